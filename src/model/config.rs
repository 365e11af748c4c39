//! The canonical model config: one description that every supported
//! architecture maps onto (the adapters in `crate::arch` write it, the forward
//! pass reads it). It is stored verbatim as JSON in the `.colibri` metadata.
//!
//! Variants are named spec structs, never boolean tails: a reader of a config
//! literal sees `router: RouterSpec { score: Softmax, renormalize: true, .. }`.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Everything the forward pass needs to know about a model's shape and maths.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// V: vocabulary size (rows of the embedding and of lm_head).
    pub vocab_size: usize,
    /// D: hidden size.
    pub hidden_size: usize,
    /// H: query heads.
    pub num_heads: usize,
    /// Hkv: key/value heads (H is a multiple of Hkv).
    pub num_kv_heads: usize,
    /// Dh: width of one head.
    pub head_dim: usize,
    /// Longest sequence the model accepts (positions 0..max_seq_len).
    pub max_seq_len: usize,
    /// Normalisation used before attention, before the FFN and at the end.
    pub norm: NormSpec,
    /// Rotary position embedding.
    pub rope: RopeSpec,
    /// Attention variant shared by all layers.
    pub attention: AttentionSpec,
    /// The MoE block, shared by every MoE layer; `None` for a dense model.
    pub moe: Option<MoeSpec>,
    /// One entry per decoder layer, in order.
    pub layers: Vec<LayerSpec>,
    /// lm_head shares the embedding matrix.
    pub tie_embeddings: bool,
}

/// RMSNorm with a learned scale: `y = x / sqrt(mean(x²) + eps) * w`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct NormSpec {
    /// Added to the mean square before the square root.
    pub eps: f32,
}

/// Rotary position embedding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeSpec {
    /// Base of the geometric frequency ladder.
    pub theta: f64,
    /// Number of leading dimensions of each head that rotate (even, <= Dh).
    pub rotary_dim: usize,
    /// How the inverse frequencies and magnitudes are rescaled.
    pub scaling: RopeScaling,
}

/// The rope_scaling variants of the supported configs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (inverse frequencies divided by it).
    Linear {
        /// Interpolation factor.
        factor: f64,
    },
    /// YaRN: per-frequency blend of interpolation and extrapolation plus a
    /// magnitude factor on cos/sin.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Context length the model was trained at.
        original_max_position_embeddings: usize,
        /// Fast boundary of the ramp, in rotations.
        beta_fast: f64,
        /// Slow boundary of the ramp, in rotations.
        beta_slow: f64,
        /// Multiplier applied to cos and sin.
        attention_factor: f64,
        /// Round the ramp bounds to whole dimensions (transformers' default).
        truncate: bool,
    },
    /// Llama-3 style smooth per-frequency scaling.
    Llama3 {
        /// Scale for low frequencies.
        factor: f64,
        /// Wavelength boundary factor for low frequencies.
        low_freq_factor: f64,
        /// Wavelength boundary factor for high frequencies.
        high_freq_factor: f64,
        /// Context length the model was trained at.
        original_max_position_embeddings: usize,
    },
}

/// How q and k are normalised after projection, before RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    /// No q/k norm.
    None,
    /// RMSNorm over each head separately (weight of size Dh), as Qwen3.
    PerHead,
    /// RMSNorm over the whole projection (weights H·Dh and Hkv·Dh), as OLMoE.
    Full,
}

/// Attention variant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionSpec {
    /// q, k and v projections carry a bias.
    pub qkv_bias: bool,
    /// The output projection carries a bias.
    pub o_bias: bool,
    /// Normalisation of q and k.
    pub qk_norm: QkNorm,
    /// Clamp q, k and v to `[-c, c]` after projection and q/k norm, before
    /// RoPE (OLMoE's clip_qkv).
    pub clip_qkv: Option<f32>,
}

/// How router logits become expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterScore {
    /// Softmax over all experts, then top-k.
    Softmax,
}

/// The router of an MoE block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterSpec {
    /// K: experts chosen per token.
    pub top_k: usize,
    /// Scoring function applied to the router logits.
    pub score: RouterScore,
    /// Divide the K chosen weights by their sum.
    pub renormalize: bool,
    /// Multiply the final weights by this (1.0 for most models).
    pub scale: f32,
}

/// Activation of the gated FFN: `down(act(gate(x)) * up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// x · sigmoid(x).
    Silu,
}

/// An always-on expert beside the routed ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedExpertSpec {
    /// Intermediate width of the shared expert.
    pub ffn_dim: usize,
    /// Its output is scaled by `sigmoid(w · x)` (Qwen2-MoE's shared_expert_gate).
    pub sigmoid_gate: bool,
}

/// The MoE block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    /// E: routed experts per MoE layer.
    pub num_experts: usize,
    /// F: intermediate width of one routed expert.
    pub expert_ffn_dim: usize,
    /// Routing rule.
    pub router: RouterSpec,
    /// Activation of every expert.
    pub activation: Activation,
    /// Optional shared expert.
    pub shared_expert: Option<SharedExpertSpec>,
}

/// The feed-forward part of one layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FfnSpec {
    /// A gated dense MLP of the given intermediate width.
    Dense {
        /// Intermediate width.
        ffn_dim: usize,
    },
    /// The model's MoE block.
    Moe,
}

/// One decoder layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerSpec {
    /// Keys older than this many positions are masked (sliding window); `None` = full.
    pub sliding_window: Option<usize>,
    /// Dense MLP or MoE block.
    pub ffn: FfnSpec,
}

impl ModelConfig {
    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Routed experts in layer `l`: E for a MoE layer, 0 for a dense one.
    pub fn experts_in_layer(&self, l: usize) -> usize {
        match (&self.layers[l].ffn, &self.moe) {
            (FfnSpec::Moe, Some(m)) => m.num_experts,
            _ => 0,
        }
    }

    /// H·Dh: width of the query projection.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Hkv·Dh: width of the key and value projections.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Checks the internal consistency of the numbers, so later code can
    /// index without re-checking. `what` names the source in the message.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(format!("invalid model config: {m}")));
        let nonzero = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_seq_len", self.max_seq_len),
            ("layers", self.layers.len()),
        ];
        for (name, v) in nonzero {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        // Sizes large enough to overflow index arithmetic are refused here.
        const LIMIT: usize = 1 << 24;
        for (name, v) in nonzero {
            if v > LIMIT {
                return bad(format!("{name} = {v} is implausibly large"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        let rd = self.rope.rotary_dim;
        if rd == 0 || !rd.is_multiple_of(2) || rd > self.head_dim {
            return bad(format!("rotary_dim {rd} must be even and in 2..=head_dim {}", self.head_dim));
        }
        if self.rope.theta.is_nan() || self.rope.theta <= 0.0 {
            return bad(format!("rope theta {} must be > 0", self.rope.theta));
        }
        if self.norm.eps.is_nan() || self.norm.eps < 0.0 {
            return bad(format!("norm eps {} must be >= 0", self.norm.eps));
        }
        match &self.rope.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } | RopeScaling::Yarn { factor, .. } | RopeScaling::Llama3 { factor, .. } => {
                if factor.is_nan() || *factor <= 0.0 {
                    return bad(format!("rope scaling factor {factor} must be > 0"));
                }
            }
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.sliding_window == Some(0) {
                return bad(format!("layer {i}: sliding window of 0"));
            }
            match l.ffn {
                FfnSpec::Dense { ffn_dim } => {
                    if ffn_dim == 0 || ffn_dim > LIMIT {
                        return bad(format!("layer {i}: dense ffn_dim {ffn_dim} out of range"));
                    }
                }
                FfnSpec::Moe => {
                    let Some(moe) = &self.moe else {
                        return bad(format!("layer {i} is MoE but the config has no MoE block"));
                    };
                    let (e, k, f) = (moe.num_experts, moe.router.top_k, moe.expert_ffn_dim);
                    if e == 0 || e > 4096 || k == 0 || k > e || f == 0 || f > LIMIT {
                        return bad(format!("MoE block: num_experts {e}, top_k {k}, expert_ffn_dim {f} out of range"));
                    }
                    if let Some(s) = &moe.shared_expert
                        && (s.ffn_dim == 0 || s.ffn_dim > LIMIT)
                    {
                        return bad(format!("shared expert ffn_dim {} out of range", s.ffn_dim));
                    }
                }
            }
        }
        Ok(())
    }
}
