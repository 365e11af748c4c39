//! q4_0: blocks of 32 weights as 4-bit codes with one f16 scale.
//! `w[i] = d * (code[i] - 8)`; byte j holds element j in its low nibble and
//! element j + 16 in its high nibble (the GGML layout, so a 16-byte load
//! unpacks into elements 0..16 and 16..32 with one mask and one shift).
//! The scale maps the weight of largest magnitude to -8, using the full
//! range on that side. 4.5 bits per weight.

use half::f16;

/// Weights per block.
pub const QK: usize = 32;

/// One block as stored in the file.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4_0 {
    /// Scale, f16 bits.
    pub d: u16,
    /// Packed codes.
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

/// Quantises `src` (a multiple of 32 long) into `dst`.
pub fn quantize(src: &[f32], dst: &mut [BlockQ4_0]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        // The signed value of largest magnitude becomes -8.
        let max = x.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = f16::from_f32(d).to_bits();
        let code = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
        for j in 0..QK / 2 {
            b.qs[j] = code(x[j]) | (code(x[j + QK / 2]) << 4);
        }
    }
}

/// Expands blocks back to f32.
pub fn dequantize(src: &[BlockQ4_0], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16::from_bits(b.d).to_f32();
        for j in 0..QK / 2 {
            y[j] = d * ((b.qs[j] & 0xF) as i32 - 8) as f32;
            y[j + QK / 2] = d * ((b.qs[j] >> 4) as i32 - 8) as f32;
        }
    }
}

/// [`quantize`] minimising `Σ wᵢ·(xᵢ − x̂ᵢ)²` for per-value weights `w`
/// (an importance matrix's column weights, repeated for every row): a few
/// scales around the largest weight's, each refined once by the weighted
/// least-squares scale for its codes, the best kept.
pub fn quantize_weighted(src: &[f32], w: &[f32], dst: &mut [BlockQ4_0]) {
    for ((x, w), b) in src.chunks_exact(QK).zip(w.chunks_exact(QK)).zip(dst.iter_mut()) {
        let max = x.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let codes = |d: f32, c: &mut [i32; QK]| {
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (c, &v) in c.iter_mut().zip(x) {
                *c = ((v * id + 8.5) as i32).clamp(0, 15) - 8;
            }
        };
        let error = |d: f32, c: &[i32; QK]| -> f32 {
            c.iter().zip(x).zip(w).map(|((&q, &v), &w)| w * (v - d * q as f32) * (v - d * q as f32)).sum()
        };
        let mut best = (f16::from_f32(max / -8.0).to_f32(), f32::INFINITY);
        let mut c = [0i32; QK];
        for k in -8..=8 {
            let d0 = max / (-8.0 + 0.25 * k as f32);
            codes(d0, &mut c);
            // The weighted least-squares scale for these codes.
            let (num, den) = c
                .iter()
                .zip(x)
                .zip(w)
                .fold((0f32, 0f32), |(n, dd), ((&q, &v), &w)| (n + w * v * q as f32, dd + w * (q * q) as f32));
            for d in [d0, if den > 0.0 { num / den } else { d0 }] {
                let d = f16::from_f32(d).to_f32();
                if !d.is_finite() {
                    continue;
                }
                codes(d, &mut c);
                let e = error(d, &c);
                if e < best.1 {
                    best = (d, e);
                }
            }
        }
        let d = best.0;
        codes(d, &mut c);
        b.d = f16::from_f32(d).to_bits();
        for j in 0..QK / 2 {
            b.qs[j] = (c[j] + 8) as u8 | (((c[j + QK / 2] + 8) as u8) << 4);
        }
    }
}
