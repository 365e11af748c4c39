//! Rotary position embedding, "rotate half" layout (as transformers'
//! `rotate_half`): dimension i of a head pairs with dimension i + R/2, where R
//! is the rotary width; dimensions past R pass through unchanged.

use crate::canonical::config::{RopeScaling, RopeSpec};

/// Inverse frequencies and magnitude for one model, computed at load.
#[derive(Clone, Debug)]
pub struct Rope {
    /// R/2 inverse frequencies.
    pub inv_freq: Vec<f32>,
    /// Multiplier on cos and sin (YaRN's attention factor; 1 otherwise).
    pub magnitude: f32,
    /// Rotate adjacent pairs (2i, 2i+1) instead of halves (i, i + R/2).
    pub interleaved: bool,
    /// LongRoPE: past this sequence length the magnitude becomes the second value.
    pub long: Option<(usize, f32)>,
}

impl Rope {
    /// Builds the frequency ladder for `spec`, following the variant's rule.
    pub fn new(spec: &RopeSpec) -> Rope {
        let (inv_freq, magnitude) = Self::ladder(spec);
        let long = match &spec.scaling {
            RopeScaling::LongRope { original_max_position_embeddings, long_mscale, .. } => {
                Some((*original_max_position_embeddings, *long_mscale as f32))
            }
            _ => None,
        };
        Rope { inv_freq, magnitude, interleaved: spec.interleaved, long }
    }

    /// Rotates the first R dimensions of one head in the model's layout.
    #[inline]
    pub fn rotate(&self, head: &mut [f32], cos: &[f32], sin: &[f32]) {
        if self.interleaved { apply_pairs(head, cos, sin) } else { apply(head, cos, sin) }
    }

    fn ladder(spec: &RopeSpec) -> (Vec<f32>, f32) {
        let r = spec.rotary_dim;
        // θ^(2i/R) in f32, as transformers computes it.
        let base: Vec<f32> =
            (0..r / 2).map(|i| crate::math::powf(spec.theta as f32, (2 * i) as f32 / r as f32)).collect();
        let plain: Vec<f32> = base.iter().map(|b| 1.0 / b).collect();
        match &spec.scaling {
            RopeScaling::None => (plain, 1.0),
            RopeScaling::LongRope { short_factor, short_mscale, .. } => {
                // 1 / (f · θ^(2i/R)), in f32 as transformers computes it.
                let f = base.iter().zip(short_factor).map(|(b, &f)| 1.0 / (f as f32 * b)).collect();
                (f, *short_mscale as f32)
            }
            RopeScaling::Linear { factor } => (plain.iter().map(|f| f / *factor as f32).collect(), 1.0),
            RopeScaling::Proportional { factor, angles } => {
                // The first `angles` frequencies of the whole head's ladder turn; the rest are 0
                // (cos 1, sin 0: those pairs pass through unchanged).
                let f = plain.iter().enumerate().map(|(i, f)| if i < *angles { f / *factor as f32 } else { 0.0 });
                (f.collect(), 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                // The dimension whose wavelength completes `rot` rotations over the original context.
                let dim_for = |rot: f64| {
                    (r as f64
                        * crate::math::ln(
                            *original_max_position_embeddings as f64 / (rot * 2.0 * std::f64::consts::PI),
                        ))
                        / (2.0 * crate::math::ln(spec.theta))
                };
                let (mut lo, mut hi) = (dim_for(*beta_fast), dim_for(*beta_slow));
                if *truncate {
                    lo = lo.floor();
                    hi = hi.ceil();
                }
                let lo = lo.max(0.0);
                let hi = hi.min(r as f64 - 1.0);
                let hi = if lo == hi { hi + 0.001 } else { hi };
                let inv_freq = (0..r / 2)
                    .map(|i| {
                        let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0) as f32;
                        let extrapolate = 1.0 - ramp;
                        let interp = 1.0 / (*factor as f32 * base[i]);
                        interp * (1.0 - extrapolate) + plain[i] * extrapolate
                    })
                    .collect();
                (inv_freq, *attention_factor as f32)
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = *original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                let inv_freq = plain
                    .iter()
                    .map(|&f| {
                        let f = f as f64;
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .map(|f| f as f32)
                    .collect();
                (inv_freq, 1.0)
            }
        }
    }

    /// Fills `cos` and `sin` (each R/2 long) for position `pos` of a call
    /// whose sequence ends at length `seq_len` (only LongRoPE looks at it).
    pub fn angles(&self, pos: usize, seq_len: usize, cos: &mut [f32], sin: &mut [f32]) {
        let magnitude = match self.long {
            Some((original, long)) if seq_len > original => long,
            _ => self.magnitude,
        };
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let a = (pos as f32 * f) as f64;
            *c = crate::math::cos(a) as f32 * magnitude;
            *s = crate::math::sin(a) as f32 * magnitude;
        }
    }
}

/// Rotates one head vector in place with precomputed `cos`/`sin` (R/2 each).
#[inline]
pub fn apply(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (a, b) = head[..2 * half].split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] - x2 * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

/// As [`apply`] for the interleaved layout: dimensions 2i and 2i+1 rotate
/// together by angle i. (transformers' DeepSeek code de-interleaves q and k
/// and then rotates halves; scores only see the dot product, which is the
/// same for both orders as long as q and k agree.)
#[inline]
pub fn apply_pairs(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    for (i, p) in head[..2 * cos.len()].chunks_exact_mut(2).enumerate() {
        let (x1, x2) = (p[0], p[1]);
        p[0] = x1 * cos[i] - x2 * sin[i];
        p[1] = x2 * cos[i] + x1 * sin[i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(scaling: RopeScaling) -> RopeSpec {
        RopeSpec { theta: 10000.0, rotary_dim: 8, scaling, interleaved: false }
    }

    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() {
        let rope = Rope::new(&spec(RopeScaling::None));
        let (mut c, mut s) = (vec![0.0; 4], vec![0.0; 4]);
        let x: Vec<f32> = (0..10).map(|i| i as f32 * 0.3 - 1.0).collect();
        rope.angles(0, 1, &mut c, &mut s);
        let mut y = x.clone();
        apply(&mut y, &c, &s);
        assert_eq!(x, y);
        rope.angles(17, 18, &mut c, &mut s);
        apply(&mut y, &c, &s);
        let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((n(&x) - n(&y)).abs() < 1e-4);
        assert_eq!(x[8..], y[8..], "dims past the rotary width pass through");
    }

    #[test]
    fn relative_positions_give_equal_dot_products() {
        // <R(p)q, R(p+k)k> depends only on the offset, the property RoPE exists for.
        let rope = Rope::new(&spec(RopeScaling::None));
        let q: Vec<f32> = (0..8).map(|i| (i as f32).sin()).collect();
        let k: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).cos()).collect();
        let dot_at = |p: usize| {
            let (mut c, mut s) = (vec![0.0; 4], vec![0.0; 4]);
            let (mut a, mut b) = (q.clone(), k.clone());
            rope.angles(p, p + 1, &mut c, &mut s);
            apply(&mut a, &c, &s);
            rope.angles(p + 3, p + 4, &mut c, &mut s);
            apply(&mut b, &c, &s);
            a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>()
        };
        assert!((dot_at(0) - dot_at(11)).abs() < 1e-4);
    }

    #[test]
    fn proportional_rope_turns_only_its_first_pairs_over_the_whole_head() {
        let spec = RopeSpec {
            theta: 10000.0,
            rotary_dim: 16,
            scaling: RopeScaling::Proportional { factor: 1.0, angles: 2 },
            interleaved: false,
        };
        let rope = Rope::new(&spec);
        // Exponents over the whole head (16), not over the 4 rotated dimensions.
        assert_eq!(rope.inv_freq[0], 1.0);
        assert!((rope.inv_freq[1] - 1.0 / 10000f32.powf(2.0 / 16.0)).abs() < 1e-7);
        assert!(rope.inv_freq[2..].iter().all(|&f| f == 0.0));
        let (mut c, mut s) = (vec![0.0; 8], vec![0.0; 8]);
        rope.angles(5, 6, &mut c, &mut s);
        let x: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 1.0).collect();
        let mut y = x.clone();
        apply(&mut y, &c, &s);
        for i in [2, 3, 4, 5, 6, 7] {
            assert_eq!((x[i], x[i + 8]), (y[i], y[i + 8]), "pair {i} passes through");
        }
        assert_ne!((x[1], x[9]), (y[1], y[9]), "pair 1 (dims 1 and 9) turns");
    }

    #[test]
    fn linear_scaling_divides_frequencies() {
        let a = Rope::new(&spec(RopeScaling::None));
        let b = Rope::new(&spec(RopeScaling::Linear { factor: 4.0 }));
        for (x, y) in a.inv_freq.iter().zip(&b.inv_freq) {
            assert!((x / 4.0 - y).abs() < 1e-9);
        }
    }
}
