//! AVX2 row dots of the super-block types (q4k, q5k, q6k; layouts in
//! [`crate::quant::kquant`]), bit for bit the scalar ones.
//!
//! One super-block at a time: the eight sub-blocks' integer dots `Σ c·q`
//! (codes unpacked to bytes, `maddubs` + `madd`, exact) are summed across
//! their lanes into one vector whose lane `j` is sub-block `j`, and the
//! scale arithmetic runs on that vector in the scalar kernel's order (one
//! rounding per operation, no fused multiply-add), lane `j` accumulating
//! sub-block `j` of every super-block. The lanes are added at the end in
//! the scalar tree. A partial last super-block leaves the lanes of its
//! missing sub-blocks at exactly +0 (masked), reading none of their bytes.
//!
//! The whole body of each `unsafe fn` here is the unsafe operation (raw
//! loads and AVX2 / F16C intrinsics), justified by its `# Safety` section.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::prim::{f16_to_f32, sum4_u8_i8, unpack_nibbles};
use crate::quant::act::BlockQ8;
use crate::quant::kquant::{Kind, QK, SUBS, unpack_scales};

/// Eight vectors of 8 i32 partial sums → one vector of their eight totals
/// (lane `j` = the sum of `v[j]`). Integer sums: exact in any order.
#[inline(always)]
unsafe fn totals(v: &[__m256i; SUBS]) -> __m256i {
    let s01 = _mm256_hadd_epi32(v[0], v[1]);
    let s23 = _mm256_hadd_epi32(v[2], v[3]);
    let s45 = _mm256_hadd_epi32(v[4], v[5]);
    let s67 = _mm256_hadd_epi32(v[6], v[7]);
    // [v0..v3 low halves | v0..v3 high halves], the same for v4..v7.
    let a = _mm256_hadd_epi32(s01, s23);
    let b = _mm256_hadd_epi32(s45, s67);
    _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31))
}

/// The scalar kernels' final sum of the eight lanes.
#[inline(always)]
unsafe fn reduce8(v: __m256) -> f32 {
    let mut a = [0f32; SUBS];
    _mm256_storeu_ps(a.as_mut_ptr(), v);
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// The activation blocks' scales and sums of one super-block (zero for the
/// sub-blocks a partial one lacks) and the mask of the lanes it has.
#[inline(always)]
unsafe fn activations(q: &[BlockQ8], subs: usize) -> (__m256, __m256i, __m256) {
    let (mut d, mut sum) = ([0f32; SUBS], [0i32; SUBS]);
    for j in 0..subs {
        let a = q.get_unchecked(j);
        d[j] = a.d;
        sum[j] = a.sum;
    }
    let lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(subs as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    (_mm256_loadu_ps(d.as_ptr()), _mm256_loadu_si256(sum.as_ptr() as *const __m256i), _mm256_castsi256_ps(lanes))
}

/// A q4k / q5k row: `Σ_j (d·f32(sc_j·p_j) − dmin·f32(m_j·Σ_j)) · d_j`, with
/// `codes(p)` the 32 code bytes of the sub-block at `p`.
#[inline(always)]
unsafe fn affine_row(kind: Kind, row: &[u8], q: &[BlockQ8], codes: impl Fn(*const u8) -> __m256i) -> f32 {
    let (hb, sb, bb) = (kind.header_bytes(), kind.sub_bytes(), kind.block_bytes());
    debug_assert_eq!(Some(row.len()), crate::quant::kquant::row_bytes(kind, q.len() * QK));
    let mut acc = _mm256_setzero_ps();
    let mut first = 0;
    let mut base = row.as_ptr();
    while first < q.len() {
        let subs = (q.len() - first).min(SUBS);
        let q = q.get_unchecked(first..first + subs);
        let d = f16_to_f32(u16::from_le_bytes([*base, *base.add(1)]));
        let dmin = f16_to_f32(u16::from_le_bytes([*base.add(2), *base.add(3)]));
        let (sc, m) = unpack_scales(&*(base.add(4) as *const [u8; 12]));
        let mut p = [_mm256_setzero_si256(); SUBS];
        for (j, p) in p.iter_mut().enumerate().take(subs) {
            let y = _mm256_loadu_si256(q.get_unchecked(j).qs.as_ptr() as *const __m256i);
            *p = sum4_u8_i8(codes(base.add(hb + j * sb)), y);
        }
        let (da, asum, mask) = activations(q, subs);
        let scv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.as_ptr() as *const __m128i));
        let mv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(m.as_ptr() as *const __m128i));
        let up = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_mullo_epi32(scv, totals(&p))));
        let down = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_mullo_epi32(mv, asum)));
        let t = _mm256_mul_ps(_mm256_sub_ps(up, down), da);
        acc = _mm256_add_ps(acc, _mm256_and_ps(t, mask));
        first += subs;
        base = base.add(bb);
    }
    reduce8(acc)
}

/// # Safety
/// The CPU must have AVX2, FMA and F16C; `row` must be a q4k row of
/// `q.len() · 32` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4k(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    affine_row(Kind::Q4K, row, q, |p| unpack_nibbles(p))
}

/// # Safety
/// As [`dot_q4k`], for a q5k row.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5k(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    // Bit i of the u32 after the nibbles is bit 4 of code i: broadcast it,
    // give byte i the u32's byte i / 8, test bit i % 8, keep 0x10 where set.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    affine_row(Kind::Q5K, row, q, |p| {
        let h = std::ptr::read_unaligned(p.add(16) as *const i32);
        let b = _mm256_shuffle_epi8(_mm256_set1_epi32(h), spread);
        let fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, bits), bits), _mm256_set1_epi8(0x10));
        _mm256_or_si256(unpack_nibbles(p), fifth)
    })
}

/// # Safety
/// As [`dot_q4k`], for a q6k row.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q6k(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    let kind = Kind::Q6K;
    let (hb, sb, bb) = (kind.header_bytes(), kind.sub_bytes(), kind.block_bytes());
    debug_assert_eq!(Some(row.len()), crate::quant::kquant::row_bytes(kind, q.len() * QK));
    // The 8 bytes of top bits, one copy per 64-bit lane shifted by 2k,
    // masked to 2 bits per byte and moved to bits 4-5: codes 8k..8k+8.
    let shifts = _mm256_setr_epi64x(0, 2, 4, 6);
    let three = _mm256_set1_epi8(3);
    let ones = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    let mut first = 0;
    let mut base = row.as_ptr();
    while first < q.len() {
        let subs = (q.len() - first).min(SUBS);
        let q = q.get_unchecked(first..first + subs);
        let d = f16_to_f32(u16::from_le_bytes([*base, *base.add(1)]));
        let mut p = [_mm256_setzero_si256(); SUBS];
        for (j, p) in p.iter_mut().enumerate().take(subs) {
            let s = base.add(hb + j * sb);
            let top = _mm256_srlv_epi64(_mm256_set1_epi64x(std::ptr::read_unaligned(s.add(16) as *const i64)), shifts);
            let codes = _mm256_or_si256(unpack_nibbles(s), _mm256_slli_epi16(_mm256_and_si256(top, three), 4));
            let y = _mm256_loadu_si256(q.get_unchecked(j).qs.as_ptr() as *const __m256i);
            // Per pair of values Σ (c − 32)·q = Σ c·q − 32·Σq (at most
            // 2 · 32 · 127 in magnitude: exact in i16), then each pair times
            // its half's scale (16-bit lanes 0..8 are values 0..16), summed
            // in pairs of pairs to i32: the lanes add up to the sub-block's n.
            let centred =
                _mm256_sub_epi16(_mm256_maddubs_epi16(codes, y), _mm256_slli_epi16(_mm256_maddubs_epi16(ones, y), 5));
            let sc = |h: usize| _mm_set1_epi16(*base.add(2 + 2 * j + h) as i8 as i16);
            *p = _mm256_madd_epi16(centred, _mm256_set_m128i(sc(1), sc(0)));
        }
        let (da, _, mask) = activations(q, subs);
        let t = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(totals(&p))), da);
        acc = _mm256_add_ps(acc, _mm256_and_ps(t, mask));
        first += subs;
        base = base.add(bb);
    }
    reduce8(acc)
}
