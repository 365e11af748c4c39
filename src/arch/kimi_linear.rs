//! Kimi-Linear (`KimiLinearForCausalLM`), mirroring transformers'
//! `models/kimi_linear/modeling_kimi_linear.py`: Kimi Delta Attention (KDA)
//! layers and multi-head latent attention layers (three to one on the
//! released 48B-A3B), DeepSeek-V3's router.
//!
//! Quirks:
//! - `linear_attn_config` lists the layers of each kind **1-indexed**
//!   (`kda_layers`, `full_attn_layers`; transformers' own `layer_types` is
//!   read when present) and gives the KDA heads (`num_heads` × `head_dim`,
//!   as many key as value heads) and `short_conv_kernel_size`;
//! - KDA: q, k and v each have their own depthwise convolution
//!   (`q_conv1d` …, SiLU); the decay is per key channel,
//!   `−exp(A_log[h])·softplus(f_b·f_a·x + dt_bias)` with `f_a` of rank
//!   `head_dim` and `dt_bias` per channel; `β = sigmoid(b_proj·x)`; the
//!   output is `o_norm(o)·sigmoid(g_b·g_a·x)` per head; q and k are
//!   l2-normalised by division (`x / √(Σx² + 1e-6)`);
//! - MLA without any RoPE: the "rotary" part of the keys, shared by every
//!   head, stays as projected (`mla_use_nope`; transformers has no rotary
//!   embedding for this model at all); the score scale is 1/√(nope + rope);
//!   the latent norms use eps 1e-6;
//! - layers below `first_k_dense_replace` (then every `moe_layer_freq`-th
//!   is MoE) are dense MLPs under `mlp.*`; the MoE layers sit under
//!   `block_sparse_moe.*` with `experts.E.w1/w3/w2` (gate/up/down) and
//!   `num_shared_experts` shared experts as one ungated MLP;
//! - routing as DeepSeek-V3: sigmoid scores, the choice adds
//!   `e_score_correction_bias` within the `topk_group` best of
//!   `num_expert_group` groups (sum of their two best), weights renormalised
//!   (`moe_renormalize`) and times `routed_scaling_factor`.

use serde_json::Value;

use super::{Arch, HfConfig, Source, llama_name};
use crate::canonical::config::*;
use crate::canonical::tensors::{ExpertTensor as X, LayerTensor as L, TensorId};
use crate::error::{Error, Result};

pub static ARCH: Arch = Arch {
    hf_class: "KimiLinearForCausalLM",
    model_type: "kimi_linear",
    config,
    source,
    ignored: super::deepseek::past_the_layers,
};

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    if c.bool_or("attention_bias", false)? {
        return Err(Error::Unsupported(format!("{}: `attention_bias: true` is not supported", c.path.display())));
    }
    if let Some(f) = c.str("moe_router_activation_func").filter(|f| *f != "sigmoid") {
        return Err(Error::Unsupported(format!(
            "{}: moe_router_activation_func \"{f}\" is not supported (sigmoid)",
            c.path.display()
        )));
    }
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let n = c.usize(&["num_hidden_layers"])?;
    let mla = super::deepseek::mla_spec(c)?;
    let (dn, dr) = (mla.qk_nope_dim, mla.qk_rope_dim);
    let lin_cfg = LinearCfg::read(c)?;
    let linear = linear_layers(c, n)?;
    let e = c.usize(&["num_experts", "num_local_experts", "n_routed_experts"])?;
    let k = c.usize(&["num_experts_per_token", "num_experts_per_tok"])?;
    let groups = match (c.opt_usize("num_expert_group")?.or(c.opt_usize("n_group")?), c.opt_usize("topk_group")?) {
        (Some(g), Some(top)) if g > 1 => Some(GroupLimit { groups: g, top_groups: top, score: GroupScore::TopTwoSum }),
        _ => None,
    };
    let renormalize = match c.get("moe_renormalize") {
        Some(_) => c.bool_or("moe_renormalize", true)?,
        None => c.bool_or("norm_topk_prob", true)?,
    };
    let f = c.usize(&["moe_intermediate_size"])?;
    let shared = c.opt_usize("num_shared_experts")?.or(c.opt_usize("n_shared_experts")?).unwrap_or(0);
    let dense = c.opt_usize("first_k_dense_replace")?.unwrap_or(1);
    let every = c.opt_usize("moe_layer_freq")?.unwrap_or(1).max(1);
    let dense_ffn = c.usize(&["intermediate_size"])?;
    let mut rope = c.rope(dr, 10000.0)?;
    rope.rotary_dim = dr;
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: h,
        head_dim: dn + dr,
        max_seq_len: c.opt_usize("max_position_embeddings")?.or(c.opt_usize("model_max_length")?).unwrap_or(4096),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-5)),
        rope,
        attention: AttentionSpec { kind: AttentionKind::Mla(mla), no_rope: true, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: e,
            expert_ffn_dim: f,
            router: RouterSpec {
                top_k: k,
                score: RouterScore::Sigmoid,
                renormalize,
                scale: c.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32,
                correction_bias: true,
                groups,
                ..Default::default()
            },
            shared_expert: (shared > 0).then_some(SharedExpertSpec { ffn_dim: shared * f, sigmoid_gate: false }),
            ..Default::default()
        }),
        linear: Some(LinearSpec {
            kind: LinearKind::Kda { gate_rank: lin_cfg.head_dim },
            k_heads: lin_cfg.heads,
            v_heads: lin_cfg.heads,
            k_head_dim: lin_cfg.head_dim,
            v_head_dim: lin_cfg.head_dim,
            conv_kernel: lin_cfg.conv_kernel,
        }),
        layers: (0..n)
            .map(|l| LayerSpec {
                mixer: if linear[l] { MixerSpec::Linear } else { MixerSpec::FULL_ATTENTION },
                ffn: if l >= dense && l % every == 0 { FfnSpec::Moe } else { FfnSpec::Dense { ffn_dim: dense_ffn } },
            })
            .collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

/// The KDA heads and convolution from `linear_attn_config` (or the flat
/// `linear_*` keys transformers also writes).
struct LinearCfg {
    heads: usize,
    head_dim: usize,
    conv_kernel: usize,
}

impl LinearCfg {
    fn read(c: &HfConfig) -> Result<LinearCfg> {
        let nested = c.get("linear_attn_config");
        let get = |inner: &str, flat: &str| -> Result<usize> {
            if let Some(v) = nested.and_then(|n| n.get(inner)).filter(|v| !v.is_null()) {
                return v.as_u64().map(|x| x as usize).ok_or_else(|| {
                    Error::checkpoint(&c.path, format!("`linear_attn_config.{inner}` must be an integer, got {v}"))
                });
            }
            c.usize(&[flat]).map_err(|_| {
                Error::checkpoint(&c.path, format!("config.json has no `linear_attn_config.{inner}` (or `{flat}`)"))
            })
        };
        let at_least_one = |inner: &str, flat: &str| -> Result<usize> {
            match get(inner, flat)? {
                0 => Err(Error::checkpoint(&c.path, format!("`linear_attn_config.{inner}` must be at least 1, got 0"))),
                x => Ok(x),
            }
        };
        Ok(LinearCfg {
            heads: at_least_one("num_heads", "linear_num_heads")?,
            head_dim: at_least_one("head_dim", "linear_head_dim")?,
            conv_kernel: at_least_one("short_conv_kernel_size", "linear_conv_kernel_dim")?,
        })
    }
}

/// Which layers are KDA: transformers' `layer_types`, else the 1-indexed
/// `linear_attn_config.kda_layers` / `full_attn_layers`, which must cover
/// every layer once.
fn linear_layers(c: &HfConfig, n: usize) -> Result<Vec<bool>> {
    let bad = |m: String| Error::checkpoint(&c.path, m);
    if let Some(types) = super::linear_layer_types(c, n)? {
        return Ok(types);
    }
    let lists = c.get("linear_attn_config").ok_or_else(|| {
        bad("config.json has neither `linear_attn_config` nor `layer_types`: which layers are KDA is unknown".into())
    })?;
    let mut kind: Vec<Option<bool>> = vec![None; n];
    for (key, linear) in [("kda_layers", true), ("full_attn_layers", false)] {
        let list = match lists.get(key) {
            Some(Value::Array(a)) => a,
            _ => return Err(bad(format!("`linear_attn_config.{key}` must be a list of 1-based layer numbers"))),
        };
        for v in list {
            let i = v.as_u64().map(|x| x as usize).filter(|&i| (1..=n).contains(&i)).ok_or_else(|| {
                bad(format!("`linear_attn_config.{key}` holds {v}, not a layer number in 1..={n} (1-based)"))
            })?;
            if kind[i - 1].replace(linear).is_some() {
                return Err(bad(format!("layer {i} (1-based) is listed twice in `linear_attn_config`")));
            }
        }
    }
    kind.iter()
        .enumerate()
        .map(|(i, k)| {
            k.ok_or_else(|| {
                bad(format!(
                    "layer {} (1-based) is in neither `linear_attn_config.kda_layers` nor `full_attn_layers` \
                     ({n} layers in num_hidden_layers)",
                    i + 1
                ))
            })
        })
        .collect()
}

fn source(hf: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    let attn = |l: usize, n: &str| Source::tensor(format!("model.layers.{l}.self_attn.{n}"));
    let moe = |l: usize, n: &str| Source::tensor(format!("model.layers.{l}.block_sparse_moe.{n}"));
    match id {
        TensorId::Layer(l, L::Router) => moe(l, "gate.weight"),
        TensorId::Layer(l, L::RouterCorrection) => moe(l, "gate.e_score_correction_bias"),
        TensorId::Layer(l, L::SharedGate) => moe(l, "shared_experts.gate_proj.weight"),
        TensorId::Layer(l, L::SharedUp) => moe(l, "shared_experts.up_proj.weight"),
        TensorId::Layer(l, L::SharedDown) => moe(l, "shared_experts.down_proj.weight"),
        TensorId::Expert(l, e, t) => {
            let w = match t {
                X::Gate => "w1",
                X::Up => "w3",
                _ => "w2",
            };
            moe(l, &format!("experts.{e}.{w}.weight"))
        }
        TensorId::Layer(l, t) if cfg.layers[l].mixer == MixerSpec::Linear => match t {
            L::LinQ => attn(l, "q_proj.weight"),
            L::LinK => attn(l, "k_proj.weight"),
            L::LinV => attn(l, "v_proj.weight"),
            L::LinB => attn(l, "b_proj.weight"),
            L::LinFa => attn(l, "f_a_proj.weight"),
            L::LinFb => attn(l, "f_b_proj.weight"),
            L::LinGa => attn(l, "g_a_proj.weight"),
            L::LinGb => attn(l, "g_b_proj.weight"),
            L::LinConvQ => attn(l, "q_conv1d.weight"),
            L::LinConvK => attn(l, "k_conv1d.weight"),
            L::LinConvV => attn(l, "v_conv1d.weight"),
            L::LinALog => attn(l, "A_log"),
            L::LinDtBias => attn(l, "dt_bias"),
            L::LinNorm => attn(l, "o_norm.weight"),
            L::Wo => attn(l, "o_proj.weight"),
            _ => plain(hf, cfg, id),
        },
        _ => plain(hf, cfg, id),
    }
}

/// The DeepSeek names of the MLA layers, and the Llama names of the rest.
fn plain(hf: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    match id {
        TensorId::Layer(_, L::WqA | L::QANorm | L::WqB | L::WkvA | L::KvANorm | L::WkB | L::WvB) => {
            (super::deepseek::V3.source)(hf, cfg, id)
        }
        other => Source::tensor(llama_name(other).unwrap_or_else(|| format!("<{other} has no Kimi-Linear name>"))),
    }
}
