//! The KV cache of the attention kinds (GQA and MLA): one layer's keys and
//! values per sequence, head by head, of every position or of a sliding
//! window's recent ones.

use crate::canonical::state::ROLLBACK;
use crate::model::blocks::attention::KvView;
use crate::quant::DType;

/// One layer's keys and values in f32 or f16, head by head: `[Hkv, S, Dk]`
/// keys and `[Hkv, S, Dv]` values for GQA (Wk = Hkv·Dk values per position);
/// for MLA one "head" of the latent and the rotated key, `[S, R + Dr]`, and
/// no separate values (Wv = 0: they are the latent). A head's rows follow
/// one another, so attention reads each head's keys and values as one
/// stream, which the hardware prefetcher follows; rows position-major (all
/// heads of a position side by side) put one head's consecutive rows a
/// whole position apart, 4 KiB at the OLMoE width, and a decode step over
/// caches out of the CPU's caches waited on each row in turn.
pub struct KvCache {
    /// Element type (f32 or f16).
    pub dtype: DType,
    /// S: rows per head (every position, or a sliding window's recent ones).
    max_seq: usize,
    /// The position of row 0 (moves forward as a sliding window slides).
    base: usize,
    /// The first position whose rows hold computed values: 0, or for a
    /// window's cache resumed at a later position, the first one
    /// [`KvCache::put_rows`] fills (rows before it stay zero until they
    /// slide out).
    first: usize,
    /// The sliding window, if the layer has one.
    window: Option<usize>,
    /// Hkv: heads (1 for MLA).
    heads: usize,
    /// Values per position, all heads, keys and values.
    k_width: usize,
    v_width: usize,
    /// Keys (after norm and RoPE) as `dtype` values; f32 storage only for
    /// its alignment.
    k: Vec<f32>,
    /// Values, stored as the keys.
    v: Vec<f32>,
}

impl KvCache {
    /// A cache of `rows` rows per head (`k_width`, `v_width` key and value
    /// values per position over the `heads`); with a `window`, one that
    /// slides when a pass would run past its last row.
    pub fn new(
        dtype: DType,
        rows: usize,
        heads: usize,
        k_width: usize,
        v_width: usize,
        window: Option<usize>,
    ) -> KvCache {
        assert!(matches!(dtype, DType::F32 | DType::F16), "the KV cache holds f32 or f16, not {dtype}");
        assert!(heads >= 1 && k_width.is_multiple_of(heads) && v_width.is_multiple_of(heads), "whole heads");
        let es = dtype.row_bytes(1).expect("an element type");
        // Zeroed allocations: pages are only committed as positions fill.
        let words = |w: usize| (rows * w * es).div_ceil(4);
        let (k, v) = (vec![0.0; words(k_width)], vec![0.0; words(v_width)]);
        KvCache { dtype, max_seq: rows, base: 0, first: 0, window, heads, k_width, v_width, k, v }
    }

    /// Whether the next pass may start at `pos`: the cache still holds
    /// every row its first query reads (always, for a cache of every position).
    pub fn can_resume_at(&self, pos: usize) -> bool {
        self.window.is_none_or(|w| pos == 0 || (pos + 1).saturating_sub(w) >= self.base.max(self.first))
    }

    /// Makes room for positions `pos0..pos0+n` in a sliding window's cache:
    /// when they would run past the last row, the `w − 1 + ROLLBACK` rows
    /// before `pos0` move to the front (every head's keys and values), so
    /// row 0 becomes that many positions before `pos0`. A sequence that
    /// starts again at 0 starts at row 0.
    fn slide(&mut self, pos0: usize, n: usize) {
        let Some(w) = self.window else { return };
        let keep = w - 1 + ROLLBACK;
        if pos0 == 0 {
            self.base = 0;
            self.first = 0;
        }
        if pos0 + n - self.base <= self.max_seq {
            return;
        }
        let new_base = pos0.saturating_sub(keep).max(self.base);
        assert!(
            pos0 + n - new_base <= self.max_seq,
            "a pass of {n} tokens does not fit a sliding-window cache of {} rows keeping {keep}",
            self.max_seq
        );
        let es = self.dtype.row_bytes(1).expect("an element type");
        let (s, hs, shift, kept) = (self.max_seq, self.heads, new_base - self.base, pos0 - new_base);
        for (buf, w) in [(&mut self.k, self.k_width), (&mut self.v, self.v_width)] {
            let row = w / hs * es;
            let b: &mut [u8] = bytemuck::cast_slice_mut(buf);
            for g in 0..hs {
                let head = g * s * row;
                b.copy_within(head + shift * row..head + (shift + kept) * row, head);
            }
        }
        self.base = new_base;
    }

    /// Stores the keys (`[n, Wk]` f32) and values (`[n, Wv]`; empty for MLA)
    /// of positions `pos0..pos0+n`, converted to the cache's type.
    pub fn store(&mut self, pos0: usize, k: &[f32], v: &[f32]) {
        let n = k.len().checked_div(self.k_width).unwrap_or(0);
        self.slide(pos0, n);
        let es = self.dtype.row_bytes(1).expect("an element type");
        let (s, hs, pos0) = (self.max_seq, self.heads, pos0 - self.base);
        for (buf, w, x) in [(&mut self.k, self.k_width, k), (&mut self.v, self.v_width, v)] {
            if w == 0 {
                continue;
            }
            let dh = w / hs;
            let b: &mut [u8] = bytemuck::cast_slice_mut(buf);
            for (t, row) in x.chunks_exact(w).enumerate() {
                for (g, part) in row.chunks_exact(dh).enumerate() {
                    let at = ((g * s) + pos0 + t) * dh * es;
                    crate::quant::encode(self.dtype, part, dh, &mut b[at..at + dh * es]);
                }
            }
        }
    }

    /// Bytes of one position's keys and values, all heads.
    pub fn position_bytes(&self) -> usize {
        self.dtype.row_bytes(self.k_width + self.v_width).expect("an element type")
    }

    /// Whether the rows of positions `pos0..pos0 + n` are still held (all of
    /// them, unless a sliding window has moved past some).
    pub fn holds(&self, pos0: usize, n: usize) -> bool {
        pos0 >= self.base.max(self.first) && pos0 + n - self.base <= self.max_seq
    }

    /// Appends the stored rows of positions `pos0..pos0 + n` to `out`: every
    /// head's `n` key rows, head after head, then the value rows the same
    /// way (`n ·` [`KvCache::position_bytes`] bytes). The rows must be held.
    pub fn copy_rows(&self, pos0: usize, n: usize, out: &mut Vec<u8>) {
        assert!(self.holds(pos0, n), "positions {pos0}..{} are not in the cache", pos0 + n);
        let es = self.dtype.row_bytes(1).expect("an element type");
        let (s, hs, at) = (self.max_seq, self.heads, pos0 - self.base);
        for (buf, w) in [(&self.k, self.k_width), (&self.v, self.v_width)] {
            let row = w / hs * es;
            let b: &[u8] = bytemuck::cast_slice(buf);
            for g in 0..hs {
                let head = (g * s + at) * row;
                out.extend_from_slice(&b[head..head + n * row]);
            }
        }
    }

    /// Makes a fresh cache one whose next pass starts at `pos`: a sliding
    /// window's row 0 becomes `w − 1 + ROLLBACK` positions before `pos` (as
    /// after a slide), and only the window's `w − 1` rows before `pos` count
    /// as held once [`KvCache::put_rows`] fills them.
    pub fn start_at(&mut self, pos: usize) {
        if let Some(w) = self.window {
            self.base = pos.saturating_sub(w - 1 + ROLLBACK);
            self.first = (pos + 1).saturating_sub(w);
        }
    }

    /// Writes rows `from..to` of `rows`, a block of `n` positions from
    /// [`KvCache::copy_rows`] starting at position `pos0`, back as positions
    /// `pos0 + from..pos0 + to`, which the cache must have room for (see
    /// [`KvCache::start_at`]).
    pub fn put_rows(&mut self, pos0: usize, n: usize, rows: &[u8], from: usize, to: usize) {
        assert!(from <= to && to <= n && rows.len() == n * self.position_bytes(), "a block of {n} positions");
        if from == to {
            return;
        }
        assert!(self.holds(pos0 + from, to - from), "no room for positions {}..{}", pos0 + from, pos0 + to);
        let es = self.dtype.row_bytes(1).expect("an element type");
        let (s, hs, at) = (self.max_seq, self.heads, pos0 + from - self.base);
        let mut src = rows;
        for (buf, w) in [(&mut self.k, self.k_width), (&mut self.v, self.v_width)] {
            let row = w / hs * es;
            let b: &mut [u8] = bytemuck::cast_slice_mut(buf);
            for g in 0..hs {
                let (block, rest) = src.split_at(n * row);
                src = rest;
                let head = (g * s + at) * row;
                b[head..head + (to - from) * row].copy_from_slice(&block[from * row..to * row]);
            }
        }
    }

    /// The sliding window, if the layer has one.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The keys and values of positions `0..len` (of `base..len` for a
    /// sliding window's cache, which holds no older ones).
    pub fn view(&self, len: usize) -> KvView<'_> {
        let es = self.dtype.row_bytes(1).expect("an element type");
        let (s, hs, base, len) = (self.max_seq, self.heads, self.base, len - self.base);
        let (kb, vb): (&[u8], &[u8]) = (bytemuck::cast_slice(&self.k), bytemuck::cast_slice(&self.v));
        // Head g's rows start g·S rows in; the last head's end after `len`.
        let rows = |w: usize| 0..(((hs - 1) * s) + len) * (w / hs) * es;
        let k = &kb[rows(self.k_width)];
        let dk = self.k_width / hs;
        if self.v_width == 0 {
            // MLA: the values are the first R values of each key row.
            return KvView { dtype: self.dtype, k, v: k, k_row: dk, v_row: dk, k_head: s * dk, v_head: s * dk, base };
        }
        let dv = self.v_width / hs;
        let v = &vb[rows(self.v_width)];
        KvView { dtype: self.dtype, k, v, k_row: dk, v_row: dv, k_head: s * dk, v_head: s * dv, base }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::blocks::test_values;

    /// A window's cache resumed at a later position holds the window's rows
    /// before it once they are put back, and not the rows before those
    /// (zeros, never computed), until a pass from position 0 starts again.
    #[test]
    fn a_resumed_window_holds_only_the_rows_put_back() {
        let (w, pos, n) = (8, 100, 16);
        let mut c = KvCache::new(DType::F32, 2 * (w + ROLLBACK) + 16, 2, 6, 6, Some(w));
        c.start_at(pos);
        let block = vec![0u8; n * c.position_bytes()];
        // The window's 7 rows before position 100: 93..96 of one block, 96..100 of the next.
        c.put_rows(80, n, &block, 13, 16);
        c.put_rows(96, n, &block, 0, 4);
        assert!(c.holds(pos + 1 - w, w - 1));
        assert!(!c.holds(pos - w, 1), "a row before the window was never computed");
        assert!(c.can_resume_at(pos) && !c.can_resume_at(pos - 2));
        c.store(0, &[0.0; 6], &[0.0; 6]);
        assert!(c.holds(0, 1));
    }
    use crate::model::blocks::attention::{Heads, attend};

    /// The head-by-head cache, filled in two stores, gives attention the
    /// bits of the same keys and values laid out position by position, in
    /// every layer, for grouped-query heads and for MLA's one shared head.
    #[test]
    fn the_cache_gives_attention_the_bits_of_a_position_major_layout() {
        let mut rnd = test_values(7);
        let (layers, max_seq, n, split) = (3, 40, 29, 11);
        for (h, hkv, dh, mla) in [(6, 3, 8, false), (4, 4, 5, false), (3, 1, 7, true)] {
            let (kw, vw) = (hkv * dh, if mla { 0 } else { hkv * dh });
            for dtype in [DType::F32, DType::F16] {
                let mut caches: Vec<KvCache> =
                    (0..layers).map(|_| KvCache::new(dtype, max_seq, hkv, kw, vw, None)).collect();
                let per_layer: Vec<(Vec<f32>, Vec<f32>)> = (0..layers)
                    .map(|_| ((0..n * kw).map(|_| rnd()).collect(), (0..n * vw).map(|_| rnd()).collect()))
                    .collect();
                // (MLA's values are empty: vw is 0.)
                for (l, (k, v)) in per_layer.iter().enumerate() {
                    caches[l].store(0, &k[..split * kw], &v[..split * vw]);
                    caches[l].store(split, &k[split * kw..], &v[split * vw..]);
                }
                let dv = if mla { dh - 2 } else { dh };
                let hd = Heads { h, hkv, dk: dh, dv, window: None, scale: 0.4, sinks: None, temperature: None };
                let q: Vec<f32> = (0..h * dh).map(|_| rnd()).collect();
                for (l, (k, v)) in per_layer.iter().enumerate() {
                    let enc = |x: &[f32], w: usize| {
                        let mut b = vec![0u8; dtype.row_bytes(w).unwrap() * n];
                        crate::quant::encode(dtype, x, w, &mut b);
                        b
                    };
                    let kb = enc(k, kw);
                    // MLA's values are the key rows' first dv.
                    let (vb, vr) = if mla { (kb.clone(), kw) } else { (enc(v, vw), vw) };
                    let flat = KvView { dtype, k: &kb, v: &vb, k_row: kw, v_row: vr, k_head: dh, v_head: dh, base: 0 };
                    let (mut want, mut got) = (vec![0f32; h * dv], vec![0f32; h * dv]);
                    attend(&q, flat, n - 1, hd, &mut vec![0.0; h * dv], &mut want);
                    attend(&q, caches[l].view(n), n - 1, hd, &mut vec![0.0; h * dv], &mut got);
                    assert_eq!(got, want, "{dtype} layer {l}, {h}/{hkv} heads of {dh}, mla {mla}");
                }
            }
        }
    }
}
