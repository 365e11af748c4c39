//! The canonical model config: one description that every supported
//! architecture maps onto (the adapters in `crate::arch` write it, the forward
//! pass reads it). It is stored verbatim as JSON in the `.colibri` metadata.
//!
//! Variants are named spec structs, never boolean tails: a reader of a config
//! literal sees `router: RouterSpec { score: Softmax, renormalize: true, .. }`.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Fields added after v1 files were written are left out when they hold
/// their default, so older models' metadata stays as it was.
fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// The largest model size (vocabulary, widths, heads, layers, context) a
/// config may give: beyond it a size is refused as implausible before it
/// sizes any allocation or index arithmetic (a hostile config.json or
/// `.colibri` header cannot make the loader allocate by its claim).
pub const SIZE_LIMIT: usize = 1 << 24;

/// Widest linear-attention key head: the rule keeps a head's normalised
/// query, key and decays on the stack (the released models use 128).
pub const MAX_LINEAR_KEY_DIM: usize = 256;

/// Most keys an indexer may keep per query (`index_topk`; the released
/// models keep 2048): the workspace holds a selection of this many positions
/// for every token of a pass.
pub const MAX_INDEX_TOP_K: usize = 1 << 16;

/// Most expert groups a router may have: the router keeps its group scores
/// on the stack, sized by this bound.
pub const MAX_GROUPS: usize = 64;

/// Everything the forward pass needs to know about a model's shape and maths.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// V: vocabulary size (rows of the embedding and of lm_head).
    pub vocab_size: usize,
    /// D: hidden size.
    pub hidden_size: usize,
    /// H: query heads.
    pub num_heads: usize,
    /// Hkv: key/value heads (H is a multiple of Hkv).
    pub num_kv_heads: usize,
    /// Dh: width of one head.
    pub head_dim: usize,
    /// Longest sequence the model accepts (positions 0..max_seq_len).
    pub max_seq_len: usize,
    /// Normalisation used before attention, before the FFN and at the end.
    pub norm: NormSpec,
    /// Rotary position embedding.
    pub rope: RopeSpec,
    /// Attention variant shared by all layers.
    pub attention: AttentionSpec,
    /// The MoE block, shared by every MoE layer; `None` for a dense model.
    pub moe: Option<MoeSpec>,
    /// The linear-attention layers' shape (hybrid models); `None` when every
    /// layer attends.
    #[serde(default, skip_serializing_if = "is_default")]
    pub linear: Option<LinearSpec>,
    /// One entry per decoder layer, in order; the multi-token-prediction
    /// layers, when kept, last (see [`MtpSpec`]).
    pub layers: Vec<LayerSpec>,
    /// Multi-token-prediction layers kept from the checkpoint: drafts for
    /// speculative decoding, never part of the ordinary forward pass.
    #[serde(default, skip_serializing_if = "is_default")]
    pub mtp: Option<MtpSpec>,
    /// lm_head shares the embedding matrix.
    pub tie_embeddings: bool,
    /// lm_head carries a bias (Phi-MoE).
    #[serde(default, skip_serializing_if = "is_default")]
    pub lm_head_bias: bool,
    /// Constant multipliers on the embedding, the residual branches and the
    /// logits (Granite); all 1 for most models.
    #[serde(default, skip_serializing_if = "is_default")]
    pub scales: Scales,
    /// The logits are soft-capped, `c · tanh(logits / c)`, after the divisor
    /// (Gemma's `final_logit_softcapping`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub logit_softcap: Option<f32>,
    /// The attention of the layers that see every position, when its shape
    /// differs from the windowed layers' (Gemma 4's global layers): those
    /// layers use it instead of `head_dim`, `num_kv_heads` and `rope`.
    #[serde(default, skip_serializing_if = "is_default")]
    pub global_attention: Option<GlobalAttentionSpec>,
    /// Each block's output is RMS-normed with its own weight before the
    /// residual add (`AttnPostNorm`, `FfnPostNorm`: Gemma's sandwich norms).
    #[serde(default, skip_serializing_if = "is_default")]
    pub post_norms: bool,
    /// Each layer's output (the residual stream after its FFN) is multiplied
    /// by a learned scalar, `LayerScale` (Gemma 4's `layer_scalar`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub layer_scale: bool,
    /// The activation of the dense layers' MLPs: SiLU for most families,
    /// the experts' clamped SwiGLU for MiniMax-M3, relu² for Nemotron-H.
    #[serde(default, skip_serializing_if = "is_default")]
    pub dense_activation: Activation,
    /// Several residual streams mixed around every block (DeepSeek-V4's
    /// manifold-constrained hyper-connections); `None`: one residual stream.
    #[serde(default, skip_serializing_if = "is_default")]
    pub hyper: Option<HyperSpec>,
}

/// Manifold-constrained hyper-connections: the residual is `N` streams of
/// width D. Before each block a small projection of the RMS-normed streams
/// gives per token `pre` `[N]` (how the streams collapse into the block's
/// input), `post` `[N]` (how the block's output spreads back over them) and
/// `comb` `[N, N]` (how the streams mix), `comb` brought near a
/// doubly-stochastic matrix by Sinkhorn iterations:
///
/// ```text
/// m = fn · rmsnorm(x_1..x_N)                          [(2 + N)·N]
/// pre = sigmoid(m_pre·s0 + b) + eps; post = 2·sigmoid(m_post·s1 + b)
/// comb = sinkhorn(softmax_rows(m_comb·s2 + b) + eps)
/// y = block(Σ_j pre_j x_j);  x'_k = post_k·y + Σ_j comb_jk x_j
/// ```
///
/// At the end a head of its own (`pre` only) collapses the streams before
/// the final norm.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct HyperSpec {
    /// N: residual streams.
    pub streams: usize,
    /// Sinkhorn iterations (the first column normalisation counts as one).
    pub sinkhorn_iters: usize,
    /// Added to `pre` and `comb` and to each Sinkhorn divisor.
    pub eps: f32,
}

/// A multi-token-prediction (MTP) layer: from the hidden state the model
/// handed its output head at position `i` and the embedding of token
/// `i + 1`, a decoder layer of its own predicts token `i + 2`:
///
/// ```text
/// x_i = W · [norm_e(embed(t_{i+1})) ; norm_h(h_i)]        W: [D, 2D]
/// y   = decoder layer (x) over the MTP rows, position i   (its own KV cache)
/// logits_i = lm_head(norm_o(y_i))
/// ```
///
/// A second draft step feeds `y` (or `norm_o(y)`) back as the hidden with
/// the first draft as the token. The layer is the last of
/// [`ModelConfig::layers`]; its glue tensors are [`TensorId::Mtp`].
///
/// [`TensorId::Mtp`]: crate::canonical::tensors::TensorId::Mtp
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MtpSpec {
    /// The hidden a draft step passes to the next is the layer's output
    /// after its output norm (Qwen3-Next, Qwen3.5), not before (DeepSeek-V3,
    /// GLM-4.5).
    pub chain_normed: bool,
}

/// The shape of the full-attention layers when it differs from the windowed
/// ones' (Gemma 4): wider heads, fewer kv heads, their own RoPE, and values
/// that are the key projection itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GlobalAttentionSpec {
    /// Dh of these layers.
    pub head_dim: usize,
    /// Hkv of these layers.
    pub num_kv_heads: usize,
    /// Their rotary embedding.
    pub rope: RopeSpec,
    /// No value projection: the values are the key projection's output,
    /// taken before the key norm and RoPE (Gemma 4's `attention_k_eq_v`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub values_from_keys: bool,
}

/// The attention heads of one layer (see [`ModelConfig::head_shape`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadShape {
    /// Dh: width of a query, key and value head.
    pub head_dim: usize,
    /// Hkv: key/value heads.
    pub kv_heads: usize,
    /// No value projection: values are the key projection.
    pub values_from_keys: bool,
    /// The layer uses [`ModelConfig::global_attention`] (and its RoPE).
    pub global: bool,
}

/// Constant multipliers of the residual stream (Granite's `embedding_multiplier`,
/// `residual_multiplier` and `logits_scaling`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scales {
    /// The token embedding is multiplied by this.
    pub embedding: f32,
    /// Each block's output is multiplied by this before the residual add.
    pub residual: f32,
    /// The logits are divided by this.
    pub logits_divisor: f32,
}

impl Default for Scales {
    fn default() -> Self {
        Scales { embedding: 1.0, residual: 1.0, logits_divisor: 1.0 }
    }
}

/// The normalisation of every norm site of the model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct NormSpec {
    /// Added to the mean square (or variance) before the square root.
    pub eps: f32,
    /// RMSNorm or LayerNorm.
    #[serde(default, skip_serializing_if = "is_default")]
    pub kind: NormKind,
}

/// Which normalisation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// `y = x / sqrt(mean(x²) + eps) * w`.
    #[default]
    Rms,
    /// `y = (x − mean) / sqrt(var + eps) * w + b` (a bias beside every scale).
    Layer,
}

/// Rotary position embedding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeSpec {
    /// Base of the geometric frequency ladder.
    pub theta: f64,
    /// Number of leading dimensions of each head that rotate (even, <= Dh).
    pub rotary_dim: usize,
    /// How the inverse frequencies and magnitudes are rescaled.
    pub scaling: RopeScaling,
    /// The rotated dimensions are stored as adjacent pairs (2i, 2i+1) rather
    /// than as halves (i, i + R/2): DeepSeek's `rope_interleave`.
    #[serde(default, skip_serializing_if = "is_default")]
    pub interleaved: bool,
}

/// The rope_scaling variants of the supported configs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (inverse frequencies divided by it).
    Linear {
        /// Interpolation factor.
        factor: f64,
    },
    /// YaRN: per-frequency blend of interpolation and extrapolation plus a
    /// magnitude factor on cos/sin.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Context length the model was trained at.
        original_max_position_embeddings: usize,
        /// Fast boundary of the ramp, in rotations.
        beta_fast: f64,
        /// Slow boundary of the ramp, in rotations.
        beta_slow: f64,
        /// Multiplier applied to cos and sin.
        attention_factor: f64,
        /// Round the ramp bounds to whole dimensions (transformers' default).
        truncate: bool,
    },
    /// LongRoPE (Phi-3, Phi-MoE): per-frequency divisors; the magnitude is
    /// `short_mscale` while the call's sequence fits the original context
    /// and `long_mscale` past it. The frequencies are always the short ones:
    /// transformers' Phi-MoE recomputes them without the sequence length.
    LongRope {
        /// R/2 divisors of the inverse frequencies.
        short_factor: Vec<f64>,
        /// R/2 divisors for long sequences (kept for the record; unused, as in transformers).
        long_factor: Vec<f64>,
        /// Context length the model was trained at.
        original_max_position_embeddings: usize,
        /// Magnitude for sequences up to the original length.
        short_mscale: f64,
        /// Magnitude for longer sequences.
        long_mscale: f64,
    },
    /// Gemma 4's "proportional" RoPE: the head is rotated as a whole
    /// (`rotary_dim` = Dh, dimension i paired with i + Dh/2), but only the
    /// first `angles` pairs turn, at `1 / (θ^(2i/Dh) · factor)`; the others
    /// have frequency 0 and pass through.
    Proportional {
        /// Divisor of the frequencies (1 on the released models).
        factor: f64,
        /// Pairs that rotate: `partial_rotary_factor · Dh / 2`, rounded down.
        angles: usize,
    },
    /// Llama-3 style smooth per-frequency scaling.
    Llama3 {
        /// Scale for low frequencies.
        factor: f64,
        /// Wavelength boundary factor for low frequencies.
        low_freq_factor: f64,
        /// Wavelength boundary factor for high frequencies.
        high_freq_factor: f64,
        /// Context length the model was trained at.
        original_max_position_embeddings: usize,
    },
}

/// How q and k are normalised after projection, before RoPE.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    /// No q/k norm.
    #[default]
    None,
    /// RMSNorm over each head separately (weight of size Dh), as Qwen3.
    PerHead,
    /// RMSNorm over the whole projection (weights H·Dh and Hkv·Dh), as OLMoE.
    Full,
}

/// Attention variant.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AttentionSpec {
    /// q, k and v projections carry a bias.
    pub qkv_bias: bool,
    /// The output projection carries a bias.
    pub o_bias: bool,
    /// Normalisation of q and k.
    pub qk_norm: QkNorm,
    /// Clamp q, k and v to `[-c, c]` after projection and q/k norm, before
    /// RoPE (OLMoE's clip_qkv).
    pub clip_qkv: Option<f32>,
    /// Grouped-query attention or multi-head latent attention.
    #[serde(default, skip_serializing_if = "is_default")]
    pub kind: AttentionKind,
    /// Each head has a learned sink logit that joins the softmax's
    /// denominator and contributes no value (GPT-OSS).
    #[serde(default, skip_serializing_if = "is_default")]
    pub sinks: bool,
    /// The attention score scale; `None` = 1/√(q/k head width).
    #[serde(default, skip_serializing_if = "is_default")]
    pub softmax_scale: Option<f32>,
    /// The query projection also emits a gate per query value: the
    /// attention output is multiplied by `sigmoid(gate)` before the output
    /// projection (Qwen3-Next, Qwen3.5).
    #[serde(default, skip_serializing_if = "is_default")]
    pub output_gate: bool,
    /// Queries and keys carry no position: no RoPE anywhere (Kimi-Linear's
    /// latent attention, whose shared "rotary" key part stays unrotated).
    #[serde(default, skip_serializing_if = "is_default")]
    pub no_rope: bool,
    /// Each value head is RMS-normed without a weight before it is cached
    /// (Gemma 4's `v_norm`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub value_norm: bool,
    /// A query's scores are multiplied by a factor that grows with its
    /// position (Llama-4's attention temperature tuning, Mistral Small 4).
    #[serde(default, skip_serializing_if = "is_default")]
    pub temperature: Option<AttentionTemperature>,
    /// The block indexer of MiniMax Sparse Attention, which the grouped-query
    /// [`MixerSpec::Sparse`] layers use to pick the blocks of keys each query
    /// attends to (MiniMax-M3); `None` elsewhere.
    #[serde(default, skip_serializing_if = "is_default")]
    pub block_index: Option<BlockIndexSpec>,
}

/// MiniMax Sparse Attention's block indexer (MiniMax-M3): per layer one
/// index key of `head_dim` values per token (`rope(RMSNorm(Wk · x))`) and
/// per query `heads` index heads (`rope(RMSNorm(Wq · x))`, each head normed
/// apart; the rope is the model's, on the first R values). Index head i scores
/// key j as `q_i · k_j`; a block of `block` keys scores the maximum over its
/// keys the query sees; the query keeps its own block and the
/// `local_blocks − 1` before it, and the best of the others up to
/// `top_blocks` in all. Query head h attends only to the keys of the blocks
/// index head `h / (H / heads)` kept (and, in its own block, to those up to
/// its position).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockIndexSpec {
    /// Hi: index heads (a divisor of H; each serves H / Hi query heads).
    pub heads: usize,
    /// Di: width of an index head and of the index key (at least R).
    pub head_dim: usize,
    /// B: keys per block; blocks start at multiples of B.
    pub block: usize,
    /// Blocks each query keeps (`index_topk_blocks`).
    pub top_blocks: usize,
    /// The query's own block and the ones just before it, kept whatever
    /// their scores (`index_local_blocks`, at most `top_blocks`).
    pub local_blocks: usize,
}

/// Llama-4's attention temperature: the query at position p is scaled by
/// `1 + beta · ln(1 + ⌊p / period⌋)`, so attention sharpens step by step as
/// the context grows past multiples of the training length.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionTemperature {
    /// Strength of the growth (`llama_4_scaling_beta`).
    pub beta: f32,
    /// Positions per step (the rope's `original_max_position_embeddings`).
    pub period: usize,
}

impl AttentionTemperature {
    /// The factor on the scores of the query at position `pos`.
    pub fn at(&self, pos: usize) -> f32 {
        // As transformers: the logarithm in f32 of a whole number of periods.
        1.0 + self.beta * crate::math::ln_1pf((pos / self.period) as f32)
    }
}

/// How queries, keys and values are formed and cached.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AttentionKind {
    /// Grouped-query attention: q, k, v projections, K and V cached per head.
    #[default]
    Gqa,
    /// Multi-head latent attention (DeepSeek-V2/V3).
    Mla(MlaSpec),
    /// DeepSeek-V4's attention: one key/value head (keys are values) over a
    /// sliding window plus a pool of compressed past entries.
    Pooled(PooledSpec),
}

/// DeepSeek-V4's attention. Queries come through a low-rank path
/// (`q_a` → RMSNorm → `q_b`, then an unweighted RMSNorm per head); one
/// shared row of Dh values per token (`kv` → RMSNorm) is both key and value.
/// The last `rope_dim` values of queries and keys rotate in adjacent pairs
/// (the config's `rope` on window-only layers, `pool_rope` on pooled ones),
/// and the output's last `rope_dim` values are rotated back by the query's
/// angle. Each query attends to the `window` last positions and to the
/// layer's pooled entries, beside a learned sink per head; the heads'
/// outputs go through a grouped low-rank projection (`o_groups` blocks of
/// `H·Dh / G` → `o_lora_rank` each, then `Wo`).
///
/// A pooled layer turns each block of `rate` tokens into one entry: a
/// softmax over the block's positions, per channel, of learned gates plus a
/// position bias weighs the block's projected rows, then RMSNorm and the
/// rotation at the block's first position. Light layers pool overlapping
/// windows (each entry also reads the previous block through a second
/// projection) and keep only the `top_k` entries a lightning indexer picks
/// for each query; heavy layers attend to every finished entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PooledSpec {
    /// Rq: rank of the query path.
    pub q_lora_rank: usize,
    /// Values of each query and key head that rotate (their last ones).
    pub rope_dim: usize,
    /// Positions a query sees directly, itself included.
    pub window: usize,
    /// G: groups of the output projection.
    pub o_groups: usize,
    /// Ro: output width of each group.
    pub o_lora_rank: usize,
    /// Tokens per entry of the heavy layers.
    pub heavy_rate: usize,
    /// Tokens per entry of the light layers.
    pub light_rate: usize,
    /// The light layers' lightning indexer.
    pub indexer: PoolIndexerSpec,
    /// The RoPE of pooled layers (their queries, keys, entries and index).
    pub pool_rope: RopeSpec,
}

/// The lightning indexer of DeepSeek-V4's light layers: its own pool of
/// index keys (as the layer's, at width `head_dim`), and per query `heads`
/// index heads from the query latent with one weight each; entry s scores
/// `Σ_h w_h · relu(q_h · k_s) / √head_dim`, `w = weights · x / √heads`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolIndexerSpec {
    /// Hi: index heads.
    pub heads: usize,
    /// Di: width of an index head and key.
    pub head_dim: usize,
    /// Entries each query keeps.
    pub top_k: usize,
}

/// Which pool a DeepSeek-V4 layer keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pool {
    /// Only the sliding window.
    Window,
    /// Entries of `heavy_rate` tokens, all attended.
    Heavy,
    /// Overlapping entries of `light_rate` tokens, chosen by the indexer.
    Light,
}

/// Multi-head latent attention. Each head's q/k width is `nope + rope`
/// (the config's `head_dim`); the cache holds one compressed latent of
/// `kv_lora_rank` values plus the shared rotated key of `rope` values per
/// token, and keys and values are recovered from it through `kv_b`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MlaSpec {
    /// Rank of the low-rank query path (`q_a` → norm → `q_b`); `None` = one q projection.
    pub q_lora_rank: Option<usize>,
    /// R: width of the compressed key/value latent.
    pub kv_lora_rank: usize,
    /// Per-head key/query width that carries no position.
    pub qk_nope_dim: usize,
    /// Per-head key/query width that is rotated (the key part shared by all heads).
    pub qk_rope_dim: usize,
    /// Per-head value width.
    pub v_head_dim: usize,
    /// Epsilon of the RMSNorms of the query and key/value latents
    /// (transformers leaves them at 1e-6 whatever `rms_norm_eps` says).
    pub latent_eps: f32,
    /// The lightning indexer of DeepSeek Sparse Attention, which the
    /// [`MixerSpec::Sparse`] layers use to pick the keys each query attends
    /// to; `None` for plain latent attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indexer: Option<IndexerSpec>,
}

/// The lightning indexer (DeepSeek-V3.2, GLM-5): per layer, one key of
/// `head_dim` values per token (`LayerNorm(wk · x)`, its first `rope_dim`
/// values rotated), and per query `heads` index heads read from the query
/// latent (`wq · q_lat`, rotated likewise) with one weight each
/// (`weights · x / √heads`). A query at position p scores each key j ≤ p as
/// `Σ_h w_h · relu(q_h · k_j / √head_dim)`; the latent attention then reads
/// only the `top_k` best keys (all of them while p < top_k).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct IndexerSpec {
    /// Hi: index heads.
    pub heads: usize,
    /// Di: width of an index head and of the index key.
    pub head_dim: usize,
    /// Keys each query keeps (`index_topk`).
    pub top_k: usize,
    /// Leading values of each index query and key that rotate, with MLA's
    /// frequencies (`qk_rope_head_dim`).
    pub rope_dim: usize,
    /// The rotated values pair as (2i, 2i+1) (GLM-5) rather than as halves
    /// (i, i + rope_dim/2) (DeepSeek-V3.2).
    pub rope_interleaved: bool,
    /// Epsilon of the index key's LayerNorm.
    pub key_norm_eps: f32,
}

/// How router logits become expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterScore {
    /// Softmax over all experts, then top-k.
    Softmax,
    /// Top-k of the logits, then a softmax over the k chosen (GPT-OSS).
    SoftmaxSelected,
    /// Sigmoid of each logit, then top-k (DeepSeek-V3, GLM-4.5).
    Sigmoid,
    /// `sqrt(softplus(logit))`, then top-k (DeepSeek-V4).
    SqrtSoftplus,
    /// Phi-MoE's sparsemixer as transformers runs it in eval mode: top-2 by
    /// logit, each weight a softmax over the experts whose logit lies within
    /// a relative `2·jitter_eps` of that choice's (the first choice left out
    /// of the second's).
    SparseMixer {
        /// `router_jitter_noise`.
        jitter_eps: f32,
    },
}

/// Group-limited selection: experts are split into `groups` equal groups,
/// each group is scored, only the best `top_groups` groups compete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLimit {
    /// Number of expert groups (divides E).
    pub groups: usize,
    /// Groups kept.
    pub top_groups: usize,
    /// How a group is scored from its experts' selection scores.
    pub score: GroupScore,
}

/// The score of an expert group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupScore {
    /// Its best expert (DeepSeek-V2's group_limited_greedy).
    Max,
    /// The sum of its two best experts (DeepSeek-V3's noaux_tc).
    TopTwoSum,
}

/// The router of an MoE block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterSpec {
    /// K: experts chosen per token.
    pub top_k: usize,
    /// Scoring function applied to the router logits.
    pub score: RouterScore,
    /// Divide the K chosen weights by their sum.
    pub renormalize: bool,
    /// With `renormalize`, the divisor is at least this: the weights are
    /// divided by `max(sum, floor)` (ERNIE-4.5's `moe_norm_min`); 0 divides
    /// by the sum itself.
    #[serde(default, skip_serializing_if = "is_default")]
    pub renormalize_floor: f32,
    /// Multiply the final weights by this (1.0 for most models).
    pub scale: f32,
    /// The scale multiplies the routed experts' summed output instead of
    /// each weight (MiniMax-M3, as transformers computes it; the same up to
    /// rounding).
    #[serde(default, skip_serializing_if = "is_default")]
    pub scale_output: bool,
    /// The router projection carries a bias.
    #[serde(default, skip_serializing_if = "is_default")]
    pub bias: bool,
    /// A per-expert bias is added to the scores to choose the experts, but
    /// the weights use the scores without it (DeepSeek-V3's `e_score_correction_bias`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub correction_bias: bool,
    /// Group-limited selection, if any.
    #[serde(default, skip_serializing_if = "is_default")]
    pub groups: Option<GroupLimit>,
    /// `Some(c)`: the router reads the residual stream through its own
    /// RMSNorm (weight `RouterNorm`) times `c`, not the FFN's normed input
    /// (Gemma 4: `c = D^-1/2`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub own_norm: Option<f32>,
    /// Each chosen weight is finally multiplied by its expert's learned
    /// scale (`RouterExpertScale`, Gemma 4's `per_expert_scale`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub expert_scale: bool,
}

/// How a gated FFN combines its gate and up projections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `silu(gate) · up`, silu(x) = x · sigmoid(x).
    #[default]
    Silu,
    /// `relu(gate)²`, not gated (Nemotron-H's `relu2` MLPs and experts, whose
    /// one input matrix is stored as the gate; the up projection is stored
    /// empty, `[0, D]`, so an MLP and an expert slab keep their three parts).
    Relu2,
    /// `gelu(gate) · up` with the tanh approximation of GELU (GeGLU,
    /// transformers' `gelu_pytorch_tanh`): `0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))`.
    GeluTanh,
    /// GPT-OSS: `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`,
    /// `(u + 1) · g · sigmoid(alpha · g)`.
    ClampedSwiglu {
        /// Slope inside the sigmoid.
        alpha: f32,
        /// Clamp bound.
        limit: f32,
    },
    /// DeepSeek-V4: `silu(min(gate, limit)) · clamp(up, −limit, limit)`.
    ClampedSilu {
        /// Clamp bound.
        limit: f32,
    },
}

/// An always-on expert beside the routed ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedExpertSpec {
    /// Intermediate width of the shared expert.
    pub ffn_dim: usize,
    /// Its output is scaled by `sigmoid(w · x)` (Qwen2-MoE's shared_expert_gate).
    pub sigmoid_gate: bool,
}

/// The MoE block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    /// E: routed experts per MoE layer.
    pub num_experts: usize,
    /// F: intermediate width of one routed expert.
    pub expert_ffn_dim: usize,
    /// Routing rule.
    pub router: RouterSpec,
    /// Activation of every routed and shared expert.
    pub activation: Activation,
    /// Routed experts' gate, up and down projections carry biases.
    #[serde(default, skip_serializing_if = "is_default")]
    pub expert_bias: bool,
    /// Optional shared expert.
    pub shared_expert: Option<SharedExpertSpec>,
    /// The routed and shared branches are normed apart (Gemma 4): the shared
    /// expert reads the FFN norm's output, the routed experts their own norm
    /// of the residual (`MoeNorm`), and each branch's output is RMS-normed
    /// (`SharedPostNorm`, `MoePostNorm`) before the two are added.
    #[serde(default, skip_serializing_if = "is_default")]
    pub branch_norms: bool,
    /// L: the routed experts run in a latent width (Nemotron 3's LatentMoE):
    /// their input is `MoeLatentIn · x` (`[L, D]`), their weighted sum goes
    /// back through `MoeLatentOut` (`[D, L]`); the router and the shared
    /// expert read `x` itself. `None`: the experts read `x` (width D).
    #[serde(default, skip_serializing_if = "is_default")]
    pub latent_dim: Option<usize>,
    /// The first this many layers choose their experts by the token's id
    /// (a `[V, K]` table, `HashTable`), not by score; the weights are the
    /// chosen experts' scores as usual (DeepSeek-V4).
    #[serde(default, skip_serializing_if = "is_default")]
    pub hash_layers: usize,
}

/// The feed-forward part of one layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FfnSpec {
    /// A gated dense MLP of the given intermediate width.
    Dense {
        /// Intermediate width.
        ffn_dim: usize,
    },
    /// The model's MoE block.
    Moe,
    /// No FFN: the layer is its mixer and one residual add (a Nemotron-H
    /// mixer block not followed by an MLP or MoE block).
    None,
}

/// The token mixer of one layer: the part that reads other positions. Its
/// parameters shared by every layer of the kind live on the model
/// (`ModelConfig::attention`, `ModelConfig::linear`); what differs per layer
/// lives here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerSpec {
    /// Softmax attention over a KV cache, of the model's `AttentionSpec` kind.
    Attention {
        /// Keys older than this many positions are masked (sliding window); `None` = full.
        window: Option<usize>,
    },
    /// Linear attention with a fixed state per sequence, of the model's
    /// [`LinearSpec`] kind.
    Linear,
    /// DeepSeek Sparse Attention: latent attention over the keys the
    /// model's [`IndexerSpec`] selects for each query.
    Sparse {
        /// The layer has no indexer: it reuses the selection of the layer
        /// before it (GLM-5's IndexShare).
        shared: bool,
    },
    /// DeepSeek-V4's attention ([`PooledSpec`]): a sliding window and the
    /// layer's pool.
    Pooled {
        /// Which pool.
        pool: Pool,
    },
}

/// The linear-attention layers of a hybrid model: a short causal
/// convolution over the query/key/value stream, then a gated delta rule
/// whose float32 state per value head is a `[Dk, Dv]` matrix (Mamba2: keys
/// and queries are a group's B and C of N = Dk values, the values a head's
/// x of P = Dv values, so its `[N, P]` state takes the same place).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinearSpec {
    /// Which rule and gates.
    pub kind: LinearKind,
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads (a multiple of the key heads; each key head serves
    /// `v_heads / k_heads` consecutive value heads).
    pub v_heads: usize,
    /// Dk: width of a query/key head.
    pub k_head_dim: usize,
    /// Dv: width of a value head.
    pub v_head_dim: usize,
    /// Taps of the depthwise causal convolution (the state keeps `kernel - 1` inputs).
    pub conv_kernel: usize,
}

/// The linear-attention rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinearKind {
    /// Gated DeltaNet (Qwen3-Next, Qwen3.5): one decay per value head and
    /// token, `exp(−exp(A_log)·softplus(a + dt_bias))` with `a` projected
    /// from the input; output RMSNorm per value head times `silu(z)`.
    #[default]
    GatedDeltaNet,
    /// Kimi Delta Attention (Kimi-Linear): one decay per key channel, from a
    /// low-rank projection `f_b·f_a·x` plus a bias per channel; output
    /// RMSNorm per head times `sigmoid(g_b·g_a·x)`; as many key as value heads.
    Kda {
        /// Width of the low-rank forget and output gates (`f_a`, `g_a` rows).
        gate_rank: usize,
    },
    /// Mamba2's selective state space (Nemotron-H, Granite 4.0-H), the
    /// gated rule without the delta correction: per head and token
    /// `dt = max(softplus(a + dt_bias), dt_min)`, `S = exp(−exp(A_log)·dt)·S
    /// + B ⊗ x·dt`, `o = Sᵀ·C + D·x`; B and C (the "keys" and "queries", no
    /// l2 norm) are shared by the `v_heads / k_heads` heads of a group; the
    /// convolution carries a bias; the output is `rmsnorm(o · silu(z))` over
    /// each group's `value_dim / k_heads` channels, times a weight per channel.
    Mamba2 {
        /// The floor of every time step (transformers' `time_step_min`).
        dt_min: f32,
    },
}

impl Activation {
    /// The activation multiplies by the up projection (every kind but relu²).
    pub fn gated(&self) -> bool {
        !matches!(self, Activation::Relu2)
    }
}

impl LinearSpec {
    /// Hk·Dk: width of the query (and of the key) projection.
    pub fn key_dim(&self) -> usize {
        self.k_heads * self.k_head_dim
    }

    /// Hv·Dv: width of the value projection and of the layer's output.
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_head_dim
    }

    /// Channels of the convolution: queries, keys and values side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

impl MixerSpec {
    /// Attention over every earlier position.
    pub const FULL_ATTENTION: MixerSpec = MixerSpec::Attention { window: None };

    /// The sliding window of an attention layer, `None` when it sees every position.
    pub fn window(&self) -> Option<usize> {
        match *self {
            MixerSpec::Attention { window } => window,
            MixerSpec::Linear | MixerSpec::Sparse { .. } | MixerSpec::Pooled { .. } => None,
        }
    }

    /// The mixer attends over a cache (anything but linear attention).
    pub fn attends(&self) -> bool {
        *self != MixerSpec::Linear
    }
}

/// One decoder layer.
///
/// Stored as `{"sliding_window": .., "ffn": ..}`, the form every `.colibri`
/// file holds, so existing files read and write byte for byte as before; a
/// linear-attention layer adds `"mixer": "linear"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "LayerRepr", into = "LayerRepr")]
pub struct LayerSpec {
    /// The token mixer: attention (optionally windowed).
    pub mixer: MixerSpec,
    /// Dense MLP or MoE block.
    pub ffn: FfnSpec,
}

/// The stored form of a `LayerSpec`.
#[derive(Serialize, Deserialize)]
struct LayerRepr {
    #[serde(default, skip_serializing_if = "is_default")]
    mixer: MixerKind,
    sliding_window: Option<usize>,
    /// A sparse layer reuses the selection of the layer before it.
    #[serde(default, skip_serializing_if = "is_default")]
    shares_selection: bool,
    /// A pooled layer's pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pool: Option<Pool>,
    ffn: FfnSpec,
}

/// The stored name of a layer's mixer kind (absent: attention).
#[derive(Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum MixerKind {
    #[default]
    Attention,
    Linear,
    Sparse,
    Pooled,
}

impl From<LayerRepr> for LayerSpec {
    fn from(r: LayerRepr) -> Self {
        let mixer = match r.mixer {
            MixerKind::Attention => MixerSpec::Attention { window: r.sliding_window },
            MixerKind::Linear => MixerSpec::Linear,
            MixerKind::Sparse => MixerSpec::Sparse { shared: r.shares_selection },
            MixerKind::Pooled => MixerSpec::Pooled { pool: r.pool.unwrap_or(Pool::Window) },
        };
        LayerSpec { mixer, ffn: r.ffn }
    }
}

impl From<LayerSpec> for LayerRepr {
    fn from(l: LayerSpec) -> Self {
        match l.mixer {
            MixerSpec::Attention { window } => LayerRepr {
                mixer: MixerKind::Attention,
                sliding_window: window,
                shares_selection: false,
                pool: None,
                ffn: l.ffn,
            },
            MixerSpec::Linear => LayerRepr {
                mixer: MixerKind::Linear,
                sliding_window: None,
                shares_selection: false,
                pool: None,
                ffn: l.ffn,
            },
            MixerSpec::Sparse { shared } => LayerRepr {
                mixer: MixerKind::Sparse,
                sliding_window: None,
                shares_selection: shared,
                pool: None,
                ffn: l.ffn,
            },
            MixerSpec::Pooled { pool } => LayerRepr {
                mixer: MixerKind::Pooled,
                sliding_window: None,
                shares_selection: false,
                pool: Some(pool),
                ffn: l.ffn,
            },
        }
    }
}

impl Default for ModelConfig {
    /// A plain dense model of Llama-2-7B's shape (32 layers of GQA without
    /// biases, RMSNorm, plain RoPE, SiLU MLPs of width 11008): the base that
    /// adapters and test configs override field by field, so a new field
    /// needs a default here rather than an edit of every literal.
    fn default() -> Self {
        let head_dim = 128;
        ModelConfig {
            vocab_size: 32000,
            hidden_size: 4096,
            num_heads: 32,
            num_kv_heads: 32,
            head_dim,
            max_seq_len: 4096,
            norm: NormSpec::default(),
            rope: RopeSpec { theta: 10000.0, rotary_dim: head_dim, scaling: RopeScaling::None, interleaved: false },
            attention: AttentionSpec::default(),
            moe: None,
            linear: None,
            layers: vec![LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Dense { ffn_dim: 11008 } }; 32],
            mtp: None,
            tie_embeddings: false,
            lm_head_bias: false,
            scales: Scales::default(),
            logit_softcap: None,
            global_attention: None,
            post_norms: false,
            layer_scale: false,
            dense_activation: Activation::Silu,
            hyper: None,
        }
    }
}

impl Default for NormSpec {
    /// RMSNorm with epsilon 1e-5.
    fn default() -> Self {
        NormSpec::rms(1e-5)
    }
}

impl Default for MoeSpec {
    /// Eight SiLU experts of width 14336, two chosen per token by softmax,
    /// no biases and no shared expert (Mixtral-8x7B's block without its
    /// renormalisation): the base adapters override field by field.
    fn default() -> Self {
        MoeSpec {
            num_experts: 8,
            expert_ffn_dim: 14336,
            router: RouterSpec { top_k: 2, ..RouterSpec::default() },
            activation: Activation::default(),
            expert_bias: false,
            shared_expert: None,
            branch_norms: false,
            latent_dim: None,
            hash_layers: 0,
        }
    }
}

impl Default for RouterSpec {
    /// One expert by softmax, weights as they come: the base that adapters
    /// override field by field.
    fn default() -> Self {
        RouterSpec {
            top_k: 1,
            score: RouterScore::Softmax,
            renormalize: false,
            renormalize_floor: 0.0,
            scale: 1.0,
            scale_output: false,
            bias: false,
            correction_bias: false,
            groups: None,
            own_norm: None,
            expert_scale: false,
        }
    }
}

/// Checks one RoPE spec against the head width `dh` it rotates.
fn check_rope(rope: &RopeSpec, dh: usize) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidInput(format!("invalid model config: {m}")));
    let rd = rope.rotary_dim;
    if rd == 0 || !rd.is_multiple_of(2) || rd > dh {
        return bad(format!("rotary_dim {rd} must be even and in 2..=head_dim {dh}"));
    }
    if rope.theta.is_nan() || rope.theta <= 0.0 {
        return bad(format!("rope theta {} must be > 0", rope.theta));
    }
    match &rope.scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } | RopeScaling::Yarn { factor, .. } | RopeScaling::Llama3 { factor, .. } => {
            if factor.is_nan() || *factor <= 0.0 {
                return bad(format!("rope scaling factor {factor} must be > 0"));
            }
        }
        RopeScaling::Proportional { factor, angles } => {
            if factor.is_nan() || *factor <= 0.0 || rd != dh || *angles > rd / 2 {
                return bad(format!(
                    "proportional rope needs factor > 0, rotary_dim = head_dim {dh} and at most {} angles, \
                     got factor {factor}, rotary_dim {rd}, {angles} angles",
                    dh / 2
                ));
            }
        }
        RopeScaling::LongRope { short_factor, long_factor, .. } => {
            let half = rd / 2;
            if short_factor.len() != half || long_factor.len() != half {
                return bad(format!(
                    "longrope needs {half} short and long factors (rotary_dim {rd}), got {} and {}",
                    short_factor.len(),
                    long_factor.len()
                ));
            }
            if short_factor.iter().chain(long_factor).any(|f| !(f.is_finite() && *f > 0.0)) {
                return bad("longrope factors must be finite and > 0".into());
            }
        }
    }
    Ok(())
}

impl NormSpec {
    /// RMSNorm with this epsilon.
    pub fn rms(eps: f64) -> NormSpec {
        NormSpec { eps: eps as f32, kind: NormKind::Rms }
    }
}

impl ModelConfig {
    /// Number of layers holding weights and state, the
    /// multi-token-prediction layer included.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Number of layers of the ordinary forward pass (without the
    /// multi-token-prediction layer).
    pub fn main_layers(&self) -> usize {
        self.layers.len() - usize::from(self.mtp.is_some())
    }

    /// True when a pipeline stage may begin at layer `l`: anywhere but at a
    /// sparse layer that borrows the key selection of the layer before it
    /// (that selection lives only for the pass).
    pub fn stage_can_begin(&self, l: usize) -> bool {
        !matches!(self.layers[l].mixer, MixerSpec::Sparse { shared: true })
    }

    /// The multi-token-prediction layer's index, when the file keeps one.
    pub fn mtp_layer(&self) -> Option<usize> {
        self.mtp.map(|_| self.layers.len() - 1)
    }

    /// LongRoPE's threshold: a pass over a run of tokens ending past it
    /// rotates them with the long magnitude, so a row's bits depend on the
    /// length of the run it was computed in (`None` without LongRoPE).
    pub fn long_rope_after(&self) -> Option<usize> {
        match &self.rope.scaling {
            RopeScaling::LongRope { original_max_position_embeddings, .. } => Some(*original_max_position_embeddings),
            _ => None,
        }
    }

    /// Routed experts in layer `l`: E for a MoE layer, 0 for a dense one.
    pub fn experts_in_layer(&self, l: usize) -> usize {
        match (&self.layers[l].ffn, &self.moe) {
            (FfnSpec::Moe, Some(m)) => m.num_experts,
            _ => 0,
        }
    }

    /// H·Dh: width of the query projection.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Hkv·Dh: width of the key and value projections.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The attention heads of layer `l`: the model's, or the global
    /// attention's for a layer without a window when the model has one.
    pub fn head_shape(&self, l: usize) -> HeadShape {
        match (&self.global_attention, self.layers[l].mixer) {
            (Some(g), MixerSpec::Attention { window: None }) => HeadShape {
                head_dim: g.head_dim,
                kv_heads: g.num_kv_heads,
                values_from_keys: g.values_from_keys,
                global: true,
            },
            _ => HeadShape {
                head_dim: self.head_dim,
                kv_heads: self.num_kv_heads,
                values_from_keys: false,
                global: false,
            },
        }
    }

    /// The widest query projection (H·Dh) over the layers.
    pub fn max_q_dim(&self) -> usize {
        self.q_dim().max(self.global_attention.as_ref().map_or(0, |g| self.num_heads * g.head_dim))
    }

    /// The widest key/value projection (Hkv·Dh) over the layers.
    pub fn max_kv_dim(&self) -> usize {
        self.kv_dim().max(self.global_attention.as_ref().map_or(0, |g| g.num_kv_heads * g.head_dim))
    }

    /// The MLA spec, when attention is latent.
    pub fn mla(&self) -> Option<&MlaSpec> {
        match &self.attention.kind {
            AttentionKind::Mla(m) => Some(m),
            AttentionKind::Gqa | AttentionKind::Pooled(_) => None,
        }
    }

    /// The DeepSeek-V4 attention spec, when attention is pooled.
    pub fn pooled(&self) -> Option<&PooledSpec> {
        match &self.attention.kind {
            AttentionKind::Pooled(p) => Some(p),
            _ => None,
        }
    }

    /// Width of one token's residual stream: D, or N·D with hyper-connections.
    pub fn residual_width(&self) -> usize {
        self.hidden_size * self.hyper.map_or(1, |h| h.streams)
    }

    /// Width of one head's attention output (Dh, or MLA's value width).
    pub fn v_head_dim(&self) -> usize {
        self.mla().map_or(self.head_dim, |m| m.v_head_dim)
    }

    /// H·Dv: width of the attention output, the input of the output projection.
    pub fn att_dim(&self) -> usize {
        self.num_heads * self.v_head_dim()
    }

    /// Checks the internal consistency of the numbers, so later code can
    /// index without re-checking. `what` names the source in the message.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(format!("invalid model config: {m}")));
        let nonzero = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_seq_len", self.max_seq_len),
            ("layers", self.layers.len()),
        ];
        for (name, v) in nonzero {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        // Sizes large enough to overflow index arithmetic are refused here.
        for (name, v) in nonzero {
            if v > SIZE_LIMIT {
                return bad(format!("{name} = {v} is implausibly large"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        let rd = self.rope.rotary_dim;
        check_rope(&self.rope, self.head_dim)?;
        if let Some(g) = &self.global_attention {
            for (name, v) in [("global head_dim", g.head_dim), ("global num_kv_heads", g.num_kv_heads)] {
                if v == 0 || v > SIZE_LIMIT {
                    return bad(format!("{name} = {v} out of range"));
                }
            }
            if !self.num_heads.is_multiple_of(g.num_kv_heads) || self.mla().is_some() {
                return bad(format!(
                    "global attention needs grouped-query attention with num_heads {} a multiple of its {} kv heads",
                    self.num_heads, g.num_kv_heads
                ));
            }
            check_rope(&g.rope, g.head_dim)?;
            if g.values_from_keys && self.attention.qkv_bias {
                return bad("values taken from the keys cannot have a value bias (qkv_bias)".into());
            }
        }
        if self.post_norms && self.norm.kind != NormKind::Rms {
            return bad("post-block norms are RMSNorms: they need an RMSNorm model".into());
        }
        if self.mtp.is_some() {
            // One full-attention layer after at least one ordinary one: the
            // draft step runs it over its own KV cache, rows shifted by one.
            if self.layers.len() < 2 {
                return bad("a multi-token-prediction layer needs at least one ordinary layer before it".into());
            }
            if self.layers.last().map(|l| l.mixer) != Some(MixerSpec::Attention { window: None }) {
                return bad("the multi-token-prediction layer must be a full-attention layer".into());
            }
            if self.norm.kind != NormKind::Rms {
                return bad("multi-token-prediction norms are RMSNorms: they need an RMSNorm model".into());
            }
        }
        if let Some(c) = self.logit_softcap
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!("logit soft-cap {c} must be finite and > 0"));
        }
        if self.norm.eps.is_nan() || self.norm.eps < 0.0 {
            return bad(format!("norm eps {} must be >= 0", self.norm.eps));
        }
        if let Some(m) = self.mla() {
            let dims = [m.kv_lora_rank, m.qk_nope_dim, m.qk_rope_dim, m.v_head_dim, m.q_lora_rank.unwrap_or(1)];
            if dims.iter().any(|&x| x == 0 || x > SIZE_LIMIT) {
                return bad(format!("MLA dimensions {m:?} out of range"));
            }
            if m.qk_nope_dim + m.qk_rope_dim != self.head_dim || self.num_kv_heads != self.num_heads {
                return bad(format!(
                    "MLA needs head_dim = nope + rope ({} + {}) and one kv head per head, got head_dim {} and {} kv heads",
                    m.qk_nope_dim, m.qk_rope_dim, self.head_dim, self.num_kv_heads
                ));
            }
            if rd != m.qk_rope_dim {
                return bad(format!("MLA rotary_dim {rd} differs from qk_rope_head_dim {}", m.qk_rope_dim));
            }
            if let Some(ix) = m.indexer {
                if [ix.heads, ix.head_dim, ix.top_k].iter().any(|&x| x == 0 || x > SIZE_LIMIT)
                    || ix.top_k > MAX_INDEX_TOP_K
                {
                    return bad(format!(
                        "indexer heads {}, head_dim {} and top_k {} must each be at least 1 (top_k at most \
                         {MAX_INDEX_TOP_K}, the others {SIZE_LIMIT})",
                        ix.heads, ix.head_dim, ix.top_k
                    ));
                }
                if ix.rope_dim != m.qk_rope_dim || ix.head_dim < ix.rope_dim {
                    return bad(format!(
                        "indexer rope_dim {} must equal qk_rope_head_dim {} and fit its head_dim {}",
                        ix.rope_dim, m.qk_rope_dim, ix.head_dim
                    ));
                }
                if m.q_lora_rank.is_none() {
                    return bad("the indexer reads the query latent: it needs q_lora_rank".into());
                }
                if ix.key_norm_eps.is_nan() || ix.key_norm_eps < 0.0 {
                    return bad(format!("indexer key norm eps {} must be >= 0", ix.key_norm_eps));
                }
            }
        }
        if let Some(b) = self.attention.block_index {
            let (h, hkv) = (self.num_heads, self.num_kv_heads);
            if [b.heads, b.head_dim, b.block, b.top_blocks].iter().any(|&x| x == 0 || x > SIZE_LIMIT)
                || b.top_blocks.saturating_mul(b.block) > MAX_INDEX_TOP_K
                || b.local_blocks > b.top_blocks
            {
                return bad(format!(
                    "block indexer {b:?}: heads, head_dim, block and top_blocks must each be at least 1, \
                     top_blocks · block at most {MAX_INDEX_TOP_K}, local_blocks at most top_blocks"
                ));
            }
            if self.mla().is_some() || self.global_attention.is_some() {
                return bad("the block indexer selects keys of grouped-query attention of one shape".into());
            }
            if !h.is_multiple_of(b.heads) || !(b.heads.is_multiple_of(hkv) || hkv.is_multiple_of(b.heads)) {
                return bad(format!(
                    "{} index heads must divide the {h} query heads and divide or be a multiple of the {hkv} kv heads",
                    b.heads
                ));
            }
            if b.head_dim < rd {
                return bad(format!("index head_dim {} is narrower than the rotary_dim {rd} it rotates", b.head_dim));
            }
        }
        if let Some(s) = self.attention.softmax_scale
            && !(s.is_finite() && s > 0.0)
        {
            return bad(format!("attention softmax scale {s} must be finite and > 0"));
        }
        if let Some(t) = self.attention.temperature
            && (!t.beta.is_finite() || t.period == 0 || t.period > SIZE_LIMIT)
        {
            return bad(format!("attention temperature {t:?} needs a finite beta and a period of 1..={SIZE_LIMIT}"));
        }
        let sc = self.scales;
        if [sc.embedding, sc.residual, sc.logits_divisor].iter().any(|v| !v.is_finite()) || sc.logits_divisor == 0.0 {
            return bad(format!("scales {sc:?} must be finite with a non-zero logits divisor"));
        }
        if let Some(lin) = &self.linear {
            let dims = [lin.k_heads, lin.v_heads, lin.k_head_dim, lin.v_head_dim, lin.conv_kernel];
            if dims.iter().any(|&x| x == 0 || x > SIZE_LIMIT) {
                return bad(format!("linear attention dimensions {lin:?} out of range (each must be >= 1)"));
            }
            if let LinearKind::Mamba2 { dt_min } = lin.kind
                && !(dt_min.is_finite() && dt_min >= 0.0)
            {
                return bad(format!("Mamba2 time-step floor {dt_min} must be finite and >= 0"));
            }
            if let LinearKind::Kda { gate_rank } = lin.kind
                && (gate_rank == 0 || gate_rank > SIZE_LIMIT || lin.k_heads != lin.v_heads)
            {
                return bad(format!(
                    "Kimi delta attention needs a gate rank >= 1 and as many key as value heads, got {lin:?}"
                ));
            }
            if lin.k_head_dim > MAX_LINEAR_KEY_DIM {
                return bad(format!(
                    "linear attention key heads of {} values are wider than the {MAX_LINEAR_KEY_DIM} supported",
                    lin.k_head_dim
                ));
            }
            if !lin.v_heads.is_multiple_of(lin.k_heads) {
                return bad(format!(
                    "linear attention: {} value heads are not a multiple of {} key heads",
                    lin.v_heads, lin.k_heads
                ));
            }
        }
        if let Some(p) = self.pooled() {
            let dims = [p.q_lora_rank, p.rope_dim, p.window, p.o_groups, p.o_lora_rank, p.heavy_rate, p.light_rate];
            let ix = p.indexer;
            if dims.iter().chain(&[ix.heads, ix.head_dim, ix.top_k]).any(|&x| x == 0 || x > SIZE_LIMIT)
                || ix.top_k > MAX_INDEX_TOP_K
            {
                return bad(format!("pooled attention dimensions {p:?} out of range (each must be >= 1)"));
            }
            if self.num_kv_heads != 1 || !p.rope_dim.is_multiple_of(2) || p.rope_dim > self.head_dim {
                return bad(format!(
                    "pooled attention needs one kv head and an even rope_dim within head_dim {}, got {} kv heads \
                     and rope_dim {}",
                    self.head_dim, self.num_kv_heads, p.rope_dim
                ));
            }
            if ix.head_dim < p.rope_dim || !self.q_dim().is_multiple_of(p.o_groups) {
                return bad(format!(
                    "pooled attention: index head_dim {} must fit rope_dim {}, and o_groups {} divide H·Dh {}",
                    ix.head_dim,
                    p.rope_dim,
                    p.o_groups,
                    self.q_dim()
                ));
            }
            if self.rope.rotary_dim != p.rope_dim || p.pool_rope.rotary_dim != p.rope_dim {
                return bad(format!("pooled attention: both RoPEs rotate rope_dim {} values", p.rope_dim));
            }
            check_rope(&p.pool_rope, self.head_dim)?;
        }
        if let Some(h) = self.hyper
            && (h.streams == 0 || h.streams > 64 || h.sinkhorn_iters == 0 || !(h.eps.is_finite() && h.eps >= 0.0))
        {
            return bad(format!("hyper-connections {h:?}: 1..=64 streams, at least one iteration, eps >= 0"));
        }
        if let Some(m) = &self.moe
            && m.hash_layers > self.layers.len()
        {
            return bad(format!("{} hash-routed layers, more than the {} layers", m.hash_layers, self.layers.len()));
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.mixer.window() == Some(0) {
                return bad(format!("layer {i}: sliding window of 0"));
            }
            if l.mixer == MixerSpec::Linear && self.linear.is_none() {
                return bad(format!("layer {i} is a linear-attention layer but the config has no linear spec"));
            }
            if matches!(l.mixer, MixerSpec::Pooled { .. }) != self.pooled().is_some() {
                return bad(format!("layer {i}: pooled layers and pooled attention come together"));
            }
            if let (MixerSpec::Sparse { shared }, Some(_)) = (l.mixer, self.attention.block_index) {
                if shared {
                    return bad(format!("layer {i}: a block-sparse layer has its own indexer, it cannot reuse one"));
                }
            } else if let MixerSpec::Sparse { shared } = l.mixer {
                if self.mla().and_then(|m| m.indexer).is_none() {
                    return bad(format!("layer {i} is a sparse-attention layer but the config has no MLA indexer"));
                }
                let after_sparse = i > 0 && matches!(self.layers[i - 1].mixer, MixerSpec::Sparse { .. });
                if shared && !after_sparse {
                    return bad(format!(
                        "layer {i} reuses the selection of the layer before it, which has no indexer selection"
                    ));
                }
            }
            match l.ffn {
                FfnSpec::Dense { ffn_dim } => {
                    if ffn_dim == 0 || ffn_dim > SIZE_LIMIT {
                        return bad(format!("layer {i}: dense ffn_dim {ffn_dim} out of range"));
                    }
                }
                FfnSpec::None => {}
                FfnSpec::Moe => {
                    let Some(moe) = &self.moe else {
                        return bad(format!("layer {i} is MoE but the config has no MoE block"));
                    };
                    let (e, k, f) = (moe.num_experts, moe.router.top_k, moe.expert_ffn_dim);
                    if matches!(moe.router.score, RouterScore::SparseMixer { .. }) && (k != 2 || e < 2) {
                        return bad(format!(
                            "the sparsemixer router picks exactly 2 of at least 2 experts, not {k} of {e}"
                        ));
                    }
                    if e == 0 || e > 4096 || k == 0 || k > e || f == 0 || f > SIZE_LIMIT {
                        return bad(format!("MoE block: num_experts {e}, top_k {k}, expert_ffn_dim {f} out of range"));
                    }
                    if let Some(s) = &moe.shared_expert
                        && (s.ffn_dim == 0 || s.ffn_dim > SIZE_LIMIT)
                    {
                        return bad(format!("shared expert ffn_dim {} out of range", s.ffn_dim));
                    }
                    if let Some(l) = moe.latent_dim
                        && (l == 0 || l > self.hidden_size || moe.branch_norms)
                    {
                        return bad(format!(
                            "MoE latent width {l} must be in 1..=hidden_size {} (and without branch norms)",
                            self.hidden_size
                        ));
                    }
                    if moe.branch_norms && (moe.shared_expert.is_none() || self.norm.kind != NormKind::Rms) {
                        return bad("MoE branch norms need a shared expert and RMSNorm".into());
                    }
                    if let Some(c) = moe.router.own_norm
                        && !c.is_finite()
                    {
                        return bad(format!("router input scale {c} must be finite"));
                    }
                    let floor = moe.router.renormalize_floor;
                    if !(floor.is_finite() && floor >= 0.0) {
                        return bad(format!("MoE router renormalisation floor {floor} must be finite and >= 0"));
                    }
                    if let Some(g) = moe.router.groups
                        && (g.groups == 0
                            || g.groups > MAX_GROUPS
                            || !e.is_multiple_of(g.groups)
                            || g.top_groups == 0
                            || g.top_groups > g.groups
                            || k > g.top_groups * (e / g.groups))
                    {
                        return bad(format!("MoE router groups {g:?} do not fit {e} experts with top_k {k}"));
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults are a model the loader accepts, dense and with the MoE
    /// block switched on, so an adapter that keeps a default keeps a valid value.
    #[test]
    fn defaults_are_valid_models() {
        let dense = ModelConfig::default();
        dense.validate().unwrap();
        let moe = ModelConfig {
            moe: Some(MoeSpec::default()),
            layers: vec![LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe }; 2],
            ..Default::default()
        };
        moe.validate().unwrap();
    }

    /// A sparse-attention layer is stored as `"mixer": "sparse"`, with
    /// `shares_selection` only when it reuses the selection before it; a
    /// shared layer needs a sparse layer before it, and any sparse layer an
    /// MLA indexer.
    #[test]
    fn sparse_layers_store_their_kind_and_need_an_indexer_before_them() {
        let own = LayerSpec { mixer: MixerSpec::Sparse { shared: false }, ffn: FfnSpec::Moe };
        let shared = LayerSpec { mixer: MixerSpec::Sparse { shared: true }, ffn: FfnSpec::Moe };
        let own_json = r#"{"mixer":"sparse","sliding_window":null,"ffn":{"kind":"moe"}}"#;
        let shared_json = r#"{"mixer":"sparse","sliding_window":null,"shares_selection":true,"ffn":{"kind":"moe"}}"#;
        assert_eq!(serde_json::to_string(&own).unwrap(), own_json);
        assert_eq!(serde_json::to_string(&shared).unwrap(), shared_json);
        assert_eq!(serde_json::from_str::<LayerSpec>(shared_json).unwrap(), shared);
        let indexer =
            IndexerSpec { heads: 2, head_dim: 8, top_k: 3, rope_dim: 4, rope_interleaved: true, key_norm_eps: 1e-6 };
        let mla = MlaSpec {
            q_lora_rank: Some(6),
            kv_lora_rank: 8,
            qk_nope_dim: 4,
            qk_rope_dim: 4,
            v_head_dim: 4,
            latent_eps: 1e-6,
            indexer: Some(indexer),
        };
        let cfg = |layers: Vec<LayerSpec>, mla: MlaSpec| ModelConfig {
            num_heads: 2,
            num_kv_heads: 2,
            head_dim: 8,
            rope: RopeSpec { rotary_dim: 4, ..ModelConfig::default().rope },
            attention: AttentionSpec { kind: AttentionKind::Mla(mla), ..Default::default() },
            moe: Some(MoeSpec::default()),
            layers,
            ..Default::default()
        };
        cfg(vec![own.clone(), shared.clone(), shared.clone()], mla).validate().unwrap();
        let err = cfg(vec![shared.clone(), own.clone()], mla).validate().unwrap_err().to_string();
        assert!(err.contains("layer 0 reuses the selection"), "{err}");
        let err = cfg(vec![own.clone()], MlaSpec { indexer: None, ..mla }).validate().unwrap_err().to_string();
        assert!(err.contains("no MLA indexer"), "{err}");
        let zero = MlaSpec { indexer: Some(IndexerSpec { top_k: 0, ..indexer }), ..mla };
        assert!(cfg(vec![own.clone()], zero).validate().unwrap_err().to_string().contains("top_k 0"));
        let no_latent = MlaSpec { q_lora_rank: None, ..mla };
        assert!(cfg(vec![own], no_latent).validate().unwrap_err().to_string().contains("q_lora_rank"));
    }

    /// A layer without FFN is stored as `"ffn": {"kind": "none"}`; a latent
    /// MoE width must fit the hidden size; a Mamba2 time-step floor must be
    /// a finite non-negative number.
    #[test]
    fn mamba_switches_store_and_validate() {
        let bare = LayerSpec { mixer: MixerSpec::Linear, ffn: FfnSpec::None };
        let json = r#"{"mixer":"linear","sliding_window":null,"ffn":{"kind":"none"}}"#;
        assert_eq!(serde_json::to_string(&bare).unwrap(), json);
        assert_eq!(serde_json::from_str::<LayerSpec>(json).unwrap(), bare);
        let lin = |dt_min| LinearSpec {
            kind: LinearKind::Mamba2 { dt_min },
            k_heads: 2,
            v_heads: 4,
            k_head_dim: 8,
            v_head_dim: 4,
            conv_kernel: 4,
        };
        let cfg = |dt_min, latent| ModelConfig {
            linear: Some(lin(dt_min)),
            moe: Some(MoeSpec { latent_dim: latent, ..Default::default() }),
            layers: vec![bare.clone(), LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe }],
            ..Default::default()
        };
        cfg(0.001, Some(64)).validate().unwrap();
        assert!(cfg(f32::NAN, None).validate().unwrap_err().to_string().contains("time-step floor"));
        assert!(cfg(0.0, Some(8192)).validate().unwrap_err().to_string().contains("latent width"));
    }

    /// A layer is stored in the form every existing `.colibri` file holds:
    /// the window under `sliding_window`, `null` when the layer sees everything.
    #[test]
    fn layer_json_keeps_the_stored_form() {
        let full = LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe };
        let windowed =
            LayerSpec { mixer: MixerSpec::Attention { window: Some(5) }, ffn: FfnSpec::Dense { ffn_dim: 9 } };
        let full_json = r#"{"sliding_window":null,"ffn":{"kind":"moe"}}"#;
        let windowed_json = r#"{"sliding_window":5,"ffn":{"kind":"dense","ffn_dim":9}}"#;
        assert_eq!(serde_json::to_string(&full).unwrap(), full_json);
        assert_eq!(serde_json::to_string(&windowed).unwrap(), windowed_json);
        assert_eq!(serde_json::from_str::<LayerSpec>(full_json).unwrap(), full);
        assert_eq!(serde_json::from_str::<LayerSpec>(windowed_json).unwrap(), windowed);
    }
}
