//! The canonical tensor set of a model: names, shapes and roles.
//!
//! The converter, the file writer and the weight loader all derive the list
//! of tensors from the config through [`tensor_plan`], so the three can never
//! disagree about which tensors exist or what shape they have.
//!
//! Matrices are `[out, in]`, row-major, one output per row (as `nn.Linear`).

use super::config::{FfnSpec, LinearKind, MixerSpec, ModelConfig, NormKind, Pool, QkNorm};

/// Which tensor of a layer's attention or FFN.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerTensor {
    /// `[D]` norm scale before attention.
    AttnNorm,
    /// `[D]` LayerNorm bias before attention.
    AttnNormBias,
    /// [H·Dh, D]
    Wq,
    /// [Hkv·Dh, D]
    Wk,
    /// [Hkv·Dh, D]
    Wv,
    /// [D, H·Dh]
    Wo,
    /// [H·Dh]
    Bq,
    /// [Hkv·Dh]
    Bk,
    /// [Hkv·Dh]
    Bv,
    /// `[D]`
    Bo,
    /// `[Dh]` (per head) or `[H·Dh]` (full)
    QNorm,
    /// `[Dh]` (per head) or `[Hkv·Dh]` (full)
    KNorm,
    /// `[D]` norm scale before the FFN.
    FfnNorm,
    /// `[D]` LayerNorm bias before the FFN.
    FfnNormBias,
    /// `[H]` attention sink logits.
    Sinks,
    /// MLA [Rq, D]: the low-rank query projection (with `q_lora_rank`).
    WqA,
    /// MLA `[Rq]`: RMSNorm scale of the query latent.
    QANorm,
    /// MLA [H·Dh, Rq]: query up-projection (with `q_lora_rank`; else `Wq` is [H·Dh, D]).
    WqB,
    /// MLA [R + Dr, D]: the latent and the shared rotated key.
    WkvA,
    /// MLA `[R]`: RMSNorm scale of the latent.
    KvANorm,
    /// MLA [H, R, Dn]: each head's key up-projection, transposed
    /// (`q_nope · W_UK` is then an ordinary matmul; the absorbed form).
    WkB,
    /// MLA [H, Dv, R]: each head's value up-projection.
    WvB,
    /// Indexer [Hi·Di, Rq]: the index queries from the query latent (DSA);
    /// [Hi·Di, D] from the normed input (a block indexer).
    IdxWq,
    /// Indexer [Di, D]: the index key.
    IdxWk,
    /// Indexer `[Di]`: scale of the index key's LayerNorm (DSA) or RMSNorm
    /// (a block indexer).
    IdxKNorm,
    /// Block indexer `[Di]`: scale of each index query head's RMSNorm.
    IdxQNorm,
    /// Indexer `[Di]`: bias of the index key's LayerNorm.
    IdxKNormBias,
    /// Indexer [Hi, D]: the index heads' weights (kept f32, as transformers keeps it).
    IdxWeights,
    /// [H·Dh, D] the attention output gate (with `output_gate`).
    Wg,
    /// `[H·Dh]` the output gate's bias (with `output_gate` and `qkv_bias`).
    Bg,
    /// Linear attention [Hk·Dk, D] queries.
    LinQ,
    /// Linear attention [Hk·Dk, D] keys.
    LinK,
    /// Linear attention [Hv·Dv, D] values.
    LinV,
    /// Linear attention [Hv·Dv, D] the output norm's gate (`z`).
    LinZ,
    /// Linear attention [Hv, D] the update strengths before their sigmoid (`b`).
    LinB,
    /// Linear attention [Hv, D] the decay's input (`a`).
    LinA,
    /// Linear attention [Hk·Dk, Kc] the depthwise convolution of the
    /// queries, one row of taps per channel, oldest tap first.
    LinConvQ,
    /// Linear attention [Hk·Dk, Kc] the convolution of the keys.
    LinConvK,
    /// Linear attention [Hv·Dv, Kc] the convolution of the values.
    LinConvV,
    /// Kimi delta attention [Rg, D] the forget gate's first factor (`f_a`).
    LinFa,
    /// Kimi delta attention [H·Dk, Rg] its second factor (`f_b`).
    LinFb,
    /// Kimi delta attention [Rg, D] the output gate's first factor (`g_a`).
    LinGa,
    /// Kimi delta attention [H·Dv, Rg] its second factor (`g_b`).
    LinGb,
    /// Linear attention `[Hv]` log of the decay rate (`A_log`).
    LinALog,
    /// Linear attention: the decay's bias (`dt_bias`), `[Hv]`, or `[H·Dk]`
    /// for Kimi delta attention.
    LinDtBias,
    /// Linear attention `[Dv]` scale of the output RMSNorm (per value head;
    /// Mamba2: `[Hv·Dv]`, one per channel).
    LinNorm,
    /// Mamba2 `[Hk·Dk]`, `[Hk·Dk]`, `[Hv·Dv]`: the convolution's biases of
    /// C, B and x (the "queries", "keys" and "values").
    LinConvBiasQ,
    /// Mamba2 `[Hk·Dk]` the convolution's bias of B.
    LinConvBiasK,
    /// Mamba2 `[Hv·Dv]` the convolution's bias of x.
    LinConvBiasV,
    /// Mamba2 `[Hv]` the skip connection's weight per head (`D`).
    LinSkip,
    /// Latent MoE [L, D]: the routed experts' input projection.
    MoeLatentIn,
    /// Latent MoE [D, L]: their summed output's projection back to D.
    MoeLatentOut,
    /// Dense MLP [F, D]
    Gate,
    /// Dense MLP [F, D]
    Up,
    /// Dense MLP [D, F]
    Down,
    /// [E, D] router
    Router,
    /// `[E]` router bias
    RouterBias,
    /// `[E]` selection-only score bias (e_score_correction_bias)
    RouterCorrection,
    /// Shared expert [Fs, D]
    SharedGate,
    /// Shared expert [Fs, D]
    SharedUp,
    /// Shared expert [D, Fs]
    SharedDown,
    /// [1, D] sigmoid gate of the shared expert
    SharedExpertGate,
    /// `[D]` RMSNorm of the attention output before the residual add (`post_norms`).
    AttnPostNorm,
    /// `[D]` RMSNorm of the FFN output before the residual add (`post_norms`).
    FfnPostNorm,
    /// `[D]` the router's own RMSNorm of the residual (`own_norm`).
    RouterNorm,
    /// `[E]` per-expert multiplier of the routing weights (`expert_scale`).
    RouterExpertScale,
    /// `[D]` the routed experts' own input norm (`branch_norms`).
    MoeNorm,
    /// `[D]` RMSNorm of the routed experts' summed output (`branch_norms`).
    MoePostNorm,
    /// `[D]` RMSNorm of the shared expert's output (`branch_norms`).
    SharedPostNorm,
    /// `[1]` multiplier of the layer's output (`layer_scale`).
    LayerScale,
    /// Pooled attention [Dh, D]: the one key/value row.
    Wkv,
    /// Pooled attention `[Dh]`: its RMSNorm scale.
    KvNorm,
    /// Pooled attention [G·Ro, H·Dh/G]: the grouped output projection,
    /// group g's rows `g·Ro..(g + 1)·Ro` (`Wo` then mixes the groups).
    WoA,
    /// Pool [m·Dh, D] (m = 2 on light layers): the rows to pool.
    PoolKv,
    /// Pool [m·Dh, D]: their gates.
    PoolGate,
    /// Pool [rate, m·Dh]: the gates' bias per position in the block.
    PoolBias,
    /// Pool `[Dh]`: RMSNorm scale of an entry.
    PoolNorm,
    /// Index pool [2·Di, D]: the rows to pool.
    IdxPoolKv,
    /// Index pool [2·Di, D]: their gates.
    IdxPoolGate,
    /// Index pool [rate, 2·Di]: the gates' bias per position.
    IdxPoolBias,
    /// Index pool `[Di]`: RMSNorm scale of an index key.
    IdxPoolNorm,
    /// Hyper-connections before attention [(2 + N)·N, N·D].
    AttnHcFn,
    /// `[(2 + N)·N]` their bias.
    AttnHcBase,
    /// `[3]` their scales (pre, post, comb).
    AttnHcScale,
    /// Hyper-connections before the FFN [(2 + N)·N, N·D].
    FfnHcFn,
    /// `[(2 + N)·N]` their bias.
    FfnHcBase,
    /// `[3]` their scales.
    FfnHcScale,
    /// Hash routing [V, K]: each token's experts (whole numbers, f32).
    HashTable,
}

/// Which matrix of a routed expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertTensor {
    /// [F, D]
    Gate,
    /// [F, D]
    Up,
    /// [D, F]
    Down,
    /// `[F]`
    GateBias,
    /// `[F]`
    UpBias,
    /// `[D]`
    DownBias,
}

impl ExpertTensor {
    /// The three matrices, in slab order.
    pub const ALL: [ExpertTensor; 3] = [ExpertTensor::Gate, ExpertTensor::Up, ExpertTensor::Down];
    /// Their biases, in slab order after the matrices.
    pub const BIASES: [ExpertTensor; 3] = [ExpertTensor::GateBias, ExpertTensor::UpBias, ExpertTensor::DownBias];
}

/// Identity of one canonical tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorId {
    /// [V, D]
    Embed,
    /// `[D]` final norm
    FinalNorm,
    /// `[D]` final LayerNorm bias
    FinalNormBias,
    /// [V, D] (absent when tied)
    LmHead,
    /// `[V]` lm_head bias
    LmHeadBias,
    /// A per-layer tensor.
    Layer(usize, LayerTensor),
    /// (layer, expert, which)
    Expert(usize, usize, ExpertTensor),
    /// The multi-token-prediction layer's glue (its decoder layer is an
    /// ordinary [`TensorId::Layer`], the last).
    Mtp(MtpTensor),
    /// Hyper-connections' final collapse [N, N·D].
    HcHeadFn,
    /// `[N]` its bias.
    HcHeadBase,
    /// `[1]` its scale.
    HcHeadScale,
}

/// The tensors around a multi-token-prediction layer (see
/// [`crate::canonical::config::MtpSpec`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MtpTensor {
    /// `[D]` RMSNorm of the next token's embedding.
    EmbedNorm,
    /// `[D]` RMSNorm of the hidden state.
    HiddenNorm,
    /// `[D, 2D]` projection of the two, embedding first.
    Proj,
    /// `[D]` RMSNorm before the output head.
    OutNorm,
}

impl MtpTensor {
    /// The tensor's name in a `.colibri` file, after `mtp.`.
    pub fn name(self) -> &'static str {
        match self {
            MtpTensor::EmbedNorm => "embed_norm",
            MtpTensor::HiddenNorm => "hidden_norm",
            MtpTensor::Proj => "proj",
            MtpTensor::OutNorm => "out_norm",
        }
    }
}

impl std::fmt::Display for TensorId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use LayerTensor as L;
        match self {
            TensorId::Embed => f.write_str("embed"),
            TensorId::FinalNorm => f.write_str("final_norm"),
            TensorId::FinalNormBias => f.write_str("final_norm.bias"),
            TensorId::LmHead => f.write_str("lm_head"),
            TensorId::LmHeadBias => f.write_str("lm_head.bias"),
            TensorId::Mtp(t) => write!(f, "mtp.{}", t.name()),
            TensorId::HcHeadFn => f.write_str("hc_head.fn"),
            TensorId::HcHeadBase => f.write_str("hc_head.base"),
            TensorId::HcHeadScale => f.write_str("hc_head.scale"),
            TensorId::Layer(l, t) => {
                let n = match t {
                    L::AttnNorm => "attn_norm",
                    L::AttnNormBias => "attn_norm.bias",
                    L::FfnNormBias => "ffn_norm.bias",
                    L::Sinks => "attn.sinks",
                    L::WqA => "attn.wq_a",
                    L::QANorm => "attn.q_a_norm",
                    L::WqB => "attn.wq_b",
                    L::WkvA => "attn.wkv_a",
                    L::KvANorm => "attn.kv_a_norm",
                    L::WkB => "attn.wk_b",
                    L::WvB => "attn.wv_b",
                    L::IdxWq => "attn.indexer.wq",
                    L::IdxWk => "attn.indexer.wk",
                    L::IdxKNorm => "attn.indexer.k_norm",
                    L::IdxQNorm => "attn.indexer.q_norm",
                    L::IdxKNormBias => "attn.indexer.k_norm.bias",
                    L::IdxWeights => "attn.indexer.weights",
                    L::RouterBias => "moe.router.bias",
                    L::RouterCorrection => "moe.router.correction",
                    L::Wg => "attn.wg",
                    L::Bg => "attn.bg",
                    L::LinQ => "linear.wq",
                    L::LinK => "linear.wk",
                    L::LinV => "linear.wv",
                    L::LinZ => "linear.wz",
                    L::LinB => "linear.wb",
                    L::LinA => "linear.wa",
                    L::LinConvQ => "linear.conv_q",
                    L::LinConvK => "linear.conv_k",
                    L::LinConvV => "linear.conv_v",
                    L::LinFa => "linear.f_a",
                    L::LinFb => "linear.f_b",
                    L::LinGa => "linear.g_a",
                    L::LinGb => "linear.g_b",
                    L::LinALog => "linear.a_log",
                    L::LinDtBias => "linear.dt_bias",
                    L::LinNorm => "linear.norm",
                    L::LinConvBiasQ => "linear.conv_q_bias",
                    L::LinConvBiasK => "linear.conv_k_bias",
                    L::LinConvBiasV => "linear.conv_v_bias",
                    L::LinSkip => "linear.skip",
                    L::MoeLatentIn => "moe.latent_in",
                    L::MoeLatentOut => "moe.latent_out",
                    L::Wq => "attn.wq",
                    L::Wk => "attn.wk",
                    L::Wv => "attn.wv",
                    L::Wo => "attn.wo",
                    L::Bq => "attn.bq",
                    L::Bk => "attn.bk",
                    L::Bv => "attn.bv",
                    L::Bo => "attn.bo",
                    L::QNorm => "attn.q_norm",
                    L::KNorm => "attn.k_norm",
                    L::FfnNorm => "ffn_norm",
                    L::Gate => "ffn.gate",
                    L::Up => "ffn.up",
                    L::Down => "ffn.down",
                    L::Router => "moe.router",
                    L::SharedGate => "moe.shared.gate",
                    L::SharedUp => "moe.shared.up",
                    L::SharedDown => "moe.shared.down",
                    L::SharedExpertGate => "moe.shared_gate",
                    L::AttnPostNorm => "attn_post_norm",
                    L::FfnPostNorm => "ffn_post_norm",
                    L::RouterNorm => "moe.router.norm",
                    L::RouterExpertScale => "moe.router.expert_scale",
                    L::MoeNorm => "moe.norm",
                    L::MoePostNorm => "moe.post_norm",
                    L::SharedPostNorm => "moe.shared.post_norm",
                    L::LayerScale => "layer_scale",
                    L::Wkv => "attn.wkv",
                    L::KvNorm => "attn.kv_norm",
                    L::WoA => "attn.wo_a",
                    L::PoolKv => "attn.pool.kv",
                    L::PoolGate => "attn.pool.gate",
                    L::PoolBias => "attn.pool.bias",
                    L::PoolNorm => "attn.pool.norm",
                    L::IdxPoolKv => "attn.indexer.pool.kv",
                    L::IdxPoolGate => "attn.indexer.pool.gate",
                    L::IdxPoolBias => "attn.indexer.pool.bias",
                    L::IdxPoolNorm => "attn.indexer.pool.norm",
                    L::AttnHcFn => "attn_hc.fn",
                    L::AttnHcBase => "attn_hc.base",
                    L::AttnHcScale => "attn_hc.scale",
                    L::FfnHcFn => "ffn_hc.fn",
                    L::FfnHcBase => "ffn_hc.base",
                    L::FfnHcScale => "ffn_hc.scale",
                    L::HashTable => "moe.hash_table",
                };
                write!(f, "layers.{l}.{n}")
            }
            TensorId::Expert(l, e, t) => {
                let n = match t {
                    ExpertTensor::Gate => "gate",
                    ExpertTensor::Up => "up",
                    ExpertTensor::Down => "down",
                    ExpertTensor::GateBias => "gate.bias",
                    ExpertTensor::UpBias => "up.bias",
                    ExpertTensor::DownBias => "down.bias",
                };
                write!(f, "layers.{l}.moe.experts.{e}.{n}")
            }
        }
    }
}

/// The classes of weight matrices a conversion recipe gives types to
/// ([`crate::convert::recipe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorClass {
    /// The token embedding (a lookup table; also the output head when tied).
    Embed,
    /// The output head.
    LmHead,
    /// An embedding tied to the output head: one matrix read as both.
    Tied,
    /// Attention's query and output projections (MLA's query factors too).
    Attention,
    /// Attention's key and value projections (MLA's compressed key-value
    /// projection and its per-head key and value factors): with grouped
    /// queries a small share of attention's weights, read by every head of
    /// a group, which a recipe may keep a step above q and o.
    AttentionKv,
    /// Dense MLPs (layers without experts).
    Ffn,
    /// Shared experts.
    Shared,
    /// Routed experts' gate and up projections.
    ExpertGateUp,
    /// Routed experts' down projections.
    ExpertDown,
}

impl TensorClass {
    /// Every class, in the order `colibri info` lists them.
    pub const ALL: [TensorClass; 9] = [
        TensorClass::Embed,
        TensorClass::LmHead,
        TensorClass::Tied,
        TensorClass::Attention,
        TensorClass::AttentionKv,
        TensorClass::Ffn,
        TensorClass::Shared,
        TensorClass::ExpertGateUp,
        TensorClass::ExpertDown,
    ];

    /// The name recipes and `colibri info` use.
    pub fn name(self) -> &'static str {
        match self {
            TensorClass::Embed => "embed",
            TensorClass::LmHead => "lm_head",
            TensorClass::Tied => "tied",
            TensorClass::Attention => "attn",
            TensorClass::AttentionKv => "attn_kv",
            TensorClass::Ffn => "ffn",
            TensorClass::Shared => "shared",
            TensorClass::ExpertGateUp => "experts",
            TensorClass::ExpertDown => "experts_down",
        }
    }
}

impl TensorId {
    /// The recipe class of a weight matrix in a model whose embedding is
    /// `tied` to the output head or not (`None` for norms, biases, the
    /// router and other small tensors, which are always f32). A tied
    /// embedding is the output head too, and the most sensitive matrix of
    /// the model as that, its error entering at both ends: it has its own
    /// class, `tied`, which recipes give the output head's type unless they
    /// name it.
    pub fn class_in(&self, tied: bool) -> Option<TensorClass> {
        match self {
            TensorId::Embed if tied => Some(TensorClass::Tied),
            _ => self.class(),
        }
    }

    /// The recipe class of a weight matrix (`None` for norms, biases, the
    /// router and other small tensors, which are always f32).
    pub fn class(&self) -> Option<TensorClass> {
        use LayerTensor as L;
        match self {
            TensorId::Embed => Some(TensorClass::Embed),
            TensorId::LmHead => Some(TensorClass::LmHead),
            TensorId::Mtp(MtpTensor::Proj) => Some(TensorClass::Attention),
            TensorId::Layer(_, t) => match t {
                L::Wq | L::Wo | L::WqA | L::WqB | L::Wg | L::IdxWq | L::WoA => Some(TensorClass::Attention),
                L::Wk | L::Wv | L::WkvA | L::WkB | L::WvB | L::IdxWk => Some(TensorClass::AttentionKv),
                L::Wkv | L::PoolKv | L::PoolGate | L::IdxPoolKv | L::IdxPoolGate => Some(TensorClass::AttentionKv),
                L::LinQ | L::LinK | L::LinV | L::LinZ | L::LinB | L::LinA => Some(TensorClass::Attention),
                L::LinFa | L::LinFb | L::LinGa | L::LinGb => Some(TensorClass::Attention),
                L::Gate | L::Up | L::Down => Some(TensorClass::Ffn),
                L::SharedGate | L::SharedUp | L::SharedDown => Some(TensorClass::Shared),
                L::MoeLatentIn | L::MoeLatentOut => Some(TensorClass::Shared),
                _ => None,
            },
            TensorId::Expert(_, _, t) => match t {
                ExpertTensor::Gate | ExpertTensor::Up => Some(TensorClass::ExpertGateUp),
                ExpertTensor::Down => Some(TensorClass::ExpertDown),
                _ => None,
            },
            _ => None,
        }
    }
}

/// Rows of an MLP's up projection: `f`, or none for an activation that is
/// not gated (relu², whose one input matrix is the gate): the tensor stays
/// in the plan, empty, so every MLP and expert slab keeps its three parts.
pub fn up_rows(act: crate::canonical::config::Activation, f: usize) -> usize {
    if act.gated() { f } else { 0 }
}

/// What a tensor is used for, which decides its storage type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A large matrix: stored in the requested weight type.
    Matrix,
    /// Norm scales, biases, the router and the shared-expert gate: always f32,
    /// because they are small and (for the router) decide which experts run.
    Small,
}

/// One entry of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedTensor {
    /// Identity.
    pub id: TensorId,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Storage role.
    pub role: Role,
}

/// Every tensor the config implies, in file order: embedding, then each layer
/// (attention, FFN, and each routed expert's gate/up/down in a row so one
/// expert is one contiguous slab), then the final norm and lm_head.
pub fn tensor_plan(cfg: &ModelConfig) -> Vec<PlannedTensor> {
    use LayerTensor as L;
    let (v, d) = (cfg.vocab_size, cfg.hidden_size);
    let (h, layer_norm) = (cfg.num_heads, cfg.norm.kind == NormKind::Layer);
    let mut out = Vec::new();
    let mut push = |id, shape: Vec<usize>, role| out.push(PlannedTensor { id, shape, role });
    push(TensorId::Embed, vec![v, d], Role::Matrix);
    for (l, layer) in cfg.layers.iter().enumerate() {
        let t = |x| TensorId::Layer(l, x);
        push(t(L::AttnNorm), vec![d], Role::Small);
        if layer_norm {
            push(t(L::AttnNormBias), vec![d], Role::Small);
        }
        match layer.mixer {
            MixerSpec::Attention { .. } | MixerSpec::Sparse { .. } => {
                // This layer's heads (Gemma 4's global layers differ from the rest).
                let shape = cfg.head_shape(l);
                let (q, kv, dh) = (h * shape.head_dim, shape.kv_heads * shape.head_dim, shape.head_dim);
                match cfg.mla() {
                    None => {
                        push(t(L::Wq), vec![q, d], Role::Matrix);
                        push(t(L::Wk), vec![kv, d], Role::Matrix);
                        if !shape.values_from_keys {
                            push(t(L::Wv), vec![kv, d], Role::Matrix);
                        }
                        if let (MixerSpec::Sparse { .. }, Some(b)) = (layer.mixer, cfg.attention.block_index) {
                            push(t(L::IdxWq), vec![b.heads * b.head_dim, d], Role::Matrix);
                            push(t(L::IdxWk), vec![b.head_dim, d], Role::Matrix);
                            push(t(L::IdxQNorm), vec![b.head_dim], Role::Small);
                            push(t(L::IdxKNorm), vec![b.head_dim], Role::Small);
                        }
                    }
                    Some(m) => {
                        match m.q_lora_rank {
                            None => push(t(L::Wq), vec![q, d], Role::Matrix),
                            Some(rq) => {
                                push(t(L::WqA), vec![rq, d], Role::Matrix);
                                push(t(L::QANorm), vec![rq], Role::Small);
                                push(t(L::WqB), vec![q, rq], Role::Matrix);
                            }
                        }
                        let r = m.kv_lora_rank;
                        push(t(L::WkvA), vec![r + m.qk_rope_dim, d], Role::Matrix);
                        push(t(L::KvANorm), vec![r], Role::Small);
                        push(t(L::WkB), vec![h, r, m.qk_nope_dim], Role::Matrix);
                        push(t(L::WvB), vec![h, m.v_head_dim, r], Role::Matrix);
                        if let (MixerSpec::Sparse { shared: false }, Some(ix), Some(rq)) =
                            (layer.mixer, m.indexer, m.q_lora_rank)
                        {
                            push(t(L::IdxWq), vec![ix.heads * ix.head_dim, rq], Role::Matrix);
                            push(t(L::IdxWk), vec![ix.head_dim, d], Role::Matrix);
                            push(t(L::IdxKNorm), vec![ix.head_dim], Role::Small);
                            push(t(L::IdxKNormBias), vec![ix.head_dim], Role::Small);
                            push(t(L::IdxWeights), vec![ix.heads, d], Role::Small);
                        }
                    }
                }
                push(t(L::Wo), vec![d, if cfg.mla().is_some() { cfg.att_dim() } else { q }], Role::Matrix);
                if cfg.attention.output_gate {
                    push(t(L::Wg), vec![q, d], Role::Matrix);
                    if cfg.attention.qkv_bias {
                        push(t(L::Bg), vec![q], Role::Small);
                    }
                }
                if cfg.attention.qkv_bias {
                    push(t(L::Bq), vec![q], Role::Small);
                    push(t(L::Bk), vec![kv], Role::Small);
                    push(t(L::Bv), vec![kv], Role::Small);
                }
                if cfg.attention.o_bias {
                    push(t(L::Bo), vec![d], Role::Small);
                }
                match cfg.attention.qk_norm {
                    QkNorm::None => {}
                    QkNorm::PerHead => {
                        push(t(L::QNorm), vec![dh], Role::Small);
                        push(t(L::KNorm), vec![dh], Role::Small);
                    }
                    QkNorm::Full => {
                        push(t(L::QNorm), vec![q], Role::Small);
                        push(t(L::KNorm), vec![kv], Role::Small);
                    }
                }
                if cfg.attention.sinks {
                    push(t(L::Sinks), vec![h], Role::Small);
                }
                if cfg.post_norms {
                    push(t(L::AttnPostNorm), vec![d], Role::Small);
                }
            }
            MixerSpec::Pooled { pool } => {
                let p = cfg.pooled().expect("validated: a pooled layer has a pooled spec");
                let (dh, rq, ix) = (cfg.head_dim, p.q_lora_rank, p.indexer);
                push(t(L::WqA), vec![rq, d], Role::Matrix);
                push(t(L::QANorm), vec![rq], Role::Small);
                push(t(L::WqB), vec![h * dh, rq], Role::Matrix);
                push(t(L::Wkv), vec![dh, d], Role::Matrix);
                push(t(L::KvNorm), vec![dh], Role::Small);
                push(t(L::Sinks), vec![h], Role::Small);
                let (m, rate) = match pool {
                    Pool::Window => (0, 0),
                    Pool::Heavy => (1, p.heavy_rate),
                    Pool::Light => (2, p.light_rate),
                };
                if m > 0 {
                    push(t(L::PoolKv), vec![m * dh, d], Role::Matrix);
                    push(t(L::PoolGate), vec![m * dh, d], Role::Matrix);
                    push(t(L::PoolBias), vec![rate, m * dh], Role::Small);
                    push(t(L::PoolNorm), vec![dh], Role::Small);
                }
                if pool == Pool::Light {
                    push(t(L::IdxPoolKv), vec![2 * ix.head_dim, d], Role::Matrix);
                    push(t(L::IdxPoolGate), vec![2 * ix.head_dim, d], Role::Matrix);
                    push(t(L::IdxPoolBias), vec![rate, 2 * ix.head_dim], Role::Small);
                    push(t(L::IdxPoolNorm), vec![ix.head_dim], Role::Small);
                    push(t(L::IdxWq), vec![ix.heads * ix.head_dim, rq], Role::Matrix);
                    push(t(L::IdxWeights), vec![ix.heads, d], Role::Small);
                }
                push(t(L::WoA), vec![p.o_groups * p.o_lora_rank, h * dh / p.o_groups], Role::Matrix);
                push(t(L::Wo), vec![d, p.o_groups * p.o_lora_rank], Role::Matrix);
            }
            MixerSpec::Linear => {
                let lin = cfg.linear.expect("validated: a linear layer has a linear spec");
                let (hv, kd, vd) = (lin.v_heads, lin.key_dim(), lin.value_dim());
                push(t(L::LinQ), vec![kd, d], Role::Matrix);
                push(t(L::LinK), vec![kd, d], Role::Matrix);
                push(t(L::LinV), vec![vd, d], Role::Matrix);
                let mamba = matches!(lin.kind, LinearKind::Mamba2 { .. });
                if !mamba {
                    push(t(L::LinB), vec![hv, d], Role::Matrix);
                }
                match lin.kind {
                    LinearKind::GatedDeltaNet | LinearKind::Mamba2 { .. } => {
                        push(t(L::LinZ), vec![vd, d], Role::Matrix);
                        push(t(L::LinA), vec![hv, d], Role::Matrix);
                    }
                    LinearKind::Kda { gate_rank: r } => {
                        push(t(L::LinFa), vec![r, d], Role::Matrix);
                        push(t(L::LinFb), vec![kd, r], Role::Matrix);
                        push(t(L::LinGa), vec![r, d], Role::Matrix);
                        push(t(L::LinGb), vec![vd, r], Role::Matrix);
                    }
                }
                let kc = lin.conv_kernel;
                push(t(L::LinConvQ), vec![kd, kc], Role::Small);
                push(t(L::LinConvK), vec![kd, kc], Role::Small);
                push(t(L::LinConvV), vec![vd, kc], Role::Small);
                push(t(L::LinALog), vec![hv], Role::Small);
                let per_channel = matches!(lin.kind, LinearKind::Kda { .. });
                push(t(L::LinDtBias), vec![if per_channel { kd } else { hv }], Role::Small);
                push(t(L::LinNorm), vec![if mamba { vd } else { lin.v_head_dim }], Role::Small);
                if mamba {
                    push(t(L::LinConvBiasQ), vec![kd], Role::Small);
                    push(t(L::LinConvBiasK), vec![kd], Role::Small);
                    push(t(L::LinConvBiasV), vec![vd], Role::Small);
                    push(t(L::LinSkip), vec![hv], Role::Small);
                }
                push(t(L::Wo), vec![d, vd], Role::Matrix);
            }
        }
        if layer.ffn != FfnSpec::None {
            push(t(L::FfnNorm), vec![d], Role::Small);
            if layer_norm {
                push(t(L::FfnNormBias), vec![d], Role::Small);
            }
        }
        match layer.ffn {
            FfnSpec::None => {}
            FfnSpec::Dense { ffn_dim: f } => {
                push(t(L::Gate), vec![f, d], Role::Matrix);
                push(t(L::Up), vec![up_rows(cfg.dense_activation, f), d], Role::Matrix);
                push(t(L::Down), vec![d, f], Role::Matrix);
            }
            FfnSpec::Moe => {
                let moe = cfg.moe.as_ref().expect("validated: MoE layer has a MoE spec");
                let (e, f) = (moe.num_experts, moe.expert_ffn_dim);
                let xd = moe.latent_dim.unwrap_or(d); // the experts' input width
                if let Some(l) = moe.latent_dim {
                    push(t(L::MoeLatentIn), vec![l, d], Role::Matrix);
                    push(t(L::MoeLatentOut), vec![d, l], Role::Matrix);
                }
                push(t(L::Router), vec![e, d], Role::Small);
                if moe.router.bias {
                    push(t(L::RouterBias), vec![e], Role::Small);
                }
                if moe.router.correction_bias && l >= moe.hash_layers {
                    push(t(L::RouterCorrection), vec![e], Role::Small);
                }
                if moe.router.own_norm.is_some() {
                    push(t(L::RouterNorm), vec![d], Role::Small);
                }
                if l < moe.hash_layers {
                    push(t(L::HashTable), vec![v, moe.router.top_k], Role::Small);
                }
                if moe.router.expert_scale {
                    push(t(L::RouterExpertScale), vec![e], Role::Small);
                }
                if moe.branch_norms {
                    push(t(L::MoeNorm), vec![d], Role::Small);
                    push(t(L::MoePostNorm), vec![d], Role::Small);
                    push(t(L::SharedPostNorm), vec![d], Role::Small);
                }
                if let Some(s) = &moe.shared_expert {
                    push(t(L::SharedGate), vec![s.ffn_dim, d], Role::Matrix);
                    push(t(L::SharedUp), vec![up_rows(moe.activation, s.ffn_dim), d], Role::Matrix);
                    push(t(L::SharedDown), vec![d, s.ffn_dim], Role::Matrix);
                    if s.sigmoid_gate {
                        push(t(L::SharedExpertGate), vec![1, d], Role::Small);
                    }
                }
                for x in 0..e {
                    let id = |w| TensorId::Expert(l, x, w);
                    push(id(ExpertTensor::Gate), vec![f, xd], Role::Matrix);
                    push(id(ExpertTensor::Up), vec![up_rows(moe.activation, f), xd], Role::Matrix);
                    push(id(ExpertTensor::Down), vec![xd, f], Role::Matrix);
                    if moe.expert_bias {
                        push(id(ExpertTensor::GateBias), vec![f], Role::Small);
                        push(id(ExpertTensor::UpBias), vec![f], Role::Small);
                        push(id(ExpertTensor::DownBias), vec![xd], Role::Small);
                    }
                }
            }
        }
        if cfg.post_norms {
            push(t(L::FfnPostNorm), vec![d], Role::Small);
        }
        if cfg.layer_scale {
            push(t(L::LayerScale), vec![1], Role::Small);
        }
        if let Some(hc) = cfg.hyper {
            let (n, mix) = (hc.streams, (2 + hc.streams) * hc.streams);
            push(t(L::AttnHcFn), vec![mix, n * d], Role::Small);
            push(t(L::AttnHcBase), vec![mix], Role::Small);
            push(t(L::AttnHcScale), vec![3], Role::Small);
            push(t(L::FfnHcFn), vec![mix, n * d], Role::Small);
            push(t(L::FfnHcBase), vec![mix], Role::Small);
            push(t(L::FfnHcScale), vec![3], Role::Small);
        }
    }
    if let Some(hc) = cfg.hyper {
        push(TensorId::HcHeadFn, vec![hc.streams, hc.streams * d], Role::Small);
        push(TensorId::HcHeadBase, vec![hc.streams], Role::Small);
        push(TensorId::HcHeadScale, vec![1], Role::Small);
    }
    push(TensorId::FinalNorm, vec![d], Role::Small);
    if layer_norm {
        push(TensorId::FinalNormBias, vec![d], Role::Small);
    }
    if !cfg.tie_embeddings {
        push(TensorId::LmHead, vec![v, d], Role::Matrix);
    }
    if cfg.lm_head_bias {
        push(TensorId::LmHeadBias, vec![v], Role::Small);
    }
    if cfg.mtp.is_some() {
        push(TensorId::Mtp(MtpTensor::EmbedNorm), vec![d], Role::Small);
        push(TensorId::Mtp(MtpTensor::HiddenNorm), vec![d], Role::Small);
        push(TensorId::Mtp(MtpTensor::Proj), vec![d, 2 * d], Role::Matrix);
        push(TensorId::Mtp(MtpTensor::OutNorm), vec![d], Role::Small);
    }
    out
}
