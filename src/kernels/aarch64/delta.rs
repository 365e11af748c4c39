//! The gated delta rule's step (`kernels::delta`) on NEON's four lanes:
//! the register type's operations and the `#[target_feature]` entry point
//! the table wraps.
//!
//! The whole body of each `unsafe fn` here is the unsafe operation
//! (intrinsics on pointers the generic step has bounded); the entry point
//! needs NEON, checked once by the table.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::aarch64::*;

use super::super::delta::{Lanes, ssm, step};

impl Lanes for float32x4_t {
    const LANES: usize = 4;
    #[inline(always)]
    unsafe fn zero() -> Self {
        vdupq_n_f32(0.0)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        vdupq_n_f32(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        vld1q_f32(p)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        vst1q_f32(p, self)
    }
    #[inline(always)]
    unsafe fn load_part(p: *const f32, n: usize) -> Self {
        // NEON has no masked load: the lanes go through a buffer.
        let mut b = [0f32; 4];
        std::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), n);
        vld1q_f32(b.as_ptr())
    }
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, n: usize) {
        let mut b = [0f32; 4];
        vst1q_f32(b.as_mut_ptr(), self);
        std::ptr::copy_nonoverlapping(b.as_ptr(), p, n);
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        vmulq_f32(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        vsubq_f32(a, b)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        // vfmaq_f32(c, a, b) is c + a · b, one rounding.
        vfmaq_f32(c, a, b)
    }
}

/// The step on four lanes, strips of eight registers (32 columns).
///
/// # Safety
/// The CPU must have NEON.
#[target_feature(enable = "neon")]
pub unsafe fn delta_step(s: &mut [f32], decay: &[f32], k: &[f32], v: &[f32], beta: f32, q: &[f32], out: &mut [f32]) {
    step::<float32x4_t, 8>(s, decay, k, v, beta, q, out)
}

/// Mamba2's step on four lanes, strips of eight registers (32 columns).
///
/// # Safety
/// The CPU must have NEON.
#[target_feature(enable = "neon")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn ssm_step(s: &mut [f32], decay: f32, dt: f32, b: &[f32], x: &[f32], c: &[f32], d: f32, out: &mut [f32]) {
    ssm::<float32x4_t, 8>(s, decay, dt, b, x, c, d, out)
}
