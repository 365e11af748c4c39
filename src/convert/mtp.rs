//! Multi-token-prediction layers: found in a checkpoint in either of the two
//! Hub layouts, and kept as the last layer of the canonical config plus the
//! four glue tensors of [`MtpTensor`] (see [`MtpSpec`] for the maths).
//!
//! - DeepSeek-V3 and GLM-4.5: `num_nextn_predict_layers` layers at
//!   `model.layers.{num_hidden_layers}..`, each an ordinary decoder layer plus
//!   `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`. Their
//!   `shared_head.head` and `embed_tokens` are copies of the model's own
//!   output head and embedding and stay unread. A draft step passes on the
//!   layer's output before `shared_head.norm`.
//! - Qwen3-Next and Qwen3.5: `mtp.fc`, `mtp.pre_fc_norm_embedding`,
//!   `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (a full-attention decoder
//!   layer named as the model's own are) and `mtp.norm`, whose output a draft
//!   step passes on. Their norms are the family's (zero-centred here).
//!
//! Only the first MTP layer is kept: a later draft step reuses it, as
//! DeepSeek's own multi-step drafting does with one layer.

use crate::arch::{Arch, HfConfig, Source};
use crate::canonical::config::{FfnSpec, LayerSpec, MixerSpec, ModelConfig, MtpSpec};
use crate::canonical::tensors::{MtpTensor, TensorId, tensor_plan};
use crate::error::{Error, Result};

/// Largest share of the file's parameters an MTP layer may add for
/// conversion to keep it without being asked (DeepSeek-V3's is 1.6%,
/// Qwen3-Next's about 2%; a tiny test model's is tens of percent).
const AUTO_SHARE: f64 = 0.05;

/// Which Hub layout holds the layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `model.layers.{L}` with `enorm`/`hnorm`/`eh_proj`/`shared_head`.
    DeepSeek {
        /// L: the checkpoint's ordinary layer count.
        at: usize,
    },
    /// `mtp.*`.
    Qwen,
}

impl Layout {
    /// The checkpoint's MTP layout, if it has MTP tensors.
    pub fn find(hf: &HfConfig, has: impl Fn(&str) -> bool) -> Option<Layout> {
        if has("mtp.fc.weight") {
            return Some(Layout::Qwen);
        }
        let at = hf.opt_usize("num_hidden_layers").ok().flatten()?;
        let deepseek = hf.opt_usize("num_nextn_predict_layers").ok().flatten().unwrap_or(0) > 0;
        (deepseek && has(&format!("model.layers.{at}.eh_proj.weight"))).then_some(Layout::DeepSeek { at })
    }

    /// Whether a Hub tensor belongs to the MTP layers (skipped when they are
    /// not kept).
    pub fn owns(self, name: &str) -> bool {
        match self {
            Layout::Qwen => name.starts_with("mtp."),
            Layout::DeepSeek { at } => name
                .strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|i| i.parse::<usize>().ok())
                .is_some_and(|i| i >= at),
        }
    }
}

/// `cfg` with the MTP layer appended when `keep` asks for it (`None`: when
/// it adds at most [`AUTO_SHARE`] of the parameters). Errors when asked to
/// keep a layer the checkpoint does not have or colibri cannot run.
pub fn with_mtp(
    hf: &HfConfig,
    mut cfg: ModelConfig,
    layout: Option<Layout>,
    keep: Option<bool>,
) -> Result<ModelConfig> {
    let path = hf.path.display();
    let layout = match (layout, keep) {
        (_, Some(false)) | (None, None) => return Ok(cfg),
        (None, Some(true)) => {
            return Err(Error::InvalidInput(format!(
                "{path}: keep_mtp: this checkpoint has no multi-token-prediction layer \
                 (no mtp.* tensors, no num_nextn_predict_layers)"
            )));
        }
        (Some(l), _) => l,
    };
    if cfg.layers.iter().any(|l| matches!(l.mixer, MixerSpec::Sparse { .. })) {
        if keep == Some(true) {
            return Err(Error::Unsupported(format!(
                "{path}: keep_mtp: the multi-token-prediction layers of sparse-attention models are not supported yet"
            )));
        }
        return Ok(cfg);
    }
    let base = tensor_plan(&cfg);
    let ffn = if cfg.moe.is_some() {
        FfnSpec::Moe
    } else {
        cfg.layers.last().map(|l| l.ffn.clone()).expect("validated: at least one layer")
    };
    cfg.layers.push(LayerSpec { mixer: MixerSpec::Attention { window: None }, ffn });
    cfg.mtp = Some(MtpSpec { chain_normed: layout == Layout::Qwen });
    if keep.is_none() {
        let count = |p: &[crate::canonical::tensors::PlannedTensor]| -> f64 {
            p.iter().map(|t| t.shape.iter().product::<usize>() as f64).sum()
        };
        let (without, with) = (count(&base), count(&tensor_plan(&cfg)));
        if with - without > AUTO_SHARE * without {
            cfg.layers.pop();
            cfg.mtp = None;
        }
    }
    Ok(cfg)
}

/// Where an MTP-layer tensor comes from, given the family's own sources
/// (`None`: not an MTP-layer tensor, the family's source as it is).
pub fn source(arch: &Arch, hf: &HfConfig, cfg: &ModelConfig, layout: Layout, id: TensorId) -> Option<Source> {
    let at = cfg.mtp_layer()?;
    // The family's norms are zero-centred when its final norm is stored so.
    let zero_centred = (arch.source)(hf, cfg, TensorId::FinalNorm).add_one;
    let norm = |name: String| {
        let s = Source::tensor(name);
        if zero_centred { s.plus_one() } else { s }
    };
    match (id, layout) {
        (TensorId::Mtp(t), Layout::Qwen) => Some(match t {
            MtpTensor::EmbedNorm => norm("mtp.pre_fc_norm_embedding.weight".into()),
            MtpTensor::HiddenNorm => norm("mtp.pre_fc_norm_hidden.weight".into()),
            MtpTensor::Proj => Source::tensor("mtp.fc.weight"),
            MtpTensor::OutNorm => norm("mtp.norm.weight".into()),
        }),
        (TensorId::Mtp(t), Layout::DeepSeek { at: hub }) => Some(match t {
            MtpTensor::EmbedNorm => norm(format!("model.layers.{hub}.enorm.weight")),
            MtpTensor::HiddenNorm => norm(format!("model.layers.{hub}.hnorm.weight")),
            MtpTensor::Proj => Source::tensor(format!("model.layers.{hub}.eh_proj.weight")),
            MtpTensor::OutNorm => norm(format!("model.layers.{hub}.shared_head.norm.weight")),
        }),
        (TensorId::Layer(l, _) | TensorId::Expert(l, _, _), Layout::Qwen) if l == at => {
            // Named as an ordinary layer `at` is, under `mtp.layers.0.`.
            Some(renamed((arch.source)(hf, cfg, id), &format!("layers.{at}."), "mtp.layers.0."))
        }
        _ => None,
    }
}

/// `s` (and its fallbacks) with everything up to and including `marker` in
/// the tensor name replaced by `prefix`.
fn renamed(mut s: Source, marker: &str, prefix: &str) -> Source {
    if let Some(i) = s.name.find(marker) {
        s.name = format!("{prefix}{}", &s.name[i + marker.len()..]);
    }
    s.otherwise = s.otherwise.map(|alt| Box::new(renamed(*alt, marker, prefix)));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_qwen_layer_name_moves_under_mtp() {
        let s = Source::tensor("model.language_model.layers.4.self_attn.q_proj.weight")
            .or(Source::tensor("model.layers.4.mlp.experts.gate_up_proj"));
        let r = renamed(s, "layers.4.", "mtp.layers.0.");
        assert_eq!(r.name, "mtp.layers.0.self_attn.q_proj.weight");
        assert_eq!(r.otherwise.unwrap().name, "mtp.layers.0.mlp.experts.gate_up_proj");
    }

    #[test]
    fn the_deepseek_layout_owns_the_layers_past_the_model() {
        let l = Layout::DeepSeek { at: 3 };
        assert!(l.owns("model.layers.3.eh_proj.weight"));
        assert!(l.owns("model.layers.4.mlp.gate.weight"));
        assert!(!l.owns("model.layers.2.mlp.gate.weight"));
        assert!(!l.owns("model.norm.weight"));
        assert!(Layout::Qwen.owns("mtp.fc.weight"));
        assert!(!Layout::Qwen.owns("model.layers.0.mtp"));
    }
}
