//! aarch64 kernels (NEON, part of the baseline of every aarch64 target Rust
//! supports, still detected at run time for symmetry with x86_64). The
//! functions here are safe wrappers over `unsafe` NEON kernels, reachable
//! only through [`Neon::kernels`]; an [`Neon`] is made only by
//! [`Neon::detect`]. Types without a NEON kernel use the scalar entry, named
//! in the table so that each choice is visible.

use super::{DeltaFn, DotFn, Gemv8Fn, GroupKernels, Layout, SsmFn, TypeKernels, scalar};
use crate::quant::DType;
use crate::quant::act::BlockQ8;

mod delta;
mod neon;

/// Proof that this CPU runs the NEON table: only [`Neon::detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub struct Neon(());

impl Neon {
    /// `Some` when this CPU has NEON.
    pub fn detect() -> Option<Neon> {
        std::arch::is_aarch64_feature_detected!("neon").then_some(Neon(()))
    }

    /// The NEON step of the gated delta rule.
    pub fn delta_fn(self) -> DeltaFn {
        delta_step
    }

    /// The NEON step of Mamba2's scan.
    pub fn ssm_fn(self) -> SsmFn {
        ssm_step
    }

    /// The NEON kernels of `dtype` (row dots one token at a time, group
    /// kernels one token at a time: prefill calls them per token).
    pub fn kernels(self, dtype: DType) -> TypeKernels {
        let dot =
            |dot: DotFn| TypeKernels { layout: Layout::Rows { dot, tile: None, dots: None }, ..scalar::kernels(dtype) };
        let group = |one: Gemv8Fn| TypeKernels {
            layout: Layout::Groups(GroupKernels { one, many: None, tile: None, direct: None }),
            ..scalar::kernels(dtype)
        };
        match dtype {
            DType::F32 => dot(f32_dot),
            DType::Bf16 => dot(bf16_dot),
            DType::F16 => scalar::kernels(DType::F16),
            DType::Q8_0 => dot(q8_0_dot),
            DType::Q4_0 => scalar::kernels(DType::Q4_0),
            DType::Q4_1 => scalar::kernels(DType::Q4_1),
            DType::Q8_0x8 => group(q8_0x8_gemv),
            DType::Q4_0x8 => group(q4_0x8_gemv),
            DType::Q4_1x8 => group(q4_1x8_gemv),
            DType::Mxfp4 => scalar::kernels(DType::Mxfp4),
            DType::Mxfp4x8 => group(mxfp4x8_gemv),
            DType::Q4K => dot(q4k_dot),
            DType::Q5K => dot(q5k_dot),
            DType::Q6K => dot(q6k_dot),
            DType::Q4Kx8 => group(q4kx8_gemv),
            DType::Q5Kx8 => group(q5kx8_gemv),
            DType::Q6Kx8 => group(q6kx8_gemv),
        }
    }
}

// SAFETY (every block below): reachable only through `Neon::kernels`, which
// needs a `Neon`, made only by `Neon::detect` after NEON was detected.

fn f32_dot(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::dot_f32(row, x, q) }
}

fn q4k_dot(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::dot_q4k(row, x, q) }
}

fn q5k_dot(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::dot_q5k(row, x, q) }
}

fn q6k_dot(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::dot_q6k(row, x, q) }
}

fn bf16_dot(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::dot_bf16(row, x, q) }
}

fn q8_0_dot(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::dot_q8_0(row, x, q) }
}

fn q8_0x8_gemv(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::gemv8_q8_0(group, q) }
}

fn q4_0x8_gemv(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::gemv8_q4_0(group, q) }
}

fn q4_1x8_gemv(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::gemv8_q4_1(group, q) }
}

fn mxfp4x8_gemv(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::gemv8_mxfp4(group, q) }
}

fn q4kx8_gemv(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::gemv8_q4k(group, q) }
}

fn q5kx8_gemv(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::gemv8_q5k(group, q) }
}

fn q6kx8_gemv(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    // SAFETY: NEON was detected (see above).
    unsafe { neon::gemv8_q6k(group, q) }
}

fn delta_step(s: &mut [f32], decay: &[f32], k: &[f32], v: &[f32], beta: f32, q: &[f32], out: &mut [f32]) {
    // SAFETY: NEON was detected (see above).
    unsafe { delta::delta_step(s, decay, k, v, beta, q, out) }
}

#[allow(clippy::too_many_arguments)]
fn ssm_step(s: &mut [f32], decay: f32, dt: f32, b: &[f32], x: &[f32], c: &[f32], d: f32, out: &mut [f32]) {
    // SAFETY: NEON was detected (see above).
    unsafe { delta::ssm_step(s, decay, dt, b, x, c, d, out) }
}
