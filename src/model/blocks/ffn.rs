//! The gated feed-forward network used by dense layers, routed experts and
//! shared experts alike: `down(silu(gate · x) ⊙ (up · x))`.

use crate::kernels::{BlockQ8, Input, Matrix, matmul, matmul_many, matmul_serial};

/// x · sigmoid(x), written to saturate cleanly for large |x|.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The three matrices of a gated MLP (a dense layer, a routed or shared expert).
#[derive(Clone, Copy, Debug)]
pub struct Mlp<'a> {
    /// [F, D]
    pub gate: Matrix<'a>,
    /// [F, D]
    pub up: Matrix<'a>,
    /// [D, F]
    pub down: Matrix<'a>,
}

/// Scratch for one gated-MLP call over n rows.
pub struct MlpScratch<'a> {
    /// ≥ [n, F] gate activations.
    pub g: &'a mut [f32],
    /// ≥ [n, F] up activations.
    pub u: &'a mut [f32],
    /// ≥ [n, F/32] quantised hidden activations (used when `down` is block-quantised).
    pub hq: &'a mut [BlockQ8],
}

/// Runs the gated MLP on the n rows of `x` ([n, D]) into `out` ([n, D]).
/// `parallel`: split each matrix across the pool (false when the caller
/// already runs several MLPs side by side, one per thread).
pub fn gated_mlp(m: &Mlp, x: &Input, s: MlpScratch, out: &mut [f32], parallel: bool) {
    let f = m.gate.rows;
    let n = x.x.len() / x.cols;
    let (g, u) = (&mut s.g[..n * f], &mut s.u[..n * f]);
    if parallel {
        matmul_many(&mut [(m.gate, &mut *g), (m.up, &mut *u)], x); // [n, F] each
    } else {
        matmul_serial(&m.gate, x, g); // [n, F]
        matmul_serial(&m.up, x, u); // [n, F]
    }
    for (a, b) in g.iter_mut().zip(u.iter()) {
        *a = silu(*a) * b; // [n, F]
    }
    let h = Input::prepare(g, f, m.down.dtype.is_quantized(), s.hq);
    if parallel {
        matmul(&m.down, &h, out); // [n, D]
    } else {
        matmul_serial(&m.down, &h, out); // [n, D]
    }
}
