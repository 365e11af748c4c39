//! The gated feed-forward network used by dense layers, routed experts and
//! shared experts alike: `down(silu(gate · x) ⊙ (up · x))`.

use crate::kernels::{Matrix, matmul};

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

/// Runs the gated MLP on `n` rows: `x` is [n, D], `out` is [n, D]; `g` and `u`
/// are scratch of at least [n, F].
pub fn gated_mlp(m: &Mlp, x: &[f32], n: usize, g: &mut [f32], u: &mut [f32], out: &mut [f32]) {
    let f = m.gate.rows;
    let (g, u) = (&mut g[..n * f], &mut u[..n * f]);
    matmul(&m.gate, x, n, g); // [n, F]
    matmul(&m.up, x, n, u); // [n, F]
    for (a, b) in g.iter_mut().zip(u.iter()) {
        *a = silu(*a) * b; // [n, F]
    }
    matmul(&m.down, g, n, out); // [n, D]
}
