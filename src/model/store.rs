//! The expert store (DESIGN.md seam 5): the one place that decides where a
//! routed expert's bytes come from.
//!
//! The MoE block asks for expert (layer, e) and gets borrowed matrices. Today
//! the only store is [`ResidentStore`], a view into the mapped file; a
//! RAM-budgeted cache filled by positioned reads slots in behind the same
//! trait without touching the forward pass. A store may change speed, never
//! the numbers: whatever it returns must be the bytes in the file.

use std::sync::Arc;

use super::blocks::ffn::Mlp;
use super::config::{FfnSpec, ModelConfig};
use super::tensors::{ExpertTensor, TensorId};
use super::{TensorRef, matrix, tensor_ref};
use crate::error::Result;
use crate::format::reader::ColibriFile;

/// The three matrices of one routed expert.
pub type ExpertView<'a> = Mlp<'a>;

/// Supplies routed experts' weights to the MoE block.
pub trait ExpertStore: Send + Sync {
    /// Expert `e` of layer `layer`. Errors (e.g. an I/O failure in a
    /// streaming store) abort the forward pass with a message.
    fn expert(&self, layer: usize, e: usize) -> Result<ExpertView<'_>>;

    /// A hint that these experts of `layer` are needed soon. The resident
    /// store ignores it.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}
}

/// Every expert resident through the file mapping.
pub struct ResidentStore {
    file: Arc<ColibriFile>,
    /// refs[layer][expert] = [gate, up, down]; empty for dense layers.
    refs: Vec<Vec<[TensorRef; 3]>>,
}

impl ResidentStore {
    /// Resolves every expert of every MoE layer of `cfg` in `file`.
    pub fn new(file: Arc<ColibriFile>, cfg: &ModelConfig) -> Result<ResidentStore> {
        let mut refs = Vec::with_capacity(cfg.layers.len());
        for (l, spec) in cfg.layers.iter().enumerate() {
            let n = match (&spec.ffn, &cfg.moe) {
                (FfnSpec::Moe, Some(m)) => m.num_experts,
                _ => 0,
            };
            let mut layer = Vec::with_capacity(n);
            for e in 0..n {
                let r = |x| tensor_ref(&file, TensorId::Expert(l, e, x));
                layer.push([r(ExpertTensor::Gate)?, r(ExpertTensor::Up)?, r(ExpertTensor::Down)?]);
            }
            refs.push(layer);
        }
        Ok(ResidentStore { file, refs })
    }
}

impl ExpertStore for ResidentStore {
    fn expert(&self, layer: usize, e: usize) -> Result<ExpertView<'_>> {
        let [g, u, d] = self.refs[layer][e];
        Ok(ExpertView { gate: matrix(&self.file, g), up: matrix(&self.file, u), down: matrix(&self.file, d) })
    }
}
