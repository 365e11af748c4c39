//! MiniMax Sparse Attention (MiniMax-M3): grouped-query attention whose
//! queries read only the blocks of keys a small index branch picks. Its
//! tensor references, its scratch, the selection and the attention over the
//! selected blocks. The index keys are kept per sequence in
//! [`IndexKeys`](super::indexer::IndexKeys), the DSA indexer's state, beside
//! the layer's KV cache.
//!
//! Letters: T tokens of the chunk, D hidden, Hi index heads of width Di,
//! B keys per block, K blocks kept (`top_blocks`), L local blocks, p a
//! query's position, NB = ⌊p / B⌋ + 1 the blocks it sees.
//!
//! ```text
//! k       = rope(rmsnorm(Wk · x))                       [T, Di]     appended to the index keys
//! q_i     = rope(rmsnorm(Wq · x)_i)                     [T, Hi·Di]  each head normed apart
//! s_i[b]  = max_{j in block b, j ≤ p} q_i · k_j         [NB]        per index head
//! sel_i   = blocks ⌊p/B⌋ − L + 1 ..= ⌊p/B⌋,             [K]         ascending
//!           then the best others (ties: the earlier block)
//! o_h     = attend(q_h, keys and values of sel_i)       query heads h of index head i
//! ```
//!
//! While a query sees no more than K blocks it keeps all of them, and the
//! layer is plain causal attention (one call over the cache for those rows).
//! The selected rows of a query's kv heads are gathered into a buffer of their
//! own, block after block, and attended as a cache of that many positions
//! with the query at the last: the blocks are in order and the last one is the
//! query's own, cut at its position.

use rayon::prelude::*;

use super::Inputs;
use super::attention::{Heads, KvView, attend};
use super::indexer::top_k;
use super::norm::rmsnorm_rows_inplace;
use super::rope::Rope;
use crate::canonical::config::{BlockIndexSpec, ModelConfig};
use crate::canonical::tensors::LayerTensor;
use crate::error::Result;
use crate::kernels::{KV_QUERIES, Matrix, matmul_many};
use crate::model::weights::TensorRef;

/// One block indexer's tensors.
#[derive(Clone, Copy, Debug)]
pub struct BlockIndexRefs {
    /// [Hi·Di, D] index queries.
    pub wq: TensorRef,
    /// [Di, D] the index key.
    pub wk: TensorRef,
    /// `[Di]` RMSNorm scale of each index query head.
    pub q_norm: TensorRef,
    /// `[Di]` RMSNorm scale of the index key.
    pub k_norm: TensorRef,
}

impl BlockIndexRefs {
    /// The references of one layer's block indexer, `t` finding each tensor in the file.
    pub fn load(t: impl Fn(LayerTensor) -> Result<TensorRef>) -> Result<BlockIndexRefs> {
        use LayerTensor as L;
        Ok(BlockIndexRefs { wq: t(L::IdxWq)?, wk: t(L::IdxWk)?, q_norm: t(L::IdxQNorm)?, k_norm: t(L::IdxKNorm)? })
    }
}

/// One block indexer's weights as views.
pub struct BlockIndexer<'a> {
    /// [Hi·Di, D]
    pub wq: Matrix<'a>,
    /// [Di, D]
    pub wk: Matrix<'a>,
    /// `[Di]`
    pub q_norm: &'a [f32],
    /// `[Di]`
    pub k_norm: &'a [f32],
    /// The norms' epsilon.
    pub eps: f32,
    /// The model's rotary embedding (its first R values rotate).
    pub rope: &'a Rope,
    /// Its shape.
    pub spec: BlockIndexSpec,
}

/// The block indexer's buffers for chunks of up to C tokens (empty without one).
#[derive(Default)]
pub struct BlockIndexScratch {
    /// [C, Hi·Di] index queries.
    q: Vec<f32>,
    /// [C, Di] index keys of this chunk.
    k: Vec<f32>,
    /// [NB, Hi] one query's block scores, block by block.
    scores: Vec<f32>,
    /// `[NB]` one index head's block scores.
    col: Vec<f32>,
    /// `[NB]` block numbers, partly ordered by score.
    order: Vec<u32>,
    /// [Hi, K] each index head's selected blocks, ascending.
    sel: Vec<u32>,
    /// [Hi, Gkv·K·B·Dh] the selected keys of each index head's kv heads, as
    /// cache bytes (f32 words, the widest cache element).
    keys: Vec<f32>,
    /// [Hi, Gkv·K·B·Dh] their values.
    values: Vec<f32>,
    /// [H·Dh] one token's attention results in kv-head order.
    order_out: Vec<f32>,
}

impl BlockIndexScratch {
    /// Buffers for `c`'s block indexer and chunks of up to `chunk` tokens.
    pub fn new(c: &ModelConfig, chunk: usize) -> BlockIndexScratch {
        let Some(b) = c.attention.block_index else { return BlockIndexScratch::default() };
        let nb = c.max_seq_len.div_ceil(b.block) + 1;
        let kv_per_index = (c.num_kv_heads / b.heads).max(1);
        let gathered = b.heads * kv_per_index * b.top_blocks * b.block * c.head_dim;
        BlockIndexScratch {
            q: vec![0.0; chunk * b.heads * b.head_dim],
            k: vec![0.0; chunk * b.head_dim],
            scores: vec![0.0; nb * b.heads],
            col: vec![0.0; nb],
            order: vec![0; nb],
            sel: vec![0; b.heads * b.top_blocks],
            keys: vec![0.0; gathered],
            values: vec![0.0; gathered],
            order_out: vec![0.0; c.num_heads * c.head_dim],
        }
    }

    /// The index keys of rows `r0..r1`, `[r1 − r0, Di]`.
    pub fn keys(&self, r0: usize, r1: usize, di: usize) -> &[f32] {
        &self.k[r0 * di..r1 * di]
    }
}

impl<'a> BlockIndexer<'a> {
    /// The views of `refs`: `mat` gives a matrix, `vec` an f32 vector.
    pub fn new(
        refs: &BlockIndexRefs,
        spec: BlockIndexSpec,
        eps: f32,
        rope: &'a Rope,
        mat: impl Fn(TensorRef) -> Matrix<'a>,
        vec: impl Fn(TensorRef) -> &'a [f32],
    ) -> BlockIndexer<'a> {
        BlockIndexer {
            wq: mat(refs.wq),
            wk: mat(refs.wk),
            q_norm: vec(refs.q_norm),
            k_norm: vec(refs.k_norm),
            eps,
            rope,
            spec,
        }
    }

    /// The index keys (`[T, Di]`) of the T rows of `x` ([T, D]) into the
    /// scratch and, when `queries`, the index queries (`[T, Hi·Di]`) too.
    /// Angles `cos`, `sin`: [T, R/2].
    pub fn project(
        &self,
        x: &[f32],
        queries: bool,
        inputs: &mut Inputs,
        cos: &[f32],
        sin: &[f32],
        s: &mut BlockIndexScratch,
    ) {
        let BlockIndexSpec { heads: hi, head_dim: di, .. } = self.spec;
        let d = self.wk.cols;
        let n = x.len() / d;
        let half = cos.len() / n.max(1);
        let (q, k) = (&mut s.q[..if queries { n * hi * di } else { 0 }], &mut s.k[..n * di]);
        let inp = inputs.prepare(x, d);
        if queries {
            matmul_many(&mut [(self.wk, &mut *k), (self.wq, &mut *q)], &inp); // [T, Di], [T, Hi·Di]
            rmsnorm_rows_inplace(q, self.q_norm, self.eps); // each head apart
        } else {
            matmul_many(&mut [(self.wk, &mut *k)], &inp); // [T, Di]
        }
        rmsnorm_rows_inplace(k, self.k_norm, self.eps);
        for t in 0..n {
            let (cs, sn) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            self.rope.rotate(&mut k[t * di..(t + 1) * di], cs, sn);
            if queries {
                for head in q[t * hi * di..(t + 1) * hi * di].chunks_exact_mut(di) {
                    self.rope.rotate(head, cs, sn);
                }
            }
        }
    }

    /// Row `t`'s selection, for its query at position `p` that sees more
    /// than K blocks of the index keys `keys`: K blocks per index head, into
    /// the scratch.
    pub fn select(&self, t: usize, p: usize, keys: KvView, s: &mut BlockIndexScratch) {
        let BlockIndexSpec { heads: hi, head_dim: di, block, top_blocks: k, local_blocks, .. } = self.spec;
        let nb = p / block + 1;
        debug_assert!(nb > k);
        let q = &s.q[t * hi * di..(t + 1) * hi * di];
        block_scores(q, di, keys, p, block, &mut s.scores[..nb * hi]);
        for i in 0..hi {
            let col = &mut s.col[..nb];
            for (b, c) in col.iter_mut().enumerate() {
                *c = s.scores[b * hi + i];
            }
            // The query's own block and the ones just before it win.
            for c in &mut col[nb - local_blocks..] {
                *c = f32::INFINITY;
            }
            top_k(col, &mut s.order[..nb], &mut s.sel[i * k..(i + 1) * k]);
        }
    }

    /// The attention of row `t`'s query `q` ([H·Dh]) at position `p` over
    /// the blocks [`BlockIndexer::select`] chose, from the layer's cache
    /// `kv` (every position up to `p` stored), into `out` ([H·Dh]).
    pub fn attend_selected(
        &self,
        q: &[f32],
        p: usize,
        kv: KvView,
        heads: Heads,
        s: &mut BlockIndexScratch,
        out: &mut [f32],
    ) {
        let BlockIndexSpec { heads: hi, block, top_blocks: k, .. } = self.spec;
        let (h, hkv, dk, dv) = (heads.h, heads.hkv, heads.dk, heads.dv);
        let (gq, gkv) = (h / hi, (hkv / hi).max(1)); // query and kv heads per index head
        let es = kv.dtype.row_bytes(1).expect("an element type");
        let room = s.keys.len() / hi;
        let scale = heads.temperature.map_or(heads.scale, |t| heads.scale * t.at(p));
        let sel = &s.sel;
        let (keys, values, order) = (&mut s.keys, &mut s.values, &mut s.order_out[..h * dv]);
        let (kb, vb): (&mut [u8], &mut [u8]) = (bytemuck::cast_slice_mut(keys), bytemuck::cast_slice_mut(values));
        kb.par_chunks_mut(room * 4)
            .zip(vb.par_chunks_mut(room * 4))
            .zip(out.par_chunks_mut(gq * dv).zip(order.par_chunks_mut(gq * dv)))
            .enumerate()
            .for_each(|(i, ((gk, gv), (o, scratch)))| {
                // This index head's kv heads: one shared by several index heads, or several of its own.
                let g0 = if hi >= hkv { i / (hi / hkv) } else { i * gkv };
                let blocks = &sel[i * k..(i + 1) * k];
                let n: usize = blocks.iter().map(|&b| ((b as usize + 1) * block).min(p + 1) - b as usize * block).sum();
                let parts = [(&mut *gk, kv.k, kv.k_row, kv.k_head, dk), (&mut *gv, kv.v, kv.v_row, kv.v_head, dv)];
                for (buf, src, row, head, width) in parts {
                    let mut at = 0;
                    for c in 0..gkv {
                        for &b in blocks {
                            let (j0, j1) = (b as usize * block, ((b as usize + 1) * block).min(p + 1));
                            // Head-major rows: one block of one head is contiguous.
                            let from = ((j0 - kv.base) * row + (g0 + c) * head) * es;
                            let len = (j1 - j0) * width * es;
                            debug_assert_eq!(row, width, "head-major rows");
                            buf[at..at + len].copy_from_slice(&src[from..from + len]);
                            at += len;
                        }
                    }
                }
                let view = KvView {
                    dtype: kv.dtype,
                    k: &gk[..gkv * n * dk * es],
                    v: &gv[..gkv * n * dv * es],
                    k_row: dk,
                    v_row: dv,
                    k_head: n * dk,
                    v_head: n * dv,
                    base: 0,
                };
                let hd = Heads {
                    h: gq,
                    hkv: gkv,
                    window: None,
                    scale,
                    sinks: heads.sinks.map(|x| &x[i * gq..(i + 1) * gq]),
                    temperature: None,
                    ..heads
                };
                attend(&q[i * gq * dk..(i + 1) * gq * dk], view, n - 1, hd, scratch, o);
            });
    }
}

/// Keys scored per step: the attention kernels' block.
const KEY_BLOCK: usize = 64;

/// `out[b, i] = max_{j in block b, j ≤ p} q_i · k_j` for the blocks of the
/// keys `0..=p` (`out` is [NB, Hi]; `q` is [Hi, Di]). Runs of blocks go to
/// tasks side by side; a maximum does not depend on the split, so neither
/// does a score.
fn block_scores(q: &[f32], di: usize, keys: KvView, p: usize, block: usize, out: &mut [f32]) {
    let kk = crate::kernels::kv_fns(keys.dtype).expect("the index keys are f32 or f16");
    let es = keys.dtype.row_bytes(1).expect("an element type");
    let hi = q.len() / di;
    let per_task = (4 * KEY_BLOCK).div_ceil(block);
    out.par_chunks_mut(per_task * hi).enumerate().for_each(|(c, o)| {
        o.fill(f32::NEG_INFINITY);
        let b0 = c * per_task;
        let (j0, j1) = (b0 * block, ((b0 + o.len() / hi) * block).min(p + 1));
        let mut dots = [[0f32; KEY_BLOCK]; KV_QUERIES];
        for jc in (j0..j1).step_by(KEY_BLOCK) {
            let cnt = KEY_BLOCK.min(j1 - jc);
            let at = (jc - keys.base) * keys.k_row * es;
            for h0 in (0..hi).step_by(KV_QUERIES) {
                let nh = KV_QUERIES.min(hi - h0);
                let qs: [&[f32]; KV_QUERIES] = std::array::from_fn(|i| &q[(h0 + i.min(nh - 1)) * di..][..di]);
                (kk.dots)(&keys.k[at..], keys.k_row, cnt, &qs[..nh], dots.as_flattened_mut(), KEY_BLOCK);
                for (i, row) in dots[..nh].iter().enumerate() {
                    for (j, &v) in row[..cnt].iter().enumerate() {
                        let slot = &mut o[((jc + j) / block - b0) * hi + h0 + i];
                        *slot = slot.max(v);
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::blocks::kv_cache::KvCache;
    use crate::model::blocks::test_values;
    use crate::quant::DType;

    fn indexer(spec: BlockIndexSpec, rope: &Rope) -> BlockIndexer<'_> {
        let none = Matrix { dtype: DType::F32, rows: 0, cols: 0, bytes: &[] };
        BlockIndexer { wq: none, wk: none, q_norm: &[], k_norm: &[], eps: 1e-6, rope, spec }
    }

    fn rope() -> Rope {
        Rope::new(&crate::canonical::config::RopeSpec { rotary_dim: 4, ..ModelConfig::default().rope })
    }

    /// With every block selected, the gathered attention gives the bits of
    /// attention over the whole cache, for one, several or all kv heads per
    /// index head, with sinks, f32 and f16 caches.
    #[test]
    fn selecting_every_block_gives_the_bits_of_dense_attention() {
        let mut r = test_values(5);
        let (dh, block) = (8, 5);
        let sinks: Vec<f32> = (0..6).map(|_| r()).collect();
        for (h, hkv, hi) in [(4, 2, 4), (4, 2, 2), (4, 2, 1), (6, 3, 3)] {
            for dtype in [DType::F32, DType::F16] {
                for p in [0, 7, 22] {
                    let n = p + 1;
                    let nb = p / block + 1;
                    let spec = BlockIndexSpec { heads: hi, head_dim: dh, block, top_blocks: nb, local_blocks: 1 };
                    let rope = rope();
                    let ix = indexer(spec, &rope);
                    let mut cache = KvCache::new(dtype, n + 4, hkv, hkv * dh, hkv * dh, None);
                    let k: Vec<f32> = (0..n * hkv * dh).map(|_| r()).collect();
                    let v: Vec<f32> = (0..n * hkv * dh).map(|_| r()).collect();
                    cache.store(0, &k, &v);
                    let q: Vec<f32> = (0..h * dh).map(|_| r()).collect();
                    let heads = Heads {
                        h,
                        hkv,
                        dk: dh,
                        dv: dh,
                        window: None,
                        scale: 0.4,
                        sinks: Some(&sinks[..h]),
                        temperature: None,
                    };
                    let mut want = vec![0.0; h * dh];
                    attend(&q, cache.view(n), p, heads, &mut vec![0.0; h * dh], &mut want);
                    let room = hi * (hkv / hi).max(1) * nb * block * dh;
                    let mut s = BlockIndexScratch {
                        sel: (0..hi).flat_map(|_| 0..nb as u32).collect(),
                        keys: vec![0.0; room],
                        values: vec![0.0; room],
                        order_out: vec![0.0; h * dh],
                        ..Default::default()
                    };
                    let mut got = vec![0.0; h * dh];
                    ix.attend_selected(&q, p, cache.view(n), heads, &mut s, &mut got);
                    assert_eq!(got, want, "{dtype} heads {h}/{hkv}, {hi} index heads, p {p}");
                }
            }
        }
    }

    /// Each index head keeps the query's own block and the ones just before
    /// it, then its best other blocks by the maximum of its dot products, in
    /// ascending order.
    #[test]
    fn the_selection_keeps_the_local_blocks_and_the_best_others() {
        let mut r = test_values(9);
        let (hi, di, block, k, local, p) = (3, 6, 3, 5, 2, 40);
        let nb = p / block + 1;
        let spec = BlockIndexSpec { heads: hi, head_dim: di, block, top_blocks: k, local_blocks: local };
        let rope = rope();
        let ix = indexer(spec, &rope);
        let keys: Vec<f32> = (0..(p + 1) * di).map(|_| r()).collect();
        let mut cache = KvCache::new(DType::F32, p + 1, 1, di, 0, None);
        cache.store(0, &keys, &[]);
        let mut s = BlockIndexScratch {
            q: (0..hi * di).map(|_| r()).collect(),
            scores: vec![0.0; nb * hi],
            col: vec![0.0; nb],
            order: vec![0; nb],
            sel: vec![0; hi * k],
            ..Default::default()
        };
        ix.select(0, p, cache.view(p + 1), &mut s);
        for i in 0..hi {
            let score = |b: usize| {
                (b * block..((b + 1) * block).min(p + 1))
                    .map(|j| (0..di).map(|x| (s.q[i * di + x] * keys[j * di + x]) as f64).sum::<f64>())
                    .fold(f64::NEG_INFINITY, f64::max)
            };
            let mut others: Vec<usize> = (0..nb - local).collect();
            others.sort_by(|a, b| score(*b).total_cmp(&score(*a)));
            let mut want: Vec<u32> = others[..k - local].iter().map(|&b| b as u32).collect();
            want.extend((nb - local..nb).map(|b| b as u32));
            want.sort_unstable();
            assert_eq!(&s.sel[i * k..(i + 1) * k], &want[..], "index head {i}");
        }
    }

    /// The block scores are the maxima of the plain dot products over each
    /// block's keys up to the query, whatever the block width.
    #[test]
    fn block_scores_are_maxima_of_the_dots() {
        let mut r = test_values(7);
        let (hi, di, n) = (3, 9, 300);
        let keys: Vec<f32> = (0..n * di).map(|_| r()).collect();
        let q: Vec<f32> = (0..hi * di).map(|_| r()).collect();
        let mut cache = KvCache::new(DType::F32, n, 1, di, 0, None);
        cache.store(0, &keys, &[]);
        for (block, p) in [(4, 37), (7, 299), (64, 130), (100, 250)] {
            let nb = p / block + 1;
            let mut got = vec![0.0; nb * hi];
            block_scores(&q, di, cache.view(p + 1), p, block, &mut got);
            for b in 0..nb {
                for i in 0..hi {
                    let want = (b * block..((b + 1) * block).min(p + 1))
                        .map(|j| (0..di).map(|x| (q[i * di + x] * keys[j * di + x]) as f64).sum::<f64>())
                        .fold(f64::NEG_INFINITY, f64::max);
                    assert!((got[b * hi + i] as f64 - want).abs() < 1e-5, "block {b} head {i}");
                }
            }
        }
    }
}
