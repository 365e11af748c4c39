//! Manifold-constrained hyper-connections ([`HyperSpec`]): the residual is
//! N streams of width D per token, `x: [T, N·D]`. Around each block the
//! streams collapse into the block's input and the block's output spreads
//! back over them, with weights each token computes from its own streams:
//!
//! ```text
//! m    = fn · (x / rms(x))                          [(2 + N)·N]   x: the N·D values of a token
//! pre  = sigmoid(m[..N]·s0 + b) + eps               [N]
//! post = 2·sigmoid(m[N..2N]·s1 + b)                 [N]
//! comb = softmax_k(m[2N..]·s2 + b) + eps            [N, N]  (row j, column k)
//!        then columns, (rows, columns)×(iters − 1), each divided by its sum + eps
//! in   = Σ_j pre_j · x_j                            [D]     the block's input
//! x'_k = post_k · block(in) + Σ_j comb_jk · x_j     [N·D]
//! ```
//!
//! The final collapse before the model's norm uses `pre` alone, from a
//! head of its own (`fn` [N, N·D]). Every token is computed apart, so the
//! rows split across threads without changing a bit.

use rayon::prelude::*;

use crate::canonical::config::HyperSpec;
use crate::quant::DType;

/// One hyper-connection's weights: `fn` [(2 + N)·N, N·D] (or [N, N·D] for
/// the final head), its bias and its scales (3, or 1 for the head).
#[derive(Clone, Copy)]
pub struct Hyper<'a> {
    /// The spec.
    pub spec: HyperSpec,
    /// The unweighted RMSNorm's epsilon (the model's norm epsilon).
    pub norm_eps: f32,
    /// [M, N·D]
    pub fn_: &'a [f32],
    /// `[M]`
    pub base: &'a [f32],
    /// `[3]` or `[1]`
    pub scale: &'a [f32],
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + crate::math::expf(-x))
}

impl Hyper<'_> {
    /// The projection `fn · (x / rms(x))` of one token's streams into `m`.
    fn mixes(&self, x: &[f32], m: &mut [f32]) {
        let w = x.len();
        let ms = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / w as f64;
        let inv = (1.0 / (ms + self.norm_eps as f64).sqrt()) as f32;
        // The rows' dot products through the f32 attention kernel (a plain
        // sum does not vectorise: 24 rows of 16384 at V4-Flash's width were
        // 8% of a prefill), then the norm's scale.
        let kk = crate::kernels::kv_fns(DType::F32).expect("f32 attention kernels");
        let rows = m.len();
        (kk.dots)(bytemuck::cast_slice(&self.fn_[..rows * w]), w, rows, &[x], m, rows);
        m.iter_mut().for_each(|v| *v *= inv);
    }

    /// Before a block: for each of the `[T, N·D]` rows of `x`, the block's
    /// input into `col` ([T, D]), and `post` ([T, N]) and `comb` ([T, N·N])
    /// for [`Hyper::after`].
    pub fn before(&self, x: &[f32], col: &mut [f32], post: &mut [f32], comb: &mut [f32]) {
        let n = self.spec.streams;
        let d = col.len() / (post.len() / n);
        let eps = self.spec.eps;
        col.par_chunks_exact_mut(d)
            .zip(post.par_chunks_exact_mut(n))
            .zip(comb.par_chunks_exact_mut(n * n))
            .zip(x.par_chunks_exact(n * d))
            .for_each(|(((col, post), comb), x)| {
                let mut m = [0.0f32; MAX_MIX];
                let m = &mut m[..(2 + n) * n];
                self.mixes(x, m);
                let (s0, s1, s2) = (self.scale[0], self.scale[1], self.scale[2]);
                let mut pre = [0.0f32; MAX_STREAMS];
                for j in 0..n {
                    pre[j] = sigmoid(m[j] * s0 + self.base[j]) + eps;
                    post[j] = 2.0 * sigmoid(m[n + j] * s1 + self.base[n + j]);
                }
                for j in 0..n {
                    let row = &mut comb[j * n..(j + 1) * n];
                    for k in 0..n {
                        row[k] = m[2 * n + j * n + k] * s2 + self.base[2 * n + j * n + k];
                    }
                    let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let mut z = 0.0f32;
                    for v in row.iter_mut() {
                        *v = crate::math::expf(*v - mx);
                        z += *v;
                    }
                    row.iter_mut().for_each(|v| *v = *v / z + eps);
                }
                normalize_columns(comb, n, eps);
                for _ in 1..self.spec.sinkhorn_iters {
                    for row in comb.chunks_exact_mut(n) {
                        let s: f32 = row.iter().sum();
                        row.iter_mut().for_each(|v| *v /= s + eps);
                    }
                    normalize_columns(comb, n, eps);
                }
                collapse(x, &pre[..n], col);
            });
    }

    /// After a block: `x'_k = post_k · y + Σ_j comb_jk · x_j` for every row,
    /// `y` the block's output [T, D]; `tmp` holds [T, N·D].
    pub fn after(&self, x: &mut [f32], y: &[f32], post: &[f32], comb: &[f32], tmp: &mut [f32]) {
        let n = self.spec.streams;
        let d = y.len() / (post.len() / n);
        tmp[..x.len()].copy_from_slice(x);
        x.par_chunks_exact_mut(n * d)
            .zip(tmp.par_chunks_exact(n * d))
            .zip(y.par_chunks_exact(d))
            .zip(post.par_chunks_exact(n).zip(comb.par_chunks_exact(n * n)))
            .for_each(|(((out, old), y), (post, comb))| {
                for k in 0..n {
                    let o = &mut out[k * d..(k + 1) * d];
                    for (i, v) in o.iter_mut().enumerate() {
                        let mut acc = 0.0f32;
                        for j in 0..n {
                            acc += comb[j * n + k] * old[j * d + i];
                        }
                        *v = post[k] * y[i] + acc;
                    }
                }
            });
    }

    /// The final collapse of each row of `x` ([T, N·D]) into `col` ([T, D]).
    pub fn head(&self, x: &[f32], col: &mut [f32]) {
        let n = self.spec.streams;
        let d = self.fn_.len() / n / n;
        col.par_chunks_exact_mut(d).zip(x.par_chunks_exact(n * d)).for_each(|(col, x)| {
            let mut m = [0.0f32; MAX_STREAMS];
            self.mixes(x, &mut m[..n]);
            let mut pre = [0.0f32; MAX_STREAMS];
            for j in 0..n {
                pre[j] = sigmoid(m[j] * self.scale[0] + self.base[j]) + self.spec.eps;
            }
            collapse(x, &pre[..n], col);
        });
    }
}

/// Most streams (the released models use 4).
pub const MAX_STREAMS: usize = 64;
const MAX_MIX: usize = (2 + MAX_STREAMS) * MAX_STREAMS;

/// Divides each column of the `[N, N]` matrix by its sum plus `eps`.
fn normalize_columns(comb: &mut [f32], n: usize, eps: f32) {
    for k in 0..n {
        let s: f32 = (0..n).map(|j| comb[j * n + k]).sum();
        for j in 0..n {
            comb[j * n + k] /= s + eps;
        }
    }
}

/// `col = Σ_j pre_j · x_j` over the streams of one token.
fn collapse(x: &[f32], pre: &[f32], col: &mut [f32]) {
    let d = col.len();
    for (i, c) in col.iter_mut().enumerate() {
        *c = pre.iter().enumerate().map(|(j, &p)| p * x[j * d + i]).sum();
    }
}
