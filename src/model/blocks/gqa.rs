//! Grouped-query attention's projections: H query heads share Hkv key/value
//! heads (H = Hkv is multi-head attention). The attention itself, over each
//! sequence's cache, is [`attend`](super::attention::attend).
//!
//! ```text
//! q, k, v = Wq·x + bq, Wk·x + bk, Wv·x + bv    [T, H·Dh], [T, Hkv·Dh] ×2 (biases if any)
//!                                               (v = k when the layer has no value projection)
//! gate = Wg·x                                   [T, H·Dh] (if the layer gates its output)
//! q, k = norm(q), norm(k)                       per head or over the whole row (if any)
//! v = v / rms(v)                                per head, without weight (if the model norms values)
//! q, k, v = clip(q), clip(k), clip(v)           (if the model clips)
//! q, k = rope(q), rope(k)                       every head
//! ```

use super::Inputs;
use super::ffn::add_bias;
use super::norm::{rms_rows_unweighted_inplace, rmsnorm_rows_inplace};
use super::rope::Rope;
use crate::kernels::{Matrix, matmul_many};

/// One layer's GQA projections and the rules applied to their outputs.
pub struct Gqa<'a> {
    /// [H·Dh, D]
    pub wq: Matrix<'a>,
    /// [Hkv·Dh, D]
    pub wk: Matrix<'a>,
    /// [Hkv·Dh, D]; `None` when the values are the key projection.
    pub wv: Option<Matrix<'a>>,
    /// [H·Dh, D] the output gate, if the model has one.
    pub wg: Option<Matrix<'a>>,
    /// `[H·Dh]` its bias.
    pub bg: Option<&'a [f32]>,
    /// `[H·Dh]`, `[Hkv·Dh]`, `[Hkv·Dh]` q, k and v biases.
    pub bias: Option<[&'a [f32]; 3]>,
    /// RMSNorm weights of q and k: `[Dh]` each per head, or whole rows.
    pub qk_norm: Option<[&'a [f32]; 2]>,
    /// The norms' epsilon.
    pub eps: f32,
    /// Clamp of q, k and v to `[-clip, clip]`.
    pub clip: Option<f32>,
    /// RMS-norm each value head without a weight.
    pub v_norm: bool,
    /// Dh: width of a head.
    pub dh: usize,
    /// The rotary embedding.
    pub rope: &'a Rope,
    /// Queries and keys rotate (false: attention without positions).
    pub rotate: bool,
}

impl Gqa<'_> {
    /// q, k, v of the T rows of `x` ([T, D]), with the RoPE angles of their
    /// positions (`cos`, `sin`: [T, R/2]), and the output gate's
    /// pre-activations into `gate` ([T, H·Dh]) when the layer has one.
    #[allow(clippy::too_many_arguments)]
    pub fn project(
        &self,
        x: &[f32],
        inputs: &mut Inputs,
        cos: &[f32],
        sin: &[f32],
        q: &mut [f32],
        k: &mut [f32],
        v: &mut [f32],
        gate: &mut [f32],
    ) {
        let (d, qd, kvd, dh) = (self.wq.cols, self.wq.rows, self.wk.rows, self.dh);
        let n = x.len() / d;
        let half = cos.len() / n.max(1);
        let inp = inputs.prepare(x, d); // quantised once for q, k, v and the gate
        match (self.wv, self.wg) {
            // [T, H·Dh], [T, Hkv·Dh] ×2, [T, H·Dh]
            (Some(wv), Some(wg)) => {
                matmul_many(&mut [(self.wq, &mut *q), (self.wk, &mut *k), (wv, &mut *v), (wg, gate)], &inp)
            }
            (Some(wv), None) => matmul_many(&mut [(self.wq, &mut *q), (self.wk, &mut *k), (wv, &mut *v)], &inp),
            (None, Some(wg)) => matmul_many(&mut [(self.wq, &mut *q), (self.wk, &mut *k), (wg, gate)], &inp),
            (None, None) => matmul_many(&mut [(self.wq, &mut *q), (self.wk, &mut *k)], &inp),
        }
        if let Some([bq, bk, bv]) = self.bias {
            add_bias(q, bq);
            add_bias(k, bk);
            add_bias(v, bv);
        }
        if self.wv.is_none() {
            v.copy_from_slice(k); // the values are the keys as projected, before their norm and RoPE
        }
        if self.v_norm {
            rms_rows_unweighted_inplace(v, dh, self.eps);
        }
        if let Some(bg) = self.bg {
            add_bias(gate, bg);
        }
        if let Some([wqn, wkn]) = self.qk_norm {
            // Per head: rows of Dh; full: rows of the whole projection.
            rmsnorm_rows_inplace(q, wqn, self.eps);
            rmsnorm_rows_inplace(k, wkn, self.eps);
        }
        if let Some(clip) = self.clip {
            for a in q.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
                *a = a.clamp(-clip, clip);
            }
        }
        for t in (0..n).filter(|_| self.rotate) {
            let (cs, sn) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            for head in
                q[t * qd..(t + 1) * qd].chunks_exact_mut(dh).chain(k[t * kvd..(t + 1) * kvd].chunks_exact_mut(dh))
            {
                self.rope.rotate(head, cs, sn);
            }
        }
    }
}
