//! AMX int8 tiles for prefill: sixteen weight rows (two interleaved groups)
//! against sixteen tokens per `tdpbssd`, one 32-value block column at a time.
//!
//! A block type scales every 32 values by its own factor, so the tile unit
//! sums one block column (K = 32) into a fresh 16 × 16 i32 tile, which goes
//! to memory and is scaled into f32 accumulators with AVX-512: per token and
//! row `acc = fma(dw · da, isum, acc)`, the same operations in the same order
//! as the AVX2 group kernels, and the integer sums are exact, so the tiles
//! give the AVX2/AVX-VNNI tables' bits (tested) and prefill on tiles agrees
//! with decode on vectors.
//!
//! Weights are repacked once per call into the tile unit's B layout: for
//! every block column, eight 64-byte rows, row `k` holding weights
//! `4k..4k+4` of each of the sixteen rows (the interleaved groups already
//! hold them so, eight rows at a time; 4-bit codes are widened to bytes).
//! The activations are read as tiles straight from the quantised input rows
//! (`BlockQ8.qs`, one token per tile row, the row stride apart).
//!
//! Using tiles needs the kernel's permission (`arch_prctl`) and a CPU that
//! really runs them: [`usable`] asks for the permission, then runs a small
//! product in a forked child, so a VM that advertises AMX but faults costs a
//! child process, not this one.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::asm;
use std::arch::x86_64::*;

use super::pack::{self, PACK, PACKED, Packed, ROWS, TileBlock};
use crate::quant::act::BlockQ8;

/// Tokens per tile (the rows of an A tile).
pub const TOKENS: usize = 16;

/// Fewest tokens a last partial tile runs on tiles (on a zero-padded copy
/// of their rows, costing what a whole tile does); fewer go to the AVX-512
/// VNNI kernel on the same packed weights. On the Xeon here (one thread,
/// `examples/kernel_speed.rs N`, all four types) a rest of 10 tokens on
/// VNNI beat a padded tile (26 tokens: 0.16-0.19 against 0.18-0.23 ns per
/// 32 weights and token), 14 was level within the noise.
pub const PAD_MIN: usize = 14;

/// The tile configuration `ldtilecfg` reads (palette 1).
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<Config>() == 64);

impl Config {
    /// Two sets of three tiles, for alternate block columns: tmm0 / tmm3,
    /// A, 16 tokens × 32 activation bytes; tmm1 / tmm4, B, 8 rows of 64
    /// bytes; tmm2 / tmm5, C, 16 tokens × 16 rows of i32.
    const fn tiles() -> Config {
        let mut c = Config { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        let mut set = 0;
        while set < 2 {
            let (a, b, s) = (3 * set, 3 * set + 1, 3 * set + 2);
            c.colsb[a] = 32;
            c.rows[a] = TOKENS as u8;
            c.colsb[b] = 64;
            c.rows[b] = 8;
            c.colsb[s] = 64;
            c.rows[s] = TOKENS as u8;
            set += 1;
        }
        c
    }
}

/// One or two interleaved groups (`groups`, whole groups of `B`) against
/// `tokens` tokens whose quantised rows are `q` (`[tokens, nb]`):
/// `out[t · 16 + r]` for token `t`, row `r` of the groups (rows past the
/// groups come out zero). A last partial tile of [`PAD_MIN`] tokens or more
/// runs on a zero-padded copy of their rows; a shorter one on AVX-512 VNNI.
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512BW, AVX-512VNNI, AVX2, FMA and F16C,
/// AMX-TILE and AMX-INT8, and this process the kernel's permission to use
/// tiles ([`usable`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn tiles<B: TileBlock>(groups: &[u8], q: &[BlockQ8], tokens: usize, out: &mut [f32]) {
    let nb = pack::check::<B>(groups, q, tokens, out);
    PACK.with_borrow_mut(|p| {
        pack::pack::<B>(p, groups, nb);
        let cfg = Config::tiles();
        asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly));
        let whole = tokens / TOKENS * TOKENS;
        for (c, qc) in q[..whole * nb].chunks_exact(TOKENS * nb).enumerate() {
            let acc = tile::<B>(p, qc.as_ptr(), nb);
            for (t, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add((c * TOKENS + t) * ROWS), *acc);
            }
        }
        let rest = tokens - whole;
        if rest > 0 && rest < PAD_MIN {
            super::avx512::packed::<B>(p, q[whole * nb..].as_ptr(), nb, rest, out.as_mut_ptr().add(whole * ROWS));
        } else if rest > 0 {
            p.pad.clear();
            p.pad.extend_from_slice(&q[whole * nb..]);
            p.pad.resize(TOKENS * nb, BlockQ8::default());
            let acc = tile::<B>(p, p.pad.as_ptr(), nb);
            for (t, acc) in acc[..rest].iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add((whole + t) * ROWS), *acc);
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    });
}

/// Issues block column `b` into tile set 0 or 1 (`tilezero`, the two
/// loads, `tdpbssd`): `tile` starts the next block before it stores and
/// scales this one, so the tile unit runs ahead of the vector unit.
macro_rules! issue {
    ($set0:literal, $a:expr, $sa:expr, $w:expr) => {
        if $set0 {
            asm!(
                "tilezero tmm2",
                "tileloadd tmm0, [{a} + {sa} * 1]",
                "tileloadd tmm1, [{w} + {s64} * 1]",
                "tdpbssd tmm2, tmm0, tmm1",
                a = in(reg) $a, sa = in(reg) $sa, w = in(reg) $w, s64 = in(reg) 64usize,
                options(nostack, readonly),
            )
        } else {
            asm!(
                "tilezero tmm5",
                "tileloadd tmm3, [{a} + {sa} * 1]",
                "tileloadd tmm4, [{w} + {s64} * 1]",
                "tdpbssd tmm5, tmm3, tmm4",
                a = in(reg) $a, sa = in(reg) $sa, w = in(reg) $w, s64 = in(reg) 64usize,
                options(nostack, readonly),
            )
        }
    };
}

/// `acc[t] += dw · da[t] · sums[t]` for block column `b` (and the
/// minimums' term), per token `t`.
#[inline(always)]
unsafe fn scale<B: TileBlock>(
    acc: &mut [__m512; TOKENS],
    p: &Packed,
    q: *const BlockQ8,
    nb: usize,
    b: usize,
    sums: *const i32,
) {
    let scales = pack::column_scales::<B>(p, b);
    let ba = q.add(b);
    // Unrolled by hand so the sixteen accumulators stay in registers.
    macro_rules! scale {
        ($($t:literal)*) => {$(
            let isum = _mm512_load_si512(sums.add(ROWS * $t) as *const __m512i);
            acc[$t] = pack::scale_token::<B>(acc[$t], scales, &*ba.add($t * nb), isum);
        )*};
    }
    scale!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
}

/// 16 tokens (`q`, `[16, nb]`) against the packed pair: the 16 × 16 f32
/// results, one register per token.
#[inline(always)]
unsafe fn tile<B: TileBlock>(p: &Packed, q: *const BlockQ8, nb: usize) -> [__m512; TOKENS] {
    /// Two buffers: the sums of block `b` go to `b % 2` and are scaled one
    /// block later, so the vector loads never wait on fresh tile stores.
    #[repr(C, align(64))]
    struct Sums([[i32; TOKENS * ROWS]; 2]);
    let mut c = Sums([[0; TOKENS * ROWS]; 2]);
    let sa = nb * std::mem::size_of::<BlockQ8>();
    let a = |b: usize| (q.add(b) as *const u8).add(std::mem::offset_of!(BlockQ8, qs));
    let w = |b: usize| p.w.as_ptr().add(b * PACKED);
    let mut acc = [_mm512_setzero_ps(); TOKENS];
    issue!(true, a(0), sa, w(0));
    for b in 0..nb {
        let even = b % 2 == 0;
        match (even, b + 1 < nb) {
            (true, true) => issue!(false, a(b + 1), sa, w(b + 1)),
            (false, true) => issue!(true, a(b + 1), sa, w(b + 1)),
            _ => {}
        }
        let cp = c.0[b % 2].as_mut_ptr();
        if even {
            asm!("tilestored [{c} + {s64} * 1], tmm2", c = in(reg) cp, s64 = in(reg) 64usize, options(nostack));
        } else {
            asm!("tilestored [{c} + {s64} * 1], tmm5", c = in(reg) cp, s64 = in(reg) 64usize, options(nostack));
        }
        if b > 0 {
            scale::<B>(&mut acc, p, q, nb, b - 1, c.0[(b - 1) % 2].as_ptr());
        }
    }
    scale::<B>(&mut acc, p, q, nb, nb - 1, c.0[(nb - 1) % 2].as_ptr());
    acc
}

/// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (EDX bit 25).
fn cpu_has_amx_int8() -> bool {
    #[allow(unused_unsafe)]
    // SAFETY: CPUID leaf 7 exists on every x86_64 CPU that has AVX2, which
    // the callers have checked first.
    let r = unsafe { __cpuid_count(7, 0) };
    r.edx & (1 << 24) != 0 && r.edx & (1 << 25) != 0
}

/// Whether this process can use int8 tiles: the CPU says so, the kernel
/// grants the tile state, and a forked child multiplies a test tile without
/// faulting and gets the right sums. Decided once.
pub fn usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| cpu_has_amx_int8() && os::permit() && os::probe_in_child())
}

/// A 16 × 32 by 32 × 16 product on tiles, checked against the integers.
///
/// # Safety
/// The CPU must have AMX-TILE and AMX-INT8 and the process the permission
/// to use them; otherwise this faults (which is why it runs in a child).
#[cfg(target_os = "linux")]
unsafe fn probe() -> bool {
    let a: [i8; 16 * 32] = std::array::from_fn(|i| (i % 23) as i8 - 11);
    let b: [i8; 8 * 64] = std::array::from_fn(|i| (i % 19) as i8 - 9);
    let mut c = [0i32; 16 * 16];
    let cfg = Config::tiles();
    asm!(
        "ldtilecfg [{cfg}]",
        "tilezero tmm2",
        "tileloadd tmm0, [{a} + {s32} * 1]",
        "tileloadd tmm1, [{b} + {s64} * 1]",
        "tdpbssd tmm2, tmm0, tmm1",
        "tilestored [{c} + {s64} * 1], tmm2",
        "tilerelease",
        cfg = in(reg) &cfg,
        a = in(reg) a.as_ptr(),
        b = in(reg) b.as_ptr(),
        c = in(reg) c.as_mut_ptr(),
        s32 = in(reg) 32usize,
        s64 = in(reg) 64usize,
        options(nostack),
    );
    (0..16).all(|m| {
        (0..16).all(|n| {
            let want: i32 = (0..32).map(|k| a[32 * m + k] as i32 * b[64 * (k / 4) + 4 * n + k % 4] as i32).sum();
            c[16 * m + n] == want
        })
    })
}

#[cfg(target_os = "linux")]
mod os {
    /// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: asks Linux for
    /// the tile data state (process-wide, inherited by forks).
    pub fn permit() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain system call with integer arguments; it only
        // changes which register state this process may use.
        unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
    }

    /// Runs [`super::probe`] in a forked child and waits for it (at most
    /// five seconds): true only if it exited cleanly with the right sums.
    pub fn probe_in_child() -> bool {
        // SAFETY: the child runs only `probe` (stack memory, no locks, no
        // allocation: safe after fork in a multi-threaded process) and
        // `_exit`, which skips every exit handler of the parent's state.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: as above; a fault here ends the child only.
            let ok = unsafe { super::probe() };
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        if pid < 0 {
            return false;
        }
        let mut status = 0;
        for _ in 0..500 {
            // SAFETY: waits for our own child; `status` is a valid out pointer.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                return libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
            }
            if r < 0 {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // SAFETY: our own child, hung: end it and reap it.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, &mut status, 0);
        }
        false
    }
}

#[cfg(not(target_os = "linux"))]
mod os {
    //! Tiles are used on Linux only (where the tile state is granted by
    //! `arch_prctl`); elsewhere the AVX-VNNI table serves.
    pub fn permit() -> bool {
        false
    }
    pub fn probe_in_child() -> bool {
        false
    }
}
