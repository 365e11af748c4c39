//! NEON dot products. Each `unsafe fn` requires NEON and reads its slices
//! with unaligned loads within the lengths it is given.
//!
//! The whole body of each `unsafe fn` here is the unsafe operation (raw
//! loads and `NEON` intrinsics), justified once by the function's
//! `# Safety` section rather than by one `unsafe {}` block per intrinsic.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::aarch64::*;

use crate::kernels::BlockQ8;
use crate::quant::q8_0::BlockQ8_0;

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
    for i in 0..nb {
        let bw = &*w.add(i);
        let ba = &q[i];
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
