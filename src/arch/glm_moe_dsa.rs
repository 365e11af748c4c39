//! GLM-5 (`GlmMoeDsaForCausalLM`), mirroring transformers'
//! `models/glm_moe_dsa/modeling_glm_moe_dsa.py` and
//! `configuration_glm_moe_dsa.py`: DeepSeek-V3.2's sparse attention (see
//! `deepseek_v32.rs`, whose config and tensor names it reuses) with two
//! differences, and GLM's class defaults.
//!
//! Quirks:
//! - the indexer rotates its rope part in adjacent pairs (transformers'
//!   `apply_rotary_pos_emb_interleave`), where DeepSeek-V3.2's rotates halves;
//! - IndexShare: a layer that `indexer_types` marks "shared" has no indexer
//!   (no `self_attn.indexer.*` tensors) and attends to the keys the layer
//!   before it selected (that layer's own or, if it shares too, the one it
//!   reused); without `indexer_types` the list comes from
//!   `index_topk_pattern` ("F"/"S" per layer) or else from `index_topk_freq`
//!   (default 1) and `index_skip_topk_offset` (default 2): layer i is "full"
//!   when max(i − offset + 1, 0) is a multiple of the frequency;
//! - the router is DeepSeek-V3's (sigmoid, correction bias, groups when
//!   `n_group` > 1; the class defaults to one group);
//! - class defaults: `rms_norm_eps` 1e-5 (the latent norms and the index key
//!   norm keep 1e-6), `index_n_heads` 32, `q_lora_rank` 2048,
//!   `max_position_embeddings` 202752, `first_k_dense_replace` 3;
//! - the multi-token-prediction layer past `num_hidden_layers` is skipped.

use serde_json::Value;

use super::deepseek_v32::{DefaultValue, DsaDefaults, dsa_config};
use super::{Arch, HfConfig};
use crate::canonical::config::ModelConfig;
use crate::error::{Error, Result};

pub static ARCH: Arch = Arch {
    hf_class: "GlmMoeDsaForCausalLM",
    model_type: "glm_moe_dsa",
    config,
    source: super::deepseek_v32::source,
    ignored: super::deepseek::past_the_layers,
};

const DEFAULTS: DsaDefaults = DsaDefaults {
    keys: &[
        ("n_group", DefaultValue::Int(1)),
        ("topk_group", DefaultValue::Int(1)),
        ("routed_scaling_factor", DefaultValue::Num(2.5)),
        ("n_shared_experts", DefaultValue::Int(1)),
        ("first_k_dense_replace", DefaultValue::Int(3)),
        ("max_position_embeddings", DefaultValue::Int(202752)),
        ("rms_norm_eps", DefaultValue::Num(1e-5)),
        ("q_lora_rank", DefaultValue::Int(2048)),
        ("index_topk", DefaultValue::Int(2048)),
        ("index_head_dim", DefaultValue::Int(128)),
        ("index_n_heads", DefaultValue::Int(32)),
    ],
    rope_interleaved: true,
};

fn config(c: &HfConfig) -> Result<ModelConfig> {
    let n = c.usize(&["num_hidden_layers"])?;
    dsa_config(c, &DEFAULTS, &shared_layers(c, n)?)
}

/// Which layers reuse the selection of the layer before them, from
/// `indexer_types`, `index_topk_pattern` or the frequency rule; a shared
/// layer with no layer before it is refused, naming the key.
fn shared_layers(c: &HfConfig, n: usize) -> Result<Vec<bool>> {
    let bad = |m: String| Error::checkpoint(&c.path, m);
    let (key, shared) = if let Some(v) = c.get("indexer_types") {
        let list = v.as_array().ok_or_else(|| bad(format!("`indexer_types` must be a list, got {v}")))?;
        let flags = list
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("full") => Ok(false),
                Some("shared") => Ok(true),
                _ => Err(bad(format!("`indexer_types[{i}]` is {t}; expected \"full\" or \"shared\""))),
            })
            .collect::<Result<Vec<_>>>()?;
        ("indexer_types", flags)
    } else if let Some(v) = c.get("index_topk_pattern") {
        let letters: Vec<String> = match v {
            Value::String(s) => s.chars().map(String::from).collect(),
            Value::Array(a) => a.iter().map(|x| x.as_str().unwrap_or("?").to_string()).collect(),
            _ => return Err(bad(format!("`index_topk_pattern` must be a string or a list, got {v}"))),
        };
        let flags = letters
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                "F" | "full" => Ok(false),
                "S" | "shared" => Ok(true),
                _ => Err(bad(format!("`index_topk_pattern[{i}]` is {t:?}; expected \"F\" or \"S\""))),
            })
            .collect::<Result<Vec<_>>>()?;
        ("index_topk_pattern", flags)
    } else {
        let freq = c.opt_usize("index_topk_freq")?.unwrap_or(1).max(1);
        let offset = c.opt_usize("index_skip_topk_offset")?.unwrap_or(2);
        let flags = (0..n).map(|i| !(i + 1).saturating_sub(offset).is_multiple_of(freq)).collect();
        ("index_topk_freq", flags)
    };
    if shared.len() != n {
        return Err(bad(format!("`{key}` lists {} layers, but num_hidden_layers is {n}", shared.len())));
    }
    if shared.first() == Some(&true) {
        return Err(bad(format!(
            "`{key}` makes layer 0 reuse the selection of an earlier indexer layer, and there is none"
        )));
    }
    Ok(shared)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::canonical::config::{FfnSpec, MixerSpec};

    fn tiny(extra: &str) -> HfConfig {
        let text = format!(
            r#"{{"architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 50, "hidden_size": 32,
            "intermediate_size": 40, "moe_intermediate_size": 12, "num_hidden_layers": 5,
            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 14, "kv_lora_rank": 10,
            "qk_nope_head_dim": 5, "qk_rope_head_dim": 6, "v_head_dim": 7, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "index_topk": 4, "index_head_dim": 10, "index_n_heads": 3{extra}}}"#
        );
        HfConfig::parse(Path::new("config.json"), &text).unwrap()
    }

    fn shared_of(extra: &str) -> Vec<bool> {
        let cfg = config(&tiny(extra)).unwrap();
        cfg.validate().unwrap();
        cfg.layers
            .iter()
            .map(|l| match l.mixer {
                MixerSpec::Sparse { shared } => shared,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    /// transformers' three spellings of IndexShare give its lists.
    #[test]
    fn index_share_follows_each_spelling() {
        let (f, s) = (false, true);
        assert_eq!(shared_of(""), [f, f, f, f, f], "default: every layer full");
        assert_eq!(shared_of(r#", "index_topk_freq": 2"#), [f, f, s, f, s]);
        assert_eq!(shared_of(r#", "index_topk_freq": 3, "index_skip_topk_offset": 1"#), [f, s, s, f, s]);
        assert_eq!(shared_of(r#", "index_topk_pattern": "FSSFS""#), [f, s, s, f, s]);
        let listed = r#", "indexer_types": ["full", "shared", "full", "shared", "shared"]"#;
        assert_eq!(shared_of(listed), [f, s, f, s, s]);
        let cfg = config(&tiny("")).unwrap();
        assert!(cfg.mla().unwrap().indexer.unwrap().rope_interleaved);
        assert_eq!(cfg.norm.eps, 1e-5);
        assert_eq!(cfg.layers[2].ffn, FfnSpec::Dense { ffn_dim: 40 }, "first_k_dense_replace defaults to 3");
    }

    /// A shared first layer (no indexer before it) and malformed lists are
    /// checkpoint errors naming the key.
    #[test]
    fn bad_index_share_lists_are_named() {
        for (extra, key) in [
            (r#", "indexer_types": ["shared", "full", "full", "full", "full"]"#, "indexer_types"),
            (r#", "index_topk_pattern": "SFFFF""#, "index_topk_pattern"),
            (r#", "indexer_types": ["full", "full"]"#, "indexer_types"),
            (r#", "indexer_types": ["full", "sparse", "full", "full", "full"]"#, "indexer_types[1]"),
        ] {
            let err = config(&tiny(extra)).unwrap_err();
            assert!(matches!(err, Error::Checkpoint { .. }), "{extra}: {err}");
            assert!(err.to_string().contains(key), "{extra}: {err}");
        }
    }
}
