//! Per-head matrix products: each of H heads multiplies its own rows by its
//! own matrix (MLA's absorbed key and value up-projections). The heads run
//! side by side, one per thread, each through rows gathered into a
//! contiguous block, so every head's product is an ordinary serial matmul.

use rayon::prelude::*;

use super::{BlockQ8, Input, Matrix, matmul_serial};

/// Gather buffers of [`per_head_matmul`], sized once for up to C rows.
#[derive(Default)]
pub struct HeadScratch {
    /// The inputs are quantised for block-quantised matrices (the model has
    /// block weights); f32 rows otherwise.
    pub quantize: bool,
    /// [H, C, max input width] each head's input rows.
    pub input: Vec<f32>,
    /// [H, C·max input width/32 + 1] the same, quantised (at least one
    /// block per head, so every head has a slot).
    pub q: Vec<BlockQ8>,
    /// [H, C, max output width] each head's output rows.
    pub output: Vec<f32>,
}

impl HeadScratch {
    /// Buffers for `h` heads, up to `rows` rows, inputs of up to `input`
    /// values and outputs of up to `output` values per head and row.
    pub fn new(quantize: bool, h: usize, rows: usize, input: usize, output: usize) -> HeadScratch {
        HeadScratch {
            quantize,
            input: vec![0.0; h * rows * input],
            q: vec![BlockQ8::default(); h * (rows * input / 32 + 1)],
            output: vec![0.0; h * rows * output],
        }
    }
}

/// For each of the `h` heads: `out[t, head][..rh] = W_head · x[t, head][..W.cols]`,
/// where `x` rows are `[T, H, sx]`, `out` rows `[T, H, so]` (each head's part
/// at the start of its stride) and `W_head` is rows `head·rh..(head+1)·rh` of
/// `w` (per-head matrices stacked, rh = rows / H).
pub fn per_head_matmul(w: &Matrix, h: usize, x: &[f32], sx: usize, out: &mut [f32], so: usize, s: &mut HeadScratch) {
    let (n, rh, ci) = (x.len() / (h * sx), w.rows / h, w.cols);
    let (input, output) = (&mut s.input[..h * n * ci], &mut s.output[..h * n * rh]);
    for (head, rows) in input.chunks_exact_mut(n * ci).enumerate() {
        for (t, row) in rows.chunks_exact_mut(ci).enumerate() {
            let at = (t * h + head) * sx;
            row.copy_from_slice(&x[at..at + ci]); // [T, ci] of this head
        }
    }
    // Blocks per head when quantised (at least one slot per head either way,
    // so the zip below visits every head).
    let qw = if s.quantize && w.dtype.is_quantized() && ci.is_multiple_of(32) { n * ci / 32 } else { 0 };
    let q = &mut s.q[..h * qw.max(1)];
    input.par_chunks(n * ci).zip(output.par_chunks_mut(n * rh)).zip(q.par_chunks_mut(qw.max(1))).enumerate().for_each(
        |(head, ((xin, y), q))| {
            let inp = Input::prepare(xin, ci, qw > 0, q);
            matmul_serial(&w.row_range(head * rh, rh), &inp, y); // [T, rh]
        },
    );
    for (head, rows) in output.chunks_exact(n * rh).enumerate() {
        for (t, row) in rows.chunks_exact(rh).enumerate() {
            let at = (t * h + head) * so;
            out[at..at + rh].copy_from_slice(row);
        }
    }
}
