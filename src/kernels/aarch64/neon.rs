//! NEON dot products. Each `unsafe fn` requires NEON and reads its slices
//! with unaligned loads within the lengths it is given.
//!
//! The whole body of each `unsafe fn` here is the unsafe operation (raw
//! loads and `NEON` intrinsics), justified once by the function's
//! `# Safety` section rather than by one `unsafe {}` block per intrinsic.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::aarch64::*;

use crate::quant::act::BlockQ8;
use crate::quant::mxfp4::{LUT2, half_scale};
use crate::quant::q8_0::BlockQ8_0;
use crate::quant::x8::{BlockMxfp4x8, BlockQ4_0x8, BlockQ4_1x8, BlockQ8_0x8};

/// # Safety
/// NEON must be available; `row` holds `x.len()` f32 values.
#[target_feature(enable = "neon")]
pub unsafe fn dot_f32(row: &[u8], x: &[f32], _q: &[BlockQ8]) -> f32 {
    let n = x.len();
    debug_assert_eq!(row.len(), n * 4);
    let w = row.as_ptr() as *const f32;
    let mut a0 = vdupq_n_f32(0.0);
    let mut a1 = vdupq_n_f32(0.0);
    let mut i = 0;
    while i + 8 <= n {
        a0 = vfmaq_f32(a0, vld1q_f32(w.add(i)), vld1q_f32(x.as_ptr().add(i)));
        a1 = vfmaq_f32(a1, vld1q_f32(w.add(i + 4)), vld1q_f32(x.as_ptr().add(i + 4)));
        i += 8;
    }
    let mut s = vaddvq_f32(vaddq_f32(a0, a1));
    while i < n {
        s += w.add(i).read_unaligned() * x[i];
        i += 1;
    }
    s
}

/// # Safety
/// NEON must be available; `row` holds `x.len()` bf16 values.
#[target_feature(enable = "neon")]
pub unsafe fn dot_bf16(row: &[u8], x: &[f32], _q: &[BlockQ8]) -> f32 {
    let n = x.len();
    debug_assert_eq!(row.len(), n * 2);
    let w = row.as_ptr() as *const u16;
    let mut a0 = vdupq_n_f32(0.0);
    let mut a1 = vdupq_n_f32(0.0);
    let mut i = 0;
    while i + 8 <= n {
        let h = vld1q_u16(w.add(i));
        let lo = vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h)));
        let hi = vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(h)));
        a0 = vfmaq_f32(a0, lo, vld1q_f32(x.as_ptr().add(i)));
        a1 = vfmaq_f32(a1, hi, vld1q_f32(x.as_ptr().add(i + 4)));
        i += 8;
    }
    let mut s = vaddvq_f32(vaddq_f32(a0, a1));
    while i < n {
        s += f32::from_bits((w.add(i).read_unaligned() as u32) << 16) * x[i];
        i += 1;
    }
    s
}

/// # Safety
/// NEON must be available; `row` holds whole q8_0 blocks and `q` at least as many.
#[target_feature(enable = "neon")]
pub unsafe fn dot_q8_0(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    let nb = row.len() / std::mem::size_of::<BlockQ8_0>();
    debug_assert!(q.len() >= nb);
    let w = row.as_ptr() as *const BlockQ8_0;
    let mut acc = vdupq_n_f32(0.0);
    for (i, ba) in q[..nb].iter().enumerate() {
        let bw = &*w.add(i);
        let x0 = vld1q_s8(bw.qs.as_ptr());
        let x1 = vld1q_s8(bw.qs.as_ptr().add(16));
        let y0 = vld1q_s8(ba.qs.as_ptr());
        let y1 = vld1q_s8(ba.qs.as_ptr().add(16));
        // Widening multiplies into i16, pairwise accumulate into i32.
        let mut s = vdupq_n_s32(0);
        s = vpadalq_s16(s, vmull_s8(vget_low_s8(x0), vget_low_s8(y0)));
        s = vpadalq_s16(s, vmull_s8(vget_high_s8(x0), vget_high_s8(y0)));
        s = vpadalq_s16(s, vmull_s8(vget_low_s8(x1), vget_low_s8(y1)));
        s = vpadalq_s16(s, vmull_s8(vget_high_s8(x1), vget_high_s8(y1)));
        let d = half::f16::from_bits(bw.d).to_f32() * ba.d;
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), d);
    }
    vaddvq_f32(acc)
}

// ------------------------------------------------------------------
// Eight interleaved rows (see `crate::quant::x8`). A 16-byte half of each
// 32-byte run holds four consecutive values of four rows; widening multiplies
// against the four activation bytes repeated give each row's products in
// neighbouring 16-bit lanes, pairwise accumulation folds them per row.

/// The eight f16 scales times the activation scale, as rows 0..4 and 4..8.
#[inline(always)]
unsafe fn scales8(d: &[u16; 8], da: f32) -> (float32x4_t, float32x4_t) {
    let f: [f32; 8] = std::array::from_fn(|l| half::f16::from_bits(d[l]).to_f32() * da);
    (vld1q_f32(f.as_ptr()), vld1q_f32(f.as_ptr().add(4)))
}

/// Σ over one group block of weight · activation per row (rows 0..4, 4..8),
/// with `w(k)` giving the values of column quad `k` (0..8) for rows 0..4 and
/// 4..8 as signed bytes.
#[inline(always)]
unsafe fn group_sums(ba: &BlockQ8, w: impl Fn(usize) -> (int8x16_t, int8x16_t)) -> (int32x4_t, int32x4_t) {
    quad_sums(ba, 0..8, w)
}

/// [`group_sums`] over column quads `quads` only.
#[inline(always)]
unsafe fn quad_sums(
    ba: &BlockQ8,
    quads: std::ops::Range<usize>,
    w: impl Fn(usize) -> (int8x16_t, int8x16_t),
) -> (int32x4_t, int32x4_t) {
    let mut s = [vdupq_n_s32(0); 4];
    for k in quads {
        let a = vreinterpretq_s8_s32(vdupq_n_s32((ba.qs.as_ptr().add(4 * k) as *const i32).read_unaligned()));
        let (w0, w1) = w(k);
        s[0] = vpadalq_s16(s[0], vmull_s8(vget_low_s8(w0), vget_low_s8(a)));
        s[1] = vpadalq_s16(s[1], vmull_high_s8(w0, a));
        s[2] = vpadalq_s16(s[2], vmull_s8(vget_low_s8(w1), vget_low_s8(a)));
        s[3] = vpadalq_s16(s[3], vmull_high_s8(w1, a));
    }
    // Each row's two 32-bit partial sums are neighbours: fold them.
    (vpaddq_s32(s[0], s[1]), vpaddq_s32(s[2], s[3]))
}

/// [`group_sums`] over column quads `4h..4h + 4` only (`h` 0 or 1: values
/// 0..16 or 16..32 of the block).
#[inline(always)]
unsafe fn half_sums(ba: &BlockQ8, h: usize, w: impl Fn(usize) -> (int8x16_t, int8x16_t)) -> (int32x4_t, int32x4_t) {
    quad_sums(ba, 4 * h..4 * h + 4, w)
}

#[inline(always)]
unsafe fn store8(a: float32x4_t, b: float32x4_t) -> [f32; 8] {
    let mut out = [0f32; 8];
    vst1q_f32(out.as_mut_ptr(), a);
    vst1q_f32(out.as_mut_ptr().add(4), b);
    out
}

/// # Safety
/// NEON must be available; `group` holds whole q8_0x8 blocks and `q` at least as many.
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_q8_0(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    let nb = group.len() / std::mem::size_of::<BlockQ8_0x8>();
    debug_assert!(q.len() >= nb);
    let g = group.as_ptr() as *const BlockQ8_0x8;
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (b, ba) in q[..nb].iter().enumerate() {
        let bw = &*g.add(b);
        let p = bw.qs.as_ptr();
        let (r0, r1) = group_sums(ba, |k| (vld1q_s8(p.add(32 * k)), vld1q_s8(p.add(32 * k + 16))));
        let (d0, d1) = scales8(&bw.d, ba.d);
        acc0 = vfmaq_f32(acc0, d0, vcvtq_f32_s32(r0));
        acc1 = vfmaq_f32(acc1, d1, vcvtq_f32_s32(r1));
    }
    store8(acc0, acc1)
}

/// Codes of column quad `k` of a 4-bit group block: low nibbles of run `k`
/// for `k < 4`, high nibbles of run `k - 4` after.
#[inline(always)]
unsafe fn nibbles(p: *const u8, k: usize) -> (int8x16_t, int8x16_t) {
    let j = k % 4;
    let (r0, r1) = (vld1q_u8(p.add(32 * j)), vld1q_u8(p.add(32 * j + 16)));
    let (c0, c1) = if k < 4 {
        (vandq_u8(r0, vdupq_n_u8(0x0F)), vandq_u8(r1, vdupq_n_u8(0x0F)))
    } else {
        (vshrq_n_u8::<4>(r0), vshrq_n_u8::<4>(r1))
    };
    (vreinterpretq_s8_u8(c0), vreinterpretq_s8_u8(c1))
}

/// # Safety
/// NEON must be available; `group` holds whole q4_0x8 blocks and `q` at least as many.
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_q4_0(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    let nb = group.len() / std::mem::size_of::<BlockQ4_0x8>();
    debug_assert!(q.len() >= nb);
    let g = group.as_ptr() as *const BlockQ4_0x8;
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (b, ba) in q[..nb].iter().enumerate() {
        let bw = &*g.add(b);
        let p = bw.qs.as_ptr();
        let (r0, r1) = group_sums(ba, |k| nibbles(p, k));
        // Codes are stored +8: Σ (c - 8)·q = Σ c·q - 8·Σq.
        let off = vdupq_n_s32(8 * ba.sum);
        let (d0, d1) = scales8(&bw.d, ba.d);
        acc0 = vfmaq_f32(acc0, d0, vcvtq_f32_s32(vsubq_s32(r0, off)));
        acc1 = vfmaq_f32(acc1, d1, vcvtq_f32_s32(vsubq_s32(r1, off)));
    }
    store8(acc0, acc1)
}

/// # Safety
/// NEON must be available; `group` holds whole q4_1x8 blocks and `q` at least as many.
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_q4_1(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    let nb = group.len() / std::mem::size_of::<BlockQ4_1x8>();
    debug_assert!(q.len() >= nb);
    let g = group.as_ptr() as *const BlockQ4_1x8;
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (b, ba) in q[..nb].iter().enumerate() {
        let bw = &*g.add(b);
        let p = bw.qs.as_ptr();
        let (r0, r1) = group_sums(ba, |k| nibbles(p, k));
        let (d0, d1) = scales8(&bw.d, ba.d);
        let (m0, m1) = scales8(&bw.m, 1.0);
        let s = ba.scaled_sum();
        acc0 = vfmaq_n_f32(vfmaq_f32(acc0, d0, vcvtq_f32_s32(r0)), m0, s);
        acc1 = vfmaq_n_f32(vfmaq_f32(acc1, d1, vcvtq_f32_s32(r1)), m1, s);
    }
    store8(acc0, acc1)
}

/// # Safety
/// NEON must be available; `group` holds whole mxfp4x8 blocks and `q` at least as many.
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_mxfp4(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    let nb = group.len() / std::mem::size_of::<BlockMxfp4x8>();
    debug_assert!(q.len() >= nb);
    let g = group.as_ptr() as *const BlockMxfp4x8;
    // Codes → doubled E2M1 values by a table lookup.
    let lut = vld1q_s8(LUT2.as_ptr());
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (b, ba) in q[..nb].iter().enumerate() {
        let bw = &*g.add(b);
        let p = bw.qs.as_ptr();
        let (r0, r1) = group_sums(ba, |k| {
            let (c0, c1) = nibbles(p, k);
            (vqtbl1q_s8(lut, vreinterpretq_u8_s8(c0)), vqtbl1q_s8(lut, vreinterpretq_u8_s8(c1)))
        });
        let f: [f32; 8] = std::array::from_fn(|l| half_scale(bw.e[l]) * ba.d);
        let (d0, d1) = (vld1q_f32(f.as_ptr()), vld1q_f32(f.as_ptr().add(4)));
        acc0 = vfmaq_f32(acc0, d0, vcvtq_f32_s32(r0));
        acc1 = vfmaq_f32(acc1, d1, vcvtq_f32_s32(r1));
    }
    store8(acc0, acc1)
}

/// `Σ c·q` of one sub-block: 32 codes below 128 (so they read as i8) times
/// 32 activation codes, widened to i16 products and summed in i32 (exact).
#[inline(always)]
unsafe fn sub_dot(lo: uint8x16_t, hi: uint8x16_t, a: &BlockQ8) -> i32 {
    let q0 = vld1q_s8(a.qs.as_ptr());
    let q1 = vld1q_s8(a.qs.as_ptr().add(16));
    let (c0, c1) = (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi));
    let mut acc = vdupq_n_s32(0);
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(c0), vget_low_s8(q0)));
    acc = vpadalq_s16(acc, vmull_high_s8(c0, q0));
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(c1), vget_low_s8(q1)));
    acc = vpadalq_s16(acc, vmull_high_s8(c1, q1));
    vaddvq_s32(acc)
}

/// `n = sc₀ · (p₀ − 32·Σ₀) + sc₁ · (p₁ − 32·Σ₁)` of one q6k sub-block with
/// codes `lo` (values 0..16) and `hi` (16..32), exact (`quant::kquant`).
#[inline(always)]
unsafe fn q6k_sub_sum(lo: uint8x16_t, hi: uint8x16_t, sc: [i8; 2], a: &BlockQ8) -> i32 {
    let half = |c: uint8x16_t, at: usize| {
        let q = vld1q_s8(a.qs.as_ptr().add(at));
        let c = vreinterpretq_s8_u8(c);
        let p = vpaddlq_s16(vmull_s8(vget_low_s8(c), vget_low_s8(q)));
        let p = vaddvq_s32(vpadalq_s16(p, vmull_high_s8(c, q)));
        p - 32 * vaddlvq_s8(q) as i32
    };
    sc[0] as i32 * half(lo, 0) + sc[1] as i32 * half(hi, 16)
}

/// Codes 0..16 and 16..32 of a sub-block's 16 nibble bytes (as q4_0).
#[inline(always)]
unsafe fn nibble_codes(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    let raw = vld1q_u8(p);
    (vandq_u8(raw, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(raw))
}

/// A q4k / q5k row in the order of `quant::kquant`'s scalar dot: the
/// integer sums here, the scale arithmetic as written there (one rounding
/// per operation), lane `j` accumulating sub-block `j`.
#[inline(always)]
unsafe fn affine_row(
    kind: crate::quant::kquant::Kind,
    row: &[u8],
    q: &[BlockQ8],
    codes: impl Fn(*const u8) -> (uint8x16_t, uint8x16_t),
) -> f32 {
    use crate::quant::kquant::{SUBS, unpack_scales};
    let (hb, sb, bb) = (kind.header_bytes(), kind.sub_bytes(), kind.block_bytes());
    let mut acc = [0f32; SUBS];
    let mut base = row.as_ptr();
    for a in q.chunks(SUBS) {
        let d = half::f16::from_bits(u16::from_le_bytes([*base, *base.add(1)])).to_f32();
        let dmin = half::f16::from_bits(u16::from_le_bytes([*base.add(2), *base.add(3)])).to_f32();
        let (sc, m) = unpack_scales(&*(base.add(4) as *const [u8; 12]));
        for (j, a) in a.iter().enumerate() {
            let (lo, hi) = codes(base.add(hb + j * sb));
            let p = d * (sc[j] as i32 * sub_dot(lo, hi, a)) as f32;
            let r = dmin * (m[j] as i32 * a.sum) as f32;
            acc[j] += (p - r) * a.d;
        }
        base = base.add(bb);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// # Safety
/// NEON must be available; `row` must be a q4k row of `q.len() · 32` values.
#[target_feature(enable = "neon")]
pub unsafe fn dot_q4k(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    debug_assert_eq!(Some(row.len()), crate::quant::kquant::row_bytes(crate::quant::kquant::Kind::Q4K, q.len() * 32));
    affine_row(crate::quant::kquant::Kind::Q4K, row, q, |p| nibble_codes(p))
}

/// # Safety
/// As [`dot_q4k`], for a q5k row.
#[target_feature(enable = "neon")]
pub unsafe fn dot_q5k(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    debug_assert_eq!(Some(row.len()), crate::quant::kquant::row_bytes(crate::quant::kquant::Kind::Q5K, q.len() * 32));
    // Bit i of the u32 after the nibbles is bit 4 of code i.
    let bits: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let bits = vld1q_u8(bits.as_ptr());
    affine_row(crate::quant::kquant::Kind::Q5K, row, q, |p| {
        let (lo, hi) = nibble_codes(p);
        let h = p.add(16);
        let fifth = |b0: u8, b1: u8| {
            let v = vcombine_u8(vdup_n_u8(b0), vdup_n_u8(b1));
            vandq_u8(vtstq_u8(v, bits), vdupq_n_u8(0x10))
        };
        (vorrq_u8(lo, fifth(*h, *h.add(1))), vorrq_u8(hi, fifth(*h.add(2), *h.add(3))))
    })
}

/// # Safety
/// As [`dot_q4k`], for a q6k row.
#[target_feature(enable = "neon")]
pub unsafe fn dot_q6k(row: &[u8], _x: &[f32], q: &[BlockQ8]) -> f32 {
    use crate::quant::kquant::{Kind, SUBS};
    let kind = Kind::Q6K;
    debug_assert_eq!(Some(row.len()), crate::quant::kquant::row_bytes(kind, q.len() * 32));
    let (hb, sb, bb) = (kind.header_bytes(), kind.sub_bytes(), kind.block_bytes());
    let three = vdup_n_u8(3);
    let mut acc = [0f32; SUBS];
    let mut base = row.as_ptr();
    for a in q.chunks(SUBS) {
        let d = half::f16::from_bits(u16::from_le_bytes([*base, *base.add(1)])).to_f32();
        for (j, a) in a.iter().enumerate() {
            let s = base.add(hb + j * sb);
            let (lo, hi) = nibble_codes(s);
            // Byte i of the 8 top-bit bytes: bits 2k..2k+1 = bits 4-5 of code i + 8k.
            let t = vld1_u8(s.add(16));
            let t0 = vand_u8(t, three);
            let t1 = vand_u8(vshr_n_u8::<2>(t), three);
            let t2 = vand_u8(vshr_n_u8::<4>(t), three);
            let t3 = vshr_n_u8::<6>(t);
            let lo = vorrq_u8(lo, vshlq_n_u8::<4>(vcombine_u8(t0, t1)));
            let hi = vorrq_u8(hi, vshlq_n_u8::<4>(vcombine_u8(t2, t3)));
            let sc = [*base.add(2 + 2 * j) as i8, *base.add(3 + 2 * j) as i8];
            acc[j] += d * q6k_sub_sum(lo, hi, sc, a) as f32 * a.d;
        }
        base = base.add(bb);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Column quad `k` of one interleaved super-block sub-block (`crate::quant::kx8`)
/// for rows 0..4 and 4..8: the nibbles as [`nibbles`] reads them, completed
/// by q5k's fifth bits or q6k's top bits. `e0`, `e1` are the sub-block's
/// extra-bit bytes (q5k: 32 bytes of fifth bits; q6k: the top bits of codes
/// 0..16 and 16..32), one 4-byte word per row. Bit `r` (q5k) or bits `2r`,
/// `2r+1` (q6k) of a row's byte `k'` belong to its code `4r + k'` (and bit
/// `4 + r` / the second word to code `16 + 4r + k'`); moving them to bit 4
/// (bits 4-5) is a per-byte shift and mask, exact.
#[inline(always)]
unsafe fn kx8_quad(
    kind: crate::quant::kquant::Kind,
    sub: *const u8,
    k: usize,
    e0: (uint8x16_t, uint8x16_t),
    e1: (uint8x16_t, uint8x16_t),
) -> (int8x16_t, int8x16_t) {
    use crate::quant::kquant::Kind;
    let (c0, c1) = nibbles(sub, k);
    let (c0, c1) = (vreinterpretq_u8_s8(c0), vreinterpretq_u8_s8(c1));
    let r = (k % 4) as i8;
    let (extra, by, mask) = match (kind, k < 4) {
        (Kind::Q4K, _) => return (vreinterpretq_s8_u8(c0), vreinterpretq_s8_u8(c1)),
        (Kind::Q5K, true) => (e0, 4 - r, 0x10),
        (Kind::Q5K, false) => (e0, -r, 0x10),
        (Kind::Q6K, true) => (e0, 4 - 2 * r, 0x30),
        (Kind::Q6K, false) => (e1, 4 - 2 * r, 0x30),
    };
    let (shift, mask) = (vdupq_n_s8(by), vdupq_n_u8(mask));
    let x0 = vandq_u8(vshlq_u8(extra.0, shift), mask);
    let x1 = vandq_u8(vshlq_u8(extra.1, shift), mask);
    (vreinterpretq_s8_u8(vorrq_u8(c0, x0)), vreinterpretq_s8_u8(vorrq_u8(c1, x1)))
}

/// A group of eight interleaved super-block rows against one token, bit for
/// bit [`crate::kernels::scalar::gemv8_kx8`]: the integer sums of a
/// sub-block per row (exact), then per row the scalar kernel's operations
/// in its order, each rounded on its own (`s = d · sc`, `u = d_a · p`,
/// `s · u − (dmin · m) · (d_a · Σ)`, `acc + term`; q6k: the integer `n` of
/// the two halves, `u = d_a · n`, `acc + d · u`; no fused multiply-add).
#[inline(always)]
unsafe fn gemv8_kx8(kind: crate::quant::kquant::Kind, g: &[u8], a: &[BlockQ8]) -> [f32; 8] {
    use crate::quant::kquant::{Kind, QK, SUBS};
    use crate::quant::kx8;
    let n = kx8::row_len(kind, g.len()).expect("whole groups of eight super-block rows");
    assert!(a.len() * QK >= n, "{kind:?}: {} activation blocks for rows of {n}", a.len());
    let (hb, sb) = (kx8::header_bytes(kind), kx8::sub_bytes(kind));
    let h = |bits: u16| half::f16::from_bits(bits).to_f32();
    let pair = |v: [f32; 8]| (vld1q_f32(v.as_ptr()), vld1q_f32(v.as_ptr().add(4)));
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    for (b, (start, subs)) in kx8::columns(kind, n).enumerate() {
        let col = &g[start..start + hb + subs * sb];
        let heads: [kx8::RowScales; 8] = std::array::from_fn(|l| kx8::scales(kind, col, l));
        for j in 0..subs {
            let sub = col.as_ptr().add(hb + j * sb);
            let words = |at: usize| (vld1q_u8(sub.add(at)), vld1q_u8(sub.add(at + 16)));
            let zero = (vdupq_n_u8(0), vdupq_n_u8(0));
            let (e0, e1) = match kind {
                Kind::Q4K => (zero, zero),
                Kind::Q5K => (words(128), zero),
                Kind::Q6K => (words(128), words(160)),
            };
            let ba = &a[b * SUBS + j];
            let da = vdupq_n_f32(ba.d);
            if kind == Kind::Q6K {
                let w = |k| kx8_quad(kind, sub, k, e0, e1);
                let (l, hh) = (half_sums(ba, 0, w), half_sums(ba, 1, w));
                let low = vaddlvq_s8(vld1q_s8(ba.qs.as_ptr())) as i32;
                let (c0, c1) = (vdupq_n_s32(32 * low), vdupq_n_s32(32 * (ba.sum - low)));
                let sc = |x: usize, r: usize| vld1q_s32([0, 1, 2, 3].map(|i| heads[r + i].sc[2 * j + x]).as_ptr());
                let n = |r: usize, l: int32x4_t, hh: int32x4_t| {
                    vaddq_s32(vmulq_s32(sc(0, r), vsubq_s32(l, c0)), vmulq_s32(sc(1, r), vsubq_s32(hh, c1)))
                };
                let (n0, n1) = (n(0, l.0, hh.0), n(4, l.1, hh.1));
                let d = pair(std::array::from_fn(|r| h(heads[r].d)));
                let (u0, u1) = (vmulq_f32(da, vcvtq_f32_s32(n0)), vmulq_f32(da, vcvtq_f32_s32(n1)));
                (acc0, acc1) = (vaddq_f32(acc0, vmulq_f32(d.0, u0)), vaddq_f32(acc1, vmulq_f32(d.1, u1)));
                continue;
            }
            let s = pair(std::array::from_fn(|l| h(heads[l].d) * heads[l].sc[j] as f32));
            let (p0, p1) = group_sums(ba, |k| kx8_quad(kind, sub, k, e0, e1));
            let (u0, u1) = (vmulq_f32(da, vcvtq_f32_s32(p0)), vmulq_f32(da, vcvtq_f32_s32(p1)));
            let o = pair(std::array::from_fn(|l| h(heads[l].dmin) * heads[l].m[j] as f32));
            let ss = vdupq_n_f32(ba.scaled_sum());
            let t0 = vsubq_f32(vmulq_f32(s.0, u0), vmulq_f32(o.0, ss));
            let t1 = vsubq_f32(vmulq_f32(s.1, u1), vmulq_f32(o.1, ss));
            (acc0, acc1) = (vaddq_f32(acc0, t0), vaddq_f32(acc1, t1));
        }
    }
    store8(acc0, acc1)
}

/// # Safety
/// NEON must be available (the lengths are checked here).
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_q4k(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    gemv8_kx8(crate::quant::kquant::Kind::Q4K, group, q)
}

/// # Safety
/// As [`gemv8_q4k`], for q5kx8.
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_q5k(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    gemv8_kx8(crate::quant::kquant::Kind::Q5K, group, q)
}

/// # Safety
/// As [`gemv8_q4k`], for q6kx8.
#[target_feature(enable = "neon")]
pub unsafe fn gemv8_q6k(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
    gemv8_kx8(crate::quant::kquant::Kind::Q6K, group, q)
}
