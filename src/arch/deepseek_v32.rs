//! DeepSeek-V3.2 (`DeepseekV32ForCausalLM`), mirroring transformers'
//! `models/deepseek_v32/modeling_deepseek_v32.py` and
//! `configuration_deepseek_v32.py`: DeepSeek-V3 (see `deepseek.rs`) whose
//! every layer is DeepSeek Sparse Attention, latent attention over the keys a
//! lightning indexer picks (`model/blocks/indexer.rs`). GLM-5
//! (`glm_moe_dsa.rs`) builds on what is here.
//!
//! Quirks:
//! - the indexer's tensors live under `self_attn.indexer.`: `wq_b`
//!   [Hi·Di, q_lora_rank] reads the normed query latent of the attention,
//!   `wk` [Di, D] and the LayerNorm `k_norm` (weight and bias, eps 1e-6
//!   whatever `rms_norm_eps` says) make the one index key, `weights_proj`
//!   [Hi, D] the heads' weights (transformers keeps it in f32; so does
//!   colibri);
//! - in an index query or key the rotated part comes first (the first
//!   `qk_rope_head_dim` values), where MLA's queries put it last; it rotates
//!   as halves (`rotate_half`), not in the adjacent pairs of MLA's rope;
//! - score = Σ_h relu(q_h · k / √Di) · w_h / √Hi, the relu inside the sum;
//!   the causal mask is added before `topk(min(index_topk, T))`, so a query
//!   that sees fewer than `index_topk` keys keeps all of them (the engine
//!   then runs plain latent attention); torch's `topk` leaves the order of
//!   equal scores unspecified, the engine keeps the earlier key (the
//!   fixtures have no tie at the boundary);
//! - MLA always rotates adjacent pairs (there is no `rope_interleave` key);
//! - `q_lora_rank` is required (the indexer reads the query latent);
//! - dense layers are those `mlp_layer_types` marks "dense", else the first
//!   `first_k_dense_replace` (default 3); `layer_types` is "indexed_attention"
//!   on every layer;
//! - class defaults where the keys are absent: `n_group` 8, `topk_group` 4,
//!   `routed_scaling_factor` 2.5, one shared expert, `max_position_embeddings`
//!   163840, `index_topk` 2048, `index_head_dim` 128, `index_n_heads` 64;
//! - routing as DeepSeek-V3; the multi-token-prediction layer past
//!   `num_hidden_layers` is skipped.

use serde_json::{Value, json};

use super::{Arch, HfConfig, Source};
use crate::canonical::config::*;
use crate::canonical::tensors::{LayerTensor as L, TensorId};
use crate::error::{Error, Result};

pub static ARCH: Arch = Arch {
    hf_class: "DeepseekV32ForCausalLM",
    model_type: "deepseek_v32",
    config,
    source,
    ignored: super::deepseek::past_the_layers,
};

/// What a DSA family's config class fills in when config.json leaves a key out.
pub(crate) struct DsaDefaults {
    /// Keys and values the class defaults to.
    pub keys: &'static [(&'static str, DefaultValue)],
    /// The indexer rotates adjacent pairs (GLM-5) rather than halves.
    pub rope_interleaved: bool,
}

/// A default of a config key.
pub(crate) enum DefaultValue {
    /// An integer.
    Int(u64),
    /// A number.
    Num(f64),
}

const DEFAULTS: DsaDefaults = DsaDefaults {
    keys: &[
        ("n_group", DefaultValue::Int(8)),
        ("topk_group", DefaultValue::Int(4)),
        ("routed_scaling_factor", DefaultValue::Num(2.5)),
        ("n_shared_experts", DefaultValue::Int(1)),
        ("first_k_dense_replace", DefaultValue::Int(3)),
        ("max_position_embeddings", DefaultValue::Int(163840)),
        ("rms_norm_eps", DefaultValue::Num(1e-6)),
        ("q_lora_rank", DefaultValue::Int(1536)),
        ("index_topk", DefaultValue::Int(2048)),
        ("index_head_dim", DefaultValue::Int(128)),
        ("index_n_heads", DefaultValue::Int(64)),
    ],
    rope_interleaved: false,
};

fn config(c: &HfConfig) -> Result<ModelConfig> {
    let n = c.usize(&["num_hidden_layers"])?;
    dsa_config(c, &DEFAULTS, &vec![false; n])
}

/// The config of a DSA family: DeepSeek-V3's latent attention and routing
/// with the class's `defaults`, and the indexer on every layer, `shared[l]`
/// when layer l reuses the selection of the layer before it.
pub(crate) fn dsa_config(c: &HfConfig, defaults: &DsaDefaults, shared: &[bool]) -> Result<ModelConfig> {
    let mut raw = c.raw.clone();
    if let Value::Object(map) = &mut raw {
        for (k, v) in defaults.keys {
            if !map.contains_key(*k) {
                map.insert(
                    (*k).into(),
                    match v {
                        DefaultValue::Int(i) => json!(i),
                        DefaultValue::Num(x) => json!(x),
                    },
                );
            }
        }
    }
    let c = &HfConfig { raw, path: c.path.clone() };
    let bad = |msg: String| Error::checkpoint(&c.path, msg);
    let router = |k, groups| RouterSpec {
        top_k: k,
        score: RouterScore::Sigmoid,
        correction_bias: true,
        groups,
        ..Default::default()
    };
    let mut cfg = super::deepseek::config(c, Some(GroupScore::TopTwoSum), router, true)?;
    if let Some(m) = cfg.moe.as_mut() {
        m.router.renormalize = c.bool_or("norm_topk_prob", true)?;
    }
    let n = cfg.num_layers();
    let mla = match &mut cfg.attention.kind {
        AttentionKind::Mla(m) => m,
        AttentionKind::Gqa | AttentionKind::Pooled(_) => {
            return Err(Error::Internal("DeepSeek's config is latent attention".into()));
        }
    };
    if mla.q_lora_rank.is_none() {
        return Err(bad("`q_lora_rank` is null, but the indexer reads the query latent: it needs a rank".into()));
    }
    let top_k = c.usize(&["index_topk"])?;
    let heads = c.usize(&["index_n_heads"])?;
    let head_dim = c.usize(&["index_head_dim"])?;
    for (key, v) in [("index_topk", top_k), ("index_n_heads", heads), ("index_head_dim", head_dim)] {
        if v == 0 {
            return Err(bad(format!("config field `{key}` must be at least 1, got 0")));
        }
    }
    if head_dim < mla.qk_rope_dim {
        return Err(bad(format!(
            "`index_head_dim` {head_dim} is narrower than the `qk_rope_head_dim` {} it rotates",
            mla.qk_rope_dim
        )));
    }
    mla.indexer = Some(IndexerSpec {
        heads,
        head_dim,
        top_k,
        rope_dim: mla.qk_rope_dim,
        rope_interleaved: defaults.rope_interleaved,
        key_norm_eps: 1e-6,
    });
    if let Some(types) = c.get("layer_types") {
        let list = types.as_array().filter(|a| a.len() == n);
        if list.is_none_or(|a| a.iter().any(|t| t.as_str() != Some("indexed_attention"))) {
            return Err(Error::Unsupported(format!(
                "{}: `layer_types` must list \"indexed_attention\" for each of the {n} layers, got {types}",
                c.path.display()
            )));
        }
    }
    let dense_ffn = c.usize(&["intermediate_size"])?;
    let dense = mlp_layer_types(c, n)?;
    if shared.len() != n {
        return Err(Error::Internal(format!("{} indexer flags for {n} layers", shared.len())));
    }
    cfg.layers = (0..n)
        .map(|l| LayerSpec {
            mixer: MixerSpec::Sparse { shared: shared[l] },
            ffn: if dense[l] { FfnSpec::Dense { ffn_dim: dense_ffn } } else { FfnSpec::Moe },
        })
        .collect();
    Ok(cfg)
}

/// Which layers are dense: `mlp_layer_types` ("dense" / "sparse" per layer)
/// when given, else the first `first_k_dense_replace`.
fn mlp_layer_types(c: &HfConfig, n: usize) -> Result<Vec<bool>> {
    let Some(v) = c.get("mlp_layer_types") else {
        let k = c.opt_usize("first_k_dense_replace")?.unwrap_or(0);
        return Ok((0..n).map(|l| l < k).collect());
    };
    let bad = |m: String| Error::checkpoint(&c.path, m);
    let list = v.as_array().ok_or_else(|| bad(format!("`mlp_layer_types` must be a list, got {v}")))?;
    if list.len() != n {
        return Err(bad(format!("`mlp_layer_types` lists {} layers, but num_hidden_layers is {n}", list.len())));
    }
    list.iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("dense") => Ok(true),
            Some("sparse") => Ok(false),
            _ => Err(bad(format!("`mlp_layer_types[{i}]` is {t}; expected \"dense\" or \"sparse\""))),
        })
        .collect()
}

/// The indexer's tensors under `self_attn.indexer.`, the rest as DeepSeek-V3.
pub(crate) fn source(hf: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    let ix = |l: usize, n: &str| Source::tensor(format!("model.layers.{l}.self_attn.indexer.{n}"));
    match id {
        TensorId::Layer(l, L::IdxWq) => ix(l, "wq_b.weight"),
        TensorId::Layer(l, L::IdxWk) => ix(l, "wk.weight"),
        TensorId::Layer(l, L::IdxKNorm) => ix(l, "k_norm.weight"),
        TensorId::Layer(l, L::IdxKNormBias) => ix(l, "k_norm.bias"),
        TensorId::Layer(l, L::IdxWeights) => ix(l, "weights_proj.weight"),
        other => super::deepseek::source(hf, cfg, other),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn tiny(extra: &str) -> HfConfig {
        let text = format!(
            r#"{{"architectures": ["DeepseekV32ForCausalLM"], "vocab_size": 50, "hidden_size": 32,
            "intermediate_size": 40, "moe_intermediate_size": 12, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 14, "kv_lora_rank": 10,
            "qk_nope_head_dim": 5, "qk_rope_head_dim": 6, "v_head_dim": 7, "n_routed_experts": 8,
            "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
            "index_topk": 4, "index_head_dim": 10, "index_n_heads": 3{extra}}}"#
        );
        HfConfig::parse(Path::new("config.json"), &text).unwrap()
    }

    #[test]
    fn every_layer_is_sparse_with_its_own_indexer() {
        let cfg = config(&tiny("")).unwrap();
        cfg.validate().unwrap();
        let ix = cfg.mla().unwrap().indexer.unwrap();
        assert_eq!((ix.heads, ix.head_dim, ix.top_k, ix.rope_dim, ix.rope_interleaved), (3, 10, 4, 6, false));
        assert!(cfg.layers.iter().all(|l| l.mixer == MixerSpec::Sparse { shared: false }));
        assert_eq!(cfg.layers[0].ffn, FfnSpec::Dense { ffn_dim: 40 });
        assert_eq!(cfg.layers[1].ffn, FfnSpec::Moe);
        assert!(cfg.rope.interleaved, "MLA rotates adjacent pairs");
        assert_eq!(cfg.moe.as_ref().unwrap().router.scale, 2.5, "the class default");
    }

    #[test]
    fn bad_indexer_keys_are_named() {
        for (extra, key) in [
            (r#", "index_topk": 0"#, "index_topk"),
            (r#", "index_n_heads": 0"#, "index_n_heads"),
            (r#", "index_head_dim": 4"#, "index_head_dim"),
            (r#", "q_lora_rank": null"#, "q_lora_rank"),
            (r#", "mlp_layer_types": ["dense", "moe", "sparse"]"#, "mlp_layer_types[1]"),
        ] {
            let err = config(&tiny(extra)).unwrap_err();
            assert!(matches!(err, Error::Checkpoint { .. }), "{extra}: {err}");
            assert!(err.to_string().contains(key), "{extra}: {err}");
        }
    }
}
