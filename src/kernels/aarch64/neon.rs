//! NEON dot products. Each `unsafe fn` requires NEON and reads its slices
//! with unaligned loads within the lengths it is given.
//!
//! The whole body of each `unsafe fn` here is the unsafe operation (raw
//! loads and `NEON` intrinsics), justified once by the function's
//! `# Safety` section rather than by one `unsafe {}` block per intrinsic.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::aarch64::*;

use crate::kernels::BlockQ8;
use crate::quant::mxfp4::{LUT2, half_scale};
use crate::quant::q8_0::BlockQ8_0;
use crate::quant::x8::{BlockMxfp4x8, BlockQ4_0x8, BlockQ4_1x8, BlockQ8_0x8};

/// # Safety
/// NEON must be available; `row` holds `x.len()` f32 values.
#[target_feature(enable = "neon")]
pub unsafe fn dot_f32(row: &[u8], x: &[f32], _q: &[BlockQ8]) -> f32 {
    let n = x.len();
    debug_assert_eq!(row.len(), n * 4);
    let w = row.as_ptr() as *const f32;
    let mut a0 = vdupq_n_f32(0.0);
    let mut a1 = vdupq_n_f32(0.0);
    let mut i = 0;
    while i + 8 <= n {
        a0 = vfmaq_f32(a0, vld1q_f32(w.add(i)), vld1q_f32(x.as_ptr().add(i)));
        a1 = vfmaq_f32(a1, vld1q_f32(w.add(i + 4)), vld1q_f32(x.as_ptr().add(i + 4)));
        i += 8;
    }
    let mut s = vaddvq_f32(vaddq_f32(a0, a1));
    while i < n {
        s += w.add(i).read_unaligned() * x[i];
        i += 1;
    }
    s
}

/// # Safety
/// NEON must be available; `row` holds `x.len()` bf16 values.
#[target_feature(enable = "neon")]
pub unsafe fn dot_bf16(row: &[u8], x: &[f32], _q: &[BlockQ8]) -> f32 {
    let n = x.len();
    debug_assert_eq!(row.len(), n * 2);
    let w = row.as_ptr() as *const u16;
    let mut a0 = vdupq_n_f32(0.0);
    let mut a1 = vdupq_n_f32(0.0);
    let mut i = 0;
    while i + 8 <= n {
        let h = vld1q_u16(w.add(i));
        let lo = vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h)));
        let hi = vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(h)));
        a0 = vfmaq_f32(a0, lo, vld1q_f32(x.as_ptr().add(i)));
        a1 = vfmaq_f32(a1, hi, vld1q_f32(x.as_ptr().add(i + 4)));
        i += 8;
    }
    let mut s = vaddvq_f32(vaddq_f32(a0, a1));
    while i < n {
        s += f32::from_bits((w.add(i).read_unaligned() as u32) << 16) * x[i];
        i += 1;
    }
    s
}

/// # Safety
/// NEON must be available; `row` holds whole q8_0 blocks and `q` at least as many.
#[target_feature(enable = "neon")]
pub unsafe fn dot_q8_0(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    let nb = row.len() / std::mem::size_of::<BlockQ8_0>();
    debug_assert!(q.len() >= nb);
    let w = row.as_ptr() as *const BlockQ8_0;
    let mut acc = vdupq_n_f32(0.0);
    for (i, ba) in q[..nb].iter().enumerate() {
        let bw = &*w.add(i);
        let x0 = vld1q_s8(bw.qs.as_ptr());
        let x1 = vld1q_s8(bw.qs.as_ptr().add(16));
        let y0 = vld1q_s8(ba.qs.as_ptr());
        let y1 = vld1q_s8(ba.qs.as_ptr().add(16));
        // Widening multiplies into i16, pairwise accumulate into i32.
        let mut s = vdupq_n_s32(0);
        s = vpadalq_s16(s, vmull_s8(vget_low_s8(x0), vget_low_s8(y0)));
        s = vpadalq_s16(s, vmull_s8(vget_high_s8(x0), vget_high_s8(y0)));
        s = vpadalq_s16(s, vmull_s8(vget_low_s8(x1), vget_low_s8(y1)));
        s = vpadalq_s16(s, vmull_s8(vget_high_s8(x1), vget_high_s8(y1)));
        let d = half::f16::from_bits(bw.d).to_f32() * ba.d;
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), d);
    }
    vaddvq_f32(acc)
}

// ------------------------------------------------------------------
// Eight interleaved rows (see `crate::quant::x8`). A 16-byte half of each
// 32-byte run holds four consecutive values of four rows; widening multiplies
// against the four activation bytes repeated give each row's products in
// neighbouring 16-bit lanes, pairwise accumulation folds them per row.

/// The eight f16 scales times the activation scale, as rows 0..4 and 4..8.
#[inline(always)]
unsafe fn scales8(d: &[u16; 8], da: f32) -> (float32x4_t, float32x4_t) {
    let f: [f32; 8] = std::array::from_fn(|l| half::f16::from_bits(d[l]).to_f32() * da);
    (vld1q_f32(f.as_ptr()), vld1q_f32(f.as_ptr().add(4)))
}

/// Σ over one group block of weight · activation per row (rows 0..4, 4..8),
/// with `w(k)` giving the values of column quad `k` (0..8) for rows 0..4 and
/// 4..8 as signed bytes.
#[inline(always)]
unsafe fn group_sums(ba: &BlockQ8, w: impl Fn(usize) -> (int8x16_t, int8x16_t)) -> (int32x4_t, int32x4_t) {
    let mut s = [vdupq_n_s32(0); 4];
    for k in 0..8 {
        let a = vreinterpretq_s8_s32(vdupq_n_s32((ba.qs.as_ptr().add(4 * k) as *const i32).read_unaligned()));
        let (w0, w1) = w(k);
        s[0] = vpadalq_s16(s[0], vmull_s8(vget_low_s8(w0), vget_low_s8(a)));
        s[1] = vpadalq_s16(s[1], vmull_high_s8(w0, a));
        s[2] = vpadalq_s16(s[2], vmull_s8(vget_low_s8(w1), vget_low_s8(a)));
        s[3] = vpadalq_s16(s[3], vmull_high_s8(w1, a));
    }
    // Each row's two 32-bit partial sums are neighbours: fold them.
    (vpaddq_s32(s[0], s[1]), vpaddq_s32(s[2], s[3]))
}

#[inline(always)]
unsafe fn store8(a: float32x4_t, b: float32x4_t) -> [f32; 8] {
    let mut out = [0f32; 8];
    vst1q_f32(out.as_mut_ptr(), a);
    vst1q_f32(out.as_mut_ptr().add(4), b);
    out
}

/// # Safety
/// NEON must be available; `group` holds whole q8_0x8 blocks and `q` at least as many.
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_q8_0(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    let nb = group.len() / std::mem::size_of::<BlockQ8_0x8>();
    debug_assert!(q.len() >= nb);
    let g = group.as_ptr() as *const BlockQ8_0x8;
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (b, ba) in q[..nb].iter().enumerate() {
        let bw = &*g.add(b);
        let p = bw.qs.as_ptr();
        let (r0, r1) = group_sums(ba, |k| (vld1q_s8(p.add(32 * k)), vld1q_s8(p.add(32 * k + 16))));
        let (d0, d1) = scales8(&bw.d, ba.d);
        acc0 = vfmaq_f32(acc0, d0, vcvtq_f32_s32(r0));
        acc1 = vfmaq_f32(acc1, d1, vcvtq_f32_s32(r1));
    }
    store8(acc0, acc1)
}

/// Codes of column quad `k` of a 4-bit group block: low nibbles of run `k`
/// for `k < 4`, high nibbles of run `k - 4` after.
#[inline(always)]
unsafe fn nibbles(p: *const u8, k: usize) -> (int8x16_t, int8x16_t) {
    let j = k % 4;
    let (r0, r1) = (vld1q_u8(p.add(32 * j)), vld1q_u8(p.add(32 * j + 16)));
    let (c0, c1) = if k < 4 {
        (vandq_u8(r0, vdupq_n_u8(0x0F)), vandq_u8(r1, vdupq_n_u8(0x0F)))
    } else {
        (vshrq_n_u8::<4>(r0), vshrq_n_u8::<4>(r1))
    };
    (vreinterpretq_s8_u8(c0), vreinterpretq_s8_u8(c1))
}

/// # Safety
/// NEON must be available; `group` holds whole q4_0x8 blocks and `q` at least as many.
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_q4_0(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    let nb = group.len() / std::mem::size_of::<BlockQ4_0x8>();
    debug_assert!(q.len() >= nb);
    let g = group.as_ptr() as *const BlockQ4_0x8;
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (b, ba) in q[..nb].iter().enumerate() {
        let bw = &*g.add(b);
        let p = bw.qs.as_ptr();
        let (r0, r1) = group_sums(ba, |k| nibbles(p, k));
        // Codes are stored +8: Σ (c - 8)·q = Σ c·q - 8·Σq.
        let off = vdupq_n_s32(8 * ba.sum);
        let (d0, d1) = scales8(&bw.d, ba.d);
        acc0 = vfmaq_f32(acc0, d0, vcvtq_f32_s32(vsubq_s32(r0, off)));
        acc1 = vfmaq_f32(acc1, d1, vcvtq_f32_s32(vsubq_s32(r1, off)));
    }
    store8(acc0, acc1)
}

/// # Safety
/// NEON must be available; `group` holds whole q4_1x8 blocks and `q` at least as many.
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_q4_1(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    let nb = group.len() / std::mem::size_of::<BlockQ4_1x8>();
    debug_assert!(q.len() >= nb);
    let g = group.as_ptr() as *const BlockQ4_1x8;
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (b, ba) in q[..nb].iter().enumerate() {
        let bw = &*g.add(b);
        let p = bw.qs.as_ptr();
        let (r0, r1) = group_sums(ba, |k| nibbles(p, k));
        let (d0, d1) = scales8(&bw.d, ba.d);
        let (m0, m1) = scales8(&bw.m, 1.0);
        let s = ba.scaled_sum();
        acc0 = vfmaq_n_f32(vfmaq_f32(acc0, d0, vcvtq_f32_s32(r0)), m0, s);
        acc1 = vfmaq_n_f32(vfmaq_f32(acc1, d1, vcvtq_f32_s32(r1)), m1, s);
    }
    store8(acc0, acc1)
}

/// # Safety
/// NEON must be available; `group` holds whole mxfp4x8 blocks and `q` at least as many.
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_mxfp4(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    let nb = group.len() / std::mem::size_of::<BlockMxfp4x8>();
    debug_assert!(q.len() >= nb);
    let g = group.as_ptr() as *const BlockMxfp4x8;
    // Codes → doubled E2M1 values by a table lookup.
    let lut = vld1q_s8(LUT2.as_ptr());
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (b, ba) in q[..nb].iter().enumerate() {
        let bw = &*g.add(b);
        let p = bw.qs.as_ptr();
        let (r0, r1) = group_sums(ba, |k| {
            let (c0, c1) = nibbles(p, k);
            (vqtbl1q_s8(lut, vreinterpretq_u8_s8(c0)), vqtbl1q_s8(lut, vreinterpretq_u8_s8(c1)))
        });
        let f: [f32; 8] = std::array::from_fn(|l| half_scale(bw.e[l]) * ba.d);
        let (d0, d1) = (vld1q_f32(f.as_ptr()), vld1q_f32(f.as_ptr().add(4)));
        acc0 = vfmaq_f32(acc0, d0, vcvtq_f32_s32(r0));
        acc1 = vfmaq_f32(acc1, d1, vcvtq_f32_s32(r1));
    }
    store8(acc0, acc1)
}
