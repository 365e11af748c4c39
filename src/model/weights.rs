//! Typed references to a model's weights: where a tensor lives in the
//! mapped file, resolved to a matrix view on use, and the view of a gated
//! MLP's three matrices. The loader, the expert store and the blocks all
//! name weights through these; nothing here copies a byte.

use crate::canonical::tensors::TensorId;
use crate::error::{Error, Result};
use crate::format::reader::ColibriFile;
use crate::kernels::Matrix;

/// Where a tensor lives in the mapped file; resolved to a view on use, which
/// costs a bounds-checked slice and no allocation.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef {
    /// Index into the file's tensor table.
    pub(crate) idx: usize,
    /// Rows (1 for a vector).
    pub rows: usize,
    /// Columns.
    pub cols: usize,
}

/// The three matrices of a gated MLP (a dense layer, a routed or shared
/// expert) and their biases, if it has them.
#[derive(Clone, Copy, Debug)]
pub struct Mlp<'a> {
    /// [F, D]
    pub gate: Matrix<'a>,
    /// [F, D]
    pub up: Matrix<'a>,
    /// [D, F]
    pub down: Matrix<'a>,
    /// `[F]`, `[F]`, `[D]`: gate, up and down biases.
    pub bias: Option<[&'a [f32]; 3]>,
}

/// Resolves a canonical tensor to a reference, checking it can be viewed.
pub(crate) fn tensor_ref(file: &ColibriFile, id: TensorId) -> Result<TensorRef> {
    let name = id.to_string();
    let idx = file.index_of(&name).ok_or_else(|| Error::format(file.path(), format!("tensor {name} is missing")))?;
    let t = &file.meta().tensors[idx];
    let (rows, cols) = match t.shape.as_slice() {
        [c] => (1, *c),
        [r, c] => (*r, *c),
        // Stacked per-head matrices ([H, rows, cols]) are viewed as one.
        [h, r, c] => (*h * *r, *c),
        s => return Err(Error::format(file.path(), format!("tensor {name}: expected 1 to 3 dimensions, got {s:?}"))),
    };
    let tr = TensorRef { idx, rows, cols };
    let view = file.tensor_at(idx);
    if Matrix::new(view.dtype, rows, cols, view.bytes).is_none() {
        return Err(Error::format(file.path(), format!("tensor {name}: misaligned or wrongly sized data")));
    }
    Ok(tr)
}

/// The matrix view of a reference (validated when the reference was made).
pub(crate) fn matrix(file: &ColibriFile, t: TensorRef) -> Matrix<'_> {
    let view = file.tensor_at(t.idx);
    Matrix::new(view.dtype, t.rows, t.cols, view.bytes).expect("validated at load")
}
