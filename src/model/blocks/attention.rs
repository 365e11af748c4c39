//! Causal attention over the KV cache: grouped-query attention, and the
//! absorbed form of multi-head latent attention, which is the same loop with
//! one shared "head" whose keys are the latent plus the rotated key and whose
//! values are the latent itself.
//!
//! One task per (token, head) pair: the task streams that head's keys and
//! values once with an online softmax (running max and sum, updated per
//! block of keys), so no score buffer beyond one block on the stack is
//! needed and the result does not depend on how tasks are spread over
//! threads. A head's sink logit, when the model has one, starts the running
//! sum: it joins the softmax's denominator and adds no value.

use rayon::prelude::*;

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
    /// [H] sink logits.
    pub sinks: Option<&'a [f32]>,
}

/// One layer's cached keys and values as raw bytes of `dtype` (f32 or f16):
/// position j's keys start at `j · k_row` values, its values at `j · v_row`
/// in `v`; kv head g's part at `g · Dk` (keys) and `g · Dv` (values). For MLA
/// `v` is the key buffer itself: the values are the first Dv of each key row.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    /// Element type (f32 or f16).
    pub dtype: DType,
    /// Keys (after norm and RoPE).
    pub k: &'a [u8],
    /// Values.
    pub v: &'a [u8],
    /// Values per cached position in `k`.
    pub k_row: usize,
    /// Values per cached position in `v`.
    pub v_row: usize,
}

/// `out[t, h] = softmax(q[t,h] · K[..=p]ᵀ · scale) · V[..=p]` for the T tokens
/// at positions `pos0..pos0+T`, where the cache rows already hold every
/// position up to `pos0+T-1`. `q` is `[T, H·Dk]`, `out` is `[T, H·Dv]`.
pub fn attend(q: &[f32], kv: KvView, pos0: usize, hd: Heads, out: &mut [f32]) {
    let Heads { h, hkv, dk, dv, window, scale, sinks } = hd;
    let group = h / hkv;
    let es = kv.dtype.row_bytes(1).expect("an element type");
    debug_assert_eq!(q.len() / dk, out.len() / dv);
    debug_assert!(kv.k.len() >= (pos0 + q.len() / (h * dk)) * kv.k_row * es);
    // The SIMD kernels of the table (chosen once).
    let dot = crate::kernels::dot_fn(kv.dtype);
    let axpy = crate::kernels::axpy_fn(kv.dtype).expect("the KV cache is f32 or f16");
    let (kc, vc) = (kv.k, kv.v);
    let kspan = |j: usize, kvh: usize| {
        let at = (j * kv.k_row + kvh * dk) * es;
        at..at + dk * es
    };
    let vspan = |j: usize, kvh: usize| {
        let at = (j * kv.v_row + kvh * dv) * es;
        at..at + dv * es
    };
    // [T·H, Dv] chunks: chunk i is token i / H, head i % H.
    out.par_chunks_mut(dv).enumerate().with_min_len(8).for_each(|(i, o)| {
        let (t, head) = (i / h, i % h);
        let pos = pos0 + t;
        let kvh = head / group;
        let qv = &q[i * dk..(i + 1) * dk];
        let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        o.fill(0.0);
        // A sink is a key of logit s with no value: it starts the sum at 1.
        let (mut m, mut l) = match sinks {
            Some(s) => (s[head], 1.0f32),
            None => (f32::NEG_INFINITY, 0.0f32),
        };
        // Keys in blocks: all scores of a block first (on the stack), then one
        // rescale of the running sums per block rather than per new maximum.
        let mut j0 = first;
        while j0 <= pos {
            let j1 = (j0 + KEY_BLOCK).min(pos + 1);
            let mut scores = [0f32; KEY_BLOCK];
            let mut block_max = f32::NEG_INFINITY;
            for (j, s) in (j0..j1).zip(scores.iter_mut()) {
                *s = dot(&kc[kspan(j, kvh)], qv, &[]) * scale;
                block_max = block_max.max(*s);
            }
            if block_max > m {
                let c = (m - block_max).exp();
                l *= c;
                o.iter_mut().for_each(|x| *x *= c);
                m = block_max;
            }
            for (j, s) in (j0..j1).zip(&scores) {
                let p = (s - m).exp();
                l += p;
                axpy(o, p, &vc[vspan(j, kvh)]);
            }
            j0 = j1;
        }
        let inv = 1.0 / l;
        o.iter_mut().for_each(|x| *x *= inv);
    });
}

/// Keys scored together before their values are accumulated.
const KEY_BLOCK: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    /// Textbook attention with an explicit mask and a two-pass softmax.
    fn naive(q: &[f32], k: &[f32], v: &[f32], pos0: usize, hd: Heads) -> Vec<f32> {
        let Heads { h, hkv, dk: dh, window, .. } = hd;
        let t_n = q.len() / (h * dh);
        let mut out = vec![0.0; q.len()];
        for t in 0..t_n {
            let p = pos0 + t;
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
                            / (dh as f64).sqrt()
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
        let mut s = 1u32;
        let mut rnd = || {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1 << 24) as f32 * 4.0 - 2.0
        };
        for &(h, hkv, dh, window, pos0, t) in &[
            (4, 2, 6, None, 0, 7),
            (6, 3, 5, Some(3), 2, 9),
            (2, 2, 12, Some(1), 0, 4),
            (8, 1, 3, None, 5, 1),
            // Several key blocks, and a window that starts inside one.
            (4, 2, 16, None, 150, 30),
            (2, 1, 8, Some(70), 100, 20),
        ] {
            let hd = Heads { h, hkv, dk: dh, dv: dh, window, scale: 1.0 / (dh as f32).sqrt(), sinks: None };
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
            };
            attend(&q, kv, pos0, hd, &mut out);
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
            };
            attend(&q, kv, pos0, hd, &mut out);
            let want = naive(&q, &back(&k16), &back(&v16), pos0, hd);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "f16 cache: {a} vs {b} for {hd:?}");
            }
        }
    }

    #[test]
    fn sinks_join_the_denominator_and_latent_values_are_key_prefixes() {
        // One shared kv head whose values are the first dv of each key row
        // (the absorbed MLA layout), with a sink logit per query head.
        let (h, dk, dv, t) = (3, 7, 4, 9);
        let mut s = 5u32;
        let mut rnd = || {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
        };
        let k: Vec<f32> = (0..t * dk).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..t * h * dk).map(|_| rnd()).collect();
        let sinks = [0.3f32, -1.0, 2.0];
        let scale = 0.37;
        let mut out = vec![0.0; t * h * dv];
        let kb: &[u8] = bytemuck::cast_slice(&k);
        let kv = KvView { dtype: DType::F32, k: kb, v: kb, k_row: dk, v_row: dk };
        let heads = Heads { h, hkv: 1, dk, dv, window: Some(4), scale, sinks: Some(&sinks) };
        attend(&q, kv, 0, heads, &mut out);
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
