//! aarch64 kernels (NEON, part of the baseline of every aarch64 target Rust
//! supports, still detected at run time for symmetry with x86_64). Types
//! without a NEON kernel here use the scalar reference.

use super::{BlockQ8, DotFn, GroupKernels, SCALAR};

mod neon;

fn f32_dot(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
    // SAFETY: only installed by `neon_table` after NEON was detected.
    unsafe { neon::dot_f32(row, x, q) }
}

fn bf16_dot(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
    // SAFETY: only installed by `neon_table` after NEON was detected.
    unsafe { neon::dot_bf16(row, x, q) }
}

fn q8_0_dot(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
    // SAFETY: only installed by `neon_table` after NEON was detected.
    unsafe { neon::dot_q8_0(row, x, q) }
}

/// NEON kernels where they exist, scalar elsewhere; `None` without NEON.
pub fn neon_table() -> Option<[DotFn; 6]> {
    if !std::arch::is_aarch64_feature_detected!("neon") {
        return None;
    }
    let mut t = SCALAR;
    t[0] = f32_dot;
    t[1] = bf16_dot;
    t[3] = q8_0_dot;
    Some(t)
}

fn q8_0x8_gemv(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    // SAFETY: only installed by `neon_groups` after NEON was detected.
    unsafe { neon::gemv8_q8_0(group, q) }
}

fn q4_0x8_gemv(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    // SAFETY: only installed by `neon_groups` after NEON was detected.
    unsafe { neon::gemv8_q4_0(group, q) }
}

fn q4_1x8_gemv(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    // SAFETY: only installed by `neon_groups` after NEON was detected.
    unsafe { neon::gemv8_q4_1(group, q) }
}

/// NEON kernels for the interleaved types (one token at a time: prefill
/// calls them per token); `None` without NEON.
pub fn neon_groups() -> Option<[GroupKernels; 3]> {
    std::arch::is_aarch64_feature_detected!("neon").then_some([
        GroupKernels { one: q8_0x8_gemv, many: None },
        GroupKernels { one: q4_0x8_gemv, many: None },
        GroupKernels { one: q4_1x8_gemv, many: None },
    ])
}
