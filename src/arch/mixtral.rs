//! Mixtral (`MixtralForCausalLM`), mirroring transformers'
//! `models/mixtral/modeling_mixtral.py`.
//!
//! Quirks:
//! - the MoE block is `block_sparse_moe`; experts are `w1` (gate), `w3` (up),
//!   `w2` (down), and the router is `block_sparse_moe.gate`;
//! - routing is softmax over all experts, top-k, renormalised over the k
//!   (equal to a softmax over the k chosen logits);
//! - every layer is MoE; no biases, no q/k norm;
//! - `sliding_window` (null in the released checkpoints) masks every layer.

use super::{Arch, HfConfig, Source, expert_part, llama_name};
use crate::canonical::config::*;
use crate::canonical::tensors::{LayerTensor, TensorId};
use crate::error::Result;

pub static ARCH: Arch =
    Arch { hf_class: "MixtralForCausalLM", model_type: "mixtral", config, source, ignored: super::nothing_ignored };

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let window = c.opt_usize("sliding_window")?;
    let n = c.usize(&["num_hidden_layers"])?;
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(32768),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-5)),
        rope: c.rope(head_dim, 1e6)?,
        moe: Some(MoeSpec {
            num_experts: c.usize(&["num_local_experts", "num_experts"])?,
            expert_ffn_dim: c.usize(&["intermediate_size"])?,
            router: RouterSpec { top_k: c.usize(&["num_experts_per_tok"])?, renormalize: true, ..Default::default() },
            ..Default::default()
        }),
        layers: (0..n).map(|_| LayerSpec { mixer: MixerSpec::Attention { window }, ffn: FfnSpec::Moe }).collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

fn source(_: &HfConfig, _: &ModelConfig, id: TensorId) -> Source {
    Source::tensor(hf_name(id))
}

fn hf_name(id: TensorId) -> String {
    match id {
        TensorId::Layer(l, LayerTensor::Router) => format!("model.layers.{l}.block_sparse_moe.gate.weight"),
        TensorId::Expert(l, e, t) => {
            let (w, kind) = expert_part(t, ["w1", "w3", "w2"]);
            format!("model.layers.{l}.block_sparse_moe.experts.{e}.{w}.{kind}")
        }
        other => llama_name(other).unwrap_or_else(|| format!("<{other} has no Mixtral name>")),
    }
}
