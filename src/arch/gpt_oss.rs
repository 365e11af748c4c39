//! GPT-OSS (`GptOssForCausalLM`), mirroring transformers'
//! `models/gpt_oss/modeling_gpt_oss.py` (and `integrations/mxfp4.py` for the
//! Hub's MXFP4 experts).
//!
//! Quirks:
//! - every attention head has a learned sink logit (`self_attn.sinks`) that
//!   joins the softmax denominator and contributes no value;
//! - `layer_types` alternates sliding (`sliding_window`) and full layers,
//!   sliding first when the list is absent;
//! - q, k, v and o carry biases (`attention_bias`, on by default); the router
//!   (`mlp.router`) too: top-k of its logits, then a softmax over the k;
//! - experts are stacked: `gate_up_proj` [E, D, 2F] with gate and up
//!   interleaved along the last axis (gate = even, up = odd), `down_proj`
//!   [E, F, D], both `x @ W` (so transposed here), with biases
//!   `gate_up_proj_bias` [E, 2F] and `down_proj_bias` [E, D];
//! - the Hub checkpoints store those two as MXFP4 (`*_blocks`, `*_scales`),
//!   which decode to [E, 2F, D] and [E, D, F], already `[out, in]`;
//! - the activation is the clamped SwiGLU: `g = min(gate, limit)`,
//!   `u = clamp(up, −limit, limit)`, `(u + 1) · g · σ(alpha · g)`;
//! - RoPE rotates halves; YaRN by default (factor 32, `truncate: false`).

use super::{Arch, HfConfig, Source, layer_types, llama_name};
use crate::canonical::config::*;
use crate::canonical::tensors::{ExpertTensor as X, LayerTensor as L, TensorId};
use crate::error::{Error, Result};

pub static ARCH: Arch =
    Arch { hf_class: "GptOssForCausalLM", model_type: "gpt_oss", config, source, ignored: super::nothing_ignored };

fn config(c: &HfConfig) -> Result<ModelConfig> {
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let window = c.opt_usize("sliding_window")?.filter(|&w| w > 0);
    let slides = layer_types(c, n)?.unwrap_or_else(|| (0..n).map(|l| l % 2 == 0).collect());
    let bias = c.bool_or("attention_bias", true)?;
    let alpha = c.opt_f64("swiglu_alpha")?.unwrap_or(1.702) as f32;
    let limit = c.opt_f64("swiglu_limit")?.unwrap_or(7.0) as f32;
    if !(limit > 0.0 && alpha.is_finite()) {
        return Err(Error::checkpoint(&c.path, format!("swiglu_limit {limit} / swiglu_alpha {alpha} out of range")));
    }
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(131072),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-5)),
        rope: c.rope(head_dim, 150000.0)?,
        attention: AttentionSpec { qkv_bias: bias, o_bias: bias, sinks: true, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: c.usize(&["num_local_experts", "num_experts"])?,
            expert_ffn_dim: c.usize(&["intermediate_size"])?,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                score: RouterScore::SoftmaxSelected,
                bias: true,
                ..Default::default()
            },
            activation: Activation::ClampedSwiglu { alpha, limit },
            expert_bias: true,
            ..Default::default()
        }),
        layers: slides
            .iter()
            .map(|&s| LayerSpec {
                mixer: MixerSpec::Attention { window: if s { window } else { None } },
                ffn: FfnSpec::Moe,
            })
            .collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

fn source(hf: &HfConfig, _: &ModelConfig, id: TensorId) -> Source {
    // MXFP4 experts decode to [out, in]; bf16 ones are stored [in, out].
    let mxfp4 = hf.quant_method() == Some("mxfp4");
    let expert = |l: usize, name: &str, e: usize| {
        let s = Source::expert(format!("model.layers.{l}.mlp.experts.{name}"), e);
        if mxfp4 { s } else { s.transposed() }
    };
    let bias = |l: usize, name: &str, e: usize| Source::expert(format!("model.layers.{l}.mlp.experts.{name}"), e);
    match id {
        TensorId::Layer(l, L::Router) => Source::tensor(format!("model.layers.{l}.mlp.router.weight")),
        TensorId::Layer(l, L::RouterBias) => Source::tensor(format!("model.layers.{l}.mlp.router.bias")),
        TensorId::Expert(l, e, X::Gate) => expert(l, "gate_up_proj", e).rows(2, 0, 1),
        TensorId::Expert(l, e, X::Up) => expert(l, "gate_up_proj", e).rows(2, 1, 1),
        TensorId::Expert(l, e, X::Down) => expert(l, "down_proj", e),
        TensorId::Expert(l, e, X::GateBias) => bias(l, "gate_up_proj_bias", e).rows(2, 0, 1),
        TensorId::Expert(l, e, X::UpBias) => bias(l, "gate_up_proj_bias", e).rows(2, 1, 1),
        TensorId::Expert(l, e, X::DownBias) => bias(l, "down_proj_bias", e),
        other => Source::tensor(llama_name(other).unwrap_or_else(|| format!("<{other} has no GPT-OSS name>"))),
    }
}
