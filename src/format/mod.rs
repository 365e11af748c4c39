//! The `.colibri` file, version 1: the only code that knows byte offsets.
//!
//! ```text
//! offset 0   magic      8 bytes  b"COLIBRI\0"
//!        8   version    u32 LE   1
//!       12   flags      u32 LE   0 (no flags are defined in v1; any set bit is refused)
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
