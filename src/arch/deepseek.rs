//! DeepSeek-V2 (`DeepseekV2ForCausalLM`) and DeepSeek-V3 (`DeepseekV3ForCausalLM`;
//! DeepSeek-R1 and Kimi-K2 share its layout), mirroring transformers'
//! `models/deepseek_v2/modeling_deepseek_v2.py` and
//! `models/deepseek_v3/modeling_deepseek_v3.py`.
//!
//! Quirks:
//! - multi-head latent attention: q from `q_proj`, or `q_a_proj` → RMSNorm →
//!   `q_b_proj` with `q_lora_rank`; `kv_a_proj_with_mqa` gives the latent
//!   (`kv_lora_rank`, RMSNormed) and one rotated key shared by all heads
//!   (`qk_rope_head_dim`); `kv_b_proj` [H·(nope + v), R] holds each head's key
//!   and value up-projections, split here into the absorbed `wk_b` / `wv_b`;
//! - `config.json`'s `head_dim` is the rope width, not the q/k head width
//!   (nope + rope);
//! - the latent norms use eps 1e-6 whatever `rms_norm_eps` is;
//! - RoPE on the rope part only, adjacent pairs (V2 always; V3 when
//!   `rope_interleave`, the default);
//! - the score scale is 1/√(nope + rope), times mscale(factor,
//!   mscale_all_dim)² under YaRN when `mscale_all_dim` is set;
//! - layers below `first_k_dense_replace` are dense (`intermediate_size`);
//!   the MoE layers add `n_shared_experts` shared experts as one MLP of
//!   `n_shared_experts · moe_intermediate_size`, ungated;
//! - V2 routing: softmax, top-k (`greedy`) or within the `topk_group` best of
//!   `n_group` groups scored by their best expert (`group_limited_greedy`);
//!   never renormalised; times `routed_scaling_factor`;
//! - V3 routing: sigmoid; the choice adds `e_score_correction_bias` and keeps
//!   the `topk_group` groups with the best sum of their two best; weights
//!   are the plain sigmoid scores, renormalised with `norm_topk_prob`, times
//!   `routed_scaling_factor`;
//! - V3 checkpoints carry the multi-token-prediction layer(s) as
//!   `model.layers.{num_hidden_layers}..`; they are skipped.

use super::{Arch, HfConfig, Source, leading_dense_layers, llama_name, qwen_moe_name, shared_experts_name};
use crate::canonical::config::*;
use crate::canonical::tensors::{LayerTensor as L, TensorId};
use crate::error::{Error, Result};

/// DeepSeek-V2 and V2-Lite.
pub static V2: Arch = Arch {
    hf_class: "DeepseekV2ForCausalLM",
    model_type: "deepseek_v2",
    config: config_v2,
    source,
    ignored: past_the_layers,
};

/// DeepSeek-V3, R1, Kimi-K2.
pub static V3: Arch = Arch {
    hf_class: "DeepseekV3ForCausalLM",
    model_type: "deepseek_v3",
    config: config_v3,
    source,
    ignored: past_the_layers,
};

fn config_v2(c: &HfConfig) -> Result<ModelConfig> {
    let groups = match c.str("topk_method").unwrap_or("greedy") {
        "greedy" => None,
        "group_limited_greedy" => Some(GroupScore::Max),
        other => {
            return Err(Error::Unsupported(format!(
                "{}: topk_method \"{other}\" is not supported (greedy, group_limited_greedy)",
                c.path.display()
            )));
        }
    };
    let router = |k, groups| RouterSpec { top_k: k, groups, ..Default::default() };
    config(c, groups, router, true)
}

pub(crate) fn config_v3(c: &HfConfig) -> Result<ModelConfig> {
    let router = |k, groups| RouterSpec {
        top_k: k,
        score: RouterScore::Sigmoid,
        correction_bias: true,
        groups,
        ..Default::default()
    };
    let interleave = c.bool_or("rope_interleave", true)?;
    let mut cfg = config(c, Some(GroupScore::TopTwoSum), router, interleave)?;
    if let Some(m) = cfg.moe.as_mut() {
        m.router.renormalize = c.bool_or("norm_topk_prob", true)?;
    }
    Ok(cfg)
}

/// What V2 and V3 share (and V3.2 and GLM-5 build on); `router(top_k,
/// groups)` makes the family's router.
pub(crate) fn config(
    c: &HfConfig,
    group_score: Option<GroupScore>,
    router: fn(usize, Option<GroupLimit>) -> RouterSpec,
    interleave: bool,
) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    for key in ["attention_bias", "mlp_bias"] {
        if c.bool_or(key, false)? {
            return Err(Error::Unsupported(format!("{}: `{key}: true` is not supported", c.path.display())));
        }
    }
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let n = c.usize(&["num_hidden_layers"])?;
    let mla = mla_spec(c)?;
    let (dn, dr) = (mla.qk_nope_dim, mla.qk_rope_dim);
    let mut rope = c.rope(dr, 10000.0)?;
    rope.rotary_dim = dr;
    rope.interleaved = interleave;
    let mut scale = 1.0 / ((dn + dr) as f64).sqrt();
    if let RopeScaling::Yarn { factor, .. } = rope.scaling
        && let Some(all) = rope_param(c, "mscale_all_dim").filter(|&m| m != 0.0)
    {
        let m = if factor <= 1.0 { 1.0 } else { 0.1 * all * crate::math::ln(factor) + 1.0 };
        scale *= m * m;
    }
    let e = c.usize(&["n_routed_experts", "num_experts", "num_local_experts"])?;
    let k = c.usize(&["num_experts_per_tok"])?;
    let groups = match (group_score, c.opt_usize("n_group")?, c.opt_usize("topk_group")?) {
        (Some(score), Some(g), Some(top)) if g > 1 => Some(GroupLimit { groups: g, top_groups: top, score }),
        _ => None,
    };
    let mut router = router(k, groups);
    router.scale = c.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32;
    let f = c.usize(&["moe_intermediate_size"])?;
    let shared = c.opt_usize("n_shared_experts")?.unwrap_or(0);
    let dense = c.opt_usize("first_k_dense_replace")?.unwrap_or(0);
    let dense_ffn = c.usize(&["intermediate_size"])?;
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: h,
        head_dim: dn + dr,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(4096),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6)),
        rope,
        attention: AttentionSpec {
            kind: AttentionKind::Mla(mla),
            softmax_scale: Some(scale as f32),
            ..Default::default()
        },
        moe: Some(MoeSpec {
            num_experts: e,
            expert_ffn_dim: f,
            router,
            shared_expert: (shared > 0).then_some(SharedExpertSpec { ffn_dim: shared * f, sigmoid_gate: false }),
            ..Default::default()
        }),
        layers: leading_dense_layers(n, dense, dense_ffn),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

/// The latent attention of DeepSeek's config keys (also Kimi-Linear's);
/// the latent norms' eps is 1e-6 whatever `rms_norm_eps` says.
pub(crate) fn mla_spec(c: &HfConfig) -> Result<MlaSpec> {
    Ok(MlaSpec {
        q_lora_rank: c.opt_usize("q_lora_rank")?,
        kv_lora_rank: c.usize(&["kv_lora_rank"])?,
        qk_nope_dim: c.usize(&["qk_nope_head_dim"])?,
        qk_rope_dim: c.usize(&["qk_rope_head_dim"])?,
        v_head_dim: c.usize(&["v_head_dim"])?,
        latent_eps: 1e-6,
        indexer: None,
    })
}

/// A number from the rope parameters (transformers 5's `rope_parameters` or 4's `rope_scaling`).
fn rope_param(c: &HfConfig, key: &str) -> Option<f64> {
    ["rope_parameters", "rope_scaling"].iter().find_map(|k| c.get(k).and_then(|p| p.get(key)).and_then(|v| v.as_f64()))
}

pub(crate) fn source(_: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    let m = cfg.mla().expect("DeepSeek configs are MLA");
    let (dn, dv) = (m.qk_nope_dim, m.v_head_dim);
    let attn = |l: usize, n: &str| format!("model.layers.{l}.self_attn.{n}.weight");
    match id {
        TensorId::Layer(l, L::WqA) => Source::tensor(attn(l, "q_a_proj")),
        TensorId::Layer(l, L::QANorm) => Source::tensor(attn(l, "q_a_layernorm")),
        TensorId::Layer(l, L::WqB) => Source::tensor(attn(l, "q_b_proj")),
        TensorId::Layer(l, L::WkvA) => Source::tensor(attn(l, "kv_a_proj_with_mqa")),
        TensorId::Layer(l, L::KvANorm) => Source::tensor(attn(l, "kv_a_layernorm")),
        // kv_b_proj rows come per head as [nope keys; values]: the key rows of
        // each head, each block transposed to [R, nope], and the value rows.
        TensorId::Layer(l, L::WkB) => {
            Source { transpose_blocks: true, ..Source::tensor(attn(l, "kv_b_proj")).rows(dn + dv, 0, dn) }
        }
        TensorId::Layer(l, L::WvB) => Source::tensor(attn(l, "kv_b_proj")).rows(dn + dv, dn, dv),
        other => Source::tensor(
            shared_experts_name(other)
                .or_else(|| qwen_moe_name(other))
                .or_else(|| llama_name(other))
                .unwrap_or_else(|| format!("<{other} has no DeepSeek name>")),
        ),
    }
}

/// The multi-token-prediction layers past `num_hidden_layers`.
pub(crate) fn past_the_layers(c: &HfConfig, name: &str) -> bool {
    let n = c.opt_usize("num_hidden_layers").ok().flatten().unwrap_or(usize::MAX);
    name.strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|i| i.parse::<usize>().ok())
        .is_some_and(|i| i >= n)
}
