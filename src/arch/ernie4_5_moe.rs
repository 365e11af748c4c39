//! ERNIE-4.5 MoE (`Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B, 300B-A47B and
//! their thinking versions), mirroring transformers'
//! `models/ernie4_5_moe/modeling_ernie4_5_moe.py`.
//!
//! Quirks:
//! - RoPE rotates adjacent pairs (2i, 2i+1) with frequency i over the whole
//!   head (transformers repeats each cos/sin entry twice and rotates the
//!   even/odd lanes), not the halves layout of Llama; theta 5e5 by default;
//! - layer `l` is MoE when `(l + 1) % moe_layer_interval == 0` and
//!   `moe_layer_start_index <= l <= moe_layer_end_index` (−1, the default,
//!   meaning the last layer); the others are dense MLPs of `intermediate_size`;
//! - routing: softmax over all experts in f32; the experts are chosen on the
//!   softmax plus `mlp.moe_statics.e_score_correction_bias` (stored `[1, E]`),
//!   the weights are the chosen softmax values divided by
//!   `max(their sum, moe_norm_min)` (always, there is no switch);
//! - `moe_num_shared_experts` shared experts are one ungated MLP of width
//!   `moe_intermediate_size · moe_num_shared_experts`, added to every token;
//! - the Hub's keys are `moe_num_experts` and `moe_k`;
//! - `use_bias` would put biases on q/k/v/o and on the dense and shared
//!   MLPs; every released checkpoint has it false, and the engine has no MLP
//!   biases, so it is refused;
//! - multi-token-prediction tensors (any name containing `mtp`, as
//!   transformers ignores them) are skipped.

use super::{Arch, HfConfig, Source, llama_name, qwen_moe_name, shared_experts_name};
use crate::canonical::config::*;
use crate::canonical::tensors::{LayerTensor, TensorId};
use crate::error::{Error, Result};

pub static ARCH: Arch =
    Arch { hf_class: "Ernie4_5_MoeForCausalLM", model_type: "ernie4_5_moe", config, source, ignored: skips_mtp };

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    if c.bool_or("use_bias", false)? {
        return Err(Error::Unsupported(format!(
            "{}: use_bias = true is not supported (biases on the dense and shared-expert MLPs)",
            c.path.display()
        )));
    }
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let mut rope = c.rope(head_dim, 500000.0)?;
    rope.interleaved = true;
    let f = c.usize(&["moe_intermediate_size"])?;
    let shared = c.opt_usize("moe_num_shared_experts")?.unwrap_or(0);
    let dense_ffn = c.usize(&["intermediate_size"])?;
    let sparse = moe_layers(c, n)?;
    let floor = c.opt_f64("moe_norm_min")?.unwrap_or(1e-12);
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(131072),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-5)),
        rope,
        moe: Some(MoeSpec {
            num_experts: c.usize(&["moe_num_experts", "num_experts"])?,
            expert_ffn_dim: f,
            router: RouterSpec {
                top_k: c.usize(&["moe_k", "num_experts_per_tok"])?,
                renormalize: true,
                renormalize_floor: floor as f32,
                correction_bias: true,
                ..Default::default()
            },
            shared_expert: (shared > 0).then_some(SharedExpertSpec { ffn_dim: shared * f, sigmoid_gate: false }),
            ..Default::default()
        }),
        layers: sparse
            .iter()
            .map(|&moe| LayerSpec {
                mixer: MixerSpec::FULL_ATTENTION,
                ffn: if moe { FfnSpec::Moe } else { FfnSpec::Dense { ffn_dim: dense_ffn } },
            })
            .collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", true)?,
        ..Default::default()
    })
}

/// Which layers are MoE (see the module note).
fn moe_layers(c: &HfConfig, n: usize) -> Result<Vec<bool>> {
    let start = c.opt_usize("moe_layer_start_index")?.unwrap_or(1);
    let interval = c.opt_usize("moe_layer_interval")?.unwrap_or(1);
    let end = match c.get("moe_layer_end_index").and_then(|v| v.as_i64()) {
        None | Some(-1) => n.saturating_sub(1),
        Some(e) if e >= 0 => e as usize,
        Some(e) => {
            return Err(Error::checkpoint(
                &c.path,
                format!("config field `moe_layer_end_index` must be -1 or a layer index, got {e}"),
            ));
        }
    };
    if interval == 0 {
        return Err(Error::checkpoint(&c.path, "config field `moe_layer_interval` must be at least 1"));
    }
    Ok((0..n).map(|l| (l + 1).is_multiple_of(interval) && l >= start && l <= end).collect())
}

fn source(_: &HfConfig, _: &ModelConfig, id: TensorId) -> Source {
    Source::tensor(match id {
        TensorId::Layer(l, LayerTensor::RouterCorrection) => {
            format!("model.layers.{l}.mlp.moe_statics.e_score_correction_bias")
        }
        _ => shared_experts_name(id)
            .or_else(|| qwen_moe_name(id))
            .or_else(|| llama_name(id))
            .unwrap_or_else(|| format!("<{id} has no ERNIE-4.5 name>")),
    })
}

/// transformers skips every checkpoint key containing `mtp`.
fn skips_mtp(_: &HfConfig, name: &str) -> bool {
    name.contains("mtp")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn cfg(extra: &str) -> HfConfig {
        let text = format!(
            r#"{{"architectures": ["Ernie4_5_MoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_hidden_layers": 8, "intermediate_size": 48,
                "moe_intermediate_size": 16, "moe_num_experts": 8, "moe_k": 2, "moe_num_shared_experts": 2,
                "vocab_size": 50, "rope_theta": 500000{extra}}}"#
        );
        HfConfig::parse(Path::new("config.json"), &text).unwrap()
    }

    fn moe_at(m: &ModelConfig) -> Vec<usize> {
        (0..m.num_layers()).filter(|&l| m.layers[l].ffn == FfnSpec::Moe).collect()
    }

    #[test]
    fn hub_config_maps_layers_router_and_rope() {
        let m = config(&cfg("")).unwrap();
        m.validate().unwrap();
        assert_eq!(moe_at(&m), [1, 2, 3, 4, 5, 6, 7]);
        assert!(m.rope.interleaved && m.rope.rotary_dim == 16 && m.tie_embeddings);
        let moe = m.moe.as_ref().unwrap();
        assert_eq!(moe.shared_expert.as_ref().unwrap().ffn_dim, 32);
        assert!(moe.router.correction_bias && moe.router.renormalize);
        assert_eq!(moe.router.renormalize_floor, 1e-12);
        let m = config(&cfg(
            r#", "moe_layer_start_index": 2, "moe_layer_end_index": 5, "moe_layer_interval": 2, "moe_norm_min": 0.5"#,
        ))
        .unwrap();
        assert_eq!(moe_at(&m), [3, 5]);
        assert_eq!(m.moe.unwrap().router.renormalize_floor, 0.5);
    }

    #[test]
    fn biases_and_bad_layer_ranges_are_refused_by_key() {
        for (extra, key) in [
            (r#", "use_bias": true"#, "use_bias"),
            (r#", "moe_layer_end_index": -3"#, "moe_layer_end_index"),
            (r#", "moe_layer_interval": 0"#, "moe_layer_interval"),
        ] {
            let msg = config(&cfg(extra)).err().unwrap().to_string();
            assert!(msg.contains(key), "{msg}");
        }
    }
}
