//! NVIDIA Nemotron-H and Nemotron 3 (`NemotronHForCausalLM`), mirroring
//! transformers' `models/nemotron_h/modeling_nemotron_h.py`: a stack of
//! single-block layers, each `x += mixer(rmsnorm(x))` with one of four mixers
//! — Mamba2 (`M`), attention (`*`), a dense MLP (`-`) or the MoE block (`E`).
//!
//! The canonical layer is a token mixer then an FFN, so the adapter pairs
//! each Mamba2 or attention block with the MLP or MoE block right after it
//! (the released patterns alternate, e.g. `MEMEM*E…`); a mixer followed by
//! another mixer becomes a layer without FFN (`FfnSpec::None`), and an FFN
//! block that follows no mixer is refused. Canonical layer `l`'s norms are the
//! two blocks' own `norm`s; the residual adds are the same two.
//!
//! Quirks:
//! - the pattern comes as `layers_block_type` (what transformers 5.24
//!   saves), `layer_types`, or the Hub's `hybrid_override_pattern` string; the
//!   legacy names `mamba` / `attention` mean `linear_attention` /
//!   `full_attention`; `num_hidden_layers` is ignored (the list's length wins);
//! - Mamba2: `in_proj` rows are `[z (I), x (I), B (G·N), C (G·N), dt (H)]`
//!   with I = `mamba_num_heads · mamba_head_dim` (not `expand · hidden`),
//!   the convolution (with a bias) runs over `[x, B, C]`; B and C are shared by
//!   the `H / G` heads of a group; the gated norm is `rmsnorm(y · silu(z))` over
//!   groups of `I / G` channels (`norm_before_gate = False`), eps
//!   `layer_norm_epsilon`;
//! - the time step is floored at `time_step_min` in the chunked (prefill)
//!   scan only: `time_step_limit` from config.json (often `[0.0, Infinity]`)
//!   is never read, and the one-token (decode) update does not clamp at all.
//!   colibri floors at `time_step_min` in every step, so a prompt gives the
//!   same state whether fed at once or token by token;
//! - attention has no RoPE at all and scale `1/√head_dim`;
//! - the MLP and the experts are not gated: `down(relu(up · x)²)`; the shared
//!   expert is always there (`moe_shared_expert_intermediate_size`) and reads
//!   the block's normed input, whatever `n_shared_experts` says;
//! - routing as DeepSeek-V3: sigmoid scores, the choice on score +
//!   `e_score_correction_bias` within the `topk_group` best of `n_group`
//!   groups (sum of their two best), weights the chosen scores renormalised
//!   (`norm_topk_prob`, denominator + 1e-20) and times `routed_scaling_factor`;
//! - the latent MoE of Nemotron 3 Super/Ultra (`moe_latent_size` = L): the
//!   routed experts read `fc1_latent_proj · x` (`[L, D]`) and their weighted
//!   sum goes through `fc2_latent_proj` (`[D, L]`); the router and the shared
//!   expert read `x` itself;
//! - transformers renames the Hub's `backbone.*` to `model.*` and stacks the
//!   per-expert `experts.E.up_proj` / `down_proj`; both layouts are read;
//!   the multi-token-prediction layers (`mtp.*`) are skipped.

use serde_json::Value;

use super::{Arch, HfConfig, Source};
use crate::canonical::config::*;
use crate::canonical::tensors::{ExpertTensor as X, LayerTensor as L, TensorId};
use crate::error::{Error, Result};

pub static ARCH: Arch =
    Arch { hf_class: "NemotronHForCausalLM", model_type: "nemotron_h", config, source, ignored: mtp_tensors };

fn mtp_tensors(_: &HfConfig, name: &str) -> bool {
    name.starts_with("mtp.")
}

/// One Nemotron-H block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Block {
    Mamba,
    Attention,
    Mlp,
    Moe,
}

/// The blocks of the config, in order.
fn blocks(c: &HfConfig) -> Result<Vec<Block>> {
    let bad = |m: String| Error::checkpoint(&c.path, m);
    let by_name = |i: usize, t: &Value| match t.as_str() {
        Some("linear_attention" | "mamba") => Ok(Block::Mamba),
        Some("full_attention" | "attention") => Ok(Block::Attention),
        Some("mlp") => Ok(Block::Mlp),
        Some("moe") => Ok(Block::Moe),
        _ => Err(bad(format!("layer type {i} is {t}; Nemotron-H has linear_attention, full_attention, mlp and moe"))),
    };
    for key in ["layers_block_type", "layer_types"] {
        if let Some(v) = c.get(key) {
            let list = v.as_array().ok_or_else(|| bad(format!("`{key}` must be a list, got {v}")))?;
            return list.iter().enumerate().map(|(i, t)| by_name(i, t)).collect();
        }
    }
    let pattern = c.str("hybrid_override_pattern").ok_or_else(|| {
        bad("config.json has none of `layers_block_type`, `layer_types`, `hybrid_override_pattern`".into())
    })?;
    pattern
        .chars()
        .enumerate()
        .map(|(i, ch)| match ch {
            'M' => Ok(Block::Mamba),
            '*' => Ok(Block::Attention),
            '-' => Ok(Block::Mlp),
            'E' => Ok(Block::Moe),
            _ => Err(bad(format!("`hybrid_override_pattern` has {ch:?} at {i}; it may hold only M, *, - and E"))),
        })
        .collect()
}

/// Canonical layer `l` is Hub block `mixer` followed by block `ffn`, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pair {
    mixer: usize,
    ffn: Option<usize>,
}

/// The blocks paired into canonical layers (mixer, then the FFN after it).
fn pairs(c: &HfConfig, blocks: &[Block]) -> Result<Vec<Pair>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < blocks.len() {
        if matches!(blocks[i], Block::Mlp | Block::Moe) {
            return Err(Error::Unsupported(format!(
                "{}: Nemotron-H block {i} is an MLP/MoE block that follows no Mamba2 or attention block; \
                 colibri pairs each FFN block with the mixer before it",
                c.path.display()
            )));
        }
        let ffn = blocks.get(i + 1).filter(|b| matches!(b, Block::Mlp | Block::Moe)).map(|_| i + 1);
        out.push(Pair { mixer: i, ffn });
        i += if ffn.is_some() { 2 } else { 1 };
    }
    Ok(out)
}

fn layout(c: &HfConfig) -> Result<(Vec<Block>, Vec<Pair>)> {
    let b = blocks(c)?;
    let p = pairs(c, &b)?;
    Ok((b, p))
}

/// The first of `keys` present, else `default`.
fn usize_or(c: &HfConfig, keys: &[&str], default: usize) -> Result<usize> {
    for k in keys {
        if c.get(k).is_some() {
            return c.usize(&[k]);
        }
    }
    Ok(default)
}

fn f64_or(c: &HfConfig, keys: &[&str], default: f64) -> Result<f64> {
    for k in keys {
        if let Some(v) = c.opt_f64(k)? {
            return Ok(v);
        }
    }
    Ok(default)
}

fn config(c: &HfConfig) -> Result<ModelConfig> {
    let unsupported = |m: String| Err(Error::Unsupported(format!("{}: {m}", c.path.display())));
    for key in ["attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"] {
        if c.bool_or(key, false)? {
            return unsupported(format!("`{key}: true` is not supported (no released Nemotron-H sets it)"));
        }
    }
    if !c.bool_or("use_conv_bias", true)? || !c.bool_or("mamba_conv_bias", true)? {
        return unsupported("a Mamba2 convolution without bias (`use_conv_bias: false`) is not supported".into());
    }
    if let Some(a) = c.str("mlp_hidden_act").filter(|a| *a != "relu2") {
        return unsupported(format!("mlp_hidden_act \"{a}\" is not supported (relu2)"));
    }
    c.require_silu("mamba_hidden_act")?;
    let (blocks, pairs) = layout(c)?;
    let d = c.usize(&["hidden_size"])?;
    let h = usize_or(c, &["num_attention_heads"], 32)?;
    let hkv = usize_or(c, &["num_key_value_heads"], h)?;
    let dh = match c.get("head_dim") {
        Some(_) => c.usize(&["head_dim"])?,
        None => d / h.max(1),
    };
    let eps = f64_or(c, &["layer_norm_epsilon"], 1e-5)?;
    let any = |b: Block| blocks.contains(&b);
    let linear = any(Block::Mamba).then(|| -> Result<LinearSpec> {
        Ok(LinearSpec {
            kind: LinearKind::Mamba2 { dt_min: f64_or(c, &["time_step_min", "mamba_dt_min"], 0.001)? as f32 },
            k_heads: usize_or(c, &["n_groups", "mamba_n_groups"], 8)?,
            v_heads: usize_or(c, &["mamba_num_heads"], 128)?,
            k_head_dim: usize_or(c, &["ssm_state_size"], 128)?,
            v_head_dim: usize_or(c, &["mamba_head_dim"], 64)?,
            conv_kernel: usize_or(c, &["conv_kernel", "mamba_d_conv"], 4)?,
        })
    });
    let moe = any(Block::Moe).then(|| -> Result<MoeSpec> {
        let e = usize_or(c, &["n_routed_experts", "num_local_experts"], 8)?;
        let groups = usize_or(c, &["n_group"], 1)?;
        Ok(MoeSpec {
            num_experts: e,
            expert_ffn_dim: usize_or(c, &["moe_intermediate_size"], 7688)?,
            router: RouterSpec {
                top_k: usize_or(c, &["num_experts_per_tok"], 2)?,
                score: RouterScore::Sigmoid,
                renormalize: c.bool_or("norm_topk_prob", true)?,
                scale: f64_or(c, &["routed_scaling_factor"], 1.0)? as f32,
                correction_bias: true,
                groups: (groups > 1).then_some(GroupLimit {
                    groups,
                    top_groups: usize_or(c, &["topk_group"], 1)?,
                    score: GroupScore::TopTwoSum,
                }),
                ..Default::default()
            },
            activation: Activation::Relu2,
            shared_expert: Some(SharedExpertSpec {
                ffn_dim: usize_or(c, &["moe_shared_expert_intermediate_size"], 7688)?,
                sigmoid_gate: false,
            }),
            latent_dim: match c.get("moe_latent_size") {
                Some(_) => Some(c.usize(&["moe_latent_size"])?),
                None => None,
            },
            ..Default::default()
        })
    });
    let dense = usize_or(c, &["intermediate_size"], 21504)?;
    let layers = pairs
        .iter()
        .map(|p| LayerSpec {
            mixer: match blocks[p.mixer] {
                Block::Mamba => MixerSpec::Linear,
                _ => MixerSpec::FULL_ATTENTION,
            },
            ffn: match p.ffn.map(|i| blocks[i]) {
                None => FfnSpec::None,
                Some(Block::Moe) => FfnSpec::Moe,
                Some(_) => FfnSpec::Dense { ffn_dim: dense },
            },
        })
        .collect();
    Ok(ModelConfig {
        vocab_size: c.usize(&["vocab_size"])?,
        hidden_size: d,
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: dh,
        max_seq_len: usize_or(c, &["max_position_embeddings"], 4096)?,
        norm: NormSpec::rms(eps),
        rope: RopeSpec { theta: 10000.0, rotary_dim: dh, scaling: RopeScaling::None, interleaved: false },
        attention: AttentionSpec { no_rope: true, ..Default::default() },
        moe: moe.transpose()?,
        linear: linear.transpose()?,
        layers,
        tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
        dense_activation: Activation::Relu2,
        ..Default::default()
    })
}

/// `s` and its fallbacks with none of their rows kept (an empty tensor).
fn no_rows(s: Source) -> Source {
    let otherwise = s.otherwise.clone().map(|o| Box::new(no_rows(*o)));
    Source { otherwise, ..s.rows(1, 0, 0) }
}

/// The Hub's `backbone.<rest>`, else transformers' `model.<rest>`.
fn named(rest: &str) -> Source {
    Source::tensor(format!("backbone.{rest}")).or(Source::tensor(format!("model.{rest}")))
}

fn source(hf: &HfConfig, cfg: &ModelConfig, id: TensorId) -> Source {
    let missing = |what: String| Source::tensor(format!("<{what} has no Nemotron-H name>"));
    let pairs = match layout(hf) {
        Ok((_, p)) => p,
        Err(_) => return missing(id.to_string()),
    };
    let block = |l: usize, ffn: bool| -> Option<usize> {
        let p = pairs.get(l)?;
        if ffn { p.ffn } else { Some(p.mixer) }
    };
    let mixer = |l: usize, rest: &str| match block(l, false) {
        Some(i) => named(&format!("layers.{i}.mixer.{rest}")),
        None => missing(id.to_string()),
    };
    let ffn = |l: usize, rest: &str| match block(l, true) {
        Some(i) => named(&format!("layers.{i}.mixer.{rest}")),
        None => missing(id.to_string()),
    };
    match id {
        TensorId::Embed => named("embeddings.weight"),
        TensorId::FinalNorm => named("norm_f.weight"),
        TensorId::LmHead => Source::tensor("lm_head.weight"),
        TensorId::Expert(l, e, t) => {
            let w = if t == X::Down { "down_proj" } else { "up_proj" };
            let per_expert = ffn(l, &format!("experts.{e}.{w}.weight"));
            let source = match block(l, true) {
                Some(i) => per_expert.or(Source::expert(format!("model.layers.{i}.mixer.experts.{w}"), e)),
                None => per_expert,
            };
            // Not gated: `up_proj` is the gate; the up projection is empty.
            if t == X::Up { no_rows(source) } else { source }
        }
        TensorId::Layer(l, t) => {
            if let Some(src) = super::mamba2_source(cfg.linear, t, |name| mixer(l, name)) {
                return src;
            }
            match t {
                L::AttnNorm => match block(l, false) {
                    Some(b) => named(&format!("layers.{b}.norm.weight")),
                    None => missing(id.to_string()),
                },
                L::FfnNorm => match block(l, true) {
                    Some(b) => named(&format!("layers.{b}.norm.weight")),
                    None => missing(id.to_string()),
                },
                L::Wo if cfg.layers[l].mixer == MixerSpec::Linear => mixer(l, "out_proj.weight"),
                L::Wq => mixer(l, "q_proj.weight"),
                L::Wk => mixer(l, "k_proj.weight"),
                L::Wv => mixer(l, "v_proj.weight"),
                L::Wo => mixer(l, "o_proj.weight"),
                // Not gated: the one input matrix is the gate; the up projection is empty.
                L::Gate => ffn(l, "up_proj.weight"),
                L::Up => no_rows(ffn(l, "up_proj.weight")),
                L::Down => ffn(l, "down_proj.weight"),
                L::Router => ffn(l, "gate.weight"),
                L::RouterCorrection => ffn(l, "gate.e_score_correction_bias"),
                L::SharedGate => ffn(l, "shared_experts.up_proj.weight"),
                L::SharedUp => no_rows(ffn(l, "shared_experts.up_proj.weight")),
                L::SharedDown => ffn(l, "shared_experts.down_proj.weight"),
                L::MoeLatentIn => ffn(l, "fc1_latent_proj.weight"),
                L::MoeLatentOut => ffn(l, "fc2_latent_proj.weight"),
                _ => missing(id.to_string()),
            }
        }
        _ => missing(id.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn cfg(json: &str) -> HfConfig {
        HfConfig::parse(Path::new("config.json"), json).unwrap()
    }

    /// Mixers take the FFN block after them; two mixers in a row leave the
    /// first without FFN; an FFN block after an FFN block is refused.
    #[test]
    fn blocks_pair_into_layers() {
        let c = cfg(r#"{"hybrid_override_pattern": "MEM*-*"}"#);
        let (_, p) = layout(&c).unwrap();
        let want = [Pair { mixer: 0, ffn: Some(1) }, Pair { mixer: 2, ffn: None }, Pair { mixer: 3, ffn: Some(4) }];
        assert_eq!(p[..3], want);
        assert_eq!(p[3], Pair { mixer: 5, ffn: None });
        let c = cfg(r#"{"layers_block_type": ["mamba", "moe", "moe"]}"#);
        assert!(layout(&c).unwrap_err().to_string().contains("block 2"));
        let c = cfg(r#"{"hybrid_override_pattern": "MX"}"#);
        assert!(layout(&c).unwrap_err().to_string().contains("'X'"));
    }
}
