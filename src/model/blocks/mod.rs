//! The building blocks of the forward pass, each a plain function over
//! slices. Shapes use the glossary in `lib.rs` (T tokens of this chunk, D, H,
//! Hkv, Dh, E, K, F, V).

pub mod attention;
pub mod ffn;
pub mod moe;
pub mod norm;
pub mod rope;
