//! The 8-row group kernels' integer sums on 512-bit registers, for CPUs
//! with AVX-512 VNNI: two 32-byte runs of a group block (each four codes of
//! each of the eight rows, a row per 32-bit lane) are one 64-byte load, the
//! lower half of the register the first run and the upper half the second.
//! Decoding the codes and the multiply-adds then take half the instructions
//! of the 256-bit forms, and the halves add up once per block. The
//! activation bytes of the two runs reach their halves by one `vpermd` of
//! the token's block. The integers are the ones every other table sums, so
//! the kernels built on these give the same bits (tested against the AVX2
//! kernels in `x86_64::tests` and against scalar by the table sweeps).
//!
//! The whole body of each `unsafe fn` here is the unsafe operation (raw
//! loads and AVX-512 intrinsics); callers are `#[target_feature]` kernels
//! that enable AVX-512F/BW/VL/VNNI and check their lengths.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::prim::{Q5K, Q6K, extra_words};
use crate::quant::act::BlockQ8;

/// `v` shifted per 32-bit lane by `lo` bits in the lower half and `hi` in
/// the upper one (left for positive counts, right for negative ones; the
/// two never differ in sign here).
#[inline(always)]
unsafe fn shift_pair(v: __m512i, lo: i32, hi: i32) -> __m512i {
    debug_assert!(lo * hi >= 0, "one direction per pair");
    if lo > 0 || hi > 0 {
        _mm512_sllv_epi32(v, halves(lo, hi))
    } else if lo < 0 || hi < 0 {
        _mm512_srlv_epi32(v, halves(-lo, -hi))
    } else {
        v
    }
}

/// `a` in every 32-bit lane of the lower half, `b` in the upper half's.
/// (A function, not a closure: a closure does not inherit the caller's
/// target features, and one left out of line makes each intrinsic in it a
/// call.)
#[inline(always)]
unsafe fn halves(a: i32, b: i32) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi32(a), _mm256_set1_epi32(b))
}

/// Runs `r` and `r + 1` of a sub-block (`r` even), as `kx8::run_codes` gives
/// each, in the lower and upper halves. `e0`, `e1`: the extra-bit words in
/// both halves.
#[inline(always)]
unsafe fn run_pair_codes<const K: u8>(sub: *const u8, r: usize, e0: __m512i, e1: __m512i) -> (__m512i, __m512i) {
    let raw = _mm512_loadu_si512(sub.add(32 * r) as *const _);
    let nib = _mm512_set1_epi8(0x0F);
    let lo = _mm512_and_si512(raw, nib);
    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib);
    let r = r as i32;
    // `a | (b & c)`: the extra bits (`b`, masked by `c`) into the codes.
    const OR_MASKED: i32 = 0xF8;
    match K {
        Q5K => {
            let bit4 = _mm512_set1_epi8(0x10);
            let lo5 = shift_pair(e0, 4 - r, 3 - r);
            let hi5 = shift_pair(e0, -r, -r - 1);
            (
                _mm512_ternarylogic_epi32::<OR_MASKED>(lo, lo5, bit4),
                _mm512_ternarylogic_epi32::<OR_MASKED>(hi, hi5, bit4),
            )
        }
        Q6K => {
            let bits45 = _mm512_set1_epi8(0x30);
            let lo6 = shift_pair(e0, 4 - 2 * r, 2 - 2 * r);
            let hi6 = shift_pair(e1, 4 - 2 * r, 2 - 2 * r);
            (
                _mm512_ternarylogic_epi32::<OR_MASKED>(lo, lo6, bits45),
                _mm512_ternarylogic_epi32::<OR_MASKED>(hi, hi6, bits45),
            )
        }
        _ => (lo, hi),
    }
}

/// [`extra_words`] in both halves of a 512-bit register.
#[inline(always)]
unsafe fn extra_words_pair<const K: u8>(sub: *const u8) -> (__m512i, __m512i) {
    let (e0, e1) = extra_words::<K>(sub);
    (_mm512_broadcast_i64x4(e0), _mm512_broadcast_i64x4(e1))
}

/// A token's activation block with its 4-byte groups `a` in the lower half's
/// lanes and `b` in the upper half's.
#[inline(always)]
unsafe fn act_pair(qs: __m512i, a: i32, b: i32) -> __m512i {
    _mm512_permutexvar_epi32(halves(a, b), qs)
}

/// Each token's 32 activation codes in the lower half of a register. A
/// loop, not `array::from_fn`: its closure was left out of line at four
/// tokens, which made every intrinsic in it a call (15x slower; see
/// `halves`).
#[inline(always)]
unsafe fn act_blocks<const T: usize>(ba: [&BlockQ8; T]) -> [__m512i; T] {
    let mut qs = [_mm512_setzero_si512(); T];
    for t in 0..T {
        qs[t] = _mm512_castsi256_si512(_mm256_loadu_si256(ba[t].qs.as_ptr() as *const __m256i));
    }
    qs
}

/// The two halves of a pair-of-runs sum added: the eight rows' sums.
#[inline(always)]
unsafe fn fold_pair(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// The per-token integer sums of one block of four nibble runs of eight
/// rows (a super-block type's sub-block, or a q4_0/q4_1 block: the same run
/// layout) by run pairs, the extra bits of kind `K` (`kx8`) merged in: with
/// `SPLIT`, the low-nibble codes (0..16) and the high ones (16..32) apart
/// (q6k); without, both in the first.
#[inline(always)]
pub(super) unsafe fn pair_sums<const T: usize, const K: u8, const SPLIT: bool>(
    sub: *const u8,
    ba: [&BlockQ8; T],
) -> ([__m256i; T], [__m256i; T]) {
    let (e0, e1) = extra_words_pair::<K>(sub);
    let qs = act_blocks(ba);
    let mut s0 = [_mm512_setzero_si512(); T];
    let mut s1 = [_mm512_setzero_si512(); T];
    for r in [0, 2] {
        let (lo, hi) = run_pair_codes::<K>(sub, r, e0, e1);
        let r = r as i32;
        for t in 0..T {
            let (alo, ahi) = (act_pair(qs[t], r, r + 1), act_pair(qs[t], 4 + r, 5 + r));
            s0[t] = _mm512_dpbusd_epi32(s0[t], lo, alo);
            if SPLIT {
                s1[t] = _mm512_dpbusd_epi32(s1[t], hi, ahi);
            } else {
                s0[t] = _mm512_dpbusd_epi32(s0[t], hi, ahi);
            }
        }
    }
    // Loops for the results too (as `act_blocks`).
    let (mut f0, mut f1) = ([_mm256_setzero_si256(); T], [_mm256_setzero_si256(); T]);
    for t in 0..T {
        f0[t] = fold_pair(s0[t]);
        if SPLIT {
            f1[t] = fold_pair(s1[t]);
        }
    }
    (f0, f1)
}

/// `Σ w · a` of one q8_0 group block (eight runs of signed weights) per
/// token, by run pairs. `vpdpbusd` multiplies unsigned by signed bytes, so
/// the weights enter as `w + 128` (one `xor` per pair, shared by the
/// tokens) and `128 · Σ a` comes off the sum: the exact integer.
#[inline(always)]
pub(super) unsafe fn q8_pair_sums<const T: usize>(qs: *const i8, ba: [&BlockQ8; T]) -> [__m256i; T] {
    let act = act_blocks(ba);
    let flip = _mm512_set1_epi8(-128);
    let mut s = [_mm512_setzero_si512(); T];
    for k in [0i32, 2, 4, 6] {
        let w = _mm512_xor_si512(_mm512_loadu_si512(qs.add(32 * k as usize) as *const _), flip);
        for t in 0..T {
            s[t] = _mm512_dpbusd_epi32(s[t], w, act_pair(act[t], k, k + 1));
        }
    }
    let mut out = [_mm256_setzero_si256(); T];
    for t in 0..T {
        out[t] = _mm256_sub_epi32(fold_pair(s[t]), _mm256_set1_epi32(128 * ba[t].sum));
    }
    out
}
