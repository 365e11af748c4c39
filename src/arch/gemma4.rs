//! Gemma 4 with experts (`Gemma4ForConditionalGeneration` as the Hub ships
//! Gemma-4-26B-A4B, and the text-only `Gemma4ForCausalLM`), mirroring
//! transformers' `models/gemma4/modeling_gemma4.py` and
//! `configuration_gemma4.py`. colibri runs the language model on text: the
//! vision and audio towers and their embedders are skipped.
//!
//! Quirks:
//! - `layer_types` mixes `sliding_attention` (window `sliding_window`) and
//!   `full_attention` layers (five to one on the Hub; without the list every
//!   sixth layer is full); transformers forces the last layer to full;
//! - the full ("global") layers have their own shape: `global_head_dim`
//!   (default 512) and, with `attention_k_eq_v`, `num_global_key_value_heads`;
//!   transformers 5.24 writes the same as `per_layer_config` (both are read).
//!   With `attention_k_eq_v` they have no `v_proj`: the values are the key
//!   projection's output, taken before `k_norm` and RoPE;
//! - RoPE per layer type: `rope_parameters.sliding_attention` (default,
//!   θ 1e4, the whole head) and `rope_parameters.full_attention`, of type
//!   "proportional": the first `partial_rotary_factor · Dh / 2` frequencies
//!   of the whole head's ladder (exponent `2i / Dh`, not over the rotated
//!   part), the rest 0, rotated over the whole head (pairs `i`, `i + Dh/2`);
//! - per-head `q_norm` and `k_norm` with weights, `v_norm` without; the
//!   attention scale is 1 (no 1/√Dh);
//! - sandwich norms: `post_attention_layernorm` normalises the attention
//!   output and `post_feedforward_layernorm` the FFN output, before each
//!   residual add; every RMSNorm scales by plain `w` (not Gemma 2/3's `1 + w`);
//! - the FFN runs a dense MLP and the experts side by side on the same
//!   residual: the MLP on `pre_feedforward_layernorm(x)`, its output normed by
//!   `post_feedforward_layernorm_1`; the experts on
//!   `pre_feedforward_layernorm_2(x)`, their sum normed by
//!   `post_feedforward_layernorm_2`; the two added, then
//!   `post_feedforward_layernorm`. The dense MLP is colibri's shared expert;
//! - the router reads the residual, not a normed input: an RMSNorm without
//!   weight, times `router.scale` [D] and `D^-1/2`, then `router.proj`;
//!   softmax over all experts, top-k, renormalised, then each weight times
//!   `router.per_expert_scale[e]`;
//! - experts are stacked: `experts.gate_up_proj` [E, 2F, D] (gate rows
//!   first) and `experts.down_proj` [E, D, F]; every MLP is GeGLU with the
//!   tanh GELU (`gelu_pytorch_tanh`);
//! - the embedding is multiplied by `√D`; each layer's output by its
//!   `layer_scalar` (a stored buffer); the logits are soft-capped,
//!   `c · tanh(logits / c)`, `c = final_logit_softcapping`;
//! - refused: per-layer input embeddings (`hidden_size_per_layer_input`, the
//!   small Gemma 4 models; 0 on 26B-A4B), KV sharing across layers
//!   (`num_kv_shared_layers`), bidirectional attention, and Gemma 4 without
//!   the MoE block.

use serde_json::{Map, Value};

use super::{Arch, HfConfig, Source};
use crate::canonical::config::*;
use crate::canonical::tensors::{ExpertTensor as X, LayerTensor as L, TensorId};
use crate::error::{Error, Result};

/// Gemma 4 as the Hub ships it, with vision (and audio) towers.
pub static GEMMA4: Arch =
    Arch { hf_class: "Gemma4ForConditionalGeneration", model_type: "gemma4", config, source, ignored: skips_towers };

/// The Gemma 4 language model on its own.
pub static GEMMA4_TEXT: Arch =
    Arch { hf_class: "Gemma4ForCausalLM", model_type: "gemma4_text", config, source, ignored: super::nothing_ignored };

fn config(hf: &HfConfig) -> Result<ModelConfig> {
    let c = &super::text_config(hf);
    let err = |msg: String| Error::checkpoint(&c.path, msg);
    match c.str("hidden_activation").unwrap_or("gelu_pytorch_tanh") {
        "gelu_pytorch_tanh" => {}
        other => {
            return Err(Error::Unsupported(format!(
                "{}: hidden_activation = \"{other}\" is not supported (only gelu_pytorch_tanh)",
                c.path.display()
            )));
        }
    }
    // Per-layer input embeddings: absent means the class default (256, on);
    // null or 0 means off.
    let ple = match c.raw.get("hidden_size_per_layer_input") {
        None => 256,
        Some(Value::Null) => 0,
        Some(_) => c.opt_usize("hidden_size_per_layer_input")?.unwrap_or(0),
    };
    if ple != 0 {
        return Err(err(format!(
            "config field `hidden_size_per_layer_input` = {ple}: per-layer input embeddings (the small Gemma 4 \
             models) are not supported; the MoE Gemma 4 sets it to 0"
        )));
    }
    if let Some(shared) = c.opt_usize("num_kv_shared_layers")?.filter(|&s| s > 0) {
        return Err(err(format!(
            "config field `num_kv_shared_layers` = {shared}: layers that reuse another layer's keys and values \
             are not supported"
        )));
    }
    if let Some(mode) = c.str("use_bidirectional_attention").filter(|m| *m == "all") {
        return Err(err(format!("config field `use_bidirectional_attention` = \"{mode}\" is not supported")));
    }
    if !c.bool_or("enable_moe_block", false)? {
        return Err(err("config field `enable_moe_block` is false: colibri runs the MoE Gemma 4 only".into()));
    }
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let n = c.usize(&["num_hidden_layers"])?;
    let head_dim = c.opt_usize("head_dim")?.unwrap_or(256);
    let kv_heads = c.opt_usize("num_key_value_heads")?.unwrap_or(4);
    let mut slides = super::layer_types(c, n)?.unwrap_or_else(|| (0..n).map(|l| (l + 1) % 6 != 0).collect());
    if let Some(last) = slides.last_mut() {
        *last = false; // transformers forces the last layer to full attention
    }
    let window = c.opt_usize("sliding_window")?.unwrap_or(512);
    if window == 0 {
        return Err(err("config field `sliding_window` must be at least 1".into()));
    }
    let k_eq_v = c.bool_or("attention_k_eq_v", false)?;
    let bias = c.bool_or("attention_bias", false)?;
    if bias && k_eq_v {
        return Err(err("`attention_bias` with `attention_k_eq_v` is not supported".into()));
    }
    let (global_dh, global_kv) = global_shape(c, &slides, kv_heads, k_eq_v)?;
    let max_pos = c.opt_usize("max_position_embeddings")?.unwrap_or(131072);
    let rope_of = |kind: &str, dh: usize| rope(c, kind, dh, max_pos);
    let e = c.usize(&["num_experts"])?;
    let softcap = c.opt_f64("final_logit_softcapping")?.map(|v| v as f32);
    Ok(ModelConfig {
        vocab_size: c.opt_usize("vocab_size")?.unwrap_or(262144),
        hidden_size: d,
        num_heads: h,
        num_kv_heads: kv_heads,
        head_dim,
        max_seq_len: max_pos,
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6)),
        rope: rope_of("sliding_attention", head_dim)?,
        attention: AttentionSpec {
            qkv_bias: bias,
            o_bias: bias,
            qk_norm: QkNorm::PerHead,
            softmax_scale: Some(1.0),
            value_norm: true,
            ..Default::default()
        },
        moe: Some(MoeSpec {
            num_experts: e,
            expert_ffn_dim: c.usize(&["moe_intermediate_size"])?,
            router: RouterSpec {
                top_k: c.usize(&["top_k_experts"])?,
                renormalize: true,
                own_norm: Some((1.0 / (d as f64).sqrt()) as f32),
                expert_scale: true,
                ..Default::default()
            },
            activation: Activation::GeluTanh,
            shared_expert: Some(SharedExpertSpec { ffn_dim: c.usize(&["intermediate_size"])?, sigmoid_gate: false }),
            branch_norms: true,
            ..Default::default()
        }),
        global_attention: Some(GlobalAttentionSpec {
            head_dim: global_dh,
            num_kv_heads: global_kv,
            rope: rope_of("full_attention", global_dh)?,
            values_from_keys: k_eq_v,
        }),
        layers: slides
            .iter()
            .map(|&s| LayerSpec { mixer: MixerSpec::Attention { window: s.then_some(window) }, ffn: FfnSpec::Moe })
            .collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", true)?,
        scales: Scales { embedding: (d as f64).sqrt() as f32, ..Default::default() },
        logit_softcap: softcap,
        post_norms: true,
        layer_scale: true,
        ..Default::default()
    })
}

/// The full-attention layers' (head width, kv heads): `per_layer_config` as
/// transformers 5.24 writes it (the same for every full layer, nothing for
/// the sliding ones), else `global_head_dim` (default 512) and, when keys
/// equal values, `num_global_key_value_heads`.
fn global_shape(c: &HfConfig, slides: &[bool], kv_heads: usize, k_eq_v: bool) -> Result<(usize, usize)> {
    let err = |msg: String| Error::checkpoint(&c.path, msg);
    if let Some(v) = c.get("per_layer_config") {
        let per: &Map<String, Value> =
            v.as_object().ok_or_else(|| err(format!("`per_layer_config` must be an object, got {v}")))?;
        let mut shape = None;
        for (key, o) in per {
            let l = key.parse::<usize>().ok().filter(|&l| l < slides.len()).ok_or_else(|| {
                err(format!("`per_layer_config` names layer \"{key}\", not one of the {} layers", slides.len()))
            })?;
            let field = |f: &str, default: usize| -> Result<usize> {
                match o.get(f) {
                    None | Some(Value::Null) => Ok(default),
                    Some(x) => x.as_u64().map(|x| x as usize).filter(|&x| x > 0 && x <= SIZE_LIMIT).ok_or_else(|| {
                        err(format!("`per_layer_config.{key}.{f}` must be a positive integer, got {x}"))
                    }),
                }
            };
            let this = (field("head_dim", 0)?, field("num_key_value_heads", kv_heads)?);
            if slides[l] || this.0 == 0 || shape.is_some_and(|s| s != this) {
                return Err(err(format!(
                    "`per_layer_config.{key}` = {o:?}: colibri supports one shape shared by every full-attention \
                     layer and none on the sliding ones"
                )));
            }
            shape = Some(this);
        }
        if let Some(s) = shape {
            return Ok(s);
        }
    }
    let dh = c.opt_usize("global_head_dim")?.unwrap_or(512);
    let kv = if k_eq_v { c.opt_usize("num_global_key_value_heads")?.unwrap_or(kv_heads) } else { kv_heads };
    if dh == 0 || kv == 0 {
        return Err(err(format!("`global_head_dim` {dh} and `num_global_key_value_heads` {kv} must be at least 1")));
    }
    Ok((dh, kv))
}

/// The RoPE of one layer type (`sliding_attention` or `full_attention`) for
/// heads of `dh`: its entry of `rope_parameters` (transformers' defaults
/// when absent). "default" turns the whole head whatever
/// `partial_rotary_factor` says, as transformers' default initialiser does;
/// "proportional" is Gemma 4's; other types are read as for every family.
fn rope(c: &HfConfig, kind: &str, dh: usize, max_pos: usize) -> Result<RopeSpec> {
    let params = c.get("rope_parameters").and_then(|p| p.get(kind)).filter(|p| p.is_object());
    let default = match kind {
        "full_attention" => serde_json::json!({"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1_000_000.0}),
        _ => serde_json::json!({"rope_type": "default", "rope_theta": 10_000.0}),
    };
    let p = params.unwrap_or(&default);
    let num = |k: &str| p.get(k).and_then(Value::as_f64);
    let theta = num("rope_theta").unwrap_or(10_000.0);
    match p.get("rope_type").and_then(Value::as_str).unwrap_or("default") {
        "default" => Ok(RopeSpec { theta, rotary_dim: dh, scaling: RopeScaling::None, interleaved: false }),
        "proportional" => {
            let partial = num("partial_rotary_factor").unwrap_or(1.0);
            if !(0.0..=1.0).contains(&partial) {
                return Err(Error::checkpoint(
                    &c.path,
                    format!("`rope_parameters.{kind}.partial_rotary_factor` {partial} must be in [0, 1]"),
                ));
            }
            let angles = (partial * dh as f64 / 2.0).floor() as usize;
            let factor = num("factor").unwrap_or(1.0);
            Ok(RopeSpec {
                theta,
                rotary_dim: dh,
                scaling: RopeScaling::Proportional { factor, angles },
                interleaved: false,
            })
        }
        _ => {
            let one = serde_json::json!({"rope_parameters": p, "max_position_embeddings": max_pos});
            HfConfig { raw: one, path: c.path.clone() }.rope(dh, theta)
        }
    }
}

fn source(hf: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    // The language model's prefix: `model.` (text only) or `model.language_model.`.
    let lm = if hf.get("text_config").is_some() { "model.language_model." } else { "model." };
    let layer = |l: usize, rest: &str| Source::tensor(format!("{lm}layers.{l}.{rest}"));
    let f = cfg.moe.as_ref().map_or(0, |m| m.expert_ffn_dim);
    match id {
        TensorId::Embed => Source::tensor(format!("{lm}embed_tokens.weight")),
        TensorId::FinalNorm => Source::tensor(format!("{lm}norm.weight")),
        TensorId::LmHead => Source::tensor("lm_head.weight"),
        TensorId::Layer(l, t) => match t {
            L::AttnNorm => layer(l, "input_layernorm.weight"),
            L::AttnPostNorm => layer(l, "post_attention_layernorm.weight"),
            L::FfnNorm => layer(l, "pre_feedforward_layernorm.weight"),
            L::FfnPostNorm => layer(l, "post_feedforward_layernorm.weight"),
            L::Wq => layer(l, "self_attn.q_proj.weight"),
            L::Wk => layer(l, "self_attn.k_proj.weight"),
            L::Wv => layer(l, "self_attn.v_proj.weight"),
            L::Wo => layer(l, "self_attn.o_proj.weight"),
            L::Bq => layer(l, "self_attn.q_proj.bias"),
            L::Bk => layer(l, "self_attn.k_proj.bias"),
            L::Bv => layer(l, "self_attn.v_proj.bias"),
            L::Bo => layer(l, "self_attn.o_proj.bias"),
            L::QNorm => layer(l, "self_attn.q_norm.weight"),
            L::KNorm => layer(l, "self_attn.k_norm.weight"),
            L::SharedGate => layer(l, "mlp.gate_proj.weight"),
            L::SharedUp => layer(l, "mlp.up_proj.weight"),
            L::SharedDown => layer(l, "mlp.down_proj.weight"),
            L::SharedPostNorm => layer(l, "post_feedforward_layernorm_1.weight"),
            L::MoeNorm => layer(l, "pre_feedforward_layernorm_2.weight"),
            L::MoePostNorm => layer(l, "post_feedforward_layernorm_2.weight"),
            L::Router => layer(l, "router.proj.weight"),
            L::RouterNorm => layer(l, "router.scale"),
            L::RouterExpertScale => layer(l, "router.per_expert_scale"),
            L::LayerScale => layer(l, "layer_scalar"),
            other => Source::tensor(format!("<{other:?} of layer {l} has no Gemma 4 name>")),
        },
        TensorId::Expert(l, e, t) => {
            let stacked = |name: &str| Source::expert(format!("{lm}layers.{l}.experts.{name}"), e);
            match t {
                X::Gate => stacked("gate_up_proj").rows(2 * f, 0, f),
                X::Up => stacked("gate_up_proj").rows(2 * f, f, f),
                X::Down => stacked("down_proj"),
                other => Source::tensor(format!("<expert {other:?} has no Gemma 4 name>")),
            }
        }
        other => Source::tensor(format!("<{other} has no Gemma 4 name>")),
    }
}

/// The vision and audio towers and their embedders: colibri runs text.
fn skips_towers(_: &HfConfig, name: &str) -> bool {
    ["model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."]
        .iter()
        .any(|p| name.starts_with(p))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn hub(text: &str) -> HfConfig {
        let raw = format!(
            r#"{{"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                "tie_word_embeddings": true, "text_config": {text}}}"#
        );
        HfConfig::parse(Path::new("config.json"), &raw).unwrap()
    }

    const TEXT: &str = r#"{"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_global_key_value_heads": 1, "head_dim": 16, "global_head_dim": 32,
        "intermediate_size": 48, "moe_intermediate_size": 8, "num_experts": 4, "top_k_experts": 2,
        "vocab_size": 100, "sliding_window": 8, "final_logit_softcapping": 30.0, "attention_k_eq_v": true,
        "enable_moe_block": true, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
        "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
        "rope_type": "proportional"}, "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}}"#;

    /// The Hub's spelling maps to sliding and global layers of their own
    /// shapes, five to one without `layer_types`.
    #[test]
    fn hub_config_maps_to_sliding_and_global_layers() {
        let cfg = config(&hub(TEXT)).unwrap();
        cfg.validate().unwrap();
        let windows: Vec<_> = cfg.layers.iter().map(|l| l.mixer.window()).collect();
        assert_eq!(windows, [Some(8), Some(8), Some(8), Some(8), Some(8), None]);
        let g = cfg.global_attention.as_ref().unwrap();
        assert_eq!((g.head_dim, g.num_kv_heads, g.values_from_keys), (32, 1, true));
        assert_eq!(g.rope.scaling, RopeScaling::Proportional { factor: 1.0, angles: 4 });
        assert_eq!((cfg.rope.rotary_dim, cfg.rope.theta), (16, 10000.0));
        assert_eq!(cfg.logit_softcap, Some(30.0));
        assert_eq!(cfg.scales.embedding, 8.0);
        assert!(cfg.tie_embeddings && cfg.post_norms && cfg.layer_scale);
    }

    /// Gemma-4-26B-A4B's text config (as published: 30 layers, five sliding
    /// to one full, 128 experts of 704, top-8) maps and validates.
    #[test]
    fn the_26b_a4b_config_maps() {
        let pattern = [r#""sliding_attention""#; 5].join(", ") + r#", "full_attention""#;
        let text = format!(
            r#"{{"attention_bias": false, "attention_k_eq_v": true, "enable_moe_block": true,
            "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2816, "hidden_size_per_layer_input": 0,
            "intermediate_size": 2112, "layer_types": [{}], "max_position_embeddings": 262144,
            "model_type": "gemma4_text", "moe_intermediate_size": 704, "num_attention_heads": 16,
            "num_experts": 128, "num_global_key_value_heads": 2, "num_hidden_layers": 30,
            "num_key_value_heads": 8, "num_kv_shared_layers": 0, "rms_norm_eps": 1e-06,
            "rope_parameters": {{"full_attention": {{"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
            "rope_type": "proportional"}}, "sliding_attention": {{"rope_theta": 10000.0, "rope_type": "default"}}}},
            "sliding_window": 1024, "tie_word_embeddings": true, "top_k_experts": 8,
            "use_bidirectional_attention": "vision", "use_double_wide_mlp": false, "vocab_size": 262144,
            "vocab_size_per_layer_input": 262144}}"#,
            [pattern.as_str(); 5].join(", ")
        );
        let cfg = config(&hub(&text)).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.layers.iter().filter(|l| l.mixer.window() == Some(1024)).count(), 25);
        let full = cfg.head_shape(5);
        assert_eq!((full.head_dim, full.kv_heads, full.values_from_keys), (512, 2, true));
        assert_eq!(cfg.head_shape(0).head_dim, 256);
        let g = cfg.global_attention.as_ref().unwrap();
        assert_eq!((g.rope.rotary_dim, &g.rope.scaling), (512, &RopeScaling::Proportional { factor: 1.0, angles: 64 }));
        let moe = cfg.moe.as_ref().unwrap();
        assert_eq!((moe.num_experts, moe.router.top_k, moe.expert_ffn_dim), (128, 8, 704));
        assert_eq!(moe.shared_expert.as_ref().unwrap().ffn_dim, 2112);
    }

    /// A `layer_types` list of another length names the key.
    #[test]
    fn layer_types_of_the_wrong_length_is_a_checkpoint_error() {
        let text = TEXT.replacen('{', r#"{"layer_types": ["sliding_attention", "full_attention"], "#, 1);
        let e = config(&hub(&text)).unwrap_err();
        assert!(matches!(e, Error::Checkpoint { .. }), "{e}");
        assert!(e.to_string().contains("layer_types") && e.to_string().contains("num_hidden_layers"), "{e}");
    }

    /// Per-layer input embeddings (the small models) are refused by name;
    /// an absent key means transformers' default, 256.
    #[test]
    fn per_layer_inputs_are_refused_by_name() {
        for text in [
            TEXT.replace(r#""hidden_size_per_layer_input": 0"#, r#""hidden_size_per_layer_input": 256"#),
            TEXT.replace(r#""hidden_size_per_layer_input": 0,"#, ""),
        ] {
            let e = config(&hub(&text)).unwrap_err();
            assert!(matches!(e, Error::Checkpoint { .. }) && e.to_string().contains("hidden_size_per_layer_input"));
        }
        let null = TEXT.replace(r#""hidden_size_per_layer_input": 0"#, r#""hidden_size_per_layer_input": null"#);
        config(&hub(&null)).unwrap();
    }

    /// transformers 5.24's `per_layer_config` reads as the Hub's keys do.
    #[test]
    fn per_layer_config_equals_the_hub_keys() {
        let text = TEXT.replace(r#""num_global_key_value_heads": 1, "#, "").replace(
            r#""global_head_dim": 32,"#,
            r#""per_layer_config": {"5": {"head_dim": 32, "num_key_value_heads": 1}},"#,
        );
        assert_eq!(config(&hub(&text)).unwrap(), config(&hub(TEXT)).unwrap());
    }

    /// The towers are skipped, the language model is not.
    #[test]
    fn towers_are_skipped() {
        let c = hub(TEXT);
        assert!(skips_towers(&c, "model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight"));
        assert!(skips_towers(&c, "model.embed_vision.embedding_projection.weight"));
        assert!(!skips_towers(&c, "model.language_model.layers.0.router.scale"));
    }
}
