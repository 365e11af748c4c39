//! Qwen2-MoE (`Qwen2MoeForCausalLM`), mirroring transformers'
//! `models/qwen2_moe/modeling_qwen2_moe.py`.
//!
//! Quirks:
//! - q, k and v projections carry biases (o does not);
//! - a shared expert (`mlp.shared_expert`) runs on every token, scaled by
//!   `sigmoid(mlp.shared_expert_gate · x)`;
//! - layers listed in `mlp_only_layers`, or not on the `decoder_sparse_step`
//!   grid, are dense MLPs of width `intermediate_size`; routed experts are
//!   `moe_intermediate_size` wide;
//! - softmax over all experts, top-k, renormalised only if `norm_topk_prob`;
//! - `sliding_window` only applies when `use_sliding_window` is true; then the
//!   layers marked `sliding_attention` in `layer_types` slide, or, without
//!   that list, the even-indexed layers below `max_window_layers`
//!   (transformers 5's `Qwen2MoeConfig.__post_init__`).

use super::{Arch, HfConfig, Source, layer_types, llama_name, qwen_moe_name, qwen_sparse_layers};
use crate::canonical::config::*;
use crate::canonical::tensors::TensorId;
use crate::error::Result;

pub static ARCH: Arch =
    Arch { hf_class: "Qwen2MoeForCausalLM", model_type: "qwen2_moe", config, source, ignored: super::nothing_ignored };

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let e = c.usize(&["num_experts", "num_local_experts"])?;
    let sparse = qwen_sparse_layers(c, n, e)?;
    let windows = qwen_windows(c, n)?;
    let shared = c.opt_usize("shared_expert_intermediate_size")?.filter(|&f| f > 0);
    let dense_ffn = c.usize(&["intermediate_size"])?;
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(8192),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6)),
        rope: c.rope(head_dim, 10000.0)?,
        attention: AttentionSpec { qkv_bias: true, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: e,
            expert_ffn_dim: c.usize(&["moe_intermediate_size"])?,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                renormalize: c.bool_or("norm_topk_prob", false)?,
                ..Default::default()
            },
            shared_expert: shared.map(|f| SharedExpertSpec { ffn_dim: f, sigmoid_gate: true }),
            ..Default::default()
        }),
        layers: (0..n)
            .map(|l| LayerSpec {
                mixer: MixerSpec::Attention { window: windows[l] },
                ffn: if sparse[l] { FfnSpec::Moe } else { FfnSpec::Dense { ffn_dim: dense_ffn } },
            })
            .collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

/// Per-layer window under Qwen2-MoE's rule (see the module note).
fn qwen_windows(c: &HfConfig, n: usize) -> Result<Vec<Option<usize>>> {
    let window = c.opt_usize("sliding_window")?.filter(|&w| w > 0);
    if !c.bool_or("use_sliding_window", false)? || window.is_none() {
        return Ok(vec![None; n]);
    }
    if let Some(types) = layer_types(c, n)? {
        return Ok(types.iter().map(|&slides| if slides { window } else { None }).collect());
    }
    let below = c.opt_usize("max_window_layers")?.unwrap_or(n);
    Ok((0..n).map(|l| if l % 2 == 0 && l < below { window } else { None }).collect())
}

fn source(_: &HfConfig, _: &ModelConfig, id: TensorId) -> Source {
    Source::tensor(hf_name(id))
}

fn hf_name(id: TensorId) -> String {
    qwen_moe_name(id).or_else(|| llama_name(id)).unwrap_or_else(|| format!("<{id} has no Qwen2-MoE name>"))
}
