//! Qwen3-MoE (`Qwen3MoeForCausalLM`), mirroring transformers'
//! `models/qwen3_moe/modeling_qwen3_moe.py`.
//!
//! Quirks:
//! - RMSNorm on each head of q and k (`self_attn.q_norm` / `k_norm`, width
//!   head_dim) after projection, before RoPE;
//! - `head_dim` is explicit and need not equal hidden / heads;
//! - `attention_bias` switches q/k/v/o biases (off in released checkpoints);
//! - no shared expert; `mlp_only_layers` / `decoder_sparse_step` as Qwen2-MoE;
//! - softmax over all experts, top-k, renormalised if `norm_topk_prob`;
//! - `sliding_window` applies only when `use_sliding_window` is true, and then
//!   to every layer (or to those `layer_types` marks `sliding_attention`).

use super::{Arch, HfConfig, Source, layer_types, llama_name, qwen_moe_name, qwen_sparse_layers};
use crate::canonical::config::*;
use crate::canonical::tensors::TensorId;
use crate::error::Result;

pub static ARCH: Arch =
    Arch { hf_class: "Qwen3MoeForCausalLM", model_type: "qwen3_moe", config, source, ignored: super::nothing_ignored };

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let e = c.usize(&["num_experts", "num_local_experts"])?;
    let sparse = qwen_sparse_layers(c, n, e)?;
    let windows = qwen_windows(c, n)?;
    let bias = c.bool_or("attention_bias", false)?;
    let dense_ffn = c.opt_usize("intermediate_size")?.unwrap_or(0);
    let layers = (0..n)
        .map(|l| LayerSpec {
            mixer: MixerSpec::Attention { window: windows[l] },
            ffn: if sparse[l] { FfnSpec::Moe } else { FfnSpec::Dense { ffn_dim: dense_ffn } },
        })
        .collect();
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(32768),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6)),
        rope: c.rope(head_dim, 10000.0)?,
        attention: AttentionSpec { qkv_bias: bias, o_bias: bias, qk_norm: QkNorm::PerHead, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: e,
            expert_ffn_dim: c.usize(&["moe_intermediate_size"])?,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                renormalize: c.bool_or("norm_topk_prob", false)?,
                ..Default::default()
            },
            ..Default::default()
        }),
        layers,
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

fn source(_: &HfConfig, _: &ModelConfig, id: TensorId) -> Source {
    Source::tensor(hf_name(id))
}

fn hf_name(id: TensorId) -> String {
    qwen_moe_name(id).or_else(|| llama_name(id)).unwrap_or_else(|| format!("<{id} has no Qwen3-MoE name>"))
}

/// Per-layer window: every layer (or those `layer_types` marks) when
/// `use_sliding_window` is on, none otherwise.
fn qwen_windows(c: &HfConfig, n: usize) -> Result<Vec<Option<usize>>> {
    let window = c.opt_usize("sliding_window")?.filter(|&w| w > 0);
    if !c.bool_or("use_sliding_window", false)? || window.is_none() {
        return Ok(vec![None; n]);
    }
    Ok(match layer_types(c, n)? {
        Some(types) => types.iter().map(|&slides| if slides { window } else { None }).collect(),
        None => vec![window; n],
    })
}
