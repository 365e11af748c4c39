//! Phi-MoE (`PhimoeForCausalLM`, Phi-3.5-MoE), mirroring transformers'
//! `models/phimoe/modeling_phimoe.py`.
//!
//! Quirks:
//! - LayerNorm (with bias) everywhere, eps `rms_norm_eps`;
//! - `attention_bias` puts biases on q, k, v and o; `lm_head_bias` on lm_head;
//! - the router is the sparsemixer as transformers evaluates it in eval mode
//!   (top-2 by logit, each weight a softmax over the experts within a
//!   relative `2·router_jitter_noise` of that choice; see `blocks::moe`);
//! - experts are Mixtral's (`block_sparse_moe.experts.E.w1/w3/w2`, router
//!   `block_sparse_moe.gate`);
//! - LongRoPE: the short factors always set the frequencies, and the
//!   magnitude switches from `short_mscale` to `long_mscale` once a call's
//!   sequence passes `original_max_position_embeddings` (transformers'
//!   Phi-MoE recomputes the frequencies without the sequence length);
//! - `sliding_window` masks every layer when set.

use super::{Arch, HfConfig, Source, expert_part, llama_name};
use crate::canonical::config::*;
use crate::canonical::tensors::{LayerTensor as L, TensorId};
use crate::error::Result;

pub static ARCH: Arch =
    Arch { hf_class: "PhimoeForCausalLM", model_type: "phimoe", config, source, ignored: super::nothing_ignored };

fn config(c: &HfConfig) -> Result<ModelConfig> {
    c.require_silu("hidden_act")?;
    let d = c.usize(&["hidden_size"])?;
    let h = c.usize(&["num_attention_heads"])?;
    let head_dim = c.head_dim(d, h)?;
    let n = c.usize(&["num_hidden_layers"])?;
    let bias = c.bool_or("attention_bias", false)?;
    let window = c.opt_usize("sliding_window")?.filter(|&w| w > 0);
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(h),
        head_dim,
        max_seq_len: c.opt_usize("max_position_embeddings")?.unwrap_or(4096),
        norm: NormSpec { eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-5) as f32, kind: NormKind::Layer },
        rope: c.rope(head_dim, 1e6)?,
        attention: AttentionSpec { qkv_bias: bias, o_bias: bias, ..Default::default() },
        moe: Some(MoeSpec {
            num_experts: c.usize(&["num_local_experts", "num_experts"])?,
            expert_ffn_dim: c.usize(&["intermediate_size"])?,
            router: RouterSpec {
                top_k: c.usize(&["num_experts_per_tok"])?,
                score: RouterScore::SparseMixer {
                    jitter_eps: c.opt_f64("router_jitter_noise")?.unwrap_or(0.01) as f32,
                },
                ..Default::default()
            },
            ..Default::default()
        }),
        layers: (0..n).map(|_| LayerSpec { mixer: MixerSpec::Attention { window }, ffn: FfnSpec::Moe }).collect(),
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        lm_head_bias: c.bool_or("lm_head_bias", false)?,
        ..Default::default()
    })
}

fn source(_: &HfConfig, _: &ModelConfig, id: TensorId) -> Source {
    let moe = |l: usize| format!("model.layers.{l}.block_sparse_moe");
    match id {
        TensorId::Layer(l, L::Router) => Source::tensor(format!("{}.gate.weight", moe(l))),
        TensorId::Expert(l, e, t) => {
            // Mixtral's expert names (w1 gate, w3 up, w2 down).
            let (w, kind) = expert_part(t, ["w1", "w3", "w2"]);
            Source::tensor(format!("{}.experts.{e}.{w}.{kind}", moe(l)))
        }
        other => Source::tensor(llama_name(other).unwrap_or_else(|| format!("<{other} has no Phi-MoE name>"))),
    }
}
