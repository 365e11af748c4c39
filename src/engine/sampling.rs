//! Choosing the next token from logits. Greedy at temperature 0; otherwise a
//! draw from softmax(logits / temperature) with a seeded generator, so the
//! same seed gives the same tokens whatever the thread count.

/// SplitMix64: tiny, fast, and good enough for sampling.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Index of the largest logit (the first one on ties, as torch.argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Samples a token: greedy when `temperature <= 0`, else from the tempered softmax.
pub fn sample(logits: &[f32], temperature: f32, rng: &mut Rng) -> u32 {
    if temperature <= 0.0 {
        return argmax(logits);
    }
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| (((l - m) / temperature) as f64).exp()).sum();
    let mut u = rng.next_f64() * z;
    for (i, &l) in logits.iter().enumerate() {
        u -= (((l - m) / temperature) as f64).exp();
        if u <= 0.0 {
            return i as u32;
        }
    }
    argmax(logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_max() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(sample(&[1.0, 3.0, 2.0], 0.0, &mut Rng::new(1)), 1);
    }

    #[test]
    fn sampling_follows_the_distribution_and_the_seed() {
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let mut rng = Rng::new(42);
        let mut counts = [0usize; 3];
        for _ in 0..20000 {
            counts[sample(&logits, 1.0, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        let frac = counts[1] as f64 / 20000.0;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
        let a: Vec<u32> = {
            let mut r = Rng::new(7);
            (0..20).map(|_| sample(&logits, 1.0, &mut r)).collect()
        };
        let b: Vec<u32> = {
            let mut r = Rng::new(7);
            (0..20).map(|_| sample(&logits, 1.0, &mut r)).collect()
        };
        assert_eq!(a, b);
    }
}
