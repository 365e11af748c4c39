//! The MoE block: route, group tokens by expert, run each chosen expert once
//! on its group, and combine.
//!
//! ```text
//! routing      logits = router · x                  [T, E]
//!              (ids, w) = top-k of softmax(logits)   [T, K] each, optionally renormalised
//! dispatch     counting sort of the (t, r) pairs by expert, gather their rows   [T·K, D]
//! waves        each expert e with tokens: gated MLP on its rows → [n_e, D]
//! combine      out[t] = Σ_r w[t, r] · y[slot(t, r)]  in rank order r = 0..K, fixed
//! ```
//!
//! Each stage is one function below ([`moe_forward`] calls them in order);
//! routing is shared with [`predict`], the next layer's prefetch.
//!
//! The router only produces (expert ids, weights); the experts never see the
//! router. Expert weights come from the [`ExpertStore`], leased in waves: all
//! of a chunk's experts at once when the store has the room (always, for a
//! resident model), otherwise as many as it can hold at a time. Each unique
//! expert is leased, and so read, once per chunk for all of its tokens.

use super::ffn::{MlpScratch, add_bias, gated_mlp, gated_mlp_serial, sigmoid};
use super::q8_blocks;
use crate::canonical::config::{Activation, GroupLimit, GroupScore, MAX_GROUPS, RouterScore, RouterSpec};
use crate::error::{Error, Result};
use crate::kernels::{Input, Matrix, matmul};
use crate::model::store::telemetry::LayerTelemetry;
use crate::model::store::{Busy, ExpertStore, Lease, LeaseMode};
use crate::model::weights::Mlp;
use crate::quant::act::BlockQ8;

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
/// `probs` (the scores the weights come from) and `sel` (the scores the
/// choice is made on) are scratch of length E.
///
/// 1. scores: softmax or sigmoid of the logits, or the logits themselves
///    when the softmax is over the chosen experts only;
/// 2. selection scores: the scores plus the correction bias, if any;
/// 3. group limit: only the experts of the best groups stay eligible;
/// 4. top-k of the selection scores;
/// 5. weights: the scores of the chosen (softmax over the chosen logits for
///    `SoftmaxSelected`), optionally renormalised (divided by their sum, or
///    by the floor when the sum is below it), then scaled.
pub fn route(
    logits: &[f32],
    spec: &RouterSpec,
    correction: Option<&[f32]>,
    probs: &mut [f32],
    sel: &mut [f32],
    ids: &mut [u32],
    w: &mut [f32],
) {
    match spec.score {
        RouterScore::Softmax => {
            probs.copy_from_slice(logits);
            softmax(probs);
        }
        RouterScore::Sigmoid => probs.iter_mut().zip(logits).for_each(|(p, &l)| *p = sigmoid(l)),
        RouterScore::SqrtSoftplus => probs.iter_mut().zip(logits).for_each(|(p, &l)| *p = sqrt_softplus(l)),
        RouterScore::SoftmaxSelected => probs.copy_from_slice(logits),
        RouterScore::SparseMixer { jitter_eps } => {
            sparse_mixer(logits, jitter_eps, ids, w);
            // The softmax over all experts, for the telemetry's margins only.
            probs.copy_from_slice(logits);
            softmax(probs);
            return;
        }
    }
    sel.copy_from_slice(probs);
    if let Some(bias) = correction {
        sel.iter_mut().zip(bias).for_each(|(s, b)| *s += b);
    }
    if let Some(g) = spec.groups {
        limit_groups(sel, &g);
    }
    top_k(sel, spec.top_k, ids);
    for (wi, &e) in w.iter_mut().zip(ids.iter()) {
        *wi = probs[e as usize];
    }
    if spec.score == RouterScore::SoftmaxSelected {
        softmax(w); // over the chosen logits
    }
    if spec.renormalize {
        let s = w.iter().sum::<f32>().max(spec.renormalize_floor);
        w.iter_mut().for_each(|x| *x /= s);
    }
    if spec.scale != 1.0 && !spec.scale_output {
        w.iter_mut().for_each(|x| *x *= spec.scale);
    }
}

/// `sqrt(softplus(x))`, softplus as torch computes it (`x` itself past 20).
pub fn sqrt_softplus(x: f32) -> f32 {
    let sp = if x > 20.0 { x } else { crate::math::ln_1pf(crate::math::expf(x)) };
    sp.sqrt()
}

/// Hash routing: the experts `table` gives the token (`ids`, K of them, as
/// f32 whole numbers) with the weights `route` would give them: their
/// scores in `probs`, renormalised and scaled as `spec` says.
pub fn route_fixed(table_row: &[f32], spec: &RouterSpec, probs: &[f32], ids: &mut [u32], w: &mut [f32]) {
    for ((id, wi), &e) in ids.iter_mut().zip(w.iter_mut()).zip(table_row) {
        *id = e as u32;
        *wi = probs[*id as usize];
    }
    if spec.renormalize {
        let s = w.iter().sum::<f32>().max(spec.renormalize_floor);
        w.iter_mut().for_each(|x| *x /= s);
    }
    if spec.scale != 1.0 {
        w.iter_mut().for_each(|x| *x *= spec.scale);
    }
}

/// `x = softmax(x)` in place, shifted by the maximum.
fn softmax(x: &mut [f32]) {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut z = 0.0f32;
    for v in x.iter_mut() {
        *v = crate::math::expf(*v - m);
        z += *v;
    }
    x.iter_mut().for_each(|v| *v /= z);
}

/// Phi-MoE's sparsemixer in eval mode (transformers' `sparsemixer` with
/// `training=False`), for K = 2. For each choice c with logit m (the best
/// logit, then the best of the others), its weight is a softmax restricted to
/// the experts j with `(m − s_j) / max(|s_j|, m) <= 2·eps` (the second choice
/// also leaves out the first), evaluated at c.
fn sparse_mixer(s: &[f32], eps: f32, ids: &mut [u32], w: &mut [f32]) {
    let argmax = |skip: Option<usize>| {
        let mut best = usize::MAX;
        for (j, &v) in s.iter().enumerate() {
            if Some(j) != skip && (best == usize::MAX || v > s[best]) {
                best = j;
            }
        }
        best
    };
    let weight = |c: usize, skip: Option<usize>| {
        let m = s[c];
        let mut z = 0.0f32;
        for (j, &v) in s.iter().enumerate() {
            // As torch: masked when the ratio is > 2·eps (a NaN ratio is kept).
            let ratio = (m - v) / v.abs().max(m);
            let masked = ratio.partial_cmp(&(2.0 * eps)) == Some(std::cmp::Ordering::Greater);
            let kept = Some(j) != skip && !masked;
            if kept {
                z += crate::math::expf(v - m);
            }
        }
        1.0 / z
    };
    let first = argmax(None);
    let second = argmax(Some(first));
    ids[0] = first as u32;
    ids[1] = second as u32;
    w[0] = weight(first, None);
    w[1] = weight(second, Some(first));
}

/// Masks (to −∞) the selection scores of every expert outside the
/// `top_groups` best groups. Group ties go to the lower group.
fn limit_groups(sel: &mut [f32], g: &GroupLimit) {
    let size = sel.len() / g.groups;
    // A group's score: its best expert, or the sum of its two best.
    let score = |grp: &[f32]| {
        let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for &x in grp {
            if x > a {
                b = a;
                a = x;
            } else if x > b {
                b = x;
            }
        }
        match g.score {
            GroupScore::Max => a,
            GroupScore::TopTwoSum if size > 1 => a + b,
            GroupScore::TopTwoSum => a,
        }
    };
    // Group scores on the stack: the config's validation keeps
    // top_groups ≤ groups ≤ MAX_GROUPS (DeepSeek uses 8).
    let (n, top) = (g.groups, g.top_groups);
    debug_assert!(top <= n && n <= MAX_GROUPS);
    let mut scores = [f32::NEG_INFINITY; MAX_GROUPS];
    for (i, s) in scores[..n].iter_mut().enumerate() {
        *s = score(&sel[i * size..(i + 1) * size]);
    }
    let mut keep = [0u32; MAX_GROUPS];
    top_k(&scores[..n], top, &mut keep[..top]);
    for i in 0..n {
        if !keep[..top].contains(&(i as u32)) {
            sel[i * size..(i + 1) * size].fill(f32::NEG_INFINITY);
        }
    }
}

/// The router's scratch and its decisions for up to C tokens.
pub struct Routes {
    /// [C, E] router logits.
    logits: Vec<f32>,
    /// `[E]` score scratch.
    probs: Vec<f32>,
    /// `[E]` selection score scratch.
    sel: Vec<f32>,
    /// [C, K] chosen experts, best first.
    pub ids: Vec<u32>,
    /// [C, K] their weights.
    pub weights: Vec<f32>,
}

/// Scratch for one MoE call over up to C tokens, allocated once per session.
pub struct MoeScratch {
    /// Routing of the chunk (or of the next layer's prediction).
    pub routes: Routes,
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
    /// `[E]` experts with tokens in this chunk, ascending.
    pub active: Vec<u32>,
    /// Up to `[E]` leases of the wave being run.
    pub leases: Vec<Lease>,
    /// `[E]` index into `leases` of each expert of the wave.
    pub lease_of: Vec<u32>,
    /// [C, D] the input of the next layer's router for prefetch prediction.
    pub pred_x: Vec<f32>,
    /// `[E]` experts predicted for the next layer, ascending.
    pub pred: Vec<u32>,
    /// `[E]` membership marks for building `pred`.
    pub mark: Vec<bool>,
}

impl MoeScratch {
    /// Scratch for up to `c` tokens, `e` experts, top-`k`, width `d`, expert ffn `f`.
    pub fn new(c: usize, e: usize, k: usize, d: usize, f: usize) -> MoeScratch {
        let ck = c * k;
        MoeScratch {
            routes: Routes {
                logits: vec![0.0; c * e],
                probs: vec![0.0; e],
                sel: vec![0.0; e],
                ids: vec![0; ck],
                weights: vec![0.0; ck],
            },
            starts: vec![0; e + 1],
            cursor: vec![0; e + 1],
            order: vec![0; ck],
            slot: vec![0; ck],
            gathered: vec![0.0; ck * d],
            gathered_q: vec![BlockQ8::default(); q8_blocks(ck * d)],
            g: vec![0.0; ck * f],
            u: vec![0.0; ck * f],
            hq: vec![BlockQ8::default(); q8_blocks(ck * f)],
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
    /// `[E]` router bias.
    pub router_bias: Option<&'a [f32]>,
    /// `[E]` selection-only score bias.
    pub correction: Option<&'a [f32]>,
    /// Routing rule.
    pub spec: &'a RouterSpec,
    /// `[E]` each expert's multiplier of its routing weight (Gemma 4).
    pub expert_scale: Option<&'a [f32]>,
    /// [T, D] the router's own input, when it is not the experts' (a router
    /// with its own norm of the residual); `None`: the experts' input.
    pub router_x: Option<&'a [f32]>,
    /// How each expert combines its gate and up projections.
    pub act: Activation,
    /// Source of the experts' weights.
    pub store: &'a dyn ExpertStore,
    /// Where routing decisions are counted, if anywhere.
    pub(crate) telemetry: Option<&'a LayerTelemetry>,
    /// A hash-routed layer: its `[V, K]` token → experts table and the
    /// pass's token ids `[T]`.
    pub hash: Option<(&'a [f32], &'a [u32])>,
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

/// How the experts of one wave share the pool.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Split {
    /// The range of experts is halved by cost and the halves run on two
    /// threads (`rayon::join`), so in decode each worker streams whole
    /// experts, one core per expert.
    ByExpert,
    /// Experts run one after another, each matrix split across the pool.
    ByRows,
}

/// Runs experts `lo..hi` (whose assignments `g` covers), shared out as `split` says.
fn run_experts(m: &MoeLayer, w: &Wave, starts: &[usize], lo: usize, hi: usize, g: Groups, split: Split) -> Result<()> {
    // Mark this thread (possibly a thief of the other half) as busy with expert work.
    let _busy = Busy::enter();
    let active = (lo..hi).filter(|&e| starts[e + 1] > starts[e]).count();
    if split == Split::ByExpert && active > 1 {
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
        let (ra, rb) = rayon::join(
            || run_experts(m, w, starts, lo, mid, a, split),
            || run_experts(m, w, starts, mid, hi, b, split),
        );
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
        match split {
            Split::ByExpert => gated_mlp_serial(&weights, m.act, &x, scratch, mine.outs), // [rows, D]
            Split::ByRows => gated_mlp(&weights, m.act, &x, scratch, mine.outs),          // [rows, D]
        }
    }
    Ok(())
}

/// Routed-expert output for the T rows of `x` ([T, D]) into `out` ([T, D]):
/// route, group the (token, rank) pairs by expert, run each expert once on
/// its group, combine. The chosen expert ids stay in `s.routes.ids[..T·K]`.
pub fn moe_forward(m: &MoeLayer, x: &Input, s: &mut MoeScratch, out: &mut [f32]) -> Result<()> {
    let (n, d, k) = (x.x.len() / x.cols, x.cols, m.spec.top_k);
    route_rows(m, x, &mut s.routes, m.telemetry); // ids, weights: [T, K]
    let dq = dispatch(x, k, s); // gathered: [T·K, D] grouped by expert
    expert_waves(m, s, d, dq)?; // outs: [T·K, D]
    combine(&s.routes.weights[..n * k], &s.slot, &s.outs, k, d, &mut out[..n * d]); // [T, D]
    if m.spec.scale_output && m.spec.scale != 1.0 {
        out[..n * d].iter_mut().for_each(|x| *x *= m.spec.scale); // the summed output, not the weights
    }
    Ok(())
}

/// `logits = router · x (+ router bias)` for the rows of `x`: [T, E].
fn router_logits(m: &MoeLayer, x: &Input, logits: &mut [f32]) {
    matmul(&m.router, x, logits);
    if let Some(b) = m.router_bias {
        add_bias(logits, b);
    }
}

/// Routing: the router's logits of the T rows of `x` and each row's K
/// experts and weights (`r.ids`, `r.weights`: [T, K]), counted in
/// `telemetry` when given. The MoE block and the next layer's prefetch
/// prediction both route through here.
fn route_rows(m: &MoeLayer, x: &Input, r: &mut Routes, telemetry: Option<&LayerTelemetry>) {
    let (e_n, k, d) = (m.router.rows, m.spec.top_k, m.router.cols);
    let n = x.x.len() / x.cols; // the experts' rows (their width may be a latent one)
    let logits = &mut r.logits[..n * e_n];
    match m.router_x {
        Some(rx) => router_logits(m, &Input::plain(&rx[..n * d], d), logits), // [T, E]
        None => router_logits(m, x, logits),                                  // [T, E]
    }
    for t in 0..n {
        let ids = &mut r.ids[t * k..(t + 1) * k]; // [K]
        let w = &mut r.weights[t * k..(t + 1) * k]; // [K]
        route(&logits[t * e_n..(t + 1) * e_n], m.spec, m.correction, &mut r.probs, &mut r.sel, ids, w);
        if let Some((table, tokens)) = m.hash {
            let tok = tokens[t] as usize;
            route_fixed(&table[tok * k..(tok + 1) * k], m.spec, &r.probs, ids, w);
        }
        if let Some(scale) = m.expert_scale {
            // After renormalisation: the weights need not sum to 1 any more.
            w.iter_mut().zip(ids.iter()).for_each(|(wi, &e)| *wi *= scale[e as usize]);
        }
        if let Some(tel) = telemetry {
            tel.record(ids, top2_margin(&r.probs, ids));
        }
    }
}

/// Dispatch: a counting sort of the T·K (token, rank) pairs by expert
/// (`s.starts` [E + 1], `s.order` and `s.slot` [T·K]), and each pair's input
/// row gathered in that order (`s.gathered` [T·K, D], with its quantised
/// twin, prepared once per token and shared by all K experts' gate and up
/// projections). Returns the quantised blocks per gathered row (0 when the
/// input is not quantised).
fn dispatch(x: &Input, k: usize, s: &mut MoeScratch) -> usize {
    let (d, e_n) = (x.cols, s.starts.len() - 1);
    let n = x.x.len() / d;
    let ids = &s.routes.ids[..n * k]; // [T·K]
    s.starts.fill(0);
    for &e in ids {
        s.starts[e as usize + 1] += 1;
    }
    for e in 0..e_n {
        s.starts[e + 1] += s.starts[e];
    }
    s.cursor.copy_from_slice(&s.starts);
    for (pair, &e) in ids.iter().enumerate() {
        let at = s.cursor[e as usize];
        s.order[at] = pair as u32;
        s.slot[pair] = at as u32;
        s.cursor[e as usize] += 1;
    }
    let dq = if x.q.is_empty() { 0 } else { q8_blocks(d) };
    for (pos, &pair) in s.order[..n * k].iter().enumerate() {
        let t = pair as usize / k;
        s.gathered[pos * d..(pos + 1) * d].copy_from_slice(&x.x[t * d..(t + 1) * d]); // [D]
        if dq > 0 {
            s.gathered_q[pos * dq..(pos + 1) * dq].copy_from_slice(&x.q[t * dq..(t + 1) * dq]);
        }
    }
    dq
}

/// Expert waves: lease as many of the chunk's active experts as the store
/// can hold (the first lease may wait for room, the others may not), run
/// them side by side on their gathered rows into `s.outs` ([T·K, D], in
/// `order`), give the slots back, repeat. `d`: the width of a gathered row
/// (D, or the latent width); `dq`: its quantised blocks, as [`dispatch`]
/// left them.
fn expert_waves(m: &MoeLayer, s: &mut MoeScratch, d: usize, dq: usize) -> Result<()> {
    let e_n = s.starts.len() - 1;
    let f = s.g.len() / s.order.len().max(1);
    let fq = q8_blocks(f);
    s.active.clear();
    s.active.extend((0..e_n as u32).filter(|&e| s.starts[e as usize + 1] > s.starts[e as usize]));
    m.store.begin_layer(m.layer);
    let mut done = 0;
    while done < s.active.len() {
        s.leases.clear();
        for (i, &e) in s.active[done..].iter().enumerate() {
            let mode = if s.leases.is_empty() { LeaseMode::Wait } else { LeaseMode::IfFree };
            match m.store.lease(m.layer, e as usize, mode) {
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
            return Err(Error::Internal(format!(
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
        let split = if rayon::current_num_threads() > 1 && wave.len() > 1 { Split::ByExpert } else { Split::ByRows };
        let w = Wave { leases: &s.leases, lease_of: &s.lease_of };
        let r = run_experts(m, &w, &s.starts, lo, hi, groups, split);
        done += s.leases.len();
        s.leases.clear(); // gives the slots back, also on error
        r?;
    }
    Ok(())
}

/// Combine: `out[t] = Σ_r w[t, r] · outs[slot(t, r)]` ([T, D]; `weights`
/// [T, K], `outs` [T·K, D] in `order`), in rank order, independent of expert
/// or thread order.
fn combine(weights: &[f32], slot: &[u32], outs: &[f32], k: usize, d: usize, out: &mut [f32]) {
    for (t, o) in out.chunks_exact_mut(d).enumerate() {
        o.fill(0.0);
        for r in 0..k {
            let pair = t * k + r;
            let wt = weights[pair];
            let at = slot[pair] as usize;
            o.iter_mut().zip(&outs[at * d..(at + 1) * d]).for_each(|(a, b)| *a += wt * b); // [D]
        }
    }
}

/// A whole MoE block: the router and its routed experts, and the shared
/// expert that runs on every token (scaled by `sigmoid(w · x)` when gated).
pub struct MoeBlock<'a> {
    /// Router and routed experts.
    pub routed: MoeLayer<'a>,
    /// The shared expert.
    pub shared: Option<Mlp<'a>>,
    /// `[D]` its sigmoid gate.
    pub shared_gate: Option<&'a [f32]>,
}

/// `out = Σ_k w_k · expert_k(x) + gate(x) · shared(x)` for the n rows of `x`;
/// `shared_out` ([n, D]) is scratch for the shared expert.
pub fn moe_block(
    b: &MoeBlock,
    x: &Input,
    s: &mut MoeScratch,
    mlp: MlpScratch,
    shared_out: &mut [f32],
    out: &mut [f32],
) -> Result<()> {
    moe_forward(&b.routed, x, s, out)?; // [n, D]
    let Some(shared) = &b.shared else { return Ok(()) };
    let d = x.cols;
    gated_mlp(shared, b.routed.act, x, mlp, shared_out); // [n, D]
    for ((o, sh), xr) in out.chunks_exact_mut(d).zip(shared_out.chunks_exact(d)).zip(x.x.chunks_exact(d)) {
        let scale = b.shared_gate.map_or(1.0, |w| sigmoid(w.iter().zip(xr).map(|(a, b)| a * b).sum()));
        o.iter_mut().zip(sh).for_each(|(p, v)| *p += scale * v);
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
pub fn predict<'s>(m: &MoeLayer, n: usize, s: &'s mut MoeScratch) -> &'s [u32] {
    let (e_n, k, d) = (m.router.rows, m.spec.top_k, m.router.cols);
    route_rows(m, &Input::plain(&s.pred_x[..n * d], d), &mut s.routes, None); // ids: [n, K]
    s.mark.fill(false);
    for &e in &s.routes.ids[..n * k] {
        s.mark[e as usize] = true;
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
        let (mut probs, mut sel) = ([0.0; 4], [0.0; 4]);
        let (mut ids, mut w) = ([0u32; 2], [0.0f32; 2]);
        let spec = RouterSpec { top_k: 2, ..Default::default() };
        route(&logits, &spec, None, &mut probs, &mut sel, &mut ids, &mut w);
        assert_eq!(ids, [1, 3]);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((w[0] - 2f32.exp() / z).abs() < 1e-6 && (w[1] - 1f32.exp() / z).abs() < 1e-6);
        let spec = RouterSpec { renormalize: true, ..spec };
        route(&logits, &spec, None, &mut probs, &mut sel, &mut ids, &mut w);
        assert!((w[0] + w[1] - 1.0).abs() < 1e-6);
        assert!((w[0] / w[1] - 1f32.exp()).abs() < 1e-5);
    }

    /// The DeepSeek-V3 rule written out plainly: sigmoid scores, choice on
    /// score + bias within the best groups (by the sum of their two best),
    /// weights from the scores alone, renormalised and scaled.
    fn reference_v3(logits: &[f32], bias: &[f32], groups: usize, top_groups: usize, k: usize) -> (Vec<u32>, Vec<f32>) {
        let e = logits.len();
        let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
        let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
        let size = e / groups;
        let mut gs: Vec<(usize, f32)> = (0..groups)
            .map(|g| {
                let mut v: Vec<f32> = choice[g * size..(g + 1) * size].to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                (g, v[0] + v[1])
            })
            .collect();
        gs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let kept: Vec<usize> = gs[..top_groups].iter().map(|g| g.0).collect();
        let mut cand: Vec<usize> = (0..e).filter(|i| kept.contains(&(i / size))).collect();
        cand.sort_by(|a, b| choice[*b].total_cmp(&choice[*a]).then(a.cmp(b)));
        let ids: Vec<u32> = cand[..k].iter().map(|&i| i as u32).collect();
        let sum: f32 = ids.iter().map(|&i| scores[i as usize]).sum();
        let w = ids.iter().map(|&i| scores[i as usize] / sum * 2.5).collect();
        (ids, w)
    }

    #[test]
    fn grouped_sigmoid_routing_with_a_correction_bias_matches_the_plain_rule() {
        let mut seed = 11u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        let spec = RouterSpec {
            top_k: 3,
            score: RouterScore::Sigmoid,
            renormalize: true,
            scale: 2.5,
            correction_bias: true,
            groups: Some(GroupLimit { groups: 4, top_groups: 2, score: GroupScore::TopTwoSum }),
            ..Default::default()
        };
        for _ in 0..200 {
            let logits: Vec<f32> = (0..12).map(|_| rnd()).collect();
            let bias: Vec<f32> = (0..12).map(|_| rnd() * 0.2).collect();
            let (mut probs, mut sel, mut ids, mut w) = ([0.0; 12], [0.0; 12], [0u32; 3], [0.0f32; 3]);
            route(&logits, &spec, Some(&bias), &mut probs, &mut sel, &mut ids, &mut w);
            let (want_ids, want_w) = reference_v3(&logits, &bias, 4, 2, 3);
            assert_eq!(ids.to_vec(), want_ids);
            for (a, b) in w.iter().zip(&want_w) {
                assert!((a - b).abs() < 1e-6, "{a} vs {b}");
            }
        }
    }

    /// ERNIE-4.5's rule: softmax scores, the choice on score + bias, the
    /// chosen scores divided by max(their sum, floor).
    #[test]
    fn renormalisation_floor_divides_by_the_larger_of_sum_and_floor() {
        let logits = [0.0f32, 1.0, 0.2, -0.5, 0.9];
        let bias = [0.0f32, 0.0, 0.3, 0.0, -0.2];
        let (mut probs, mut sel, mut ids, mut w) = ([0.0; 5], [0.0; 5], [0u32; 2], [0.0f32; 2]);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        let p = |e: usize| logits[e].exp() / z;
        for floor in [0.0f32, 0.3, 0.9] {
            let spec = RouterSpec {
                top_k: 2,
                renormalize: true,
                renormalize_floor: floor,
                correction_bias: true,
                ..Default::default()
            };
            route(&logits, &spec, Some(&bias), &mut probs, &mut sel, &mut ids, &mut w);
            // Scores + bias: 0.2 + 0.3 puts expert 2 ahead of expert 4.
            assert_eq!(ids, [2, 1]);
            let sum = p(1) + p(2);
            assert!(sum > 0.3 && sum < 0.9);
            let div = sum.max(floor);
            assert!((w[0] - p(2) / div).abs() < 1e-6 && (w[1] - p(1) / div).abs() < 1e-6, "floor {floor}: {w:?}");
        }
    }

    #[test]
    fn softmax_over_the_selected_logits_and_group_max() {
        let logits = [0.5f32, 2.0, -1.0, 1.0, 3.0, 0.0];
        let (mut probs, mut sel, mut ids, mut w) = ([0.0; 6], [0.0; 6], [0u32; 2], [0.0f32; 2]);
        let spec = RouterSpec { top_k: 2, score: RouterScore::SoftmaxSelected, ..Default::default() };
        route(&logits, &spec, None, &mut probs, &mut sel, &mut ids, &mut w);
        assert_eq!(ids, [4, 1]);
        let z = 3f32.exp() + 2f32.exp();
        assert!((w[0] - 3f32.exp() / z).abs() < 1e-6 && (w[1] - 2f32.exp() / z).abs() < 1e-6);
        // Groups of two scored by their best: {0,1} 2.0, {2,3} 1.0, {4,5} 3.0; keep one group.
        let spec = RouterSpec {
            top_k: 2,
            groups: Some(GroupLimit { groups: 3, top_groups: 1, score: GroupScore::Max }),
            ..Default::default()
        };
        route(&logits, &spec, None, &mut probs, &mut sel, &mut ids, &mut w);
        assert_eq!(ids, [4, 5]);
    }
}
