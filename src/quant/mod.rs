//! Weight types: how a row of a weight matrix is laid out in bytes.
//!
//! Quantisation is a property of a weight, never of a model: the forward pass
//! asks a [`crate::kernels`] routine for `W · x` and the kernel looks at the
//! dtype. Every type has a reference (scalar) encoder and decoder here; the
//! block-quantised types of the speed work plug in as new variants with their
//! `#[repr(C)]` blocks in files beside this one.

pub mod act;
pub mod kquant;
pub mod kx8;
pub mod mxfp4;
pub mod q4_0;
pub mod q4_1;
pub mod q8_0;
pub mod x8;

use serde::{Deserialize, Serialize};

/// Storage type of a tensor in a `.colibri` file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16: the top 16 bits of an f32.
    Bf16,
    /// IEEE binary16.
    F16,
    /// Blocks of 32 int8 with an f16 scale ([`q8_0`]).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// Blocks of 32 4-bit codes with an f16 scale ([`q4_0`]).
    #[serde(rename = "q4_0")]
    Q4_0,
    /// Blocks of 32 4-bit codes with an f16 scale and minimum ([`q4_1`]).
    #[serde(rename = "q4_1")]
    Q4_1,
    /// Blocks of 32 E2M1 codes with a shared E8M0 exponent ([`mxfp4`]).
    Mxfp4,
    /// q8_0 rows interleaved in groups of eight ([`x8`]).
    #[serde(rename = "q8_0x8")]
    Q8_0x8,
    /// q4_0 rows interleaved in groups of eight ([`x8`]).
    #[serde(rename = "q4_0x8")]
    Q4_0x8,
    /// q4_1 rows interleaved in groups of eight ([`x8`]).
    #[serde(rename = "q4_1x8")]
    Q4_1x8,
    /// mxfp4 rows interleaved in groups of eight ([`x8`]).
    Mxfp4x8,
    /// Super-blocks of 256: 4-bit codes, 6-bit scales and minimums ([`kquant`]).
    #[serde(rename = "q4k")]
    Q4K,
    /// Super-blocks of 256: 5-bit codes, 6-bit scales and minimums ([`kquant`]).
    #[serde(rename = "q5k")]
    Q5K,
    /// Super-blocks of 256: 6-bit codes, 8-bit scales ([`kquant`]).
    #[serde(rename = "q6k")]
    Q6K,
    /// q4k rows interleaved in groups of eight ([`kx8`]).
    #[serde(rename = "q4kx8")]
    Q4Kx8,
    /// q5k rows interleaved in groups of eight ([`kx8`]).
    #[serde(rename = "q5kx8")]
    Q5Kx8,
    /// q6k rows interleaved in groups of eight ([`kx8`]).
    #[serde(rename = "q6kx8")]
    Q6Kx8,
}

impl DType {
    /// The weight types a user chooses from, in the order the docs list them.
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::Bf16,
        DType::F16,
        DType::Q8_0,
        DType::Q6K,
        DType::Q5K,
        DType::Q4K,
        DType::Q4_0,
        DType::Q4_1,
        DType::Mxfp4,
    ];

    /// The interleaved storage forms of the block types (chosen by the
    /// converter, never by name), in the order of their row-major twins.
    pub const INTERLEAVED: [DType; 7] =
        [DType::Q8_0x8, DType::Q6Kx8, DType::Q5Kx8, DType::Q4Kx8, DType::Q4_0x8, DType::Q4_1x8, DType::Mxfp4x8];

    /// The interleaved form of a block type, if it has one.
    pub fn interleaved(self) -> Option<DType> {
        match self {
            DType::Q8_0 => Some(DType::Q8_0x8),
            DType::Q4_0 => Some(DType::Q4_0x8),
            DType::Q4_1 => Some(DType::Q4_1x8),
            DType::Mxfp4 => Some(DType::Mxfp4x8),
            DType::Q4K => Some(DType::Q4Kx8),
            DType::Q5K => Some(DType::Q5Kx8),
            DType::Q6K => Some(DType::Q6Kx8),
            _ => None,
        }
    }

    /// The row-major type holding the same values (itself for row types).
    pub fn base(self) -> DType {
        match self {
            DType::Q8_0x8 => DType::Q8_0,
            DType::Q4_0x8 => DType::Q4_0,
            DType::Q4_1x8 => DType::Q4_1,
            DType::Mxfp4x8 => DType::Mxfp4,
            DType::Q4Kx8 => DType::Q4K,
            DType::Q5Kx8 => DType::Q5K,
            DType::Q6Kx8 => DType::Q6K,
            d => d,
        }
    }

    /// Rows stored together: 8 for the interleaved types, else 1. A matrix
    /// of such a type has a multiple of this many rows.
    pub fn group_rows(self) -> usize {
        if self.base() == self { 1 } else { x8::ROWS }
    }

    /// The lowercase name used in the file and the CLI.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q8_0x8 => "q8_0x8",
            DType::Q4_0x8 => "q4_0x8",
            DType::Q4_1x8 => "q4_1x8",
            DType::Mxfp4 => "mxfp4",
            DType::Mxfp4x8 => "mxfp4x8",
            DType::Q4K => "q4k",
            DType::Q5K => "q5k",
            DType::Q6K => "q6k",
            DType::Q4Kx8 => "q4kx8",
            DType::Q5Kx8 => "q5kx8",
            DType::Q6Kx8 => "q6kx8",
        }
    }

    /// The super-block kind of the row-major [`kquant`] types (`None` for
    /// their interleaved forms too: ask their [`DType::base`]).
    pub fn kquant(self) -> Option<kquant::Kind> {
        match self {
            DType::Q4K => Some(kquant::Kind::Q4K),
            DType::Q5K => Some(kquant::Kind::Q5K),
            DType::Q6K => Some(kquant::Kind::Q6K),
            _ => None,
        }
    }

    /// Block-quantised types store rows as whole blocks of this many values;
    /// 1 for element types.
    pub fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::Bf16 | DType::F16 => 1,
            _ => 32,
        }
    }

    /// Bytes of one block (of one element for element types; of one row's
    /// share of a group block for the interleaved types).
    fn block_bytes(self) -> usize {
        match self.base() {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::Q8_0 => std::mem::size_of::<q8_0::BlockQ8_0>(),
            DType::Q4_0 => std::mem::size_of::<q4_0::BlockQ4_0>(),
            DType::Q4_1 => std::mem::size_of::<q4_1::BlockQ4_1>(),
            DType::Mxfp4 => std::mem::size_of::<mxfp4::BlockMxfp4>(),
            _ => unreachable!("base() is a row type; the kquant types size their rows themselves"),
        }
    }

    /// True for the block-quantised types, whose kernels take the activation
    /// quantised to 8 bits.
    pub fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Parses a CLI / Python name (`f32`, `bf16`, `f16`, and the long spellings).
    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::Bf16),
            "f16" | "float16" | "fp16" | "half" => Some(DType::F16),
            "q8_0" => Some(DType::Q8_0),
            "q4_0" => Some(DType::Q4_0),
            "q4_1" => Some(DType::Q4_1),
            "mxfp4" => Some(DType::Mxfp4),
            "q4k" => Some(DType::Q4K),
            "q5k" => Some(DType::Q5K),
            "q6k" => Some(DType::Q6K),
            _ => None,
        }
    }

    /// Bytes taken by one row of `cols` elements. Every row of a matrix starts
    /// at a multiple of this from the tensor's start (every group of eight
    /// rows, for the interleaved types). `None` when `cols` is not a legal row
    /// length for the type (block types need whole blocks).
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        if let Some(kind) = self.base().kquant() {
            // Super-blocks of 256, the last one possibly partial (the
            // interleaved forms take the same bytes per row).
            return kquant::row_bytes(kind, cols);
        }
        let b = self.block_len();
        if !cols.is_multiple_of(b) {
            return None;
        }
        (cols / b).checked_mul(self.block_bytes())
    }

    /// Bytes taken by a tensor of `numel` elements laid out as rows of `cols`.
    pub fn tensor_bytes(self, shape: &[usize]) -> Option<usize> {
        let cols = *shape.last().unwrap_or(&1);
        let rows = shape[..shape.len().saturating_sub(1)].iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
        if !rows.is_multiple_of(self.group_rows()) {
            return None;
        }
        self.row_bytes(cols)?.checked_mul(rows)
    }

    /// Required alignment of the tensor's first byte in memory, so the data can
    /// be viewed as a slice of its element type.
    pub fn align(self) -> usize {
        match self {
            DType::F32 => 4,
            _ => 2,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Encodes a `[rows, cols]` f32 matrix into `dst` (exactly
/// `tensor_bytes([rows, cols])` bytes: block types need whole blocks, the
/// interleaved types whole groups of eight rows). bf16 and f16 round to
/// nearest even, as torch's `.to()` does. `dst` must be aligned for the
/// type's blocks.
pub fn encode(dtype: DType, src: &[f32], cols: usize, dst: &mut [u8]) {
    encode_weighted(dtype, src, cols, None, dst)
}

/// [`encode`], with the block types' quantisers minimising the error
/// weighted by `importance` (one non-negative weight per column: an
/// importance matrix's mean squared activations, [`crate::imatrix`]) instead
/// of the plain squared error. `None` is exactly [`encode`]. Element types,
/// and mxfp4 (its power-of-two scale leaves no choice worth weighing), are
/// the same either way.
pub fn encode_weighted(dtype: DType, src: &[f32], cols: usize, importance: Option<&[f32]>, dst: &mut [u8]) {
    debug_assert_eq!(Some(dst.len()), dtype.tensor_bytes(&[src.len() / cols.max(1), cols]));
    let weights = importance.map(|imp| column_weights(imp, cols));
    let weights = weights.as_deref();
    if dtype.group_rows() > 1 {
        // Row-major first, then the byte shuffle (lossless).
        let mut rows = vec![0u16; dst.len() / 2];
        encode_rows(dtype.base(), src, cols, weights, bytemuck::cast_slice_mut(&mut rows));
        let nb = cols / 32;
        let rows: &[u8] = bytemuck::cast_slice(&rows);
        match dtype {
            DType::Q8_0x8 => x8::pack::<x8::BlockQ8_0x8>(cast(rows), nb, cast_mut(dst)),
            DType::Q4_0x8 => x8::pack::<x8::BlockQ4_0x8>(cast(rows), nb, cast_mut(dst)),
            DType::Q4_1x8 => x8::pack::<x8::BlockQ4_1x8>(cast(rows), nb, cast_mut(dst)),
            DType::Mxfp4x8 => x8::pack::<x8::BlockMxfp4x8>(cast(rows), nb, cast_mut(dst)),
            DType::Q4Kx8 => kx8::pack(kquant::Kind::Q4K, rows, cols, dst),
            DType::Q5Kx8 => kx8::pack(kquant::Kind::Q5K, rows, cols, dst),
            DType::Q6Kx8 => kx8::pack(kquant::Kind::Q6K, rows, cols, dst),
            _ => unreachable!("group_rows() > 1 only for interleaved types"),
        }
        return;
    }
    encode_rows(dtype, src, cols, weights, dst);
}

/// How far the column weights of the importance-weighted quantisers pull
/// an importance towards uniform: each column's weight is its importance
/// plus this share of the mean. A calibration text is a small sample, so a
/// column it barely lit up is not free to take any error; on the demo
/// model (held-out prose, mean KL) a
/// share of 0.1 helped every type tried (q4_1 4.36e-3 → 3.55e-3, q4k
/// 3.95e-3 → 3.51e-3, q6k 3.86e-4 → 3.09e-4), where a bare floor at 1e-3
/// of the mean helped the 4-bit types less and made q6k worse.
pub const IMPORTANCE_SHRINK: f64 = 0.1;

/// The per-column weights the quantisers use: the importance shrunk
/// towards its mean ([`IMPORTANCE_SHRINK`]), uniform when it is all zero.
fn column_weights(importance: &[f32], cols: usize) -> Vec<f32> {
    assert_eq!(importance.len(), cols, "an importance vector has one weight per column");
    let mean = importance.iter().map(|&v| v as f64).sum::<f64>() / cols.max(1) as f64;
    if !(mean > 0.0 && mean.is_finite()) {
        return vec![1.0; cols];
    }
    let shrink = (IMPORTANCE_SHRINK * mean) as f32;
    importance.iter().map(|&v| v + shrink).collect()
}

fn cast<T: bytemuck::Pod>(b: &[u8]) -> &[T] {
    bytemuck::cast_slice(b)
}

fn cast_mut<T: bytemuck::Pod>(b: &mut [u8]) -> &mut [T] {
    bytemuck::cast_slice_mut(b)
}

/// [`encode`] for a row-major type (any number of rows of `cols`), the
/// block types weighted per column by `weights` when given.
fn encode_rows(dtype: DType, src: &[f32], cols: usize, weights: Option<&[f32]>, dst: &mut [u8]) {
    if let Some(kind) = dtype.kquant() {
        kquant::quantize_rows(kind, src, cols, weights, dst);
        return;
    }
    if let Some(w) = weights.filter(|_| matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1)) {
        let rb = dtype.row_bytes(cols).expect("whole blocks");
        for (x, out) in src.chunks_exact(cols).zip(dst.chunks_exact_mut(rb)) {
            match dtype {
                DType::Q8_0 => q8_0::quantize_weighted(x, w, bytemuck::cast_slice_mut(out)),
                DType::Q4_0 => q4_0::quantize_weighted(x, w, bytemuck::cast_slice_mut(out)),
                DType::Q4_1 => q4_1::quantize_weighted(x, w, bytemuck::cast_slice_mut(out)),
                _ => unreachable!("filtered above"),
            }
        }
        return;
    }
    match dtype {
        DType::Q8_0 => q8_0::quantize(src, bytemuck::cast_slice_mut(dst)),
        DType::Q4_0 => q4_0::quantize(src, bytemuck::cast_slice_mut(dst)),
        DType::Q4_1 => q4_1::quantize(src, bytemuck::cast_slice_mut(dst)),
        DType::Mxfp4 => mxfp4::quantize(src, bytemuck::cast_slice_mut(dst)),
        DType::F32 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&s.to_le_bytes());
            }
        }
        DType::Bf16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::bf16::from_f32(*s).to_bits().to_le_bytes());
            }
        }
        DType::F16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::f16::from_f32(*s).to_bits().to_le_bytes());
            }
        }
        _ => unreachable!("interleaved types are encoded through `encode`"),
    }
}

/// Decodes a `[rows, cols]` matrix from `src` into `dst` (`rows * cols`
/// values). Element types accept any alignment; block types need `src`
/// aligned to 2.
pub fn decode(dtype: DType, src: &[u8], cols: usize, dst: &mut [f32]) {
    debug_assert_eq!(Some(src.len()), dtype.tensor_bytes(&[dst.len() / cols.max(1), cols]));
    if dtype.group_rows() > 1 {
        let mut rows = vec![0u16; src.len() / 2];
        let nb = cols / 32;
        let out: &mut [u8] = bytemuck::cast_slice_mut(&mut rows);
        match dtype {
            DType::Q8_0x8 => x8::unpack::<x8::BlockQ8_0x8>(cast(src), nb, cast_mut(out)),
            DType::Q4_0x8 => x8::unpack::<x8::BlockQ4_0x8>(cast(src), nb, cast_mut(out)),
            DType::Q4_1x8 => x8::unpack::<x8::BlockQ4_1x8>(cast(src), nb, cast_mut(out)),
            DType::Mxfp4x8 => x8::unpack::<x8::BlockMxfp4x8>(cast(src), nb, cast_mut(out)),
            DType::Q4Kx8 => kx8::unpack(kquant::Kind::Q4K, src, cols, out),
            DType::Q5Kx8 => kx8::unpack(kquant::Kind::Q5K, src, cols, out),
            DType::Q6Kx8 => kx8::unpack(kquant::Kind::Q6K, src, cols, out),
            _ => unreachable!("group_rows() > 1 only for interleaved types"),
        }
        decode(dtype.base(), bytemuck::cast_slice(&rows), cols, dst);
        return;
    }
    if let Some(kind) = dtype.kquant() {
        let rb = dtype.row_bytes(cols).expect("rows of whole sub-blocks");
        for (row, out) in src.chunks_exact(rb).zip(dst.chunks_exact_mut(cols)) {
            kquant::dequantize_row(kind, row, out);
        }
        return;
    }
    decode_rows(dtype, src, dst);
}

/// Decodes row `l` (0..8) of one group of eight interleaved rows (`src`,
/// `8 * row_bytes(dst.len())` bytes) into `dst`.
pub fn decode_group_row(dtype: DType, src: &[u8], l: usize, dst: &mut [f32]) {
    fn each<G: x8::Interleave>(base: DType, src: &[u8], l: usize, dst: &mut [f32]) {
        // One block at a time through the stack: no allocation (this serves
        // embedding lookups inside the forward pass).
        for (g, out) in cast::<G>(src).iter().zip(dst.chunks_exact_mut(32)) {
            decode_rows(base, bytemuck::bytes_of(&g.unpack(l)), out);
        }
    }
    match dtype {
        DType::Q8_0x8 => each::<x8::BlockQ8_0x8>(DType::Q8_0, src, l, dst),
        DType::Q4_0x8 => each::<x8::BlockQ4_0x8>(DType::Q4_0, src, l, dst),
        DType::Q4_1x8 => each::<x8::BlockQ4_1x8>(DType::Q4_1, src, l, dst),
        DType::Mxfp4x8 => each::<x8::BlockMxfp4x8>(DType::Mxfp4, src, l, dst),
        DType::Q4Kx8 | DType::Q5Kx8 | DType::Q6Kx8 => {
            let kind = dtype.base().kquant().expect("a super-block type");
            // One super-block at a time through the stack, as above.
            let mut row = [0u8; kquant::Kind::Q6K.block_bytes()];
            const _: () = assert!(kquant::Kind::Q6K.block_bytes() >= kquant::Kind::Q5K.block_bytes());
            for ((start, subs), out) in kx8::columns(kind, dst.len()).zip(dst.chunks_mut(kquant::QK_K)) {
                let len = kind.header_bytes() + subs * kind.sub_bytes();
                let row = &mut row[..len];
                kx8::unpack_column_row(kind, &src[start..start + x8::ROWS * len], subs, l, row);
                kquant::dequantize_row(kind, row, out);
            }
        }
        _ => panic!("decode_group_row: {dtype} is not an interleaved type"),
    }
}

/// [`decode`] for a row-major type.
fn decode_rows(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::Q8_0 => q8_0::dequantize(bytemuck::cast_slice(src), dst),
        DType::Q4_0 => q4_0::dequantize(bytemuck::cast_slice(src), dst),
        DType::Q4_1 => q4_1::dequantize(bytemuck::cast_slice(src), dst),
        DType::Mxfp4 => mxfp4::dequantize(bytemuck::cast_slice(src), dst),
        DType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        DType::Bf16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
            }
        }
        DType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
            }
        }
        _ => unreachable!("interleaved types are decoded through `decode`"),
    }
}

/// 2^k exactly, for k in f64's normal range (−1022..=1023): the exponent
/// bits set directly. `powi` is not promised exact on every platform (Miri
/// perturbs it on purpose), and the scale arithmetic of mxfp4 and FP8 must be.
pub fn exp2i(k: i32) -> f64 {
    assert!((-1022..=1023).contains(&k), "2^{k} is outside f64's normal range");
    f64::from_bits(((k + 1023) as u64) << 52)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_each_type() {
        let xs: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.37).collect();
        for dt in DType::ALL.into_iter().filter(|d| !d.is_quantized()) {
            let mut bytes = vec![0u8; dt.row_bytes(xs.len()).unwrap()];
            encode(dt, &xs, xs.len(), &mut bytes);
            let mut back = vec![0f32; xs.len()];
            decode(dt, &bytes, xs.len(), &mut back);
            let tol = match dt {
                DType::F32 => 0.0,
                DType::Bf16 => 1.0 / 256.0,
                DType::F16 => 1.0 / 2048.0,
                _ => unreachable!(),
            };
            for (a, b) in xs.iter().zip(&back) {
                assert!((a - b).abs() <= tol * a.abs().max(1e-3), "{dt}: {a} vs {b}");
            }
        }
    }

    /// Root-mean-square quantisation error relative to the RMS of the data, on
    /// Gaussian-like weights: the figure each block type is designed around.
    fn relative_rms_error(dt: DType, xs: &[f32]) -> f32 {
        let mut bytes = vec![0u16; dt.row_bytes(xs.len()).unwrap() / 2];
        encode(dt, xs, xs.len(), bytemuck::cast_slice_mut(&mut bytes));
        let mut back = vec![0f32; xs.len()];
        decode(dt, bytemuck::cast_slice(&bytes), xs.len(), &mut back);
        let num: f32 = xs.iter().zip(&back).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f32 = xs.iter().map(|a| a * a).sum();
        (num / den).sqrt()
    }

    fn gaussian(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        let mut u = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n).map(|_| ((-2.0 * u().ln()).sqrt() * (2.0 * std::f64::consts::PI * u()).cos()) as f32 * 0.02).collect()
    }

    #[test]
    fn block_types_meet_their_error_budgets() {
        let xs = gaussian(32 * 512, 11);
        // Uniform quantisation noise of a step s has RMS s/sqrt(12); with 127
        // or 7.5 steps per max|w| of a 32-sample Gaussian block (~2.5 sigma)
        // that gives about 0.006 (q8_0) and 0.1 (q4_0). On symmetric data
        // q4_1's offset buys little (measured: 0.071 vs 0.086); its gain is on
        // skewed blocks, checked below.
        let e8 = relative_rms_error(DType::Q8_0, &xs);
        let e40 = relative_rms_error(DType::Q4_0, &xs);
        let e41 = relative_rms_error(DType::Q4_1, &xs);
        assert!(e8 < 0.01, "q8_0 {e8}");
        assert!(e40 < 0.13, "q4_0 {e40}");
        assert!(e41 < 0.9 * e40, "q4_1 {e41} should beat q4_0 {e40}");
        // Skewed blocks (all weights of one sign, as after a ReLU-like bias):
        // q4_0 wastes half its levels, q4_1 uses all 16.
        let skewed: Vec<f32> = xs.iter().map(|v| v.abs() + 0.01).collect();
        let (s40, s41) = (relative_rms_error(DType::Q4_0, &skewed), relative_rms_error(DType::Q4_1, &skewed));
        assert!(s41 < 0.5 * s40, "skewed: q4_1 {s41} vs q4_0 {s40}");
        // mxfp4: 15 non-uniform levels and a power-of-two scale (so up to a
        // factor 2 of range unused); measured 0.118 on this data, q4_0's class.
        let em = relative_rms_error(DType::Mxfp4, &xs);
        assert!(em < 0.15, "mxfp4 {em}");
        eprintln!("relative RMS error: q8_0 {e8:.4}, q4_0 {e40:.4}, q4_1 {e41:.4}, mxfp4 {em:.4}");
    }

    /// Σ imp_c · (x − x̂)² over a [rows, cols] matrix, relative to Σ imp_c · x².
    fn weighted_error(dt: DType, xs: &[f32], cols: usize, imp: &[f32], weighted: bool) -> f64 {
        let mut bytes = vec![0u16; dt.tensor_bytes(&[xs.len() / cols, cols]).unwrap() / 2];
        let out = bytemuck::cast_slice_mut(&mut bytes);
        encode_weighted(dt, xs, cols, weighted.then_some(imp), out);
        let mut back = vec![0f32; xs.len()];
        decode(dt, bytemuck::cast_slice(&bytes), cols, &mut back);
        let (mut num, mut den) = (0f64, 0f64);
        for (i, (a, b)) in xs.iter().zip(&back).enumerate() {
            let w = imp[i % cols] as f64;
            num += w * ((a - b) as f64).powi(2);
            den += w * (*a as f64).powi(2);
        }
        num / den
    }

    #[test]
    fn importance_weighting_lowers_the_weighted_error() {
        let cols = 256;
        let xs = gaussian(cols * 64, 5);
        // A few columns carry most of the activation energy, as in real models.
        let imp: Vec<f32> = (0..cols).map(|c| if c % 37 == 3 { 50.0 } else { 0.2 + (c % 5) as f32 * 0.1 }).collect();
        for dt in [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q4_1x8] {
            let plain = weighted_error(dt, &xs, cols, &imp, false);
            let weighted = weighted_error(dt, &xs, cols, &imp, true);
            eprintln!("{dt}: weighted error {plain:.3e} unweighted, {weighted:.3e} weighted");
            assert!(weighted < 0.9 * plain, "{dt}: {weighted} vs {plain}");
        }
        // Uniform importance: at least as good as the plain quantiser.
        let flat = vec![1.0; cols];
        for dt in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let plain = weighted_error(dt, &xs, cols, &flat, false);
            let weighted = weighted_error(dt, &xs, cols, &flat, true);
            assert!(weighted <= plain * 1.0001, "{dt}: {weighted} vs {plain}");
        }
        // All-zero importance falls back to uniform weights, and zeros stay zeros.
        let zero = vec![0.0; cols];
        let mut bytes = vec![0u16; DType::Q4_1.tensor_bytes(&[64, cols]).unwrap() / 2];
        encode_weighted(DType::Q4_1, &xs, cols, Some(&zero), bytemuck::cast_slice_mut(&mut bytes));
        let mut a = vec![0u16; bytes.len()];
        encode_weighted(DType::Q4_1, &xs, cols, Some(&flat), bytemuck::cast_slice_mut(&mut a));
        assert_eq!(a, bytes);
    }

    #[test]
    fn block_types_need_whole_blocks_and_handle_zeros() {
        for dt in [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Mxfp4] {
            assert_eq!(dt.row_bytes(33), None);
            assert!(dt.row_bytes(64).is_some());
            let zeros = vec![0f32; 64];
            let mut bytes = vec![0u16; dt.row_bytes(64).unwrap() / 2];
            encode(dt, &zeros, 64, bytemuck::cast_slice_mut(&mut bytes));
            let mut back = vec![1f32; 64];
            decode(dt, bytemuck::cast_slice(&bytes), 64, &mut back);
            assert!(back.iter().all(|&v| v == 0.0), "{dt}");
        }
    }

    #[test]
    fn names_parse_back() {
        for dt in DType::ALL {
            assert_eq!(DType::parse(dt.name()), Some(dt));
        }
        assert_eq!(DType::parse("q9"), None);
    }

    #[test]
    fn sizes_do_not_overflow() {
        assert_eq!(DType::F32.tensor_bytes(&[3, 5]), Some(60));
        assert_eq!(DType::Bf16.tensor_bytes(&[7]), Some(14));
        assert_eq!(DType::F32.tensor_bytes(&[usize::MAX, 2]), None);
    }
}
