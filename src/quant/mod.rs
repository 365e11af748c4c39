//! Weight types: how a row of a weight matrix is laid out in bytes.
//!
//! Quantisation is a property of a weight, never of a model: the forward pass
//! asks a [`crate::kernels`] routine for `W · x` and the kernel looks at the
//! dtype. Every type has a reference (scalar) encoder and decoder here; the
//! block-quantised types of the speed work plug in as new variants with their
//! `#[repr(C)]` blocks in files beside this one.

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
}

impl DType {
    /// All types, in the order the docs list them.
    pub const ALL: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

    /// The lowercase name used in the file and the CLI.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// Parses a CLI / Python name (`f32`, `bf16`, `f16`, and the long spellings).
    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::Bf16),
            "f16" | "float16" | "fp16" | "half" => Some(DType::F16),
            _ => None,
        }
    }

    /// Bytes taken by one row of `cols` elements. Every row of a matrix starts
    /// at a multiple of this from the tensor's start. `None` when `cols` is not
    /// a legal row length for the type (block types need whole blocks).
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        match self {
            DType::F32 => cols.checked_mul(4),
            DType::Bf16 | DType::F16 => cols.checked_mul(2),
        }
    }

    /// Bytes taken by a tensor of `numel` elements laid out as rows of `cols`.
    pub fn tensor_bytes(self, shape: &[usize]) -> Option<usize> {
        let cols = *shape.last().unwrap_or(&1);
        let rows = shape[..shape.len().saturating_sub(1)].iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
        self.row_bytes(cols)?.checked_mul(rows)
    }

    /// Required alignment of the tensor's first byte in memory, so the data can
    /// be viewed as a slice of its element type.
    pub fn align(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Encodes f32 values into `dst` (exactly `row_bytes(src.len())` bytes).
/// bf16 and f16 round to nearest even, as torch's `.to()` does.
pub fn encode(dtype: DType, src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(Some(dst.len()), dtype.row_bytes(src.len()));
    match dtype {
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
    }
}

/// Decodes `dst.len()` values from `src` (a whole number of rows of the type).
pub fn decode(dtype: DType, src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(Some(src.len()), dtype.row_bytes(dst.len()));
    match dtype {
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_each_type() {
        let xs: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.37).collect();
        for dt in DType::ALL {
            let mut bytes = vec![0u8; dt.row_bytes(xs.len()).unwrap()];
            encode(dt, &xs, &mut bytes);
            let mut back = vec![0f32; xs.len()];
            decode(dt, &bytes, &mut back);
            let tol = match dt {
                DType::F32 => 0.0,
                DType::Bf16 => 1.0 / 256.0,
                DType::F16 => 1.0 / 2048.0,
            };
            for (a, b) in xs.iter().zip(&back) {
                assert!((a - b).abs() <= tol * a.abs().max(1e-3), "{dt}: {a} vs {b}");
            }
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
