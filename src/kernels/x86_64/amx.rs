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
use std::cell::RefCell;

use crate::kernels::BlockQ8;
use crate::quant::mxfp4::{LUT2, half_scale};
use crate::quant::x8::{BlockMxfp4x8, BlockQ4_0x8, BlockQ4_1x8, BlockQ8_0x8, ROWS as GROUP};

/// Tokens per tile (the rows of an A tile).
pub const TOKENS: usize = 16;
/// Weight rows per tile: two groups, the sixteen i32 columns of a C tile.
pub const ROWS: usize = 2 * GROUP;
/// Bytes of one packed block column: 32 weights of each of the 16 rows.
const PACKED: usize = 32 * ROWS;

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
    /// tmm0: A, 16 tokens × 32 activation bytes; tmm1: B, 8 rows of 64
    /// bytes; tmm2: C, 16 tokens × 16 rows of i32.
    const fn tiles() -> Config {
        let mut c = Config { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        c.colsb[0] = 32;
        c.rows[0] = TOKENS as u8;
        c.colsb[1] = 64;
        c.rows[1] = 8;
        c.colsb[2] = 64;
        c.rows[2] = TOKENS as u8;
        c
    }
}

/// One call's weights in the B layout, with their scales (and minimums) as
/// f32: per block column `w[512 b..]`, `scales[16 b..]`, `mins[16 b..]`.
#[derive(Default)]
pub struct Packed {
    w: Vec<i8>,
    scales: Vec<f32>,
    mins: Vec<f32>,
}

impl Packed {
    fn reset(&mut self, nb: usize, mins: bool) {
        self.w.clear();
        self.w.resize(nb * PACKED, 0);
        self.scales.clear();
        self.scales.resize(nb * ROWS, 0.0);
        self.mins.clear();
        if mins {
            self.mins.resize(nb * ROWS, 0.0);
        }
    }

    /// Block column `b`, half `h` (the group): the 32 bytes of B row `k`.
    fn row(&mut self, b: usize, k: usize, h: usize) -> &mut [i8] {
        let at = b * PACKED + 64 * k + 32 * h;
        &mut self.w[at..at + 32]
    }
}

thread_local! {
    /// Per-thread repacking buffer, grown to the widest matrix seen.
    static PACK: RefCell<Packed> = RefCell::new(Packed::default());
}

fn f16s(d: &[u16; GROUP], out: &mut [f32]) {
    for (o, &d) in out.iter_mut().zip(d) {
        *o = half::f16::from_bits(d).to_f32();
    }
}

/// Widens a group block's 4-bit codes into B rows: low nibbles of run `j`
/// are weights `4j..4j+4` of each row (B row `j`), high nibbles weights
/// `16 + 4j..` (B row `4 + j`), each code through `value`.
fn unpack_codes(p: &mut Packed, b: usize, h: usize, qs: &[u8; 16 * GROUP], value: impl Fn(u8) -> i8) {
    for j in 0..4 {
        let run = &qs[32 * j..32 * j + 32];
        for (o, &c) in p.row(b, j, h).iter_mut().zip(run) {
            *o = value(c & 0xF);
        }
        for (o, &c) in p.row(b, 4 + j, h).iter_mut().zip(run) {
            *o = value(c >> 4);
        }
    }
}

/// The interleaved block types the tiles multiply.
pub trait TileBlock: bytemuck::Pod {
    /// Whether the type adds `min · Σ activations` per block (q4_1).
    const MINS: bool;
    /// Puts this group block into half `h` of packed block column `b`.
    fn pack(&self, p: &mut Packed, b: usize, h: usize);
}

impl TileBlock for BlockQ8_0x8 {
    const MINS: bool = false;
    fn pack(&self, p: &mut Packed, b: usize, h: usize) {
        for k in 0..8 {
            p.row(b, k, h).copy_from_slice(&self.qs[32 * k..32 * k + 32]);
        }
        f16s(&self.d, &mut p.scales[ROWS * b + GROUP * h..]);
    }
}

impl TileBlock for BlockQ4_0x8 {
    const MINS: bool = false;
    fn pack(&self, p: &mut Packed, b: usize, h: usize) {
        // Codes are stored +8: the tile sums Σ (c − 8)·q directly.
        unpack_codes(p, b, h, &self.qs, |c| c as i8 - 8);
        f16s(&self.d, &mut p.scales[ROWS * b + GROUP * h..]);
    }
}

impl TileBlock for BlockQ4_1x8 {
    const MINS: bool = true;
    fn pack(&self, p: &mut Packed, b: usize, h: usize) {
        unpack_codes(p, b, h, &self.qs, |c| c as i8);
        f16s(&self.d, &mut p.scales[ROWS * b + GROUP * h..]);
        f16s(&self.m, &mut p.mins[ROWS * b + GROUP * h..]);
    }
}

impl TileBlock for BlockMxfp4x8 {
    const MINS: bool = false;
    fn pack(&self, p: &mut Packed, b: usize, h: usize) {
        unpack_codes(p, b, h, &self.qs, |c| LUT2[c as usize]);
        for (o, &e) in p.scales[ROWS * b + GROUP * h..][..GROUP].iter_mut().zip(&self.e) {
            *o = half_scale(e);
        }
    }
}

/// One or two interleaved groups (`groups`, whole groups of `B`) against
/// `tokens` tokens (a multiple of [`TOKENS`]) whose quantised rows are
/// `q` (`[tokens, nb]`): `out[t · 16 + r]` for token `t`, row `r` of the
/// groups (rows past the groups come out zero).
///
/// # Safety
/// The CPU must have AVX-512F, AVX2, FMA and F16C, AMX-TILE and AMX-INT8,
/// and this process the kernel's permission to use tiles ([`usable`]).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub unsafe fn tiles<B: TileBlock>(groups: &[u8], q: &[BlockQ8], tokens: usize, out: &mut [f32]) {
    assert!(tokens > 0 && tokens.is_multiple_of(TOKENS), "tiles take whole tiles of tokens, got {tokens}");
    let nb = q.len() / tokens;
    assert_eq!(q.len(), tokens * nb, "q is not [tokens, nb]");
    let blocks: &[B] = bytemuck::cast_slice(groups);
    let ng = blocks.len() / nb.max(1);
    assert!(nb > 0 && (ng == 1 || ng == 2) && blocks.len() == ng * nb, "tiles take one or two whole groups");
    assert_eq!(out.len(), tokens * ROWS, "out is not [tokens, 16]");
    PACK.with_borrow_mut(|p| {
        p.reset(nb, B::MINS);
        for (h, g) in blocks.chunks_exact(nb).enumerate() {
            for (b, blk) in g.iter().enumerate() {
                blk.pack(p, b, h);
            }
        }
        multiply::<B>(p, q, nb, out);
    });
}

/// The tile products and the scaling, over packed weights.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn multiply<B: TileBlock>(p: &Packed, q: &[BlockQ8], nb: usize, out: &mut [f32]) {
    #[repr(C, align(64))]
    struct Sums([i32; TOKENS * ROWS]);
    let mut c = Sums([0; TOKENS * ROWS]);
    let cfg = Config::tiles();
    let a_stride = nb * std::mem::size_of::<BlockQ8>();
    let qs_at = std::mem::offset_of!(BlockQ8, qs);
    asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly));
    for (chunk, qc) in q.chunks_exact(TOKENS * nb).enumerate() {
        let mut acc = [_mm512_setzero_ps(); TOKENS];
        for b in 0..nb {
            let a = (qc.as_ptr().add(b) as *const u8).add(qs_at);
            let w = p.w.as_ptr().add(b * PACKED);
            asm!(
                "tilezero tmm2",
                "tileloadd tmm0, [{a} + {sa} * 1]",
                "tileloadd tmm1, [{w} + {s64} * 1]",
                "tdpbssd tmm2, tmm0, tmm1",
                "tilestored [{c} + {s64} * 1], tmm2",
                a = in(reg) a,
                sa = in(reg) a_stride,
                w = in(reg) w,
                s64 = in(reg) 64usize,
                c = in(reg) c.0.as_mut_ptr(),
                options(nostack),
            );
            let dw = _mm512_loadu_ps(p.scales.as_ptr().add(ROWS * b));
            let m = if B::MINS { _mm512_loadu_ps(p.mins.as_ptr().add(ROWS * b)) } else { _mm512_setzero_ps() };
            for (t, acc) in acc.iter_mut().enumerate() {
                let ba = &qc[t * nb + b];
                let isum = _mm512_cvtepi32_ps(_mm512_load_si512(c.0.as_ptr().add(ROWS * t) as *const __m512i));
                let s = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(ba.d)), isum, *acc);
                *acc = if B::MINS { _mm512_fmadd_ps(m, _mm512_set1_ps(ba.scaled_sum()), s) } else { s };
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add((chunk * TOKENS + t) * ROWS), *acc);
        }
    }
    asm!("tilerelease", options(nostack, nomem));
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
