//! Granite-MoE (`GraniteMoeForCausalLM`), mirroring transformers'
//! `models/granitemoe/modeling_granitemoe.py`.
//!
//! Quirks:
//! - the embedding is multiplied by `embedding_multiplier`, each block's
//!   output by `residual_multiplier` before its residual add, and the logits
//!   divided by `logits_scaling`;
//! - the attention score scale is `attention_multiplier`, not 1/√Dh;
//! - experts are stacked: `block_sparse_moe.input_linear` [E, 2F, D] holds
//!   gate (first F rows) and up (last F), `output_linear` [E, D, F] the down
//!   projections; the router is `block_sparse_moe.router.layer`;
//! - routing: top-k of the logits, then a softmax over the k.

use super::{Arch, HfConfig, Source, llama_name};
use crate::canonical::config::*;
use crate::canonical::tensors::{ExpertTensor as X, LayerTensor as L, TensorId};
use crate::error::Result;

pub static ARCH: Arch = Arch {
    hf_class: "GraniteMoeForCausalLM",
    model_type: "granitemoe",
    config,
    source,
    ignored: super::nothing_ignored,
};

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let mult = |k: &str| -> Result<f32> { Ok(c.opt_f64(k)?.unwrap_or(1.0) as f32) };
    let bias = c.bool_or("attention_bias", false)?;
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(4096),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6)),
        rope: c.rope(head_dim, 10000.0)?,
        attention: AttentionSpec {
            qkv_bias: bias,
            o_bias: bias,
            softmax_scale: Some(mult("attention_multiplier")?),
            ..Default::default()
        },
        moe: Some(MoeSpec {
            num_experts: c.usize(&["num_local_experts", "num_experts"])?,
            expert_ffn_dim: c.usize(&["intermediate_size"])?,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                score: RouterScore::SoftmaxSelected,
                ..Default::default()
            },
            ..Default::default()
        }),
        layers: (0..n).map(|_| LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe }).collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        scales: Scales {
            embedding: mult("embedding_multiplier")?,
            residual: mult("residual_multiplier")?,
            logits_divisor: mult("logits_scaling")?,
        },
        ..Default::default()
    })
}

fn source(_: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    let f = cfg.moe.as_ref().map_or(0, |m| m.expert_ffn_dim);
    let moe = |l: usize, n: &str| format!("model.layers.{l}.block_sparse_moe.{n}.weight");
    match id {
        TensorId::Layer(l, L::Router) => Source::tensor(moe(l, "router.layer")),
        TensorId::Expert(l, e, X::Gate) => Source::expert(moe(l, "input_linear"), e).rows(2 * f, 0, f),
        TensorId::Expert(l, e, X::Up) => Source::expert(moe(l, "input_linear"), e).rows(2 * f, f, f),
        TensorId::Expert(l, e, X::Down) => Source::expert(moe(l, "output_linear"), e),
        other => Source::tensor(llama_name(other).unwrap_or_else(|| format!("<{other} has no Granite-MoE name>"))),
    }
}
