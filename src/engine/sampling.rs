//! Choosing the next token from logits.
//!
//! The logits pass through a fixed chain of processors, in the order
//! transformers applies them:
//!
//! 1. repetition penalty over every token seen so far (prompt and output):
//!    a positive logit is divided by the penalty, a negative one multiplied;
//! 2. presence and frequency penalties over the generated tokens only, with
//!    OpenAI's meaning: `l -= frequency · count + presence · [count > 0]`;
//! 3. at temperature 0 the answer is the argmax of the penalised logits;
//!    otherwise the logits are divided by the temperature;
//! 4. top-k keeps the k largest; top-p the shortest run of the sorted
//!    distribution whose mass reaches p; min-p drops every token whose
//!    probability is below `min_p ×` the largest one;
//! 5. one draw from the softmax of what is left, with a seeded generator.
//!
//! Every step runs on the calling thread, and every ordering is fixed by the
//! logits alone (ties go to the lower id), so a seed gives the same tokens
//! whatever the thread count. A [`Sampler`] holds all its buffers from
//! creation on: choosing a token allocates nothing.

use std::cmp::Ordering;

use crate::error::{Error, Result};

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

pub use crate::math::argmax;

/// How the next token is chosen. The neutral value of every knob switches it
/// off; [`SamplingParams::default`] is plain greedy decoding.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (argmax); otherwise the softmax temperature.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the most likely tokens up to this much probability mass, in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one, in [0, 1]; 0 = off.
    pub min_p: f32,
    /// transformers' repetition penalty over prompt and output, > 0; 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated; 0 = off.
    pub presence_penalty: f32,
    /// Subtracted from a generated token's logit once per time it was generated; 0 = off.
    pub frequency_penalty: f32,
    /// Seed of the random draw (unused when greedy).
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks every value is in range, naming the first one that is not.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidInput(msg));
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return bad(format!("temperature must be a finite number >= 0 (0 = greedy), got {t}"));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return bad(format!("top_p must be in (0, 1] (1 = off), got {p}"));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return bad(format!("min_p must be in [0, 1] (0 = off), got {m}"));
        }
        let r = self.repetition_penalty;
        if !r.is_finite() || r <= 0.0 {
            return bad(format!("repetition_penalty must be a finite number > 0 (1 = off), got {r}"));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !v.is_finite() {
                return bad(format!("{name} must be a finite number (0 = off), got {v}"));
            }
        }
        Ok(())
    }

    fn greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Higher score first, then lower id: a total order, so sorting and
/// selection give the same candidates whatever algorithm runs them.
fn by_score_desc(scores: &[f32]) -> impl Fn(&u32, &u32) -> Ordering + '_ {
    move |&a, &b| scores[b as usize].total_cmp(&scores[a as usize]).then(a.cmp(&b))
}

/// Sorting the whole vocabulary for top-p is wasted work when the mass is
/// concentrated: the top `TOP_P_PREFIX` candidates are sorted first and the
/// full sort runs only if they do not reach the threshold.
const TOP_P_PREFIX: usize = 1024;

/// Chooses tokens for one generation, remembering what it has seen for the
/// penalties. Create one per call with [`Sampler::new`].
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// [V] times each token was generated (empty when no presence/frequency penalty).
    counts: Vec<u32>,
    /// Distinct generated tokens, in order of first appearance.
    generated: Vec<u32>,
    /// [V] whether a token is in the prompt or the output (empty without repetition penalty).
    seen: Vec<bool>,
    /// Distinct seen tokens.
    seen_ids: Vec<u32>,
    /// [V] the logits being processed.
    scores: Vec<f32>,
    /// [≤ V] ids still in the running.
    cand: Vec<u32>,
}

impl Sampler {
    /// A sampler for a vocabulary of `vocab` tokens continuing `prompt`.
    /// Fails if a parameter is out of range.
    pub fn new(params: SamplingParams, vocab: usize, prompt: &[u32]) -> Result<Sampler> {
        params.validate()?;
        let penalise_counts = params.presence_penalty != 0.0 || params.frequency_penalty != 0.0;
        let penalise_seen = params.repetition_penalty != 1.0;
        let mut s = Sampler {
            rng: Rng::new(params.seed),
            counts: if penalise_counts { vec![0; vocab] } else { Vec::new() },
            generated: Vec::new(),
            seen: if penalise_seen { vec![false; vocab] } else { Vec::new() },
            seen_ids: Vec::new(),
            scores: vec![0.0; vocab],
            cand: Vec::with_capacity(vocab),
            params,
        };
        for &t in prompt {
            s.mark_seen(t);
        }
        Ok(s)
    }

    /// The parameters in use.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    fn mark_seen(&mut self, t: u32) {
        if let Some(flag) = self.seen.get_mut(t as usize)
            && !*flag
        {
            *flag = true;
            self.seen_ids.push(t);
        }
    }

    /// Records a token as generated, for the penalties of later steps.
    pub fn accept(&mut self, t: u32) {
        self.mark_seen(t);
        if let Some(c) = self.counts.get_mut(t as usize) {
            if *c == 0 {
                self.generated.push(t);
            }
            *c += 1;
        }
    }

    /// Chooses the next token from `logits` (`[V]`). Call [`Sampler::accept`]
    /// with the token actually used.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.choose(logits, None)
    }

    /// Chooses the next token among those `mask` allows: a bit set of `[V]`
    /// (bit `i % 32` of word `i / 32` for id `i`), at least one bit set.
    /// The mask applies after the penalties and before temperature, top-k,
    /// top-p and min-p, which then see only the allowed tokens; the draw
    /// takes one number from the generator as an unmasked one does, so a
    /// seed gives the same tokens run after run.
    pub fn sample_masked(&mut self, logits: &[f32], mask: &[u32]) -> u32 {
        self.choose(logits, Some(mask))
    }

    fn choose(&mut self, logits: &[f32], mask: Option<&[u32]>) -> u32 {
        debug_assert_eq!(logits.len(), self.scores.len());
        let p = &self.params;
        let s = &mut self.scores;
        s.copy_from_slice(logits);

        // Repetition penalty (transformers): shrink seen tokens towards "unlikely".
        let r = p.repetition_penalty;
        if r != 1.0 {
            for &t in &self.seen_ids {
                let l = &mut s[t as usize];
                *l = if *l < 0.0 { *l * r } else { *l / r };
            }
        }
        // Presence and frequency penalties (OpenAI), over generated tokens only.
        if !self.counts.is_empty() {
            for &t in &self.generated {
                let c = self.counts[t as usize] as f32;
                let l = &mut s[t as usize];
                *l = *l - p.frequency_penalty * c - p.presence_penalty;
            }
        }
        let cand = &mut self.cand;
        cand.clear();
        match mask {
            None if p.greedy() => return argmax(s),
            None => cand.extend(0..s.len() as u32),
            Some(mask) => {
                allowed(mask, s.len(), cand);
                if p.greedy() {
                    // The first allowed maximum; NaN scores never win.
                    let best = cand.iter().copied().reduce(|a, b| if s[b as usize] > s[a as usize] { b } else { a });
                    return best.unwrap_or(0);
                }
            }
        }

        // Temperature, then top-k over the whole vocabulary (or what the mask allows).
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_score_desc(s));
            cand.truncate(p.top_k);
        }
        for &t in cand.iter() {
            s[t as usize] /= p.temperature;
        }
        let max = cand.iter().map(|&t| s[t as usize]).fold(f32::NEG_INFINITY, f32::max);
        // e^(l − max), with the maximum itself at exactly 1 (also when it is
        // infinite: a tiny temperature overflows the logits) and NaN logits
        // at 0, so no weight is NaN and the most likely token always counts.
        let weight = |l: f32| {
            if l == max {
                return 1.0;
            }
            let w = crate::math::exp((l - max) as f64);
            if w.is_nan() { 0.0 } else { w }
        };

        // Top-p: keep a candidate while the mass strictly before it is below p.
        if p.top_p < 1.0 && cand.len() > 1 {
            let total: f64 = cand.iter().map(|&t| weight(s[t as usize])).sum();
            let need = p.top_p as f64 * total;
            let mut keep = None;
            if cand.len() > TOP_P_PREFIX {
                cand.select_nth_unstable_by(TOP_P_PREFIX - 1, by_score_desc(s));
                cand[..TOP_P_PREFIX].sort_unstable_by(by_score_desc(s));
                keep = top_p_cut(&cand[..TOP_P_PREFIX], s, &weight, need);
            }
            let keep = keep.unwrap_or_else(|| {
                cand.sort_unstable_by(by_score_desc(s));
                top_p_cut(cand, s, &weight, need).unwrap_or(cand.len())
            });
            cand.truncate(keep);
        }
        // Min-p: p_i >= min_p · p_max  <=>  exp(l_i - l_max) >= min_p.
        if p.min_p > 0.0 {
            let floor = p.min_p as f64;
            cand.retain(|&t| weight(s[t as usize]) >= floor);
        }

        // One draw from the softmax of the survivors.
        let total: f64 = cand.iter().map(|&t| weight(s[t as usize])).sum();
        let mut u = self.rng.next_f64() * total;
        for &t in cand.iter() {
            u -= weight(s[t as usize]);
            if u < 0.0 {
                return t;
            }
        }
        // Rounding left a sliver of mass past the last candidate; or every
        // logit was NaN, and min-p kept nothing: the argmax, as greedy would
        // (under a mask, the first allowed token).
        cand.last().copied().unwrap_or_else(|| match mask {
            None => argmax(s),
            Some(mask) => {
                allowed(mask, s.len(), cand);
                cand.first().copied().unwrap_or(0)
            }
        })
    }
}

/// The ids below `n` whose bit is set in `mask`, ascending, into `out`.
fn allowed(mask: &[u32], n: usize, out: &mut Vec<u32>) {
    out.clear();
    for (w, &bits) in mask.iter().enumerate() {
        let mut bits = bits;
        while bits != 0 {
            let id = w * 32 + bits.trailing_zeros() as usize;
            if id >= n {
                return;
            }
            out.push(id as u32);
            bits &= bits - 1;
        }
    }
}

/// How many of the `sorted` candidates top-p keeps, or `None` if all of them
/// are kept and the mass they hold is still short of `need` (the caller then
/// has to look further down the distribution).
fn top_p_cut(sorted: &[u32], s: &[f32], weight: &dyn Fn(f32) -> f64, need: f64) -> Option<usize> {
    let mut before = 0.0;
    for (i, &t) in sorted.iter().enumerate() {
        if i > 0 && before >= need {
            return Some(i);
        }
        before += weight(s[t as usize]);
    }
    if before >= need { Some(sorted.len()) } else { None }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(p: SamplingParams, vocab: usize) -> Sampler {
        Sampler::new(p, vocab, &[]).unwrap()
    }

    /// Found by the sampler fuzz target: a subnormal temperature overflows
    /// the logits to ±inf, which made every weight NaN and left min-p with
    /// no candidate (a panic). Overflowed, infinite and NaN logits now give
    /// a token in the vocabulary: the most likely one where there is one.
    #[test]
    fn overflowing_infinite_and_nan_logits_still_give_a_token() {
        let tiny = SamplingParams { temperature: 3.7e-39, min_p: 0.05, top_p: 0.9, ..Default::default() };
        let logits = [1.0f32, 3.0, -2.0, 0.5];
        let mut s = sampler(tiny, 4);
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1, "a vanishing temperature is greedy");
        }
        let hot = SamplingParams { temperature: 1.0, min_p: 0.5, top_k: 3, ..Default::default() };
        for logits in [
            [f32::NAN; 4],
            [f32::INFINITY, 0.0, f32::INFINITY, f32::NAN],
            [f32::NEG_INFINITY; 4],
            [f32::NAN, 1.0, f32::NAN, 0.5],
        ] {
            let mut s = sampler(hot.clone(), 4);
            for _ in 0..20 {
                let t = s.sample(&logits) as usize;
                assert!(t < 4, "{logits:?}: {t}");
                assert!(!logits[t].is_nan() || logits.iter().all(|l| l.is_nan()), "{logits:?}: NaN token {t}");
            }
        }
    }

    /// Frequencies of each token over `n` draws.
    fn histogram(p: SamplingParams, logits: &[f32], n: usize) -> Vec<f64> {
        let mut s = sampler(p, logits.len());
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..n {
            counts[s.sample(logits) as usize] += 1;
        }
        counts.into_iter().map(|c| c as f64 / n as f64).collect()
    }

    fn softmax(l: &[f64]) -> Vec<f64> {
        let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = l.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        e.into_iter().map(|x| x / z).collect()
    }

    fn close(got: &[f64], want: &[f64], tol: f64) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() < tol, "token {i}: frequency {g}, expected {w} (all: {got:?} vs {want:?})");
        }
    }

    fn sampled(t: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature: t, seed, ..Default::default() }
    }

    const L: [f32; 6] = [1.0, 2.5, -0.5, 2.0, 0.0, 1.5];

    #[test]
    fn greedy_picks_first_max() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(sampler(SamplingParams::default(), 3).sample(&[1.0, 3.0, 2.0]), 1);
    }

    #[test]
    fn temperature_follows_the_tempered_softmax() {
        for t in [0.5f32, 1.0, 2.0] {
            let want = softmax(&L.map(|l| (l / t) as f64));
            close(&histogram(sampled(t, 3), &L, 40_000), &want, 0.012);
        }
    }

    #[test]
    fn top_k_keeps_the_k_largest_renormalised() {
        let p = SamplingParams { top_k: 3, ..sampled(1.0, 11) };
        let want = softmax(&[f64::NEG_INFINITY, 2.5, f64::NEG_INFINITY, 2.0, f64::NEG_INFINITY, 1.5]);
        close(&histogram(p, &L, 40_000), &want, 0.012);
        // Ties at the cut go to the lower id.
        let p = SamplingParams { top_k: 1, ..sampled(1.0, 1) };
        assert_eq!(histogram(p, &[0.0, 5.0, 5.0], 100)[1], 1.0);
    }

    #[test]
    fn top_p_keeps_the_shortest_prefix_reaching_p() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 in this order after sorting.
        let logits = [2f32.ln(), 1.0f32.ln(), 4f32.ln(), 1.0f32.ln()];
        let f = |top_p| histogram(SamplingParams { top_p, ..sampled(1.0, 5) }, &logits, 30_000);
        // p = 0.45: the first token alone reaches it.
        close(&f(0.45), &[0.0, 0.0, 1.0, 0.0], 1e-9);
        // p = 0.6: the first two (0.5 + 0.25), renormalised to 2/3 and 1/3.
        close(&f(0.6), &[1.0 / 3.0, 0.0, 2.0 / 3.0, 0.0], 0.012);
        // p = 0.8: three tokens; ids 1 and 3 tie, so the lower id stays.
        close(&f(0.8), &[2.0 / 7.0, 1.0 / 7.0, 4.0 / 7.0, 0.0], 0.012);
        close(&f(1.0), &[0.25, 0.125, 0.5, 0.125], 0.012);
    }

    #[test]
    fn top_p_over_a_large_vocabulary_matches_a_full_sort() {
        // Over TOP_P_PREFIX candidates: the prefix shortcut and the full sort
        // must agree, both when the prefix is enough and when it is not.
        let v = 5000;
        let peaked: Vec<f32> = (0..v).map(|i| -(i as f32) * 0.01).collect();
        let flat: Vec<f32> = (0..v).map(|i| ((i * 7919) % 13) as f32 * 0.001).collect();
        for logits in [&peaked, &flat] {
            for top_p in [0.3f32, 0.9, 0.999] {
                let p = SamplingParams { top_p, ..sampled(1.0, 9) };
                let mut s = sampler(p, v);
                s.sample(logits);
                let mut kept = s.cand.clone();
                kept.sort_unstable();
                // Reference: sort everything, keep while the mass before is below p.
                let mut order: Vec<u32> = (0..v as u32).collect();
                order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
                let w: Vec<f64> = softmax(&logits.iter().map(|&l| l as f64).collect::<Vec<_>>());
                let mut want = Vec::new();
                let mut before = 0.0;
                for &t in &order {
                    if !want.is_empty() && before >= top_p as f64 {
                        break;
                    }
                    want.push(t);
                    before += w[t as usize];
                }
                want.sort_unstable();
                let diff = want.len().abs_diff(kept.len());
                assert!(diff <= 1, "top_p {top_p}: kept {} tokens, reference {}", kept.len(), want.len());
                if diff == 0 {
                    assert_eq!(kept, want, "top_p {top_p}");
                }
            }
        }
    }

    #[test]
    fn min_p_drops_tokens_below_the_fraction_of_the_best() {
        // Probabilities proportional to 8, 4, 2, 1.
        let logits = [8f32.ln(), 4f32.ln(), 2f32.ln(), 0.0];
        let p = SamplingParams { min_p: 0.3, ..sampled(1.0, 2) };
        close(&histogram(p, &logits, 30_000), &[8.0 / 12.0, 4.0 / 12.0, 0.0, 0.0], 0.012);
        let p = SamplingParams { min_p: 1.0, ..sampled(1.0, 2) };
        close(&histogram(p, &logits, 100), &[1.0, 0.0, 0.0, 0.0], 1e-9);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let p = SamplingParams { repetition_penalty: 2.0, ..Default::default() };
        let mut s = Sampler::new(p, 4, &[0, 2, 0]).unwrap();
        // Token 0: 3.0 -> 1.5; token 2: -1.0 -> -2.0; token 1 untouched at 2.0.
        assert_eq!(s.sample(&[3.0, 2.0, -1.0, -1.5]), 1);
        assert_eq!(s.scores, [1.5, 2.0, -2.0, -1.5]);
        s.accept(1);
        s.sample(&[3.0, 2.0, -1.0, -1.5]);
        assert_eq!(s.scores, [1.5, 1.0, -2.0, -1.5], "a generated token is seen too");
    }

    #[test]
    fn presence_and_frequency_penalties_count_generated_tokens_only() {
        let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
        let mut s = Sampler::new(p, 3, &[0, 0, 0]).unwrap();
        let logits = [1.0, 1.0, 1.0];
        s.sample(&logits);
        assert_eq!(s.scores, logits, "prompt tokens are not penalised");
        for t in [1, 1, 2] {
            s.accept(t);
        }
        s.sample(&logits);
        assert_eq!(s.scores, [1.0, 1.0 - 0.5 - 2.0 * 0.25, 1.0 - 0.5 - 0.25]);
    }

    #[test]
    fn penalties_apply_in_greedy_mode() {
        let p = SamplingParams { presence_penalty: 10.0, ..Default::default() };
        let mut s = sampler(p, 3);
        let logits = [1.0, 3.0, 2.0];
        let mut out = Vec::new();
        for _ in 0..3 {
            let t = s.sample(&logits);
            s.accept(t);
            out.push(t);
        }
        assert_eq!(out, [1, 2, 0]);
    }

    #[test]
    fn a_seed_fixes_the_draws() {
        let run = |seed| {
            let mut s = sampler(SamplingParams { top_p: 0.9, ..sampled(1.3, seed) }, L.len());
            (0..50).map(|_| s.sample(&L)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn a_mask_limits_every_mode_to_its_tokens_and_keeps_the_draws() {
        // Tokens 0, 2 and 5 allowed (bits 0, 2, 5 of one word).
        let mask = [0b100101u32];
        let greedy = sampler(SamplingParams::default(), L.len()).sample_masked(&L, &mask);
        assert_eq!(greedy, 5, "the best allowed token, not the best one (1)");
        for p in [sampled(1.0, 4), SamplingParams { top_k: 2, top_p: 0.5, min_p: 0.1, ..sampled(2.0, 4) }] {
            let mut s = sampler(p.clone(), L.len());
            let mut seen = [0usize; 6];
            for _ in 0..2000 {
                seen[s.sample_masked(&L, &mask) as usize] += 1;
            }
            assert_eq!(seen[1] + seen[3] + seen[4], 0, "{p:?}: {seen:?}");
        }
        // Masked, all three share the softmax of their logits.
        let want = softmax(&[1.0, f64::NEG_INFINITY, -0.5, f64::NEG_INFINITY, f64::NEG_INFINITY, 1.5]);
        let mut s = sampler(sampled(1.0, 8), L.len());
        let mut counts = [0usize; 6];
        for _ in 0..40_000 {
            counts[s.sample_masked(&L, &mask) as usize] += 1;
        }
        close(&counts.iter().map(|&c| c as f64 / 40_000.0).collect::<Vec<_>>(), &want, 0.012);
        let run = |seed| {
            let mut s = sampler(sampled(1.3, seed), L.len());
            (0..50).map(|_| s.sample_masked(&L, &mask)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
    }

    #[test]
    fn out_of_range_parameters_are_named() {
        let cases: [(SamplingParams, &str); 8] = [
            (sampled(-1.0, 0), "temperature"),
            (sampled(f32::NAN, 0), "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { top_p: 1.5, ..Default::default() }, "top_p"),
            (SamplingParams { min_p: -0.1, ..Default::default() }, "min_p"),
            (SamplingParams { repetition_penalty: 0.0, ..Default::default() }, "repetition_penalty"),
            (SamplingParams { presence_penalty: f32::INFINITY, ..Default::default() }, "presence_penalty"),
            (SamplingParams { frequency_penalty: f32::NAN, ..Default::default() }, "frequency_penalty"),
        ];
        for (p, name) in cases {
            let err = Sampler::new(p, 4, &[]).unwrap_err();
            assert!(matches!(&err, Error::InvalidInput(m) if m.starts_with(name)), "{err}");
        }
    }
}
