//! The building blocks of the forward pass, each a plain function over
//! slices. Shapes use the glossary in `lib.rs` (T tokens of this chunk, D, H,
//! Hkv, Dh, E, K, F, V).

pub mod attention;
pub mod block_index;
pub mod delta;
pub mod ffn;
pub mod gqa;
pub mod hyper;
pub mod indexer;
pub mod kv_cache;
pub mod mla;
pub mod moe;
pub mod norm;
pub mod pooled;
pub mod rope;

use crate::kernels::Input;
use crate::quant::act::BlockQ8;

/// Activations per quantised block ([`BlockQ8`]): the one place model code
/// learns the block size, for sizing and slicing quantised rows.
const Q8_BLOCK: usize = 32;
const _: () = assert!(std::mem::size_of::<BlockQ8>() == 8 + Q8_BLOCK);

/// Quantised blocks that `values` activations take (whole blocks only: a
/// row that is not a whole number of blocks is never quantised).
pub fn q8_blocks(values: usize) -> usize {
    values / Q8_BLOCK
}

/// Prepares matmul inputs: the activations as they are, plus their
/// quantised twin when the model has block-quantised weights (so each input
/// is quantised once and read by every matrix it feeds). The buffer is sized
/// once; model code asks for an input and never handles blocks itself.
pub struct Inputs {
    quantize: bool,
    blocks: Vec<BlockQ8>,
}

impl Inputs {
    /// For inputs of up to `values` activations in all; quantising only
    /// when `quantize`.
    pub fn new(quantize: bool, values: usize) -> Inputs {
        Inputs { quantize, blocks: vec![BlockQ8::default(); q8_blocks(values)] }
    }

    /// Whether inputs get a quantised twin.
    pub fn quantize(&self) -> bool {
        self.quantize
    }

    /// The rows of `x` (`[n, cols]`) as a matmul input, quantised into this
    /// buffer when the model wants it and `cols` is a whole number of blocks.
    pub fn prepare<'a>(&'a mut self, x: &'a [f32], cols: usize) -> Input<'a> {
        Input::prepare(x, cols, self.quantize, &mut self.blocks)
    }
}

/// Test data for the blocks' tests: values in [-1, 1) from a 32-bit linear
/// congruential stream, the same for a seed on every CPU.
#[cfg(test)]
pub(crate) fn test_values(seed: u32) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(1664525).wrapping_add(1013904223);
        (s >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
    }
}
