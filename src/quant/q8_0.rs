//! q8_0: blocks of 32 weights as signed bytes with one f16 scale.
//! `w[i] = d * qs[i]`, with `d = max|w| / 127`. 8.5 bits per weight.

use half::f16;

/// Weights per block.
pub const QK: usize = 32;

/// One block as stored in the file.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ8_0 {
    /// Scale, f16 bits.
    pub d: u16,
    /// Quantised weights.
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

/// Quantises `src` (a multiple of 32 long) into `dst`, rounding to nearest.
pub fn quantize(src: &[f32], dst: &mut [BlockQ8_0]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        b.d = f16::from_f32(d).to_bits();
        for (q, v) in b.qs.iter_mut().zip(x) {
            *q = (v * id).round().clamp(-127.0, 127.0) as i8;
        }
    }
}

/// Expands blocks back to f32.
pub fn dequantize(src: &[BlockQ8_0], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16::from_bits(b.d).to_f32();
        for (o, q) in y.iter_mut().zip(b.qs) {
            *o = d * q as f32;
        }
    }
}
