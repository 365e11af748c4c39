//! The `.colibri` file, version 1: the only code that knows byte offsets.
//!
//! ```text
//! offset 0   magic      8 bytes  b"COLIBRI\0"
//!        8   version    u32 LE   1
//!       12   flags      u32 LE   bit 0: a stage file ([`FLAG_PART`]); any other set bit is refused
//!       16   meta_len   u64 LE   length of the JSON metadata
//!       24   data_off   u64 LE   start of the tensor data, a multiple of 4096
//!       32   metadata   meta_len bytes of UTF-8 JSON ([`FileMeta`])
//!  data_off  tensor data; every offset in the metadata is relative to data_off
//! ```
//!
//! Every tensor starts at a multiple of 64. Each routed expert's gate, up and
//! down matrices are adjacent inside one slab that starts on a 4096-byte page,
//! so a single positioned read fetches the whole expert. `docs/FORMAT.md` is
//! the human-facing copy of this spec.
//!
//! [`reader::ColibriFile::open`] validates everything (magic, version, flags,
//! every offset, length, dtype size and overlap) before any tensor is handed
//! out; code after it trusts the typed views.

pub mod reader;
pub mod writer;

#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};

use crate::canonical::config::ModelConfig;
use crate::canonical::tensors::{PlannedTensor, TensorId, tensor_plan};
use crate::quant::DType;

/// First eight bytes of every `.colibri` file.
pub const MAGIC: [u8; 8] = *b"COLIBRI\0";
/// The format version this build reads and writes.
pub const VERSION: u32 = 1;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 32;
/// Alignment of every tensor, relative to the data start.
pub const TENSOR_ALIGN: u64 = 64;
/// Alignment of the data start and of every expert slab.
pub const PAGE: u64 = 4096;
/// Header flag: the file holds one pipeline stage of a model, not all of it
/// ([`FileMeta::part`]). A reader that predates stage files refuses it.
pub const FLAG_PART: u32 = 1;

/// The JSON metadata block.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FileMeta {
    /// Hugging Face class name of the source model (e.g. `MixtralForCausalLM`).
    pub architecture: String,
    /// The canonical config the forward pass runs from.
    pub config: ModelConfig,
    /// Storage type of the large matrices (small tensors are always f32);
    /// with a mixed recipe, that of the routed experts.
    pub weight_dtype: DType,
    /// The conversion recipe, when the matrices are not all of one type
    /// (`q4_1-mix`, or a `class=type` spec).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipe: Option<String>,
    /// Everything about the source needed for text I/O and provenance.
    #[serde(default)]
    pub source: SourceInfo,
    /// Every tensor, in file order.
    pub tensors: Vec<TensorEntry>,
    /// One slab per routed expert.
    pub experts: Vec<ExpertSlab>,
    /// Set in a stage file: which part of the whole model it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<Part>,
}

impl FileMeta {
    /// The tensors this file must hold, in the canonical order: the config's
    /// whole plan, or a stage file's share of it.
    pub fn plan(&self) -> Vec<PlannedTensor> {
        let mut plan = tensor_plan(&self.config);
        if let Some(part) = &self.part {
            plan.retain(|p| part.holds(&p.id, &self.config));
        }
        plan
    }
}

/// What a stage file (written by `convert::split`) holds of its model:
/// the tensors of a contiguous range of decoder layers, the embedding when
/// the range begins at layer 0 (or ends at the last with tied embeddings),
/// the final norm and head when it ends at the last layer, and every expert
/// slab of its layers. The config, tokenizer and source files are the whole
/// model's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    /// Index of this stage in its split, from 0.
    pub stage: usize,
    /// Stages in the split.
    pub stages: usize,
    /// First and one-past-last decoder layer held.
    pub layers: [usize; 2],
    /// The whole file it was cut from, as `<length>-<FNV-1a of its header
    /// and metadata, hex>`: stage files of one split share it.
    pub origin: String,
}

impl Part {
    /// The decoder layers held.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.layers[0]..self.layers[1]
    }

    /// True when a stage file of `cfg` with this part holds tensor `id`.
    pub fn holds(&self, id: &TensorId, cfg: &ModelConfig) -> bool {
        let (first, last) = (self.layers[0] == 0, self.layers[1] == cfg.main_layers());
        match id {
            TensorId::Embed => first || (last && cfg.tie_embeddings),
            TensorId::FinalNorm
            | TensorId::FinalNormBias
            | TensorId::LmHead
            | TensorId::LmHeadBias
            | TensorId::HcHeadFn
            | TensorId::HcHeadBase
            | TensorId::HcHeadScale => last,
            TensorId::Layer(l, _) | TensorId::Expert(l, _, _) => self.range().contains(l),
            // The multi-token-prediction layer runs after the whole model; no stage runs it.
            TensorId::Mtp(_) => false,
        }
    }

    /// What is wrong with this part for a model of `cfg`, if anything.
    pub fn check(&self, cfg: &ModelConfig) -> std::result::Result<(), String> {
        let [a, b] = self.layers;
        if self.stages == 0 || self.stage >= self.stages || a >= b || b > cfg.main_layers() {
            return Err(format!(
                "stage {} of {} holding layers {a}..{b} does not fit a model of {} layers",
                self.stage,
                self.stages,
                cfg.main_layers()
            ));
        }
        Ok(())
    }
}

/// Files of the source checkpoint embedded verbatim (when present), so one
/// `.colibri` file is the whole model.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SourceInfo {
    /// The original config.json.
    #[serde(default)]
    pub config: Option<serde_json::Value>,
    /// tokenizer.json.
    #[serde(default)]
    pub tokenizer: Option<serde_json::Value>,
    /// tokenizer_config.json.
    #[serde(default)]
    pub tokenizer_config: Option<serde_json::Value>,
    /// The chat template (from chat_template.jinja or tokenizer_config.json).
    #[serde(default)]
    pub chat_template: Option<String>,
    /// generation_config.json.
    #[serde(default)]
    pub generation_config: Option<serde_json::Value>,
    /// Dtype of the source weights as config.json states it.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Parts of the checkpoint the engine does not run and the converter
    /// left out, as `prefix.* (N tensors)` (a vision tower, a
    /// multi-token-prediction layer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
}

/// One tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Canonical name (see `canonical::tensors::TensorId`'s `Display`).
    pub name: String,
    /// Storage type.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Byte offset from the data start.
    pub offset: u64,
    /// Byte length.
    pub nbytes: u64,
}

/// The byte range holding one routed expert's three matrices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertSlab {
    /// Layer index.
    pub layer: usize,
    /// Expert index within the layer.
    pub expert: usize,
    /// Byte offset from the data start (a multiple of [`PAGE`]).
    pub offset: u64,
    /// Byte length (covers gate, up and down).
    pub nbytes: u64,
}

/// Rounds `x` up to a multiple of `a` (a power of two), `None` on overflow.
pub(crate) fn align_up(x: u64, a: u64) -> Option<u64> {
    debug_assert!(a.is_power_of_two());
    Some(x.checked_add(a - 1)? & !(a - 1))
}
