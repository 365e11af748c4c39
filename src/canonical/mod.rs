//! The canonical description of a model: its config and the tensor set
//! derived from it. Plain data below everything that reads it — the adapters,
//! the converter, the file format and the forward pass all import it, and it
//! imports none of them.

pub mod config;
pub mod state;
pub mod tensors;
