//! The gated delta rule's step (`kernels::delta`) on eight lanes (AVX2 +
//! FMA) and sixteen (AVX-512F): the register type's operations, and the
//! `#[target_feature]` entry points the tables wrap.
//!
//! The whole body of each `unsafe fn` here is the unsafe operation
//! (intrinsics on pointers the generic step has bounded); the entry points
//! need the features their names say, checked once by the table.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::super::delta::{Lanes, ssm, step};

impl Lanes for __m256 {
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm256_storeu_ps(p, self)
    }
    #[inline(always)]
    unsafe fn load_part(p: *const f32, n: usize) -> Self {
        // Masked-off lanes are neither read nor able to fault.
        _mm256_maskload_ps(p, first_lanes(n))
    }
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, n: usize) {
        _mm256_maskstore_ps(p, first_lanes(n), self)
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        _mm256_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        _mm256_fmadd_ps(a, b, c)
    }
}

/// The mask of lanes `0..n` for `vmaskmovps` (sign bit set).
#[inline(always)]
unsafe fn first_lanes(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

impl Lanes for __m512 {
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm512_storeu_ps(p, self)
    }
    #[inline(always)]
    unsafe fn load_part(p: *const f32, n: usize) -> Self {
        // Masked-off lanes are neither read nor able to fault.
        _mm512_maskz_loadu_ps(((1u32 << n) - 1) as __mmask16, p)
    }
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, n: usize) {
        _mm512_mask_storeu_ps(p, ((1u32 << n) - 1) as __mmask16, self)
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        _mm512_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        _mm512_fmadd_ps(a, b, c)
    }
}

/// The step on eight lanes, strips of eight registers (64 columns; sixteen
/// would not fit in the sixteen registers with their sums and deltas).
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn ymm_delta_step(
    s: &mut [f32],
    decay: &[f32],
    k: &[f32],
    v: &[f32],
    beta: f32,
    q: &[f32],
    out: &mut [f32],
) {
    step::<__m256, 8>(s, decay, k, v, beta, q, out)
}

/// The step on sixteen lanes, strips of eight registers (128 columns: a
/// whole row at Qwen3.6's width).
///
/// # Safety
/// The CPU must have AVX-512F, AVX2 and FMA.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn zmm_delta_step(
    s: &mut [f32],
    decay: &[f32],
    k: &[f32],
    v: &[f32],
    beta: f32,
    q: &[f32],
    out: &mut [f32],
) {
    step::<__m512, 8>(s, decay, k, v, beta, q, out)
}

/// Mamba2's step on eight lanes, strips of eight registers (64 columns: a
/// whole head at Nemotron-H's width).
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn ymm_ssm_step(
    s: &mut [f32],
    decay: f32,
    dt: f32,
    b: &[f32],
    x: &[f32],
    c: &[f32],
    d: f32,
    out: &mut [f32],
) {
    ssm::<__m256, 8>(s, decay, dt, b, x, c, d, out)
}

/// Mamba2's step on sixteen lanes, strips of four registers (64 columns).
///
/// # Safety
/// The CPU must have AVX-512F, AVX2 and FMA.
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn zmm_ssm_step(
    s: &mut [f32],
    decay: f32,
    dt: f32,
    b: &[f32],
    x: &[f32],
    c: &[f32],
    d: f32,
    out: &mut [f32],
) {
    ssm::<__m512, 4>(s, decay, dt, b, x, c, d, out)
}
