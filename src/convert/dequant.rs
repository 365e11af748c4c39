//! Decoding of the pre-quantised formats found in Hugging Face checkpoints.
//!
//! - FP8 E4M3 with block scales (DeepSeek-V3 style `weight` +
//!   `weight_scale_inv`): [`e4m3_to_f32`], [`dequant_fp8_block`].
//! - MXFP4 (GPT-OSS `*_blocks` + `*_scales`): [`FP4_E2M1`], [`e8m0_scale`],
//!   [`dequant_mxfp4`].
//! - compressed-tensors `pack-quantized` symmetric int4 with one scale per
//!   32 values (Kimi-K2 `weight_packed` + `weight_scale`): [`int4_codes`],
//!   [`dequant_int4`], and [`int4_to_q4_0`], which moves a group into a
//!   q4_0 block without rounding when its scale is an f16.
//!
//! Besides that last one, only decoding lives here: the caller checks the
//! shapes and then turns the codes into f32, which the normal conversion
//! path encodes again.

use half::f16;

use crate::quant::q4_0::{self, BlockQ4_0};

/// OCP FP8 E4M3 code → value, for all 256 codes, built at compile time.
static E4M3: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut b = 0;
    while b < 256 {
        let sign = (b as u32 >> 7) << 31;
        let exp = (b as u32 >> 3) & 0xF;
        let man = b as u32 & 0x7;
        table[b] = if exp == 0xF && man == 0x7 {
            f32::NAN
        } else if exp == 0 {
            // Subnormal: man/8 * 2^-6 = man * 2^-9 (exact in f32).
            let v = man as f32 / 512.0;
            if sign != 0 { -v } else { v }
        } else {
            // Normal: rebias the exponent from 7 to 127, widen the mantissa.
            f32::from_bits(sign | (exp + 127 - 7) << 23 | man << 20)
        };
        b += 1;
    }
    table
}

/// Decodes one OCP FP8 E4M3 byte (the `F8_E4M3` safetensors dtype,
/// `torch.float8_e4m3fn`): 1 sign bit, 4 exponent bits with bias 7, 3
/// mantissa bits, subnormals when the exponent is 0, no infinities, and
/// NaN for 0x7F and 0xFF. Every finite value is exact in f32 (largest 448).
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3[b as usize]
}

/// Dequantises a row-major `rows × cols` matrix of E4M3 `codes` with one
/// scale per `block[0] × block[1]` tile:
/// `out[r*cols + c] = e4m3(codes[r*cols + c]) * scale_inv[(r / block[0]) *
/// ceil(cols / block[1]) + c / block[1]]`.
///
/// `scale_inv` is row-major over the tile grid (`ceil(rows / block[0])` ×
/// `ceil(cols / block[1])`); tiles at the bottom and right edges may be
/// partial. Despite the checkpoint's name (`weight_scale_inv`), the scale is
/// multiplied in. The caller validates the shapes; they are only
/// debug-asserted here.
pub fn dequant_fp8_block(
    codes: &[u8],
    rows: usize,
    cols: usize,
    scale_inv: &[f32],
    block: [usize; 2],
    out: &mut [f32],
) {
    let [br, bc] = block;
    debug_assert!(br > 0 && bc > 0, "empty FP8 scale block {block:?}");
    let tiles_per_row = cols.div_ceil(bc);
    debug_assert_eq!(codes.len(), rows * cols);
    debug_assert_eq!(out.len(), rows * cols);
    debug_assert_eq!(scale_inv.len(), rows.div_ceil(br) * tiles_per_row);
    if rows == 0 || cols == 0 {
        return;
    }
    for (r, (out_row, code_row)) in out.chunks_exact_mut(cols).zip(codes.chunks_exact(cols)).enumerate() {
        let row_scales = &scale_inv[(r / br) * tiles_per_row..][..tiles_per_row];
        for ((o, c), &s) in out_row.chunks_mut(bc).zip(code_row.chunks(bc)).zip(row_scales) {
            for (o, &c) in o.iter_mut().zip(c) {
                *o = e4m3_to_f32(c) * s;
            }
        }
    }
}

/// FP4 E2M1 values indexed by the 4-bit code: 1 sign bit (bit 3), 2
/// exponent bits with bias 1, 1 mantissa bit. Codes 0..8 are 0, 0.5, 1,
/// 1.5, 2, 3, 4, 6; codes 8..16 are the same negated (code 8 is -0.0).
pub const FP4_E2M1: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Decodes an E8M0 scale byte (OCP MX): `2^(b - 127)`, exact, including
/// `b = 0` → 2^-127 (an f32 subnormal). Returns `None` for 255, the NaN code.
#[inline]
pub fn e8m0_scale(b: u8) -> Option<f32> {
    match b {
        255 => None,
        // 2^-127 is below f32's normal range: the top mantissa bit alone.
        0 => Some(f32::from_bits(1 << 22)),
        // A biased exponent of `b` with a zero mantissa is 2^(b-127).
        _ => Some(f32::from_bits(u32::from(b) << 23)),
    }
}

/// Dequantises MXFP4 in the GPT-OSS Hub layout: one E8M0 byte in `scales`
/// per 32 values, and 16 bytes in `blocks` per 32 values, two E2M1 codes
/// per byte. Within a byte the **low nibble is the even element** and the
/// high nibble the odd one: `out[32*i + 2*j] = FP4_E2M1[blocks[16*i + j] &
/// 0xF] * 2^(scales[i] - 127)` and `out[32*i + 2*j + 1]` takes `>> 4`. This
/// is the order of `convert_moe_packed_tensors` in Hugging Face
/// transformers' `integrations/mxfp4.py` (`sub[:, 0::2] = lut[blk & 0x0F]`,
/// `sub[:, 1::2] = lut[blk >> 4]`). `out` is in the storage order of
/// `blocks`; transformers transposes the last two axes of the result
/// afterwards, which is the caller's business.
///
/// `out.len()` must be `32 * scales.len()` and `blocks.len()`
/// `16 * scales.len()` (debug-asserted). Returns `Err(i)` for the first
/// `scales[i]` equal to 255 (NaN), leaving `out` untouched. Values past
/// f32's range (6 × 2^127) become infinite.
pub fn dequant_mxfp4(blocks: &[u8], scales: &[u8], out: &mut [f32]) -> Result<(), usize> {
    debug_assert_eq!(blocks.len(), 16 * scales.len());
    debug_assert_eq!(out.len(), 32 * scales.len());
    if let Some(i) = scales.iter().position(|&s| s == 255) {
        return Err(i);
    }
    for ((o, blk), &s) in out.chunks_exact_mut(32).zip(blocks.chunks_exact(16)).zip(scales) {
        let Some(scale) = e8m0_scale(s) else { unreachable!("NaN scales were rejected above") };
        for (pair, &byte) in o.chunks_exact_mut(2).zip(blk) {
            pair[0] = FP4_E2M1[usize::from(byte & 0xF)] * scale;
            pair[1] = FP4_E2M1[usize::from(byte >> 4)] * scale;
        }
    }
    Ok(())
}

/// Values per int4 group (compressed-tensors `group_size`; one scale each).
pub const INT4_GROUP: usize = 32;

/// The 32 stored nibbles of one int4 group: `packed` is the group's 16 bytes
/// of `weight_packed` (four little-endian int32 words, eight values each,
/// the first value in the lowest bits), so value `2j` is the low nibble of
/// byte `j` and value `2j + 1` the high one. compressed-tensors stores the
/// signed code `q` (-8..=7) as the nibble `q + 8` (its `pack_to_int32` adds
/// `1 << (num_bits - 1)` before packing), which is q4_0's code for the same
/// `q`: a nibble is returned as stored.
#[inline]
pub fn int4_codes(packed: &[u8]) -> [u8; INT4_GROUP] {
    debug_assert_eq!(packed.len(), INT4_GROUP / 2);
    let mut c = [0u8; INT4_GROUP];
    for (pair, &b) in c.chunks_exact_mut(2).zip(packed) {
        pair[0] = b & 0xF;
        pair[1] = b >> 4;
    }
    c
}

/// Dequantises int4 groups: `out[32·g + k] = (code − 8) · scales[g]`, the
/// codes of group `g` from `packed[16·g..16·g + 16]` ([`int4_codes`]). The
/// product is exact in f32 (a 4-bit code times a bf16 or f16 scale).
/// compressed-tensors itself multiplies in the scale's type (bf16), which
/// rounds some products; colibri keeps the exact value.
pub fn dequant_int4(packed: &[u8], scales: &[f32], out: &mut [f32]) {
    debug_assert_eq!(packed.len(), scales.len() * INT4_GROUP / 2);
    debug_assert_eq!(out.len(), scales.len() * INT4_GROUP);
    for ((o, p), &s) in out.chunks_exact_mut(INT4_GROUP).zip(packed.chunks_exact(INT4_GROUP / 2)).zip(scales) {
        for (o, c) in o.iter_mut().zip(int4_codes(p)) {
            *o = (i32::from(c) - 8) as f32 * s;
        }
    }
}

/// How an int4 group's scale fits q4_0's f16 scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleFit {
    /// The scale is an f16 value (zero and f16 subnormals included): the
    /// group is a q4_0 block as it stands.
    Exact,
    /// Within f16's range but not one of its values (more precision than
    /// f16 keeps, or below its smallest subnormal): the group is
    /// requantised from its exact values.
    Inexact,
    /// Beyond f16's largest value: no q4_0 block holds the group.
    Overflow,
    /// NaN or infinite.
    NotFinite,
}

/// Classifies one scale ([`ScaleFit`]).
pub fn scale_fit(s: f32) -> ScaleFit {
    if !s.is_finite() {
        return ScaleFit::NotFinite;
    }
    let h = f16::from_f32(s);
    if h.is_infinite() {
        ScaleFit::Overflow
    } else if h.to_f32() == s {
        ScaleFit::Exact
    } else {
        ScaleFit::Inexact
    }
}

/// One int4 group as a q4_0 block. With an [`ScaleFit::Exact`] scale the
/// block is `d = scale` and the stored nibbles (q4_0 keeps value `j` and
/// `j + 16` in byte `j`, so only their places change): the same 32 values,
/// no rounding. Otherwise the group's exact values are quantised as any f32
/// source is ([`q4_0::quantize`]), so the result equals converting a
/// dequantised copy of the checkpoint; an overflowing scale is the caller's
/// to avoid (q4_0 cannot hold it).
pub fn int4_to_q4_0(packed: &[u8], scale: f32) -> BlockQ4_0 {
    let c = int4_codes(packed);
    if scale_fit(scale) == ScaleFit::Exact {
        let mut b = BlockQ4_0 { d: f16::from_f32(scale).to_bits(), qs: [0; 16] };
        for (j, q) in b.qs.iter_mut().enumerate() {
            *q = c[j] | (c[j + 16] << 4);
        }
        return b;
    }
    let mut v = [0f32; INT4_GROUP];
    dequant_int4(packed, &[scale], &mut v);
    let mut b = [BlockQ4_0 { d: 0, qs: [0; 16] }];
    q4_0::quantize(&v, &mut b);
    b[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::exp2i;

    /// compressed-tensors' packing written out the slow way: value `i` of a
    /// row goes to int32 word `i / 8` at bit `4·(i % 8)` as `q + 8`, and the
    /// words are stored little-endian.
    fn pack_int4(q: &[i8]) -> Vec<u8> {
        let mut words = vec![0u32; q.len().div_ceil(8)];
        for (i, &v) in q.iter().enumerate() {
            assert!((-8..=7).contains(&v));
            words[i / 8] |= ((v as i32 + 8) as u32) << (4 * (i % 8));
        }
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn codes_of(i: usize) -> Vec<i8> {
        (0..32).map(|k| ((k * 7 + i * 3) % 16) as i8 - 8).collect()
    }

    #[test]
    fn int4_nibbles_unpack_in_element_order() {
        for i in 0..4 {
            let q = codes_of(i);
            let c = int4_codes(&pack_int4(&q));
            let got: Vec<i8> = c.iter().map(|&n| n as i8 - 8).collect();
            assert_eq!(got, q);
        }
        // Value 0 in the lowest nibble of the first word, value 7 in its top.
        let mut q = [0i8; 32];
        q[0] = -8;
        q[7] = 7;
        q[8] = -1;
        let p = pack_int4(&q);
        assert_eq!(&p[..5], &[0x80, 0x88, 0x88, 0xF8, 0x87]);
    }

    #[test]
    fn int4_dequant_is_code_times_scale() {
        let q: Vec<i8> = [codes_of(0), codes_of(1)].concat();
        let p = pack_int4(&q);
        let scales = [0.375f32, -1.5e-3];
        let mut out = [f32::NAN; 64];
        dequant_int4(&p, &scales, &mut out);
        for (k, &v) in out.iter().enumerate() {
            assert_eq!(v, q[k] as f32 * scales[k / 32], "value {k}");
        }
    }

    #[test]
    fn scale_fit_classes() {
        let bf16 = |x: f32| half::bf16::from_f32(x).to_f32();
        assert_eq!(scale_fit(0.0), ScaleFit::Exact);
        assert_eq!(scale_fit(bf16(0.0123)), ScaleFit::Exact); // 8 significant bits fit f16's 11
        assert_eq!(scale_fit(exp2i(-24) as f32), ScaleFit::Exact); // f16's smallest subnormal
        assert_eq!(scale_fit(3.0 * exp2i(-20) as f32), ScaleFit::Exact); // a subnormal f16
        assert_eq!(scale_fit(bf16(1.0e-6)), ScaleFit::Inexact); // below f16's normals, too fine
        assert_eq!(scale_fit(exp2i(-30) as f32), ScaleFit::Inexact); // under the smallest subnormal
        assert_eq!(scale_fit(1.0 + exp2i(-12) as f32), ScaleFit::Inexact); // 13 significant bits
        assert_eq!(scale_fit(65504.0), ScaleFit::Exact);
        assert_eq!(scale_fit(bf16(65536.0)), ScaleFit::Overflow);
        assert_eq!(scale_fit(f32::INFINITY), ScaleFit::NotFinite);
        assert_eq!(scale_fit(f32::NAN), ScaleFit::NotFinite);
        // Every finite bf16 below f16's range top and at or above its
        // smallest normal is exact.
        for bits in 0..=0x7F7Fu16 {
            let s = half::bf16::from_bits(bits).to_f32();
            if (exp2i(-14) as f32..=65504.0).contains(&s) {
                assert_eq!(scale_fit(s), ScaleFit::Exact, "bf16 {bits:#06x} = {s}");
            }
        }
    }

    #[test]
    fn int4_group_moves_into_q4_0_without_rounding() {
        let mut deq = [0f32; 32];
        for (i, scale) in [0.0123f32, 2.5e-3, 7.0, 0.0].into_iter().enumerate() {
            let scale = half::bf16::from_f32(scale).to_f32();
            let q = codes_of(i);
            let p = pack_int4(&q);
            let b = int4_to_q4_0(&p, scale);
            assert_eq!(b.d, f16::from_f32(scale).to_bits());
            q4_0::dequantize(&[b], &mut deq);
            for (k, &v) in deq.iter().enumerate() {
                assert_eq!(v, q[k] as f32 * scale, "scale {scale} value {k}");
            }
        }
    }

    #[test]
    fn int4_group_with_an_inexact_scale_is_quantised_like_its_values() {
        let scale = half::bf16::from_f32(1.0e-6).to_f32();
        assert_eq!(scale_fit(scale), ScaleFit::Inexact);
        let p = pack_int4(&codes_of(2));
        let mut v = [0f32; 32];
        dequant_int4(&p, &[scale], &mut v);
        let mut want = [BlockQ4_0 { d: 0, qs: [0; 16] }];
        q4_0::quantize(&v, &mut want);
        let got = int4_to_q4_0(&p, scale);
        assert_eq!((got.d, got.qs), (want[0].d, want[0].qs));
    }

    /// E4M3 from its definition, computed in f64 (every value is exact).
    fn e4m3_reference(b: u8) -> f32 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let exp = i32::from((b >> 3) & 0xF);
        let man = f64::from(b & 0x7) / 8.0;
        let mag = if exp == 0 { man * exp2i(-6) } else { (1.0 + man) * exp2i(exp - 7) };
        (sign * mag) as f32
    }

    #[test]
    fn e4m3_all_codes() {
        for b in 0..=255u8 {
            let got = e4m3_to_f32(b);
            if b & 0x7F == 0x7F {
                assert!(got.is_nan(), "code {b:#04x} should be NaN, got {got}");
            } else {
                assert_eq!(got.to_bits(), e4m3_reference(b).to_bits(), "code {b:#04x}");
                assert!(got.is_finite());
            }
        }
    }

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x01), (exp2i(-9) as f32));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * (exp2i(-9) as f32));
        assert_eq!(e4m3_to_f32(0x08), (exp2i(-6) as f32));
        assert_eq!(e4m3_to_f32(0x00).to_bits(), 0);
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
    }

    fn fp8_naive(codes: &[u8], rows: usize, cols: usize, scale_inv: &[f32], block: [usize; 2]) -> Vec<f32> {
        let tiles_per_row = cols.div_ceil(block[1]);
        let mut out = vec![0.0; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                let s = scale_inv[(r / block[0]) * tiles_per_row + c / block[1]];
                out[r * cols + c] = e4m3_reference(codes[r * cols + c]) * s;
            }
        }
        out
    }

    fn check_fp8(rows: usize, cols: usize, block: [usize; 2]) {
        // Deterministic codes covering the whole range, NaN codes skipped.
        let codes: Vec<u8> = (0..rows * cols)
            .map(|i| ((i * 37 + 11) % 256) as u8)
            .map(|b| if b & 0x7F == 0x7F { 0x3F } else { b })
            .collect();
        let tiles = rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
        let scale_inv: Vec<f32> = (0..tiles).map(|t| 0.25 * (t as f32 + 1.0)).collect();
        let mut out = vec![f32::NAN; rows * cols];
        dequant_fp8_block(&codes, rows, cols, &scale_inv, block, &mut out);
        let want = fp8_naive(&codes, rows, cols, &scale_inv, block);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out), bits(&want), "rows {rows} cols {cols} block {block:?}");
    }

    #[test]
    fn fp8_block_partial_edges() {
        check_fp8(5, 7, [2, 3]);
        check_fp8(6, 6, [2, 3]);
        check_fp8(3, 2, [128, 128]);
        check_fp8(4, 9, [1, 1]);
        check_fp8(0, 7, [2, 3]);
    }

    #[test]
    fn fp8_block_scale_placement() {
        // 3 × 4 with 2 × 3 tiles: tile grid 2 × 2, every code 1.0.
        let codes = [0x38u8; 12];
        let scale_inv = [1.0, 2.0, 3.0, 4.0];
        let mut out = [0.0; 12];
        dequant_fp8_block(&codes, 3, 4, &scale_inv, [2, 3], &mut out);
        assert_eq!(out, [1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 2.0, 3.0, 3.0, 3.0, 4.0]);
    }

    #[test]
    fn fp4_table_matches_definition() {
        for (code, &v) in FP4_E2M1.iter().enumerate() {
            let sign = if code & 8 != 0 { -1.0f32 } else { 1.0 };
            let exp = ((code >> 1) & 3) as i32;
            let man = (code & 1) as f32;
            let mag = if exp == 0 { man * 0.5 } else { (1.0 + man / 2.0) * (exp2i(exp - 1) as f32) };
            assert_eq!(v.to_bits(), (sign * mag).to_bits(), "code {code}");
        }
    }

    #[test]
    fn e8m0_exact() {
        assert_eq!(e8m0_scale(127), Some(1.0));
        assert_eq!(e8m0_scale(128), Some(2.0));
        assert_eq!(e8m0_scale(126), Some(0.5));
        assert_eq!(e8m0_scale(255), None);
        let tiny = e8m0_scale(0).unwrap();
        assert!(tiny.is_subnormal());
        assert_eq!(tiny, exp2i(-127) as f32);
        for b in 0..=254u8 {
            let want = exp2i(i32::from(b) - 127) as f32;
            assert_eq!(e8m0_scale(b), Some(want), "byte {b}");
        }
    }

    #[test]
    fn mxfp4_known_values() {
        let mut blocks = [0u8; 48];
        blocks[0] = 0x21; // low 1 (0.5) then high 2 (1.0)
        blocks[1] = 0xF7; // low 7 (6.0) then high 15 (-6.0)
        blocks[15] = 0x80; // low 0 (0.0) then high 8 (-0.0)
        blocks[16] = 0x9A; // low 10 (-1.0) then high 9 (-0.5), scaled by 4
        blocks[32] = 0x01; // low 1 (0.5), high 0, scaled by 2^-127
        let scales = [127u8, 129, 0];
        let mut out = [f32::NAN; 96];
        dequant_mxfp4(&blocks, &scales, &mut out).unwrap();
        assert_eq!(out[..4], [0.5, 1.0, 6.0, -6.0]);
        assert!(out[4..30].iter().all(|&v| v.to_bits() == 0));
        assert_eq!(out[30].to_bits(), 0);
        assert_eq!(out[31].to_bits(), (-0.0f32).to_bits());
        assert_eq!(out[32..34], [-4.0, -2.0]);
        assert!(out[34..64].iter().all(|&v| v == 0.0));
        assert_eq!(out[64], exp2i(-128) as f32);
        assert!(out[65..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn mxfp4_nan_scale() {
        let blocks = [0x11u8; 64];
        let scales = [127u8, 255, 130, 255];
        let mut out = [7.0f32; 128];
        assert_eq!(dequant_mxfp4(&blocks, &scales, &mut out), Err(1));
        assert!(out.iter().all(|&v| v == 7.0), "out must be untouched on error");
        assert_eq!(dequant_mxfp4(&[], &[], &mut []), Ok(()));
    }
}
