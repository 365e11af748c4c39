//! colibri-moe: a CPU inference engine for Mixture-of-Experts language models.
//!
//! ```text
//! HF folder ──convert──► model.colibri ──mmap──► Model (shared, read-only)
//! ids ─► Session (KV cache + workspace) ─► embed → N × [norm → attention → +
//!        norm → MoE block → +] → norm → lm_head ─► logits ─► sampler
//! ```
//!
//! Modules, in the order data flows: [`arch`] (Hugging Face adapters) and
//! [`convert`] write the [`format`](mod@format), all describing a model by
//! the [`canonical`] config and tensor set; [`model`] loads it and runs the
//! forward pass from [`canonical::config::ModelConfig`] alone, with matrix
//! work in [`kernels`] and weight types in [`quant`]; [`engine`] holds sessions,
//! sampling and generation; [`imatrix`] records the importance matrices the
//! quantisers of [`convert`] can weight their errors by; `python` is the
//! thin PyO3 layer.
//!
//! Glossary of dimension letters used in shape comments:
//!
//! | letter | meaning |
//! | --- | --- |
//! | T | tokens in the current chunk |
//! | S | positions held by the KV cache |
//! | D | hidden size |
//! | H, Hkv | query heads, key/value heads |
//! | Dh | head width |
//! | R | rotary width (≤ Dh) |
//! | E | routed experts per MoE layer |
//! | K | experts chosen per token |
//! | F | intermediate width of an MLP or expert |
//! | V | vocabulary size |
//! | L | decoder layers |
#![deny(missing_docs)]
// Tests compute their references with std's functions on purpose; the
// library code goes through crate::math (clippy.toml).
#![cfg_attr(test, allow(clippy::disallowed_methods))]

#[cfg(target_endian = "big")]
compile_error!("colibri reads little-endian files through typed views; big-endian targets are not supported");

pub mod arch;
pub mod canonical;
pub mod capi;
pub mod convert;
pub mod engine;
pub mod error;
pub mod format;
#[cfg(any(test, feature = "testing"))]
pub mod fuzzing;
pub mod imatrix;
pub mod io;
pub mod kernels;
pub mod math;
pub mod model;
pub mod quant;
#[cfg(any(test, feature = "testing"))]
pub mod synth;
pub mod threads;

#[cfg(feature = "python")]
mod python;

pub use engine::{Engine, EngineOptions, GenerateOptions};
pub use error::{Error, Result};
