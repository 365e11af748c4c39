//! A loaded model: the validated file, its canonical config, and typed
//! references to every dense weight. Read-only after load and shared by every
//! session (`Send + Sync`); per-conversation state (KV cache, workspace)
//! lives beside it in [`session::Session`], as llama2.c keeps `RunState`
//! beside `Transformer`.

pub mod blocks;
pub mod forward;
pub mod session;
pub mod stage;
pub mod store;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::canonical::config::{self, FfnSpec, MixerSpec, ModelConfig};
use crate::canonical::tensors::{LayerTensor as L, MtpTensor, TensorId};
use crate::error::Result;
use crate::format::reader::ColibriFile;
use crate::kernels::Matrix;
use blocks::block_index::BlockIndexRefs;
use blocks::delta::DeltaRefs;
use blocks::indexer::{IndexRefs, IndexerRefs};
use store::telemetry::Telemetry;
use store::{DenseCopy, ExpertStore, HeatState, RoutingStats, StoreOptions, StoreStats, WeightsBacking};
use weights::{TensorRef, matrix, tensor_ref};

/// A dense gated MLP: `down(act(gate · x) * (up · x))`.
#[derive(Clone, Copy, Debug)]
pub struct MlpRefs {
    /// [F, D]
    pub gate: TensorRef,
    /// [F, D]
    pub up: TensorRef,
    /// [D, F]
    pub down: TensorRef,
}

/// The feed-forward half of a layer.
// One per layer, made at load: the MoE variant's size costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, Debug)]
pub enum FfnRefs {
    /// No FFN (the layer is its mixer alone).
    None,
    /// A dense MLP.
    Dense(MlpRefs),
    /// The MoE block: router (and its biases), optional shared expert and its
    /// gate; the routed experts themselves are fetched through the [`ExpertStore`].
    Moe {
        /// [E, D] router (f32).
        router: TensorRef,
        /// `[E]` router bias.
        router_bias: Option<TensorRef>,
        /// `[E]` selection-only score bias.
        correction: Option<TensorRef>,
        /// Shared expert, if the model has one.
        shared: Option<MlpRefs>,
        /// [1, D] sigmoid gate of the shared expert (f32).
        shared_gate: Option<TensorRef>,
        /// `[D]` the router's own norm of the residual.
        router_norm: Option<TensorRef>,
        /// `[E]` per-expert multiplier of the routing weights.
        expert_scale: Option<TensorRef>,
        /// `[D]` ×3: the routed experts' input norm, their output norm and
        /// the shared expert's output norm (branch norms).
        branch_norms: Option<[TensorRef; 3]>,
        /// [L, D], [D, L]: the projections into and out of the experts'
        /// latent width (latent MoE).
        latent: Option<[TensorRef; 2]>,
        /// [V, K] the token → experts table of a hash-routed layer.
        hash_table: Option<TensorRef>,
    },
}

/// A norm's scale and, for LayerNorm, its bias.
#[derive(Clone, Copy, Debug)]
pub struct NormRefs {
    /// `[D]`
    pub w: TensorRef,
    /// `[D]`
    pub b: Option<TensorRef>,
}

/// How a layer's queries, keys and values are projected.
#[derive(Clone, Copy, Debug)]
pub enum QkvRefs {
    /// Grouped-query attention.
    Gqa {
        /// [H·Dh, D]
        wq: TensorRef,
        /// [Hkv·Dh, D]
        wk: TensorRef,
        /// [Hkv·Dh, D]; `None` when the values are the key projection.
        wv: Option<TensorRef>,
        /// Block-sparse attention: the layer's block indexer.
        index: Option<BlockIndexRefs>,
    },
    /// Multi-head latent attention.
    Mla {
        /// The query: one projection [H·Dh, D], or `q_a` [Rq, D] → RMSNorm → `q_b` [H·Dh, Rq].
        q: MlaQuery,
        /// [R + Dr, D] latent and shared rotated key.
        wkv_a: TensorRef,
        /// `[R]` RMSNorm of the latent.
        kv_a_norm: TensorRef,
        /// [H·R, Dn] per-head key up-projections, transposed.
        wk_b: TensorRef,
        /// [H·Dv, R] per-head value up-projections.
        wv_b: TensorRef,
        /// Sparse attention: where the selection of keys comes from.
        index: Option<IndexRefs>,
    },
    /// Linear attention by the gated delta rule (its output projection is `wo`).
    Delta(DeltaRefs),
    /// DeepSeek-V4's pooled attention (its second output projection is `wo`).
    Pooled(blocks::pooled::PooledRefs),
}

/// The query path of MLA.
#[derive(Clone, Copy, Debug)]
pub enum MlaQuery {
    /// [H·Dh, D]
    Direct(TensorRef),
    /// Low rank: `[Rq, D]`, its `[Rq]` norm, `[H·Dh, Rq]`.
    LowRank(TensorRef, TensorRef, TensorRef),
}

/// References to one layer's dense weights.
#[derive(Clone, Copy, Debug)]
pub struct LayerRefs {
    /// Norm before attention.
    pub attn_norm: NormRefs,
    /// q, k, v (or latent) projections.
    pub qkv: QkvRefs,
    /// [D, H·Dv]
    pub wo: TensorRef,
    /// q, k, v biases.
    pub qkv_bias: Option<[TensorRef; 3]>,
    /// o bias.
    pub o_bias: Option<TensorRef>,
    /// q and k norm scales.
    pub qk_norm: Option<[TensorRef; 2]>,
    /// `[H]` attention sink logits.
    pub sinks: Option<TensorRef>,
    /// [H·Dh, D] the attention output gate.
    pub wg: Option<TensorRef>,
    /// `[H·Dh]` its bias.
    pub bg: Option<TensorRef>,
    /// Norm before the FFN (none when the layer has no FFN).
    pub ffn_norm: Option<NormRefs>,
    /// Dense MLP or MoE.
    pub ffn: FfnRefs,
    /// `[D]` ×2: norms of the attention and FFN outputs before their residual adds.
    pub post_norms: Option<[TensorRef; 2]>,
    /// `[1]` multiplier of the layer's output.
    pub layer_scale: Option<TensorRef>,
    /// Hyper-connections around attention and around the FFN: `fn`, bias
    /// and scales of each.
    pub hyper: Option<[[TensorRef; 3]; 2]>,
}

/// The glue around the multi-token-prediction layer (the last of
/// [`Model::layers`]).
#[derive(Clone, Copy, Debug)]
pub struct MtpRefs {
    /// `[D]` norm of the next token's embedding.
    pub embed_norm: TensorRef,
    /// `[D]` norm of the hidden state.
    pub hidden_norm: TensorRef,
    /// [D, 2D] projection of the two, embedding first.
    pub proj: TensorRef,
    /// `[D]` norm before the output head.
    pub out_norm: TensorRef,
}

/// A model ready to run.
pub struct Model {
    file: Arc<ColibriFile>,
    /// The canonical config.
    pub config: ModelConfig,
    /// [V, D] (`None` in a stage file that begins after layer 0 and does
    /// not end with a tied head).
    pub embed: Option<TensorRef>,
    /// The final norm (`None` in a stage file that ends before the last layer).
    pub final_norm: Option<NormRefs>,
    /// [V, D]; the embedding when tied (`None` as the final norm).
    pub lm_head: Option<TensorRef>,
    /// `[V]` lm_head bias.
    pub lm_head_bias: Option<TensorRef>,
    /// One per decoder layer the file holds, from [`Model::first_layer`]
    /// (every layer and the multi-token-prediction layer last, but in a
    /// stage file); see [`Model::layer`].
    pub layers: Vec<LayerRefs>,
    /// The first layer of [`Model::layers`]: 0 but in a stage file.
    pub first_layer: usize,
    /// The multi-token-prediction layer's glue, when the file keeps one.
    pub mtp: Option<MtpRefs>,
    /// The layers this model runs: all of them, or one pipeline stage's.
    pub stage: stage::Stage,
    /// Source of the routed experts' weights.
    pub experts: Box<dyn ExpertStore>,
    /// Precomputed RoPE inverse frequencies and magnitude.
    pub rope: blocks::rope::Rope,
    /// The global attention layers' RoPE, when they have their own.
    pub global_rope: Option<blocks::rope::Rope>,
    /// The pooled layers' RoPE (DeepSeek-V4), when attention is pooled.
    pub pool_rope: Option<blocks::rope::Rope>,
    /// The hyper-connections' final collapse: `fn`, bias, scale.
    pub hc_head: Option<[TensorRef; 3]>,
    /// The dense weights copied out of the file (only when experts stream).
    dense: Option<DenseCopy>,
    /// Routing counters.
    pub(crate) telemetry: Telemetry,
    /// Where routing heat is saved (only when experts stream).
    heat: Option<HeatState>,
    /// Notes from opening (e.g. an ignored heat file).
    warnings: Vec<String>,
    /// Where the weights live (mapped, copied or streamed), and why.
    weights: WeightsBacking,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("file", &self.file.path()).finish_non_exhaustive()
    }
}

impl Model {
    /// Opens and validates a `.colibri` file, every expert resident.
    pub fn open(path: &Path) -> Result<Model> {
        Self::open_with(path, &StoreOptions::default())
    }

    /// Opens and validates a `.colibri` file, placing its routed experts as
    /// `opts` says (see [`StoreOptions`]): with a RAM budget smaller than the
    /// experts, the dense part is read into memory and experts stream from
    /// the file into a fixed pool of slots.
    pub fn open_with(path: &Path, opts: &StoreOptions) -> Result<Model> {
        let mut file = ColibriFile::open(path)?;
        let settled = store::settle_weights(&mut file, opts)?;
        let mut model = Self::from_file_with(Arc::new(file), opts)?;
        if let Some(w) = settled {
            model.weights = w;
        }
        Ok(model)
    }

    /// Builds the typed references over an already-validated file, every
    /// expert resident.
    pub fn from_file(file: Arc<ColibriFile>) -> Result<Model> {
        Self::from_file_with(file, &StoreOptions::default())
    }

    /// Builds the typed references over an already-validated file, placing
    /// the routed experts as `opts` says.
    pub fn from_file_with(file: Arc<ColibriFile>, opts: &StoreOptions) -> Result<Model> {
        let cfg = file.meta().config.clone();
        let r = |id: TensorId| tensor_ref(&file, id);
        let layer_norm = cfg.norm.kind == config::NormKind::Layer;
        let mut layers = Vec::with_capacity(cfg.layers.len());
        // A stage file holds its own layers only.
        let first_layer = file.part().map_or(0, |p| p.layers[0]);
        for (l, spec) in cfg.layers.iter().enumerate().filter(|(l, _)| file.holds_layer(*l)) {
            let t = |x| r(TensorId::Layer(l, x));
            let opt = |on: bool, x| if on { t(x).map(Some) } else { Ok(None) };
            let mlp = |g, u, d| -> Result<MlpRefs> { Ok(MlpRefs { gate: t(g)?, up: t(u)?, down: t(d)? }) };
            let norm = |w, b| -> Result<NormRefs> { Ok(NormRefs { w: t(w)?, b: opt(layer_norm, b)? }) };
            let moe = cfg.moe.as_ref();
            let has_shared = moe.and_then(|m| m.shared_expert.as_ref());
            let ffn = match spec.ffn {
                FfnSpec::None => FfnRefs::None,
                FfnSpec::Dense { .. } => FfnRefs::Dense(mlp(L::Gate, L::Up, L::Down)?),
                FfnSpec::Moe => FfnRefs::Moe {
                    router: t(L::Router)?,
                    router_bias: opt(moe.is_some_and(|m| m.router.bias), L::RouterBias)?,
                    correction: opt(
                        moe.is_some_and(|m| m.router.correction_bias && l >= m.hash_layers),
                        L::RouterCorrection,
                    )?,
                    shared: has_shared.map(|_| mlp(L::SharedGate, L::SharedUp, L::SharedDown)).transpose()?,
                    shared_gate: has_shared.filter(|s| s.sigmoid_gate).map(|_| t(L::SharedExpertGate)).transpose()?,
                    router_norm: opt(moe.is_some_and(|m| m.router.own_norm.is_some()), L::RouterNorm)?,
                    expert_scale: opt(moe.is_some_and(|m| m.router.expert_scale), L::RouterExpertScale)?,
                    branch_norms: match moe.is_some_and(|m| m.branch_norms) {
                        true => Some([t(L::MoeNorm)?, t(L::MoePostNorm)?, t(L::SharedPostNorm)?]),
                        false => None,
                    },
                    latent: match moe.is_some_and(|m| m.latent_dim.is_some()) {
                        true => Some([t(L::MoeLatentIn)?, t(L::MoeLatentOut)?]),
                        false => None,
                    },
                    hash_table: opt(moe.is_some_and(|m| l < m.hash_layers), L::HashTable)?,
                },
            };
            let pooled = matches!(spec.mixer, MixerSpec::Pooled { .. });
            let attends = spec.mixer != MixerSpec::Linear && !pooled;
            let qkv = match cfg.mla() {
                _ if pooled => {
                    use blocks::pooled::{PoolIndexRefs, PoolRefs, PooledRefs};
                    let pool = |kv, gate, bias, norm| -> Result<PoolRefs> {
                        Ok(PoolRefs { kv: t(kv)?, gate: t(gate)?, bias: t(bias)?, norm: t(norm)? })
                    };
                    let which = match spec.mixer {
                        MixerSpec::Pooled { pool } => pool,
                        _ => config::Pool::Window,
                    };
                    QkvRefs::Pooled(PooledRefs {
                        wq_a: t(L::WqA)?,
                        q_a_norm: t(L::QANorm)?,
                        wq_b: t(L::WqB)?,
                        wkv: t(L::Wkv)?,
                        kv_norm: t(L::KvNorm)?,
                        sinks: t(L::Sinks)?,
                        wo_a: t(L::WoA)?,
                        pool: match which {
                            config::Pool::Window => None,
                            _ => Some(pool(L::PoolKv, L::PoolGate, L::PoolBias, L::PoolNorm)?),
                        },
                        index: match which {
                            config::Pool::Light => Some(PoolIndexRefs {
                                pool: pool(L::IdxPoolKv, L::IdxPoolGate, L::IdxPoolBias, L::IdxPoolNorm)?,
                                wq: t(L::IdxWq)?,
                                weights: t(L::IdxWeights)?,
                            }),
                            _ => None,
                        },
                    })
                }
                _ if !attends => QkvRefs::Delta(DeltaRefs::load(cfg.linear.as_ref(), t)?),
                None => QkvRefs::Gqa {
                    wq: t(L::Wq)?,
                    wk: t(L::Wk)?,
                    wv: opt(!cfg.head_shape(l).values_from_keys, L::Wv)?,
                    index: match spec.mixer {
                        MixerSpec::Sparse { .. } => Some(BlockIndexRefs::load(t)?),
                        _ => None,
                    },
                },
                Some(m) => QkvRefs::Mla {
                    q: match m.q_lora_rank {
                        None => MlaQuery::Direct(t(L::Wq)?),
                        Some(_) => MlaQuery::LowRank(t(L::WqA)?, t(L::QANorm)?, t(L::WqB)?),
                    },
                    wkv_a: t(L::WkvA)?,
                    kv_a_norm: t(L::KvANorm)?,
                    wk_b: t(L::WkB)?,
                    wv_b: t(L::WvB)?,
                    index: match spec.mixer {
                        MixerSpec::Sparse { shared: true } => Some(IndexRefs::Shared),
                        MixerSpec::Sparse { shared: false } => Some(IndexRefs::Own(IndexerRefs::load(t)?)),
                        _ => None,
                    },
                },
            };
            layers.push(LayerRefs {
                attn_norm: norm(L::AttnNorm, L::AttnNormBias)?,
                qkv,
                wo: t(L::Wo)?,
                qkv_bias: if attends && cfg.attention.qkv_bias {
                    Some([t(L::Bq)?, t(L::Bk)?, t(L::Bv)?])
                } else {
                    None
                },
                o_bias: opt(attends && cfg.attention.o_bias, L::Bo)?,
                qk_norm: match cfg.attention.qk_norm {
                    _ if !attends => None,
                    config::QkNorm::None => None,
                    _ => Some([t(L::QNorm)?, t(L::KNorm)?]),
                },
                sinks: opt(attends && cfg.attention.sinks, L::Sinks)?,
                wg: opt(attends && cfg.attention.output_gate, L::Wg)?,
                bg: opt(attends && cfg.attention.output_gate && cfg.attention.qkv_bias, L::Bg)?,
                ffn_norm: if spec.ffn == FfnSpec::None { None } else { Some(norm(L::FfnNorm, L::FfnNormBias)?) },
                ffn,
                post_norms: match cfg.post_norms {
                    true => Some([t(L::AttnPostNorm)?, t(L::FfnPostNorm)?]),
                    false => None,
                },
                layer_scale: opt(cfg.layer_scale, L::LayerScale)?,
                hyper: match cfg.hyper {
                    Some(_) => Some([
                        [t(L::AttnHcFn)?, t(L::AttnHcBase)?, t(L::AttnHcScale)?],
                        [t(L::FfnHcFn)?, t(L::FfnHcBase)?, t(L::FfnHcScale)?],
                    ]),
                    None => None,
                },
            });
        }
        let mtp = match cfg.mtp {
            _ if file.part().is_some() => None,
            None => None,
            Some(_) => Some(MtpRefs {
                embed_norm: r(TensorId::Mtp(MtpTensor::EmbedNorm))?,
                hidden_norm: r(TensorId::Mtp(MtpTensor::HiddenNorm))?,
                proj: r(TensorId::Mtp(MtpTensor::Proj))?,
                out_norm: r(TensorId::Mtp(MtpTensor::OutNorm))?,
            }),
        };
        // A stage file holds the embedding and the head only when its stage uses them.
        let holds = |id: TensorId| file.part().is_none_or(|p| p.holds(&id, &cfg));
        let embed = holds(TensorId::Embed).then(|| r(TensorId::Embed)).transpose()?;
        let heads = holds(TensorId::FinalNorm);
        let lm_head = match cfg.tie_embeddings {
            _ if !heads => None,
            true => embed,
            false => Some(r(TensorId::LmHead)?),
        };
        let rope = blocks::rope::Rope::new(&cfg.rope);
        let global_rope = cfg.global_attention.as_ref().map(|g| blocks::rope::Rope::new(&g.rope));
        let pool_rope = cfg.pooled().map(|p| blocks::rope::Rope::new(&p.pool_rope));
        let hc_head = match cfg.hyper {
            Some(_) if heads => Some([r(TensorId::HcHeadFn)?, r(TensorId::HcHeadBase)?, r(TensorId::HcHeadScale)?]),
            _ => None,
        };
        let placed = store::place(&file, opts)?;
        let experts_per_layer = cfg.layers.iter().map(|l| match (&l.ffn, &cfg.moe) {
            (FfnSpec::Moe, Some(m)) => m.num_experts,
            _ => 0,
        });
        let weights = WeightsBacking {
            backing: if placed.dense.is_some() {
                "streamed"
            } else if file.is_copied() {
                "copied"
            } else {
                "mapped"
            },
            huge_pages: None,
            note: if placed.dense.is_some() {
                "streamed: the dense part copied, experts read into slots".into()
            } else {
                String::new()
            },
        };
        Ok(Model {
            weights,
            experts: placed.experts,
            dense: placed.dense,
            heat: placed.heat,
            warnings: placed.warnings,
            telemetry: Telemetry::new(experts_per_layer),
            final_norm: match heads {
                true => Some(NormRefs {
                    w: r(TensorId::FinalNorm)?,
                    b: if layer_norm { Some(r(TensorId::FinalNormBias)?) } else { None },
                }),
                false => None,
            },
            lm_head_bias: if cfg.lm_head_bias && heads { Some(r(TensorId::LmHeadBias)?) } else { None },
            embed,
            lm_head,
            layers,
            first_layer,
            mtp,
            stage: match file.part() {
                Some(p) => stage::Stage::new(&cfg, p.range())?,
                None => stage::Stage::whole(&cfg),
            },
            rope,
            global_rope,
            pool_rope,
            hc_head,
            config: cfg,
            file,
        })
    }

    /// The weights of decoder layer `l`, which this model must hold (every
    /// layer, but in a stage file; a stage runs only layers its file holds).
    #[inline]
    pub fn layer(&self, l: usize) -> &LayerRefs {
        &self.layers[l - self.first_layer]
    }

    /// The embedding matrix `[V, D]`; only a stage that embeds asks, and its
    /// file holds it.
    pub fn embedding(&self) -> TensorRef {
        self.embed.expect("a stage that embeds holds the embedding (checked at open)")
    }

    /// The final norm and output head; only a stage that computes logits
    /// asks, and its file holds them.
    pub fn head(&self) -> (NormRefs, TensorRef) {
        match (self.final_norm, self.lm_head) {
            (Some(n), Some(h)) => (n, h),
            _ => unreachable!("a stage that computes logits holds the head (checked at open)"),
        }
    }

    /// Makes this model one pipeline stage running only `layers` of its
    /// forward pass (see [`stage::Stage::new`] for what is refused). Only
    /// those layers' weights are ever read. Only a stage file's stage may
    /// stream its experts under a RAM budget.
    pub fn set_stage(&mut self, layers: std::ops::Range<usize>) -> Result<()> {
        let stage = stage::Stage::new(&self.config, layers)?;
        if let Some(p) = self.file.part()
            && (stage.layers.start < p.layers[0] || stage.layers.end > p.layers[1])
        {
            return Err(crate::error::Error::InvalidInput(format!(
                "stage layers {}..{}: {} is a stage file holding layers {}..{} only",
                stage.layers.start,
                stage.layers.end,
                self.file.path().display(),
                p.layers[0],
                p.layers[1]
            )));
        }
        // Streaming from the whole file would copy every layer's dense part
        // and spread the budget's slots over experts this stage never runs.
        if self.streams_experts() && !stage.is_whole() && self.file.part().is_none() {
            return Err(crate::error::Error::InvalidInput(
                "a pipeline stage of a whole model file keeps its experts resident: open it without a RAM \
                 budget, or cut the model into stage files (colibri split), whose stages can stream"
                    .into(),
            ));
        }
        self.stage = stage;
        Ok(())
    }

    /// Routing telemetry since open: per MoE layer and expert, how often it
    /// was chosen (heat), utilisation entropy, top-1/top-2 margins.
    pub fn routing_stats(&self) -> RoutingStats {
        let mut r = self.telemetry.snapshot();
        for l in &mut r.layers {
            self.experts.residency(l.layer, &mut l.residency, l.heat.len());
        }
        r
    }

    /// What the expert store did since open: hits, bytes read per token,
    /// prefetch accuracy, time waiting on I/O.
    pub fn store_stats(&self) -> StoreStats {
        let mut s = self.experts.stats();
        s.tokens = self.telemetry.tokens.load(std::sync::atomic::Ordering::Relaxed);
        s.bytes_read_per_token = store::telemetry::ratio(s.bytes_read, s.tokens);
        s.warnings.extend(self.warnings.iter().cloned());
        s.weights = self.weights.clone();
        s
    }

    /// Writes the routing heat (what the heat file held at open plus this
    /// run's counts) to the heat file, atomically. Returns its path, or
    /// `None` when there is nothing to save: experts do not stream, heat
    /// files are off, or no token has run. Also done when the model drops.
    pub fn save_heat(&self) -> Result<Option<PathBuf>> {
        let Some(h) = &self.heat else { return Ok(None) };
        let tokens = self.telemetry.tokens.load(std::sync::atomic::Ordering::Relaxed);
        if tokens == 0 {
            return Ok(None);
        }
        let (layers, experts) = (self.config.num_layers(), self.config.moe.as_ref().map_or(0, |m| m.num_experts));
        let mut heat = h.base.clone().unwrap_or_else(|| store::Heat::zeros(layers, experts));
        heat.tokens = heat.tokens.saturating_add(tokens);
        for (l, t) in self.telemetry.layers.iter().enumerate() {
            for e in 0..t.counts.len() {
                let c = &mut heat.counts[l * experts + e];
                *c = c.saturating_add(self.telemetry.count(l, e));
            }
        }
        store::heat::save_heat(&h.path, h.identity, &heat)?;
        Ok(Some(h.path.clone()))
    }

    /// True when routed experts stream from the file into a cache (a RAM
    /// budget): the dense weights are then a copy, not the file's bytes.
    pub fn streams_experts(&self) -> bool {
        self.dense.is_some()
    }

    /// True when any weight matrix is stored in a block-quantised type.
    pub fn has_block_weights(&self) -> bool {
        self.file.meta().tensors.iter().any(|t| t.dtype.is_quantized())
    }

    /// The underlying file.
    pub fn file(&self) -> &ColibriFile {
        &self.file
    }

    /// A weight matrix view (of a dense tensor: routed experts come from
    /// [`Model::experts`]).
    #[inline]
    pub fn mat(&self, t: TensorRef) -> Matrix<'_> {
        match &self.dense {
            Some(d) => d.matrix(&self.file, t),
            None => matrix(&self.file, t),
        }
    }

    /// The f32 vector view of an optional tensor.
    #[inline]
    pub fn opt_vec(&self, t: Option<TensorRef>) -> Option<&[f32]> {
        t.map(|t| self.vec(t))
    }

    /// An f32 vector view (norm scales, biases).
    #[inline]
    pub fn vec(&self, t: TensorRef) -> &[f32] {
        let m = self.mat(t);
        // Small tensors are f32 (checked by the reader) and 64-byte aligned.
        bytemuck::cast_slice(m.bytes)
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        // Persist what this run learnt about routing; failing to is not an
        // error of anything the caller asked for.
        if let Err(e) = self.save_heat() {
            eprintln!("colibri: warning: could not save routing heat: {e}");
        }
    }
}
