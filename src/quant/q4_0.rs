//! q4_0: blocks of 32 weights as 4-bit codes with one f16 scale.
//! `w[i] = d * (code[i] - 8)`; byte j holds element j in its low nibble and
//! element j + 16 in its high nibble (the GGML layout, so a 16-byte load
//! unpacks into elements 0..16 and 16..32 with one mask and one shift).
//! The scale maps the weight of largest magnitude to -8, using the full
//! range on that side. 4.5 bits per weight.

use half::f16;

/// Weights per block.
pub const QK: usize = 32;

/// One block as stored in the file.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4_0 {
    /// Scale, f16 bits.
    pub d: u16,
    /// Packed codes.
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

/// Quantises `src` (a multiple of 32 long) into `dst`.
pub fn quantize(src: &[f32], dst: &mut [BlockQ4_0]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        // The signed value of largest magnitude becomes -8.
        let max = x.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = f16::from_f32(d).to_bits();
        let code = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
        for j in 0..QK / 2 {
            b.qs[j] = code(x[j]) | (code(x[j + QK / 2]) << 4);
        }
    }
}

/// Expands blocks back to f32.
pub fn dequantize(src: &[BlockQ4_0], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16::from_bits(b.d).to_f32();
        for j in 0..QK / 2 {
            y[j] = d * ((b.qs[j] & 0xF) as i32 - 8) as f32;
            y[j + QK / 2] = d * ((b.qs[j] >> 4) as i32 - 8) as f32;
        }
    }
}
