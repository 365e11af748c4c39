//! IBM Granite 4.0-H (`GraniteMoeHybridForCausalLM`), mirroring transformers'
//! `models/granitemoehybrid/modeling_granitemoehybrid.py`: Mamba2 layers
//! and grouped-query attention layers (`layer_types` / `layers_block_type`),
//! each followed by Granite-MoE's block and an always-on shared MLP.
//!
//! Quirks:
//! - Granite's muP constants: the embedding times `embedding_multiplier`,
//!   each block's output times `residual_multiplier` before its residual add,
//!   the logits divided by `logits_scaling`, the attention scale
//!   `attention_multiplier` (not 1/√Dh);
//! - attention rotates only with `position_embedding_type: "rope"`; anything
//!   else (the released models say `"nope"`) means no positions at all;
//! - the family's own plain RoPE turns the whole head (explicit `head_dim`
//!   or hidden / heads) whatever `partial_rotary_factor` says; the scaled
//!   kinds (`linear`, `yarn`, ...) would shorten the frequencies by it, but
//!   the rotation multiplies whole heads, so transformers cannot run such a
//!   config: colibri refuses it;
//! - Mamba2 as Nemotron-H's (in_proj rows `[z, x, B, C, dt]`, conv over
//!   `[x, B, C]` with a bias, the gated norm per group of `I / n_groups`) with
//!   I = `mamba_expand · hidden_size` and `mamba_d_head: "auto"` = I /
//!   `mamba_n_heads`; the gated norm's eps is `rms_norm_eps`;
//! - the time step is clamped to `time_step_limit` in the chunked (prefill)
//!   scan only, never in the one-token update; colibri floors every step at
//!   its lower bound (an upper bound that is not infinite is refused);
//! - routing: top-k of the logits, then a softmax over the k
//!   (`block_sparse_moe.router.layer`); experts stacked as Granite-MoE's
//!   (`input_linear` [E, 2F, D], gate rows first; `output_linear` [E, D, F]);
//! - the shared MLP (`shared_mlp.input_linear` [2Fs, D], gate rows first,
//!   SiLU) runs on every layer and is added after the experts; with
//!   `num_local_experts: 0` it is the layer's only FFN (a dense layer).

use serde_json::Value;

use super::{Arch, HfConfig, Source, llama_name};
use crate::canonical::config::*;
use crate::canonical::tensors::{ExpertTensor as X, LayerTensor as L, TensorId};
use crate::error::{Error, Result};

pub static ARCH: Arch = Arch {
    hf_class: "GraniteMoeHybridForCausalLM",
    model_type: "granitemoehybrid",
    config,
    source,
    ignored: super::nothing_ignored,
};

/// Which layers are Mamba2: `layer_types` (or `layers_block_type`), all of
/// them when neither is given (transformers' default).
fn mamba_layers(c: &HfConfig, n: usize) -> Result<Vec<bool>> {
    let bad = |m: String| Error::checkpoint(&c.path, m);
    let Some(v) = c.get("layer_types").or(c.get("layers_block_type")) else { return Ok(vec![true; n]) };
    let list = v.as_array().ok_or_else(|| bad(format!("`layer_types` must be a list, got {v}")))?;
    if list.len() != n {
        return Err(bad(format!("`layer_types` lists {} layers, but num_hidden_layers is {n}", list.len())));
    }
    list.iter()
        .enumerate()
        .map(|(i, t): (usize, &Value)| match t.as_str() {
            Some("linear_attention" | "mamba") => Ok(true),
            Some("full_attention" | "attention") => Ok(false),
            _ => Err(bad(format!("`layer_types[{i}]` is {t}; Granite 4.0-H has linear_attention and full_attention"))),
        })
        .collect()
}

/// RoPE as the family reads it: always over the whole head. Plain RoPE
/// ignores a `partial_rotary_factor`; a scaled kind with one below 1 is
/// refused (transformers' rotation fails on it).
fn granite_rope(c: &HfConfig, head_dim: usize) -> Result<RopeSpec> {
    let mut rope = c.rope(head_dim, 10000.0)?;
    if rope.scaling != RopeScaling::None && rope.rotary_dim != head_dim & !1 {
        return Err(Error::Unsupported(format!(
            "{}: `partial_rotary_factor` with scaled RoPE (transformers rotates Granite 4.0-H's whole heads)",
            c.path.display()
        )));
    }
    rope.rotary_dim = head_dim & !1;
    Ok(rope)
}

fn config(c: &HfConfig) -> Result<ModelConfig> {
    let unsupported = |m: String| Err(Error::Unsupported(format!("{}: {m}", c.path.display())));
    c.require_silu("hidden_act")?;
    if !c.bool_or("mamba_conv_bias", true)? || c.bool_or("mamba_proj_bias", false)? {
        return unsupported("Mamba2 needs `mamba_conv_bias: true` and `mamba_proj_bias: false`".into());
    }
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let mamba = mamba_layers(c, n)?;
    let mult = |k: &str| -> Result<f32> { Ok(c.opt_f64(k)?.unwrap_or(1.0) as f32) };
    let bias = c.bool_or("attention_bias", false)?;
    let rope = c.str("position_embedding_type") == Some("rope");
    let limit = c.opt_f64_list("time_step_limit")?.unwrap_or(vec![0.0, f64::INFINITY]);
    let dt_min = match limit[..] {
        [lo, hi] if lo.is_finite() && lo >= 0.0 && hi == f64::INFINITY => lo as f32,
        _ => return unsupported(format!("time_step_limit {limit:?} is not supported (a floor, then Infinity)")),
    };
    let heads = c.opt_usize("mamba_n_heads")?.unwrap_or(128);
    let inter = c.opt_usize("mamba_expand")?.unwrap_or(2) * d;
    let head = match c.get("mamba_d_head") {
        None => inter / heads.max(1),
        Some(v) if v.as_str() == Some("auto") => inter / heads.max(1),
        Some(_) => c.usize(&["mamba_d_head"])?,
    };
    if heads * head != inter {
        return Err(Error::checkpoint(
            &c.path,
            format!("mamba_n_heads {heads} × mamba_d_head {head} differs from mamba_expand × hidden_size {inter}"),
        ));
    }
    let experts = c.opt_usize("num_local_experts")?.unwrap_or(8);
    let shared = c.opt_usize("shared_intermediate_size")?.unwrap_or(1024);
    let moe = (experts > 0)
        .then(|| -> Result<MoeSpec> {
            Ok(MoeSpec {
                num_experts: experts,
                expert_ffn_dim: c.usize(&["intermediate_size"])?,
                router: RouterSpec {
                    top_k: c.opt_usize("num_experts_per_tok")?.unwrap_or(2),
                    score: RouterScore::SoftmaxSelected,
                    ..Default::default()
                },
                shared_expert: Some(SharedExpertSpec { ffn_dim: shared, sigmoid_gate: false }),
                ..Default::default()
            })
        })
        .transpose()?;
    let ffn = if moe.is_some() { FfnSpec::Moe } else { FfnSpec::Dense { ffn_dim: shared } };
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(2048),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6)),
        rope: granite_rope(c, head_dim)?,
        attention: AttentionSpec {
            qkv_bias: bias,
            o_bias: bias,
            softmax_scale: Some(mult("attention_multiplier")?),
            no_rope: !rope,
            ..Default::default()
        },
        moe,
        linear: mamba.contains(&true).then_some(LinearSpec {
            kind: LinearKind::Mamba2 { dt_min },
            k_heads: c.opt_usize("mamba_n_groups")?.unwrap_or(1),
            v_heads: heads,
            k_head_dim: c.opt_usize("mamba_d_state")?.unwrap_or(256),
            v_head_dim: head,
            conv_kernel: c.opt_usize("mamba_d_conv")?.unwrap_or(4),
        }),
        layers: mamba
            .iter()
            .map(|&m| LayerSpec {
                mixer: if m { MixerSpec::Linear } else { MixerSpec::FULL_ATTENTION },
                ffn: ffn.clone(),
            })
            .collect(),
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
    let fs = cfg.moe.as_ref().and_then(|m| m.shared_expert.as_ref()).map_or(0, |s| s.ffn_dim);
    let moe = |l: usize, n: &str| format!("model.layers.{l}.block_sparse_moe.{n}.weight");
    let shared = |l: usize, n: &str| Source::tensor(format!("model.layers.{l}.shared_mlp.{n}.weight"));
    let mamba = |l: usize, n: &str| Source::tensor(format!("model.layers.{l}.mamba.{n}"));
    match id {
        TensorId::Layer(l, L::Router) => Source::tensor(moe(l, "router.layer")),
        TensorId::Expert(l, e, X::Gate) => Source::expert(moe(l, "input_linear"), e).rows(2 * f, 0, f),
        TensorId::Expert(l, e, X::Up) => Source::expert(moe(l, "input_linear"), e).rows(2 * f, f, f),
        TensorId::Expert(l, e, X::Down) => Source::expert(moe(l, "output_linear"), e),
        // The shared MLP: the MoE layers' shared expert, or a dense layer's MLP.
        TensorId::Layer(l, L::SharedGate | L::Gate) => {
            let w = match cfg.layers[l].ffn {
                FfnSpec::Dense { ffn_dim } => ffn_dim,
                _ => fs,
            };
            shared(l, "input_linear").rows(2 * w, 0, w)
        }
        TensorId::Layer(l, L::SharedUp | L::Up) => {
            let w = match cfg.layers[l].ffn {
                FfnSpec::Dense { ffn_dim } => ffn_dim,
                _ => fs,
            };
            shared(l, "input_linear").rows(2 * w, w, w)
        }
        TensorId::Layer(l, L::SharedDown | L::Down) => shared(l, "output_linear"),
        TensorId::Layer(l, L::Wo) if cfg.layers[l].mixer == MixerSpec::Linear => mamba(l, "out_proj.weight"),
        TensorId::Layer(l, t) if cfg.layers[l].mixer == MixerSpec::Linear => {
            super::mamba2_source(cfg.linear, t, |name| mamba(l, name)).unwrap_or_else(|| plain(TensorId::Layer(l, t)))
        }
        other => plain(other),
    }
}

fn plain(id: TensorId) -> Source {
    Source::tensor(llama_name(id).unwrap_or_else(|| format!("<{id} has no Granite 4.0-H name>")))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn cfg(extra: &str) -> Result<ModelConfig> {
        let base = r#""hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 50,
            "intermediate_size": 32, "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16"#;
        config(&HfConfig::parse(Path::new("config.json"), &format!("{{{base}{extra}}}"))?)
    }

    /// `mamba_d_head: "auto"` is `mamba_expand · hidden / mamba_n_heads`; the
    /// legacy layer names read; without experts the shared MLP is a dense
    /// layer; only `"rope"` rotates.
    #[test]
    fn granite_hybrid_switches_read_as_transformers_reads_them() {
        let c = cfg(r#", "layer_types": ["mamba", "attention", "mamba"], "mamba_d_head": "auto""#).unwrap();
        let lin = c.linear.unwrap();
        assert_eq!((lin.v_heads, lin.v_head_dim, lin.k_heads, lin.k_head_dim), (8, 16, 2, 16));
        assert_eq!(c.layers[1].mixer, MixerSpec::FULL_ATTENTION);
        assert!(c.attention.no_rope && c.moe.is_some());
        let dense =
            cfg(r#", "num_local_experts": 0, "shared_intermediate_size": 24, "position_embedding_type": "rope""#)
                .unwrap();
        assert!(dense.moe.is_none() && !dense.attention.no_rope);
        assert!(dense.layers.iter().all(|l| l.ffn == FfnSpec::Dense { ffn_dim: 24 } && l.mixer == MixerSpec::Linear));
        dense.validate().unwrap();
        assert!(matches!(cfg(r#", "time_step_limit": [0.0, 1.0]"#), Err(Error::Unsupported(_))));
        let floor = cfg(r#", "time_step_limit": [0.5, Infinity]"#).unwrap();
        assert_eq!(floor.linear.unwrap().kind, LinearKind::Mamba2 { dt_min: 0.5 });
        assert!(cfg(r#", "mamba_d_head": 7"#).unwrap_err().to_string().contains("mamba_d_head"));
    }

    /// Plain RoPE turns the whole (explicit) head and ignores
    /// `partial_rotary_factor`; a scaled kind with one is refused.
    #[test]
    fn granite_hybrid_plain_rope_ignores_the_partial_factor() {
        let rope = |p: &str| {
            let extra = format!(r#", "head_dim": 16, "position_embedding_type": "rope", "rope_parameters": {{{p}}}"#);
            cfg(&extra).map(|c| c.rope)
        };
        let plain = rope(r#""rope_type": "default", "rope_theta": 300.0, "partial_rotary_factor": 0.5"#).unwrap();
        assert_eq!((plain.rotary_dim, plain.theta), (16, 300.0));
        let linear = rope(r#""rope_type": "linear", "factor": 2.0"#).unwrap();
        assert_eq!((linear.rotary_dim, linear.scaling), (16, RopeScaling::Linear { factor: 2.0 }));
        let partial = rope(r#""rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5"#);
        assert!(matches!(partial, Err(Error::Unsupported(m)) if m.contains("partial_rotary_factor")));
    }
}
