//! A pipeline stage: a contiguous range of a model's layers, run by one
//! process (a Ray actor, usually on a machine of its own). The first stage
//! also embeds the tokens and the last one also applies the final norm and
//! the output head; between stages travels the residual stream, `[T, D]`
//! f32 rows, which is all a layer reads of the layers before it.
//!
//! A stage maps the whole file but reads only its own layers' weights, so
//! its resident memory is its share of the file; sequences keep state
//! (caches) only for its layers.

use std::ops::Range;

use crate::canonical::config::ModelConfig;
use crate::error::{Error, Result};

/// Which part of the model a [`super::Model`] runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    /// The decoder layers this stage runs, in order.
    pub layers: Range<usize>,
    /// Total layers of the model's forward pass (the multi-token-prediction
    /// layer, if any, not counted).
    pub of: usize,
}

impl Stage {
    /// The whole model as one stage.
    pub fn whole(c: &ModelConfig) -> Stage {
        Stage { layers: 0..c.main_layers(), of: c.main_layers() }
    }

    /// The stage running `layers` of the model `c`, checked: a non-empty
    /// range of its forward pass's layers that does not begin at a sparse
    /// layer borrowing the layer before it's key selection (that selection
    /// lives only for the pass).
    pub fn new(c: &ModelConfig, layers: Range<usize>) -> Result<Stage> {
        let of = c.main_layers();
        if layers.start >= layers.end || layers.end > of {
            return Err(Error::InvalidInput(format!(
                "stage layers {}..{}: give a non-empty range within the model's {of} layers",
                layers.start, layers.end
            )));
        }
        if !c.stage_can_begin(layers.start) {
            return Err(Error::InvalidInput(format!(
                "stage layers {}..{}: layer {} reuses the key selection of the layer before it, so a stage \
                 cannot begin there; move the boundary",
                layers.start, layers.end, layers.start
            )));
        }
        Ok(Stage { layers, of })
    }

    /// True when this stage embeds the tokens (it runs layer 0).
    pub fn embeds(&self) -> bool {
        self.layers.start == 0
    }

    /// True when this stage computes the logits (it runs the last layer).
    pub fn heads(&self) -> bool {
        self.layers.end == self.of
    }

    /// True when this stage is the whole model.
    pub fn is_whole(&self) -> bool {
        self.embeds() && self.heads()
    }

    /// True when layer `l` belongs to this stage.
    pub fn runs(&self, l: usize) -> bool {
        self.layers.contains(&l)
    }
}

/// Splits `layer_bytes` (the weight bytes of each layer, in order) into
/// contiguous stages, one per entry of `shares`, each stage's bytes about
/// its share of the whole (shares are relative: a node's memory, say); the
/// embedding's bytes count with the first stage and the head's with the
/// last. Every stage gets at least one layer; a layer where no stage may
/// begin (`can_start[l] == false`) stays with the stage before it.
pub fn balance(
    layer_bytes: &[u64],
    head_bytes: (u64, u64),
    can_start: &[bool],
    shares: &[f64],
) -> Result<Vec<Range<usize>>> {
    let (n, k) = (layer_bytes.len(), shares.len());
    let starts = can_start.iter().skip(1).filter(|&&b| b).count() + 1;
    if k == 0 || k > starts {
        return Err(Error::InvalidInput(format!(
            "{k} stages: the model's {n} layers split into between 1 and {starts} stages"
        )));
    }
    if shares.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(Error::InvalidInput(format!("stage shares must be positive, got {shares:?}")));
    }
    let total = (layer_bytes.iter().sum::<u64>() + head_bytes.0 + head_bytes.1) as f64;
    let whole: f64 = shares.iter().sum();
    let mut out = Vec::with_capacity(k);
    let (mut begin, mut acc, mut upto) = (0, head_bytes.0 as f64, 0.0);
    for l in 0..n {
        acc += layer_bytes[l] as f64;
        let left = k - out.len() - 1; // stages still to begin after the current one
        if left == 0 || l + 1 == n || !can_start[l + 1] {
            continue;
        }
        let target = total * (upto + shares[out.len()]) / whole;
        // Cut when this stage has its share, or when every boundary still
        // possible is needed for the stages left.
        let later = can_start[l + 1..].iter().filter(|&&b| b).count();
        if acc >= target || later == left {
            upto += shares[out.len()];
            out.push(begin..l + 1);
            begin = l + 1;
        }
    }
    out.push(begin..n);
    Ok(out)
}

/// The weight bytes of each layer of `file`'s forward pass, and of the
/// embedding and of the final norm and head, for [`balance`].
pub fn layer_bytes(file: &crate::format::reader::ColibriFile) -> (Vec<u64>, u64, u64) {
    let c = &file.meta().config;
    let mut layers = vec![0u64; c.main_layers()];
    let (mut embed, mut head) = (0, 0);
    for t in &file.meta().tensors {
        let layer = t.name.strip_prefix("layers.").and_then(|r| r.split('.').next()?.parse::<usize>().ok());
        match (layer, t.name.as_str()) {
            (Some(l), _) if l < layers.len() => layers[l] += t.nbytes,
            (_, "embed") => embed += t.nbytes,
            (_, "lm_head" | "lm_head.bias" | "final_norm" | "final_norm.bias") => head += t.nbytes,
            _ => {} // the multi-token-prediction layer, which stages do not run
        }
    }
    if c.tie_embeddings {
        head += embed; // the last stage reads the same matrix as its head
    }
    (layers, embed, head)
}

/// Where a stage may begin in `c` ([`ModelConfig::stage_can_begin`]).
pub fn can_start(c: &ModelConfig) -> Vec<bool> {
    (0..c.main_layers()).map(|l| c.stage_can_begin(l)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balance_splits_by_bytes_and_honours_boundaries() {
        let (even, all) = ([10; 8], [true; 8]);
        assert_eq!(balance(&even, (0, 0), &all, &[1.0; 2]).unwrap(), vec![0..4, 4..8]);
        // A big embedding pulls the first boundary earlier.
        assert_eq!(balance(&even, (40, 0), &all, &[1.0; 2]).unwrap(), vec![0..2, 2..8]);
        // A node with three times the memory takes three times the bytes.
        assert_eq!(balance(&even, (0, 0), &all, &[3.0, 1.0]).unwrap(), vec![0..6, 6..8]);
        // Layers 1..4 cannot begin a stage: the first boundary moves to 4.
        let mut can = all;
        can[1..4].fill(false);
        assert_eq!(balance(&even, (40, 0), &can, &[1.0; 2]).unwrap(), vec![0..4, 4..8]);
        assert_eq!(balance(&even, (0, 0), &all, &[1.0; 8]).unwrap(), (0..8).map(|l| l..l + 1).collect::<Vec<_>>());
        assert_eq!(balance(&[1, 1, 100], (0, 0), &[true; 3], &[1.0; 3]).unwrap(), vec![0..1, 1..2, 2..3]);
        assert!(balance(&even, (0, 0), &all, &[1.0; 9]).is_err());
        assert!(balance(&even, (0, 0), &can, &[1.0; 6]).is_err());
        assert!(balance(&even, (0, 0), &all, &[]).is_err());
        assert!(balance(&even, (0, 0), &all, &[1.0, 0.0]).is_err());
    }
}
