//! AVX2 group kernels of the interleaved super-block types (q4kx8, q5kx8,
//! q6kx8; layout in [`crate::quant::kx8`]), bit for bit the scalar
//! reference [`crate::kernels::scalar::gemv8_kx8`].
//!
//! Lane = row, as the q4_1x8 kernels of `avx2.rs`: a 32-byte run of a
//! sub-block's nibbles is four codes of each of the eight rows (low
//! nibbles codes `4r..4r+4`, high nibbles `16+4r..`); q5k's fifth bits and
//! q6k's top bits come from the rows' words (one 32-byte load per sub-block,
//! two for q6k) by one shift and mask per run. Against four activation
//! bytes broadcast to every lane, `maddubs` + `madd` (or AVX-VNNI's
//! `vpdpbusd`) sums each row's products in its own lane: codes are below
//! 64, so no pair sum saturates, and the 16-bit partial sums are widened
//! before they could (every four runs for q4k: 8 · 2 · 15 · 127 = 30480;
//! every two for q5k: 4 · 2 · 31 · 127 = 31496; every run for q6k:
//! 2 · 2 · 63 · 127 = 32004). The integers are exact either way.
//!
//! Per column the eight rows' `d` (and `dmin`) convert with one `vcvtph2ps`;
//! per sub-block the eight rows' scales widen from one 8-byte load (q4k,
//! q5k: the top bits from the rows' u32 words, shifted two bits per
//! sub-block), and `s = d · f32(sc)`, `o = dmin · f32(m)` are made once for
//! every token. Then per token, on the eight-row vector, the scalar order:
//! `u = d_a · f32(p)`, `t = s · u − o · (d_a · f32(Σ))`, `acc = acc + t`,
//! each a separate `vmulps` / `vsubps` / `vaddps` (no fused multiply-add),
//! so every lane is the scalar row's bits; one to four tokens share each
//! weight load and run the same lane arithmetic, so prefill and decode
//! agree. q6k keeps the two halves' sums apart (a run's low nibbles are
//! codes 0..16, its high ones 16..32), takes each token's `Σ₀` from a `psadbw`
//! of its first 16 bytes, and makes `n = sc₀ · (p₀ − 32·Σ₀) + sc₁ · (p₁ −
//! 32·Σ₁)` exactly in f32 (the two 8-byte scale loads of the sub-block;
//! see [`q6k_sums`]), then `u = d_a · f32(n)` and `t = d · u`.
//!
//! The whole body of each `unsafe fn` here is the unsafe operation (raw
//! loads and AVX2 / F16C intrinsics), justified by its `# Safety` section;
//! the public kernels check the group and activation lengths themselves.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::pack::{PACKED, Packed, ROWS, TileBlock};
use super::pairs::pair_sums;
use super::prim::{
    AVX_VNNI, MADD, Q4K, Q5K, Q6K, ZMM_VNNI, act4, extra_words, in_passes, kind_of, prefetch_ahead, prefetch_by,
    store8, stream_ahead, vpdpbusd,
};
use crate::kernels::GEMM8_TOKENS;
use crate::quant::act::BlockQ8;
use crate::quant::kquant::{self, QK, SUBS};
use crate::quant::kx8;
use crate::quant::x8::ROWS as GROUP;

/// Runs of 16-bit partial sums (`maddubs` pairs) summed before widening to
/// 32 bits, within the bound of the module docs.
const fn widen_every(k: u8) -> usize {
    match k {
        Q4K => 4,
        Q5K => 2,
        _ => 1,
    }
}

/// `v` shifted left by `by` bits per 32-bit lane (right for negative `by`);
/// `by` is a constant once the run loop is unrolled.
#[inline(always)]
unsafe fn shift(v: __m256i, by: i32) -> __m256i {
    match by {
        4 => _mm256_slli_epi32::<4>(v),
        3 => _mm256_slli_epi32::<3>(v),
        2 => _mm256_slli_epi32::<2>(v),
        1 => _mm256_slli_epi32::<1>(v),
        0 => v,
        -1 => _mm256_srli_epi32::<1>(v),
        -2 => _mm256_srli_epi32::<2>(v),
        _ => _mm256_srli_epi32::<3>(v),
    }
}

/// Run `r`'s codes of one sub-block of eight rows: (codes `4r..4r+4`,
/// codes `16+4r..16+4r+4`) of every row, a row per 32-bit lane. `e0`, `e1`
/// are the sub-block's extra-bit words (q5k: the fifth bits; q6k: the top
/// bits of codes 0..16 and 16..32).
#[inline(always)]
unsafe fn run_codes<const K: u8>(sub: *const u8, r: usize, e0: __m256i, e1: __m256i) -> (__m256i, __m256i) {
    let raw = _mm256_loadu_si256(sub.add(32 * r) as *const __m256i);
    let nib = _mm256_set1_epi8(0x0F);
    let lo = _mm256_and_si256(raw, nib);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nib);
    let r = r as i32;
    match K {
        // Bit r of each byte completes the low nibble, bit 4 + r the high one.
        Q5K => {
            let bit4 = _mm256_set1_epi8(0x10);
            let lo5 = _mm256_and_si256(shift(e0, 4 - r), bit4);
            let hi5 = _mm256_and_si256(shift(e0, -r), bit4);
            (_mm256_or_si256(lo, lo5), _mm256_or_si256(hi, hi5))
        }
        // Bits 2r, 2r+1 of each byte are bits 4-5 of the code.
        Q6K => {
            let bits45 = _mm256_set1_epi8(0x30);
            let lo6 = _mm256_and_si256(shift(e0, 4 - 2 * r), bits45);
            let hi6 = _mm256_and_si256(shift(e1, 4 - 2 * r), bits45);
            (_mm256_or_si256(lo, lo6), _mm256_or_si256(hi, hi6))
        }
        _ => (lo, hi),
    }
}

/// `Σ c · q` of one sub-block of eight rows against each token's activation
/// block, per lane (row), exact (q4k, q5k).
#[inline(always)]
unsafe fn code_sums<const T: usize, const VNNI: u8, const K: u8>(sub: *const u8, ba: [&BlockQ8; T]) -> [__m256i; T] {
    if VNNI == ZMM_VNNI {
        return pair_sums::<T, K, false>(sub, ba).0;
    }
    let (e0, e1) = extra_words::<K>(sub);
    let ones = _mm256_set1_epi16(1);
    let mut s32 = [_mm256_setzero_si256(); T];
    let mut s16 = [_mm256_setzero_si256(); T];
    for r in 0..4 {
        let (lo, hi) = run_codes::<K>(sub, r, e0, e1);
        for t in 0..T {
            let (alo, ahi) = (act4(ba[t], 4 * r), act4(ba[t], 16 + 4 * r));
            if VNNI != MADD {
                s32[t] = vpdpbusd::<VNNI>(vpdpbusd::<VNNI>(s32[t], lo, alo), hi, ahi);
            } else {
                let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi));
                s16[t] = _mm256_add_epi16(s16[t], p);
                if (r + 1) % widen_every(K) == 0 {
                    s32[t] = _mm256_add_epi32(s32[t], _mm256_madd_epi16(s16[t], ones));
                    s16[t] = _mm256_setzero_si256();
                }
            }
        }
    }
    s32
}

/// `32 · Σ₀` and `32 · Σ₁` of an activation block (`Σ₀` over its first 16
/// codes, `Σ₁` over the rest), each in every lane: from [`half_sum32`].
#[inline(always)]
unsafe fn half_sums32(b: &BlockQ8) -> (__m256i, __m256i) {
    let low = _mm256_broadcastd_epi32(half_sum32(b));
    (low, _mm256_sub_epi32(_mm256_set1_epi32(32 * b.sum), low))
}

/// `32 · Σ₀` of an activation block (over its first 16 codes) in the low
/// lane: a `psadbw` of the codes made unsigned (each half's sum plus
/// 16 · 128), kept in the vector unit.
#[inline(always)]
pub(super) unsafe fn half_sum32(b: &BlockQ8) -> __m128i {
    let v = _mm_xor_si128(_mm_loadu_si128(b.qs.as_ptr() as *const __m128i), _mm_set1_epi8(-128));
    let s = _mm_sad_epu8(v, _mm_setzero_si128());
    let low = _mm_sub_epi32(_mm_add_epi32(s, _mm_unpackhi_epi64(s, s)), _mm_set1_epi32(16 * 128));
    _mm_slli_epi32::<5>(low)
}

/// One q6k sub-block of eight rows against each token's activation block:
/// per lane (row) `f32(n)`, `n = sc₀ · (p₀ − 32·Σ₀) + sc₁ · (p₁ − 32·Σ₁)`,
/// with `sc0`, `sc1` the rows' two scales of the sub-block as f32. Taken in
/// f32 (a multiply and a fused multiply-add where two `vpmulld` would do:
/// the same speed on Zen 5, and `vpmulld` is two uops on Intel cores) and
/// still exact: `|p − 32·Σ| ≤ 16 · 32 · 127` and `|sc| ≤ 128`, so each
/// product, and their sum, is an integer below 2²⁴, which f32 holds and
/// neither operation rounds.
#[inline(always)]
unsafe fn q6k_sums<const T: usize, const VNNI: u8>(
    sub: *const u8,
    sc0: __m256,
    sc1: __m256,
    ba: [&BlockQ8; T],
) -> [__m256; T] {
    let (s0, s1) = if VNNI == ZMM_VNNI { pair_sums::<T, Q6K, true>(sub, ba) } else { q6k_run_sums::<T, VNNI>(sub, ba) };
    // A loop, not `array::from_fn` (see `pairs::pair_sums`).
    let mut n = [_mm256_setzero_ps(); T];
    for t in 0..T {
        let (h0, h1) = half_sums32(ba[t]);
        let (c0, c1) = (_mm256_sub_epi32(s0[t], h0), _mm256_sub_epi32(s1[t], h1));
        n[t] = _mm256_fmadd_ps(sc1, _mm256_cvtepi32_ps(c1), _mm256_mul_ps(sc0, _mm256_cvtepi32_ps(c0)));
    }
    n
}

/// q6k's `p₀` and `p₁` of one sub-block of eight rows, per token, run by run.
#[inline(always)]
unsafe fn q6k_run_sums<const T: usize, const VNNI: u8>(
    sub: *const u8,
    ba: [&BlockQ8; T],
) -> ([__m256i; T], [__m256i; T]) {
    let (e0, e1) = extra_words::<Q6K>(sub);
    let ones = _mm256_set1_epi16(1);
    let mut s0 = [_mm256_setzero_si256(); T];
    let mut s1 = [_mm256_setzero_si256(); T];
    for r in 0..4 {
        let (lo, hi) = run_codes::<Q6K>(sub, r, e0, e1);
        for t in 0..T {
            let (alo, ahi) = (act4(ba[t], 4 * r), act4(ba[t], 16 + 4 * r));
            if VNNI != MADD {
                s0[t] = vpdpbusd::<VNNI>(s0[t], lo, alo);
                s1[t] = vpdpbusd::<VNNI>(s1[t], hi, ahi);
            } else {
                // A pair is at most 2 · 63 · 127: widened every run.
                s0[t] = _mm256_add_epi32(s0[t], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, alo), ones));
                s1[t] = _mm256_add_epi32(s1[t], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, ahi), ones));
            }
        }
    }
    (s0, s1)
}

/// A column's eight `d` (and `dmin`) as f32, and the rows' words of the
/// scales' top bits, walked sub-block by sub-block.
struct Head<const K: u8> {
    d: __m256,
    dmin: __m256,
    /// Bits 2j, 2j+1 of each row's word (the scale's top bits) at bits 4-5
    /// for the next sub-block j.
    tsc: __m256i,
    /// Bits 16+2j, 17+2j (the minimum's) at bits 4-5.
    tm: __m256i,
}

impl<const K: u8> Head<K> {
    /// The headers of the column at `col`.
    #[inline(always)]
    unsafe fn load(col: *const u8) -> Head<K> {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(col as *const __m128i));
        match K {
            Q6K => Head { d, dmin: _mm256_setzero_ps(), tsc: _mm256_setzero_si256(), tm: _mm256_setzero_si256() },
            _ => {
                let top = _mm256_loadu_si256(col.add(96) as *const __m256i);
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(col.add(16) as *const __m128i));
                Head { d, dmin, tsc: _mm256_slli_epi32::<4>(top), tm: _mm256_srli_epi32::<12>(top) }
            }
        }
    }

    /// q6k: the eight rows' two scales of sub-block `j`, as f32 lanes.
    #[inline(always)]
    unsafe fn q6k_scales(col: *const u8, j: usize) -> (__m256, __m256) {
        let sc = |at: usize| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(col.add(at) as *const __m128i)));
        (sc(16 + 16 * j), sc(24 + 16 * j))
    }

    /// The eight rows' `s = d · sc` and `o = dmin · m` of sub-block `j`
    /// (called for j = 0, 1, ... in order; q4k, q5k).
    #[inline(always)]
    unsafe fn next(&mut self, col: *const u8, j: usize) -> (__m256, __m256) {
        match K {
            Q6K => unreachable!("q6k has two scales per sub-block: q6k_scales"),
            _ => {
                let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(col.add(32 + 8 * j) as *const __m128i));
                let bits45 = _mm256_set1_epi32(0x30);
                let sc =
                    _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)), _mm256_and_si256(self.tsc, bits45));
                let m = _mm256_or_si256(_mm256_srli_epi32::<4>(b), _mm256_and_si256(self.tm, bits45));
                (self.tsc, self.tm) = (_mm256_srli_epi32::<2>(self.tsc), _mm256_srli_epi32::<2>(self.tm));
                (_mm256_mul_ps(self.d, _mm256_cvtepi32_ps(sc)), _mm256_mul_ps(self.dmin, _mm256_cvtepi32_ps(m)))
            }
        }
    }
}

/// One group of `nsub` sub-blocks per row (`g`, exactly that long) against
/// `T` tokens (`q[t]`, at least `nsub` blocks each): the eight rows' sums
/// per token.
#[inline(always)]
unsafe fn gemm8<const T: usize, const VNNI: u8, const K: u8>(
    g: *const u8,
    nsub: usize,
    q: [*const BlockQ8; T],
) -> [__m256; T] {
    let kind = kind_of(K);
    let (hb, sb, cb) = (kx8::header_bytes(kind), kx8::sub_bytes(kind), kx8::column_bytes(kind));
    let ahead = stream_ahead::<T>(K == Q4K);
    let mut acc = [_mm256_setzero_ps(); T];
    let (mut first, mut col) = (0, g);
    while first < nsub {
        let subs = (nsub - first).min(SUBS);
        prefetch_by(col, ahead, hb);
        let mut head = Head::<K>::load(col);
        for j in 0..subs {
            let sub = col.add(hb + j * sb);
            prefetch_by(sub, ahead, sb);
            let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q[t].add(first + j));
            if K == Q6K {
                let (sc0, sc1) = Head::<K>::q6k_scales(col, j);
                let n = q6k_sums::<T, VNNI>(sub, sc0, sc1, ba);
                for t in 0..T {
                    let u = _mm256_mul_ps(_mm256_set1_ps(ba[t].d), n[t]);
                    acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(head.d, u));
                }
                continue;
            }
            let (s, o) = head.next(col, j);
            let sums = code_sums::<T, VNNI, K>(sub, ba);
            for t in 0..T {
                let u = _mm256_mul_ps(_mm256_set1_ps(ba[t].d), _mm256_cvtepi32_ps(sums[t]));
                let term = _mm256_sub_ps(_mm256_mul_ps(s, u), _mm256_mul_ps(o, _mm256_set1_ps(ba[t].scaled_sum())));
                acc[t] = _mm256_add_ps(acc[t], term);
            }
        }
        first += subs;
        col = col.add(cb);
    }
    acc
}

/// Sub-blocks per row of a group of `K` of `len` bytes, checked against
/// `qlen` activation blocks: the lengths every kernel here relies on.
fn sub_blocks<const K: u8>(len: usize, qlen: usize) -> usize {
    let n = kx8::row_len(kind_of(K), len).expect("whole groups of eight super-block rows");
    assert!(qlen * QK >= n, "{:?}: {qlen} activation blocks for rows of {n}", kind_of(K));
    n / QK
}

macro_rules! kx8_kernels {
    ($one:ident, $many:ident, $k:ident, $vnni:ident, $features:literal, [$($t:literal)+]) => {
        /// # Safety
        /// The CPU must have the target features this function enables
        /// (the lengths are checked here).
        #[target_feature(enable = $features)]
        pub unsafe fn $one(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
            let nsub = sub_blocks::<$k>(group.len(), q.len());
            let [acc] = gemm8::<1, $vnni, $k>(group.as_ptr(), nsub, [q.as_ptr()]);
            store8(acc)
        }

        /// # Safety
        /// As the one-token kernel, with 1 to [`GEMM8_TOKENS`] tokens (`out`
        /// as long as `q`).
        #[target_feature(enable = $features)]
        pub unsafe fn $many(group: &[u8], q: &[&[BlockQ8]], out: &mut [[f32; 8]]) {
            let shortest = q.iter().map(|r| r.len()).min().unwrap_or(0);
            let nsub = sub_blocks::<$k>(group.len(), shortest);
            let g = group.as_ptr();
            in_passes!(q, out, [$($t)+], gemm8::<_, $vnni, $k>(g, nsub));
        }
    };
}

// Four tokens per pass over the weights: at eight the per-token state
// spills, and one pass ran slower than two (docs/design/kernels.md).
kx8_kernels!(gemv8_q4k, gemm8xn_q4k, Q4K, MADD, "avx2,fma,f16c", [1 2 3 4]);
kx8_kernels!(gemv8_q5k, gemm8xn_q5k, Q5K, MADD, "avx2,fma,f16c", [1 2 3 4]);
kx8_kernels!(gemv8_q6k, gemm8xn_q6k, Q6K, MADD, "avx2,fma,f16c", [1 2 3 4]);

// With AVX-VNNI's `vpdpbusd` for the integer sums: the same integers, so
// the same bits.
kx8_kernels!(vnni_gemv8_q4k, vnni_gemm8xn_q4k, Q4K, AVX_VNNI, "avx2,fma,f16c,avxvnni", [1 2 3 4]);
kx8_kernels!(vnni_gemv8_q5k, vnni_gemm8xn_q5k, Q5K, AVX_VNNI, "avx2,fma,f16c,avxvnni", [1 2 3 4]);
kx8_kernels!(vnni_gemv8_q6k, vnni_gemm8xn_q6k, Q6K, AVX_VNNI, "avx2,fma,f16c,avxvnni", [1 2 3 4]);

// With 512-bit `vpdpbusd` over pairs of runs ([`ZMM_VNNI`]): the same
// integers once more.
kx8_kernels!(zmm_gemv8_q4k, zmm_gemm8xn_q4k, Q4K, ZMM_VNNI, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", [1 2 3 4]);
kx8_kernels!(zmm_gemv8_q5k, zmm_gemm8xn_q5k, Q5K, ZMM_VNNI, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", [1 2 3 4]);
kx8_kernels!(zmm_gemv8_q6k, zmm_gemm8xn_q6k, Q6K, ZMM_VNNI, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", [1 2 3 4]);

// ------------------------------------------------------------------
// The 16-row kernels' side (`pack.rs`, `avx512.rs`, `amx.rs`).

/// The super-block types as the 16-row kernels take them: for the tiles
/// (q4k, q5k) each sub-block one block column, its codes as signed bytes,
/// its `s = d · sc` and `o = dmin · m` as the column's scales and minimums.
/// q6k has two scales per sub-block, which one scale per row and block
/// column cannot hold: it has no tiles, and only the direct kernel
/// (`avx512::direct16`, which reads the groups as they are) takes it.
pub struct KTile<const K: u8>;
/// q4kx8 for the 16-row kernels.
pub type Q4KTile = KTile<Q4K>;
/// q5kx8 for the 16-row kernels.
pub type Q5KTile = KTile<Q5K>;
/// q6kx8 for the direct 16-row kernel (no tiles: see [`KTile`]).
pub type Q6KTile = KTile<Q6K>;

impl<const K: u8> TileBlock for KTile<K> {
    const MINS: bool = true;

    fn group_bytes(nb: usize) -> usize {
        GROUP * kquant::row_bytes(kind_of(K), nb * QK).expect("whole sub-blocks")
    }

    #[inline(always)]
    unsafe fn pack(p: &mut Packed, groups: &[u8], nb: usize) {
        const { assert!(K != Q6K, "q6k has no tiles (two scales per sub-block)") };
        let kind = kind_of(K);
        let n = nb * QK;
        let gb = Self::group_bytes(nb);
        let ng = groups.len() / gb;
        let (hb, sb) = (kx8::header_bytes(kind), kx8::sub_bytes(kind));
        p.reserve(nb);
        for h in 0..ng {
            let g = groups.as_ptr().add(h * gb);
            for (c, (start, subs)) in kx8::columns(kind, n).enumerate() {
                let col = g.add(start);
                prefetch_ahead(col, hb + subs * sb);
                let mut head = Head::<K>::load(col);
                for j in 0..subs {
                    let b = c * SUBS + j;
                    let sub = col.add(hb + j * sb);
                    let (s, o) = head.next(col, j);
                    let at = ROWS * b + GROUP * h;
                    _mm256_storeu_ps(p.scales.as_mut_ptr().add(at), s);
                    _mm256_storeu_ps(p.mins.as_mut_ptr().add(at), o);
                    let (e0, e1) = extra_words::<K>(sub);
                    let w = p.w.as_mut_ptr().add(b * PACKED + 32 * h);
                    for r in 0..4 {
                        // Run r is B rows r (codes 4r..4r+4) and 4 + r
                        // (codes 16+4r..): four weights of each row per lane.
                        let (lo, hi) = run_codes::<K>(sub, r, e0, e1);
                        _mm256_storeu_si256(w.add(64 * r) as *mut __m256i, lo);
                        _mm256_storeu_si256(w.add(64 * (4 + r)) as *mut __m256i, hi);
                    }
                }
            }
        }
        if ng == 1 {
            (0..nb).for_each(|b| p.zero(b, 1));
        }
    }

    /// `acc + (s · (da · f32(isum)) − o · (da · Σa))`, each operation rounded
    /// on its own, as [`gemm8`].
    #[inline(always)]
    unsafe fn scale_token(acc: __m512, (s, o): (__m512, __m512), ba: &BlockQ8, isum: __m512i) -> __m512 {
        let u = _mm512_mul_ps(_mm512_set1_ps(ba.d), _mm512_cvtepi32_ps(isum));
        let term = _mm512_sub_ps(_mm512_mul_ps(s, u), _mm512_mul_ps(o, _mm512_set1_ps(ba.scaled_sum())));
        _mm512_add_ps(acc, term)
    }
}
