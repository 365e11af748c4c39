//! MiniMax-M2 / M2.1 / M2.5 / M2.7 (`MiniMaxM2ForCausalLM`), mirroring
//! transformers' `models/minimax_m2/modeling_minimax_m2.py`.
//!
//! Quirks:
//! - q_norm / k_norm are RMSNorms over the WHOLE projection (widths H·Dh and
//!   Hkv·Dh, the Hub's `qk_norm_type: "per_layer"`), applied before the
//!   split into heads and before RoPE, as OLMoE; transformers always builds
//!   them and reads neither `use_qk_norm` nor `qk_norm_type`, so a config
//!   asking for anything else is refused rather than run differently;
//! - partial RoPE given by the Hub's top-level `rotary_dim` (64 of 128):
//!   transformers turns it into `partial_rotary_factor = rotary_dim / head_dim`
//!   unless a `partial_rotary_factor` is given, which then wins; halves
//!   layout (`rotate_half`), theta 5e6 by default;
//! - routing: sigmoid of the logits, the experts chosen on sigmoid +
//!   `block_sparse_moe.e_score_correction_bias` (transformers reads the
//!   buffer whatever `use_routing_bias` says; the released configs say
//!   true), weights the chosen sigmoids renormalised to sum 1, no scaling
//!   factor and no groups; transformers hardcodes the sigmoid, so a
//!   `scoring_func` other than `sigmoid` is refused;
//! - the Mixtral tensor layout: `block_sparse_moe.gate`, experts `w1` (gate),
//!   `w3` (up), `w2` (down); every layer MoE; no shared expert (a non-zero
//!   `shared_intermediate_size` is refused), no biases;
//! - `attn_type_list` (all 1, full attention, in the released configs) is
//!   not read by transformers: every layer is full softmax attention;
//! - multi-token-prediction tensors past `num_hidden_layers`, or under
//!   `mtp`, are skipped (`use_mtp` is not read by transformers).

use super::{Arch, HfConfig, Source, expert_part, llama_name};
use crate::canonical::config::*;
use crate::canonical::tensors::{LayerTensor, TensorId};
use crate::error::{Error, Result};

pub static ARCH: Arch =
    Arch { hf_class: "MiniMaxM2ForCausalLM", model_type: "minimax_m2", config, source, ignored: skips_mtp };

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    let unsupported = |key: &str, v: &str, only: &str| {
        Error::Unsupported(format!("{}: {key} = {v} is not supported (only {only})", c.path.display()))
    };
    if !c.bool_or("use_qk_norm", true)? {
        return Err(unsupported("use_qk_norm", "false", "true: transformers always normalises q and k"));
    }
    if let Some(t) = c.str("qk_norm_type").filter(|&t| t != "per_layer") {
        return Err(unsupported("qk_norm_type", &format!("\"{t}\""), "\"per_layer\""));
    }
    if let Some(s) = c.str("scoring_func").filter(|&s| s != "sigmoid") {
        return Err(unsupported("scoring_func", &format!("\"{s}\""), "\"sigmoid\""));
    }
    if let Some(s) = c.opt_usize("shared_intermediate_size")?.filter(|&s| s > 0) {
        return Err(unsupported("shared_intermediate_size", &s.to_string(), "0: no shared expert"));
    }
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let mut rope = c.rope(head_dim, 5e6)?;
    let partial_given = c.get("partial_rotary_factor").is_some()
        || c.get("rope_parameters").and_then(|p| p.get("partial_rotary_factor")).is_some();
    if let (false, Some(r)) = (partial_given, c.opt_usize("rotary_dim")?) {
        // As transformers: the factor r / Dh, then Dh times the factor.
        let factor = r as f64 / head_dim.max(1) as f64;
        rope.rotary_dim = ((head_dim as f64 * factor) as usize) & !1;
    }
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(196608),
        norm: NormSpec::rms(c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6)),
        rope,
        attention: AttentionSpec { qk_norm: QkNorm::Full, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: c.usize(&["num_local_experts", "num_experts"])?,
            expert_ffn_dim: c.usize(&["intermediate_size"])?,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                score: RouterScore::Sigmoid,
                renormalize: true,
                correction_bias: c.bool_or("use_routing_bias", true)?,
                ..Default::default()
            },
            ..Default::default()
        }),
        layers: (0..n).map(|_| LayerSpec { mixer: MixerSpec::FULL_ATTENTION, ffn: FfnSpec::Moe }).collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        ..Default::default()
    })
}

fn source(_: &HfConfig, _: &ModelConfig, id: TensorId) -> Source {
    let moe = |l: usize| format!("model.layers.{l}.block_sparse_moe");
    Source::tensor(match id {
        TensorId::Layer(l, LayerTensor::Router) => format!("{}.gate.weight", moe(l)),
        TensorId::Layer(l, LayerTensor::RouterCorrection) => format!("{}.e_score_correction_bias", moe(l)),
        TensorId::Expert(l, e, t) => {
            let (w, kind) = expert_part(t, ["w1", "w3", "w2"]);
            format!("{}.experts.{e}.{w}.{kind}", moe(l))
        }
        other => llama_name(other).unwrap_or_else(|| format!("<{other} has no MiniMax-M2 name>")),
    })
}

/// Multi-token-prediction modules: layers past `num_hidden_layers`, or `mtp.*`.
fn skips_mtp(c: &HfConfig, name: &str) -> bool {
    super::deepseek::past_the_layers(c, name) || name.starts_with("mtp.") || name.starts_with("model.mtp")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn cfg(extra: &str) -> HfConfig {
        let text = format!(
            r#"{{"architectures": ["MiniMaxM2ForCausalLM"], "hidden_size": 64, "head_dim": 16,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                "intermediate_size": 24, "num_local_experts": 8, "num_experts_per_tok": 2,
                "vocab_size": 50, "rope_theta": 5000000, "rotary_dim": 8{extra}}}"#
        );
        HfConfig::parse(Path::new("config.json"), &text).unwrap()
    }

    #[test]
    fn hub_config_maps_rotary_dim_and_the_router() {
        let m = config(&cfg(r#", "use_qk_norm": true, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
               "use_routing_bias": true, "shared_intermediate_size": 0"#))
        .unwrap();
        m.validate().unwrap();
        assert_eq!(m.rope.rotary_dim, 8);
        assert_eq!(m.rope.theta, 5e6);
        assert_eq!(m.attention.qk_norm, QkNorm::Full);
        let r = &m.moe.as_ref().unwrap().router;
        assert!(r.correction_bias && r.renormalize && r.score == RouterScore::Sigmoid);
    }

    #[test]
    fn a_partial_rotary_factor_wins_over_rotary_dim() {
        let m = config(&cfg(r#", "partial_rotary_factor": 0.25"#)).unwrap();
        assert_eq!(m.rope.rotary_dim, 4);
    }

    #[test]
    fn other_norms_and_scores_are_refused_by_key() {
        for (extra, key) in [
            (r#", "qk_norm_type": "per_head""#, "qk_norm_type"),
            (r#", "use_qk_norm": false"#, "use_qk_norm"),
            (r#", "scoring_func": "softmax""#, "scoring_func"),
            (r#", "shared_intermediate_size": 12"#, "shared_intermediate_size"),
        ] {
            let msg = config(&cfg(extra)).err().unwrap().to_string();
            assert!(msg.contains(key), "{msg}");
        }
    }
}
