//! AVX-512 VNNI kernels for prefill: sixteen weight rows (two interleaved
//! groups, repacked once per call by `pack.rs`) against a run of tokens,
//! one 512-bit register per token holding the sixteen rows' sums.
//!
//! A packed 64-byte row is weights `4k..4k+4` of each of the sixteen rows,
//! so `vpdpbusd` against the token's four activation bytes `4k..4k+4`
//! (broadcast to every lane) adds four products to each row's lane. The
//! instruction multiplies unsigned by signed bytes: the weights are signed,
//! so they enter as `w + 128` (one `xor` per load, shared by every token)
//! and `128 · Σ a` (the activation block's `sum`) comes off the block's
//! integer sum, which is then `Σ w · a` exactly, the integer every other
//! table sums. The scaling is the AVX2 group kernels' (`fma(dw · da, isum,
//! acc)`, q4_1's `fma(m, da · Σa, ·)` after it, in that order), so these
//! kernels give the AVX2 and AVX-VNNI tables' bits, and prefill here agrees
//! with decode on the 256-bit kernels.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::pack::{self, PACK, PACKED, Packed, ROWS, TileBlock};
use crate::kernels::BlockQ8;

/// Tokens whose sums live in registers at once: 2 · 12 accumulators plus
/// the weights leave a few of the 32 registers spare.
const TOKENS: usize = 12;

/// One or two interleaved groups (`groups`, whole groups of `B`) against
/// `tokens` tokens whose quantised rows are `q` (`[tokens, nb]`):
/// `out[t · 16 + r]` for token `t`, row `r` of the groups (rows past the
/// groups come out zero).
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512BW, AVX-512VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn rows16<B: TileBlock>(groups: &[u8], q: &[BlockQ8], tokens: usize, out: &mut [f32]) {
    let nb = pack::check::<B>(groups, q, tokens, out);
    PACK.with_borrow_mut(|p| {
        pack::pack::<B>(p, groups, nb);
        // The next pair of groups follows these in the matrix: ask for it
        // while the tile computes, a share per block column, so that its
        // packing finds it in cache (past the matrix's end the addresses
        // are never read: a prefetch does not fault).
        let ahead = Ahead { at: groups.as_ptr().wrapping_add(groups.len()), per_col: groups.len().div_ceil(nb) };
        packed_ahead::<B>(p, q.as_ptr(), nb, tokens, out.as_mut_ptr(), Some(ahead));
    });
}

/// `tokens` tokens (`q`, `[tokens, nb]`) against a packed pair, into `out`
/// (`[tokens, 16]`), [`TOKENS`] at a time (the AMX tiles use it for the
/// tokens short of a whole tile).
///
/// # Safety
/// As [`rows16`]; `q` and `out` hold that many tokens.
#[inline(always)]
pub unsafe fn packed<B: TileBlock>(p: &Packed, q: *const BlockQ8, nb: usize, tokens: usize, out: *mut f32) {
    packed_ahead::<B>(p, q, nb, tokens, out, None)
}

/// Bytes to ask for while a tile computes: `per_col` of them from `at` per
/// block column.
#[derive(Clone, Copy)]
struct Ahead {
    at: *const u8,
    per_col: usize,
}

/// [`packed`], asking for `ahead`'s bytes during the first run of tokens.
#[inline(always)]
unsafe fn packed_ahead<B: TileBlock>(
    p: &Packed,
    q: *const BlockQ8,
    nb: usize,
    tokens: usize,
    out: *mut f32,
    mut ahead: Option<Ahead>,
) {
    let mut t = 0;
    while t < tokens {
        let (qt, o) = (q.add(t * nb), out.add(t * ROWS));
        let m = (tokens - t).min(TOKENS);
        let a = ahead.take();
        match m {
            12 => run::<B, 12>(p, qt, nb, o, a),
            11 => run::<B, 11>(p, qt, nb, o, a),
            10 => run::<B, 10>(p, qt, nb, o, a),
            9 => run::<B, 9>(p, qt, nb, o, a),
            8 => run::<B, 8>(p, qt, nb, o, a),
            7 => run::<B, 7>(p, qt, nb, o, a),
            6 => run::<B, 6>(p, qt, nb, o, a),
            5 => run::<B, 5>(p, qt, nb, o, a),
            4 => run::<B, 4>(p, qt, nb, o, a),
            3 => run::<B, 3>(p, qt, nb, o, a),
            2 => run::<B, 2>(p, qt, nb, o, a),
            _ => run::<B, 1>(p, qt, nb, o, a),
        }
        t += m;
    }
}

/// `T` tokens (`q`, `[T, nb]`) against the packed pair, into `out`
/// (`[T, 16]`).
#[inline(always)]
unsafe fn run<B: TileBlock, const T: usize>(
    p: &Packed,
    q: *const BlockQ8,
    nb: usize,
    out: *mut f32,
    ahead: Option<Ahead>,
) {
    let flip = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..nb {
        if let Some(a) = ahead {
            let from = a.at.wrapping_add(b * a.per_col);
            let mut off = 0;
            while off < a.per_col {
                _mm_prefetch::<_MM_HINT_T0>(from.wrapping_add(off) as *const i8);
                off += 64;
            }
        }
        let w = p.w.as_ptr().add(b * PACKED);
        let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q.add(t * nb + b));
        let mut isum = [_mm512_setzero_si512(); T];
        for k in 0..8 {
            let wk = _mm512_xor_si512(_mm512_loadu_si512(w.add(64 * k) as *const __m512i), flip);
            for t in 0..T {
                let a = _mm512_set1_epi32((ba[t].qs.as_ptr().add(4 * k) as *const i32).read_unaligned());
                isum[t] = _mm512_dpbusd_epi32(isum[t], wk, a);
            }
        }
        let scales = pack::column_scales::<B>(p, b);
        for t in 0..T {
            // Σ (w + 128)·a − 128·Σa = Σ w·a.
            let s = _mm512_sub_epi32(isum[t], _mm512_set1_epi32(128 * ba[t].sum));
            acc[t] = pack::scale_token::<B>(acc[t], scales, ba[t], s);
        }
    }
    for (t, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * ROWS), *a);
    }
}

/// Tokens whose sums one [`direct_run`] keeps in registers: 2 · 8
/// accumulators, the two code vectors and the scales leave room to spare.
const DIRECT_TOKENS: usize = 8;

/// Sixteen rows of q4_0x8 straight from the matrix, for the few tokens of a
/// batched decode step (below the tiles' `min`, where packing a pair of
/// groups costs more than it saves): the 32-byte runs of the two groups'
/// same block column are the halves of one register, so after the nibble
/// split every `vpdpbusd` takes sixteen rows against one broadcast
/// activation word, with no repack and no per-token shuffle. One or two
/// groups (`groups`), `tokens` tokens (`q`, `[tokens, nb]`), `out[t · 16 +
/// r]` (rows past the groups come out zero). The integer sums and the
/// scaling (`fma(dw · da, isum, acc)` per block, in block order) are the
/// 8-row kernels', so the bits are too.
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512BW, AVX-512VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn direct16_q4_0(groups: &[u8], q: &[BlockQ8], tokens: usize, out: &mut [f32]) {
    use crate::quant::x8::BlockQ4_0x8;
    let nb = pack::check_groups(groups, q, tokens, out, |nb| nb * std::mem::size_of::<BlockQ4_0x8>());
    let g0 = groups.as_ptr() as *const BlockQ4_0x8;
    let two = groups.len() == 2 * nb * std::mem::size_of::<BlockQ4_0x8>();
    // With one group the upper half repeats it and is cleared below.
    let g1 = if two { g0.add(nb) } else { g0 };
    let mut t = 0;
    while t < tokens {
        let (qt, o) = (q.as_ptr().add(t * nb), out.as_mut_ptr().add(t * ROWS));
        let m = (tokens - t).min(DIRECT_TOKENS);
        match m {
            8 => direct_run::<8>(g0, g1, qt, nb, o),
            7 => direct_run::<7>(g0, g1, qt, nb, o),
            6 => direct_run::<6>(g0, g1, qt, nb, o),
            5 => direct_run::<5>(g0, g1, qt, nb, o),
            4 => direct_run::<4>(g0, g1, qt, nb, o),
            3 => direct_run::<3>(g0, g1, qt, nb, o),
            2 => direct_run::<2>(g0, g1, qt, nb, o),
            _ => direct_run::<1>(g0, g1, qt, nb, o),
        }
        t += m;
    }
    if !two {
        for row in out.chunks_exact_mut(ROWS) {
            row[ROWS / 2..].fill(0.0);
        }
    }
}

/// `T` tokens (`q`, `[T, nb]`) against groups `g0` (lanes 0..8) and `g1`
/// (lanes 8..16), into `out` (`[T, 16]`).
#[inline(always)]
unsafe fn direct_run<const T: usize>(
    g0: *const crate::quant::x8::BlockQ4_0x8,
    g1: *const crate::quant::x8::BlockQ4_0x8,
    q: *const BlockQ8,
    nb: usize,
    out: *mut f32,
) {
    let nib = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..nb {
        let (b0, b1) = (&*g0.add(b), &*g1.add(b));
        super::avx2::prefetch_ahead(b0 as *const _ as *const u8, std::mem::size_of_val(b0));
        super::avx2::prefetch_ahead(b1 as *const _ as *const u8, std::mem::size_of_val(b1));
        let d = _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(b0.d.as_ptr() as *const __m128i)),
            _mm_loadu_si128(b1.d.as_ptr() as *const __m128i),
        );
        let dw = _mm512_cvtph_ps(d);
        let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q.add(t * nb + b));
        let mut isum = [_mm512_setzero_si512(); T];
        for j in 0..4 {
            let raw = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(b0.qs.as_ptr().add(32 * j) as *const __m256i)),
                _mm256_loadu_si256(b1.qs.as_ptr().add(32 * j) as *const __m256i),
            );
            // Low nibbles: columns 4j..4j+4 of each row; high: 16+4j.. .
            let lo = _mm512_and_si512(raw, nib);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib);
            for t in 0..T {
                let a = ba[t].qs.as_ptr();
                let alo = _mm512_set1_epi32((a.add(4 * j) as *const i32).read_unaligned());
                let ahi = _mm512_set1_epi32((a.add(16 + 4 * j) as *const i32).read_unaligned());
                isum[t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[t], lo, alo), hi, ahi);
            }
        }
        for t in 0..T {
            // Codes are stored +8: Σ (c − 8)·a = Σ c·a − 8·Σa.
            let s = _mm512_sub_epi32(isum[t], _mm512_set1_epi32(8 * ba[t].sum));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(ba[t].d)), _mm512_cvtepi32_ps(s), acc[t]);
        }
    }
    for (t, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * ROWS), *a);
    }
}
