//! x86_64 kernels: AVX2 + FMA + F16C. Each public function here is a safe
//! wrapper that may only be reached through the table built by
//! [`super::table`], which installs them only after run-time detection of
//! all three features.

mod avx2;

use super::{AxpyFn, BlockQ8, Dot4Fn, DotFn, GroupKernels};

/// True when this CPU has everything the AVX2 kernels use.
pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

macro_rules! safe_wrapper {
    ($name:ident, $inner:path) => {
        fn $name(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
            // SAFETY: this wrapper is only stored in the kernel table after
            // `has_avx2()` returned true on this CPU (see `avx2_table`), so
            // the target features the inner function enables are present.
            unsafe { $inner(row, x, q) }
        }
    };
}

safe_wrapper!(f32_dot, avx2::dot_f32);
safe_wrapper!(bf16_dot, avx2::dot_bf16);
safe_wrapper!(f16_dot, avx2::dot_f16);
safe_wrapper!(q8_0_dot, avx2::dot_q8_0);
safe_wrapper!(q4_0_dot, avx2::dot_q4_0);
safe_wrapper!(q4_1_dot, avx2::dot_q4_1);

macro_rules! safe_wrapper4 {
    ($name:ident, $inner:path) => {
        fn $name(row: &[u8], q: [&[BlockQ8]; 4]) -> [f32; 4] {
            // SAFETY: as `safe_wrapper`: installed only after `has_avx2()`.
            unsafe { $inner(row, q) }
        }
    };
}

safe_wrapper4!(q8_0_dot4, avx2::dot4_q8_0);
safe_wrapper4!(q4_0_dot4, avx2::dot4_q4_0);
safe_wrapper4!(q4_1_dot4, avx2::dot4_q4_1);

/// The AVX2 1×4 tiles for the block types (q8_0, q4_0, q4_1).
pub fn avx2_tiles() -> Option<[Dot4Fn; 3]> {
    has_avx2().then_some([q8_0_dot4, q4_0_dot4, q4_1_dot4])
}

/// The AVX2 dot products by dtype order of `DType::ALL`, or `None` when the
/// CPU lacks a required feature.
pub fn avx2_table() -> Option<[DotFn; 6]> {
    has_avx2().then_some([f32_dot, bf16_dot, f16_dot, q8_0_dot, q4_0_dot, q4_1_dot])
}

macro_rules! safe_group {
    ($one:ident, $four:ident, $inner1:path, $inner4:path) => {
        fn $one(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
            // SAFETY: as `safe_wrapper`: installed only after `has_avx2()`.
            unsafe { $inner1(group, q) }
        }
        fn $four(group: &[u8], q: &[&[BlockQ8]], out: &mut [[f32; 8]]) {
            // SAFETY: as `safe_wrapper`: installed only after `has_avx2()`.
            unsafe { $inner4(group, q, out) }
        }
    };
}

safe_group!(q8_0x8_gemv, q8_0x8_gemm4, avx2::gemv8_q8_0, avx2::gemm8x4_q8_0);
safe_group!(q4_0x8_gemv, q4_0x8_gemm4, avx2::gemv8_q4_0, avx2::gemm8x4_q4_0);
safe_group!(q4_1x8_gemv, q4_1x8_gemm4, avx2::gemv8_q4_1, avx2::gemm8x4_q4_1);

/// The AVX2 kernels for the interleaved types (q8_0x8, q4_0x8, q4_1x8).
pub fn avx2_groups() -> Option<[GroupKernels; 3]> {
    has_avx2().then_some([
        GroupKernels { one: q8_0x8_gemv, many: Some(q8_0x8_gemm4) },
        GroupKernels { one: q4_0x8_gemv, many: Some(q4_0x8_gemm4) },
        GroupKernels { one: q4_1x8_gemv, many: Some(q4_1x8_gemm4) },
    ])
}

fn f32_axpy(o: &mut [f32], a: f32, v: &[u8]) {
    // SAFETY: as `safe_wrapper`: installed only after `has_avx2()`.
    unsafe { avx2::axpy_f32(o, a, v) }
}

fn f16_axpy(o: &mut [f32], a: f32, v: &[u8]) {
    // SAFETY: as `safe_wrapper`: installed only after `has_avx2()`.
    unsafe { avx2::axpy_f16(o, a, v) }
}

/// The AVX2 `o += a · v` for f32 and f16 `v`.
pub fn avx2_axpy() -> Option<[AxpyFn; 2]> {
    has_avx2().then_some([f32_axpy, f16_axpy])
}
