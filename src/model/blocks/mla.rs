//! Multi-head latent attention (DeepSeek-V2/V3): keys and values are
//! compressed into one latent of R values per token plus a shared rotated
//! key of Dr values, and the cache holds only that. The up-projections are
//! absorbed into the queries and the output, so attention runs in latent
//! space as one "kv head" of width R + Dr shared by all H heads.
//!
//! ```text
//! q = Wq·x, or Wq_b · norm(Wq_a·x)                      [T, H·(Dn + Dr)]
//! kv = Wkv_a·x = [latent, k_pe]                          [T, R + Dr]
//! latent = norm(latent); k_pe, q_pe = rope(k_pe), rope(q_pe)
//! q_abs[t, h] = [W_UK_hᵀ · q_nope[t, h], q_pe[t, h]]     [T, H·(R + Dr)]   (absorb)
//! o_lat = attend(q_abs, cache + kv)                      [T, H·R]          (per sequence)
//! att[t, h] = W_UV_h · o_lat[t, h]                       [T, H·Dv]         (expand)
//! ```

use super::Inputs;
use super::norm::rmsnorm_rows_inplace;
use super::rope::Rope;
use crate::canonical::config::{MlaSpec, ModelConfig};
use crate::kernels::heads::{HeadScratch, per_head_matmul};
use crate::kernels::{Matrix, matmul, matmul_many};

/// The query path of one MLA layer.
#[derive(Clone, Copy)]
pub enum MlaQ<'a> {
    /// [H·Dh, D]
    Direct(Matrix<'a>),
    /// `q_a` [Rq, D], its `[Rq]` RMSNorm, `q_b` [H·Dh, Rq].
    LowRank(Matrix<'a>, &'a [f32], Matrix<'a>),
}

/// One MLA layer's weights and shape.
pub struct Mla<'a> {
    /// The query projection(s).
    pub q: MlaQ<'a>,
    /// [R + Dr, D] latent and shared rotated key.
    pub wkv_a: Matrix<'a>,
    /// `[R]` RMSNorm of the latent.
    pub kv_a_norm: &'a [f32],
    /// [H·R, Dn] per-head key up-projections, transposed.
    pub wk_b: Matrix<'a>,
    /// [H·Dv, R] per-head value up-projections.
    pub wv_b: Matrix<'a>,
    /// The latent's widths.
    pub spec: MlaSpec,
    /// H: query heads.
    pub h: usize,
    /// Dh = Dn + Dr: a query head's width.
    pub dh: usize,
    /// The rotary embedding (`None`: positions are not encoded, as in
    /// Kimi-Linear, and the "rotated" parts stay as projected).
    pub rope: Option<&'a Rope>,
}

/// Buffers of multi-head latent attention for up to C tokens.
#[derive(Default)]
pub struct MlaScratch {
    /// [C, Rq] query latent (with `q_lora_rank`).
    pub q_lat: Vec<f32>,
    /// [C, H·(R + Dr)] absorbed queries: `W_UKᵀ · q_nope` then the rotated `q_pe`.
    pub q_abs: Vec<f32>,
    /// [C, H·R] attention output in latent space.
    pub o_lat: Vec<f32>,
    /// The per-head products' gather buffers.
    pub heads: HeadScratch,
}

impl MlaScratch {
    /// Buffers for chunks of up to `chunk` tokens (empty for a GQA model);
    /// `quantize`: the model has block-quantised weights.
    pub fn new(c: &ModelConfig, chunk: usize, quantize: bool) -> MlaScratch {
        let Some(m) = c.mla() else { return MlaScratch::default() };
        let (h, r) = (c.num_heads, m.kv_lora_rank);
        MlaScratch {
            q_lat: vec![0.0; chunk * m.q_lora_rank.unwrap_or(0)],
            q_abs: vec![0.0; chunk * h * (r + m.qk_rope_dim)],
            o_lat: vec![0.0; chunk * h * r],
            heads: HeadScratch::new(quantize, h, chunk, m.qk_nope_dim.max(r), r.max(m.v_head_dim)),
        }
    }
}

impl Mla<'_> {
    /// The queries of the T rows of `x` ([T, D]) into `q` [T, H·Dh], and the
    /// normed latent plus the rotated shared key into `kv` [T, R + Dr]; RoPE
    /// (angles `cos`, `sin`: [T, R/2]) on each head's last Dr query values
    /// and on the shared key.
    #[allow(clippy::too_many_arguments)]
    pub fn project(
        &self,
        x: &[f32],
        inputs: &mut Inputs,
        cos: &[f32],
        sin: &[f32],
        q: &mut [f32],
        kv: &mut [f32],
        s: &mut MlaScratch,
    ) {
        let m = &self.spec;
        let (d, qd, dh) = (self.wkv_a.cols, self.h * self.dh, self.dh);
        let n = x.len() / d;
        let half = cos.len() / n.max(1);
        let kw = m.kv_lora_rank + m.qk_rope_dim;
        let inp = inputs.prepare(x, d); // shared by q (or q_a) and kv_a
        match self.q {
            MlaQ::Direct(wq) => matmul_many(&mut [(wq, &mut *q), (self.wkv_a, &mut *kv)], &inp), // [T, H·Dh], [T, R + Dr]
            MlaQ::LowRank(wa, norm_w, wb) => {
                let rq = m.q_lora_rank.expect("low-rank query");
                let lat = &mut s.q_lat[..n * rq];
                matmul_many(&mut [(wa, &mut *lat), (self.wkv_a, &mut *kv)], &inp); // [T, Rq], [T, R + Dr]
                rmsnorm_rows_inplace(lat, norm_w, m.latent_eps);
                matmul(&wb, &inputs.prepare(lat, rq), q); // [T, H·Dh]
            }
        }
        for t in 0..n {
            let row = &mut kv[t * kw..(t + 1) * kw];
            rmsnorm_rows_inplace(&mut row[..m.kv_lora_rank], self.kv_a_norm, m.latent_eps); // the latent, [R]
            let Some(rope) = self.rope else { continue };
            let (cs, sn) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            rope.rotate(&mut row[m.kv_lora_rank..], cs, sn); // k_pe, [Dr]
            for head in q[t * qd..(t + 1) * qd].chunks_exact_mut(dh) {
                rope.rotate(&mut head[m.qk_nope_dim..], cs, sn); // q_pe, [Dr]
            }
        }
    }

    /// Absorbed queries of the T rows of `q` ([T, H·Dh]) into `s.q_abs`:
    /// `q_abs[t, h] = [W_UK_hᵀ · q_nope[t, h], q_pe[t, h]]`, [T, H·(R + Dr)].
    pub fn absorb(&self, q: &[f32], s: &mut MlaScratch) {
        let (h, dh, r, dr) = (self.h, self.dh, self.spec.kv_lora_rank, self.spec.qk_rope_dim);
        let n = q.len() / (h * dh);
        per_head_matmul(&self.wk_b, h, q, dh, &mut s.q_abs, r + dr, &mut s.heads);
        for (qa, qh) in s.q_abs[..n * h * (r + dr)].chunks_exact_mut(r + dr).zip(q.chunks_exact(dh)) {
            qa[r..].copy_from_slice(&qh[self.spec.qk_nope_dim..]);
        }
    }

    /// The heads' outputs from latent space, for the first `n` rows of
    /// `s.o_lat`: `att[t, h] = W_UV_h · o_lat[t, h]`, [T, H·Dv].
    pub fn expand(&self, n: usize, s: &mut MlaScratch, att: &mut [f32]) {
        let (h, r) = (self.h, self.spec.kv_lora_rank);
        per_head_matmul(&self.wv_b, h, &s.o_lat[..n * h * r], r, att, self.spec.v_head_dim, &mut s.heads);
    }
}
