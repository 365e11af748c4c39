//! The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2,
//! GLM-5): its tensor references, its per-sequence key cache, its scratch,
//! and the selection it makes for latent attention.
//!
//! Letters: T tokens of the chunk, D hidden, Rq the query latent, Hi index
//! heads of width Di, Dr the rotated part, K the keys kept (`top_k`), S the
//! keys a query sees (its position + 1).
//!
//! ```text
//! k       = rope(LayerNorm(Wk · x))                     [T, Di]   appended to the key cache
//! q       = rope(Wq · q_lat)                            [T, Hi·Di]
//! w       = Ww · x / √Hi                                [T, Hi]
//! s[j]    = Σ_h w_h · relu(q_h · k_j / √Di)             [S]       for each query, keys j ≤ its position
//! sel     = the K best j, ascending                     [K]       (ties: the earlier key)
//! o_lat   = attend(q_abs, latent rows sel)              [H·R]     only the selected rows are read
//! ```
//!
//! While a query sees no more than K keys it keeps all of them, and the
//! layer is plain latent attention: the indexer then only appends its keys.
//! A layer without an indexer of its own (GLM-5's IndexShare) attends to the
//! rows the layer before it selected, still in the workspace.

use rayon::prelude::*;

use super::Inputs;
use super::attention::{Heads, KvView, attend};
use super::kv_cache::KvCache;
use super::rope::{apply, apply_pairs};
use crate::canonical::config::{IndexerSpec, ModelConfig};
use crate::canonical::tensors::LayerTensor;
use crate::error::Result;
use crate::kernels::{KV_QUERIES, Matrix, matmul, matmul_many};
use crate::model::weights::TensorRef;
use crate::quant::DType;

/// Where a sparse layer's selection comes from.
#[derive(Clone, Copy, Debug)]
pub enum IndexRefs {
    /// Its own indexer.
    Own(IndexerRefs),
    /// The selection of the layer before it.
    Shared,
}

/// One indexer's tensors.
#[derive(Clone, Copy, Debug)]
pub struct IndexerRefs {
    /// [Hi·Di, Rq] index queries from the query latent.
    pub wq: TensorRef,
    /// [Di, D] the index key.
    pub wk: TensorRef,
    /// `[Di]` the key LayerNorm's scale.
    pub k_norm: TensorRef,
    /// `[Di]` its bias.
    pub k_bias: TensorRef,
    /// [Hi, D] the heads' weights (f32).
    pub weights: TensorRef,
}

impl IndexerRefs {
    /// The references of one layer's indexer, `t` finding each tensor in the file.
    pub fn load(t: impl Fn(LayerTensor) -> Result<TensorRef>) -> Result<IndexerRefs> {
        use LayerTensor as L;
        Ok(IndexerRefs {
            wq: t(L::IdxWq)?,
            wk: t(L::IdxWk)?,
            k_norm: t(L::IdxKNorm)?,
            k_bias: t(L::IdxKNormBias)?,
            weights: t(L::IdxWeights)?,
        })
    }
}

/// One indexer's weights as views.
pub struct Indexer<'a> {
    /// [Hi·Di, Rq]
    pub wq: Matrix<'a>,
    /// [Di, D]
    pub wk: Matrix<'a>,
    /// `[Di]`
    pub k_norm: &'a [f32],
    /// `[Di]`
    pub k_bias: &'a [f32],
    /// [Hi, D]
    pub weights: Matrix<'a>,
    /// Its shape.
    pub spec: IndexerSpec,
}

/// A sequence's index keys for one layer: one row of Di values per
/// position, of every position, in the KV cache's element type. Truncation
/// moves back with the sequence's position, as the latent cache's does:
/// rows past it are overwritten before any query reads them.
pub struct IndexKeys(KvCache);

impl IndexKeys {
    /// Room for `rows` positions of `width` values of `dtype` (f32 or f16).
    pub fn new(dtype: DType, rows: usize, width: usize) -> IndexKeys {
        IndexKeys(KvCache::new(dtype, rows, 1, width, 0, None))
    }

    /// Stores the keys (`[n, Di]`) of positions `pos0..pos0 + n`.
    pub fn store(&mut self, pos0: usize, k: &[f32]) {
        self.0.store(pos0, k, &[]);
    }

    /// The cache under the keys, for copying rows out and back in.
    pub fn cache(&mut self) -> &mut KvCache {
        &mut self.0
    }

    /// The cache under the keys, to read.
    pub fn rows(&self) -> &KvCache {
        &self.0
    }

    /// The keys of positions `0..len`.
    pub fn view(&self, len: usize) -> KvView<'_> {
        self.0.view(len)
    }
}

/// The indexer's buffers for chunks of up to C tokens (empty without an indexer).
#[derive(Default)]
pub struct IndexerScratch {
    /// [C, Hi·Di] index queries.
    q: Vec<f32>,
    /// [C, Di] index keys of this chunk.
    k: Vec<f32>,
    /// [C, Hi] head weights.
    w: Vec<f32>,
    /// `[S]` one query's scores.
    scores: Vec<f32>,
    /// `[S]` key positions, partly ordered by score.
    order: Vec<u32>,
    /// [C, K] each row's selected key positions, ascending (rows that see
    /// more than K keys; the others keep every key and are not written).
    sel: Vec<u32>,
    /// [K, R + Dr] the selected latent rows as cache bytes (f32 words, the
    /// widest cache element).
    gather: Vec<f32>,
    /// K.
    top_k: usize,
}

impl IndexerScratch {
    /// Buffers for `c`'s indexer and chunks of up to `chunk` tokens.
    pub fn new(c: &ModelConfig, chunk: usize) -> IndexerScratch {
        let Some((m, ix)) = c.mla().and_then(|m| m.indexer.map(|ix| (m, ix))) else {
            return IndexerScratch::default();
        };
        let s = c.max_seq_len;
        let k = ix.top_k.min(s);
        IndexerScratch {
            q: vec![0.0; chunk * ix.heads * ix.head_dim],
            k: vec![0.0; chunk * ix.head_dim],
            w: vec![0.0; chunk * ix.heads],
            scores: vec![0.0; s],
            order: vec![0; s],
            sel: vec![0; chunk * k],
            gather: vec![0.0; k * (m.kv_lora_rank + m.qk_rope_dim)],
            top_k: ix.top_k,
        }
    }

    /// The index keys of the first `n` rows, `[n, Di]`.
    pub fn keys(&self, n: usize, di: usize) -> &[f32] {
        &self.k[..n * di]
    }
}

/// [`super::norm::layernorm`] of one row, in place: statistics in f64,
/// then `(x − mean) / √(var + eps) · w + b`.
fn layernorm_inplace(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean) * (v as f64 - mean)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    for ((v, &g), &c) in x.iter_mut().zip(w).zip(b) {
        *v = ((*v as f64 - mean) * inv) as f32 * g + c;
    }
}

/// Rotates the first `cos.len() · 2` values of `x` in the indexer's layout.
fn rotate(interleaved: bool, x: &mut [f32], cos: &[f32], sin: &[f32]) {
    if interleaved { apply_pairs(x, cos, sin) } else { apply(x, cos, sin) }
}

impl<'a> Indexer<'a> {
    /// The views of `refs`: `mat` gives a matrix, `vec` an f32 vector.
    pub fn new(
        refs: &IndexerRefs,
        spec: IndexerSpec,
        mat: impl Fn(TensorRef) -> Matrix<'a>,
        vec: impl Fn(TensorRef) -> &'a [f32],
    ) -> Indexer<'a> {
        Indexer {
            wq: mat(refs.wq),
            wk: mat(refs.wk),
            k_norm: vec(refs.k_norm),
            k_bias: vec(refs.k_bias),
            weights: mat(refs.weights),
            spec,
        }
    }

    /// The index keys of the T rows of `x` ([T, D]) into the scratch
    /// (`[T, Di]`) and, when `queries`, the head weights (`[T, Hi]`) and the
    /// index queries from the normed query latent `q_lat` ([T, Rq]) too.
    /// Angles `cos`, `sin`: [T, Dr/2].
    #[allow(clippy::too_many_arguments)]
    pub fn project(
        &self,
        x: &[f32],
        q_lat: &[f32],
        queries: bool,
        inputs: &mut Inputs,
        cos: &[f32],
        sin: &[f32],
        s: &mut IndexerScratch,
    ) {
        let IndexerSpec { heads: hi, head_dim: di, rope_dim: dr, rope_interleaved: il, key_norm_eps, .. } = self.spec;
        let d = self.wk.cols;
        let n = x.len() / d;
        let half = dr / 2;
        let (k, w) = (&mut s.k[..n * di], &mut s.w[..n * hi]);
        let inp = inputs.prepare(x, d);
        if queries {
            matmul_many(&mut [(self.wk, &mut *k), (self.weights, &mut *w)], &inp); // [T, Di], [T, Hi]
        } else {
            matmul(&self.wk, &inp, k); // [T, Di]
        }
        for (t, row) in k.chunks_exact_mut(di).enumerate() {
            layernorm_inplace(row, self.k_norm, self.k_bias, key_norm_eps);
            rotate(il, row, &cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
        }
        if !queries {
            return;
        }
        let scale = 1.0 / (hi as f32).sqrt();
        w.iter_mut().for_each(|v| *v *= scale);
        let rq = self.wq.cols;
        let q = &mut s.q[..n * hi * di];
        matmul(&self.wq, &inputs.prepare(&q_lat[..n * rq], rq), q); // [T, Hi·Di]
        for (t, row) in q.chunks_exact_mut(hi * di).enumerate() {
            let (cs, sn) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            for head in row.chunks_exact_mut(di) {
                rotate(il, head, cs, sn);
            }
        }
    }

    /// Row `t`'s selection, for its query at position `p` over the keys of
    /// positions `0..=p` (more than K of them): into the scratch's row `t`.
    pub fn select(&self, t: usize, p: usize, keys: KvView, s: &mut IndexerScratch) {
        let (hi, di, k) = (self.spec.heads, self.spec.head_dim, self.spec.top_k);
        let n = p + 1;
        debug_assert!(n > k);
        let (q, w) = (&s.q[t * hi * di..(t + 1) * hi * di], &s.w[t * hi..(t + 1) * hi]);
        score(q, w, di, keys, &mut s.scores[..n]);
        top_k(&s.scores[..n], &mut s.order[..n], &mut s.sel[t * k..(t + 1) * k]);
    }
}

/// Keys scored per task.
const KEY_BLOCK: usize = 64;

/// `scores[j] = Σ_h w_h · relu(q_h · k_j / √Di)` for the keys `j < scores.len()`
/// of `keys` (one row of Di values each); `q` is `[Hi, Di]`, `w` `[Hi]`. Each
/// key's score adds the heads in order, whatever the split of keys between
/// threads; −0 is stored as +0, so equal scores compare equal.
pub fn score(q: &[f32], w: &[f32], di: usize, keys: KvView, scores: &mut [f32]) {
    let kk = crate::kernels::kv_fns(keys.dtype).expect("the index keys are f32 or f16");
    let es = keys.dtype.row_bytes(1).expect("an element type");
    let scale = 1.0 / (di as f32).sqrt();
    let hi = w.len();
    scores.par_chunks_mut(KEY_BLOCK).enumerate().for_each(|(b, out)| {
        let j0 = b * KEY_BLOCK;
        let mut dots = [[0f32; KEY_BLOCK]; KV_QUERIES];
        out.fill(0.0);
        for h0 in (0..hi).step_by(KV_QUERIES) {
            let nh = KV_QUERIES.min(hi - h0);
            let qs: [&[f32]; KV_QUERIES] = std::array::from_fn(|i| &q[(h0 + i.min(nh - 1)) * di..][..di]);
            let at = (j0 - keys.base) * keys.k_row * es;
            (kk.dots)(&keys.k[at..], keys.k_row, out.len(), &qs[..nh], dots.as_flattened_mut(), KEY_BLOCK);
            for (i, row) in dots[..nh].iter().enumerate() {
                let wh = w[h0 + i];
                for (o, &d) in out.iter_mut().zip(row) {
                    *o += wh * (d * scale).max(0.0);
                }
            }
        }
        out.iter_mut().for_each(|v| *v += 0.0);
    });
}

/// The `out.len()` best positions of `scores`, ascending: a partial
/// selection (O(S)), higher scores first and, among equal scores, the earlier
/// position (transformers' `topk` leaves the order of ties unspecified).
pub fn top_k(scores: &[f32], order: &mut [u32], out: &mut [u32]) {
    let k = out.len();
    for (j, o) in order.iter_mut().enumerate() {
        *o = j as u32;
    }
    let better = |a: &u32, b: &u32| scores[*b as usize].total_cmp(&scores[*a as usize]).then(a.cmp(b));
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, better);
    }
    out.copy_from_slice(&order[..k]);
    out.sort_unstable();
}

/// Latent attention of the queries `q` ([H·(R + Dr)]) of the token at
/// position `p` over the rows `sel` (ascending positions) of the latent
/// cache `latent`: the rows are gathered into `gather` and attended as a
/// cache of `sel.len()` positions, the token at the last (its attention
/// temperature, if any, applied for position `p`). Only the selected rows
/// are read; with every position selected, the bits of attention over the
/// whole cache.
#[allow(clippy::too_many_arguments)]
pub fn attend_selected(
    q: &[f32],
    p: usize,
    latent: KvView,
    sel: &[u32],
    heads: Heads,
    gather: &mut [f32],
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let es = latent.dtype.row_bytes(1).expect("an element type");
    let row = latent.k_row * es;
    let g: &mut [u8] = bytemuck::cast_slice_mut(gather);
    for (i, &j) in sel.iter().enumerate() {
        let at = (j as usize - latent.base) * row;
        g[i * row..(i + 1) * row].copy_from_slice(&latent.k[at..at + row]);
    }
    let n = sel.len();
    let rows = &g[..n * row];
    let view = KvView { k: rows, v: rows, base: 0, k_head: n * latent.k_row, v_head: n * latent.k_row, ..latent };
    // The temperature of position p, as the kernel would compute it there.
    let scale = heads.temperature.map_or(heads.scale, |t| heads.scale * t.at(p));
    attend(q, view, n - 1, Heads { window: None, scale, temperature: None, ..heads }, scratch, out);
}

/// Runs the sparse layer's attention for one sequence's `m` rows at
/// positions `pos0..`: rows that see no more than K keys attend to the whole
/// cache (one call, the dense path), the others to their selection.
#[allow(clippy::too_many_arguments)]
pub fn attend_rows(
    q_abs: &[f32],
    latent: KvView,
    pos0: usize,
    heads: Heads,
    s: &mut IndexerScratch,
    r0: usize,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let qw = heads.h * heads.dk;
    let ow = heads.h * heads.dv;
    let m = q_abs.len() / qw;
    let dense = m.min(s.top_k.saturating_sub(pos0));
    if dense > 0 {
        attend(&q_abs[..dense * qw], latent, pos0, heads, &mut scratch[..dense * ow], &mut out[..dense * ow]);
    }
    let k = s.top_k;
    for i in dense..m {
        let sel = &s.sel[(r0 + i) * k..(r0 + i + 1) * k];
        let (q, o) = (&q_abs[i * qw..(i + 1) * qw], &mut out[i * ow..(i + 1) * ow]);
        attend_selected(q, pos0 + i, latent, sel, heads, &mut s.gather, &mut scratch[..ow], o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::blocks::test_values;

    /// The selection path with every key selected gives the bits of the
    /// dense path (attention over the whole latent cache), in prefill and in
    /// decode, over several key blocks, for f32 and f16 caches.
    #[test]
    fn selecting_every_key_gives_the_bits_of_dense_attention() {
        let mut r = test_values(3);
        let (h, dk, dv) = (5, 13, 9);
        for dtype in [DType::F32, DType::F16] {
            for (pos0, t) in [(0, 7), (60, 9), (130, 1), (0, 150)] {
                let n = pos0 + t;
                let mut cache = KvCache::new(dtype, n + 3, 1, dk, 0, None);
                let rows: Vec<f32> = (0..n * dk).map(|_| r()).collect();
                cache.store(0, &rows, &[]);
                let q: Vec<f32> = (0..t * h * dk).map(|_| r()).collect();
                let heads = Heads { h, hkv: 1, dk, dv, window: None, scale: 0.3, sinks: None, temperature: None };
                let mut dense = vec![0.0; t * h * dv];
                attend(&q, cache.view(n), pos0, heads, &mut vec![0.0; t * h * dv], &mut dense);
                let mut gather = vec![0.0; n * dk];
                for i in 0..t {
                    let sel: Vec<u32> = (0..=(pos0 + i) as u32).collect();
                    let mut one = vec![0.0; h * dv];
                    let qi = &q[i * h * dk..(i + 1) * h * dk];
                    let p = pos0 + i;
                    attend_selected(qi, p, cache.view(n), &sel, heads, &mut gather, &mut vec![0.0; h * dv], &mut one);
                    assert_eq!(one, dense[i * h * dv..(i + 1) * h * dv], "{dtype} pos0 {pos0} row {i}");
                }
            }
        }
    }

    /// Attending to a selection equals attending to a cache that holds
    /// only those rows.
    #[test]
    fn a_selection_attends_to_its_rows_only() {
        let mut r = test_values(11);
        let (h, dk, dv, n) = (3, 6, 4, 90);
        let rows: Vec<f32> = (0..n * dk).map(|_| r()).collect();
        let mut cache = KvCache::new(DType::F32, n, 1, dk, 0, None);
        cache.store(0, &rows, &[]);
        let sel: Vec<u32> = vec![2, 17, 40, 63, 64, 89];
        let picked: Vec<f32> = sel.iter().flat_map(|&j| rows[j as usize * dk..][..dk].to_vec()).collect();
        let mut small = KvCache::new(DType::F32, sel.len(), 1, dk, 0, None);
        small.store(0, &picked, &[]);
        let q: Vec<f32> = (0..h * dk).map(|_| r()).collect();
        let heads = Heads { h, hkv: 1, dk, dv, window: None, scale: 0.5, sinks: None, temperature: None };
        let (mut want, mut got) = (vec![0.0; h * dv], vec![0.0; h * dv]);
        attend(&q, small.view(sel.len()), sel.len() - 1, heads, &mut vec![0.0; h * dv], &mut want);
        let (mut gather, mut scratch) = (vec![0.0; n * dk], vec![0.0; h * dv]);
        attend_selected(&q, 89, cache.view(n), &sel, heads, &mut gather, &mut scratch, &mut got);
        assert_eq!(got, want);
    }

    /// The scores are the rule written out, and the selection keeps the K
    /// best, the earlier position among equal scores, ascending.
    #[test]
    fn scores_and_top_k_follow_the_rule() {
        let mut r = test_values(5);
        let (hi, di, n) = (11, 7, 150);
        let keys: Vec<f32> = (0..n * di).map(|_| r()).collect();
        let q: Vec<f32> = (0..hi * di).map(|_| r()).collect();
        let w: Vec<f32> = (0..hi).map(|_| r()).collect();
        let mut cache = KvCache::new(DType::F32, n, 1, di, 0, None);
        cache.store(0, &keys, &[]);
        let mut got = vec![0.0; n];
        score(&q, &w, di, cache.view(n), &mut got);
        for j in 0..n {
            let want: f64 = (0..hi)
                .map(|h| {
                    let dot: f64 = (0..di).map(|x| (q[h * di + x] * keys[j * di + x]) as f64).sum();
                    w[h] as f64 * (dot / (di as f64).sqrt()).max(0.0)
                })
                .sum();
            assert!((got[j] as f64 - want).abs() < 1e-5, "key {j}: {} vs {want}", got[j]);
        }
        let scores = [0.5f32, 2.0, -0.0, 2.0, 0.0, 1.0, -3.0, 0.0];
        let mut order = vec![0; scores.len()];
        let mut out = vec![0; 5];
        top_k(&scores, &mut order, &mut out);
        // 2.0 (1, 3), 1.0 (5), 0.5 (0), then the first of the zeros (2: −0 equals +0 once scored).
        assert_eq!(out, [0, 1, 3, 4, 5], "+0 ranks above −0 here: raw scores keep the sign");
        let canon: Vec<f32> = scores.iter().map(|v| v + 0.0).collect();
        top_k(&canon, &mut order, &mut out);
        assert_eq!(out, [0, 1, 2, 3, 5]);
    }
}
