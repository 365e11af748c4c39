//! q4_1: blocks of 32 weights as 4-bit codes with an f16 scale AND an f16
//! minimum: `w[i] = d * code[i] + m`. The offset lets the 16 levels cover the
//! block's actual range [min, max] instead of a symmetric [-max, max]: on
//! symmetric Gaussian weights that lowers the RMS error of q4_0 by about a
//! sixth, on skewed blocks by more than half. Nibble layout as q4_0.
//! 5 bits per weight.
//!
//! The scale search tries a few shrunken ranges around [min, max] and keeps
//! the one with the smallest squared error (clipping a lone outlier often
//! pays for itself across the other 31 weights).

use half::f16;

/// Weights per block.
pub const QK: usize = 32;

/// One block as stored in the file.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4_1 {
    /// Scale, f16 bits.
    pub d: u16,
    /// Minimum (offset), f16 bits.
    pub m: u16,
    /// Packed codes.
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

fn encode_with(x: &[f32], lo: f32, hi: f32) -> (f32, f32, [u8; QK], f32) {
    // Round d and m through f16 first so the error is measured as stored.
    let d = f16::from_f32((hi - lo) / 15.0).to_f32();
    let m = f16::from_f32(lo).to_f32();
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut codes = [0u8; QK];
    let mut err = 0.0;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = ((v - m) * id).round().clamp(0.0, 15.0) as u8;
        let e = d * *c as f32 + m - v;
        err += e * e;
    }
    (d, m, codes, err)
}

/// Quantises `src` (a multiple of 32 long) into `dst`.
pub fn quantize(src: &[f32], dst: &mut [BlockQ4_1]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let lo = x.iter().cloned().fold(f32::INFINITY, f32::min);
        let hi = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut best = encode_with(x, lo, hi);
        for k in 1..=6 {
            let s = 1.0 - 0.03 * k as f32;
            for (l, h) in [(lo * s, hi), (lo, hi * s), (lo * s, hi * s)] {
                let c = encode_with(x, l, h);
                if c.3 < best.3 {
                    best = c;
                }
            }
        }
        let (d, m, codes, _) = best;
        b.d = f16::from_f32(d).to_bits();
        b.m = f16::from_f32(m).to_bits();
        for j in 0..QK / 2 {
            b.qs[j] = codes[j] | (codes[j + QK / 2] << 4);
        }
    }
}

/// Expands blocks back to f32.
pub fn dequantize(src: &[BlockQ4_1], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16::from_bits(b.d).to_f32();
        let m = f16::from_bits(b.m).to_f32();
        for j in 0..QK / 2 {
            y[j] = d * (b.qs[j] & 0xF) as f32 + m;
            y[j + QK / 2] = d * (b.qs[j] >> 4) as f32 + m;
        }
    }
}

/// [`quantize`] minimising `Σ wᵢ·(xᵢ − x̂ᵢ)²` for per-value weights `w`:
/// the same ranges as [`quantize`], each followed by the weighted
/// least-squares `(d, m)` for its codes (the 2×2 normal equations), every
/// candidate measured as stored (f16) and the best kept.
pub fn quantize_weighted(src: &[f32], w: &[f32], dst: &mut [BlockQ4_1]) {
    for ((x, w), b) in src.chunks_exact(QK).zip(w.chunks_exact(QK)).zip(dst.iter_mut()) {
        let lo = x.iter().cloned().fold(f32::INFINITY, f32::min);
        let hi = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let measure = |d: f32, m: f32| -> Option<(f32, f32, [u8; QK], f32)> {
            let (d, m) = (f16::from_f32(d).to_f32(), f16::from_f32(m).to_f32());
            if !(d.is_finite() && m.is_finite()) {
                return None;
            }
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut codes = [0u8; QK];
            let mut err = 0.0;
            for ((c, &v), &w) in codes.iter_mut().zip(x).zip(w) {
                *c = ((v - m) * id).round().clamp(0.0, 15.0) as u8;
                let e = d * *c as f32 + m - v;
                err += w * e * e;
            }
            Some((d, m, codes, err))
        };
        let mut best = measure((hi - lo) / 15.0, lo).expect("finite input gives a finite range");
        let mut ranges = vec![(lo, hi)];
        for k in 1..=6 {
            let s = 1.0 - 0.03 * k as f32;
            ranges.extend([(lo * s, hi), (lo, hi * s), (lo * s, hi * s)]);
        }
        for (l, h) in ranges {
            let Some(c) = measure((h - l) / 15.0, l) else { continue };
            // Weighted least squares of x ≈ d·c + m over the block.
            let (mut sw, mut sc, mut scc, mut sx, mut scx) = (0f64, 0f64, 0f64, 0f64, 0f64);
            for ((&q, &v), &w) in c.2.iter().zip(x).zip(w) {
                let (q, v, w) = (q as f64, v as f64, w as f64);
                sw += w;
                sc += w * q;
                scc += w * q * q;
                sx += w * v;
                scx += w * q * v;
            }
            let det = sw * scc - sc * sc;
            let refined = if det > 1e-12 * sw * scc.max(1e-30) {
                let d = (sw * scx - sc * sx) / det;
                let m = (sx - d * sc) / sw;
                (d > 0.0).then(|| measure(d as f32, m as f32)).flatten()
            } else {
                None
            };
            for cand in [Some(c), refined].into_iter().flatten() {
                if cand.3 < best.3 {
                    best = cand;
                }
            }
        }
        let (d, m, codes, _) = best;
        b.d = f16::from_f32(d).to_bits();
        b.m = f16::from_f32(m).to_bits();
        for j in 0..QK / 2 {
            b.qs[j] = codes[j] | (codes[j + QK / 2] << 4);
        }
    }
}
