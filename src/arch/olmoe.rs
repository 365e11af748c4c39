//! OLMoE (`OlmoeForCausalLM`), mirroring transformers'
//! `models/olmoe/modeling_olmoe.py`.
//!
//! Quirks:
//! - q_norm / k_norm are RMSNorms over the WHOLE projection (widths H·Dh and
//!   Hkv·Dh), applied before the reshape into heads and before RoPE;
//! - optional `clip_qkv` clamps q, k and v to [-c, c] right after projection;
//! - every layer is MoE; softmax over all experts, top-k, renormalised only
//!   if `norm_topk_prob` (false in the released checkpoints).

use super::{Arch, HfConfig, Source, llama_name, qwen_moe_name};
use crate::canonical::config::*;
use crate::canonical::tensors::TensorId;
use crate::error::Result;

pub static ARCH: Arch =
    Arch { hf_class: "OlmoeForCausalLM", model_type: "olmoe", config, source, ignored: super::nothing_ignored };

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let bias = c.bool_or("attention_bias", false)?;
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(4096),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-5)),
        rope: c.rope(head_dim, 10000.0)?,
        attention: AttentionSpec {
            qkv_bias: bias,
            o_bias: bias,
            qk_norm: QkNorm::Full,
            clip_qkv: c.opt_f64("clip_qkv")?.map(|x| x as f32),
            ..Default::default()
        },
        moe: Some(MoeSpec {
            num_experts: c.usize(&["num_experts", "num_local_experts"])?,
            expert_ffn_dim: c.usize(&["intermediate_size"])?,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                renormalize: c.bool_or("norm_topk_prob", false)?,
                ..Default::default()
            },
            ..Default::default()
        }),
        layers: (0..n).map(|_| LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe }).collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

fn source(_: &HfConfig, _: &ModelConfig, id: TensorId) -> Source {
    Source::tensor(hf_name(id))
}

fn hf_name(id: TensorId) -> String {
    qwen_moe_name(id).or_else(|| llama_name(id)).unwrap_or_else(|| format!("<{id} has no OLMoE name>"))
}
