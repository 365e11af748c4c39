//! DeepSeek-V4's attention ([`PooledSpec`]): one key/value head whose rows
//! are both keys and values, attended over a sliding window and over the
//! layer's pool of compressed past entries, with a learned sink per head
//! and a grouped low-rank output projection.
//!
//! ```text
//! q_lat = rmsnorm(Wq_a · x)                       [T, Rq]
//! q     = rope(rms_per_head(Wq_b · q_lat))        [T, H·Dh]   last Dr values rotate
//! kv    = rope(rmsnorm(Wkv · x))                  [T, Dh]     key and value
//! pool:  each block of `rate` tokens → one entry  [Dh]        (softmax pooling, see Pooler)
//! o_h   = softmax(q_h·[window kv ; entries] / √Dh, sink_h) · [window kv ; entries]
//! o_h   = rope⁻¹(o_h)                                         at the query's position
//! out   = Wo · concat_g(Wo_a[g] · o_group g)     [T, D]
//! ```
//!
//! Light layers keep, per query, only the `top_k` entries a lightning
//! indexer scores best; heavy layers attend to every finished entry. An
//! entry is visible to the query at position p once its block has ended at
//! or before p (`entry < (p + 1) / rate`).
//!
//! State per sequence ([`PooledState`]), all float32: the window's last
//! `window` rows (a ring), each pooler's unfinished block (and, on light
//! layers, the previous block's overlapping half), the pooled entries and
//! the index keys. Nothing is allocated per token: the entries' rows are
//! sized for the sequence's longest length up front.

use rayon::prelude::*;

use super::Inputs;
use super::attention::KvView;
use super::indexer::score;
use super::moe::top_k;
use super::rope::{Rope, apply_pairs};
use crate::canonical::config::{Pool, PooledSpec};
use crate::kernels::{KV_QUERIES, Matrix, matmul};
use crate::model::weights::TensorRef;
use crate::quant::DType;

/// One pooler's weights: the projections of the rows it pools and of their
/// gates (`[m·W, D]`, m = 2 with overlapping blocks), the gates' bias per
/// position in the block (`[rate, m·W]`) and the entry's RMSNorm (`[W]`).
#[derive(Clone, Copy, Debug)]
pub struct PoolRefs {
    /// [m·W, D]
    pub kv: TensorRef,
    /// [m·W, D]
    pub gate: TensorRef,
    /// [rate, m·W]
    pub bias: TensorRef,
    /// `[W]`
    pub norm: TensorRef,
}

/// A light layer's lightning indexer: its own pooler of index keys, the
/// index queries from the query latent and the heads' weights.
#[derive(Clone, Copy, Debug)]
pub struct PoolIndexRefs {
    /// The index keys' pooler (W = Di).
    pub pool: PoolRefs,
    /// [Hi·Di, Rq]
    pub wq: TensorRef,
    /// [Hi, D] (f32)
    pub weights: TensorRef,
}

/// A pooled-attention layer's weights.
#[derive(Clone, Copy, Debug)]
pub struct PooledRefs {
    /// [Rq, D]
    pub wq_a: TensorRef,
    /// `[Rq]`
    pub q_a_norm: TensorRef,
    /// [H·Dh, Rq]
    pub wq_b: TensorRef,
    /// [Dh, D]
    pub wkv: TensorRef,
    /// `[Dh]`
    pub kv_norm: TensorRef,
    /// `[H]`
    pub sinks: TensorRef,
    /// [G·Ro, H·Dh/G]
    pub wo_a: TensorRef,
    /// The layer's pool (none on window-only layers).
    pub pool: Option<PoolRefs>,
    /// The indexer (light layers).
    pub index: Option<PoolIndexRefs>,
}

/// A pooler's weights as views.
#[derive(Clone, Copy)]
pub struct PoolW<'a> {
    kv: Matrix<'a>,
    gate: Matrix<'a>,
    bias: &'a [f32],
    norm: &'a [f32],
}

impl<'a> PoolW<'a> {
    /// Views of `r`'s tensors.
    pub fn new(r: &PoolRefs, mat: impl Fn(TensorRef) -> Matrix<'a>, vec: impl Fn(TensorRef) -> &'a [f32]) -> Self {
        PoolW { kv: mat(r.kv), gate: mat(r.gate), bias: vec(r.bias), norm: vec(r.norm) }
    }
}

/// One series of pooled entries of a sequence (the layer's, or the
/// indexer's keys) and the block still filling.
#[derive(Clone, Debug)]
pub struct Pooler {
    /// W: values per entry.
    width: usize,
    /// Tokens per entry.
    rate: usize,
    /// Each entry also reads the previous block (two series per row).
    overlap: bool,
    /// `[rate, m·W]` projected rows of the unfinished block.
    block_kv: Vec<f32>,
    /// `[rate, m·W]` their gates, bias added.
    block_gate: Vec<f32>,
    /// `[rate, W]` the last finished block's first series (overlap only).
    prev_kv: Vec<f32>,
    /// `[rate, W]` its gates.
    prev_gate: Vec<f32>,
    /// A block has finished (so `prev_*` hold one).
    has_prev: bool,
    /// `[capacity, W]` the entries.
    entries: Vec<f32>,
    /// Entries finished.
    count: usize,
}

impl Pooler {
    fn new(width: usize, rate: usize, overlap: bool, max_seq: usize) -> Pooler {
        let m = if overlap { 2 } else { 1 };
        let prev = if overlap { rate * width } else { 0 };
        Pooler {
            width,
            rate,
            overlap,
            block_kv: vec![0.0; rate * m * width],
            block_gate: vec![0.0; rate * m * width],
            prev_kv: vec![0.0; prev],
            prev_gate: vec![0.0; prev],
            has_prev: false,
            entries: vec![0.0; max_seq / rate * width],
            count: 0,
        }
    }

    /// `[count, W]` the finished entries.
    pub fn entries(&self) -> &[f32] {
        &self.entries[..self.count * self.width]
    }

    /// Feeds the token at `pos` (its projected row `kv` and gate `gate`,
    /// `[m·W]` each); when it ends a block, pools the block into the next
    /// entry: per channel a softmax over the block's positions of the
    /// gates, weighing the rows; then the RMSNorm and the rotation at the
    /// block's first position. With overlap the softmax runs over the
    /// previous block's first series and this block's second one.
    fn push(&mut self, pos: usize, kv: &[f32], gate: &[f32], w: &PoolW, fin: Finish) {
        let Finish { eps, rope, rd } = fin;
        let (width, rate) = (self.width, self.rate);
        let m = if self.overlap { 2 } else { 1 };
        let j = pos % rate;
        let row = m * width;
        self.block_kv[j * row..(j + 1) * row].copy_from_slice(kv);
        let g = &mut self.block_gate[j * row..(j + 1) * row];
        g.iter_mut().zip(gate).zip(&w.bias[j * row..(j + 1) * row]).for_each(|((o, &a), &b)| *o = a + b);
        if j + 1 < rate {
            return;
        }
        let at = self.count * width;
        let entry = &mut self.entries[at..at + width];
        // Each channel: the softmax over the slots that take part.
        let (cur, prev) = (if self.overlap { width } else { 0 }, self.overlap && self.has_prev);
        for (c, out) in entry.iter_mut().enumerate() {
            let mut mx = f32::NEG_INFINITY;
            for s in 0..rate {
                mx = mx.max(self.block_gate[s * row + cur + c]);
                if prev {
                    mx = mx.max(self.prev_gate[s * width + c]);
                }
            }
            let (mut z, mut acc) = (0.0f32, 0.0f32);
            if prev {
                for s in 0..rate {
                    let e = crate::math::expf(self.prev_gate[s * width + c] - mx);
                    z += e;
                    acc += e * self.prev_kv[s * width + c];
                }
            }
            for s in 0..rate {
                let e = crate::math::expf(self.block_gate[s * row + cur + c] - mx);
                z += e;
                acc += e * self.block_kv[s * row + cur + c];
            }
            *out = acc / z;
        }
        let raw: &mut [f32] = entry;
        rms_in_place(raw, w.norm, eps);
        let first = self.count * rate;
        rotate_tail(raw, rope, first, rd, false);
        if self.overlap {
            for s in 0..rate {
                self.prev_kv[s * width..(s + 1) * width].copy_from_slice(&self.block_kv[s * row..s * row + width]);
                self.prev_gate[s * width..(s + 1) * width].copy_from_slice(&self.block_gate[s * row..s * row + width]);
            }
            self.has_prev = true;
        }
        self.count += 1;
    }

    /// Entries finished.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Tokens per entry.
    pub fn rate(&self) -> usize {
        self.rate
    }

    /// Brings the pool to `count` entries by repeating its finished ones in
    /// order (at most what the state was sized for): the work of a long
    /// context without prefilling it, for decode benchmarks. Does nothing
    /// without an entry to repeat.
    pub fn repeat_to(&mut self, count: usize) {
        let (w, have) = (self.width, self.count);
        let count = count.min(self.entries.len() / w);
        if have == 0 || count <= have {
            return;
        }
        for e in have..count {
            let src = (e % have) * w;
            self.entries.copy_within(src..src + w, e * w);
        }
        self.count = count;
    }

    /// Forgets everything (a sequence going back to its start).
    fn reset(&mut self) {
        self.count = 0;
        self.has_prev = false;
    }

    /// Values this pooler's state holds at position `pos` (what
    /// [`Pooler::copy_to`] writes).
    fn len_at(&self) -> usize {
        self.block_kv.len()
            + self.block_gate.len()
            + self.prev_kv.len()
            + self.prev_gate.len()
            + 1
            + self.count * self.width
    }

    fn copy_to(&self, out: &mut Vec<f32>) {
        out.push(self.count as f32 + if self.has_prev { 0.5 } else { 0.0 });
        out.extend_from_slice(&self.block_kv);
        out.extend_from_slice(&self.block_gate);
        out.extend_from_slice(&self.prev_kv);
        out.extend_from_slice(&self.prev_gate);
        out.extend_from_slice(self.entries());
    }

    fn copy_from<'s>(&mut self, s: &'s [f32]) -> &'s [f32] {
        let tag = s[0];
        self.count = tag as usize;
        self.has_prev = tag.fract() != 0.0;
        let mut at = 1;
        for buf in [&mut self.block_kv, &mut self.block_gate, &mut self.prev_kv, &mut self.prev_gate] {
            let n = buf.len();
            buf.copy_from_slice(&s[at..at + n]);
            at += n;
        }
        let n = self.count * self.width;
        self.entries[..n].copy_from_slice(&s[at..at + n]);
        &s[at + n..]
    }
}

/// How a finished block becomes an entry: the norm's epsilon, the RoPE and
/// how many values it rotates.
#[derive(Clone, Copy)]
struct Finish<'a> {
    eps: f32,
    rope: &'a Rope,
    rd: usize,
}

/// RMSNorm of `x` with scale `w`, in place.
fn rms_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let ms = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64;
    let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
    x.iter_mut().zip(w).for_each(|(v, &g)| *v = *v * inv * g);
}

/// Rotates the last `rd` values of `x` in adjacent pairs by the angles of
/// position `pos` (backwards with `inverse`).
fn rotate_tail(x: &mut [f32], rope: &Rope, pos: usize, rd: usize, inverse: bool) {
    let mut cos = [0.0f32; MAX_HALF];
    let mut sin = [0.0f32; MAX_HALF];
    let half = rd / 2;
    rope.angles(pos, 0, &mut cos[..half], &mut sin[..half]);
    if inverse {
        sin[..half].iter_mut().for_each(|s| *s = -*s);
    }
    let n = x.len();
    apply_pairs(&mut x[n - rd..], &cos[..half], &sin[..half]);
}

/// Most rotated pairs a head may have (the released models rotate 32).
pub const MAX_HALF: usize = 256;

/// A pooled layer's state for one sequence.
#[derive(Clone, Debug)]
pub struct PooledState {
    /// Rows of the window ring.
    window: usize,
    /// `[window, Dh]` the last `window` key/value rows, position p at row p % window.
    ring: Vec<f32>,
    /// The layer's entries (heavy and light layers).
    pub pool: Option<Pooler>,
    /// The indexer's keys (light layers).
    pub index: Option<Pooler>,
    /// The state at the sequence's checkpoint ([`PooledState::save`]).
    saved: Vec<f32>,
}

impl PooledState {
    /// The empty state of a layer with `pool` for sequences of up to `max_seq` tokens.
    pub fn new(spec: &PooledSpec, head_dim: usize, pool: Pool, max_seq: usize) -> PooledState {
        let (p, ix) = match pool {
            Pool::Window => (None, None),
            Pool::Heavy => (Some(Pooler::new(head_dim, spec.heavy_rate, false, max_seq)), None),
            Pool::Light => (
                Some(Pooler::new(head_dim, spec.light_rate, true, max_seq)),
                Some(Pooler::new(spec.indexer.head_dim, spec.light_rate, true, max_seq)),
            ),
        };
        PooledState {
            window: spec.window,
            ring: vec![0.0; spec.window * head_dim],
            pool: p,
            index: ix,
            saved: Vec::new(),
        }
    }

    /// Back to the start.
    pub fn reset(&mut self) {
        for p in self.pool.iter_mut().chain(self.index.iter_mut()) {
            p.reset();
        }
    }

    /// Keeps a copy of the state, for [`PooledState::restore`].
    pub fn save(&mut self) {
        let mut saved = std::mem::take(&mut self.saved);
        saved.clear();
        self.copy_to(&mut saved);
        self.saved = saved;
    }

    /// Goes back to the state [`PooledState::save`] kept.
    pub fn restore(&mut self) {
        let saved = std::mem::take(&mut self.saved);
        self.copy_from(&saved);
        self.saved = saved;
    }

    /// Values [`PooledState::copy_to`] writes.
    pub fn len(&self) -> usize {
        self.ring.len() + self.pool.iter().chain(self.index.iter()).map(Pooler::len_at).sum::<usize>()
    }

    /// Whether the state holds no values (never: the window has rows).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole state at the current position, appended to `out`.
    pub fn copy_to(&self, out: &mut Vec<f32>) {
        out.extend_from_slice(&self.ring);
        for p in self.pool.iter().chain(self.index.iter()) {
            p.copy_to(out);
        }
    }

    /// Restores what [`PooledState::copy_to`] wrote; returns the rest of `s`.
    pub fn copy_from<'s>(&mut self, s: &'s [f32]) -> &'s [f32] {
        let n = self.ring.len();
        self.ring.copy_from_slice(&s[..n]);
        let mut rest = &s[n..];
        for p in self.pool.iter_mut().chain(self.index.iter_mut()) {
            rest = p.copy_from(rest);
        }
        rest
    }
}

/// Buffers of the pooled layers' forward pass, for up to C tokens.
#[derive(Default)]
pub struct PooledScratch {
    /// [C, Rq] the query latent.
    q_lat: Vec<f32>,
    /// [C, Dh] the key/value rows.
    kv: Vec<f32>,
    /// [C, 2·Dh] the rows to pool, and [C, 2·Dh] their gates.
    pool_kv: Vec<f32>,
    pool_gate: Vec<f32>,
    /// [C, 2·Di] the index rows to pool, and their gates.
    idx_kv: Vec<f32>,
    idx_gate: Vec<f32>,
    /// [C, Hi·Di] index queries; [C, Hi] their weights.
    idx_q: Vec<f32>,
    idx_w: Vec<f32>,
    /// `[E]` one query's index scores, E the most entries a sequence has.
    idx_scores: Vec<f32>,
    /// `[K]` one query's chosen entries.
    chosen: Vec<u32>,
    /// [H, W + K + 1] each head's attention weights for one query.
    probs: Vec<f32>,
    /// [W + K, Dh] the rows one query reads, gathered.
    rows: Vec<f32>,
    /// [C, H·Dh / G] one group's inputs, [C, Ro] its outputs, [C, G·Ro] all groups' outputs.
    group_in: Vec<f32>,
    group_tmp: Vec<f32>,
    group_out: Vec<f32>,
}

impl PooledScratch {
    /// Buffers for `spec` with `h` heads of `dh` values and model width `d`,
    /// for passes of `chunk` tokens and sequences up to `max_seq_len`.
    pub fn new(spec: Option<&PooledSpec>, h: usize, dh: usize, chunk: usize, max_seq_len: usize) -> PooledScratch {
        let Some(p) = spec else { return PooledScratch::default() };
        let ix = p.indexer;
        let light_entries = max_seq_len / p.light_rate;
        let heavy_entries = max_seq_len / p.heavy_rate;
        let seen = p.window + ix.top_k.min(light_entries).max(heavy_entries) + 1;
        PooledScratch {
            q_lat: vec![0.0; chunk * p.q_lora_rank],
            kv: vec![0.0; chunk * dh],
            pool_kv: vec![0.0; chunk * 2 * dh],
            pool_gate: vec![0.0; chunk * 2 * dh],
            idx_kv: vec![0.0; chunk * 2 * ix.head_dim],
            idx_gate: vec![0.0; chunk * 2 * ix.head_dim],
            idx_q: vec![0.0; chunk * ix.heads * ix.head_dim],
            idx_w: vec![0.0; chunk * ix.heads],
            idx_scores: vec![0.0; light_entries.max(1)],
            chosen: vec![0; ix.top_k.min(light_entries).max(1)],
            probs: vec![0.0; h * seen],
            rows: vec![0.0; seen * dh],
            group_in: vec![0.0; chunk * h * dh / p.o_groups],
            group_tmp: vec![0.0; chunk * p.o_lora_rank],
            group_out: vec![0.0; chunk * p.o_groups * p.o_lora_rank],
        }
    }
}

/// A pooled layer's weights as views, with what the pass needs to know.
pub struct Pooled<'a> {
    /// Its spec.
    pub spec: &'a PooledSpec,
    /// Which pool.
    pub pool: Pool,
    /// H heads of Dh values.
    pub h: usize,
    /// Dh.
    pub dh: usize,
    /// The model's norm epsilon.
    pub eps: f32,
    /// The RoPE of this layer (the model's for window-only layers, the pool's otherwise).
    pub rope: &'a Rope,
    /// The pool's RoPE (its entries and the indexer always use it).
    pub pool_rope: &'a Rope,
    /// [Rq, D]
    pub wq_a: Matrix<'a>,
    /// `[Rq]`
    pub q_a_norm: &'a [f32],
    /// [H·Dh, Rq]
    pub wq_b: Matrix<'a>,
    /// [Dh, D]
    pub wkv: Matrix<'a>,
    /// `[Dh]`
    pub kv_norm: &'a [f32],
    /// `[H]`
    pub sinks: &'a [f32],
    /// [G·Ro, H·Dh/G]
    pub wo_a: Matrix<'a>,
    /// The layer's pooler.
    pub pooler: Option<PoolW<'a>>,
    /// The indexer: its pooler, [Hi·Di, Rq] queries, [Hi, D] weights.
    pub index: Option<(PoolW<'a>, Matrix<'a>, &'a [f32])>,
}

impl Pooled<'_> {
    /// Projects the chunk's `n` rows of `xn` ([T, D]): queries into `q`
    /// ([T, H·Dh], normed per head and rotated at positions `pos[t]`), and
    /// the key/value rows, pooled rows, index rows and index queries into
    /// the scratch.
    pub fn project(&self, xn: &[f32], pos: &[usize], xq: &mut Inputs, q: &mut [f32], s: &mut PooledScratch) {
        let (n, d) = (pos.len(), self.wq_a.cols);
        let (rq, dh, rd) = (self.spec.q_lora_rank, self.dh, self.spec.rope_dim);
        let inp = xq.prepare(&xn[..n * d], d);
        matmul(&self.wq_a, &inp, &mut s.q_lat[..n * rq]); // [T, Rq]
        matmul(&self.wkv, &inp, &mut s.kv[..n * dh]); // [T, Dh]
        if let Some(pw) = &self.pooler {
            let m = pw.kv.rows;
            matmul(&pw.kv, &inp, &mut s.pool_kv[..n * m]); // [T, m·Dh]
            matmul(&pw.gate, &inp, &mut s.pool_gate[..n * m]);
        }
        if let Some((iw, _, weights)) = &self.index {
            let m = iw.kv.rows;
            matmul(&iw.kv, &inp, &mut s.idx_kv[..n * m]); // [T, 2·Di]
            matmul(&iw.gate, &inp, &mut s.idx_gate[..n * m]);
            let hi = weights.len() / d;
            let scale = 1.0 / (hi as f32).sqrt();
            for t in 0..n {
                let x = &xn[t * d..(t + 1) * d];
                for (hh, w) in s.idx_w[t * hi..(t + 1) * hi].iter_mut().enumerate() {
                    let dot: f32 = weights[hh * d..(hh + 1) * d].iter().zip(x).map(|(a, b)| a * b).sum();
                    *w = dot * scale; // [Hi]
                }
            }
        }
        for (t, &p) in pos.iter().enumerate() {
            let row = &mut s.q_lat[t * rq..(t + 1) * rq];
            rms_in_place(row, self.q_a_norm, self.eps);
            let kv = &mut s.kv[t * dh..(t + 1) * dh];
            rms_in_place(kv, self.kv_norm, self.eps);
            rotate_tail(kv, self.rope, p, rd, false);
        }
        let lat = xq.prepare(&s.q_lat[..n * rq], rq);
        matmul(&self.wq_b, &lat, &mut q[..n * self.h * dh]); // [T, H·Dh]
        if let Some((_, wq, _)) = &self.index {
            matmul(wq, &lat, &mut s.idx_q[..n * wq.rows]); // [T, Hi·Di]
        }
        for t in 0..n {
            for head in q[t * self.h * dh..(t + 1) * self.h * dh].chunks_exact_mut(dh) {
                let ms = head.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / dh as f64;
                let inv = (1.0 / (ms + self.eps as f64).sqrt()) as f32;
                head.iter_mut().for_each(|v| *v *= inv);
                rotate_tail(head, self.rope, pos[t], rd, false);
            }
            if let Some((iw, wq, _)) = &self.index {
                let di = iw.norm.len();
                let hi = wq.rows / di;
                for head in s.idx_q[t * hi * di..(t + 1) * hi * di].chunks_exact_mut(di) {
                    rotate_tail(head, self.pool_rope, pos[t], rd, false);
                }
            }
        }
    }

    /// One sequence's rows `r0..r0 + m` of the chunk (positions `pos0..`):
    /// feeds the poolers, then attends each query over its window and its
    /// entries into `att` ([m, H·Dh], rotated back), then stores the window
    /// rows.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        st: &mut PooledState,
        q: &[f32],
        r0: usize,
        m: usize,
        pos0: usize,
        s: &mut PooledScratch,
        att: &mut [f32],
    ) {
        let (dh, h, rd, eps) = (self.dh, self.h, self.spec.rope_dim, self.eps);
        let pr = self.pool_rope;
        if pos0 == 0 {
            st.reset(); // a sequence (re)starting
        }
        let fin = Finish { eps, rope: pr, rd };
        // The poolers first: a block ending inside the chunk is visible to
        // the chunk's later queries.
        if let (Some(pw), Some(p)) = (&self.pooler, st.pool.as_mut()) {
            let w = pw.kv.rows;
            for i in 0..m {
                let t = r0 + i;
                p.push(pos0 + i, &s.pool_kv[t * w..(t + 1) * w], &s.pool_gate[t * w..(t + 1) * w], pw, fin);
            }
        }
        if let (Some((iw, _, _)), Some(p)) = (&self.index, st.index.as_mut()) {
            let w = iw.kv.rows;
            for i in 0..m {
                let t = r0 + i;
                p.push(pos0 + i, &s.idx_kv[t * w..(t + 1) * w], &s.idx_gate[t * w..(t + 1) * w], iw, fin);
            }
        }
        let win = st.window;
        let scale = 1.0 / (dh as f32).sqrt();
        let seen = s.probs.len() / h;
        let kk = crate::kernels::kv_fns(DType::F32).expect("f32 attention kernels");
        for i in 0..m {
            let (t, p) = (r0 + i, pos0 + i);
            // The entries this query reads: all finished ones (heavy), the
            // indexer's choice among them (light).
            let visible = st.pool.as_ref().map_or(0, |pl| (pl.count).min((p + 1) / pl.rate));
            let chosen: &[u32] = match (&self.index, st.index.as_ref()) {
                (Some((_, wq, _)), Some(ix)) => {
                    let k = self.spec.indexer.top_k;
                    let di = ix.width;
                    let hi = wq.rows / di;
                    let n_vis = ix.count.min((p + 1) / ix.rate);
                    let qi = &s.idx_q[t * hi * di..(t + 1) * hi * di];
                    let wi = &s.idx_w[t * hi..(t + 1) * hi];
                    let scores = &mut s.idx_scores[..n_vis];
                    let keys = KvView {
                        dtype: DType::F32,
                        k: bytemuck::cast_slice(&ix.entries[..n_vis * di]),
                        v: &[],
                        k_row: di,
                        v_row: di,
                        k_head: n_vis * di,
                        v_head: 0,
                        base: 0,
                    };
                    score(qi, wi, di, keys, scores); // [E], each entry on its own
                    let keep = k.min(n_vis);
                    top_k(scores, keep, &mut s.chosen[..keep]); // [K]
                    &s.chosen[..keep]
                }
                _ => &s.chosen[..0],
            };
            let light = self.index.is_some();
            let entries = st.pool.as_ref().map_or(&[][..], |pl| pl.entries());
            let first = (p + 1).saturating_sub(win);
            let n_ent = if light { chosen.len() } else { visible };
            let nw = p + 1 - first;
            let nk = nw + n_ent;
            // The rows this query reads, gathered in order (window, then
            // entries) so the kernels see one contiguous run of keys.
            let rows = &mut s.rows[..nk * dh];
            for (j, row) in rows[..nw * dh].chunks_exact_mut(dh).enumerate() {
                let q_pos = first + j;
                row.copy_from_slice(if q_pos >= pos0 {
                    let r = r0 + q_pos - pos0;
                    &s.kv[r * dh..(r + 1) * dh]
                } else {
                    let r = q_pos % win;
                    &st.ring[r * dh..(r + 1) * dh]
                });
            }
            for (j, row) in rows[nw * dh..].chunks_exact_mut(dh).enumerate() {
                let e = if light { chosen[j] as usize } else { j };
                row.copy_from_slice(&entries[e * dh..(e + 1) * dh]);
            }
            let rows: &[u8] = bytemuck::cast_slice(&*rows);
            let qrow = &q[t * h * dh..(t + 1) * h * dh];
            let out = &mut att[i * h * dh..(i + 1) * h * dh];
            // Up to KV_QUERIES heads per task read each row once; every
            // (head, row) product has the same bits whatever the grouping.
            let groups = out.par_chunks_mut(KV_QUERIES * dh).zip(s.probs.par_chunks_mut(KV_QUERIES * seen));
            groups.enumerate().for_each(|(g, (o, pb))| {
                let h0 = g * KV_QUERIES;
                let nq = o.len() / dh;
                let qs: [&[f32]; KV_QUERIES] = std::array::from_fn(|j| &qrow[(h0 + j.min(nq - 1)) * dh..][..dh]);
                (kk.dots)(rows, dh, nk, &qs[..nq], pb, seen); // [nq, nk] at stride `seen`
                for (j, pr) in pb.chunks_mut(seen).take(nq).enumerate() {
                    let pr = &mut pr[..nk];
                    pr.iter_mut().for_each(|v| *v *= scale);
                    let sink = self.sinks[h0 + j];
                    let mx = pr.iter().cloned().fold(sink, f32::max);
                    let mut z = crate::math::expf(sink - mx);
                    for v in pr.iter_mut() {
                        *v = crate::math::expf(*v - mx);
                        z += *v;
                    }
                    let inv = 1.0 / z;
                    pr.iter_mut().for_each(|v| *v *= inv);
                }
                o.fill(0.0);
                (kk.pv)(o, &pb[..(nq - 1) * seen + nk], seen, rows, dh, nk); // [nq, Dh]
                for oh in o.chunks_exact_mut(dh) {
                    rotate_tail(oh, self.rope, p, rd, true);
                }
            });
        }
        // The window keeps the chunk's last rows.
        for i in m.saturating_sub(win)..m {
            let (t, p) = (r0 + i, pos0 + i);
            let r = p % win;
            st.ring[r * dh..(r + 1) * dh].copy_from_slice(&s.kv[t * dh..(t + 1) * dh]);
        }
    }

    /// The grouped output projection's first half: `att` ([T, H·Dh]) group
    /// by group through `Wo_a`, into `[T, G·Ro]` (left in the scratch, and
    /// returned).
    pub fn group_out<'s>(&self, att: &[f32], n: usize, xq: &mut Inputs, s: &'s mut PooledScratch) -> &'s [f32] {
        let (g, ro, hd) = (self.spec.o_groups, self.spec.o_lora_rank, self.h * self.dh);
        let width = hd / g;
        for grp in 0..g {
            for t in 0..n {
                let src = &att[t * hd + grp * width..t * hd + (grp + 1) * width];
                s.group_in[t * width..(t + 1) * width].copy_from_slice(src);
            }
            let w = self.wo_a.row_range(grp * ro, ro);
            let inp = xq.prepare(&s.group_in[..n * width], width);
            matmul(&w, &inp, &mut s.group_tmp[..n * ro]); // [T, Ro] of this group
            for t in 0..n {
                let dst = t * g * ro + grp * ro;
                s.group_out[dst..dst + ro].copy_from_slice(&s.group_tmp[t * ro..(t + 1) * ro]);
            }
        }
        &s.group_out[..n * g * ro]
    }
}
