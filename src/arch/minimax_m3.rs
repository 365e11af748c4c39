//! MiniMax-M3 (`MiniMaxM3SparseForConditionalGeneration`, model_type
//! `minimax_m3_vl`) as the Hub ships it, mirroring transformers'
//! `models/minimax_m3_vl/modeling_minimax_m3_vl.py` and
//! `configuration_minimax_m3_vl.py`: the language model (`text_config`)
//! beside a vision tower; colibri converts the language model and runs text.
//! Also the same language model saved alone (`MiniMaxM3VLForCausalLM`,
//! model_type `minimax_m3_vl_text`): a flat config, read the same way, and
//! the tensors under transformers' own module names (see `text_source`).
//!
//! Quirks:
//! - MiniMax Sparse Attention on the layers `layer_types` marks
//!   "minimax_m3_sparse" (the others are full attention): grouped-query
//!   attention whose queries read only the key blocks a block indexer keeps
//!   (`model/blocks/block_index.rs`); its tensors are `self_attn.index_q_proj`
//!   [Hi·Di, D], `index_k_proj` [Di, D] and the RMSNorms `index_q_norm`,
//!   `index_k_norm` [Di]; no scale, relu or head weights in the score, the
//!   raw `q_i · k_j` max-pooled per block; index head i serves query heads
//!   i·H/Hi.., so H must be a multiple of Hi;
//! - the index branch rotates with the main attention's cosines cut to its
//!   width (`cos[..., :index_head_dim]`): an index head narrower than the
//!   rotated width would pair mismatched frequencies and is refused;
//! - the local blocks get an infinite score before the top-k, so
//!   `index_local_blocks` more than `index_topk_blocks` would leave
//!   transformers choosing among ties: refused; ties between finite block
//!   scores keep the earlier block (torch leaves their order unspecified);
//! - the Hub's legacy keys are read as transformers reads them:
//!   `sparse_attention_config` (`sparse_num_index_heads`, `sparse_index_dim`,
//!   `sparse_block_size`, `sparse_topk_blocks`, `sparse_local_block`) wins
//!   over the flat `index_*` keys, `sparse_attention_freq` gives
//!   `layer_types` and `moe_layer_freq` gives `mlp_layer_types` when those
//!   are absent; without either every layer is full attention / MoE;
//! - every RMSNorm is Gemma-style, `x · (1 + w)` (the layer norms, the final
//!   norm, the per-head q/k norms and the index norms): stored as `1 + w`;
//! - partial RoPE only through `partial_rotary_factor` (in `rope_parameters`
//!   or at the top): transformers' config for this family does not read the
//!   Hub's `rotary_dim` (MiniMax-M2's does), so without the factor every head
//!   value rotates; theta 5e6 by default;
//! - `hidden_act` is not read (transformers sets it to silu and computes the
//!   clamped SwiGLU from `swiglu_alpha` / `swiglu_limit`,
//!   `(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)` with `g = min(gate,
//!   limit)`), in the routed experts, the shared expert and the dense layers
//!   (`mlp_layer_types` "dense", width `dense_intermediate_size`);
//! - routing as MiniMax-M2's (sigmoid, `e_score_correction_bias` for the
//!   choice, renormalised), then the experts' summed output times
//!   `routed_scaling_factor` (default 2.0), plus one shared expert of
//!   `shared_intermediate_size`, ungated;
//! - tensors: `language_model.model.*` and `language_model.lm_head.weight`
//!   (Mixtral-style `block_sparse_moe.experts.E.w1/w3/w2`,
//!   `block_sparse_moe.gate`, `block_sparse_moe.shared_experts.*_proj`,
//!   dense `mlp.{gate,up,down}_proj`); the vision tower
//!   (`vision_tower.*`, `multi_modal_projector.*`, `patch_merge_mlp.*`) and
//!   the multi-token-prediction modules (`mtp.*`, which transformers drops)
//!   are skipped and listed in the file as not converted;
//! - the text-only class has no Hub-name conversion in transformers, so
//!   what it saves (and all it loads) is `model.layers.N.mlp.*`: the experts
//!   stacked (`experts.gate_up_proj` [E, 2F, D], gate rows first;
//!   `experts.down_proj` [E, D, F]), `mlp.gate.weight` and
//!   `mlp.gate.e_score_correction_bias`, the shared expert and the dense
//!   MLP with a fused `gate_up_proj` [2F, D] (gate first), and the indexer
//!   under `self_attn.indexer.{q,k}_{proj,norm}`;
//! - the head is tied to the embedding when the top level or `text_config`
//!   says so (transformers' config takes either); the text-only class is
//!   untied unless its config says `tie_word_embeddings: true` (its
//!   `_tied_weights_keys` only name the pair).

use serde_json::Value;

use super::{Arch, HfConfig, Source, expert_part};
use crate::canonical::config::*;
use crate::canonical::tensors::{ExpertTensor as X, LayerTensor as L, TensorId};
use crate::error::{Error, Result};

/// MiniMax-M3 as the Hub ships it, with a vision tower.
pub static ARCH: Arch = Arch {
    hf_class: "MiniMaxM3SparseForConditionalGeneration",
    model_type: "minimax_m3_vl",
    config,
    source,
    ignored: not_the_language_model,
};

/// The language model alone: a flat config, `model.*` and `lm_head.weight`.
pub static TEXT: Arch = Arch {
    hf_class: "MiniMaxM3VLForCausalLM",
    model_type: "minimax_m3_vl_text",
    config,
    source: text_source,
    ignored: not_the_language_model,
};

/// The language model's config, `text_config`, tied when either level says so.
fn text_config(hf: &HfConfig) -> HfConfig {
    let Some(Value::Object(t)) = hf.get("text_config") else {
        return HfConfig { raw: hf.raw.clone(), path: hf.path.clone() };
    };
    let mut raw = t.clone();
    let tied = |v: Option<&Value>| v.and_then(Value::as_bool).unwrap_or(false);
    let tie = tied(hf.get("tie_word_embeddings")) || tied(raw.get("tie_word_embeddings"));
    raw.insert("tie_word_embeddings".into(), Value::Bool(tie));
    HfConfig { raw: Value::Object(raw), path: hf.path.clone() }
}

/// A per-layer list of 0/1 flags (the Hub's `sparse_attention_freq`,
/// `moe_layer_freq`) or of names (`layer_types`, `mlp_layer_types`): true
/// where the entry is 1 or `on`, false where it is 0 or `off`.
fn flags(c: &HfConfig, key: &str, v: &Value, n: usize, on: &str, off: &str) -> Result<Vec<bool>> {
    let bad = |m: String| Error::checkpoint(&c.path, m);
    let list = v.as_array().ok_or_else(|| bad(format!("`{key}` must be a list, got {v}")))?;
    if list.len() != n {
        return Err(bad(format!("`{key}` lists {} layers, but num_hidden_layers is {n}", list.len())));
    }
    list.iter()
        .enumerate()
        .map(|(i, t)| match (t.as_str(), t.as_u64().or(t.as_bool().map(u64::from))) {
            (Some(s), _) if s == on => Ok(true),
            (Some(s), _) if s == off => Ok(false),
            (_, Some(1)) => Ok(true),
            (_, Some(0)) => Ok(false),
            _ => Err(bad(format!("`{key}[{i}]` is {t}; expected \"{on}\" or \"{off}\""))),
        })
        .collect()
}

fn config(hf: &HfConfig) -> Result<ModelConfig> {
    let c = &text_config(hf);
    let bad = |m: String| Error::checkpoint(&c.path, m);
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let sparse_cfg = c.get("sparse_attention_config").filter(|v| v.is_object());
    // A legacy key inside `sparse_attention_config` wins over the flat one.
    let index_key = |flat: &str, legacy: &str, default: usize| -> Result<usize> {
        let v = sparse_cfg.and_then(|s| s.get(legacy)).filter(|v| !v.is_null()).or_else(|| c.get(flat));
        match v {
            None => Ok(default),
            Some(v) => v.as_u64().map(|x| x as usize).filter(|&x| x <= SIZE_LIMIT).ok_or_else(|| {
                bad(format!("config field `{flat}` (`{legacy}`) must be a non-negative integer, got {v}"))
            }),
        }
    };
    let block_index = BlockIndexSpec {
        heads: index_key("index_n_heads", "sparse_num_index_heads", 4)?,
        head_dim: index_key("index_head_dim", "sparse_index_dim", 128)?,
        block: index_key("index_block_size", "sparse_block_size", 128)?,
        top_blocks: index_key("index_topk_blocks", "sparse_topk_blocks", 16)?,
        local_blocks: index_key("index_local_blocks", "sparse_local_block", 1)?,
    };
    let sparse = match (c.get("layer_types"), sparse_cfg.and_then(|s| s.get("sparse_attention_freq"))) {
        (Some(v), _) => flags(c, "layer_types", v, n, "minimax_m3_sparse", "full_attention")?,
        (None, Some(v)) => flags(c, "sparse_attention_freq", v, n, "1", "0")?,
        (None, None) => vec![false; n],
    };
    let moe_layers = match (c.get("mlp_layer_types"), c.get("moe_layer_freq")) {
        (Some(v), _) => flags(c, "mlp_layer_types", v, n, "sparse", "dense")?,
        (None, Some(v)) => flags(c, "moe_layer_freq", v, n, "1", "0")?,
        (None, None) => vec![true; n],
    };
    let rope = c.rope(head_dim, 5e6)?;
    if sparse.iter().any(|&s| s) {
        let b = block_index;
        for (key, v) in [
            ("index_n_heads", b.heads),
            ("index_head_dim", b.head_dim),
            ("index_block_size", b.block),
            ("index_topk_blocks", b.top_blocks),
        ] {
            if v == 0 {
                return Err(bad(format!("config field `{key}` must be at least 1, got 0")));
            }
        }
        if !h.is_multiple_of(b.heads) {
            return Err(bad(format!(
                "`index_n_heads` {} does not divide num_attention_heads {h}: each index head serves a whole group",
                b.heads
            )));
        }
        if b.head_dim < rope.rotary_dim {
            return Err(Error::Unsupported(format!(
                "{}: `index_head_dim` {} is narrower than the rotated width {}: transformers would rotate it \
                 with mismatched frequencies",
                c.path.display(),
                b.head_dim,
                rope.rotary_dim
            )));
        }
        if b.local_blocks > b.top_blocks {
            return Err(Error::Unsupported(format!(
                "{}: `index_local_blocks` {} is more than `index_topk_blocks` {}: transformers would choose \
                 among equal scores",
                c.path.display(),
                b.local_blocks,
                b.top_blocks
            )));
        }
    }
    let limit = c.opt_f64("swiglu_limit")?.unwrap_or(7.0) as f32;
    let act = Activation::ClampedSwiglu { alpha: c.opt_f64("swiglu_alpha")?.unwrap_or(1.702) as f32, limit };
    let shared = c.opt_usize("shared_intermediate_size")?.unwrap_or(3072);
    if shared == 0 {
        return Err(bad("`shared_intermediate_size` is 0, but every MoE layer has a shared expert".into()));
    }
    let dense_ffn = c.opt_usize("dense_intermediate_size")?.unwrap_or(12288);
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(4),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(524288),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6)),
        rope,
        attention: AttentionSpec {
            qk_norm: QkNorm::PerHead,
            block_index: sparse.iter().any(|&s| s).then_some(block_index),
            ..Default::default()
        },
        moe: Some(MoeSpec {
            num_experts: c.usize(&["num_local_experts", "num_experts"])?,
            expert_ffn_dim: c.usize(&["intermediate_size"])?,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                score: RouterScore::Sigmoid,
                renormalize: true,
                correction_bias: true,
                scale: c.opt_f64("routed_scaling_factor")?.unwrap_or(2.0) as f32,
                scale_output: true,
                ..Default::default()
            },
            activation: act,
            shared_expert: Some(SharedExpertSpec { ffn_dim: shared, sigmoid_gate: false }),
            ..Default::default()
        }),
        layers: (0..n)
            .map(|l| LayerSpec {
                mixer: if sparse[l] { MixerSpec::Sparse { shared: false } } else { MixerSpec::FULL_ATTENTION },
                ffn: if moe_layers[l] { FfnSpec::Moe } else { FfnSpec::Dense { ffn_dim: dense_ffn } },
            })
            .collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        dense_activation: act,
        ..Default::default()
    })
}

fn source(_: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    named(cfg, id, "language_model.model", "language_model.lm_head.weight")
}

/// The text-only class as transformers saves it: no key conversion is
/// registered for `minimax_m3_vl_text`, so its files keep the module names
/// (`mlp.*` rather than `block_sparse_moe.*`, fused `gate_up_proj` halves,
/// stacked experts, `self_attn.indexer.*`).
fn text_source(_: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    let mlp = |l: usize, n: &str| format!("model.layers.{l}.mlp.{n}");
    let half = |name: String, w: usize, second: bool| Source::tensor(name).rows(2 * w, if second { w } else { 0 }, w);
    let f = cfg.moe.as_ref().map_or(0, |m| m.expert_ffn_dim);
    let fs = cfg.moe.as_ref().and_then(|m| m.shared_expert.as_ref()).map_or(0, |s| s.ffn_dim);
    let dense = |l: usize| match cfg.layers.get(l).map(|x| &x.ffn) {
        Some(FfnSpec::Dense { ffn_dim }) => *ffn_dim,
        _ => 0,
    };
    let indexer = |l: usize, n: &str| Source::tensor(format!("model.layers.{l}.self_attn.indexer.{n}.weight"));
    match id {
        TensorId::Layer(l, t) => match t {
            L::IdxQNorm => indexer(l, "q_norm").plus_one(),
            L::IdxKNorm => indexer(l, "k_norm").plus_one(),
            L::IdxWq => indexer(l, "q_proj"),
            L::IdxWk => indexer(l, "k_proj"),
            L::Gate => half(mlp(l, "gate_up_proj.weight"), dense(l), false),
            L::Up => half(mlp(l, "gate_up_proj.weight"), dense(l), true),
            L::Down => Source::tensor(mlp(l, "down_proj.weight")),
            L::Router => Source::tensor(mlp(l, "gate.weight")),
            L::RouterCorrection => Source::tensor(mlp(l, "gate.e_score_correction_bias")),
            L::SharedGate => half(mlp(l, "shared_experts.gate_up_proj.weight"), fs, false),
            L::SharedUp => half(mlp(l, "shared_experts.gate_up_proj.weight"), fs, true),
            L::SharedDown => Source::tensor(mlp(l, "shared_experts.down_proj.weight")),
            _ => named(cfg, id, "model", "lm_head.weight"),
        },
        TensorId::Expert(l, e, X::Gate) => Source::expert(mlp(l, "experts.gate_up_proj"), e).rows(2 * f, 0, f),
        TensorId::Expert(l, e, X::Up) => Source::expert(mlp(l, "experts.gate_up_proj"), e).rows(2 * f, f, f),
        TensorId::Expert(l, e, X::Down) => Source::expert(mlp(l, "experts.down_proj"), e),
        TensorId::Expert(l, e, t) => Source::tensor(format!("<{t:?} of expert {e}, layer {l} has no MiniMax-M3 name>")),
        _ => named(cfg, id, "model", "lm_head.weight"),
    }
}

/// A tensor's name under the language model's prefix `m` and head name.
fn named(cfg: &ModelConfig, id: TensorId, m: &str, head: &str) -> Source {
    let p = |l: usize| format!("{m}.layers.{l}");
    let moe = |l: usize| format!("{m}.layers.{l}.block_sparse_moe");
    let name = match id {
        TensorId::Embed => format!("{m}.embed_tokens.weight"),
        TensorId::FinalNorm => return Source::tensor(format!("{m}.norm.weight")).plus_one(),
        TensorId::LmHead => return Source::tensor(head),
        TensorId::Layer(l, t) => match t {
            L::AttnNorm => return Source::tensor(format!("{}.input_layernorm.weight", p(l))).plus_one(),
            L::FfnNorm => return Source::tensor(format!("{}.post_attention_layernorm.weight", p(l))).plus_one(),
            L::QNorm => return Source::tensor(format!("{}.self_attn.q_norm.weight", p(l))).plus_one(),
            L::KNorm => return Source::tensor(format!("{}.self_attn.k_norm.weight", p(l))).plus_one(),
            L::IdxQNorm => return Source::tensor(format!("{}.self_attn.index_q_norm.weight", p(l))).plus_one(),
            L::IdxKNorm => return Source::tensor(format!("{}.self_attn.index_k_norm.weight", p(l))).plus_one(),
            L::Wq => format!("{}.self_attn.q_proj.weight", p(l)),
            L::Wk => format!("{}.self_attn.k_proj.weight", p(l)),
            L::Wv => format!("{}.self_attn.v_proj.weight", p(l)),
            L::Wo => format!("{}.self_attn.o_proj.weight", p(l)),
            L::IdxWq => format!("{}.self_attn.index_q_proj.weight", p(l)),
            L::IdxWk => format!("{}.self_attn.index_k_proj.weight", p(l)),
            L::Gate => format!("{}.mlp.gate_proj.weight", p(l)),
            L::Up => format!("{}.mlp.up_proj.weight", p(l)),
            L::Down => format!("{}.mlp.down_proj.weight", p(l)),
            L::Router => format!("{}.gate.weight", moe(l)),
            L::RouterCorrection => format!("{}.e_score_correction_bias", moe(l)),
            L::SharedGate => format!("{}.shared_experts.gate_proj.weight", moe(l)),
            L::SharedUp => format!("{}.shared_experts.up_proj.weight", moe(l)),
            L::SharedDown => format!("{}.shared_experts.down_proj.weight", moe(l)),
            other => format!("<{other:?} of layer {l} has no MiniMax-M3 name ({} layers)>", cfg.num_layers()),
        },
        TensorId::Expert(l, e, t) => {
            let (w, kind) = expert_part(t, ["w1", "w3", "w2"]);
            format!("{}.experts.{e}.{w}.{kind}", moe(l))
        }
        other => format!("<{other} has no MiniMax-M3 name>"),
    };
    Source::tensor(name)
}

/// The vision tower, its projectors, and the multi-token-prediction modules.
fn not_the_language_model(_: &HfConfig, name: &str) -> bool {
    let rest = name.strip_prefix("model.").unwrap_or(name);
    ["vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "mtp.", "language_model.mtp."]
        .iter()
        .any(|p| rest.starts_with(p))
        || name.contains(".mtp.")
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn hf(text: &str, top: &str) -> HfConfig {
        let raw = format!(
            r#"{{"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl"{top},
            "text_config": {{"vocab_size": 50, "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 3, "intermediate_size": 12,
            "num_local_experts": 6, "num_experts_per_tok": 2, "shared_intermediate_size": 10,
            "dense_intermediate_size": 20{text}}}}}"#
        );
        HfConfig::parse(Path::new("config.json"), &raw).unwrap()
    }

    /// The Hub's legacy spelling gives transformers' lists and index sizes;
    /// `rotary_dim` is not read.
    #[test]
    fn legacy_keys_give_the_layers_and_the_indexer() {
        let sparse = r#", "sparse_attention_config": {"sparse_num_index_heads": 2, "sparse_index_dim": 8,
            "sparse_block_size": 4, "sparse_topk_blocks": 3, "sparse_local_block": 1,
            "sparse_attention_freq": [0, 1, 1]}, "index_n_heads": 4, "moe_layer_freq": [0, 1, 1],
            "rotary_dim": 4, "hidden_act": "swigluoai""#;
        let m = config(&hf(sparse, "")).unwrap();
        m.validate().unwrap();
        let b = m.attention.block_index.unwrap();
        assert_eq!((b.heads, b.head_dim, b.block, b.top_blocks, b.local_blocks), (2, 8, 4, 3, 1));
        assert_eq!(m.layers[0].mixer, MixerSpec::FULL_ATTENTION);
        assert_eq!(m.layers[1].mixer, MixerSpec::Sparse { shared: false });
        assert_eq!(m.layers[0].ffn, FfnSpec::Dense { ffn_dim: 20 });
        assert_eq!(m.layers[2].ffn, FfnSpec::Moe);
        assert_eq!(m.rope.rotary_dim, 8, "rotary_dim is not read: the whole head rotates");
        assert!(matches!(m.dense_activation, Activation::ClampedSwiglu { limit, .. } if limit == 7.0));
        let r = &m.moe.as_ref().unwrap().router;
        assert!(r.scale == 2.0 && r.scale_output && r.correction_bias && r.renormalize);
        assert!(!m.tie_embeddings);
        assert!(config(&hf("", r#", "tie_word_embeddings": true"#)).unwrap().tie_embeddings);
        assert!(config(&hf("", "")).unwrap().attention.block_index.is_none(), "no sparse layer, no indexer");
    }

    #[test]
    fn bad_index_keys_are_named() {
        let sparse = r#", "layer_types": ["full_attention", "minimax_m3_sparse", "full_attention"]"#;
        for (extra, key) in [
            (", \"index_n_heads\": 3", "index_n_heads"),
            (", \"index_topk_blocks\": 0", "index_topk_blocks"),
            (", \"index_head_dim\": 4, \"rope_parameters\": {\"rope_theta\": 1e4}", "index_head_dim"),
            (", \"index_local_blocks\": 20", "index_local_blocks"),
        ] {
            let err = config(&hf(&format!("{sparse}{extra}"), "")).unwrap_err();
            assert!(err.to_string().contains(key), "{extra}: {err}");
        }
        let err = config(&hf(r#", "layer_types": ["full_attention", "sliding_attention", "full_attention"]"#, ""));
        assert!(err.unwrap_err().to_string().contains("layer_types[1]"));
    }

    /// The language model alone: a flat config, untied by default, and
    /// transformers' module names (fused and stacked, the indexer apart).
    #[test]
    fn the_text_only_class_reads_a_flat_config_and_the_module_names() {
        let raw = r#"{"architectures": ["MiniMaxM3VLForCausalLM"], "model_type": "minimax_m3_vl_text",
            "vocab_size": 50, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "num_hidden_layers": 2, "intermediate_size": 12, "num_local_experts": 6,
            "num_experts_per_tok": 2, "shared_intermediate_size": 10, "dense_intermediate_size": 20,
            "mlp_layer_types": ["dense", "sparse"], "index_head_dim": 8,
            "layer_types": ["full_attention", "minimax_m3_sparse"]}"#;
        let c = HfConfig::parse(Path::new("config.json"), raw).unwrap();
        assert!(std::ptr::eq(super::super::lookup(&c).unwrap(), &TEXT));
        let m = (TEXT.config)(&c).unwrap();
        m.validate().unwrap();
        assert!(!m.tie_embeddings && m.attention.block_index.is_some());
        let src = |id| (TEXT.source)(&c, &m, id);
        assert_eq!(src(TensorId::LmHead), Source::tensor("lm_head.weight"));
        assert_eq!(src(TensorId::Embed), Source::tensor("model.embed_tokens.weight"));
        assert_eq!(
            src(TensorId::Layer(0, L::Up)),
            Source::tensor("model.layers.0.mlp.gate_up_proj.weight").rows(40, 20, 20)
        );
        assert_eq!(
            src(TensorId::Layer(1, L::SharedGate)),
            Source::tensor("model.layers.1.mlp.shared_experts.gate_up_proj.weight").rows(20, 0, 10)
        );
        assert_eq!(
            src(TensorId::Expert(1, 4, X::Up)),
            Source::expert("model.layers.1.mlp.experts.gate_up_proj", 4).rows(24, 12, 12)
        );
        assert_eq!(
            src(TensorId::Layer(1, L::RouterCorrection)).name,
            "model.layers.1.mlp.gate.e_score_correction_bias"
        );
        assert_eq!(
            src(TensorId::Layer(1, L::IdxKNorm)),
            Source::tensor("model.layers.1.self_attn.indexer.k_norm.weight").plus_one()
        );
        assert_eq!(src(TensorId::Layer(1, L::Wq)).name, "model.layers.1.self_attn.q_proj.weight");
    }

    #[test]
    fn skips_the_vision_tower_and_mtp_only() {
        let c = hf("", "");
        for n in [
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
            "multi_modal_projector.linear_1.weight",
            "patch_merge_mlp.linear_2.bias",
            "mtp.layers.0.eh_proj.weight",
        ] {
            assert!(not_the_language_model(&c, n), "{n}");
        }
        assert!(!not_the_language_model(&c, "language_model.model.layers.1.block_sparse_moe.gate.weight"));
        assert!(!not_the_language_model(&c, "language_model.lm_head.weight"));
    }
}
