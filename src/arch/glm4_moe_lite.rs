//! GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`), mirroring transformers'
//! `models/glm4_moe_lite/modeling_glm4_moe_lite.py`: DeepSeek-V3's latent
//! attention under GLM-4.5's MoE block, which routes as DeepSeek-V3 does.
//!
//! Quirks:
//! - the attention is transformers' `DeepseekV3Attention` unchanged (q
//!   low-rank path, latent and shared rope key, `kv_b_proj` split into the
//!   absorbed key and value up-projections; latent norms at eps 1e-6 whatever
//!   `rms_norm_eps` says; rope on adjacent pairs unless `rope_interleave` is
//!   false; the score scale takes mscale² under YaRN with `mscale_all_dim`),
//!   so the config and tensor names are read through the DeepSeek-V3 adapter;
//! - `config.json`'s `head_dim` is the rope width (an alias of
//!   `qk_rope_head_dim`), not the query head width;
//! - which layers are dense is `mlp_layer_types` (`"dense"` / `"sparse"` per
//!   layer), defaulting to the first layer dense and the rest sparse;
//!   transformers never reads `first_k_dense_replace` for this family, so a
//!   value there is ignored;
//! - routing: sigmoid, the choice adds `e_score_correction_bias` within the
//!   `topk_group` best of `n_group` groups (sum of their two best), weights
//!   renormalised with `norm_topk_prob`, times `routed_scaling_factor`; one
//!   ungated shared MLP of `n_shared_experts · moe_intermediate_size`;
//! - transformers' defaults where config.json is silent: `rms_norm_eps`
//!   1e-5, `routed_scaling_factor` 1.8, `n_shared_experts` 1;
//! - the multi-token-prediction layer past `num_hidden_layers` is skipped.

use serde_json::{Value, json};

use super::{Arch, HfConfig, Source, deepseek};
use crate::canonical::config::*;
use crate::canonical::tensors::TensorId;
use crate::error::{Error, Result};

pub static ARCH: Arch = Arch {
    hf_class: "Glm4MoeLiteForCausalLM",
    model_type: "glm4_moe_lite",
    config,
    source,
    ignored: deepseek::past_the_layers,
};

fn config(c: &HfConfig) -> Result<ModelConfig> {
    // transformers' `Glm4MoeLiteConfig` defaults that differ from what the
    // DeepSeek-V3 adapter assumes for an absent key.
    let defaults =
        [("rms_norm_eps", json!(1e-5)), ("routed_scaling_factor", json!(1.8)), ("n_shared_experts", json!(1))];
    let mut raw = c.raw.clone();
    if let Value::Object(map) = &mut raw {
        for (key, v) in defaults {
            if map.get(key).is_none_or(Value::is_null) {
                map.insert(key.into(), v);
            }
        }
        // transformers takes the dense layers from `mlp_layer_types` only.
        map.remove("first_k_dense_replace");
    }
    let with_defaults = HfConfig { raw, path: c.path.clone() };
    let mut cfg = (deepseek::V3.config)(&with_defaults)?;
    let n = cfg.layers.len();
    let dense_ffn = c.usize(&["intermediate_size"])?;
    for (layer, sparse) in cfg.layers.iter_mut().zip(sparse_layers(c, n)?) {
        layer.ffn = if sparse { FfnSpec::Moe } else { FfnSpec::Dense { ffn_dim: dense_ffn } };
    }
    cfg.max_seq_len = c.opt_usize("max_position_embeddings")?.unwrap_or(202752);
    Ok(cfg)
}

/// `mlp_layer_types` as "MoE?" flags; without it, every layer but the first.
fn sparse_layers(c: &HfConfig, n: usize) -> Result<Vec<bool>> {
    let Some(v) = c.get("mlp_layer_types") else { return Ok((0..n).map(|l| l > 0).collect()) };
    let list =
        v.as_array().ok_or_else(|| Error::checkpoint(&c.path, format!("`mlp_layer_types` must be a list, got {v}")))?;
    if list.len() != n {
        return Err(Error::checkpoint(
            &c.path,
            format!("`mlp_layer_types` lists {} layers, but num_hidden_layers is {n}", list.len()),
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("sparse") => Ok(true),
            Some("dense") => Ok(false),
            _ => Err(Error::checkpoint(
                &c.path,
                format!("`mlp_layer_types[{i}]` is {t}; expected \"dense\" or \"sparse\""),
            )),
        })
        .collect()
}

fn source(hf: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    (deepseek::V3.source)(hf, cfg, id)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn hub_like(extra: &str) -> HfConfig {
        let text = format!(
            r#"{{"architectures": ["Glm4MoeLiteForCausalLM"], "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 48, "moe_intermediate_size": 8, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 8,
            "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5, "n_routed_experts": 8,
            "num_experts_per_tok": 2 {extra}}}"#
        );
        HfConfig::parse(Path::new("config.json"), &text).unwrap()
    }

    #[test]
    fn transformers_defaults_apply_where_the_config_is_silent() {
        let cfg = config(&hub_like(r#", "first_k_dense_replace": 2"#)).unwrap();
        assert_eq!(cfg.norm.eps, 1e-5);
        let moe = cfg.moe.as_ref().unwrap();
        assert_eq!(moe.router.scale, 1.8);
        assert_eq!(moe.shared_expert.as_ref().unwrap().ffn_dim, 8);
        // first_k_dense_replace is not read: only layer 0 is dense.
        let ffn: Vec<_> = cfg.layers.iter().map(|l| l.ffn.clone()).collect();
        assert_eq!(ffn, [FfnSpec::Dense { ffn_dim: 48 }, FfnSpec::Moe, FfnSpec::Moe]);
    }

    #[test]
    fn mlp_layer_types_choose_the_dense_layers() {
        let cfg = config(&hub_like(r#", "mlp_layer_types": ["sparse", "dense", "sparse"]"#)).unwrap();
        let ffn: Vec<_> = cfg.layers.iter().map(|l| l.ffn.clone()).collect();
        assert_eq!(ffn, [FfnSpec::Moe, FfnSpec::Dense { ffn_dim: 48 }, FfnSpec::Moe]);
        let err = config(&hub_like(r#", "mlp_layer_types": ["sparse", "dense"]"#)).unwrap_err().to_string();
        assert!(err.contains("mlp_layer_types"), "{err}");
        let err = config(&hub_like(r#", "mlp_layer_types": ["sparse", "moe", "dense"]"#)).unwrap_err().to_string();
        assert!(err.contains("mlp_layer_types[1]"), "{err}");
    }
}
