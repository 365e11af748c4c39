//! The building blocks of the forward pass, each a plain function over
//! slices. Shapes use the glossary in `lib.rs` (T tokens of this chunk, D, H,
//! Hkv, Dh, E, K, F, V).

pub mod attention;
pub mod ffn;
pub mod moe;
pub mod norm;
pub mod rope;

use crate::kernels::BlockQ8;

/// Activations per quantised block ([`BlockQ8`]): the one place model code
/// learns the block size, for sizing and slicing quantised rows.
const Q8_BLOCK: usize = 32;
const _: () = assert!(std::mem::size_of::<BlockQ8>() == 8 + Q8_BLOCK);

/// Quantised blocks that `values` activations take (whole blocks only: a
/// row that is not a whole number of blocks is never quantised).
pub fn q8_blocks(values: usize) -> usize {
    values / Q8_BLOCK
}
