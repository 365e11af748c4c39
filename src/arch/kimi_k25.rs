//! Kimi-K2.5 (`KimiK25ForConditionalGeneration`, model_type `kimi_k25`) as
//! the Hub ships it, mirroring transformers'
//! `models/kimi_k25/modeling_kimi_k25.py`: a DeepSeek-V3 language model
//! (`text_config`, model_type `kimi_k2`, read by [`super::deepseek`]) beside
//! a MoonViT vision tower and its projector. colibri converts the language
//! model and runs text only.
//!
//! Quirks:
//! - the Hub checkpoint keeps the language model under `language_model.model.*`
//!   and its head as `language_model.lm_head.weight`; transformers renames
//!   them to `model.language_model.*` and `lm_head.weight` on load (and a
//!   checkpoint it saved may use those): both are read;
//! - `vision_tower.*` and `mm_projector.*` are skipped (and listed in the
//!   file as not converted), as are multi-token-prediction layers past
//!   `num_hidden_layers`;
//! - transformers' `Kimi_K25Config` ties the head to the embedding by
//!   default, but leaves them untied when the checkpoint holds a head that
//!   differs; here `tie_word_embeddings` is read from the top level, else
//!   from `text_config`, else taken as false, and a checkpoint without a
//!   head falls back to the embedding;
//! - on text-only input transformers swaps the media placeholder ids
//!   (`image_token_id`, `video_token_id`) for id 0 before the embedding
//!   lookup; colibri embeds every id as it is (the placeholders only mean
//!   something with media, which colibri does not take);
//! - the routed experts of the released checkpoints are compressed-tensors
//!   int4 (`weight_packed` / `weight_scale` / `weight_shape`, read by
//!   `convert/safetensors.rs`), declared in `text_config.quantization_config`
//!   or at the top level.

use serde_json::Value;

use super::{Arch, HfConfig, Source, deepseek};
use crate::canonical::config::ModelConfig;
use crate::canonical::tensors::TensorId;
use crate::error::Result;

/// Kimi-K2.5 (and later K2.x releases of the same layout).
pub static ARCH: Arch = Arch {
    hf_class: "KimiK25ForConditionalGeneration",
    model_type: "kimi_k25",
    config,
    source,
    ignored: not_the_language_model,
};

/// The language model's config: `text_config` with the tie flag resolved
/// (top level, else its own, else false).
fn text_config(hf: &HfConfig) -> HfConfig {
    let mut raw = match hf.get("text_config") {
        Some(Value::Object(t)) => t.clone(),
        _ => return HfConfig { raw: hf.raw.clone(), path: hf.path.clone() },
    };
    let tie = hf.get("tie_word_embeddings").or_else(|| raw.get("tie_word_embeddings").filter(|v| !v.is_null()));
    let tie = tie.cloned().unwrap_or(Value::Bool(false));
    raw.insert("tie_word_embeddings".into(), tie);
    HfConfig { raw: Value::Object(raw), path: hf.path.clone() }
}

fn config(hf: &HfConfig) -> Result<ModelConfig> {
    deepseek::config_v3(&text_config(hf))
}

/// A DeepSeek name in the Hub layout, falling back to transformers' own,
/// then to `last` when given.
fn nested(s: Source, last: Option<Source>) -> Source {
    let (hub, native) = match s.name.strip_prefix("model.") {
        Some(rest) => (format!("language_model.model.{rest}"), format!("model.language_model.{rest}")),
        None => (format!("language_model.{}", s.name), s.name.clone()),
    };
    let native = Source { name: native, ..s.clone() };
    let native = match last {
        Some(l) => native.or(l),
        None => native,
    };
    Source { name: hub, ..s }.or(native)
}

fn source(hf: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    let text = text_config(hf);
    // Without a head of its own the checkpoint's embedding is the head.
    let last = (id == TensorId::LmHead).then(|| nested(deepseek::source(&text, cfg, TensorId::Embed), None));
    nested(deepseek::source(&text, cfg, id), last)
}

/// The vision tower, its projector and the layers past the language model's.
fn not_the_language_model(hf: &HfConfig, name: &str) -> bool {
    let rest = name.strip_prefix("model.").unwrap_or(name);
    if rest.starts_with("vision_tower.") || rest.starts_with("mm_projector.") {
        return true;
    }
    let lm = name.strip_prefix("language_model.").or_else(|| name.strip_prefix("model.language_model."));
    match lm {
        Some(rest) => {
            let as_text = if name.starts_with("model.") { format!("model.{rest}") } else { rest.to_string() };
            deepseek::past_the_layers(&text_config(hf), &as_text)
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn hf(text: &str) -> HfConfig {
        HfConfig::parse(Path::new("config.json"), text).unwrap()
    }

    #[test]
    fn names_are_nested_with_transformers_spelling_as_fallback() {
        let s = nested(Source::tensor("model.layers.1.mlp.experts.0.up_proj.weight"), None);
        assert_eq!(s.name, "language_model.model.layers.1.mlp.experts.0.up_proj.weight");
        assert_eq!(s.otherwise.as_ref().unwrap().name, "model.language_model.layers.1.mlp.experts.0.up_proj.weight");
        let h = nested(Source::tensor("lm_head.weight"), Some(Source::tensor("model.embed_tokens.weight")));
        let chain: Vec<&str> =
            std::iter::successors(Some(&h), |s| s.otherwise.as_deref()).map(|s| s.name.as_str()).collect();
        assert_eq!(chain, ["language_model.lm_head.weight", "lm_head.weight", "model.embed_tokens.weight"]);
    }

    #[test]
    fn tie_flag_top_level_then_text_then_false() {
        let tie = |t: &str| text_config(&hf(t)).raw["tie_word_embeddings"].clone();
        assert_eq!(tie(r#"{"text_config": {}}"#), Value::Bool(false));
        assert_eq!(tie(r#"{"text_config": {"tie_word_embeddings": true}}"#), Value::Bool(true));
        assert_eq!(
            tie(r#"{"tie_word_embeddings": false, "text_config": {"tie_word_embeddings": true}}"#),
            Value::Bool(false)
        );
    }

    #[test]
    fn skips_vision_and_mtp_only() {
        let c = hf(r#"{"text_config": {"num_hidden_layers": 2}}"#);
        for n in ["vision_tower.encoder.blocks.0.wqkv.weight", "mm_projector.proj.0.weight", "model.vision_tower.x"] {
            assert!(not_the_language_model(&c, n), "{n}");
        }
        assert!(not_the_language_model(&c, "language_model.model.layers.2.eh_proj.weight"));
        assert!(not_the_language_model(&c, "model.language_model.layers.2.eh_proj.weight"));
        assert!(!not_the_language_model(&c, "language_model.model.layers.1.mlp.gate.weight"));
        assert!(!not_the_language_model(&c, "language_model.lm_head.weight"));
    }
}
