//! mxfp4: the OCP microscaling FP4 format GPT-OSS ships its experts in.
//! Blocks of 32 weights, each an E2M1 code (1 sign, 2 exponent, 1 mantissa
//! bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), sharing one E8M0 exponent:
//! `w[i] = E2M1[code[i]] · 2^(e − 127)`. 4.25 bits per weight.
//!
//! Byte j holds element j in its low nibble and element j + 16 in its high
//! nibble, as q4_0 (the Hub's own order is pairs 2j, 2j+1; the converter
//! decodes and re-encodes, which is exact for values that came from MXFP4).
//! Kernels multiply with the codes' values doubled ([`LUT2`], integers in
//! −12..12) and halve the scale ([`half_scale`]), so the dot product of a
//! block is an integer one.

use super::exp2i;

/// Weights per block.
pub const QK: usize = 32;

/// One block as stored in the file.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockMxfp4 {
    /// Shared exponent, E8M0 (bias 127).
    pub e: u8,
    /// Packed E2M1 codes.
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockMxfp4>() == 17);

/// E2M1 values, indexed by code.
pub const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Twice the E2M1 values, as the integers the kernels multiply by.
pub const LUT2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `2^(e − 128)` exactly (the block scale halved, to go with [`LUT2`]).
#[inline]
pub fn half_scale(e: u8) -> f32 {
    match e {
        // Below f32's normal range: 2^-128 and 2^-127 are subnormals.
        0 => f32::from_bits(1 << 21),
        1 => f32::from_bits(1 << 22),
        _ => f32::from_bits(u32::from(e - 1) << 23),
    }
}

/// The code of the E2M1 value nearest `t` (ties to the smaller magnitude),
/// saturating at ±6.
fn nearest(t: f32) -> u8 {
    // Midpoints between consecutive magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
    const MID: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let m = t.abs();
    let code = MID.iter().take_while(|&&b| m > b).count() as u8;
    if t < 0.0 && code > 0 { code | 8 } else { code }
}

/// Quantises `src` (a multiple of 32 long) into `dst`. The shared exponent is
/// the smallest that puts the block's largest magnitude within ±6, so no
/// value is clipped; values that are already MXFP4 come back exactly.
pub fn quantize(src: &[f32], dst: &mut [BlockMxfp4]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let amax = x.iter().fold(0f32, |m, &v| m.max(v.abs()));
        let mut e: i32 =
            if amax > 0.0 && amax.is_finite() { crate::math::log2(amax as f64 / 6.0).ceil() as i32 + 127 } else { 0 };
        // log2 is not exact: step to the smallest exponent that holds amax.
        e = e.clamp(0, 254);
        while e > 0 && amax as f64 <= 6.0 * exp2i(e - 1 - 127) {
            e -= 1;
        }
        while e < 254 && amax as f64 > 6.0 * exp2i(e - 127) {
            e += 1;
        }
        b.e = e as u8;
        let inv = exp2i(127 - e);
        let code = |v: f32| nearest((v as f64 * inv) as f32);
        for j in 0..QK / 2 {
            b.qs[j] = code(x[j]) | (code(x[j + QK / 2]) << 4);
        }
    }
}

/// Expands blocks back to f32.
pub fn dequantize(src: &[BlockMxfp4], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let s = half_scale(b.e);
        for j in 0..QK / 2 {
            y[j] = s * f32::from(LUT2[(b.qs[j] & 0xF) as usize]);
            y[j + QK / 2] = s * f32::from(LUT2[(b.qs[j] >> 4) as usize]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxfp4_values_round_trip_exactly_and_scales_are_exact() {
        for e in 0..=255u8 {
            let want = exp2i(i32::from(e) - 128) as f32;
            assert_eq!(half_scale(e), want, "e = {e}");
        }
        // Every code at several exponents: decoding and re-encoding is exact.
        for e in [1u8, 60, 120, 127, 131, 200, 254] {
            let mut b = BlockMxfp4 { e, qs: [0; 16] };
            for j in 0..16 {
                b.qs[j] = (j as u8) | (((15 - j) as u8) << 4);
            }
            let mut v = [0f32; 32];
            dequantize(&[b], &mut v);
            let mut again = [BlockMxfp4 { e: 0, qs: [0; 16] }];
            quantize(&v, &mut again);
            let mut w = [0f32; 32];
            dequantize(&again, &mut w);
            assert_eq!(v, w, "e = {e}");
        }
        for (c, v) in E2M1.iter().enumerate() {
            assert_eq!(f32::from(LUT2[c]), 2.0 * v);
        }
    }

    #[test]
    fn quantising_keeps_the_largest_magnitude_and_zeros() {
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 15.5) * 0.37).collect();
        let mut b = [BlockMxfp4 { e: 0, qs: [0; 16] }];
        quantize(&x, &mut b);
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        // The scale is the smallest that holds max|x| = 5.735: 2^0 (6 ≥ 5.735 > 3).
        assert_eq!(b[0].e, 127);
        for (a, c) in x.iter().zip(&y) {
            // Half the widest step (4 to 6).
            assert!((a - c).abs() <= 1.0 + 1e-6, "{a} vs {c}");
        }
        quantize(&[0.0; 32], &mut b);
        dequantize(&b, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
    }
}
