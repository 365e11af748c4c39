//! Scalar reference kernels: always compiled, the oracle every SIMD kernel is
//! tested against. Written with eight independent accumulators so the summation
//! order is fixed and documented (lane i sums elements i, i+8, i+16, …; the
//! lanes are then added pairwise, then the tail), which SIMD twins reproduce.
//! Plain multiply-then-add, not `mul_add`: without hardware FMA in the
//! baseline target, `mul_add` becomes a slow library call.

/// Sums eight lane accumulators in a fixed tree order.
#[inline(always)]
fn reduce8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// Dot product of an f32 weight row with an f32 activation vector.
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for i in 0..8 {
            acc[i] += a[i] * b[i];
        }
    }
    let mut s = reduce8(acc);
    for (a, b) in wt.iter().zip(xt) {
        s += a * *b;
    }
    s
}

/// bf16 → f32 is exact: the bf16 bits are the top half of the f32.
#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Dot product of a bf16 weight row (raw bits) with an f32 vector.
pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for i in 0..8 {
            acc[i] += bf16_to_f32(a[i]) * b[i];
        }
    }
    let mut s = reduce8(acc);
    for (a, b) in wt.iter().zip(xt) {
        s += bf16_to_f32(*a) * *b;
    }
    s
}

/// Dot product of an f16 weight row (raw bits) with an f32 vector.
pub fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let h = |b: u16| half::f16::from_bits(b).to_f32();
    let mut acc = [0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for i in 0..8 {
            acc[i] += h(a[i]) * b[i];
        }
    }
    let mut s = reduce8(acc);
    for (a, b) in wt.iter().zip(xt) {
        s += h(*a) * *b;
    }
    s
}

/// `o += a · v`.
pub fn axpy_f32(o: &mut [f32], a: f32, v: &[f32]) {
    for (x, y) in o.iter_mut().zip(v) {
        *x += a * y;
    }
}

/// `o += a · v` for f16 `v` (raw bits).
pub fn axpy_f16(o: &mut [f32], a: f32, v: &[u16]) {
    for (x, y) in o.iter_mut().zip(v) {
        *x += a * half::f16::from_bits(*y).to_f32();
    }
}

use crate::quant::act::BlockQ8;
use crate::quant::mxfp4::{BlockMxfp4, LUT2, half_scale};
use crate::quant::q4_0::BlockQ4_0;
use crate::quant::q4_1::BlockQ4_1;
use crate::quant::q8_0::BlockQ8_0;

/// q8_0 weight row · quantised activation.
pub fn dot_q8_0(w: &[BlockQ8_0], a: &[BlockQ8]) -> f32 {
    let mut s = 0f32;
    for (bw, ba) in w.iter().zip(a) {
        let dot: i32 = bw.qs.iter().zip(&ba.qs).map(|(&x, &y)| x as i32 * y as i32).sum();
        s += half::f16::from_bits(bw.d).to_f32() * ba.d * dot as f32;
    }
    s
}

/// q4_0 weight row · quantised activation.
pub fn dot_q4_0(w: &[BlockQ4_0], a: &[BlockQ8]) -> f32 {
    let mut s = 0f32;
    for (bw, ba) in w.iter().zip(a) {
        let mut dot = 0i32;
        for j in 0..16 {
            dot += ((bw.qs[j] & 0xF) as i32 - 8) * ba.qs[j] as i32;
            dot += ((bw.qs[j] >> 4) as i32 - 8) * ba.qs[j + 16] as i32;
        }
        s += half::f16::from_bits(bw.d).to_f32() * ba.d * dot as f32;
    }
    s
}

/// q4_1 weight row · quantised activation: `Σ (d·c + m)·x = d·dₐ·Σ c·q + m·s`.
pub fn dot_q4_1(w: &[BlockQ4_1], a: &[BlockQ8]) -> f32 {
    let mut s = 0f32;
    for (bw, ba) in w.iter().zip(a) {
        let mut dot = 0i32;
        for j in 0..16 {
            dot += (bw.qs[j] & 0xF) as i32 * ba.qs[j] as i32;
            dot += (bw.qs[j] >> 4) as i32 * ba.qs[j + 16] as i32;
        }
        s += half::f16::from_bits(bw.d).to_f32() * ba.d * dot as f32
            + half::f16::from_bits(bw.m).to_f32() * ba.scaled_sum();
    }
    s
}

/// mxfp4 weight row · quantised activation: per block the integer
/// `Σ LUT2[c]·q` (doubled E2M1 values) times `2^(e−128)·dₐ`.
pub fn dot_mxfp4(w: &[BlockMxfp4], a: &[BlockQ8]) -> f32 {
    let mut s = 0f32;
    for (bw, ba) in w.iter().zip(a) {
        let mut dot = 0i32;
        for j in 0..16 {
            dot += LUT2[(bw.qs[j] & 0xF) as usize] as i32 * ba.qs[j] as i32;
            dot += LUT2[(bw.qs[j] >> 4) as usize] as i32 * ba.qs[j + 16] as i32;
        }
        s += half_scale(bw.e) * ba.d * dot as f32;
    }
    s
}

use crate::quant::x8::{BlockMxfp4x8, BlockQ4_0x8, BlockQ4_1x8, BlockQ8_0x8, ROWS};

/// Σ over the 32 values of row `l` of a 4-bit group block: code · activation.
fn nibble_dot(qs: &[u8; 16 * ROWS], l: usize, a: &[i8; 32]) -> i32 {
    let mut dot = 0i32;
    for j in 0..4 {
        for i in 0..4 {
            let byte = qs[32 * j + 4 * l + i];
            dot += (byte & 0xF) as i32 * a[4 * j + i] as i32;
            dot += (byte >> 4) as i32 * a[16 + 4 * j + i] as i32;
        }
    }
    dot
}

/// Eight interleaved q8_0 rows · one quantised activation row.
pub fn gemv8_q8_0(g: &[BlockQ8_0x8], a: &[BlockQ8]) -> [f32; ROWS] {
    let mut acc = [0f32; ROWS];
    for (bw, ba) in g.iter().zip(a) {
        for (l, s) in acc.iter_mut().enumerate() {
            let mut dot = 0i32;
            for k in 0..8 {
                for i in 0..4 {
                    dot += bw.qs[32 * k + 4 * l + i] as i32 * ba.qs[4 * k + i] as i32;
                }
            }
            *s += half::f16::from_bits(bw.d[l]).to_f32() * ba.d * dot as f32;
        }
    }
    acc
}

/// Eight interleaved q4_0 rows · one quantised activation row.
pub fn gemv8_q4_0(g: &[BlockQ4_0x8], a: &[BlockQ8]) -> [f32; ROWS] {
    let mut acc = [0f32; ROWS];
    for (bw, ba) in g.iter().zip(a) {
        for (l, s) in acc.iter_mut().enumerate() {
            // Σ (c - 8)·q = Σ c·q - 8·Σq, exactly, in integers.
            let dot = nibble_dot(&bw.qs, l, &ba.qs) - 8 * ba.sum;
            *s += half::f16::from_bits(bw.d[l]).to_f32() * ba.d * dot as f32;
        }
    }
    acc
}

/// Eight interleaved mxfp4 rows · one quantised activation row.
pub fn gemv8_mxfp4(g: &[BlockMxfp4x8], a: &[BlockQ8]) -> [f32; ROWS] {
    let mut acc = [0f32; ROWS];
    for (bw, ba) in g.iter().zip(a) {
        for (l, s) in acc.iter_mut().enumerate() {
            let mut dot = 0i32;
            for j in 0..4 {
                for i in 0..4 {
                    let byte = bw.qs[32 * j + 4 * l + i];
                    dot += LUT2[(byte & 0xF) as usize] as i32 * ba.qs[4 * j + i] as i32;
                    dot += LUT2[(byte >> 4) as usize] as i32 * ba.qs[16 + 4 * j + i] as i32;
                }
            }
            *s += half_scale(bw.e[l]) * ba.d * dot as f32;
        }
    }
    acc
}

/// Eight interleaved q4_1 rows · one quantised activation row.
pub fn gemv8_q4_1(g: &[BlockQ4_1x8], a: &[BlockQ8]) -> [f32; ROWS] {
    let mut acc = [0f32; ROWS];
    for (bw, ba) in g.iter().zip(a) {
        for (l, s) in acc.iter_mut().enumerate() {
            let dot = nibble_dot(&bw.qs, l, &ba.qs);
            *s += half::f16::from_bits(bw.d[l]).to_f32() * ba.d * dot as f32
                + half::f16::from_bits(bw.m[l]).to_f32() * ba.scaled_sum();
        }
    }
    acc
}

use crate::quant::kquant::{
    BlockQ4K, BlockQ5K, BlockQ6K, Kind, QK, SUBS, check_row, codes_q5k, codes_q6k, h2f, load, nibbles, spans,
    unpack_scales,
};
use crate::quant::kx8;

// ------------------------------------------------------------------
// Super-block types (q4k, q5k, q6k), row-major.

/// q4k row · quantised activation (`a.len()` blocks, one per sub-block), in
/// the order the layout's docs give ([`crate::quant::kquant`]).
pub fn dot_q4k(row: &[u8], a: &[BlockQ8]) -> f32 {
    check_row(Kind::Q4K, row.len(), a.len() * QK);
    let mut acc = [0f32; SUBS];
    for (span, a) in spans(Kind::Q4K, a.len() * QK).zip(a.chunks(SUBS)) {
        let b: BlockQ4K = load(&row[span.0]);
        let (sc, m) = unpack_scales(&b.head.scales);
        for (j, a) in a.iter().enumerate() {
            acc[j] += affine_term(h2f(b.head.d), h2f(b.head.dmin), sc[j], m[j], &nibbles(&b.qs[j]), a);
        }
    }
    reduce8(acc)
}

/// q5k row · quantised activation, as [`dot_q4k`].
pub fn dot_q5k(row: &[u8], a: &[BlockQ8]) -> f32 {
    check_row(Kind::Q5K, row.len(), a.len() * QK);
    let mut acc = [0f32; SUBS];
    for (span, a) in spans(Kind::Q5K, a.len() * QK).zip(a.chunks(SUBS)) {
        let b: BlockQ5K = load(&row[span.0]);
        let (sc, m) = unpack_scales(&b.head.scales);
        for (j, a) in a.iter().enumerate() {
            acc[j] += affine_term(h2f(b.head.d), h2f(b.head.dmin), sc[j], m[j], &codes_q5k(&b.subs[j]), a);
        }
    }
    reduce8(acc)
}

/// q6k row · quantised activation, as [`dot_q4k`].
pub fn dot_q6k(row: &[u8], a: &[BlockQ8]) -> f32 {
    check_row(Kind::Q6K, row.len(), a.len() * QK);
    let mut acc = [0f32; SUBS];
    for (span, a) in spans(Kind::Q6K, a.len() * QK).zip(a.chunks(SUBS)) {
        let b: BlockQ6K = load(&row[span.0]);
        for (j, a) in a.iter().enumerate() {
            let n = q6k_sub_sum(&codes_q6k(&b.subs[j]), [b.head.scales[2 * j], b.head.scales[2 * j + 1]], a);
            acc[j] += h2f(b.head.d) * n as f32 * a.d;
        }
    }
    reduce8(acc)
}

/// One q6k sub-block's integer `n = sc₀ · (p₀ − 32 · Σ₀) + sc₁ · (p₁ − 32 ·
/// Σ₁)` of the module docs (`Σ (c − 32)·q` per half, exactly, each times its
/// scale): the integer every q6k kernel computes, row-major or interleaved.
pub(crate) fn q6k_sub_sum(codes: &[u8; QK], sc: [i8; 2], a: &BlockQ8) -> i32 {
    let half = |h: usize| {
        let r = 16 * h..16 * h + 16;
        let p: i32 = codes[r.clone()].iter().zip(&a.qs[r.clone()]).map(|(&c, &q)| c as i32 * q as i32).sum();
        let s: i32 = a.qs[r].iter().map(|&q| q as i32).sum();
        sc[h] as i32 * (p - 32 * s)
    };
    half(0) + half(1)
}

/// `Σ c·q` over one sub-block.
fn code_dot(codes: &[u8; QK], a: &BlockQ8) -> i32 {
    codes.iter().zip(&a.qs).map(|(&c, &q)| c as i32 * q as i32).sum()
}

/// One affine sub-block's share of a dot: `(d·(sc·p) − dmin·(m·Σ)) · d_a`.
fn affine_term(d: f32, dmin: f32, sc: u8, m: u8, codes: &[u8; QK], a: &BlockQ8) -> f32 {
    let p = d * (sc as i32 * code_dot(codes, a)) as f32;
    let r = dmin * (m as i32 * a.sum) as f32;
    (p - r) * a.d
}

/// Eight interleaved super-block rows (one group of q4kx8, q5kx8 or q6kx8,
/// [`crate::quant::kx8`]; its length gives the row length) · one quantised
/// activation row (at least that long).
///
/// The operation order, which every SIMD kernel of these types keeps bit
/// for bit: per row `l` one accumulator, starting at +0, runs over the
/// columns in order and within each over its sub-blocks `j` in order. With
/// `a` the activation block of the sub-block and `d`, `dmin`, `sc[j]`,
/// `m[j]` row `l`'s header fields (d, dmin as f32):
///
/// - q4k, q5k: `p = Σᵢ c[i] · a.qs[i]` (i32, exact), `s = d · f32(sc[j])`,
///   `o = dmin · f32(m[j])` (the decoder's scale and offset: a value is
///   `s · c − o`), `u = a.d · f32(p)`, `t = s · u − o · (a.d · f32(a.sum))`;
/// - q6k: `n = sc[2j] · (p₀ − 32 · Σ₀) + sc[2j+1] · (p₁ − 32 · Σ₁)` (i32,
///   exact; `p₀`, `Σ₀` the code and activation sums over values 0..16, `p₁`,
///   `Σ₁` over 16..32, as the row type's), `u = a.d · f32(n)`, `t = d · u`;
/// - `acc = acc + t`.
///
/// Every integer is exact in i32 and converts to f32 exactly (at most 2²⁴),
/// and each f32 operation rounds on its own (no fused multiply-add), in the
/// order of the brackets. This is not the row-major dots' order (one lane
/// per sub-block, [`crate::quant::kquant`]): the interleaved forms are
/// types of their own, and within each the one-token and the several-token
/// kernels agree.
pub fn gemv8_kx8(kind: Kind, g: &[u8], a: &[BlockQ8]) -> [f32; ROWS] {
    let n = kx8::row_len(kind, g.len()).expect("whole groups of eight super-block rows");
    assert!(a.len() * QK >= n, "{kind:?}: {} activation blocks for rows of {n}", a.len());
    let h = |bits: u16| half::f16::from_bits(bits).to_f32();
    let (hb, sb) = (kx8::header_bytes(kind), kx8::sub_bytes(kind));
    let mut acc = [0f32; ROWS];
    for (b, (start, subs)) in kx8::columns(kind, n).enumerate() {
        let col = &g[start..start + hb + subs * sb];
        for (l, acc) in acc.iter_mut().enumerate() {
            let head = kx8::scales(kind, col, l);
            for j in 0..subs {
                let codes = kx8::codes(kind, &col[hb + j * sb..hb + (j + 1) * sb], l);
                let ba = &a[b * SUBS + j];
                if kind == Kind::Q6K {
                    let sc = [head.sc[2 * j] as i8, head.sc[2 * j + 1] as i8];
                    let u = ba.d * q6k_sub_sum(&codes, sc, ba) as f32;
                    *acc += h(head.d) * u;
                    continue;
                }
                let p: i32 = codes.iter().zip(&ba.qs).map(|(&c, &q)| c as i32 * q as i32).sum();
                let s = h(head.d) * head.sc[j] as f32;
                let u = ba.d * p as f32;
                *acc += s * u - h(head.dmin) * head.m[j] as f32 * ba.scaled_sum();
            }
        }
    }
    acc
}

// ------------------------------------------------------------------
// The gated delta rule's recurrent step.

/// One token of the gated delta rule for one head (the oracle of
/// [`super::DeltaFn`]; steps as in `kernels::delta`'s docs), in the order
/// transformers' recurrent form computes it: the state decays row by row
/// (`S' = S · d_i`, stored), `kv = S'ᵀ k`, `delta = (v − kv) · beta`,
/// `S = S' + k ⊗ delta`, `out = Sᵀ q`, by plain multiply and add. `kv`
/// sums over the key channels from the first, `out` from the last (the
/// SIMD tables' order, which there keeps the rows just read in L1); the
/// columns go in strips of 16 so the sums and deltas live on the stack,
/// not in a scratch buffer.
pub fn delta_step(s: &mut [f32], decay: &[f32], k: &[f32], v: &[f32], beta: f32, q: &[f32], out: &mut [f32]) {
    const W: usize = 16;
    let (dk, dv) = super::delta::check(s, decay, k, v, q, out);
    let ds = usize::from(decay.len() > 1);
    for j0 in (0..dv).step_by(W) {
        let w = W.min(dv - j0);
        let mut kv = [0f32; W];
        for i in 0..dk {
            let (d, ki) = (decay[i * ds], k[i]);
            for (x, a) in s[i * dv + j0..i * dv + j0 + w].iter_mut().zip(&mut kv) {
                *x *= d;
                *a += *x * ki;
            }
        }
        let mut delta = [0f32; W];
        for ((e, vj), a) in delta.iter_mut().zip(&v[j0..j0 + w]).zip(&kv) {
            *e = (vj - a) * beta;
        }
        let mut o = [0f32; W];
        for i in (0..dk).rev() {
            let (ki, qi) = (k[i], q[i]);
            for ((x, e), o) in s[i * dv + j0..i * dv + j0 + w].iter_mut().zip(&delta).zip(&mut o) {
                *x += ki * e;
                *o += *x * qi;
            }
        }
        out[j0..j0 + w].copy_from_slice(&o[..w]);
    }
}

/// The scalar Mamba2 step ([`super::SsmFn`]): per state row, in order,
/// `S[i] = S[i] · decay + (dt · b_i) · x` and `o += S[i] · c_i`, by plain
/// multiply and add (transformers' recurrent form); then `out = o + x · d`.
#[allow(clippy::too_many_arguments)]
pub fn ssm_step(s: &mut [f32], decay: f32, dt: f32, b: &[f32], x: &[f32], c: &[f32], d: f32, out: &mut [f32]) {
    let (_, p) = super::delta::ssm_check(s, b, x, c, out);
    out.fill(0.0);
    for (i, (&bi, &ci)) in b.iter().zip(c).enumerate() {
        let db = dt * bi;
        for ((sv, &xv), o) in s[i * p..(i + 1) * p].iter_mut().zip(x).zip(out.iter_mut()) {
            *sv = *sv * decay + db * xv;
            *o += *sv * ci;
        }
    }
    out.iter_mut().zip(x).for_each(|(o, &xv)| *o += xv * d);
}

// ------------------------------------------------------------------
// The scalar table: the same functions over raw row bytes, one entry per
// weight type. The other tables fall back to these entries by name.

use super::{DotFn, Gemv8Fn, GroupKernels, InputKind, KvKernels, Layout, TypeKernels};
use crate::quant::DType;

fn f32_row(row: &[u8], x: &[f32], _: &[BlockQ8]) -> f32 {
    dot_f32(bytemuck::cast_slice(row), x)
}
fn bf16_row(row: &[u8], x: &[f32], _: &[BlockQ8]) -> f32 {
    dot_bf16(bytemuck::cast_slice(row), x)
}
fn f16_row(row: &[u8], x: &[f32], _: &[BlockQ8]) -> f32 {
    dot_f16(bytemuck::cast_slice(row), x)
}
fn q8_0_row(row: &[u8], _: &[f32], q: &[BlockQ8]) -> f32 {
    dot_q8_0(bytemuck::cast_slice(row), q)
}
fn q4_0_row(row: &[u8], _: &[f32], q: &[BlockQ8]) -> f32 {
    dot_q4_0(bytemuck::cast_slice(row), q)
}
fn q4_1_row(row: &[u8], _: &[f32], q: &[BlockQ8]) -> f32 {
    dot_q4_1(bytemuck::cast_slice(row), q)
}
fn q4k_row(row: &[u8], _: &[f32], q: &[BlockQ8]) -> f32 {
    dot_q4k(row, q)
}
fn q5k_row(row: &[u8], _: &[f32], q: &[BlockQ8]) -> f32 {
    dot_q5k(row, q)
}
fn q6k_row(row: &[u8], _: &[f32], q: &[BlockQ8]) -> f32 {
    dot_q6k(row, q)
}
fn mxfp4_row(row: &[u8], _: &[f32], q: &[BlockQ8]) -> f32 {
    dot_mxfp4(bytemuck::cast_slice(row), q)
}
fn mxfp4x8_group(g: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    gemv8_mxfp4(bytemuck::cast_slice(g), q)
}
fn q8_0x8_group(g: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    gemv8_q8_0(bytemuck::cast_slice(g), q)
}
fn q4_0x8_group(g: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    gemv8_q4_0(bytemuck::cast_slice(g), q)
}
fn q4_1x8_group(g: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    gemv8_q4_1(bytemuck::cast_slice(g), q)
}
fn q4kx8_group(g: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    gemv8_kx8(Kind::Q4K, g, q)
}
fn q5kx8_group(g: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    gemv8_kx8(Kind::Q5K, g, q)
}
fn q6kx8_group(g: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    gemv8_kx8(Kind::Q6K, g, q)
}
/// One dot per (query, key).
fn dots_each<T: bytemuck::Pod>(
    k: &[u8],
    ks: usize,
    nk: usize,
    x: &[&[f32]],
    out: &mut [f32],
    os: usize,
    dot: fn(&[T], &[f32]) -> f32,
) {
    let k: &[T] = bytemuck::cast_slice(k);
    for (q, x) in x.iter().enumerate() {
        for j in 0..nk {
            out[q * os + j] = dot(&k[j * ks..j * ks + x.len()], x);
        }
    }
}
fn f32_dots(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
    dots_each::<f32>(k, ks, nk, x, out, os, dot_f32);
}
fn f16_dots(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
    dots_each::<u16>(k, ks, nk, x, out, os, dot_f16);
}
/// One axpy per output row.
fn axpys_each<T: bytemuck::Pod>(o: &mut [f32], a: &[f32], v: &[u8], axpy: fn(&mut [f32], f32, &[T])) {
    let v: &[T] = bytemuck::cast_slice(v);
    for (o, &a) in o.chunks_exact_mut(v.len().max(1)).zip(a) {
        axpy(o, a, v);
    }
}
fn f32_axpys(o: &mut [f32], a: &[f32], v: &[u8]) {
    axpys_each::<f32>(o, a, v, axpy_f32);
}
fn f16_axpys(o: &mut [f32], a: &[f32], v: &[u8]) {
    axpys_each::<u16>(o, a, v, axpy_f16);
}
/// The row's axpy per output row, key by key.
fn pv_by_axpy<T: bytemuck::Pod>(
    o: &mut [f32],
    p: &[f32],
    ps: usize,
    v: &[u8],
    vs: usize,
    nk: usize,
    axpy: fn(&mut [f32], f32, &[T]),
) {
    let v: &[T] = bytemuck::cast_slice(v);
    let n = p.len().div_ceil(ps.max(1));
    let len = o.len() / n.max(1);
    for j in 0..nk {
        for (i, o) in o.chunks_exact_mut(len.max(1)).enumerate() {
            axpy(o, p[i * ps + j], &v[j * vs..j * vs + len]);
        }
    }
}
fn f32_pv(o: &mut [f32], p: &[f32], ps: usize, v: &[u8], vs: usize, nk: usize) {
    pv_by_axpy::<f32>(o, p, ps, v, vs, nk, axpy_f32);
}
fn f16_pv(o: &mut [f32], p: &[f32], ps: usize, v: &[u8], vs: usize, nk: usize) {
    pv_by_axpy::<u16>(o, p, ps, v, vs, nk, axpy_f16);
}
const F32_KV: KvKernels = KvKernels { dots: f32_dots, axpys: f32_axpys, pv: f32_pv };
const F16_KV: KvKernels = KvKernels { dots: f16_dots, axpys: f16_axpys, pv: f16_pv };

/// The scalar kernels of `dtype`: one dot per row (no tiles) and one token
/// per group call.
pub(super) fn kernels(dtype: DType) -> TypeKernels {
    use InputKind::{F32, Q8};
    let rows = |input: InputKind, dot: DotFn| TypeKernels {
        input,
        layout: Layout::Rows { dot, tile: None, dots: None },
        kv: None,
    };
    let group = |one: Gemv8Fn| TypeKernels {
        input: Q8,
        layout: Layout::Groups(GroupKernels { one, many: None, tile: None, direct: None }),
        kv: None,
    };
    match dtype {
        DType::F32 => TypeKernels { kv: Some(F32_KV), ..rows(F32, f32_row) },
        DType::Bf16 => rows(F32, bf16_row),
        DType::F16 => TypeKernels { kv: Some(F16_KV), ..rows(F32, f16_row) },
        DType::Q8_0 => rows(Q8, q8_0_row),
        DType::Q4_0 => rows(Q8, q4_0_row),
        DType::Q4_1 => rows(Q8, q4_1_row),
        DType::Q8_0x8 => group(q8_0x8_group),
        DType::Q4_0x8 => group(q4_0x8_group),
        DType::Q4_1x8 => group(q4_1x8_group),
        DType::Mxfp4 => rows(Q8, mxfp4_row),
        DType::Mxfp4x8 => group(mxfp4x8_group),
        DType::Q4K => rows(Q8, q4k_row),
        DType::Q5K => rows(Q8, q5k_row),
        DType::Q6K => rows(Q8, q6k_row),
        DType::Q4Kx8 => group(q4kx8_group),
        DType::Q5Kx8 => group(q5kx8_group),
        DType::Q6Kx8 => group(q6kx8_group),
    }
}
