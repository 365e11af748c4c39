//! Causal attention over the KV cache: grouped-query attention, and the
//! absorbed form of multi-head latent attention, which is the same loop with
//! one shared "head" whose keys are the latent plus the rotated key and whose
//! values are the latent itself.
//!
//! Each query streams its head's keys and values once with an online
//! softmax (running max and sum, updated per block of keys), so no score
//! buffer beyond one block on the stack is needed. Queries that share a kv
//! head are taken up to eight at a time (the heads of one kv group at one
//! token, or consecutive tokens of one head), so every key and value row is
//! read once for all of them; the kernels give each query the same bits
//! however many share a call, and key blocks are aligned to absolute
//! positions, so a query's result does not depend on which others it ran
//! with: prefill and decode agree, whatever the thread count. A head's sink
//! logit, when the model has one, starts the running sum: it joins the
//! softmax's denominator and adds no value.

use rayon::prelude::*;

use crate::canonical::config::AttentionTemperature;
use crate::kernels::{KV_QUERIES, KvKernels};
use crate::math::expf_poly as exp;
use crate::quant::DType;

/// Head layout of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct Heads<'a> {
    /// H: query heads.
    pub h: usize,
    /// Hkv: key/value heads.
    pub hkv: usize,
    /// Dk: query/key width of a head.
    pub dk: usize,
    /// Dv: value width of a head.
    pub dv: usize,
    /// Sliding window: a query at position p sees keys p-w+1..=p.
    pub window: Option<usize>,
    /// Score scale (1/√Dk unless the model says otherwise).
    pub scale: f32,
    /// `[H]` sink logits.
    pub sinks: Option<&'a [f32]>,
    /// A factor on each query's scale that grows with its position.
    pub temperature: Option<AttentionTemperature>,
}

/// One layer's cached keys and values as raw bytes of `dtype` (f32 or f16):
/// kv head g's keys of position j start at `j · k_row + g · k_head` values
/// in `k`, its values at `j · v_row + g · v_head` in `v`. For MLA `v` is the
/// key buffer itself: the values are the first Dv of each key row.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    /// Element type (f32 or f16).
    pub dtype: DType,
    /// Keys (after norm and RoPE).
    pub k: &'a [u8],
    /// Values.
    pub v: &'a [u8],
    /// Values from one position's keys to the next's, in `k`.
    pub k_row: usize,
    /// Values from one position's values to the next's, in `v`.
    pub v_row: usize,
    /// Values from one kv head's keys to the next's (at one position).
    pub k_head: usize,
    /// Values from one kv head's values to the next's.
    pub v_head: usize,
    /// The position of the first row in `k` and `v` (a sliding-window
    /// cache keeps only recent rows; 0 for a cache of every position).
    /// Attention never reads a key before it.
    pub base: usize,
}

/// Keys scored together before their values are accumulated; blocks start
/// at multiples of this position.
const KEY_BLOCK: usize = 64;

/// Batches of queries one task runs side by side: each key block is read
/// for all of them in turn while it is in cache, instead of every batch
/// streaming the whole cache (at 8k tokens a kv head's keys and values are
/// 4 MiB in f16, more than L2).
const TASK_BATCHES: usize = 16;

/// `out[t, h] = softmax(q[t,h] · K[..=p]ᵀ · scale) · V[..=p]` for the T tokens
/// at positions `pos0..pos0+T`, where the cache rows already hold every
/// position up to `pos0+T-1`. `q` is `[T, H·Dk]`, `out` is `[T, H·Dv]`;
/// `scratch` (at least as long as `out`) holds the results in kv-head order
/// before they go to `out`.
pub fn attend(q: &[f32], kv: KvView, pos0: usize, hd: Heads, scratch: &mut [f32], out: &mut [f32]) {
    let Heads { h, hkv, dk, dv, .. } = hd;
    let group = h / hkv;
    let t_n = q.len() / (h * dk);
    debug_assert_eq!(q.len() / dk, out.len() / dv);
    let es = kv.dtype.row_bytes(1).expect("an element type");
    debug_assert!(t_n == 0 || kv.k.len() >= ((hkv - 1) * kv.k_head + (pos0 + t_n - 1 - kv.base) * kv.k_row + dk) * es);
    // The SIMD kernels of the table (chosen once).
    let kk = crate::kernels::kv_fns(kv.dtype).expect("the KV cache is f32 or f16");
    // Query i of kv head g is token i / group, head g·group + i % group:
    // positions never decrease along i.
    let per_kv = t_n * group;
    let scratch = &mut scratch[..out.len()];
    let at = Ctx { q, kv, kk, pos0, hd, es };
    scratch.par_chunks_mut(per_kv * dv).enumerate().for_each(|(g, hs)| {
        hs.par_chunks_mut(TASK_BATCHES * KV_QUERIES * dv).enumerate().for_each(|(c, o)| {
            let mut batches = o.chunks_mut(KV_QUERIES * dv).enumerate();
            let mut bs: [Option<Batch>; TASK_BATCHES] = std::array::from_fn(|_| {
                batches.next().map(|(b, o)| {
                    let ids: [(usize, usize); KV_QUERIES] = std::array::from_fn(|k| {
                        let i = (c * TASK_BATCHES + b) * KV_QUERIES + k;
                        (i / group, g * group + i % group)
                    });
                    let n = o.len() / dv;
                    Batch::new(&at, g, &ids[..n], o)
                })
            });
            let lo = bs.iter().flatten().map(|b| b.first[0] / KEY_BLOCK).min().unwrap_or(0);
            let hi = bs.iter().flatten().map(|b| b.pos[b.n - 1] / KEY_BLOCK).max().unwrap_or(0);
            let mut scores = [[0f32; KEY_BLOCK]; KV_QUERIES];
            for blk in lo..=hi {
                for b in bs.iter_mut().flatten() {
                    b.block(&at, blk, &mut scores);
                }
            }
            bs.iter_mut().flatten().for_each(Batch::finish);
        });
    });
    for (g, hs) in scratch.chunks_exact(per_kv * dv).enumerate() {
        for (i, o) in hs.chunks_exact(dv).enumerate() {
            let (t, head) = (i / group, g * group + i % group);
            out[(t * h + head) * dv..(t * h + head + 1) * dv].copy_from_slice(o);
        }
    }
}

/// What every batch of one call reads.
struct Ctx<'a> {
    q: &'a [f32],
    kv: KvView<'a>,
    kk: KvKernels,
    pos0: usize,
    hd: Heads<'a>,
    /// Bytes per cache element.
    es: usize,
}

/// Up to eight queries of one kv head (positions in nondecreasing order)
/// with their score scales, and their online softmax: running maximum `m`,
/// running sum `l`, and the unnormalised output rows `o` (`[n, Dv]`).
struct Batch<'a> {
    n: usize,
    kvh: usize,
    qs: [&'a [f32]; KV_QUERIES],
    scale: [f32; KV_QUERIES],
    pos: [usize; KV_QUERIES],
    first: [usize; KV_QUERIES],
    m: [f32; KV_QUERIES],
    l: [f32; KV_QUERIES],
    o: &'a mut [f32],
}

impl<'a> Batch<'a> {
    /// The batch of queries `ids` ((token, head) pairs) of kv head `kvh`,
    /// its output rows `o`.
    fn new(at: &Ctx<'a>, kvh: usize, ids: &[(usize, usize)], o: &'a mut [f32]) -> Batch<'a> {
        let Heads { h, dk, window, sinks, scale, temperature, .. } = at.hd;
        let n = ids.len();
        let qs: [&[f32]; KV_QUERIES] = std::array::from_fn(|i| {
            let (t, head) = ids[i.min(n - 1)];
            &at.q[(t * h + head) * dk..(t * h + head + 1) * dk]
        });
        let pos: [usize; KV_QUERIES] = std::array::from_fn(|i| at.pos0 + ids[i.min(n - 1)].0);
        let first: [usize; KV_QUERIES] = std::array::from_fn(|i| window.map_or(0, |w| (pos[i] + 1).saturating_sub(w)));
        let scale: [f32; KV_QUERIES] = std::array::from_fn(|i| temperature.map_or(scale, |t| scale * t.at(pos[i])));
        // A sink is a key of logit s with no value: it starts the sum at 1.
        let mut m = [f32::NEG_INFINITY; KV_QUERIES];
        let mut l = [0f32; KV_QUERIES];
        for (i, &(_, head)) in ids.iter().enumerate() {
            if let Some(s) = sinks {
                (m[i], l[i]) = (s[head], 1.0);
            }
        }
        o.fill(0.0);
        Batch { n, kvh, qs, scale, pos, first, m, l, o }
    }

    /// Adds key block `blk` (if any query sees a key of it): scores, the
    /// rescale when the block raises a query's maximum, the probabilities
    /// (exactly zero on the keys a query does not see) and their block sum,
    /// then the values, in key order.
    fn block(&mut self, at: &Ctx, blk: usize, scores: &mut [[f32; KEY_BLOCK]; KV_QUERIES]) {
        let (kv, kk, es) = (at.kv, at.kk, at.es);
        let dv = at.hd.dv;
        let (n, kvh) = (self.n, self.kvh);
        let (b0, b1) = (blk * KEY_BLOCK, (blk + 1) * KEY_BLOCK);
        // Query i's keys in this block: lo[i]..hi[i] (both nondecreasing in
        // i, so the queries that see any are a run a..z).
        let lo: [usize; KV_QUERIES] = std::array::from_fn(|i| self.first[i].max(b0));
        let hi: [usize; KV_QUERIES] = std::array::from_fn(|i| (self.pos[i] + 1).min(b1));
        let live = |i: usize| lo[i] < hi[i];
        let Some(a) = (0..n).find(|&i| live(i)) else { return };
        let z = (0..n).rev().find(|&i| live(i)).expect("one is live") + 1;
        let (jlo, jhi) = (lo[a], hi[z - 1]);
        debug_assert!(jlo >= kv.base, "a key before the cache's first row");
        let k0 = ((jlo - kv.base) * kv.k_row + kvh * kv.k_head) * es;
        let flat = &mut scores.as_flattened_mut()[a * KEY_BLOCK + jlo - b0..];
        (kk.dots)(&kv.k[k0..], kv.k_row, jhi - jlo, &self.qs[a..z], flat, KEY_BLOCK);
        for i in a..z {
            let row = &mut scores[i];
            let (r0, r1) = (lo[i] - b0, hi[i] - b0);
            let scale = self.scale[i];
            row[r0..r1].iter_mut().for_each(|s| *s *= scale);
            let block_max = row[r0..r1].iter().fold(f32::NEG_INFINITY, |x, &s| x.max(s));
            if block_max > self.m[i] {
                let c = exp(self.m[i] - block_max);
                self.l[i] *= c;
                self.o[i * dv..(i + 1) * dv].iter_mut().for_each(|x| *x *= c);
                self.m[i] = block_max;
            }
            probabilities(row, r0, r1, self.m[i]);
            self.l[i] += block_sum(row);
        }
        // Keys every query of the run sees go through `pv` (the sums stay in
        // registers across them); the keys at the edges, one by one. Either
        // way each query adds its keys' values in key order.
        let (ilo, ihi) = (lo[z - 1], hi[a].max(lo[z - 1]));
        let mut p = [0f32; KV_QUERIES];
        let mut j = jlo;
        while j < jhi {
            if j == ilo && ilo < ihi {
                let v0 = ((ilo - kv.base) * kv.v_row + kvh * kv.v_head) * es;
                let p = &scores.as_flattened()[a * KEY_BLOCK + ilo - b0..(z - 1) * KEY_BLOCK + ihi - b0];
                (kk.pv)(&mut self.o[a * dv..z * dv], p, KEY_BLOCK, &kv.v[v0..], kv.v_row, ihi - ilo);
                j = ihi;
                continue;
            }
            // The queries that see key j: a contiguous run.
            let qa = (a..z).find(|&i| hi[i] > j).unwrap_or(z);
            let qb = (qa..z).find(|&i| lo[i] > j).unwrap_or(z);
            if qa < qb {
                for i in qa..qb {
                    p[i] = scores[i][j - b0];
                }
                let at = ((j - kv.base) * kv.v_row + kvh * kv.v_head) * es;
                (kk.axpys)(&mut self.o[qa * dv..qb * dv], &p[qa..qb], &kv.v[at..at + dv * es]);
            }
            j += 1;
        }
    }

    /// Divides each output row by its softmax sum.
    fn finish(&mut self) {
        let dv = self.o.len() / self.n;
        for (o, l) in self.o.chunks_exact_mut(dv).zip(self.l) {
            let inv = 1.0 / l;
            o.iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// `row[j] = e^(row[j] − m)` for `r0 ≤ j < r1`, exactly 0 elsewhere.
#[inline]
fn probabilities(row: &mut [f32; KEY_BLOCK], r0: usize, r1: usize, m: f32) {
    for (j, x) in row.iter_mut().enumerate() {
        let e = exp(*x - m);
        *x = if (r0..r1).contains(&j) { e } else { 0.0 };
    }
}

/// A block's probabilities summed in a fixed order (sixteen lanes, then a
/// halving tree), so a query's sum does not depend on its batch.
#[inline]
fn block_sum(row: &[f32; KEY_BLOCK]) -> f32 {
    let mut a = [0f32; 16];
    for c in row.chunks_exact(16) {
        for (a, c) in a.iter_mut().zip(c) {
            *a += c;
        }
    }
    let mut w = 8;
    while w > 0 {
        for k in 0..w {
            a[k] += a[k + w];
        }
        w /= 2;
    }
    a[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::blocks::test_values;

    /// Textbook attention with an explicit mask and a two-pass softmax.
    fn naive(q: &[f32], k: &[f32], v: &[f32], pos0: usize, hd: Heads) -> Vec<f32> {
        let Heads { h, hkv, dk: dh, window, scale, temperature, .. } = hd;
        let t_n = q.len() / (h * dh);
        let mut out = vec![0.0; q.len()];
        for t in 0..t_n {
            let p = pos0 + t;
            // The temperature as its rule reads: 1 + beta · ln(1 + floor(p / period)).
            let temp = temperature.map_or(1.0, |tp| 1.0 + tp.beta as f64 * (1.0 + (p / tp.period) as f64).ln());
            for head in 0..h {
                let kvh = head / (h / hkv);
                let scores: Vec<f64> = (0..=p)
                    .map(|j| {
                        let visible = window.is_none_or(|w| p - j < w);
                        if !visible {
                            return f64::NEG_INFINITY;
                        }
                        (0..dh)
                            .map(|d| (q[(t * h + head) * dh + d] * k[j * hkv * dh + kvh * dh + d]) as f64)
                            .sum::<f64>()
                            * scale as f64
                            * temp
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..dh {
                    out[(t * h + head) * dh + d] =
                        (0..=p).map(|j| e[j] / z * v[j * hkv * dh + kvh * dh + d] as f64).sum::<f64>() as f32;
                }
            }
        }
        out
    }

    #[test]
    fn matches_naive_attention_with_gqa_window_and_offset() {
        let mut values = test_values(1);
        let mut rnd = || 2.0 * values();
        for &(h, hkv, dh, window, pos0, t) in &[
            (4, 2, 6, None, 0, 7),
            (6, 3, 5, Some(3), 2, 9),
            (2, 2, 12, Some(1), 0, 4),
            (8, 1, 3, None, 5, 1),
            // Several key blocks, and a window that starts inside one.
            (4, 2, 16, None, 150, 30),
            (2, 1, 8, Some(70), 100, 20),
        ] {
            // A temperature where the queries do not start at 0.
            let temperature = (pos0 > 0).then_some(AttentionTemperature { beta: 0.4, period: 16 });
            let scale = 1.0 / (dh as f32).sqrt();
            let hd = Heads { h, hkv, dk: dh, dv: dh, window, scale, sinks: None, temperature };
            let s_len = pos0 + t;
            let k: Vec<f32> = (0..s_len * hkv * dh).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..s_len * hkv * dh).map(|_| rnd()).collect();
            let q: Vec<f32> = (0..t * h * dh).map(|_| rnd()).collect();
            let mut out = vec![0.0; q.len()];
            let (kr, vr) = (hkv * dh, hkv * dh);
            let kv = KvView {
                dtype: DType::F32,
                k: bytemuck::cast_slice(&k),
                v: bytemuck::cast_slice(&v),
                k_row: kr,
                v_row: vr,
                k_head: dh,
                v_head: dh,
                base: 0,
            };
            attend(&q, kv, pos0, hd, &mut vec![0.0; out.len()], &mut out);
            let want = naive(&q, &k, &v, pos0, hd);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b} for {hd:?}");
            }
            // An f16 cache: the same attention over the rounded keys and values.
            let to16 = |x: &[f32]| x.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect::<Vec<u16>>();
            let back = |x: &[u16]| x.iter().map(|b| half::f16::from_bits(*b).to_f32()).collect::<Vec<f32>>();
            let (k16, v16) = (to16(&k), to16(&v));
            let kv = KvView {
                dtype: DType::F16,
                k: bytemuck::cast_slice(&k16),
                v: bytemuck::cast_slice(&v16),
                k_row: kr,
                v_row: vr,
                k_head: dh,
                v_head: dh,
                base: 0,
            };
            attend(&q, kv, pos0, hd, &mut vec![0.0; out.len()], &mut out);
            let want = naive(&q, &back(&k16), &back(&v16), pos0, hd);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "f16 cache: {a} vs {b} for {hd:?}");
            }
        }
    }

    /// All tokens in one call (prefill) against one token per call (decode):
    /// the same bits, across several key blocks, with groups of heads, a
    /// window that starts inside a block, sinks, f32 and f16 caches.
    #[test]
    fn one_call_and_token_by_token_give_the_same_bits() {
        let mut values = test_values(9);
        let mut rnd = || 2.0 * values();
        let sinks = [0.5f32, -0.25, 1.0, 0.0, 2.0, -1.0];
        for &(h, hkv, dh, window, pos0, t) in &[
            (6, 3, 24, Some(70), 37, 100),
            (6, 1, 20, None, 0, 150),
            (6, 6, 8, None, 60, 9),
            (6, 2, 17, Some(5), 3, 30),
        ] {
            let temperature = window.map(|_| AttentionTemperature { beta: 0.3, period: 9 });
            let hd = Heads { h, hkv, dk: dh, dv: dh, window, scale: 0.3, sinks: Some(&sinks[..h]), temperature };
            let n = pos0 + t;
            let k: Vec<f32> = (0..n * hkv * dh).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..n * hkv * dh).map(|_| rnd()).collect();
            let q: Vec<f32> = (0..t * h * dh).map(|_| rnd()).collect();
            let to16 = |x: &[f32]| x.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect::<Vec<u16>>();
            let (k16, v16) = (to16(&k), to16(&v));
            for (dtype, kb, vb) in [
                (DType::F32, bytemuck::cast_slice::<f32, u8>(&k), bytemuck::cast_slice::<f32, u8>(&v)),
                (DType::F16, bytemuck::cast_slice::<u16, u8>(&k16), bytemuck::cast_slice::<u16, u8>(&v16)),
            ] {
                let kv =
                    KvView { dtype, k: kb, v: vb, k_row: hkv * dh, v_row: hkv * dh, k_head: dh, v_head: dh, base: 0 };
                let mut all = vec![0.0; q.len()];
                attend(&q, kv, pos0, hd, &mut vec![0.0; q.len()], &mut all);
                for ti in 0..t {
                    let qt = &q[ti * h * dh..(ti + 1) * h * dh];
                    let mut one = vec![0.0; h * dh];
                    attend(qt, kv, pos0 + ti, hd, &mut vec![0.0; h * dh], &mut one);
                    assert_eq!(one, all[ti * h * dh..(ti + 1) * h * dh], "{dtype} {hd:?}: token {ti}");
                }
            }
        }
    }

    #[test]
    fn sinks_join_the_denominator_and_latent_values_are_key_prefixes() {
        // One shared kv head whose values are the first dv of each key row
        // (the absorbed MLA layout), with a sink logit per query head.
        let (h, dk, dv, t) = (3, 7, 4, 9);
        let mut rnd = test_values(5);
        let k: Vec<f32> = (0..t * dk).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..t * h * dk).map(|_| rnd()).collect();
        let sinks = [0.3f32, -1.0, 2.0];
        let scale = 0.37;
        let mut out = vec![0.0; t * h * dv];
        let kb: &[u8] = bytemuck::cast_slice(&k);
        let kv = KvView { dtype: DType::F32, k: kb, v: kb, k_row: dk, v_row: dk, k_head: 0, v_head: 0, base: 0 };
        let heads = Heads { h, hkv: 1, dk, dv, window: Some(4), scale, sinks: Some(&sinks), temperature: None };
        attend(&q, kv, 0, heads, &mut vec![0.0; out.len()], &mut out);
        for ti in 0..t {
            for hh in 0..h {
                let first = (ti + 1).saturating_sub(4);
                let sc: Vec<f64> = (first..=ti)
                    .map(|j| {
                        (0..dk).map(|x| (q[(ti * h + hh) * dk + x] * k[j * dk + x]) as f64).sum::<f64>() * scale as f64
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(sinks[hh] as f64, f64::max);
                let z: f64 = sc.iter().map(|x| (x - mx).exp()).sum::<f64>() + (sinks[hh] as f64 - mx).exp();
                for x in 0..dv {
                    let want: f64 =
                        sc.iter().zip(first..=ti).map(|(s, j)| (s - mx).exp() / z * k[j * dk + x] as f64).sum();
                    let got = out[(ti * h + hh) * dv + x] as f64;
                    assert!((got - want).abs() < 1e-5, "t {ti} head {hh}: {got} vs {want}");
                }
            }
        }
    }
}
