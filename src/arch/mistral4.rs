//! Mistral Small 4 (`Mistral4ForCausalLM`, and
//! `Mistral3ForConditionalGeneration` with a `mistral4` text model, as the
//! Hub ships it), mirroring transformers' `models/mistral4/modeling_mistral4.py`
//! and, for the nesting, `models/mistral3/modeling_mistral3.py`.
//!
//! Quirks:
//! - the attention is DeepSeek-V3's latent attention (read through the
//!   DeepSeek-V3 adapter: low-rank q, latent and shared rope key, `kv_b_proj`
//!   split into the absorbed up-projections, latent norms at eps 1e-6, rope on
//!   adjacent pairs unless `rope_interleave` is false, score scale
//!   1/√(nope + rope) times mscale(factor, mscale_all_dim)² under YaRN), plus
//!   Llama-4's attention temperature: after RoPE, the whole query at position
//!   p is multiplied by `1 + llama_4_scaling_beta · ln(1 + ⌊p /
//!   original_max_position_embeddings⌋)`, both read from the rope parameters
//!   (transformers fails without them, so a config without them is refused);
//! - `config.json`'s `head_dim` is nope + rope here, and the rope parameters
//!   carry `partial_rotary_factor` = rope / head_dim: the rotated width is
//!   `qk_rope_head_dim` either way;
//! - routing is a softmax over all experts; groups (`n_group`) are scored by
//!   the sum of their two best probabilities and the `topk_group` best kept
//!   (the others masked with 0, which chooses as −∞ does since every kept
//!   probability is above 0); weights are the chosen probabilities,
//!   renormalised with `norm_topk_prob` (default true), times
//!   `routed_scaling_factor`; no correction bias;
//! - layers below `first_k_dense_replace` (default 0) are dense; the MoE layers
//!   add `n_shared_experts` (default 1) shared experts as one ungated MLP;
//! - transformers has no per-expert conversion for this family: checkpoints
//!   hold each layer's experts stacked (`mlp.experts.gate_up_proj` [E, 2F, D],
//!   gate rows first; `mlp.experts.down_proj` [E, D, F]); per-expert tensors
//!   are read too;
//! - nested in `Mistral3ForConditionalGeneration`, the language model's config
//!   is `text_config` (whose `model_type` must be `mistral4`) and its tensors
//!   live under `language_model.model.`, the head at
//!   `language_model.lm_head.weight` (the names transformers writes for this
//!   class; those it holds in memory, `model.language_model.` and a root
//!   `lm_head.weight`, are read too); whether
//!   the head is tied is the top level's `tie_word_embeddings`, which
//!   transformers defaults to true there. colibri converts the language model
//!   and runs text only: the vision tower and the multimodal projector are
//!   skipped.

use serde_json::{Value, json};

use super::{Arch, HfConfig, Source, deepseek, qwen_moe_name, text_config};
use crate::canonical::config::*;
use crate::canonical::tensors::{ExpertTensor as X, TensorId};
use crate::error::{Error, Result};

/// Mistral Small 4, the language model on its own.
pub static ARCH: Arch =
    Arch { hf_class: "Mistral4ForCausalLM", model_type: "mistral4", config, source, ignored: super::nothing_ignored };

/// Mistral Small 4 as the Hub ships it, with a vision tower.
pub static MISTRAL3: Arch = Arch {
    hf_class: "Mistral3ForConditionalGeneration",
    model_type: "mistral3",
    config,
    source,
    ignored: skips_vision,
};

/// A conditional-generation checkpoint (the language model nested).
fn nested(hf: &HfConfig) -> bool {
    hf.get("text_config").is_some()
}

fn config(hf: &HfConfig) -> Result<ModelConfig> {
    let c = &text_config(hf);
    if nested(hf) && c.str("model_type") != Some("mistral4") {
        return Err(Error::Unsupported(format!(
            "{}: Mistral3ForConditionalGeneration is supported with a `mistral4` language model (Mistral Small 4), \
             not text_config.model_type {:?}",
            hf.path.display(),
            c.str("model_type").unwrap_or("(none)")
        )));
    }
    let with_defaults = HfConfig { raw: with_transformers_defaults(c), path: c.path.clone() };
    let mut cfg = (deepseek::V3.config)(&with_defaults)?;
    if let Some(moe) = cfg.moe.as_mut() {
        moe.router.score = RouterScore::Softmax;
        moe.router.correction_bias = false;
    }
    cfg.attention.temperature = Some(temperature(&with_defaults)?);
    if nested(hf) {
        cfg.tie_embeddings = hf.bool_or("tie_word_embeddings", true)?;
    }
    Ok(cfg)
}

/// The config with transformers' `Mistral4Config` defaults where it is
/// silent and the DeepSeek-V3 adapter would assume otherwise.
fn with_transformers_defaults(c: &HfConfig) -> Value {
    let mut raw = c.raw.clone();
    let Value::Object(map) = &mut raw else { return raw };
    let absent = |map: &serde_json::Map<String, Value>, key: &str| map.get(key).is_none_or(Value::is_null);
    for (key, v) in [("n_shared_experts", json!(1)), ("max_position_embeddings", json!(1_048_576))] {
        if absent(map, key) {
            map.insert(key.into(), v);
        }
    }
    if absent(map, "rope_parameters") && absent(map, "rope_scaling") {
        let nope = map.get("qk_nope_head_dim").and_then(Value::as_f64).unwrap_or(64.0);
        let rope = map.get("qk_rope_head_dim").and_then(Value::as_f64).unwrap_or(64.0);
        let max_pos = map.get("max_position_embeddings").cloned().unwrap_or(json!(1_048_576));
        map.insert(
            "rope_parameters".into(),
            json!({
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 128.0,
                "original_max_position_embeddings": 8192,
                "max_position_embeddings": max_pos,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale_all_dim": 1.0,
                "mscale": 1.0,
                "llama_4_scaling_beta": 0.1,
                "partial_rotary_factor": rope / (nope + rope),
            }),
        );
    }
    raw
}

/// Llama-4's attention temperature from the rope parameters.
fn temperature(c: &HfConfig) -> Result<AttentionTemperature> {
    let params = ["rope_parameters", "rope_scaling"].iter().find_map(|k| c.get(k).filter(|p| p.is_object()));
    let num = |key: &str| {
        params.and_then(|p| p.get(key)).filter(|v| !v.is_null()).ok_or_else(|| {
            Error::checkpoint(
                &c.path,
                format!("Mistral 4 needs `{key}` in the rope parameters (the attention temperature)"),
            )
        })
    };
    let beta = num("llama_4_scaling_beta")?;
    let beta = beta
        .as_f64()
        .ok_or_else(|| Error::checkpoint(&c.path, format!("`llama_4_scaling_beta` must be a number, got {beta}")))?;
    let period = num("original_max_position_embeddings")?;
    let period = period.as_u64().filter(|&p| p > 0).ok_or_else(|| {
        Error::checkpoint(
            &c.path,
            format!("`original_max_position_embeddings` must be a positive integer, got {period}"),
        )
    })?;
    Ok(AttentionTemperature { beta: beta as f32, period: period as usize })
}

fn source(hf: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    let c = text_config(hf);
    let plain = (deepseek::V3.source)(&c, cfg, id);
    let f = cfg.moe.as_ref().map_or(0, |m| m.expert_ffn_dim);
    let primary = match id {
        // Stacked first (what transformers reads), then one tensor per expert.
        TensorId::Expert(l, e, t @ (X::Gate | X::Up | X::Down)) => {
            let stacked = |n: &str| Source::expert(format!("model.layers.{l}.mlp.experts.{n}"), e);
            let s = match t {
                X::Gate => stacked("gate_up_proj").rows(2 * f, 0, f),
                X::Up => stacked("gate_up_proj").rows(2 * f, f, f),
                _ => stacked("down_proj"),
            };
            s.or(Source::tensor(qwen_moe_name(id).unwrap_or_default()))
        }
        _ => plain,
    };
    if nested(hf) { nest(primary) } else { primary }
}

/// The nested names of a source and its fallbacks: `language_model.model.X`
/// and `language_model.lm_head.weight` as transformers saves the class, else
/// the in-memory `model.language_model.X` and `lm_head.weight`.
fn nest(s: Source) -> Source {
    let (saved, held) = match s.name.strip_prefix("model.") {
        Some(rest) => (format!("language_model.model.{rest}"), format!("model.language_model.{rest}")),
        None => (format!("language_model.{}", s.name), s.name.clone()),
    };
    let otherwise = s.otherwise.clone().map(|alt| Box::new(nest(*alt)));
    let first = Source { name: saved, otherwise: None, ..s.clone() };
    let second = Source { name: held, otherwise, ..s };
    first.or(second)
}

/// The vision tower and the projector, under either layout, and a stored
/// head that transformers replaces by the embedding when the top level ties
/// them.
fn skips_vision(hf: &HfConfig, name: &str) -> bool {
    let tied = hf.bool_or("tie_word_embeddings", true).unwrap_or(true);
    let bare = name.strip_prefix("model.").unwrap_or(name);
    bare.starts_with("vision_tower.")
        || bare.starts_with("multi_modal_projector.")
        || (tied && (name == "lm_head.weight" || name == "language_model.lm_head.weight"))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const TEXT: &str = r#""vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 6,
        "qk_rope_head_dim": 4, "v_head_dim": 5, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
        "num_experts_per_tok": 2"#;

    fn parse(text: &str) -> HfConfig {
        HfConfig::parse(Path::new("config.json"), text).unwrap()
    }

    #[test]
    fn defaults_give_the_hub_rope_and_the_temperature() {
        let cfg = config(&parse(&format!(r#"{{"architectures": ["Mistral4ForCausalLM"], {TEXT}}}"#))).unwrap();
        assert_eq!(cfg.attention.temperature, Some(AttentionTemperature { beta: 0.1, period: 8192 }));
        assert!(matches!(cfg.rope.scaling, RopeScaling::Yarn { .. }));
        assert_eq!(cfg.rope.rotary_dim, 4);
        let moe = cfg.moe.as_ref().unwrap();
        assert_eq!(
            (moe.router.score, moe.router.correction_bias, moe.router.renormalize),
            (RouterScore::Softmax, false, true)
        );
        assert_eq!(moe.shared_expert.as_ref().unwrap().ffn_dim, 8);
        let t = cfg.attention.temperature.unwrap();
        assert_eq!((t.at(0), t.at(8191)), (1.0, 1.0));
        assert!((t.at(8192) - (1.0 + 0.1 * 2f32.ln())).abs() < 1e-7);
    }

    #[test]
    fn rope_parameters_without_the_beta_are_refused_by_name() {
        let text = format!(
            r#"{{"architectures": ["Mistral4ForCausalLM"], {TEXT},
            "rope_parameters": {{"rope_type": "default", "rope_theta": 10000.0}}}}"#
        );
        let err = config(&parse(&text)).unwrap_err().to_string();
        assert!(err.contains("llama_4_scaling_beta"), "{err}");
    }

    #[test]
    fn nested_configs_need_a_mistral4_text_model_and_tie_from_the_top() {
        let nested = |model_type: &str, top: &str| {
            parse(&format!(
                r#"{{"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3" {top},
                "text_config": {{"model_type": "{model_type}", {TEXT}}}, "vision_config": {{}}}}"#
            ))
        };
        assert!(config(&nested("mistral4", "")).unwrap().tie_embeddings);
        assert!(!config(&nested("mistral4", r#", "tie_word_embeddings": false"#)).unwrap().tie_embeddings);
        let err = config(&nested("mistral", "")).unwrap_err().to_string();
        assert!(err.contains("mistral4"), "{err}");
    }

    #[test]
    fn nested_names_fall_back_to_the_older_layout() {
        let hf = parse(&format!(
            r#"{{"architectures": ["Mistral3ForConditionalGeneration"], "tie_word_embeddings": false,
            "text_config": {{"model_type": "mistral4", {TEXT}}}}}"#
        ));
        let cfg = config(&hf).unwrap();
        let names = |s: Source| {
            let mut out = vec![s.name.clone()];
            let mut alt = s.otherwise;
            while let Some(a) = alt {
                out.push(a.name.clone());
                alt = a.otherwise;
            }
            out
        };
        assert_eq!(names(source(&hf, &cfg, TensorId::LmHead)), ["language_model.lm_head.weight", "lm_head.weight"]);
        let gate = names(source(&hf, &cfg, TensorId::Expert(1, 3, X::Gate)));
        assert_eq!(
            gate,
            [
                "language_model.model.layers.1.mlp.experts.gate_up_proj",
                "model.language_model.layers.1.mlp.experts.gate_up_proj",
                "language_model.model.layers.1.mlp.experts.3.gate_proj.weight",
                "model.language_model.layers.1.mlp.experts.3.gate_proj.weight",
            ]
        );
        assert!(skips_vision(&hf, "model.vision_tower.patch_conv.weight"));
        assert!(skips_vision(&hf, "multi_modal_projector.linear_1.weight"));
        assert!(!skips_vision(&hf, "language_model.model.norm.weight"));
        assert!(!skips_vision(&hf, "lm_head.weight"));
    }
}
