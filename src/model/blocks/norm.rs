//! RMSNorm.

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
