//! Per-conversation state: the KV cache and every activation buffer, sized
//! once at creation so the forward pass never allocates. It lives beside the
//! model (the engine wraps it) because the forward pass is its only user.

use crate::canonical::config::{FfnSpec, MixerSpec, ModelConfig};
use crate::canonical::state::{LayerState, ROLLBACK, Rows, window_rows};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::model::blocks::block_index::BlockIndexScratch;
use crate::model::blocks::delta::{DeltaScratch, DeltaState};
use crate::model::blocks::indexer::{IndexKeys, IndexerScratch};
use crate::model::blocks::kv_cache::KvCache;
use crate::model::blocks::mla::MlaScratch;
use crate::model::blocks::moe::MoeScratch;
use crate::model::blocks::pooled::{PooledScratch, PooledState};
use crate::model::blocks::{Inputs, q8_blocks};
use crate::quant::DType;
use crate::quant::act::BlockQ8;

/// Element type of a session's KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheType {
    /// f16 when the model has block-quantised weights (their rounding already
    /// dwarfs the cache's), f32 otherwise (so f32/bf16/f16 models stay exact
    /// against transformers).
    #[default]
    Auto,
    /// 4 bytes per value.
    F32,
    /// 2 bytes per value: half the memory and half the attention reads.
    F16,
}

impl KvCacheType {
    /// Parses `auto`, `f32` or `f16`.
    pub fn parse(s: &str) -> Option<KvCacheType> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Some(KvCacheType::Auto),
            "f32" | "float32" => Some(KvCacheType::F32),
            "f16" | "float16" => Some(KvCacheType::F16),
            _ => None,
        }
    }

    /// The element type for `model`.
    pub fn resolve(self, model: &Model) -> DType {
        match self {
            KvCacheType::F32 => DType::F32,
            KvCacheType::F16 => DType::F16,
            KvCacheType::Auto if model.has_block_weights() => DType::F16,
            KvCacheType::Auto => DType::F32,
        }
    }
}

pub use crate::canonical::state::DEFAULT_CHUNK;

/// One sequence's own state: its KV cache, its position and the logits of
/// its last token. A [`Workspace`] holds everything a forward pass only needs
/// while it runs, so many sequences can share one (see
/// [`crate::model::forward::forward_batch`]).
pub struct Sequence {
    /// Longest sequence this holds (KV cache rows).
    pub max_seq: usize,
    /// Tokens already in the cache (the next token's position).
    pub pos: usize,
    /// One state per layer, of the layer's kind; reached through [`Sequence::kv`].
    layers: Vec<LayerCache>,
    /// `[V]` logits of the last token processed.
    pub logits: Vec<f32>,
    /// `[R − 1, V]` logits of the tokens before the last, when a pass asked
    /// for `R` rows to verify drafted tokens (empty until
    /// [`Sequence::allow_logit_rows`] makes room).
    pub earlier_logits: Vec<f32>,
    /// The position of the last [`Sequence::checkpoint`], while it is still
    /// at or before `pos`.
    checkpoint: Option<usize>,
    /// Layers of the ordinary forward pass (the multi-token-prediction
    /// layer, if any, is after them).
    main_layers: usize,
    /// The multi-token-prediction layer's rows, when this sequence drafts
    /// with it ([`Sequence::enable_mtp`]).
    pub mtp: Option<MtpRows>,
}

/// The error for drafts asked of a file without a multi-token-prediction layer.
pub const NO_MTP: &str = "this model file holds no multi-token-prediction layer: convert the checkpoint \
                          with --keep-mtp (keep_mtp=True), or draft with speculative=\"ngram\"";

/// What a sequence drafting with the multi-token-prediction layer keeps
/// besides that layer's KV cache. The layer's row at position `i` reads the
/// hidden state of position `i` and the token at `i + 1`, so it trails the
/// ordinary layers by one position: each pass computes the rows whose next
/// token it has, and keeps its hidden states for the rows still to come.
#[derive(Debug)]
pub struct MtpRows {
    /// Positions whose row the layer's cache holds (`0..held`).
    pub held: usize,
    /// `[count, D]` hidden states (after the final norm) of positions
    /// `first..first + count`: the last pass's, after the one before it.
    hidden: Vec<f32>,
    first: usize,
    count: usize,
    /// A row could not be computed (its hidden state is gone): the layer
    /// drafts no more for this sequence.
    pub lost: bool,
    /// Seconds the passes spent on these rows since the owner last took
    /// them (what drafting costs beyond the drafts themselves).
    pub secs: f64,
}

impl MtpRows {
    /// Keeps the hidden states `h` ([m, D]) of positions `pos..pos + m`,
    /// and the one of `pos − 1` if it was kept.
    pub fn keep(&mut self, pos: usize, h: &[f32], d: usize) {
        let m = h.len() / d;
        let carried = pos.checked_sub(1).and_then(|p| p.checked_sub(self.first)).filter(|&i| i < self.count);
        let at = usize::from(carried.is_some());
        if self.hidden.len() < (m + at) * d {
            self.hidden.resize((m + at) * d, 0.0);
        }
        if let Some(i) = carried {
            self.hidden.copy_within(i * d..(i + 1) * d, 0);
        }
        self.hidden[at * d..(at + m) * d].copy_from_slice(h);
        self.first = pos - at;
        self.count = m + at;
    }

    /// The hidden states `[n, D]` of positions `p..p + n`, if kept.
    pub fn hidden_rows(&self, p: usize, n: usize, d: usize) -> Option<&[f32]> {
        let i = p.checked_sub(self.first).filter(|&i| i + n <= self.count)?;
        Some(&self.hidden[i * d..(i + n) * d])
    }
}

impl Sequence {
    /// A sequence of up to `max_seq` tokens (capped at the model's context)
    /// fed at most `chunk` tokens per pass, with a KV cache of `kv_dtype`
    /// (f32 or f16).
    pub fn new(model: &Model, max_seq: usize, chunk: usize, kv_dtype: DType) -> Sequence {
        let c = &model.config;
        let max_seq = max_seq.clamp(1, c.max_seq_len);
        // A pipeline stage keeps one-position placeholders for the layers
        // other stages run (they are never read).
        let rows = |l: usize| if model.stage.is_whole() || model.stage.runs(l) { max_seq } else { 1 };
        let layers = (c.layer_states().into_iter().enumerate())
            .map(|(l, st)| LayerCache::new(c, l, st, kv_dtype, rows(l), chunk.max(1)))
            .collect();
        let logits = vec![0.0; c.vocab_size];
        let main_layers = c.main_layers();
        Sequence {
            max_seq,
            pos: 0,
            layers,
            logits,
            earlier_logits: Vec::new(),
            checkpoint: None,
            main_layers,
            mtp: None,
        }
    }

    /// Makes this fresh sequence compute the multi-token-prediction layer's
    /// rows as it goes, for drafts (an error when the model has no such
    /// layer or the sequence has started).
    pub fn enable_mtp(&mut self, model: &Model) -> Result<()> {
        if model.mtp.is_none() {
            return Err(Error::InvalidInput(NO_MTP.into()));
        }
        if self.pos != 0 {
            return Err(Error::InvalidInput("multi-token prediction is enabled before a sequence starts".into()));
        }
        self.mtp = Some(MtpRows { held: 0, hidden: Vec::new(), first: 0, count: 0, lost: false, secs: 0.0 });
        Ok(())
    }

    /// Layer `l`'s key/value cache. This is the one place that turns a
    /// layer's state into the view its mixer reads; every layer keeps a KV
    /// cache today.
    pub fn kv(&mut self, l: usize) -> &mut KvCache {
        match &mut self.layers[l] {
            LayerCache::Kv(cache) | LayerCache::Indexed(cache, _) => cache,
            LayerCache::Delta(_) => panic!("layer {l} is a linear-attention layer: it keeps no KV cache"),
            LayerCache::Pooled(_) => panic!("layer {l} is a pooled-attention layer: it keeps no KV cache"),
        }
    }

    /// Layer `l`'s indexer keys (a sparse layer with an indexer of its own).
    pub fn index_keys(&mut self, l: usize) -> &mut IndexKeys {
        match &mut self.layers[l] {
            LayerCache::Indexed(_, keys) => keys,
            _ => panic!("layer {l} has no indexer: it keeps no index keys"),
        }
    }

    /// Layer `l`'s key/value cache and its indexer keys together (a
    /// block-sparse layer reads both in one pass).
    pub fn kv_and_index_keys(&mut self, l: usize) -> (&mut KvCache, &mut IndexKeys) {
        match &mut self.layers[l] {
            LayerCache::Indexed(cache, keys) => (cache, keys),
            _ => panic!("layer {l} has no indexer: it keeps no index keys"),
        }
    }

    /// Layer `l`'s linear-attention state.
    pub fn delta(&mut self, l: usize) -> &mut DeltaState {
        match &mut self.layers[l] {
            LayerCache::Delta(state) => state,
            LayerCache::Kv(_) | LayerCache::Indexed(..) | LayerCache::Pooled(_) => {
                panic!("layer {l} is an attention layer: it keeps no recurrent state")
            }
        }
    }

    /// Layer `l`'s pooled-attention state.
    pub fn pooled(&mut self, l: usize) -> &mut PooledState {
        match &mut self.layers[l] {
            LayerCache::Pooled(state) => state,
            _ => panic!("layer {l} is not a pooled-attention layer"),
        }
    }
}

impl Sequence {
    /// Makes room for passes asking the logits of up to `rows` tokens.
    pub fn allow_logit_rows(&mut self, rows: usize) {
        let want = rows.saturating_sub(1) * self.logits.len();
        if self.earlier_logits.len() < want {
            self.earlier_logits.resize(want, 0.0);
        }
    }

    /// Rolls the sequence back to its first `pos` tokens, so the next token
    /// goes to position `pos` (how speculative decoding drops rejected
    /// tokens). A KV layer only moves back its position: the rows past it are
    /// overwritten before any query reads them, as positions fill again.
    /// A linear-attention layer's state holds no per-position history: such
    /// a sequence goes back to its start (its next pass begins from the zero
    /// state), to the position of its last [`Sequence::checkpoint`] (the
    /// saved states come back), or nowhere; anything else is an error.
    /// `logits` keeps the last processed token's row until the next pass.
    pub fn truncate(&mut self, pos: usize) -> Result<()> {
        if pos > self.pos {
            return Err(Error::InvalidInput(format!(
                "cannot truncate a sequence of {} tokens to {pos}: it can only go back",
                self.pos
            )));
        }
        if let Some(l) = self.layers.iter().position(|l| matches!(l, LayerCache::Kv(c) if !c.can_resume_at(pos))) {
            return Err(Error::InvalidInput(format!(
                "cannot truncate a sequence of {} tokens to {pos}: layer {l}'s sliding-window cache keeps only \
                 its window and {ROLLBACK} more positions",
                self.pos
            )));
        }
        let recurrent = self.layers.iter().any(|l| matches!(l, LayerCache::Delta(_) | LayerCache::Pooled(_)));
        if recurrent && pos != 0 && pos != self.pos {
            if self.checkpoint != Some(pos) {
                let saved = self.checkpoint.map_or("none".to_string(), |p| p.to_string());
                return Err(Error::InvalidInput(format!(
                    "cannot truncate a sequence of {} tokens to {pos}: its linear-attention or pooled layers keep a \
                     running state, which goes back only to 0 or to a checkpoint (saved at: {saved})",
                    self.pos
                )));
            }
            for layer in &mut self.layers {
                match layer {
                    LayerCache::Delta(state) => state.restore(),
                    LayerCache::Pooled(state) => state.restore(),
                    _ => {}
                }
            }
        }
        if self.checkpoint.is_some_and(|c| c > pos) {
            self.checkpoint = None;
        }
        if let Some(m) = self.mtp.as_mut() {
            // Row i reads token i + 1: rows up to pos − 2 keep theirs.
            m.held = m.held.min(pos.saturating_sub(1));
        }
        self.pos = pos;
        Ok(())
    }

    /// Saves every linear-attention layer's state at the current position,
    /// so [`Sequence::truncate`] can come back to it (one checkpoint per
    /// sequence: a new one replaces the old). Copies the recurrent states
    /// (their bytes are [`StateLayout::bytes_per_sequence`]); KV layers need
    /// nothing. How speculative decoding can reject drafted tokens on these
    /// models: checkpoint, verify, truncate to the checkpoint and feed the
    /// accepted tokens again.
    ///
    /// [`StateLayout::bytes_per_sequence`]: crate::canonical::state::StateLayout
    pub fn checkpoint(&mut self) {
        for layer in &mut self.layers {
            match layer {
                LayerCache::Delta(state) => state.save(),
                LayerCache::Pooled(state) => state.save(),
                _ => {}
            }
        }
        self.checkpoint = Some(self.pos);
    }
}

/// What a layer of a sequence keeps, as the prefix cache sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keeps {
    /// Rows per position (keys and values, a latent, index keys): of every
    /// position, or of a sliding window's last `w` ones.
    Rows {
        /// The sliding window, if any.
        window: Option<usize>,
    },
    /// A recurrent state of fixed size, for the position reached.
    State,
}

impl Keeps {
    /// The positions whose rows a pass starting at `pos` reads (`None` for
    /// a recurrent state, which is needed whole): every earlier one, or the
    /// window's `w − 1` before it.
    pub fn rows_for(self, pos: usize) -> Option<std::ops::Range<usize>> {
        match self {
            Keeps::Rows { window: None } => Some(0..pos),
            Keeps::Rows { window: Some(w) } => Some((pos + 1).saturating_sub(w)..pos),
            Keeps::State => None,
        }
    }
}

impl Sequence {
    /// What each layer keeps.
    pub fn keeps(&self) -> Vec<Keeps> {
        let keeps = |l: &LayerCache| match l {
            LayerCache::Kv(c) => Keeps::Rows { window: c.window() },
            LayerCache::Indexed(..) => Keeps::Rows { window: None },
            LayerCache::Delta(_) | LayerCache::Pooled(_) => Keeps::State,
        };
        self.layers[..self.main_layers].iter().map(keeps).collect()
    }

    /// Layer `l`'s rows of positions `pos0..pos0 + n`, as bytes (every head's
    /// keys, then values, then a sparse layer's index keys), or `None` when
    /// the layer holds no rows or no longer holds these (a sliding window
    /// moved past them). The positions must be below `pos`.
    pub fn copy_rows(&self, l: usize, pos0: usize, n: usize) -> Option<Box<[u8]>> {
        assert!(pos0 + n <= self.pos, "positions {pos0}..{} are not computed yet", pos0 + n);
        let mut out = Vec::new();
        match &self.layers[l] {
            LayerCache::Kv(c) if c.holds(pos0, n) => {
                out.reserve_exact(n * c.position_bytes());
                c.copy_rows(pos0, n, &mut out);
            }
            LayerCache::Indexed(c, keys) => {
                out.reserve_exact(n * (c.position_bytes() + keys.rows().position_bytes()));
                c.copy_rows(pos0, n, &mut out);
                keys.rows().copy_rows(pos0, n, &mut out);
            }
            LayerCache::Kv(_) | LayerCache::Delta(_) | LayerCache::Pooled(_) => return None,
        }
        Some(out.into_boxed_slice())
    }

    /// Whether any layer keeps a recurrent state.
    pub fn is_recurrent(&self) -> bool {
        self.layers.iter().any(|l| matches!(l, LayerCache::Delta(_) | LayerCache::Pooled(_)))
    }

    /// Values of every recurrent state, all layers (0 without any).
    pub fn recurrent_len(&self) -> usize {
        let len = |l: &LayerCache| match l {
            LayerCache::Delta(d) => d.len(),
            LayerCache::Pooled(p) => p.len(),
            _ => 0,
        };
        self.layers.iter().map(len).sum()
    }

    /// Every layer's recurrent state at the current position, layer after
    /// layer, into `out` (cleared first; its buffer is reused).
    pub fn copy_recurrent(&self, out: &mut Vec<f32>) {
        out.clear();
        for layer in &self.layers {
            match layer {
                LayerCache::Delta(d) => d.copy_to(out),
                LayerCache::Pooled(p) => p.copy_to(out),
                _ => {}
            }
        }
    }

    /// Makes this fresh sequence one that has processed `pos` tokens, from
    /// saved state: `blocks[i][l]` holds layer `l`'s rows of positions
    /// `i·block..(i + 1)·block` (as [`Sequence::copy_rows`] gave them; only
    /// the rows [`Keeps::rows_for`] names are read, and must be there), and
    /// `recurrent` the recurrent states at `pos` (as
    /// [`Sequence::copy_recurrent`] gave them). The logits are not restored:
    /// the next pass computes them.
    pub fn resume(&mut self, pos: usize, block: usize, blocks: &[&[Option<Box<[u8]>>]], recurrent: Option<&[f32]>) {
        assert!(self.pos == 0 && pos <= self.max_seq && pos <= blocks.len() * block, "a fresh sequence");
        let mut state = recurrent.unwrap_or(&[]);
        for (l, layer) in self.layers[..self.main_layers].iter_mut().enumerate() {
            let (c, mut keys) = match layer {
                LayerCache::Kv(c) => (c, None),
                LayerCache::Indexed(c, keys) => (c, Some(keys)),
                LayerCache::Delta(d) => {
                    state = d.copy_from(state);
                    continue;
                }
                LayerCache::Pooled(p) => {
                    state = p.copy_from(state);
                    continue;
                }
            };
            let want = Keeps::Rows { window: c.window() }.rows_for(pos).expect("rows");
            c.start_at(pos);
            let first = want.start / block;
            for (i, saved) in blocks.iter().enumerate().take(want.end.div_ceil(block)).skip(first) {
                let p0 = i * block;
                let (from, to) = (want.start.max(p0) - p0, want.end.min(p0 + block) - p0);
                let rows = saved[l].as_deref().expect("the rows a resumed pass reads");
                let (own, index) = rows.split_at(block * c.position_bytes());
                c.put_rows(p0, block, own, from, to);
                if let Some(k) = keys.as_mut() {
                    k.cache().put_rows(p0, block, index, from, to);
                }
            }
        }
        assert!(state.is_empty(), "recurrent states of another shape");
        self.pos = pos;
        self.checkpoint = None;
    }
}

/// The state one layer keeps for a sequence, of the layer's kind.
enum LayerCache {
    /// Keys and values (or MLA's latent) of every position.
    Kv(KvCache),
    /// A linear-attention layer's convolution inputs and recurrent matrices.
    Delta(DeltaState),
    /// A sparse layer's latent of every position and its indexer's keys;
    /// both go back with the sequence's position, as a KV cache does.
    Indexed(KvCache, IndexKeys),
    /// A pooled-attention layer's window, unfinished blocks and pools.
    Pooled(PooledState),
}

impl LayerCache {
    /// The empty state of `state`'s kind for up to `max_seq` positions fed
    /// at most `chunk` at a time.
    fn new(c: &ModelConfig, l: usize, state: LayerState, kv_dtype: DType, max_seq: usize, chunk: usize) -> LayerCache {
        if let (LayerState::Pooled { .. }, Some(p), MixerSpec::Pooled { pool }) = (state, c.pooled(), c.layers[l].mixer)
        {
            return LayerCache::Pooled(PooledState::new(p, c.head_dim, pool, max_seq));
        }
        match state {
            LayerState::Indexed { width, key_width } => {
                let latent = KvCache::new(kv_dtype, max_seq, 1, width, 0, None);
                return LayerCache::Indexed(latent, IndexKeys::new(kv_dtype, max_seq, key_width));
            }
            LayerState::BlockIndexed { heads, head_dim, key_width } => {
                let kv = KvCache::new(kv_dtype, max_seq, heads, heads * head_dim, heads * head_dim, None);
                return LayerCache::Indexed(kv, IndexKeys::new(kv_dtype, max_seq, key_width));
            }
            _ => {}
        }
        let window = match state {
            LayerState::Kv { rows, .. } | LayerState::Latent { rows, .. } => rows,
            LayerState::Recurrent { .. }
            | LayerState::Indexed { .. }
            | LayerState::BlockIndexed { .. }
            | LayerState::Pooled { .. } => Rows::Full,
        };
        match (cache_shape(state), window) {
            (Some((heads, k_width, v_width)), Rows::Full) => {
                LayerCache::Kv(KvCache::new(kv_dtype, max_seq, heads, k_width, v_width, None))
            }
            (Some((heads, k_width, v_width)), Rows::Window(w)) => {
                let rows = window_rows(w, chunk).min(max_seq);
                LayerCache::Kv(KvCache::new(kv_dtype, rows, heads, k_width, v_width, Some(w)))
            }
            (None, _) => {
                LayerCache::Delta(DeltaState::new(c.linear.as_ref().expect("a recurrent state has a linear spec")))
            }
        }
    }
}

/// A KV layer state's cache shape: (heads, key values, value values) per
/// position over all heads (`None` for a recurrent state). MLA's latent is
/// one head whose values are read from its key rows, so it stores no
/// separate values.
fn cache_shape(state: LayerState) -> Option<(usize, usize, usize)> {
    match state {
        LayerState::Kv { heads, k_width, v_width, .. } => Some((heads, heads * k_width, heads * v_width)),
        LayerState::Latent { width, .. } | LayerState::Indexed { width, .. } => Some((1, width, 0)),
        LayerState::BlockIndexed { heads, head_dim, .. } => Some((heads, heads * head_dim, heads * head_dim)),
        LayerState::Recurrent { .. } | LayerState::Pooled { .. } => None,
    }
}

/// Activation buffers of the forward pass, sized once for up to C tokens
/// (of one sequence or several) and S sequences' logits per pass, so the
/// forward pass never allocates.
pub struct Workspace {
    /// C: most tokens one forward chunk processes.
    pub chunk: usize,
    /// S: most logit rows one forward chunk computes (one per sequence that
    /// asks for its last token's logits).
    pub logit_rows: usize,
    /// [C, D] residual stream.
    pub x: Vec<f32>,
    /// [C, D] normed residual.
    pub xn: Vec<f32>,
    /// [C, H·Dh] queries.
    pub q: Vec<f32>,
    /// [C, Hkv·Dh] keys of this chunk.
    pub k: Vec<f32>,
    /// [C, Hkv·Dh] values of this chunk.
    pub v: Vec<f32>,
    /// [C, H·Dv] attention output.
    pub att: Vec<f32>,
    /// [C, max(H·Dv, H·R)] attention results in kv-head order (MLA: R the latent width).
    pub att_order: Vec<f32>,
    /// MLA buffers (empty for GQA).
    pub mla: MlaScratch,
    /// Linear-attention buffers (empty when every layer attends).
    pub delta: DeltaScratch,
    /// The sparse layers' indexer buffers (empty without an indexer).
    pub index: IndexerScratch,
    /// The block-sparse layers' indexer buffers (empty without a block indexer).
    pub block_index: BlockIndexScratch,
    /// [C, H·Dh] attention output gates (empty without them).
    pub gate: Vec<f32>,
    /// [C, D] block output before the residual add.
    pub proj: Vec<f32>,
    /// [C, D] shared expert output.
    pub shared: Vec<f32>,
    /// [C, Fmax] gate scratch for dense and shared MLPs.
    pub g: Vec<f32>,
    /// [C, Fmax] up scratch.
    pub u: Vec<f32>,
    /// [C, max(D, H·Dh, H·Dv)] the current matmul input's quantised copy
    /// (when some matrix is block-quantised): every input is prepared here.
    pub xq: Inputs,
    /// [C, Fmax/32] quantised MLP hidden activations.
    pub hq: Vec<BlockQ8>,
    /// [C, R/2] RoPE cosines of this chunk's positions.
    pub cos: Vec<f32>,
    /// [C, R/2] RoPE sines.
    pub sin: Vec<f32>,
    /// [C, Rg/2] the global layers' RoPE cosines (empty without their own RoPE).
    pub global_cos: Vec<f32>,
    /// [C, Rg/2] their sines.
    pub global_sin: Vec<f32>,
    /// [C, D] the routed experts' own normed input (branch norms; else empty).
    pub xr: Vec<f32>,
    /// [C, D] the router's own normed input (else empty).
    pub xrt: Vec<f32>,
    /// MoE scratch.
    pub moe: MoeScratch,
    /// [S, D] the normed last rows whose logits are wanted (the lm_head's input).
    pub head_x: Vec<f32>,
    /// [S, V] their logits (the lm_head's output).
    pub head_y: Vec<f32>,
    /// [C, 2D] the multi-token-prediction layer's input, the normed
    /// embedding and hidden state side by side (empty without the layer).
    pub mtp_in: Vec<f32>,
    /// [C, D] the hidden states it reads.
    pub mtp_h: Vec<f32>,
    /// The pooled layers' buffers (empty without them).
    pub pooled: PooledScratch,
    /// `[C]` the pass's token ids (hash routing reads them).
    pub tokens: Vec<u32>,
    /// `[C]` each row's position (pooled attention reads them).
    pub positions: Vec<usize>,
    /// Hyper-connections (empty without them): [C, D] a block's input, [C, N]
    /// `post`, [C, N·N] `comb`, [C, N·D] the streams before the block.
    pub hc_col: Vec<f32>,
    /// [C, N]
    pub hc_post: Vec<f32>,
    /// [C, N·N]
    pub hc_comb: Vec<f32>,
    /// [C, N·D]
    pub hc_tmp: Vec<f32>,
}

impl Workspace {
    /// Buffers for passes of up to `chunk` tokens asking the logits of up to
    /// `logit_rows` sequences.
    pub fn new(model: &Model, chunk: usize, logit_rows: usize) -> Workspace {
        let c = &model.config;
        let chunk = chunk.max(1);
        let logit_rows = logit_rows.clamp(1, chunk);
        let quantize = model.has_block_weights();
        let (d, kv, qd) = (c.hidden_size, c.max_kv_dim(), c.max_q_dim());
        let (nhc, wres) = (c.hyper.map_or(0, |h| h.streams), c.residual_width());
        let pooled_in = c.pooled().map_or(0, |p| p.q_lora_rank.max(qd / p.o_groups));
        let ad = c.att_dim().max(qd);
        let k_width = c.layer_states().into_iter().filter_map(|st| cache_shape(st).map(|s| s.1)).max().unwrap_or(0);
        let linear_out = c.linear.as_ref().map_or(0, |l| l.value_dim());
        let mtp_in = if c.mtp.is_some() { 2 * d } else { 0 };
        let mut fmax = 1;
        for layer in &c.layers {
            if let FfnSpec::Dense { ffn_dim } = layer.ffn {
                fmax = fmax.max(ffn_dim);
            }
        }
        let (e, k, fe) = match &c.moe {
            Some(m) => {
                if let Some(s) = &m.shared_expert {
                    fmax = fmax.max(s.ffn_dim);
                }
                (m.num_experts, m.router.top_k, m.expert_ffn_dim)
            }
            None => (1, 1, 1),
        };
        let half = c.rope.rotary_dim / 2;
        let global_half = c.global_attention.as_ref().map_or(0, |g| g.rope.rotary_dim / 2);
        let branch_norms = c.moe.as_ref().is_some_and(|m| m.branch_norms);
        let latent = c.moe.as_ref().is_some_and(|m| m.latent_dim.is_some());
        let router_norm = c.moe.as_ref().is_some_and(|m| m.router.own_norm.is_some());
        Workspace {
            chunk,
            logit_rows,
            x: vec![0.0; chunk * wres],
            xn: vec![0.0; chunk * d],
            q: vec![0.0; chunk * qd],
            k: vec![0.0; chunk * k_width],
            v: vec![0.0; chunk * kv],
            att: vec![0.0; chunk * ad],
            att_order: vec![0.0; chunk * ad.max(c.num_heads * c.mla().map_or(0, |m| m.kv_lora_rank))],
            mla: MlaScratch::new(c, chunk, quantize),
            delta: DeltaScratch::new(c.linear.as_ref(), chunk),
            index: IndexerScratch::new(c, chunk),
            block_index: BlockIndexScratch::new(c, chunk),
            gate: vec![0.0; if c.attention.output_gate { chunk * qd } else { 0 }],
            proj: vec![0.0; chunk * d],
            shared: vec![0.0; chunk * d],
            g: vec![0.0; chunk * fmax],
            u: vec![0.0; chunk * fmax],
            xq: Inputs::new(quantize, chunk * d.max(qd).max(ad).max(linear_out).max(mtp_in).max(pooled_in)),
            hq: vec![BlockQ8::default(); q8_blocks(chunk * fmax)],
            cos: vec![0.0; chunk * half],
            sin: vec![0.0; chunk * half],
            global_cos: vec![0.0; chunk * global_half],
            global_sin: vec![0.0; chunk * global_half],
            xr: vec![0.0; if branch_norms || latent { chunk * d } else { 0 }],
            xrt: vec![0.0; if router_norm || latent { chunk * d } else { 0 }],
            moe: MoeScratch::new(chunk, e, k, d, fe),
            head_x: vec![0.0; logit_rows * d],
            head_y: vec![0.0; logit_rows * c.vocab_size],
            mtp_in: vec![0.0; if c.mtp.is_some() { chunk * 2 * d } else { 0 }],
            mtp_h: vec![0.0; if c.mtp.is_some() { chunk * d } else { 0 }],
            pooled: PooledScratch::new(c.pooled(), c.num_heads, c.head_dim, chunk, c.max_seq_len),
            tokens: vec![0; chunk],
            positions: vec![0; chunk],
            hc_col: vec![0.0; if nhc > 0 { chunk * d } else { 0 }],
            hc_post: vec![0.0; chunk * nhc],
            hc_comb: vec![0.0; chunk * nhc * nhc],
            hc_tmp: vec![0.0; if nhc > 0 { chunk * wres } else { 0 }],
        }
    }
}

/// One sequence with a workspace of its own: what a single caller runs.
pub struct Session {
    /// The sequence (KV cache, position, last logits).
    pub seq: Sequence,
    /// Its activation buffers.
    pub ws: Workspace,
}

impl Session {
    /// Allocates a session for sequences up to `max_seq` tokens (capped at the
    /// model's context), processing at most `chunk` tokens per pass, with the
    /// model's default KV cache type ([`KvCacheType::Auto`]).
    pub fn new(model: &Model, max_seq: usize, chunk: usize) -> Session {
        Session::with_kv(model, max_seq, chunk, KvCacheType::Auto.resolve(model))
    }

    /// As [`Session::new`], with the KV cache's element type (f32 or f16) given.
    pub fn with_kv(model: &Model, max_seq: usize, chunk: usize, kv_dtype: DType) -> Session {
        let chunk = chunk.clamp(1, max_seq.clamp(1, model.config.max_seq_len));
        let seq = Sequence::new(model, max_seq, chunk, kv_dtype);
        let ws = Workspace::new(model, chunk, 1);
        Session { seq, ws }
    }

    /// Tokens already in the cache.
    pub fn pos(&self) -> usize {
        self.seq.pos
    }

    /// Longest sequence this session holds.
    pub fn max_seq(&self) -> usize {
        self.seq.max_seq
    }

    /// `[V]` logits of the last token processed.
    pub fn logits(&self) -> &[f32] {
        &self.seq.logits
    }

    /// Rolls the sequence back to its first `pos` tokens ([`Sequence::truncate`]).
    pub fn truncate(&mut self, pos: usize) -> Result<()> {
        self.seq.truncate(pos)
    }

    /// Saves the linear-attention states at the current position ([`Sequence::checkpoint`]).
    pub fn checkpoint(&mut self) {
        self.seq.checkpoint()
    }

    /// Forgets the sequence (keeps the buffers).
    pub fn reset(&mut self) {
        self.seq.truncate(0).expect("any sequence goes back to its start");
    }
}
