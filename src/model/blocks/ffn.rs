//! The gated feed-forward network used by dense layers, routed experts and
//! shared experts alike: `down(act(gate · x + bg, up · x + bu)) + bd`, where
//! `act` is `silu(g) · u` for most models (biases only where the model has them).

use crate::canonical::config::Activation;
use crate::kernels::{Input, matmul, matmul_many, matmul_serial};
use crate::model::weights::Mlp;
use crate::quant::act::BlockQ8;

/// x · sigmoid(x), written to saturate cleanly for large |x|; the
/// experts' activation, so its e^x is the vectorisable polynomial
/// (`math::expf_poly`, within two ulp) rather than a libm call per value.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + crate::math::expf_poly(-x))
}

/// GELU with the tanh approximation, as torch's `gelu(x, approximate="tanh")`:
/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // √(2/π)
    0.5 * x * (1.0 + crate::math::tanhf(K * (x + 0.044715 * x * x * x)))
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + crate::math::expf(-x))
}

/// `act(g, u)` over one row pair, in place in `g`.
#[inline]
fn activate(act: Activation, g: &mut [f32], u: &[f32]) {
    match act {
        Activation::Silu => g.iter_mut().zip(u).for_each(|(a, &b)| *a = silu(*a) * b),
        Activation::Relu2 => g.iter_mut().for_each(|a| {
            let r = a.max(0.0);
            *a = r * r;
        }),
        Activation::GeluTanh => g.iter_mut().zip(u).for_each(|(a, &b)| *a = gelu_tanh(*a) * b),
        Activation::ClampedSwiglu { alpha, limit } => g.iter_mut().zip(u).for_each(|(a, &b)| {
            let x = a.min(limit);
            let y = b.clamp(-limit, limit);
            *a = (y + 1.0) * (x * (1.0 / (1.0 + crate::math::expf_poly(-(alpha * x)))));
        }),
        Activation::ClampedSilu { limit } => {
            g.iter_mut().zip(u).for_each(|(a, &b)| *a = silu(a.min(limit)) * b.clamp(-limit, limit))
        }
    }
}

/// Adds `bias` to each row of `y`.
pub fn add_bias(y: &mut [f32], bias: &[f32]) {
    for row in y.chunks_exact_mut(bias.len()) {
        row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
    }
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

/// Runs the gated MLP on the n rows of `x` ([n, D]) into `out` ([n, D]),
/// each matrix split across the pool.
pub fn gated_mlp(m: &Mlp, act: Activation, x: &Input, s: MlpScratch, out: &mut [f32]) {
    let (f, n) = (m.gate.rows, x.x.len() / x.cols);
    let (g, u) = (&mut s.g[..n * f], &mut s.u[..n * f]);
    if !act.gated() {
        matmul(&m.gate, x, g); // [n, F]: not gated, the up projection is empty
    } else {
        matmul_many(&mut [(m.gate, &mut *g), (m.up, &mut *u)], x); // [n, F] each
    }
    let h = hidden(m, act, g, u, s.hq); // [n, F]
    matmul(&m.down, &h, out); // [n, D]
    down_bias(m, out);
}

/// [`gated_mlp`] on the calling thread only, for callers that already run
/// several MLPs side by side, one per thread.
pub fn gated_mlp_serial(m: &Mlp, act: Activation, x: &Input, s: MlpScratch, out: &mut [f32]) {
    let (f, n) = (m.gate.rows, x.x.len() / x.cols);
    let (g, u) = (&mut s.g[..n * f], &mut s.u[..n * f]);
    matmul_serial(&m.gate, x, g); // [n, F]
    if act.gated() {
        matmul_serial(&m.up, x, u); // [n, F]
    }
    let h = hidden(m, act, g, u, s.hq); // [n, F]
    matmul_serial(&m.down, &h, out); // [n, D]
    down_bias(m, out);
}

/// `act(g + bg, u + bu)` into `g`, prepared (quantised into `hq` when `down`
/// is block-quantised) as the down projection's input.
fn hidden<'a>(m: &Mlp, act: Activation, g: &'a mut [f32], u: &mut [f32], hq: &'a mut [BlockQ8]) -> Input<'a> {
    if let Some([bg, bu, _]) = m.bias {
        add_bias(g, bg);
        add_bias(u, bu);
    }
    activate(act, g, u); // [n, F]
    Input::prepare(g, m.gate.rows, m.down.dtype.is_quantized(), hq)
}

/// `out += bd`, when the MLP has a down bias.
fn down_bias(m: &Mlp, out: &mut [f32]) {
    if let Some([_, _, bd]) = m.bias {
        add_bias(out, bd);
    }
}
