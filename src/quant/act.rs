//! The activation block: an activation row quantised to 8 bits per value
//! in blocks of 32, the form every block-quantised weight type is multiplied
//! against (ggml's `block_q8_0`-style activation, kept beside the weight
//! blocks it meets). The reference quantiser is here; the kernel tables'
//! SIMD quantisers reproduce it bit for bit.

/// 32 activations quantised to signed bytes: `x ≈ d · qs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ8 {
    /// Scale.
    pub d: f32,
    /// Σ qs (weight types with an offset, or codes stored unsigned, need it).
    pub sum: i32,
    /// Codes, in [-127, 127].
    pub qs: [i8; 32],
}

impl BlockQ8 {
    /// `d · Σ qs`: the block's sum in activation units.
    #[inline(always)]
    pub fn scaled_sum(&self) -> f32 {
        self.d * self.sum as f32
    }
}
const _: () = assert!(std::mem::size_of::<BlockQ8>() == 40);

/// `x.round() as i8` (half away from zero, saturating; NaN gives 0),
/// without the libm call `round` costs on x86_64: clamp to the codes' range
/// (so infinities saturate too), truncate, then step by the exact remainder.
/// The SIMD activation quantisers of `crate::kernels` do the same steps.
#[inline(always)]
pub fn round_i8(x: f32) -> i8 {
    let x = if x.is_nan() { 0.0 } else { x.clamp(-128.0, 127.0) };
    let t = x as i32;
    let f = x - t as f32;
    (t + (f >= 0.5) as i32 - (f <= -0.5) as i32).clamp(-128, 127) as i8
}

/// Quantises one activation row (a multiple of 32 long) to 8-bit blocks:
/// `x ≈ d · q`, with the code sum `Σq` kept for offset types. The reference
/// every kernel table's quantiser gives bit for bit.
pub fn quantize_act(x: &[f32], out: &mut [BlockQ8]) {
    for (xs, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in b.qs.iter_mut().zip(xs) {
            *q = round_i8(v * id);
            sum += *q as i32;
        }
        b.d = d;
        b.sum = sum;
    }
}
