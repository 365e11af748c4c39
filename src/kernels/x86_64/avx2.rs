//! AVX2 + FMA + F16C dot products. Each `unsafe fn` requires those three CPU
//! features (checked once by the caller); slices are read with unaligned
//! loads, and the lengths the kernel relies on are `debug_assert!`ed.
//!
//! Integer kernels use the sign trick: `maddubs` multiplies unsigned by
//! signed bytes, so `|w|` is paired with `sign(w)·a`; pair sums stay below
//! 2·127·127 < 2^15, so the 16-bit intermediate never saturates (weights are
//! in [-127, 127], activations in [-127, 127]).
//!
//! Kernels are written over the small `#[inline(always)]` primitives of
//! `prim.rs`: the int8 dot `sum4_u8_i8` (the one instruction AVX-VNNI
//! replaces), `hsum`, `f16_to_f32`; inlined into the `#[target_feature]`
//! outer functions they compile to the same code as written out in place
//! (kernel_speed, one and four tokens). The f32/bf16/f16 weight rows are
//! multiplied by the attention score kernels of `kv.rs` (generic over the
//! register width), weight rows taking the place of keys.
//!
//! The whole body of each `unsafe fn` here is the unsafe operation (raw
//! loads and `AVX2, FMA and F16C` intrinsics), justified once by the function's
//! `# Safety` section rather than by one `unsafe {}` block per intrinsic.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::pairs;
use super::prim::{
    AVX_VNNI, BlockSums, EVEX_VNNI, LateAcc, MADD, Q4K, ZMM_VNNI, act4, dot_i8, dot_u8_i8, dp4, f16_to_f32, hsum,
    in_passes, prefetch_by, store8, stream_ahead, unpack_nibbles, vpdpbusd,
};
use crate::kernels::GEMM8_TOKENS;
use crate::quant::act::BlockQ8;
use crate::quant::mxfp4::{BlockMxfp4, LUT2};
use crate::quant::q4_0::BlockQ4_0;
use crate::quant::q4_1::BlockQ4_1;
use crate::quant::q8_0::BlockQ8_0;
use crate::quant::x8::{BlockMxfp4x8, BlockQ4_0x8, BlockQ4_1x8, BlockQ8_0x8};

/// Σ over blocks of scale · products, as two interleaved FMA chains (even and
/// odd blocks) so the 4-cycle FMA latency is not paid once per block.
#[inline(always)]
unsafe fn two_chains(nb: usize, mut block: impl FnMut(usize) -> (__m256, __m256)) -> f32 {
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 2 <= nb {
        let (d0, p0) = block(i);
        let (d1, p1) = block(i + 1);
        a0 = _mm256_fmadd_ps(d0, p0, a0);
        a1 = _mm256_fmadd_ps(d1, p1, a1);
        i += 2;
    }
    if i < nb {
        let (d0, p0) = block(i);
        a0 = _mm256_fmadd_ps(d0, p0, a0);
    }
    hsum(_mm256_add_ps(a0, a1))
}

/// # Safety
/// AVX2, FMA and F16C must be available; `row` holds whole q8_0 blocks and
/// `q` at least as many activation blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    let nb = row.len() / std::mem::size_of::<BlockQ8_0>();
    debug_assert!(q.len() >= nb);
    let w = row.as_ptr() as *const BlockQ8_0;
    // Two accumulators (even and odd blocks) halve the FMA dependency chain.
    let block = |i: usize| {
        let bw = &*w.add(i);
        let ba = q.get_unchecked(i);
        let d = _mm256_set1_ps(f16_to_f32(bw.d) * ba.d);
        let x = _mm256_loadu_si256(bw.qs.as_ptr() as *const __m256i);
        let y = _mm256_loadu_si256(ba.qs.as_ptr() as *const __m256i);
        (d, dot_i8(x, y))
    };
    two_chains(nb, block)
}

/// # Safety
/// As [`dot_q8_0`], for q4_0 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_0(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    let nb = row.len() / std::mem::size_of::<BlockQ4_0>();
    debug_assert!(q.len() >= nb);
    let w = row.as_ptr() as *const BlockQ4_0;
    let eight = _mm256_set1_epi8(8);
    let block = |i: usize| {
        let bw = &*w.add(i);
        let ba = q.get_unchecked(i);
        let d = _mm256_set1_ps(f16_to_f32(bw.d) * ba.d);
        let x = _mm256_sub_epi8(unpack_nibbles(bw.qs.as_ptr()), eight);
        let y = _mm256_loadu_si256(ba.qs.as_ptr() as *const __m256i);
        (d, dot_i8(x, y))
    };
    two_chains(nb, block)
}

/// The doubled E2M1 values in both 128-bit lanes, for `pshufb` lookups.
#[inline(always)]
unsafe fn lut2() -> __m256i {
    let t = _mm_loadu_si128(LUT2.as_ptr() as *const __m128i);
    _mm256_set_m128i(t, t)
}

/// 2^(e − 128) for each of eight E8M0 bytes, exactly (as `half_scale`):
/// `e << 23` is the f32 2^(e − 127) for e ≥ 1 (halving it is exact, into the
/// subnormals too); e = 0 takes 2^-128 directly.
#[inline(always)]
unsafe fn half_scales8(e: *const u8) -> __m256 {
    let ei = _mm256_cvtepu8_epi32(_mm_loadl_epi64(e as *const __m128i));
    let pow = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(ei, 23)), _mm256_set1_ps(0.5));
    let zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(ei, _mm256_setzero_si256()));
    _mm256_blendv_ps(pow, _mm256_set1_ps(f32::from_bits(1 << 21)), zero)
}

/// # Safety
/// As [`dot_q8_0`], for mxfp4 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_mxfp4(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    let nb = row.len() / std::mem::size_of::<BlockMxfp4>();
    debug_assert!(q.len() >= nb);
    let w = row.as_ptr() as *const BlockMxfp4;
    let lut = lut2();
    let block = |i: usize| {
        let bw = &*w.add(i);
        let ba = q.get_unchecked(i);
        let d = _mm256_set1_ps(crate::quant::mxfp4::half_scale(bw.e) * ba.d);
        let x = _mm256_shuffle_epi8(lut, unpack_nibbles(bw.qs.as_ptr()));
        let y = _mm256_loadu_si256(ba.qs.as_ptr() as *const __m256i);
        (d, dot_i8(x, y))
    };
    two_chains(nb, block)
}

/// # Safety
/// As [`dot_q8_0`], for q4_1 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    let nb = row.len() / std::mem::size_of::<BlockQ4_1>();
    debug_assert!(q.len() >= nb);
    let w = row.as_ptr() as *const BlockQ4_1;
    let mut offsets = 0f32;
    for i in 0..nb {
        offsets += f16_to_f32((*w.add(i)).m) * q.get_unchecked(i).scaled_sum();
    }
    let block = |i: usize| {
        let bw = &*w.add(i);
        let ba = q.get_unchecked(i);
        let d = _mm256_set1_ps(f16_to_f32(bw.d) * ba.d);
        let x = unpack_nibbles(bw.qs.as_ptr());
        let y = _mm256_loadu_si256(ba.qs.as_ptr() as *const __m256i);
        (d, dot_u8_i8(x, y))
    };
    two_chains(nb, block) + offsets
}

/// One weight row against four activation rows: the weight block is loaded,
/// unpacked and sign-split once and used four times (a 1×4 GEMM tile).
/// Each token keeps the even/odd chains of [`two_chains`], so a tile gives
/// the same bits as four single dots (prefill and decode agree exactly).
#[inline(always)]
unsafe fn tile4(
    nb: usize,
    q: [&[BlockQ8]; 4],
    mut weights: impl FnMut(usize) -> (f32, __m256i, __m256i),
    signed: bool,
) -> [f32; 4] {
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    for i in 0..nb {
        // (scale, |w| or w, sign source)
        let (dw, wabs, wsign) = weights(i);
        for (t, a) in acc.iter_mut().enumerate() {
            let ba = q[t].get_unchecked(i);
            let y = _mm256_loadu_si256(ba.qs.as_ptr() as *const __m256i);
            let y = if signed { _mm256_sign_epi8(y, wsign) } else { y };
            let p = dot_u8_i8(wabs, y);
            a[i & 1] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ba.d), p, a[i & 1]);
        }
    }
    acc.map(|a| hsum(_mm256_add_ps(a[0], a[1])))
}

/// # Safety
/// AVX2, FMA and F16C must be available; `row` holds whole q8_0 blocks and
/// every `q[t]` at least as many activation blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot4_q8_0(row: &[u8], q: [&[BlockQ8]; 4]) -> [f32; 4] {
    let nb = row.len() / std::mem::size_of::<BlockQ8_0>();
    debug_assert!(q.iter().all(|r| r.len() >= nb));
    let w = row.as_ptr() as *const BlockQ8_0;
    tile4(
        nb,
        q,
        |i| {
            let bw = &*w.add(i);
            let x = _mm256_loadu_si256(bw.qs.as_ptr() as *const __m256i);
            (f16_to_f32(bw.d), _mm256_sign_epi8(x, x), x)
        },
        true,
    )
}

/// # Safety
/// As [`dot4_q8_0`], for q4_0 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot4_q4_0(row: &[u8], q: [&[BlockQ8]; 4]) -> [f32; 4] {
    let nb = row.len() / std::mem::size_of::<BlockQ4_0>();
    debug_assert!(q.iter().all(|r| r.len() >= nb));
    let w = row.as_ptr() as *const BlockQ4_0;
    let eight = _mm256_set1_epi8(8);
    tile4(
        nb,
        q,
        |i| {
            let bw = &*w.add(i);
            let x = _mm256_sub_epi8(unpack_nibbles(bw.qs.as_ptr()), eight);
            (f16_to_f32(bw.d), _mm256_sign_epi8(x, x), x)
        },
        true,
    )
}

/// # Safety
/// As [`dot4_q8_0`], for q4_1 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot4_q4_1(row: &[u8], q: [&[BlockQ8]; 4]) -> [f32; 4] {
    let nb = row.len() / std::mem::size_of::<BlockQ4_1>();
    debug_assert!(q.iter().all(|r| r.len() >= nb));
    let w = row.as_ptr() as *const BlockQ4_1;
    let mut out = tile4(
        nb,
        q,
        |i| {
            let bw = &*w.add(i);
            let x = unpack_nibbles(bw.qs.as_ptr());
            (f16_to_f32(bw.d), x, x)
        },
        false,
    );
    // Offsets summed separately, then added, exactly as `dot_q4_1` does.
    for (t, o) in out.iter_mut().enumerate() {
        let mut offsets = 0f32;
        for i in 0..nb {
            offsets += f16_to_f32((*w.add(i)).m) * q[t].get_unchecked(i).scaled_sum();
        }
        *o += offsets;
    }
    out
}

// ------------------------------------------------------------------
// Eight interleaved rows (see `crate::quant::x8`): each 32-bit lane of a
// register belongs to one row, so a group block ends as eight row sums in
// eight lanes, scaled by the eight row scales at once; no horizontal sums.
// `T` tokens share each weight load and unpack (T = 1 in decode, 4 in
// prefill); per lane the arithmetic is the same for every `T`, so prefill
// and decode agree bit for bit.

#[inline(always)]
unsafe fn gemm8_q8_0<const T: usize, const VNNI: u8>(
    g: *const BlockQ8_0x8,
    nb: usize,
    q: [*const BlockQ8; T],
) -> [__m256; T] {
    let mut acc = LateAcc::<T, false>::new();
    let ahead = stream_ahead::<T>(true);
    for b in 0..nb {
        acc.settle();
        let bw = &*g.add(b);
        prefetch_by(bw as *const BlockQ8_0x8 as *const u8, ahead, std::mem::size_of::<BlockQ8_0x8>());
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(bw.d.as_ptr() as *const __m128i));
        let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q[t].add(b));
        acc.hold(BlockSums::new(dw, ba, q8_sums::<T, VNNI>(bw.qs.as_ptr(), ba)));
    }
    acc.finish()
}

/// `Σ w · a` of one q8_0 group block per lane (row) and token, exact: by the
/// sign trick, `|w|` against `sign(w)·a`, run by run (or by run pairs).
#[inline(always)]
unsafe fn q8_sums<const T: usize, const VNNI: u8>(qs: *const i8, ba: [&BlockQ8; T]) -> [__m256i; T] {
    if VNNI == ZMM_VNNI {
        return pairs::q8_pair_sums::<T>(qs, ba);
    }
    let mut isum = [_mm256_setzero_si256(); T];
    for k in 0..8 {
        let w = _mm256_loadu_si256(qs.add(32 * k) as *const __m256i);
        let wabs = _mm256_sign_epi8(w, w);
        for (t, s) in isum.iter_mut().enumerate() {
            let a = _mm256_sign_epi8(act4(ba[t], 4 * k), w);
            *s = dp4::<VNNI>(*s, wabs, a);
        }
    }
    isum
}

/// 4-bit codes · activations of one group block, per lane (row). The codes
/// multiply as they are (q4_0, q4_1: unsigned 0..15), or with `LUT` as the
/// doubled E2M1 values (mxfp4: −12..12, by the sign trick, `|v|` against the
/// activation negated where `v < 0`). Without VNNI the sums run in 16-bit
/// lanes, two per row, widened once at the end (a lane adds eight products
/// of pairs, at most 8 · 2 · 15 · 127 = 30480); with it, `vpdpbusd` sums
/// straight into 32 bits. The integers are the same.
#[inline(always)]
unsafe fn nibble_sums<const T: usize, const VNNI: u8, const LUT: bool>(
    qs: *const u8,
    ba: [&BlockQ8; T],
) -> [__m256i; T] {
    if VNNI == ZMM_VNNI && !LUT {
        // q4_0 and q4_1 lay their runs out as q4k's sub-blocks.
        return pairs::pair_sums::<T, { Q4K }, false>(qs, ba).0;
    }
    let mask = _mm256_set1_epi8(0x0F);
    let lut = lut2();
    let mut s = [_mm256_setzero_si256(); T];
    for j in 0..4 {
        let raw = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
        let lo = _mm256_and_si256(raw, mask);
        let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        let (lo, hi) = if LUT { (_mm256_shuffle_epi8(lut, lo), _mm256_shuffle_epi8(lut, hi)) } else { (lo, hi) };
        let (xlo, xhi) = if LUT { (_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(hi, hi)) } else { (lo, hi) };
        for (t, s) in s.iter_mut().enumerate() {
            let (mut alo, mut ahi) = (act4(ba[t], 4 * j), act4(ba[t], 16 + 4 * j));
            if LUT {
                (alo, ahi) = (_mm256_sign_epi8(alo, lo), _mm256_sign_epi8(ahi, hi));
            }
            *s = if VNNI != MADD {
                vpdpbusd::<VNNI>(vpdpbusd::<VNNI>(*s, xlo, alo), xhi, ahi)
            } else {
                let p = _mm256_add_epi16(_mm256_maddubs_epi16(xlo, alo), _mm256_maddubs_epi16(xhi, ahi));
                _mm256_add_epi16(*s, p)
            };
        }
    }
    if VNNI != MADD {
        return s;
    }
    let ones = _mm256_set1_epi16(1);
    s.map(|s| _mm256_madd_epi16(s, ones))
}

#[inline(always)]
unsafe fn gemm8_q4_0<const T: usize, const VNNI: u8>(
    g: *const BlockQ4_0x8,
    nb: usize,
    q: [*const BlockQ8; T],
) -> [__m256; T] {
    let mut acc = LateAcc::<T, false>::new();
    let ahead = stream_ahead::<T>(true);
    for b in 0..nb {
        acc.settle();
        let bw = &*g.add(b);
        prefetch_by(bw as *const BlockQ4_0x8 as *const u8, ahead, std::mem::size_of::<BlockQ4_0x8>());
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(bw.d.as_ptr() as *const __m128i));
        let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q[t].add(b));
        // Codes are stored +8: Σ (c - 8)·q = Σ c·q - 8·Σq, the 8·Σq taken
        // off the widened sums. It is shifted in a vector register: written
        // as `set1(8 · sum)` it went through a general register and a move
        // into the vector unit per token and block, and the eight-token loop
        // ran 4% slower (Zen 2, in L2).
        let sums = nibble_sums::<T, VNNI, false>(bw.qs.as_ptr(), ba);
        let sums =
            std::array::from_fn(|t| _mm256_sub_epi32(sums[t], _mm256_slli_epi32::<3>(_mm256_set1_epi32(ba[t].sum))));
        acc.hold(BlockSums::new(dw, ba, sums));
    }
    acc.finish()
}

#[inline(always)]
unsafe fn gemm8_q4_1<const T: usize, const VNNI: u8>(
    g: *const BlockQ4_1x8,
    nb: usize,
    q: [*const BlockQ8; T],
) -> [__m256; T] {
    let mut acc = LateAcc::<T, true>::new();
    let ahead = stream_ahead::<T>(true);
    for b in 0..nb {
        acc.settle();
        let bw = &*g.add(b);
        prefetch_by(bw as *const BlockQ4_1x8 as *const u8, ahead, std::mem::size_of::<BlockQ4_1x8>());
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(bw.d.as_ptr() as *const __m128i));
        let m = _mm256_cvtph_ps(_mm_loadu_si128(bw.m.as_ptr() as *const __m128i));
        let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q[t].add(b));
        let sums = nibble_sums::<T, VNNI, false>(bw.qs.as_ptr(), ba);
        acc.hold(BlockSums {
            m,
            scaled_sum: std::array::from_fn(|t| ba[t].scaled_sum()),
            ..BlockSums::new(dw, ba, sums)
        });
    }
    acc.finish()
}

#[inline(always)]
unsafe fn gemm8_mxfp4<const T: usize, const VNNI: u8>(
    g: *const BlockMxfp4x8,
    nb: usize,
    q: [*const BlockQ8; T],
) -> [__m256; T] {
    let mut acc = LateAcc::<T, false>::new();
    let ahead = stream_ahead::<T>(false);
    for b in 0..nb {
        acc.settle();
        let bw = &*g.add(b);
        prefetch_by(bw as *const BlockMxfp4x8 as *const u8, ahead, std::mem::size_of::<BlockMxfp4x8>());
        let dw = half_scales8(bw.e.as_ptr());
        let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q[t].add(b));
        acc.hold(BlockSums::new(dw, ba, nibble_sums::<T, VNNI, true>(bw.qs.as_ptr(), ba)));
    }
    acc.finish()
}

macro_rules! group_kernels {
    ($one:ident, $many:ident, $inner:ident, $block:ty, $vnni:ident, $features:literal, [$($t:literal)+]) => {
        /// # Safety
        /// The CPU must have the target features this function enables;
        /// `group` holds whole group blocks of this type and `q` at least as
        /// many activation blocks.
        #[target_feature(enable = $features)]
        pub unsafe fn $one(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
            let nb = group.len() / std::mem::size_of::<$block>();
            debug_assert!(q.len() >= nb);
            let [acc] = $inner::<1, $vnni>(group.as_ptr() as *const $block, nb, [q.as_ptr()]);
            store8(acc)
        }

        /// # Safety
        /// As the one-token kernel, with 1 to [`GEMM8_TOKENS`] tokens, every
        /// `q[t]` long enough and `out` as long as `q`.
        #[target_feature(enable = $features)]
        pub unsafe fn $many(group: &[u8], q: &[&[BlockQ8]], out: &mut [[f32; 8]]) {
            let nb = group.len() / std::mem::size_of::<$block>();
            debug_assert!(q.iter().all(|r| r.len() >= nb));
            let g = group.as_ptr() as *const $block;
            in_passes!(q, out, [$($t)+], $inner::<_, $vnni>(g, nb));
        }
    };
}

// The last argument lists the token counts of one pass over the weights:
// eight for the 4-bit types, four for q8_0, whose eight tokens' sums spill
// out of the 16 registers and ran slower in one pass than in two
// (docs/design/kernels.md).
group_kernels!(gemv8_q8_0, gemm8xn_q8_0, gemm8_q8_0, BlockQ8_0x8, MADD, "avx2,fma,f16c", [1 2 3 4]);
group_kernels!(gemv8_q4_0, gemm8xn_q4_0, gemm8_q4_0, BlockQ4_0x8, MADD, "avx2,fma,f16c", [1 2 3 4 5 6 7 8]);
group_kernels!(gemv8_q4_1, gemm8xn_q4_1, gemm8_q4_1, BlockQ4_1x8, MADD, "avx2,fma,f16c", [1 2 3 4 5 6 7 8]);
group_kernels!(gemv8_mxfp4, gemm8xn_mxfp4, gemm8_mxfp4, BlockMxfp4x8, MADD, "avx2,fma,f16c", [1 2 3 4 5 6 7 8]);

// The same kernels with AVX-VNNI's `vpdpbusd` for the integer sums (the
// same integers, so the same bits as the AVX2 ones).
group_kernels!(vnni_gemv8_q8_0, vnni_gemm8xn_q8_0, gemm8_q8_0, BlockQ8_0x8, AVX_VNNI, "avx2,fma,f16c,avxvnni", [1 2 3 4]);
group_kernels!(vnni_gemv8_q4_0, vnni_gemm8xn_q4_0, gemm8_q4_0, BlockQ4_0x8, AVX_VNNI, "avx2,fma,f16c,avxvnni", [1 2 3 4 5 6 7 8]);
group_kernels!(vnni_gemv8_q4_1, vnni_gemm8xn_q4_1, gemm8_q4_1, BlockQ4_1x8, AVX_VNNI, "avx2,fma,f16c,avxvnni", [1 2 3 4 5 6 7 8]);
group_kernels!(vnni_gemv8_mxfp4, vnni_gemm8xn_mxfp4, gemm8_mxfp4, BlockMxfp4x8, AVX_VNNI, "avx2,fma,f16c,avxvnni", [1 2 3 4 5 6 7 8]);

// With 512-bit `vpdpbusd` over pairs of runs (`pairs.rs`): the same
// integers again. (mxfp4's lookup and sign trick have no 512-bit form here.)
group_kernels!(
    zmm_gemv8_q8_0,
    zmm_gemm8xn_q8_0,
    gemm8_q8_0,
    BlockQ8_0x8,
    ZMM_VNNI,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    [1 2 3 4]
);
group_kernels!(
    zmm_gemv8_q4_0,
    zmm_gemm8xn_q4_0,
    gemm8_q4_0,
    BlockQ4_0x8,
    ZMM_VNNI,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    [1 2 3 4]
);
group_kernels!(
    zmm_gemv8_q4_1,
    zmm_gemm8xn_q4_1,
    gemm8_q4_1,
    BlockQ4_1x8,
    ZMM_VNNI,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    [1 2 3 4]
);

// mxfp4 with the EVEX `vpdpbusd` of AVX-512 VNNI (256-bit, so AVX-512VL),
// for CPUs without AVX-VNNI.
group_kernels!(
    evex_gemv8_mxfp4,
    evex_gemm8xn_mxfp4,
    gemm8_mxfp4,
    BlockMxfp4x8,
    EVEX_VNNI,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    [1 2 3 4]
);

/// [`crate::quant::act::quantize_act`] eight lanes at a time, with the
/// same operations on every value (the maximum |x| is exact in any order,
/// `d = amax / 127`, `x · (1 / d)`, NaN to 0, clamped, truncated and stepped
/// by the exact remainder), so the codes are the scalar ones (tested).
///
/// # Safety
/// AVX2, FMA and F16C must be available; `x` is a multiple of 32 long and
/// `out` holds a block per 32 values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_act(x: &[f32], out: &mut [BlockQ8]) {
    assert!(x.len().is_multiple_of(32) && out.len() >= x.len() / 32, "quantize_act: lengths");
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
    let (half, mhalf) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.5));
    for (xs, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(xs.as_ptr().add(8 * k)));
        // max(|v|, m) keeps m where v is NaN, as f32::max does.
        let mut m = _mm256_setzero_ps();
        for v in v {
            m = _mm256_max_ps(_mm256_and_ps(v, abs), m);
        }
        let amax = hmax(m);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let mut codes = [_mm256_setzero_si256(); 4];
        for (c, v) in codes.iter_mut().zip(v) {
            let y = _mm256_mul_ps(v, id);
            let y = _mm256_and_ps(y, _mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
            let y = _mm256_min_ps(_mm256_max_ps(y, lo), hi);
            let t = _mm256_cvttps_epi32(y);
            let f = _mm256_sub_ps(y, _mm256_cvtepi32_ps(t));
            let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(f, half));
            let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(f, mhalf));
            // The masks are -1 where true: t − up + down.
            let r = _mm256_add_epi32(_mm256_sub_epi32(t, up), down);
            *c = _mm256_min_epi32(_mm256_max_epi32(r, _mm256_set1_epi32(-128)), _mm256_set1_epi32(127));
        }
        let sum = _mm256_add_epi32(_mm256_add_epi32(codes[0], codes[1]), _mm256_add_epi32(codes[2], codes[3]));
        let s128 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256::<1>(sum));
        let s64 = _mm_add_epi32(s128, _mm_shuffle_epi32::<0b01_00_11_10>(s128));
        let s32 = _mm_add_epi32(s64, _mm_shuffle_epi32::<0b10_11_00_01>(s64));
        // i32 lanes to bytes, in order: packs work within 128-bit halves.
        let w01 = _mm256_packs_epi32(codes[0], codes[1]);
        let w23 = _mm256_packs_epi32(codes[2], codes[3]);
        let bytes = _mm256_packs_epi16(w01, w23);
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, bytes);
        b.d = d;
        b.sum = _mm_cvtsi128_si32(s32);
    }
}

/// The largest of eight lanes.
#[inline(always)]
unsafe fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    _mm_cvtss_f32(m)
}
