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

/// [`quantize`] minimising `Σ wᵢ·(xᵢ − x̂ᵢ)²` for per-value weights `w`:
/// the max-abs scale and slightly smaller ones (clipping the largest
/// weight a little can lower the weighted error of the rest), each refined
/// by the weighted least-squares scale for its codes.
pub fn quantize_weighted(src: &[f32], w: &[f32], dst: &mut [BlockQ8_0]) {
    for ((x, w), b) in src.chunks_exact(QK).zip(w.chunks_exact(QK)).zip(dst.iter_mut()) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let codes = |d: f32, q: &mut [i8; QK]| {
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (q, v) in q.iter_mut().zip(x) {
                *q = (v * id).round().clamp(-127.0, 127.0) as i8;
            }
        };
        let error = |d: f32, q: &[i8; QK]| -> f32 {
            q.iter().zip(x).zip(w).map(|((&q, &v), &w)| w * (v - d * q as f32) * (v - d * q as f32)).sum()
        };
        let mut q = [0i8; QK];
        let mut best = (f16::from_f32(amax / 127.0).to_f32(), f32::INFINITY);
        for k in 0..6 {
            let d0 = amax / (127.0 + 2.0 * k as f32);
            codes(d0, &mut q);
            let (num, den) =
                q.iter().zip(x).zip(w).fold((0f32, 0f32), |(n, dd), ((&q, &v), &w)| {
                    (n + w * v * q as f32, dd + w * (q as f32) * (q as f32))
                });
            for d in [d0, if den > 0.0 { num / den } else { d0 }] {
                let d = f16::from_f32(d).to_f32();
                if !(d.is_finite() && d >= 0.0) {
                    continue;
                }
                codes(d, &mut q);
                let e = error(d, &q);
                if e < best.1 {
                    best = (d, e);
                }
            }
        }
        codes(best.0, &mut q);
        b.d = f16::from_f32(best.0).to_bits();
        b.qs = q;
    }
}
