//! Synthetic models: random `.colibri` files built without any checkpoint,
//! for tests (tiny configs with awkward sizes) and benchmarks (real MoE
//! widths, see `examples/decode.rs`).

use std::path::Path;

use crate::canonical::config::*;
use crate::canonical::tensors::{TensorId, tensor_plan};
use crate::format::writer::{ToPlace, Writer, layout};
use crate::format::{FileMeta, SourceInfo};
use crate::quant::{self, DType};

/// A small MoE config with awkward sizes: every feature of the canonical
/// config that the forward pass branches on is switched on somewhere.
pub fn tiny_config() -> ModelConfig {
    ModelConfig {
        vocab_size: 53,
        hidden_size: 22,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 6,
        max_seq_len: 64,
        norm: NormSpec::rms(1e-5),
        rope: RopeSpec { theta: 10000.0, rotary_dim: 6, scaling: RopeScaling::None, interleaved: false },
        attention: AttentionSpec { qkv_bias: true, qk_norm: QkNorm::PerHead, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: 5,
            expert_ffn_dim: 10,
            router: RouterSpec { top_k: 2, renormalize: true, ..Default::default() },
            shared_expert: Some(SharedExpertSpec { ffn_dim: 7, sigmoid_gate: true }),
            ..Default::default()
        }),
        layers: vec![
            LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
            LayerSpec { mixer: MixerSpec::Attention { window: Some(5) }, ffn: FfnSpec::Dense { ffn_dim: 9 } },
            LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
        ],
        ..Default::default()
    }
}

/// The same features with every matrix width a multiple of 32, so the
/// block-quantised types can store every matrix.
pub fn tiny_config_blocks() -> ModelConfig {
    let mut c = tiny_config();
    c.vocab_size = 61;
    c.hidden_size = 64;
    c.head_dim = 16;
    c.rope.rotary_dim = 16;
    if let Some(m) = c.moe.as_mut() {
        m.expert_ffn_dim = 96;
        if let Some(s) = m.shared_expert.as_mut() {
            s.ffn_dim = 32;
        }
    }
    c.layers[1].ffn = FfnSpec::Dense { ffn_dim: 64 };
    c
}

/// The config to test `dtype` with: block types need widths in whole blocks.
pub fn config_for(dtype: DType) -> ModelConfig {
    if dtype.is_quantized() { tiny_config_blocks() } else { tiny_config() }
}

/// Every switch the frontier families added, at once, in widths whole
/// blocks fit: MLA with a low-rank query and interleaved RoPE, attention
/// sinks, LayerNorm, residual/embedding/logit scales, an lm_head bias,
/// sigmoid routing with a correction bias and group limits, expert biases
/// and the clamped SwiGLU, a shared expert, a leading dense layer and a
/// sliding window. Not any real model: it exists to test invariants
/// (prefill = decode, thread count, placement) over the new code paths.
pub fn frontier_config() -> ModelConfig {
    let mla = MlaSpec {
        q_lora_rank: Some(32),
        kv_lora_rank: 32,
        qk_nope_dim: 32,
        qk_rope_dim: 16,
        v_head_dim: 16,
        latent_eps: 1e-6,
        indexer: None,
    };
    ModelConfig {
        vocab_size: 61,
        hidden_size: 64,
        num_heads: 4,
        num_kv_heads: 4,
        head_dim: 48,
        max_seq_len: 64,
        norm: NormSpec { eps: 1e-5, kind: NormKind::Layer },
        rope: RopeSpec { theta: 10000.0, rotary_dim: 16, scaling: RopeScaling::None, interleaved: true },
        attention: AttentionSpec {
            kind: AttentionKind::Mla(mla),
            sinks: true,
            softmax_scale: Some(0.2),
            ..Default::default()
        },
        moe: Some(MoeSpec {
            num_experts: 8,
            expert_ffn_dim: 32,
            router: RouterSpec {
                top_k: 3,
                score: RouterScore::Sigmoid,
                renormalize: true,
                renormalize_floor: 0.0,
                scale: 2.5,
                bias: true,
                correction_bias: true,
                groups: Some(GroupLimit { groups: 4, top_groups: 2, score: GroupScore::TopTwoSum }),
                ..Default::default()
            },
            activation: Activation::ClampedSwiglu { alpha: 1.702, limit: 1.5 },
            expert_bias: true,
            shared_expert: Some(SharedExpertSpec { ffn_dim: 32, sigmoid_gate: false }),
            ..Default::default()
        }),
        layers: vec![
            LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Dense { ffn_dim: 64 } },
            LayerSpec { mixer: MixerSpec::Attention { window: Some(5) }, ffn: FfnSpec::Moe },
            LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
        ],
        lm_head_bias: true,
        scales: Scales { embedding: 2.0, residual: 0.7, logits_divisor: 3.0 },
        ..Default::default()
    }
}

/// DeepSeek Sparse Attention over [`frontier_config`]: every layer sparse,
/// the middle one reusing the selection before it (GLM-5's IndexShare), an
/// indexer of 4 heads of 32 keeping 5 keys with its rope in pairs; so the
/// invariants (prefill = decode, chunks, threads, batching, rollback) are
/// tested past the point where queries select.
pub fn sparse_config() -> ModelConfig {
    let mut c = frontier_config();
    if let AttentionKind::Mla(m) = &mut c.attention.kind {
        m.indexer = Some(IndexerSpec {
            heads: 4,
            head_dim: 32,
            top_k: 5,
            rope_dim: m.qk_rope_dim,
            rope_interleaved: true,
            key_norm_eps: 1e-6,
        });
    }
    for (l, layer) in c.layers.iter_mut().enumerate() {
        layer.mixer = MixerSpec::Sparse { shared: l == 1 };
    }
    c
}

/// MiniMax Sparse Attention over [`tiny_config_blocks`]: two block-sparse
/// layers around a sliding one, a block indexer of 4 heads of 16 over the 2
/// kv heads keeping 3 blocks of 4 keys (its own and the best 2 others),
/// partial RoPE, the clamped SwiGLU in the dense layer and the experts, the
/// routed scale after the experts; so the invariants (prefill = decode,
/// chunks, threads, batching, rollback, stages) are tested past 12 keys,
/// where queries drop blocks.
pub fn block_sparse_config() -> ModelConfig {
    let mut c = tiny_config_blocks();
    c.rope.rotary_dim = 8;
    c.attention.block_index = Some(BlockIndexSpec { heads: 4, head_dim: 16, block: 4, top_blocks: 3, local_blocks: 1 });
    let act = Activation::ClampedSwiglu { alpha: 1.702, limit: 1.5 };
    if let Some(m) = c.moe.as_mut() {
        m.activation = act;
        m.router.score = RouterScore::Sigmoid;
        m.router.correction_bias = true;
        m.router.scale = 1.7;
        m.router.scale_output = true;
    }
    c.dense_activation = act;
    c.layers[0].mixer = MixerSpec::Sparse { shared: false };
    c.layers[2].mixer = MixerSpec::Sparse { shared: false };
    c
}

/// DeepSeek-V4's switches in small widths: pooled attention with a heavy
/// pool (8 tokens an entry), light pools (4 tokens, overlapping, an indexer
/// keeping 3 entries), a window-only layer and a window of 6; 3
/// hyper-connection streams; sqrt-softplus routing with a correction bias,
/// the first layer hash-routed; the clamped SwiGLU; a grouped output
/// projection. Prompts past a few dozen tokens exercise every piece.
pub fn pooled_config() -> ModelConfig {
    let yarn = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 16,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: 1.0,
        truncate: true,
    };
    let rope = |theta, scaling| RopeSpec { theta, rotary_dim: 8, scaling, interleaved: true };
    let pooled = PooledSpec {
        q_lora_rank: 12,
        rope_dim: 8,
        window: 6,
        o_groups: 2,
        o_lora_rank: 10,
        heavy_rate: 8,
        light_rate: 4,
        indexer: PoolIndexerSpec { heads: 3, head_dim: 10, top_k: 3 },
        pool_rope: rope(160000.0, yarn),
    };
    let pools = [Pool::Heavy, Pool::Light, Pool::Window, Pool::Light];
    ModelConfig {
        vocab_size: 57,
        hidden_size: 32,
        num_heads: 4,
        num_kv_heads: 1,
        head_dim: 16,
        max_seq_len: 400,
        norm: NormSpec::rms(1e-6),
        rope: rope(10000.0, RopeScaling::None),
        attention: AttentionSpec { sinks: true, kind: AttentionKind::Pooled(pooled), ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: 6,
            expert_ffn_dim: 20,
            router: RouterSpec {
                top_k: 2,
                score: RouterScore::SqrtSoftplus,
                renormalize: true,
                scale: 1.5,
                correction_bias: true,
                ..Default::default()
            },
            activation: Activation::ClampedSilu { limit: 0.8 },
            shared_expert: Some(SharedExpertSpec { ffn_dim: 20, sigmoid_gate: false }),
            hash_layers: 1,
            ..Default::default()
        }),
        layers: pools.iter().map(|&pool| LayerSpec { mixer: MixerSpec::Pooled { pool }, ffn: FfnSpec::Moe }).collect(),
        hyper: Some(HyperSpec { streams: 3, sinkhorn_iters: 5, eps: 1e-6 }),
        ..Default::default()
    }
}

/// A hybrid of linear-attention and gated full-attention layers in widths
/// whole blocks fit (Qwen3-Next's switches): Gated DeltaNet layers with two
/// value heads per key head and key and value heads of different widths,
/// attention with an output gate, per-head q/k norms and partial RoPE, a
/// shared expert with its gate and a dense layer among the MoE ones.
pub fn hybrid_config() -> ModelConfig {
    let mut c = tiny_config_blocks();
    c.attention = AttentionSpec { qkv_bias: true, qk_norm: QkNorm::PerHead, output_gate: true, ..Default::default() };
    c.rope.rotary_dim = 4;
    c.linear = Some(LinearSpec {
        kind: LinearKind::GatedDeltaNet,
        k_heads: 2,
        v_heads: 4,
        k_head_dim: 16,
        v_head_dim: 8,
        conv_kernel: 4,
    });
    c.layers = vec![
        LayerSpec { mixer: MixerSpec::Linear, ffn: FfnSpec::Moe },
        LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
        LayerSpec { mixer: MixerSpec::Linear, ffn: FfnSpec::Dense { ffn_dim: 64 } },
        LayerSpec { mixer: MixerSpec::Linear, ffn: FfnSpec::Moe },
        LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
    ];
    c
}

/// Kimi-Linear's switches on the frontier config: Kimi delta attention
/// layers (a decay per key channel, low-rank gates) between layers of latent
/// attention without RoPE.
pub fn kda_hybrid_config() -> ModelConfig {
    let mut c = frontier_config();
    c.attention.no_rope = true;
    c.linear = Some(LinearSpec {
        kind: LinearKind::Kda { gate_rank: 16 },
        k_heads: 3,
        v_heads: 3,
        k_head_dim: 16,
        v_head_dim: 16,
        conv_kernel: 3,
    });
    c.layers = vec![
        LayerSpec { mixer: MixerSpec::Linear, ffn: FfnSpec::Dense { ffn_dim: 64 } },
        LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
        LayerSpec { mixer: MixerSpec::Linear, ffn: FfnSpec::Moe },
        LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
    ];
    c
}

/// Nemotron-H's switches in widths whole blocks fit: Mamba2 layers (two
/// groups of three heads, a floored time step), GQA without RoPE, non-gated
/// relu² experts in a latent width, dense MLP and shared expert, a layer
/// without FFN, and a sigmoid router with groups and a correction bias.
pub fn mamba_hybrid_config() -> ModelConfig {
    let mut c = tiny_config_blocks();
    c.attention = AttentionSpec { no_rope: true, ..Default::default() };
    c.linear = Some(LinearSpec {
        kind: LinearKind::Mamba2 { dt_min: 0.05 },
        k_heads: 2,
        v_heads: 6,
        k_head_dim: 16,
        v_head_dim: 8,
        conv_kernel: 4,
    });
    c.dense_activation = Activation::Relu2;
    if let Some(m) = c.moe.as_mut() {
        m.activation = Activation::Relu2;
        m.router = RouterSpec {
            score: RouterScore::Sigmoid,
            renormalize: true,
            scale: 2.5,
            correction_bias: true,
            groups: Some(GroupLimit { groups: 3, top_groups: 2, score: GroupScore::TopTwoSum }),
            top_k: 3,
            ..Default::default()
        };
        m.num_experts = 6;
        m.latent_dim = Some(32);
        m.shared_expert = Some(SharedExpertSpec { ffn_dim: 64, sigmoid_gate: false });
        m.expert_bias = false;
    }
    c.layers = vec![
        LayerSpec { mixer: MixerSpec::Linear, ffn: FfnSpec::Moe },
        LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
        LayerSpec { mixer: MixerSpec::Linear, ffn: FfnSpec::None },
        LayerSpec { mixer: MixerSpec::Linear, ffn: FfnSpec::Dense { ffn_dim: 64 } },
        LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
    ];
    c
}

/// Gemma 4's switches in widths whole blocks fit: sliding layers and global
/// layers of their own head width and kv heads whose values are their keys,
/// proportional RoPE, a weightless value norm and attention scale 1, post
/// norms, a GeGLU shared expert beside the experts with branch norms, a
/// router with its own norm and per-expert scales, layer scales, an
/// embedding scale and a logit soft-cap.
pub fn gemma4_config() -> ModelConfig {
    let mut c = tiny_config_blocks();
    c.attention =
        AttentionSpec { qk_norm: QkNorm::PerHead, softmax_scale: Some(1.0), value_norm: true, ..Default::default() };
    let proportional = RopeScaling::Proportional { factor: 1.0, angles: 4 };
    c.global_attention = Some(GlobalAttentionSpec {
        head_dim: 32,
        num_kv_heads: 1,
        rope: RopeSpec { theta: 1e6, rotary_dim: 32, scaling: proportional, interleaved: false },
        values_from_keys: true,
    });
    if let Some(m) = c.moe.as_mut() {
        m.activation = Activation::GeluTanh;
        m.router.own_norm = Some(0.125);
        m.router.expert_scale = true;
        m.branch_norms = true;
        if let Some(s) = m.shared_expert.as_mut() {
            s.sigmoid_gate = false;
        }
    }
    let sliding = LayerSpec { mixer: MixerSpec::Attention { window: Some(5) }, ffn: FfnSpec::Moe };
    let global = LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe };
    c.layers = vec![sliding.clone(), sliding.clone(), global.clone(), sliding, global];
    c.scales.embedding = 8.0;
    c.logit_softcap = Some(5.0);
    c.post_norms = true;
    c.layer_scale = true;
    c
}

/// More experts than the tiny configs (3 MoE layers of 16, top-3, a dense
/// layer between them, a shared expert), every width a multiple of 32 so
/// every dtype applies: small enough for tests, large enough that a budget of
/// 10% of the experts still holds the K + 1 the store needs.
pub fn many_experts_config() -> ModelConfig {
    let mut c = tiny_config_blocks();
    if let Some(m) = c.moe.as_mut() {
        m.num_experts = 16;
        m.expert_ffn_dim = 32;
        m.router.top_k = 3;
    }
    c.layers = vec![
        LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
        LayerSpec { mixer: MixerSpec::Attention { window: Some(5) }, ffn: FfnSpec::Moe },
        LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Dense { ffn_dim: 64 } },
        LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe },
    ];
    c
}

/// Writes a `.colibri` file for `cfg` with deterministic pseudo-random weights.
///
/// # Panics
/// On any I/O error: this is a test and benchmark helper.
pub fn write_random_model(path: &Path, cfg: &ModelConfig, dtype: DType, seed: u64) -> FileMeta {
    let plan = tensor_plan(cfg);
    let items: Vec<ToPlace> = plan
        .iter()
        .map(|p| ToPlace {
            name: p.id.to_string(),
            dtype: crate::convert::storage_dtype(p.role, dtype, &p.shape),
            shape: p.shape.clone(),
            expert: match p.id {
                TensorId::Expert(l, e, _) => Some((l, e)),
                _ => None,
            },
        })
        .collect();
    let (tensors, experts) = layout(&items).unwrap();
    let meta = FileMeta {
        architecture: "TestForCausalLM".into(),
        config: cfg.clone(),
        weight_dtype: dtype,
        recipe: None,
        source: SourceInfo::default(),
        tensors,
        experts,
        part: None,
    };
    let mut w = Writer::create(path, &meta).unwrap();
    let mut s = seed.wrapping_mul(2862933555777941757).wrapping_add(3037000493);
    let mut vals: Vec<f32> = Vec::new();
    let mut buf: Vec<u16> = Vec::new();
    for (p, e) in plan.iter().zip(&meta.tensors) {
        let n: usize = p.shape.iter().product();
        let fan_in = *p.shape.last().unwrap() as f32;
        let is_norm = p.shape.len() == 1 && !e.name.contains(".b");
        vals.clear();
        if let TensorId::Layer(_, crate::canonical::tensors::LayerTensor::HashTable) = p.id {
            // Each token's experts: distinct ids.
            let (k, experts) = (p.shape[1], cfg.moe.as_ref().map_or(1, |m| m.num_experts));
            vals.extend((0..n).map(|i| ((i / k * 5 + i % k) % experts) as f32));
        }
        let fill = vals.is_empty();
        vals.extend((0..if fill { n } else { 0 }).map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if is_norm {
                1.0 + 0.3 * u
            } else if p.id == TensorId::Embed {
                u
            } else {
                u * 2.0 / fan_in.sqrt()
            }
        }));
        buf.resize((e.nbytes as usize).div_ceil(2), 0);
        let bytes = &mut bytemuck::cast_slice_mut::<u16, u8>(&mut buf)[..e.nbytes as usize];
        quant::encode(e.dtype, &vals, *e.shape.last().unwrap_or(&1), bytes);
        w.begin(&e.name).unwrap();
        w.write(bytes).unwrap();
        w.end();
    }
    w.finish().unwrap();
    meta
}

/// OLMoE-1B-7B widths with `layers` decoder layers (hidden 2048, 16 heads of
/// 128, 64 experts of width 1024, top-8, vocabulary 50304).
pub fn olmoe_width(layers: usize) -> ModelConfig {
    ModelConfig {
        vocab_size: 50304,
        hidden_size: 2048,
        num_heads: 16,
        num_kv_heads: 16,
        head_dim: 128,
        max_seq_len: 4096,
        norm: NormSpec::rms(1e-5),
        rope: RopeSpec { theta: 10000.0, rotary_dim: 128, scaling: RopeScaling::None, interleaved: false },
        attention: AttentionSpec { qk_norm: QkNorm::Full, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: 64,
            expert_ffn_dim: 1024,
            router: RouterSpec { top_k: 8, ..Default::default() },
            ..Default::default()
        }),
        layers: vec![LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe }; layers],
        ..Default::default()
    }
}

/// Qwen3-30B-A3B widths with `layers` decoder layers (hidden 2048, GQA 32/4
/// heads of 128, 128 experts of width 768, top-8, vocabulary 151936).
pub fn qwen3_30b_width(layers: usize) -> ModelConfig {
    ModelConfig {
        vocab_size: 151936,
        hidden_size: 2048,
        num_heads: 32,
        num_kv_heads: 4,
        head_dim: 128,
        max_seq_len: 4096,
        norm: NormSpec::rms(1e-6),
        rope: RopeSpec { theta: 1e6, rotary_dim: 128, scaling: RopeScaling::None, interleaved: false },
        attention: AttentionSpec { qk_norm: QkNorm::PerHead, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: 128,
            expert_ffn_dim: 768,
            router: RouterSpec { top_k: 8, renormalize: true, ..Default::default() },
            ..Default::default()
        }),
        layers: vec![LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe }; layers],
        ..Default::default()
    }
}

/// DeepSeek-V2-Lite widths with `layers` decoder layers (hidden 2048, MLA with
/// latent 512 + rope 64, 16 heads of nope 128 / v 128, no query low rank; a
/// dense first layer of 10944, then 64 experts of 1408, top-6, 2 shared;
/// vocabulary 102400).
pub fn deepseek_v2_lite_width(layers: usize) -> ModelConfig {
    let mla = MlaSpec {
        q_lora_rank: None,
        kv_lora_rank: 512,
        qk_nope_dim: 128,
        qk_rope_dim: 64,
        v_head_dim: 128,
        latent_eps: 1e-6,
        indexer: None,
    };
    ModelConfig {
        vocab_size: 102400,
        hidden_size: 2048,
        num_heads: 16,
        num_kv_heads: 16,
        head_dim: 192,
        max_seq_len: 4096,
        norm: NormSpec::rms(1e-6),
        rope: RopeSpec { theta: 10000.0, rotary_dim: 64, scaling: RopeScaling::None, interleaved: true },
        attention: AttentionSpec { kind: AttentionKind::Mla(mla), ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: 64,
            expert_ffn_dim: 1408,
            router: RouterSpec { top_k: 6, ..Default::default() },
            shared_expert: Some(SharedExpertSpec { ffn_dim: 2816, sigmoid_gate: false }),
            ..Default::default()
        }),
        layers: (0..layers)
            .map(|l| LayerSpec {
                mixer: MixerSpec::FULL_ATTENTION,
                ffn: if l == 0 { FfnSpec::Dense { ffn_dim: 10944 } } else { FfnSpec::Moe },
            })
            .collect(),
        ..Default::default()
    }
}

/// GPT-OSS-20B widths with `layers` decoder layers (hidden 2880, 64/8 heads of
/// 64 with sinks, sliding window 128 on even layers, 32 experts of 2880,
/// top-4, biases everywhere, clamped SwiGLU; vocabulary 201088).
pub fn gpt_oss_20b_width(layers: usize) -> ModelConfig {
    ModelConfig {
        vocab_size: 201088,
        hidden_size: 2880,
        num_heads: 64,
        num_kv_heads: 8,
        head_dim: 64,
        max_seq_len: 4096,
        norm: NormSpec::rms(1e-5),
        rope: RopeSpec { theta: 150000.0, rotary_dim: 64, scaling: RopeScaling::None, interleaved: false },
        attention: AttentionSpec { qkv_bias: true, o_bias: true, sinks: true, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: 32,
            expert_ffn_dim: 2880,
            router: RouterSpec { top_k: 4, score: RouterScore::SoftmaxSelected, bias: true, ..Default::default() },
            activation: Activation::ClampedSwiglu { alpha: 1.702, limit: 7.0 },
            expert_bias: true,
            ..Default::default()
        }),
        layers: (0..layers)
            .map(|l| LayerSpec {
                mixer: MixerSpec::Attention { window: (l % 2 == 0).then_some(128) },
                ffn: FfnSpec::Moe,
            })
            .collect(),
        ..Default::default()
    }
}
