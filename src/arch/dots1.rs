//! dots.llm1 (`Dots1ForCausalLM`), mirroring transformers'
//! `models/dots1/modeling_dots1.py`: Qwen3's attention in front of
//! DeepSeek-V3's MoE block.
//!
//! Quirks:
//! - attention as Qwen3: RMSNorm on each head of q and k (`rms_norm_eps`)
//!   before RoPE; `attention_bias` puts biases on q, k, v *and* o; the head
//!   width is `head_dim` when given, else hidden / heads;
//! - sliding windows follow `layer_types` when given; without it, every layer
//!   from `max_window_layers` on slides whenever `sliding_window` is set —
//!   `use_sliding_window` is never read (unlike Qwen2/Qwen3, where it gates
//!   the window);
//! - layers below `first_k_dense_replace` (default 0) are dense
//!   (`intermediate_size`); the MoE layers add `n_shared_experts` shared
//!   experts as one ungated MLP of `n_shared_experts · moe_intermediate_size`;
//! - routing as DeepSeek-V3: sigmoid scores, the choice adds
//!   `e_score_correction_bias` within the `topk_group` best of `n_group`
//!   groups (sum of their two best), weights are the plain sigmoid scores,
//!   renormalised only with `norm_topk_prob` (default false), times
//!   `routed_scaling_factor`.

use super::{
    Arch, HfConfig, Source, layer_types, leading_dense_layers, llama_name, qwen_moe_name, shared_experts_name,
};
use crate::canonical::config::*;
use crate::canonical::tensors::TensorId;
use crate::error::Result;

pub static ARCH: Arch =
    Arch { hf_class: "Dots1ForCausalLM", model_type: "dots1", config, source, ignored: super::nothing_ignored };

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let bias = c.bool_or("attention_bias", false)?;
    let e = c.usize(&["n_routed_experts", "num_local_experts"])?;
    let groups = match (c.opt_usize("n_group")?, c.opt_usize("topk_group")?) {
        (Some(g), Some(top)) if g > 1 => Some(GroupLimit { groups: g, top_groups: top, score: GroupScore::TopTwoSum }),
        _ => None,
    };
    let f = c.usize(&["moe_intermediate_size"])?;
    let shared = c.opt_usize("n_shared_experts")?.unwrap_or(0);
    let dense = c.opt_usize("first_k_dense_replace")?.unwrap_or(0);
    let mut layers = leading_dense_layers(n, dense, c.usize(&["intermediate_size"])?);
    for (layer, window) in layers.iter_mut().zip(windows(c, n)?) {
        layer.mixer = MixerSpec::Attention { window };
    }
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(2048),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6)),
        rope: c.rope(head_dim, 10000.0)?,
        attention: AttentionSpec { qkv_bias: bias, o_bias: bias, qk_norm: QkNorm::PerHead, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: e,
            expert_ffn_dim: f,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                score: RouterScore::Sigmoid,
                renormalize: c.bool_or("norm_topk_prob", false)?,
                scale: c.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32,
                correction_bias: true,
                groups,
                ..Default::default()
            },
            shared_expert: (shared > 0).then_some(SharedExpertSpec { ffn_dim: shared * f, sigmoid_gate: false }),
            ..Default::default()
        }),
        layers,
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

/// Per-layer window: the `layer_types` that slide, else every layer from
/// `max_window_layers` on (default: none) when `sliding_window` is set.
fn windows(c: &HfConfig, n: usize) -> Result<Vec<Option<usize>>> {
    let window = c.opt_usize("sliding_window")?.filter(|&w| w > 0);
    let slides = match layer_types(c, n)? {
        Some(types) => types,
        None => {
            let from = c.opt_usize("max_window_layers")?.unwrap_or(n);
            (0..n).map(|l| l >= from).collect()
        }
    };
    Ok(slides.into_iter().map(|s| if s { window } else { None }).collect())
}

fn source(_: &HfConfig, _: &ModelConfig, id: TensorId) -> Source {
    Source::tensor(
        shared_experts_name(id)
            .or_else(|| qwen_moe_name(id))
            .or_else(|| llama_name(id))
            .unwrap_or_else(|| format!("<{id} has no dots1 name>")),
    )
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn windows_of(extra: &str) -> Vec<Option<usize>> {
        let text = format!(r#"{{"num_hidden_layers": 4 {extra}}}"#);
        windows(&HfConfig::parse(Path::new("config.json"), &text).unwrap(), 4).unwrap()
    }

    #[test]
    fn windows_follow_max_window_layers_whatever_use_sliding_window_says() {
        assert_eq!(windows_of(""), [None; 4]);
        assert_eq!(windows_of(r#", "sliding_window": 8"#), [None; 4]);
        let late = windows_of(r#", "sliding_window": 8, "max_window_layers": 2, "use_sliding_window": false"#);
        assert_eq!(late, [None, None, Some(8), Some(8)]);
        let listed = windows_of(
            r#", "sliding_window": 8, "max_window_layers": 0,
            "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]"#,
        );
        assert_eq!(listed, [None, Some(8), None, Some(8)]);
    }
}
