//! The MoE block: route, group tokens by expert, run each chosen expert once
//! on its group, and combine.
//!
//! ```text
//! logits = router · x                 [T, E]
//! (ids, w) = top-k of softmax(logits)  [T, K] each, optionally renormalised
//! for each expert e with tokens:       gather rows → gated MLP → [n_e, D]
//! out[t] = Σ_r w[t, r] · y[slot(t, r)]  in rank order r = 0..K, fixed
//! ```
//!
//! The router only produces (expert ids, weights); the experts never see the
//! router. Expert weights come from the [`ExpertStore`], leased in waves: all
//! of a chunk's experts at once when the store has the room (always, for a
//! resident model), otherwise as many as it can hold at a time. Each unique
//! expert is leased, and so read, once per chunk for all of its tokens.

use super::ffn::{MlpScratch, gated_mlp};
use crate::error::Result;
use crate::kernels::{BlockQ8, Input, Matrix, matmul};
use crate::model::config::{RouterScore, RouterSpec};
use crate::model::store::telemetry::LayerTelemetry;
use crate::model::store::{Busy, ExpertStore, Lease};

/// Indices of the `k` largest `scores`, best first, by partial selection
/// (O(E·K), no sort of all E). Ties go to the lower index.
pub fn top_k(scores: &[f32], k: usize, idx: &mut [u32]) {
    debug_assert!(k <= scores.len() && idx.len() == k);
    let mut len = 0;
    for (e, &s) in scores.iter().enumerate() {
        if len == k && s <= scores[idx[k - 1] as usize] {
            continue;
        }
        // Insert e into the sorted prefix, dropping the last if full.
        let mut pos = len.min(k - 1);
        if len < k {
            len += 1;
        }
        while pos > 0 && scores[idx[pos - 1] as usize] < s {
            idx[pos] = idx[pos - 1];
            pos -= 1;
        }
        idx[pos] = e as u32;
    }
}

/// Turns one token's router logits into K expert ids and weights.
/// `probs` is scratch of length E.
pub fn route(logits: &[f32], spec: &RouterSpec, probs: &mut [f32], ids: &mut [u32], w: &mut [f32]) {
    match spec.score {
        RouterScore::Softmax => {
            let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut z = 0.0f32;
            for (p, &l) in probs.iter_mut().zip(logits) {
                *p = (l - m).exp();
                z += *p;
            }
            probs.iter_mut().for_each(|p| *p /= z);
        }
    }
    top_k(probs, spec.top_k, ids);
    for (wi, &e) in w.iter_mut().zip(ids.iter()) {
        *wi = probs[e as usize];
    }
    if spec.renormalize {
        let s: f32 = w.iter().sum();
        w.iter_mut().for_each(|x| *x /= s);
    }
    if spec.scale != 1.0 {
        w.iter_mut().for_each(|x| *x *= spec.scale);
    }
}

/// Scratch for one MoE call over up to C tokens, allocated once per session.
pub struct MoeScratch {
    /// [C, E] router logits.
    pub logits: Vec<f32>,
    /// [E] softmax scratch.
    pub probs: Vec<f32>,
    /// [C, K] chosen experts.
    pub ids: Vec<u32>,
    /// [C, K] their weights.
    pub weights: Vec<f32>,
    /// [E + 1] start of each expert's group in `order`.
    pub starts: Vec<usize>,
    /// [E + 1] fill cursor for the counting sort.
    pub cursor: Vec<usize>,
    /// [C·K] (t, r) pairs grouped by expert: entry = t·K + r.
    pub order: Vec<u32>,
    /// [C·K] position of (t, r) within `order`.
    pub slot: Vec<u32>,
    /// [C·K, D] input rows in `order`.
    pub gathered: Vec<f32>,
    /// [C·K, D/32] the same rows quantised (when the experts are block-quantised).
    pub gathered_q: Vec<BlockQ8>,
    /// [C·K, F] gate activations.
    pub g: Vec<f32>,
    /// [C·K, F] up activations.
    pub u: Vec<f32>,
    /// [C·K, F/32] quantised hidden activations.
    pub hq: Vec<BlockQ8>,
    /// [C·K, D] every (t, r) pair's expert output, in `order`.
    pub outs: Vec<f32>,
    /// [E] experts with tokens in this chunk, ascending.
    pub active: Vec<u32>,
    /// Up to [E] leases of the wave being run.
    pub leases: Vec<Lease>,
    /// [E] index into `leases` of each expert of the wave.
    pub lease_of: Vec<u32>,
    /// [C, D] the input of the next layer's router for prefetch prediction.
    pub pred_x: Vec<f32>,
    /// [E] experts predicted for the next layer, ascending.
    pub pred: Vec<u32>,
    /// [E] membership marks for building `pred`.
    pub mark: Vec<bool>,
}

impl MoeScratch {
    /// Scratch for up to `c` tokens, `e` experts, top-`k`, width `d`, expert ffn `f`.
    pub fn new(c: usize, e: usize, k: usize, d: usize, f: usize) -> MoeScratch {
        let ck = c * k;
        MoeScratch {
            logits: vec![0.0; c * e],
            probs: vec![0.0; e],
            ids: vec![0; ck],
            weights: vec![0.0; ck],
            starts: vec![0; e + 1],
            cursor: vec![0; e + 1],
            order: vec![0; ck],
            slot: vec![0; ck],
            gathered: vec![0.0; ck * d],
            gathered_q: vec![BlockQ8::default(); ck * d / 32],
            g: vec![0.0; ck * f],
            u: vec![0.0; ck * f],
            hq: vec![BlockQ8::default(); ck * f / 32],
            outs: vec![0.0; ck * d],
            active: Vec::with_capacity(e),
            leases: Vec::with_capacity(e),
            lease_of: vec![0; e],
            pred_x: vec![0.0; c * d],
            pred: Vec::with_capacity(e),
            mark: vec![false; e],
        }
    }
}

/// One MoE layer's router and where its experts come from.
pub struct MoeLayer<'a> {
    /// Layer index (the store's key).
    pub layer: usize,
    /// [E, D] router weights.
    pub router: Matrix<'a>,
    /// Routing rule.
    pub spec: &'a RouterSpec,
    /// Source of the experts' weights.
    pub store: &'a dyn ExpertStore,
    /// Where routing decisions are counted, if anywhere.
    pub(crate) telemetry: Option<&'a LayerTelemetry>,
}

/// The leases of the wave being run.
struct Wave<'a> {
    leases: &'a [Lease],
    /// Expert → index into `leases`.
    lease_of: &'a [u32],
}

/// The per-assignment buffers of a contiguous range of experts; splitting at
/// an expert boundary gives two disjoint halves that can run on two threads.
struct Groups<'a> {
    x: &'a [f32],
    xq: &'a [BlockQ8],
    g: &'a mut [f32],
    u: &'a mut [f32],
    hq: &'a mut [BlockQ8],
    outs: &'a mut [f32],
    /// Widths per assignment: D, D/32 (0 if unquantised), F, F/32.
    d: usize,
    dq: usize,
    f: usize,
    fq: usize,
}

impl<'a> Groups<'a> {
    fn split(self, rows: usize) -> (Groups<'a>, Groups<'a>) {
        let (x0, x1) = self.x.split_at(rows * self.d);
        let (q0, q1) = self.xq.split_at(rows * self.dq);
        let (g0, g1) = self.g.split_at_mut(rows * self.f);
        let (u0, u1) = self.u.split_at_mut(rows * self.f);
        let (h0, h1) = self.hq.split_at_mut(rows * self.fq);
        let (o0, o1) = self.outs.split_at_mut(rows * self.d);
        let (d, dq, f, fq) = (self.d, self.dq, self.f, self.fq);
        (
            Groups { x: x0, xq: q0, g: g0, u: u0, hq: h0, outs: o0, d, dq, f, fq },
            Groups { x: x1, xq: q1, g: g1, u: u1, hq: h1, outs: o1, d, dq, f, fq },
        )
    }
}

/// Relative cost of running expert groups: streaming an expert's weights is
/// worth a couple of rows of compute.
fn cost(rows: usize) -> usize {
    if rows == 0 { 0 } else { rows + 2 }
}

/// Runs experts `lo..hi` (whose assignments `g` covers). With `par`, the range
/// is halved by cost and the halves run on two threads (`rayon::join`), so in
/// decode each worker streams whole experts, one core per expert; without it,
/// experts run one after another with each matrix split across threads.
fn run_experts(m: &MoeLayer, w: &Wave, starts: &[usize], lo: usize, hi: usize, g: Groups, par: bool) -> Result<()> {
    // Mark this thread (possibly a thief of the other half) as busy with expert work.
    let _busy = Busy::enter();
    let active = (lo..hi).filter(|&e| starts[e + 1] > starts[e]).count();
    if par && active > 1 {
        // Split where the left half first reaches half the cost, keeping at
        // least one active expert on each side.
        let total: usize = (lo..hi).map(|e| cost(starts[e + 1] - starts[e])).sum();
        let (mut mid, mut acc, mut left) = (lo, 0, 0);
        for e in lo..hi {
            let rows = starts[e + 1] - starts[e];
            acc += cost(rows);
            left += (rows > 0) as usize;
            if left >= 1 && (acc * 2 >= total || left == active - 1) {
                mid = e + 1;
                break;
            }
        }
        let (a, b) = g.split(starts[mid] - starts[lo]);
        let (ra, rb) =
            rayon::join(|| run_experts(m, w, starts, lo, mid, a, par), || run_experts(m, w, starts, mid, hi, b, par));
        return ra.and(rb);
    }
    let mut rest = g;
    for e in lo..hi {
        let rows = starts[e + 1] - starts[e];
        let (mine, next) = rest.split(rows);
        rest = next;
        if rows == 0 {
            continue;
        }
        let weights = m.store.view(&w.leases[w.lease_of[e] as usize])?;
        let x = Input { x: mine.x, q: mine.xq, cols: mine.d };
        let scratch = MlpScratch { g: mine.g, u: mine.u, hq: mine.hq };
        gated_mlp(&weights, &x, scratch, mine.outs, !par); // [rows, D]
    }
    Ok(())
}

/// Routed-expert output for the n rows of `x` ([n, D]) into `out` ([n, D]).
/// The chosen expert ids stay in `s.ids[..n*K]` for telemetry.
pub fn moe_forward(m: &MoeLayer, x: &Input, s: &mut MoeScratch, out: &mut [f32]) -> Result<()> {
    let (router, spec) = (&m.router, m.spec);
    let (e_n, k, d) = (router.rows, spec.top_k, router.cols);
    let n = x.x.len() / d;
    let logits = &mut s.logits[..n * e_n];
    matmul(router, x, logits); // [n, E]
    for t in 0..n {
        let ids = &mut s.ids[t * k..(t + 1) * k];
        route(&logits[t * e_n..(t + 1) * e_n], spec, &mut s.probs, ids, &mut s.weights[t * k..(t + 1) * k]);
        if let Some(tel) = m.telemetry {
            tel.record(ids, top2_margin(&s.probs, ids));
        }
    }
    // Counting sort of the n·K (token, rank) pairs by expert.
    s.starts.fill(0);
    for &e in &s.ids[..n * k] {
        s.starts[e as usize + 1] += 1;
    }
    for e in 0..e_n {
        s.starts[e + 1] += s.starts[e];
    }
    s.cursor.copy_from_slice(&s.starts);
    for (pair, &e) in s.ids[..n * k].iter().enumerate() {
        let at = s.cursor[e as usize];
        s.order[at] = pair as u32;
        s.slot[pair] = at as u32;
        s.cursor[e as usize] += 1;
    }
    // Gather each assignment's input row (and its quantised twin, prepared
    // once per token and shared by all K experts' gate and up projections).
    let dq = if x.q.is_empty() { 0 } else { d / 32 };
    for (pos, &pair) in s.order[..n * k].iter().enumerate() {
        let t = pair as usize / k;
        s.gathered[pos * d..(pos + 1) * d].copy_from_slice(&x.x[t * d..(t + 1) * d]);
        if dq > 0 {
            s.gathered_q[pos * dq..(pos + 1) * dq].copy_from_slice(&x.q[t * dq..(t + 1) * dq]);
        }
    }
    let f = s.g.len() / s.order.len().max(1);
    let fq = f / 32;
    s.active.clear();
    s.active.extend((0..e_n as u32).filter(|&e| s.starts[e as usize + 1] > s.starts[e as usize]));
    m.store.begin_layer(m.layer);
    // Waves: lease as many of the active experts as the store can hold (the
    // first lease may wait for room, the others may not), run them side by
    // side, give the slots back, repeat.
    let mut done = 0;
    while done < s.active.len() {
        s.leases.clear();
        for (i, &e) in s.active[done..].iter().enumerate() {
            match m.store.lease(m.layer, e as usize, s.leases.is_empty()) {
                Ok(Some(l)) => {
                    s.lease_of[e as usize] = i as u32;
                    s.leases.push(l);
                }
                Ok(None) => break,
                Err(err) => {
                    s.leases.clear();
                    return Err(err);
                }
            }
        }
        let wave = &s.active[done..done + s.leases.len()];
        let (Some(&first), Some(&last)) = (wave.first(), wave.last()) else {
            return Err(crate::error::Error::InvalidInput(format!(
                "expert store gave no lease for layer {} even when allowed to wait",
                m.layer
            )));
        };
        let (lo, hi) = (first as usize, last as usize + 1);
        let (r0, r1) = (s.starts[lo], s.starts[hi]);
        let groups = Groups {
            x: &s.gathered[r0 * d..r1 * d],
            xq: &s.gathered_q[r0 * dq..r1 * dq],
            g: &mut s.g[r0 * f..r1 * f],
            u: &mut s.u[r0 * f..r1 * f],
            hq: &mut s.hq[r0 * fq..r1 * fq],
            outs: &mut s.outs[r0 * d..r1 * d],
            d,
            dq,
            f,
            fq,
        };
        let par = rayon::current_num_threads() > 1 && wave.len() > 1;
        let w = Wave { leases: &s.leases, lease_of: &s.lease_of };
        let r = run_experts(m, &w, &s.starts, lo, hi, groups, par);
        done += s.leases.len();
        s.leases.clear(); // gives the slots back, also on error
        r?;
    }
    // Combine in rank order, independent of expert or thread order.
    for t in 0..n {
        let o = &mut out[t * d..(t + 1) * d];
        o.fill(0.0);
        for r in 0..k {
            let pair = t * k + r;
            let wt = s.weights[pair];
            let at = s.slot[pair] as usize;
            o.iter_mut().zip(&s.outs[at * d..(at + 1) * d]).for_each(|(a, b)| *a += wt * b);
        }
    }
    Ok(())
}

/// p(first choice) − p(second choice) of one token, from the softmax
/// probabilities `probs` and its ranked choices `ids`.
fn top2_margin(probs: &[f32], ids: &[u32]) -> f32 {
    let p1 = probs[ids[0] as usize];
    let p2 = if ids.len() > 1 {
        probs[ids[1] as usize]
    } else {
        let best = ids[0] as usize;
        probs.iter().enumerate().filter(|&(e, _)| e != best).map(|(_, &p)| p).fold(0.0, f32::max)
    };
    p1 - p2
}

/// Predicts which experts a layer's router picks for the first `n` rows of
/// `s.pred_x` (its expected input): the unique ids, ascending, in `s.pred`.
/// Uses the routing scratch, which [`moe_forward`] overwrites before reading.
pub fn predict<'s>(router: &Matrix, spec: &RouterSpec, n: usize, s: &'s mut MoeScratch) -> &'s [u32] {
    let (e_n, k, d) = (router.rows, spec.top_k, router.cols);
    let logits = &mut s.logits[..n * e_n];
    matmul(router, &Input::plain(&s.pred_x[..n * d], d), logits); // [n, E]
    s.mark.fill(false);
    for t in 0..n {
        let ids = &mut s.ids[t * k..(t + 1) * k];
        route(&logits[t * e_n..(t + 1) * e_n], spec, &mut s.probs, ids, &mut s.weights[t * k..(t + 1) * k]);
        for &e in ids.iter() {
            s.mark[e as usize] = true;
        }
    }
    s.pred.clear();
    s.pred.extend((0..e_n as u32).filter(|&e| s.mark[e as usize]));
    &s.pred
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_matches_a_full_sort() {
        let mut seed = 3u64;
        for e in [1usize, 2, 5, 7, 31, 64, 129] {
            for k in 1..=e.min(9) {
                let scores: Vec<f32> = (0..e)
                    .map(|_| {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                        (seed >> 33) as f32
                    })
                    .collect();
                let mut idx = vec![0u32; k];
                top_k(&scores, k, &mut idx);
                let mut all: Vec<u32> = (0..e as u32).collect();
                all.sort_by(|a, b| scores[*b as usize].total_cmp(&scores[*a as usize]).then(a.cmp(b)));
                assert_eq!(idx, all[..k], "e={e} k={k}");
            }
        }
    }

    #[test]
    fn margin_is_between_the_two_best() {
        let probs = [0.1f32, 0.6, 0.05, 0.25];
        assert!((top2_margin(&probs, &[1, 3]) - 0.35).abs() < 1e-6);
        assert!((top2_margin(&probs, &[1]) - 0.35).abs() < 1e-6);
    }

    #[test]
    fn ties_go_to_the_lower_index() {
        let mut idx = [0u32; 2];
        top_k(&[1.0, 3.0, 3.0, 0.0, 3.0], 2, &mut idx);
        assert_eq!(idx, [1, 2]);
    }

    #[test]
    fn routing_weights_follow_the_spec() {
        let logits = [0.5f32, 2.0, -1.0, 1.0];
        let mut probs = [0.0; 4];
        let (mut ids, mut w) = ([0u32; 2], [0.0f32; 2]);
        let spec = RouterSpec { top_k: 2, score: RouterScore::Softmax, renormalize: false, scale: 1.0 };
        route(&logits, &spec, &mut probs, &mut ids, &mut w);
        assert_eq!(ids, [1, 3]);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((w[0] - 2f32.exp() / z).abs() < 1e-6 && (w[1] - 1f32.exp() / z).abs() < 1e-6);
        let spec = RouterSpec { renormalize: true, ..spec };
        route(&logits, &spec, &mut probs, &mut ids, &mut w);
        assert!((w[0] + w[1] - 1.0).abs() < 1e-6);
        assert!((w[0] / w[1] - 1f32.exp()).abs() < 1e-5);
    }
}
