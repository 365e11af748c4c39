//! Matrix kernels: `y = W · x` for every weight type, split across threads.
//!
//! Model code calls [`matmul`] with a [`Matrix`] and never names a dtype or an
//! ISA. Work is split by output rows only (never one dot product across
//! threads), so results do not depend on the thread count.
//!
//! The scalar kernels in [`scalar`] are the reference; SIMD kernels chosen
//! once at start-up by feature detection slot in beside them.

pub mod scalar;

use rayon::prelude::*;

use crate::quant::DType;

/// A borrowed `[rows, cols]` weight matrix, row-major, in any storage type.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    /// Storage type of the rows.
    pub dtype: DType,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// `rows * row_bytes(cols)` bytes, aligned for the element type.
    pub bytes: &'a [u8],
}

impl<'a> Matrix<'a> {
    /// Wraps `bytes` as a `[rows, cols]` matrix of `dtype`; `None` if the
    /// length or alignment does not fit.
    pub fn new(dtype: DType, rows: usize, cols: usize, bytes: &'a [u8]) -> Option<Matrix<'a>> {
        let want = dtype.row_bytes(cols)?.checked_mul(rows)?;
        (bytes.len() == want && (bytes.as_ptr() as usize) % dtype.align() == 0).then_some(Matrix {
            dtype,
            rows,
            cols,
            bytes,
        })
    }

    fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols).expect("checked in new")
    }

    /// Dot product of row `r` with `x` (length `cols`).
    #[inline]
    pub fn dot_row(&self, r: usize, x: &[f32]) -> f32 {
        let rb = self.row_bytes();
        let raw = &self.bytes[r * rb..(r + 1) * rb];
        match self.dtype {
            DType::F32 => scalar::dot_f32(bytemuck::cast_slice(raw), x),
            DType::Bf16 => scalar::dot_bf16(bytemuck::cast_slice(raw), x),
            DType::F16 => scalar::dot_f16(bytemuck::cast_slice(raw), x),
        }
    }

    /// Decodes row `r` into `out` (length `cols`), e.g. an embedding lookup.
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        crate::quant::decode(self.dtype, &self.bytes[r * rb..(r + 1) * rb], out);
    }
}

/// A raw pointer that may cross threads; see the SAFETY notes where it is used.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

impl SendPtr {
    /// Taking the pointer through a method makes closures capture the whole
    /// wrapper (which is Send) rather than its raw-pointer field.
    fn get(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: only used by `matmul`, whose tasks write disjoint elements.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// Rows handed to one task: enough work to amortise scheduling (about 64 KiB
/// of weights), few enough that every thread gets several tasks.
fn rows_per_task(m: &Matrix, threads: usize) -> usize {
    let by_bytes = (64 * 1024 / m.row_bytes().max(1)).max(1);
    let by_threads = m.rows.div_ceil(threads * 4).max(1);
    by_bytes.min(by_threads).max(1)
}

/// `y[t, r] = Σ_c W[r, c] · x[t, c]` for `t < n` tokens: `x` is `[n, cols]`,
/// `y` is `[n, rows]`, both row-major. Runs on the current rayon pool.
pub fn matmul(w: &Matrix, x: &[f32], n: usize, y: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols, "matmul: x is not [n, cols]");
    assert_eq!(y.len(), n * w.rows, "matmul: y is not [n, rows]");
    if n == 0 || w.rows == 0 {
        return;
    }
    let chunk = rows_per_task(w, rayon::current_num_threads());
    if n == 1 {
        y.par_chunks_mut(chunk).enumerate().for_each(|(ci, ys)| {
            let r0 = ci * chunk;
            for (i, yv) in ys.iter_mut().enumerate() {
                *yv = w.dot_row(r0 + i, x);
            }
        });
        return;
    }
    let (rows, cols) = (w.rows, w.cols);
    let yp = SendPtr(y.as_mut_ptr());
    (0..rows.div_ceil(chunk)).into_par_iter().for_each(|ci| {
        for r in ci * chunk..((ci + 1) * chunk).min(rows) {
            for t in 0..n {
                let v = w.dot_row(r, &x[t * cols..(t + 1) * cols]);
                // SAFETY: `t * rows + r < n * rows == y.len()` (asserted above),
                // and row `r` belongs to exactly one task, so no two threads
                // write the same element; `y` is exclusively borrowed for the
                // whole call, so nothing else reads it meanwhile.
                unsafe { *yp.get().add(t * rows + r) = v };
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn matmul_matches_naive_for_every_type_and_awkward_shapes() {
        let mut s = 7u64;
        for dt in DType::ALL {
            for &(rows, cols, n) in &[(1, 1, 1), (3, 7, 2), (31, 33, 5), (255, 17, 1), (64, 1023, 3)] {
                let wf: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
                let mut wb = vec![0u8; dt.row_bytes(cols).unwrap() * rows];
                // Encode row by row into an aligned buffer.
                crate::quant::encode(dt, &wf, &mut wb);
                let mut aligned = vec![0f32; wb.len().div_ceil(4)];
                bytemuck::cast_slice_mut::<f32, u8>(&mut aligned)[..wb.len()].copy_from_slice(&wb);
                let bytes = &bytemuck::cast_slice::<f32, u8>(&aligned)[..wb.len()];
                let m = Matrix::new(dt, rows, cols, bytes).unwrap();
                let mut wd = vec![0f32; rows * cols];
                crate::quant::decode(dt, bytes, &mut wd);
                let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s)).collect();
                let mut y = vec![0f32; n * rows];
                matmul(&m, &x, n, &mut y);
                for t in 0..n {
                    for r in 0..rows {
                        let want: f64 = (0..cols).map(|c| wd[r * cols + c] as f64 * x[t * cols + c] as f64).sum();
                        let got = y[t * rows + r] as f64;
                        assert!(
                            (want - got).abs() <= 1e-5 * (cols as f64).sqrt().max(1.0),
                            "{dt} {rows}x{cols}: {want} vs {got}"
                        );
                    }
                }
            }
        }
    }
}
