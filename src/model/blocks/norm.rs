//! RMSNorm and LayerNorm.

use crate::canonical::config::{NormKind, NormSpec};

/// The model's norm of one row: RMSNorm, or LayerNorm when `bias` is given
/// (LayerNorm always has one in the supported models).
pub fn norm(spec: NormSpec, x: &[f32], w: &[f32], bias: Option<&[f32]>, out: &mut [f32]) {
    match (spec.kind, bias) {
        (NormKind::Layer, Some(b)) => layernorm(x, w, b, spec.eps, out),
        _ => rmsnorm(x, w, spec.eps, out),
    }
}

/// [`norm`] of each D-wide row of `x` into `out`.
pub fn norm_rows(spec: NormSpec, x: &[f32], w: &[f32], bias: Option<&[f32]>, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        norm(spec, xr, w, bias, or);
    }
}

/// `out = (x − mean) / sqrt(var + eps) * w + b` (biased variance, as torch),
/// statistics in f64.
pub fn layernorm(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean) * (v as f64 - mean)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    for (((o, &v), &g), &c) in out.iter_mut().zip(x).zip(w).zip(b) {
        *o = ((v as f64 - mean) * inv) as f32 * g + c;
    }
}

/// `out = x / sqrt(mean(x²) + eps) * w` for one row; the mean square is
/// accumulated in f64 so long rows do not lose precision.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert!(x.len() == w.len() && x.len() == out.len());
    let ms = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64;
    let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

/// RMSNorm of each `w.len()`-wide row of `x`, in place.
pub fn rmsnorm_rows_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for row in x.chunks_exact_mut(n) {
        let ms = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / n as f64;
        let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
        for (v, &g) in row.iter_mut().zip(w) {
            *v = *v * inv * g;
        }
    }
}

/// RMSNorm without a weight of each `width`-wide row of `x`, in place
/// (Gemma 4's value norm).
pub fn rms_rows_unweighted_inplace(x: &mut [f32], width: usize, eps: f32) {
    for row in x.chunks_exact_mut(width) {
        let ms = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / width as f64;
        let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_rms_after_norm() {
        let x: Vec<f32> = (0..37).map(|i| i as f32 - 11.5).collect();
        let w = vec![1.0; 37];
        let mut y = vec![0.0; 37];
        rmsnorm(&x, &w, 0.0, &mut y);
        let rms = (y.iter().map(|v| v * v).sum::<f32>() / 37.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-5);
        let mut z = x.clone();
        rmsnorm_rows_inplace(&mut z, &w, 0.0);
        assert_eq!(y, z);
    }
}
