//! Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5/3.6/3.8-MoE
//! (`Qwen3_5MoeForCausalLM`, and `Qwen3_5MoeForConditionalGeneration` as the
//! Hub ships it), mirroring transformers' `models/qwen3_next` and
//! `models/qwen3_5_moe`: hybrids of Gated DeltaNet and gated full-attention
//! layers (three to one on the released models).
//!
//! Quirks:
//! - `layer_types` lists `linear_attention` / `full_attention` per layer;
//!   without it, every `full_attention_interval`-th layer (default 4) attends;
//! - every RMSNorm of the residual stream and of q/k scales by `1 + w`
//!   (weights stored zero-centred): the converter stores `1 + w`, computed in
//!   f32 as transformers does, so the engine's norm is the ordinary one. The
//!   linear layers' gated output norm scales by plain `w`;
//! - full attention: `q_proj` emits, per head, the query and then a gate of
//!   the same width; the attention output is multiplied by `sigmoid(gate)`
//!   before `o_proj`. Per-head q/k RMSNorm; partial RoPE
//!   (`partial_rotary_factor`, default 0.25, on the first dimensions of
//!   each head);
//! - Qwen3-Next fuses the linear layer's projections: `in_proj_qkvz` holds,
//!   per key head, its query, its key, then the values and output gates of
//!   its `Hv/Hk` value heads; `in_proj_ba` per key head the `b` then the `a`
//!   of those value heads. Qwen3.5 stores `in_proj_qkv` (all queries, all
//!   keys, all values), `in_proj_z`, `in_proj_b`, `in_proj_a`;
//! - Qwen3.5's interleaved multimodal RoPE (`mrope_section`) gives every
//!   section the same position for text, where it equals ordinary partial
//!   RoPE; colibri converts the language model and runs text only (the
//!   vision tower `model.visual.*` is skipped);
//! - Qwen3.5's conditional-generation checkpoints put the language model
//!   under `model.language_model.*` and its config under `text_config`, and
//!   the Hub's store each layer's experts stacked (`mlp.experts.gate_up_proj`
//!   [E, 2F, D], gate rows first; `mlp.experts.down_proj` [E, D, F]), where
//!   `save_pretrained` writes them one by one: both are read;
//! - routing is a softmax over all experts, top-k, renormalised (always for
//!   Qwen3.5; `norm_topk_prob` for Qwen3-Next), plus a shared expert scaled
//!   by `sigmoid(shared_expert_gate · x)`; Qwen3-Next's `mlp_only_layers` /
//!   `decoder_sparse_step` make some layers dense;
//! - `mtp.*` (the multi-token-prediction layer) is not computed and skipped.

use super::{Arch, HfConfig, Source, llama_name, qwen_moe_name, qwen_sparse_layers, text_config};
use crate::canonical::config::*;
use crate::canonical::tensors::{ExpertTensor as X, LayerTensor as L, TensorId};
use crate::error::{Error, Result};

/// Qwen3-Next and Qwen3-Coder-Next.
pub static NEXT: Arch =
    Arch { hf_class: "Qwen3NextForCausalLM", model_type: "qwen3_next", config, source, ignored: skips_mtp };

/// Qwen3.5/3.6 MoE, the language model on its own.
pub static QWEN3_5: Arch =
    Arch { hf_class: "Qwen3_5MoeForCausalLM", model_type: "qwen3_5_moe_text", config, source, ignored: skips_mtp };

/// Qwen3.5/3.6 MoE as the Hub ships it, with a vision tower.
pub static QWEN3_5_VL: Arch = Arch {
    hf_class: "Qwen3_5MoeForConditionalGeneration",
    model_type: "qwen3_5_moe",
    config,
    source,
    ignored: skips_mtp_and_vision,
};

/// The two layouts of the linear layers' projections.
fn fused(hf: &HfConfig) -> bool {
    hf.str("model_type") == Some("qwen3_next")
}

fn config(hf: &HfConfig) -> Result<ModelConfig> {
    let next = fused(hf);
    let c = &text_config(hf);
    c.require_silu("hidden_act")?;
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let e = c.usize(&["num_experts", "num_local_experts"])?;
    let linear = linear_layers(c, n)?;
    let sparse = if next { qwen_sparse_layers(c, n, e)? } else { vec![e > 0; n] };
    let dense_ffn = c.opt_usize("intermediate_size")?.unwrap_or(0);
    let bias = c.bool_or("attention_bias", false)?;
    let mut rope = c.rope(head_dim, 10000.0)?;
    if !mentions_partial_rotary(c) {
        rope.rotary_dim = (head_dim / 4) & !1;
    }
    let shared = c.opt_usize("shared_expert_intermediate_size")?.filter(|&f| f > 0);
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(32768),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6)),
        rope,
        attention: AttentionSpec {
            qkv_bias: bias,
            o_bias: bias,
            qk_norm: QkNorm::PerHead,
            output_gate: true,
            ..Default::default()
        },
        moe: Some(MoeSpec {
            num_experts: e,
            expert_ffn_dim: c.usize(&["moe_intermediate_size"])?,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                renormalize: if next { c.bool_or("norm_topk_prob", true)? } else { true },
                ..Default::default()
            },
            shared_expert: shared.map(|f| SharedExpertSpec { ffn_dim: f, sigmoid_gate: true }),
            ..Default::default()
        }),
        linear: Some(linear_spec(c)?),
        layers: (0..n)
            .map(|l| LayerSpec {
                mixer: if linear[l] { MixerSpec::Linear } else { MixerSpec::FULL_ATTENTION },
                ffn: if sparse[l] { FfnSpec::Moe } else { FfnSpec::Dense { ffn_dim: dense_ffn } },
            })
            .collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

/// The Gated DeltaNet layers' shape, every size at least 1 and the value
/// heads a multiple of the key heads, or an error naming the key.
fn linear_spec(c: &HfConfig) -> Result<LinearSpec> {
    let keys = [
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
    ];
    let mut v = [0; 5];
    for (x, key) in v.iter_mut().zip(keys) {
        *x = c.usize(&[key])?;
        if *x == 0 {
            return Err(Error::checkpoint(&c.path, format!("config field `{key}` must be at least 1, got 0")));
        }
    }
    let [k_heads, v_heads, k_head_dim, v_head_dim, conv_kernel] = v;
    if !v_heads.is_multiple_of(k_heads) {
        return Err(Error::checkpoint(
            &c.path,
            format!("`linear_num_value_heads` {v_heads} is not a multiple of `linear_num_key_heads` {k_heads}"),
        ));
    }
    Ok(LinearSpec { kind: LinearKind::GatedDeltaNet, k_heads, v_heads, k_head_dim, v_head_dim, conv_kernel })
}

/// Whether the config gives a partial rotary factor anywhere (else the
/// family's default of 0.25 applies).
fn mentions_partial_rotary(c: &HfConfig) -> bool {
    let nested = ["rope_parameters", "rope_scaling"]
        .iter()
        .any(|k| c.get(k).and_then(|p| p.get("partial_rotary_factor")).is_some_and(|v| !v.is_null()));
    nested || c.get("partial_rotary_factor").is_some()
}

/// Which layers are linear attention: `layer_types`, else all but every
/// `full_attention_interval`-th.
fn linear_layers(c: &HfConfig, n: usize) -> Result<Vec<bool>> {
    if let Some(types) = super::linear_layer_types(c, n)? {
        return Ok(types);
    }
    let every = c.opt_usize("full_attention_interval")?.unwrap_or(4);
    if every == 0 {
        return Err(Error::checkpoint(&c.path, "config field `full_attention_interval` must be >= 1"));
    }
    Ok((0..n).map(|l| (l + 1) % every != 0).collect())
}

fn source(hf: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    let vl = hf.get("text_config").is_some();
    // The language model's prefix: `model.` or `model.language_model.`.
    let lm = |name: String| match name.strip_prefix("model.") {
        Some(rest) if vl => format!("model.language_model.{rest}"),
        _ => name,
    };
    let layer = |l: usize, rest: &str| lm(format!("model.layers.{l}.{rest}"));
    let lin = cfg.linear.expect("this family has linear layers");
    let (kd, vd, dk, dv) = (lin.key_dim(), lin.value_dim(), lin.k_head_dim, lin.v_head_dim);
    let per_key = lin.v_heads / lin.k_heads;
    let dh = cfg.head_dim;
    let plain = |id| {
        let name = qwen_moe_name(id).or_else(|| llama_name(id));
        Source::tensor(lm(name.unwrap_or_else(|| format!("<{id} has no Qwen3-Next name>"))))
    };
    match id {
        TensorId::FinalNorm | TensorId::Layer(_, L::AttnNorm | L::FfnNorm | L::QNorm | L::KNorm) => {
            plain(id).plus_one()
        }
        // Per head: the query's Dh rows, then the gate's.
        TensorId::Layer(_, L::Wq | L::Bq) => plain(id).rows(2 * dh, 0, dh),
        TensorId::Layer(l, L::Wg) => Source::tensor(layer(l, "self_attn.q_proj.weight")).rows(2 * dh, dh, dh),
        TensorId::Layer(l, L::Bg) => Source::tensor(layer(l, "self_attn.q_proj.bias")).rows(2 * dh, dh, dh),
        TensorId::Layer(l, t @ (L::LinQ | L::LinK | L::LinV | L::LinZ | L::LinB | L::LinA)) if fused(hf) => {
            // Per key head: q (Dk), k (Dk), v and z of its value heads.
            let group = 2 * dk + 2 * dv * per_key;
            let qkvz = Source::tensor(layer(l, "linear_attn.in_proj_qkvz.weight"));
            let ba = Source::tensor(layer(l, "linear_attn.in_proj_ba.weight"));
            match t {
                L::LinQ => qkvz.rows(group, 0, dk),
                L::LinK => qkvz.rows(group, dk, dk),
                L::LinV => qkvz.rows(group, 2 * dk, dv * per_key),
                L::LinZ => qkvz.rows(group, 2 * dk + dv * per_key, dv * per_key),
                L::LinB => ba.rows(2 * per_key, 0, per_key),
                _ => ba.rows(2 * per_key, per_key, per_key),
            }
        }
        TensorId::Layer(l, t @ (L::LinQ | L::LinK | L::LinV)) => {
            let all = 2 * kd + vd;
            let qkv = Source::tensor(layer(l, "linear_attn.in_proj_qkv.weight"));
            match t {
                L::LinQ => qkv.rows(all, 0, kd),
                L::LinK => qkv.rows(all, kd, kd),
                _ => qkv.rows(all, 2 * kd, vd),
            }
        }
        TensorId::Layer(l, L::LinZ) => Source::tensor(layer(l, "linear_attn.in_proj_z.weight")),
        TensorId::Layer(l, L::LinB) => Source::tensor(layer(l, "linear_attn.in_proj_b.weight")),
        TensorId::Layer(l, L::LinA) => Source::tensor(layer(l, "linear_attn.in_proj_a.weight")),
        // One [2·Hk·Dk + Hv·Dv, 1, Kc] convolution over q | k | v.
        TensorId::Layer(l, t @ (L::LinConvQ | L::LinConvK | L::LinConvV)) => {
            let conv = Source::tensor(layer(l, "linear_attn.conv1d.weight"));
            let all = 2 * kd + vd;
            match t {
                L::LinConvQ => conv.rows(all, 0, kd),
                L::LinConvK => conv.rows(all, kd, kd),
                _ => conv.rows(all, 2 * kd, vd),
            }
        }
        TensorId::Layer(l, L::LinALog) => Source::tensor(layer(l, "linear_attn.A_log")),
        TensorId::Layer(l, L::LinDtBias) => Source::tensor(layer(l, "linear_attn.dt_bias")),
        TensorId::Layer(l, L::LinNorm) => Source::tensor(layer(l, "linear_attn.norm.weight")),
        TensorId::Layer(l, L::Wo) if cfg.layers[l].mixer == MixerSpec::Linear => {
            Source::tensor(layer(l, "linear_attn.out_proj.weight"))
        }
        TensorId::Expert(l, e, t @ (X::Gate | X::Up | X::Down)) => {
            let f = cfg.moe.as_ref().map_or(0, |m| m.expert_ffn_dim);
            let stacked = match t {
                X::Gate => Source::expert(layer(l, "mlp.experts.gate_up_proj"), e).rows(2 * f, 0, f),
                X::Up => Source::expert(layer(l, "mlp.experts.gate_up_proj"), e).rows(2 * f, f, f),
                _ => Source::expert(layer(l, "mlp.experts.down_proj"), e),
            };
            plain(id).or(stacked)
        }
        other => plain(other),
    }
}

fn skips_mtp(_: &HfConfig, name: &str) -> bool {
    name.starts_with("mtp.")
}

fn skips_mtp_and_vision(hf: &HfConfig, name: &str) -> bool {
    skips_mtp(hf, name) || name.starts_with("model.visual.")
}
