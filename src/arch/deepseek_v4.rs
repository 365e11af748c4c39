//! DeepSeek-V4 (`DeepseekV4ForCausalLM`, Flash and Pro), mirroring
//! transformers' `models/deepseek_v4/modeling_deepseek_v4.py` and
//! `configuration_deepseek_v4.py`, and the key renames of
//! `conversion_mapping.py` for DeepSeek's own root-level tensor names.
//! The attention is `model/blocks/pooled.rs`, the hyper-connections
//! `model/blocks/hyper.rs`.
//!
//! Quirks (as transformers computes them):
//! - one key/value head whose row is key and value alike; queries and keys
//!   rotate their *last* `qk_rope_head_dim` values in adjacent pairs, and
//!   the attention output's last values are rotated back by the query's
//!   angle before the output projection; the query is RMS-normed per head
//!   without a weight after `q_b_proj`;
//! - window-only layers use `rope_theta` plain; pooled layers use
//!   `compress_rope_theta` with the config's YaRN, whose magnitude is forced
//!   to 1 (`attention_factor` 1.0) — their queries and keys too, not only
//!   the pooled entries;
//! - the window is `sliding_window` positions, the query's own included;
//!   an entry is seen once its block has ended at or before the query;
//!   entry w is rotated at position `w · rate` (its block's first), even
//!   on light layers whose entry also reads the block before;
//! - the pooled softmax is per channel over the block's positions (plus the
//!   previous block's first half on light layers; none before the first
//!   block), gates plus a learned bias per position; RMSNorm after;
//! - the indexer scores `Σ_h relu(q_h·k)/√Di · w_h`, `w = weights·x/√Hi`
//!   (x the layer's normed input), keeps `index_topk` entries among those
//!   the query may see;
//! - routing: `sqrtsoftplus` scores, top-k on score plus
//!   `e_score_correction_bias`, weights renormalised always (`norm_topk_prob`
//!   is ignored) and times `routed_scaling_factor`; `hash_moe` layers take
//!   their experts from `tid2eid[token]` and have no correction bias;
//! - the clamped SwiGLU `silu(min(g, L)) · clamp(u, −L, L)` in the routed
//!   and the shared experts alike; the shared expert is
//!   `moe_intermediate_size` wide whatever `n_shared_experts` says;
//! - hyper-connections: `hc_mult` streams, Sinkhorn as in `hyper.rs`, the
//!   first column normalisation counting as one of `hc_sinkhorn_iters`;
//! - `compress_ratios` (per layer, 0 / 4 / 128, the Hub) or `layer_types`
//!   (transformers) give the layers' pools, `compress_rates` (or
//!   `compress_rate_csa` / `compress_rate_hca`) their rates; without either
//!   list: two heavy layers, then light and heavy alternating;
//!   `mlp_layer_types` (or `num_hash_layers`, default 3) the hash layers;
//! - the multi-token-prediction tensors (`mtp.*`) are skipped.

use serde_json::{Value, json};

use super::{Arch, HfConfig, Source};
use crate::canonical::config::*;
use crate::canonical::tensors::{ExpertTensor as X, LayerTensor as L, TensorId};
use crate::error::{Error, Result};

pub static ARCH: Arch =
    Arch { hf_class: "DeepseekV4ForCausalLM", model_type: "deepseek_v4", config, source, ignored: skips_mtp };

/// The multi-token-prediction layer, which transformers does not load.
fn skips_mtp(_: &HfConfig, name: &str) -> bool {
    name.starts_with("mtp.") || name.contains(".mtp.")
}

/// A RoPE spec from one set of rope parameters (`params`, a JSON object).
fn rope_of(c: &HfConfig, params: Value, head_dim: usize) -> Result<RopeSpec> {
    let mut raw = json!({ "rope_parameters": params });
    if let Some(m) = c.get("max_position_embeddings") {
        raw["max_position_embeddings"] = m.clone();
    }
    let sub = HfConfig { raw, path: c.path.clone() };
    let mut spec = sub.rope(head_dim, 10000.0)?;
    spec.interleaved = true;
    Ok(spec)
}

/// The "main" and "compress" RoPEs, from transformers' nested
/// `rope_parameters` or the flat Hub keys.
fn ropes(c: &HfConfig, head_dim: usize, rope_dim: usize) -> Result<(RopeSpec, RopeSpec)> {
    let partial = rope_dim as f64 / head_dim as f64;
    let nested = c.get("rope_parameters").filter(|p| p.get("main").is_some() && p.get("compress").is_some());
    let (main, compress) = match nested {
        Some(p) => (p["main"].clone(), p["compress"].clone()),
        None => {
            let theta = c.opt_f64("rope_theta")?.unwrap_or(10000.0);
            let ctheta = c.opt_f64("compress_rope_theta")?.unwrap_or(160000.0);
            let mut yarn = c.get("rope_scaling").or(c.get("rope_parameters")).cloned().unwrap_or(json!({}));
            if let Value::Object(m) = &mut yarn {
                m.remove("main");
                m.remove("compress");
                if let Some(t) = m.remove("type") {
                    m.entry("rope_type").or_insert(t);
                }
                m.insert("rope_theta".into(), json!(ctheta));
                m.insert("partial_rotary_factor".into(), json!(partial));
                let kind = m.entry("rope_type").or_insert(json!("default")).clone();
                if kind == json!("yarn") {
                    m.entry("attention_factor").or_insert(json!(1.0));
                }
            }
            (json!({"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}), yarn)
        }
    };
    Ok((rope_of(c, main, head_dim)?, rope_of(c, compress, head_dim)?))
}

/// Each layer's pool: from `layer_types`, else `compress_ratios`, else
/// transformers' default schedule.
fn pools(c: &HfConfig, n: usize) -> Result<Vec<Pool>> {
    let bad = |m: String| Error::checkpoint(&c.path, m);
    if let Some(v) = c.get("layer_types") {
        let list = v.as_array().ok_or_else(|| bad(format!("`layer_types` must be a list, got {v}")))?;
        if list.len() < n {
            return Err(bad(format!("`layer_types` lists {} layers, but num_hidden_layers is {n}", list.len())));
        }
        return list[..n]
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(Pool::Window),
                Some("compressed_sparse_attention") => Ok(Pool::Light),
                Some("heavily_compressed_attention") => Ok(Pool::Heavy),
                _ => Err(bad(format!("`layer_types` entry {t} is not a DeepSeek-V4 attention type"))),
            })
            .collect();
    }
    if c.get("compress_ratios").is_some() {
        let list = c.usize_list("compress_ratios")?;
        if list.len() < n {
            return Err(bad(format!("`compress_ratios` lists {} layers, but num_hidden_layers is {n}", list.len())));
        }
        return list[..n]
            .iter()
            .map(|&r| match r {
                0 => Ok(Pool::Window),
                4 => Ok(Pool::Light),
                128 => Ok(Pool::Heavy),
                other => Err(bad(format!("`compress_ratios` entry {other} is not 0, 4 or 128"))),
            })
            .collect();
    }
    Ok((0..n).map(|l| if l < 2 || l % 2 == 0 { Pool::Heavy } else { Pool::Light }).collect())
}

/// How many leading layers are hash-routed.
fn hash_layers(c: &HfConfig, n: usize) -> Result<usize> {
    let Some(v) = c.get("mlp_layer_types") else {
        return Ok(c.opt_usize("num_hash_layers")?.unwrap_or(3).min(n));
    };
    let bad = |m: String| Error::checkpoint(&c.path, m);
    let list = v.as_array().ok_or_else(|| bad(format!("`mlp_layer_types` must be a list, got {v}")))?;
    let hash: Vec<bool> = list
        .iter()
        .take(n)
        .map(|t| match t.as_str() {
            Some("hash_moe") => Ok(true),
            Some("moe") => Ok(false),
            _ => Err(bad(format!("`mlp_layer_types` entry {t} is not \"hash_moe\" or \"moe\""))),
        })
        .collect::<Result<_>>()?;
    let k = hash.iter().take_while(|&&h| h).count();
    if hash[k..].iter().any(|&h| h) {
        return Err(Error::Unsupported(format!(
            "{}: hash-routed layers must come first in `mlp_layer_types`, got {v}",
            c.path.display()
        )));
    }
    Ok(k)
}

fn config(c: &HfConfig) -> Result<ModelConfig> {
    let bad = |m: String| Error::checkpoint(&c.path, m);
    c.require_silu("hidden_act")?;
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.opt_usize("head_dim")?.unwrap_or(512);
    let n = c.usize(&["num_hidden_layers"])?;
    let partial = match c.opt_f64("partial_rotary_factor")? {
        Some(p) => p,
        None => c.opt_usize("qk_rope_head_dim")?.map_or(64.0 / 512.0, |r| r as f64 / head_dim as f64),
    };
    let rope_dim = (head_dim as f64 * partial) as usize;
    let (main, compress) = ropes(c, head_dim, rope_dim)?;
    let rates = c.get("compress_rates");
    let rate = |key: &str, legacy: &str, default: usize| -> Result<usize> {
        match rates.and_then(|r| r.get(key)) {
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| bad(format!("`compress_rates.{key}` is {v}"))),
            None => Ok(c.opt_usize(legacy)?.unwrap_or(default)),
        }
    };
    let (light_rate, heavy_rate) = (
        rate("compressed_sparse_attention", "compress_rate_csa", 4)?,
        rate("heavily_compressed_attention", "compress_rate_hca", 128)?,
    );
    let score = match c.str("scoring_func").unwrap_or("sqrtsoftplus") {
        "sqrtsoftplus" => RouterScore::SqrtSoftplus,
        "sigmoid" => RouterScore::Sigmoid,
        other => {
            return Err(Error::Unsupported(format!(
                "{}: scoring_func \"{other}\" is not supported (sqrtsoftplus, sigmoid)",
                c.path.display()
            )));
        }
    };
    let limit = c.opt_f64("swiglu_limit")?.unwrap_or(10.0) as f32;
    if limit.is_nan() || limit <= 0.0 {
        return Err(bad(format!("`swiglu_limit` {limit} must be > 0")));
    }
    let moe_ffn = c.usize(&["moe_intermediate_size"])?;
    let eps = c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
    let kv_heads = c.opt_usize("num_key_value_heads")?.unwrap_or(1);
    if kv_heads != 1 {
        return Err(bad(format!("`num_key_value_heads` is {kv_heads}: DeepSeek-V4 has one shared key/value head")));
    }
    let pools = pools(c, n)?;
    let spec = PooledSpec {
        q_lora_rank: c.opt_usize("q_lora_rank")?.unwrap_or(1024),
        rope_dim,
        window: c.opt_usize("sliding_window")?.unwrap_or(128),
        o_groups: c.opt_usize("o_groups")?.unwrap_or(8),
        o_lora_rank: c.opt_usize("o_lora_rank")?.unwrap_or(1024),
        heavy_rate,
        light_rate,
        indexer: PoolIndexerSpec {
            heads: c.opt_usize("index_n_heads")?.unwrap_or(64),
            head_dim: c.opt_usize("index_head_dim")?.unwrap_or(128),
            top_k: c.opt_usize("index_topk")?.unwrap_or(512),
        },
        pool_rope: compress,
    };
    let cfg = ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: 1,
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(1048576),
        norm: NormSpec::rms(eps),
        rope: main,
        attention: AttentionSpec { sinks: true, kind: AttentionKind::Pooled(spec), ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: c.usize(&["n_routed_experts", "num_local_experts"])?,
            expert_ffn_dim: moe_ffn,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                score,
                renormalize: true,
                scale: c.opt_f64("routed_scaling_factor")?.unwrap_or(1.5) as f32,
                correction_bias: true,
                ..Default::default()
            },
            activation: Activation::ClampedSilu { limit },
            shared_expert: Some(SharedExpertSpec { ffn_dim: moe_ffn, sigmoid_gate: false }),
            hash_layers: hash_layers(c, n)?,
            ..Default::default()
        }),
        layers: pools.iter().map(|&pool| LayerSpec { mixer: MixerSpec::Pooled { pool }, ffn: FfnSpec::Moe }).collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        hyper: Some(HyperSpec {
            streams: c.opt_usize("hc_mult")?.unwrap_or(4),
            sinkhorn_iters: c.opt_usize("hc_sinkhorn_iters")?.unwrap_or(20),
            eps: c.opt_f64("hc_eps")?.unwrap_or(1e-6) as f32,
        }),
        ..Default::default()
    };
    cfg.validate().map_err(|e| bad(e.to_string()))?;
    Ok(cfg)
}

/// A tensor under DeepSeek's name as transformers saves it (`ds` behind
/// `model.`), as DeepSeek's own files hold it (`ds` at the root), or under
/// transformers' module name `hf`.
fn named(hf: &str, ds: String) -> Source {
    Source::tensor(format!("model.{ds}")).or(Source::tensor(ds).or(Source::tensor(hf)))
}

fn source(_: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    let f = cfg.moe.as_ref().map_or(0, |m| m.expert_ffn_dim);
    match id {
        // (transformers saves these few under their module names)
        TensorId::Embed => Source::tensor("model.embed_tokens.weight").or(Source::tensor("embed.weight")),
        TensorId::FinalNorm => Source::tensor("model.norm.weight").or(Source::tensor("norm.weight")),
        TensorId::LmHead => Source::tensor("head.weight").or(Source::tensor("lm_head.weight")),
        TensorId::HcHeadFn => Source::tensor("model.hc_head.hc_fn").or(Source::tensor("hc_head_fn")),
        TensorId::HcHeadBase => Source::tensor("model.hc_head.hc_base").or(Source::tensor("hc_head_base")),
        TensorId::HcHeadScale => Source::tensor("model.hc_head.hc_scale").or(Source::tensor("hc_head_scale")),
        TensorId::Layer(l, t) => {
            let (p, q) = (format!("model.layers.{l}"), format!("layers.{l}"));
            let a = |hf: &str, ds: &str| named(&format!("{p}.self_attn.{hf}"), format!("{q}.attn.{ds}"));
            let m = |hf: &str, ds: &str| named(&format!("{p}.mlp.{hf}"), format!("{q}.ffn.{ds}"));
            let top = |hf: &str, ds: &str| named(&format!("{p}.{hf}"), format!("{q}.{ds}"));
            match t {
                L::AttnNorm => top("input_layernorm.weight", "attn_norm.weight"),
                L::FfnNorm => top("post_attention_layernorm.weight", "ffn_norm.weight"),
                L::AttnHcFn => top("attn_hc.fn", "hc_attn_fn"),
                L::AttnHcBase => top("attn_hc.base", "hc_attn_base"),
                L::AttnHcScale => top("attn_hc.scale", "hc_attn_scale"),
                L::FfnHcFn => top("ffn_hc.fn", "hc_ffn_fn"),
                L::FfnHcBase => top("ffn_hc.base", "hc_ffn_base"),
                L::FfnHcScale => top("ffn_hc.scale", "hc_ffn_scale"),
                L::WqA => a("q_a_proj.weight", "wq_a.weight"),
                L::QANorm => a("q_a_norm.weight", "q_norm.weight"),
                L::WqB => a("q_b_proj.weight", "wq_b.weight"),
                L::Wkv => a("kv_proj.weight", "wkv.weight"),
                // (the Hub's `kv_norm`; transformers saves it as `norm`, undoing its `.norm.` rename)
                L::KvNorm => Source::tensor(format!("{p}.attn.norm.weight")).or(a("kv_norm.weight", "kv_norm.weight")),
                L::WoA => a("o_a_proj.weight", "wo_a.weight"),
                L::Wo => a("o_b_proj.weight", "wo_b.weight"),
                L::Sinks => a("sinks", "attn_sink"),
                L::PoolKv => a("compressor.kv_proj.weight", "compressor.wkv.weight"),
                L::PoolGate => a("compressor.gate_proj.weight", "compressor.wgate.weight"),
                L::PoolBias => a("compressor.position_bias", "compressor.ape"),
                L::PoolNorm => a("compressor.kv_norm.weight", "compressor.norm.weight"),
                L::IdxPoolKv => a("compressor.indexer.kv_proj.weight", "indexer.compressor.wkv.weight"),
                L::IdxPoolGate => a("compressor.indexer.gate_proj.weight", "indexer.compressor.wgate.weight"),
                L::IdxPoolBias => a("compressor.indexer.position_bias", "indexer.compressor.ape"),
                L::IdxPoolNorm => a("compressor.indexer.kv_norm.weight", "indexer.compressor.norm.weight"),
                L::IdxWq => a("compressor.indexer.q_b_proj.weight", "indexer.wq_b.weight"),
                L::IdxWeights => a("compressor.indexer.scorer.weights_proj.weight", "indexer.weights_proj.weight"),
                L::Router => m("gate.weight", "gate.weight"),
                L::RouterCorrection => m("gate.e_score_correction_bias", "gate.bias"),
                L::HashTable => m("gate.tid2eid", "gate.tid2eid"),
                L::SharedGate => m("shared_experts.gate_proj.weight", "shared_experts.w1.weight"),
                L::SharedUp => m("shared_experts.up_proj.weight", "shared_experts.w3.weight"),
                L::SharedDown => m("shared_experts.down_proj.weight", "shared_experts.w2.weight"),
                other => Source::tensor(format!("<{other:?} of layer {l} has no DeepSeek-V4 name>")),
            }
        }
        TensorId::Expert(l, e, t) => {
            let fused = |n: &str| Source::expert(format!("model.layers.{l}.mlp.experts.{n}"), e);
            let own = |w: &str, alt: Source| {
                let name = format!("layers.{l}.ffn.experts.{e}.{w}.weight");
                Source::tensor(format!("model.{name}")).or(Source::tensor(name).or(alt))
            };
            match t {
                X::Gate => own("w1", fused("gate_up_proj").rows(2 * f, 0, f)),
                X::Up => own("w3", fused("gate_up_proj").rows(2 * f, f, f)),
                X::Down => own("w2", fused("down_proj")),
                other => Source::tensor(format!("<{other:?} of expert {e} has no DeepSeek-V4 name>")),
            }
        }
        other => Source::tensor(format!("<{other} has no DeepSeek-V4 name>")),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn tiny(extra: &str) -> HfConfig {
        let text = format!(
            r#"{{"architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 50, "hidden_size": 32,
            "moe_intermediate_size": 12, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 16,
            "q_lora_rank": 8, "qk_rope_head_dim": 4, "n_routed_experts": 6, "num_experts_per_tok": 2,
            "o_groups": 2, "o_lora_rank": 6, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 2,
            "sliding_window": 5{extra}}}"#
        );
        HfConfig::parse(Path::new("config.json"), &text).unwrap()
    }

    #[test]
    fn hub_and_transformers_spellings_agree() {
        let hub = config(&tiny(r#", "compress_ratios": [128, 0, 4, 128, 0], "num_hash_layers": 1"#)).unwrap();
        let tf = config(&tiny(
            r#", "layer_types": ["heavily_compressed_attention", "sliding_attention",
               "compressed_sparse_attention", "heavily_compressed_attention"],
               "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
               "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}"#,
        ))
        .unwrap();
        assert_eq!(hub, tf);
        let pools: Vec<_> = hub.layers.iter().map(|l| l.mixer).collect();
        assert_eq!(pools[2], MixerSpec::Pooled { pool: Pool::Light });
        assert_eq!(hub.moe.as_ref().unwrap().hash_layers, 1);
        assert_eq!(hub.pooled().unwrap().rope_dim, 4);
    }

    #[test]
    fn bad_keys_are_named() {
        for (extra, key) in [
            (r#", "compress_ratios": [0, 5, 0, 0]"#, "compress_ratios"),
            (r#", "layer_types": ["full_attention", "x", "y", "z"]"#, "layer_types"),
            (r#", "num_key_value_heads": 2"#, "num_key_value_heads"),
            (r#", "swiglu_limit": 0"#, "swiglu_limit"),
        ] {
            let err = config(&tiny(extra)).unwrap_err();
            assert!(err.to_string().contains(key), "{extra}: {err}");
        }
    }
}
