//! GLM-4.5 / 4.6 MoE (`Glm4MoeForCausalLM`; GLM-4.5-Air too), mirroring
//! transformers' `models/glm4_moe/modeling_glm4_moe.py`.
//!
//! Quirks:
//! - partial rotary: the first `head_dim · partial_rotary_factor` values of
//!   each head rotate (halves), the rest pass; the factor defaults to 0.5
//!   when config.json does not give one;
//! - `attention_bias` puts biases on q, k and v (never on o);
//! - `use_qk_norm`: RMSNorm on each head of q and k before RoPE;
//! - layers below `first_k_dense_replace` are dense; MoE layers add
//!   `n_shared_experts` shared experts (one ungated MLP);
//! - routing as DeepSeek-V3: sigmoid, choice on score + `e_score_correction_bias`
//!   within the `topk_group` best of `n_group` groups (sum of their two
//!   best), weights renormalised with `norm_topk_prob`, times
//!   `routed_scaling_factor`;
//! - the multi-token-prediction layers past `num_hidden_layers` are skipped.

use super::{Arch, HfConfig, Source, leading_dense_layers, llama_name, qwen_moe_name, shared_experts_name};
use crate::canonical::config::*;
use crate::canonical::tensors::TensorId;
use crate::error::Result;

pub static ARCH: Arch = Arch {
    hf_class: "Glm4MoeForCausalLM",
    model_type: "glm4_moe",
    config,
    source,
    ignored: super::deepseek::past_the_layers,
};

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let mut rope = c.rope(head_dim, 10000.0)?;
    let partial_given = c.get("partial_rotary_factor").is_some()
        || c.get("rope_parameters").and_then(|p| p.get("partial_rotary_factor")).is_some();
    if !partial_given {
        rope.rotary_dim = (head_dim / 2) & !1;
    }
    let e = c.usize(&["n_routed_experts", "num_local_experts", "num_experts"])?;
    let groups = match (c.opt_usize("n_group")?, c.opt_usize("topk_group")?) {
        (Some(g), Some(top)) if g > 1 => Some(GroupLimit { groups: g, top_groups: top, score: GroupScore::TopTwoSum }),
        _ => None,
    };
    let f = c.usize(&["moe_intermediate_size"])?;
    let shared = c.opt_usize("n_shared_experts")?.unwrap_or(0);
    let dense = c.opt_usize("first_k_dense_replace")?.unwrap_or(1);
    let dense_ffn = c.usize(&["intermediate_size"])?;
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(131072),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-5)),
        rope,
        attention: AttentionSpec {
            qkv_bias: c.bool_or("attention_bias", false)?,
            qk_norm: if c.bool_or("use_qk_norm", false)? { QkNorm::PerHead } else { QkNorm::None },
            ..Default::default()
        },
        moe: Some(MoeSpec {
            num_experts: e,
            expert_ffn_dim: f,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                score: RouterScore::Sigmoid,
                renormalize: c.bool_or("norm_topk_prob", true)?,
                scale: c.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32,
                correction_bias: true,
                groups,
                ..Default::default()
            },
            shared_expert: (shared > 0).then_some(SharedExpertSpec { ffn_dim: shared * f, sigmoid_gate: false }),
            ..Default::default()
        }),
        layers: leading_dense_layers(n, dense, dense_ffn),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

fn source(_: &HfConfig, _: &ModelConfig, id: TensorId) -> Source {
    Source::tensor(
        shared_experts_name(id)
            .or_else(|| qwen_moe_name(id))
            .or_else(|| llama_name(id))
            .unwrap_or_else(|| format!("<{id} has no GLM-4 MoE name>")),
    )
}
