//! Reading Hugging Face safetensors checkpoints, single-file or sharded.
//!
//! A safetensors file is an 8-byte little-endian header length `n`, `n` bytes
//! of JSON mapping each tensor name to `{dtype, shape, data_offsets}`, then the
//! raw data; offsets are relative to the end of the JSON. Sharded checkpoints
//! add `model.safetensors.index.json` whose `weight_map` names each tensor's
//! file. Every file is mapped read-only and validated before use.
//!
//! Quantised Hub checkpoints are presented as the tensors they encode:
//! - FP8 (`quantization_config.quant_method = "fp8"`): an `F8_E4M3` tensor `W`
//!   with a float32 `W_scale_inv` of one scale per `weight_block_size` block;
//! - MXFP4 (`quant_method = "mxfp4"`, GPT-OSS): `W_blocks` (`U8`, `[.., G, 16]`,
//!   two E2M1 codes a byte) with `W_scales` (`U8`, `[.., G]`, E8M0 exponents),
//!   presented as `W` of shape `[.., G·32]`.
//! - compressed-tensors `pack-quantized` (`quant_method =
//!   "compressed-tensors"`, Kimi-K2 / K2-Thinking / K2.5 experts): a module
//!   `M` as `M.weight_packed` (`I32`, `[.., rows, cols/8]`, eight int4 codes
//!   per word), `M.weight_scale` (`[.., rows, cols/32]`, one scale per 32
//!   values) and `M.weight_shape` (`I32`/`I64`, the logical shape), presented
//!   as `M.weight`. Only symmetric int4 with groups of 32 is read
//!   ([`check_compressed_tensors`]); anything else is refused by name.
//!
//! The companion tensors are consumed into the tensor they scale, so the
//! converter's "every tensor used" check sees only logical tensors.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde_json::Value;

use super::dequant;
use crate::error::{Error, Result};
use crate::quant::DType;

/// One source tensor: where its bytes are and how they encode its values.
#[derive(Clone, Debug)]
pub struct SrcTensor {
    /// How the values are stored.
    pub enc: Encoding,
    /// Logical shape, outermost first.
    pub shape: Vec<usize>,
    /// The bytes (codes, for the quantised encodings).
    at: Span,
}

/// Where some bytes are: a file of the checkpoint and a byte range in it.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    file: usize,
    start: usize,
    end: usize,
}

/// How a source tensor's values are stored.
#[derive(Clone, Debug)]
pub enum Encoding {
    /// A colibri element type (F32, BF16, F16), usable as it is.
    Plain(DType),
    /// E4M3 codes times a float32 scale per `[b0, b1]` block.
    Fp8 {
        /// The `_scale_inv` tensor's bytes: `[ceil(rows/b0), ceil(cols/b1)]` f32
        /// (or one E8M0 exponent byte each, `ue8m0`).
        scales: Span,
        /// Block size (rows, cols).
        block: [usize; 2],
        /// The scales are E8M0 bytes (`2^(b − 127)`, DeepSeek-V4's `scale_fmt: ue8m0`).
        ue8m0: bool,
    },
    /// E2M1 pairs with one E8M0 exponent per 32 values.
    Mxfp4 {
        /// One byte per 32 values.
        scales: Span,
    },
    /// Symmetric int4 codes (stored as `q + 8`, eight per little-endian
    /// int32) with one scale per 32 values along the last axis.
    PackedInt4 {
        /// The `weight_scale` tensor's bytes, one scale per 32 values.
        scales: Span,
        /// Their type (BF16 on the Hub; F16 and F32 are read too).
        scale_dtype: DType,
    },
    /// Whole numbers (`I64` or `I32`, little-endian), read as f32: index
    /// tables such as DeepSeek-V4's token → experts map. A value beyond
    /// f32's exact integers (2^24) is an error.
    Int {
        /// Bytes per value (8 or 4).
        bytes: usize,
    },
}

/// What the scales of one int4 tensor allow ([`Checkpoint::int4_scales`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Int4Scales {
    /// Groups of 32 values.
    pub groups: usize,
    /// Groups whose scale is within f16's range but not an f16 value.
    pub inexact: usize,
    /// Groups whose scale is beyond f16's range.
    pub overflow: usize,
}

/// A raw safetensors entry before quantisation companions are resolved.
struct RawTensor {
    dtype: String,
    shape: Vec<usize>,
    at: Span,
}

/// All tensors of a checkpoint folder.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    tensors: BTreeMap<String, SrcTensor>,
}

/// An E8M0 exponent byte as the f32 `2^(b − 127)` (255 is NaN).
fn e8m0(b: u8) -> f32 {
    match b {
        0 => f32::from_bits(0x0040_0000), // 2^-127, a subnormal
        255 => f32::NAN,
        _ => f32::from_bits(u32::from(b) << 23),
    }
}

/// The scale tensor beside the quantised tensor `name` (`X.weight`):
/// `X.weight_scale_inv` (transformers) or `X.scale` (DeepSeek's own files),
/// taken out of `raw`.
fn take_scale(raw: &mut BTreeMap<String, RawTensor>, name: &str) -> Option<(String, RawTensor)> {
    let own = name.strip_suffix(".weight").map(|b| format!("{b}.scale"));
    [Some(format!("{name}_scale_inv")), own].into_iter().flatten().find_map(|n| raw.remove(&n).map(|t| (n, t)))
}

fn st_dtype(s: &str) -> Option<DType> {
    match s {
        "F32" => Some(DType::F32),
        "BF16" => Some(DType::Bf16),
        "F16" => Some(DType::F16),
        _ => None,
    }
}

impl Checkpoint {
    /// Opens every safetensors file of `dir` (via the index when there is one).
    pub fn open(dir: &Path, quant: Option<&Value>) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let names: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: Value =
                serde_json::from_str(&text).map_err(|e| Error::checkpoint(&index, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| Error::checkpoint(&index, "has no `weight_map` object"))?;
            let mut files: Vec<String> = map.values().filter_map(Value::as_str).map(String::from).collect();
            files.sort();
            files.dedup();
            for f in &files {
                // One plain file name: no folders, no `..`, no drive or root
                // (which `Path::join` would let replace the folder).
                let mut parts = Path::new(f).components();
                let plain = matches!(parts.next(), Some(std::path::Component::Normal(_))) && parts.next().is_none();
                if !plain || f.contains('/') || f.contains('\\') || f.contains("..") || f.contains(':') {
                    return Err(Error::checkpoint(&index, format!("weight_map names a file outside the folder: {f}")));
                }
            }
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if single.exists() {
                vec![single]
            } else {
                let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
                let mut v: Vec<PathBuf> = rd
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .collect();
                v.sort();
                v
            }
        };
        if names.is_empty() {
            return Err(Error::checkpoint(
                dir,
                "no *.safetensors weights found (only safetensors checkpoints are supported)",
            ));
        }
        let mut ck = Checkpoint { dir: dir.to_path_buf(), files: Vec::new(), tensors: BTreeMap::new() };
        let mut raw = BTreeMap::new();
        for p in names {
            ck.add_file(&p, &mut raw)?;
        }
        ck.resolve(raw, quant)?;
        Ok(ck)
    }

    /// Turns raw entries into logical tensors: plain types as they are, FP8
    /// and MXFP4 codes joined with their scales as `quant` (config.json's
    /// `quantization_config`) declares.
    fn resolve(&mut self, mut raw: BTreeMap<String, RawTensor>, quant: Option<&Value>) -> Result<()> {
        let method = quant.and_then(|q| q.get("quant_method")).and_then(Value::as_str);
        let cfg_err = |m: String| Error::checkpoint(&self.dir.join("config.json"), m);
        match method {
            None | Some("fp8") | Some("mxfp4") => {}
            Some("compressed-tensors") => {
                check_compressed_tensors(quant.expect("a method implies the config")).map_err(cfg_err)?
            }
            Some(other) => {
                return Err(cfg_err(format!(
                    "quantization_config.quant_method \"{other}\" is not supported (supported: fp8 with block \
                     scales, mxfp4, compressed-tensors pack-quantized int4)"
                )));
            }
        }
        let fp8_block = match method {
            Some("fp8") => {
                let q = quant.expect("a method implies the config");
                if let Some(fmt) = q.get("fmt").and_then(Value::as_str)
                    && fmt != "e4m3"
                {
                    return Err(cfg_err(format!("fp8 format \"{fmt}\" is not supported (only e4m3)")));
                }
                let b: Option<Vec<usize>> = q
                    .get("weight_block_size")
                    .and_then(Value::as_array)
                    .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect());
                match b.as_deref() {
                    Some(&[b0, b1]) if b0 > 0 && b1 > 0 => Some([b0, b1]),
                    _ => {
                        return Err(cfg_err(
                            "fp8 quantization_config needs `weight_block_size` as two positive integers (per-tensor FP8 scales are not supported)".into(),
                        ));
                    }
                }
            }
            _ => None,
        };
        let names: Vec<String> = raw.keys().cloned().collect();
        for name in names {
            let Some(t) = raw.get(&name) else { continue }; // consumed as a companion
            let file = self.files[t.at.file].0.clone();
            let bad = |m: String| Error::checkpoint(&file, m);
            match t.dtype.as_str() {
                // Names sort before their `_scale_inv` / `_scales` companions, so
                // a companion seen here has no tensor and is left to the
                // converter's unused-tensor check.
                // DeepSeek's `X.scale` sorts before its `X.weight`, which takes it.
                "F8_E8M0" | "U8" | "F32"
                    if name.strip_suffix(".scale").is_some_and(|b| {
                        raw.get(&format!("{b}.weight")).is_some_and(|w| matches!(w.dtype.as_str(), "F8_E4M3" | "I8"))
                    }) => {}
                "F32" | "BF16" | "F16" => self.plain(&name, raw.remove(&name).expect("present"))?,
                "I64" | "I32" if !name.ends_with("_packed") && !name.ends_with("_shape") => {
                    let t = raw.remove(&name).expect("present");
                    let bytes = if t.dtype == "I64" { 8 } else { 4 };
                    self.insert(&name, SrcTensor { enc: Encoding::Int { bytes }, shape: t.shape, at: t.at })?;
                }
                "F8_E4M3" => {
                    let Some(block) = fp8_block else {
                        return Err(bad(format!(
                            "tensor {name} is F8_E4M3, but config.json declares no fp8 quantization_config with weight_block_size"
                        )));
                    };
                    let t = raw.remove(&name).expect("present");
                    let (sname, s) = take_scale(&mut raw, &name)
                        .ok_or_else(|| bad(format!("FP8 tensor {name} has no {name}_scale_inv")))?;
                    let [rows, cols] = t.shape[..] else {
                        return Err(bad(format!("FP8 tensor {name} has shape {:?}; expected 2 dimensions", t.shape)));
                    };
                    let want = vec![rows.div_ceil(block[0]), cols.div_ceil(block[1])];
                    let ue8m0 = matches!(s.dtype.as_str(), "F8_E8M0" | "U8");
                    if !(s.dtype == "F32" || ue8m0) || s.shape != want {
                        return Err(bad(format!(
                            "{sname} is {} {:?}; FP8 tensor {name} [{rows}, {cols}] with blocks {block:?} needs F32 \
                             (or E8M0) {want:?}",
                            s.dtype, s.shape
                        )));
                    }
                    self.insert(
                        &name,
                        SrcTensor { enc: Encoding::Fp8 { scales: s.at, block, ue8m0 }, shape: t.shape, at: t.at },
                    )?;
                }
                // DeepSeek-V4's FP4 experts: E2M1 pairs in int8 bytes (low nibble
                // first) with one E8M0 exponent per 32 values along each row — the
                // MXFP4 layout, read as such.
                "I8" if method == Some("fp8") => {
                    let t = raw.remove(&name).expect("present");
                    let (sname, s) = take_scale(&mut raw, &name)
                        .ok_or_else(|| bad(format!("FP4 tensor {name} has no {name}_scale_inv")))?;
                    let [rows, half] = t.shape[..] else {
                        return Err(bad(format!("FP4 tensor {name} has shape {:?}; expected 2 dimensions", t.shape)));
                    };
                    let cols = 2 * half;
                    if !matches!(s.dtype.as_str(), "F8_E8M0" | "U8")
                        || s.shape != [rows, cols.div_ceil(32)]
                        || cols % 32 != 0
                    {
                        return Err(bad(format!(
                            "{sname} is {} {:?}; FP4 tensor {name} [{rows}, {cols}] needs E8M0 scales [{rows}, {}] \
                             (one per 32 values)",
                            s.dtype,
                            s.shape,
                            cols / 32
                        )));
                    }
                    self.insert(
                        &name,
                        SrcTensor { enc: Encoding::Mxfp4 { scales: s.at }, shape: vec![rows, cols], at: t.at },
                    )?;
                }
                "U8" if name.ends_with("_blocks") => {
                    let base = name.trim_end_matches("_blocks").to_string();
                    if method != Some("mxfp4") {
                        return Err(bad(format!(
                            "tensor {name} looks like MXFP4 blocks, but config.json declares no mxfp4 quantization_config"
                        )));
                    }
                    let t = raw.remove(&name).expect("present");
                    let sname = format!("{base}_scales");
                    let s = raw.remove(&sname).ok_or_else(|| bad(format!("MXFP4 tensor {name} has no {sname}")))?;
                    let n = t.shape.len();
                    if n < 2 || t.shape[n - 1] != 16 || s.dtype != "U8" || s.shape[..] != t.shape[..n - 1] {
                        return Err(bad(format!(
                            "MXFP4 tensor {base}: blocks {:?} and scales {} {:?} disagree (want blocks [.., G, 16] and U8 scales [.., G])",
                            t.shape, s.dtype, s.shape
                        )));
                    }
                    let mut shape = t.shape[..n - 2].to_vec();
                    shape.push(t.shape[n - 2] * 32);
                    self.insert(&base, SrcTensor { enc: Encoding::Mxfp4 { scales: s.at }, shape, at: t.at })?;
                }
                "I32" if name.ends_with(".weight_packed") => {
                    if method != Some("compressed-tensors") {
                        return Err(bad(format!(
                            "tensor {name} looks like packed int4 weights, but config.json declares no \
                             compressed-tensors quantization_config"
                        )));
                    }
                    let base = name.trim_end_matches("_packed").to_string();
                    let t = raw.remove(&name).expect("present");
                    let (sname, hname) = (format!("{base}_scale"), format!("{base}_shape"));
                    let s =
                        raw.remove(&sname).ok_or_else(|| bad(format!("packed int4 tensor {name} has no {sname}")))?;
                    let h =
                        raw.remove(&hname).ok_or_else(|| bad(format!("packed int4 tensor {name} has no {hname}")))?;
                    let shape = self.int4_shape(&base, &t, &s, &h).map_err(bad)?;
                    let scale_dtype = st_dtype(&s.dtype).expect("checked by int4_shape");
                    self.insert(
                        &base,
                        SrcTensor { enc: Encoding::PackedInt4 { scales: s.at, scale_dtype }, shape, at: t.at },
                    )?;
                }
                other => {
                    return Err(Error::Unsupported(format!(
                        "{}: tensor {name} has dtype {other}; supported source dtypes are F32, BF16, F16, and \
                         F8_E4M3 / MXFP4 / packed int4 with their scales",
                        file.display()
                    )));
                }
            }
        }
        Ok(())
    }

    /// The logical shape of the packed int4 tensor `base` (`M.weight`) from
    /// its `weight_shape`, checked against the codes and the scales.
    fn int4_shape(
        &self,
        base: &str,
        t: &RawTensor,
        s: &RawTensor,
        h: &RawTensor,
    ) -> std::result::Result<Vec<usize>, String> {
        let bytes = &self.files[h.at.file].1[h.at.start..h.at.end];
        let shape: Option<Vec<usize>> = match (h.dtype.as_str(), h.shape.as_slice()) {
            ("I32", [_]) => {
                bytes.chunks_exact(4).map(|c| usize::try_from(i32::from_le_bytes(c.try_into().ok()?)).ok()).collect()
            }
            ("I64", [_]) => {
                bytes.chunks_exact(8).map(|c| usize::try_from(i64::from_le_bytes(c.try_into().ok()?)).ok()).collect()
            }
            _ => None,
        };
        let Some(shape) = shape.filter(|v| v.len() >= 2) else {
            return Err(format!(
                "{base}_shape is {} {:?}; packed int4 tensor {base} needs the logical shape as a 1-D I32 or I64 list \
                 of at least two sizes",
                h.dtype, h.shape
            ));
        };
        let (lead, cols) = (&shape[..shape.len() - 1], shape[shape.len() - 1]);
        let with_last = |n: usize| lead.iter().copied().chain([n]).collect::<Vec<_>>();
        let (want_codes, want_scales) = (with_last(cols / 8), with_last(cols / dequant::INT4_GROUP));
        if !cols.is_multiple_of(dequant::INT4_GROUP) || t.shape != want_codes {
            return Err(format!(
                "packed int4 tensor {base}: {base}_packed {:?} does not hold the shape {shape:?} of {base}_shape \
                 (want rows of whole groups of {}: {want_codes:?})",
                t.shape,
                dequant::INT4_GROUP
            ));
        }
        if st_dtype(&s.dtype).is_none() || s.shape != want_scales {
            return Err(format!(
                "packed int4 tensor {base}: {base}_scale is {} {:?}; shape {shape:?} with groups of {} needs \
                 BF16, F16 or F32 {want_scales:?}",
                s.dtype,
                s.shape,
                dequant::INT4_GROUP
            ));
        }
        Ok(shape)
    }

    fn plain(&mut self, name: &str, t: RawTensor) -> Result<()> {
        let dtype = st_dtype(&t.dtype).expect("a plain type");
        self.insert(name, SrcTensor { enc: Encoding::Plain(dtype), shape: t.shape, at: t.at })
    }

    fn insert(&mut self, name: &str, t: SrcTensor) -> Result<()> {
        if self.tensors.insert(name.to_string(), t).is_some() {
            let f = self.dir.clone();
            return Err(Error::checkpoint(&f, format!("tensor {name} appears twice (also as quantised blocks?)")));
        }
        Ok(())
    }

    fn add_file(&mut self, path: &Path, raw: &mut BTreeMap<String, RawTensor>) -> Result<()> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only map of a checkpoint file that the converter only
        // reads; if another process truncates it meanwhile, reads may fault.
        // That is the documented mmap caveat; we never write through it.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let bad = |m: String| Error::checkpoint(path, m);
        if map.len() < 8 {
            return Err(bad("file too short to be safetensors".into()));
        }
        let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
        let hdr_end = 8u64.checked_add(n).filter(|&e| e <= map.len() as u64).ok_or_else(|| {
            bad(format!("header length {n} runs past the end of the {}-byte file; truncated?", map.len()))
        })? as usize;
        let hdr: HashMap<String, Value> =
            serde_json::from_slice(&map[8..hdr_end]).map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
        let data_len = map.len() - hdr_end;
        let fi = self.files.len();
        for (name, v) in hdr {
            if name == "__metadata__" {
                continue;
            }
            let dt = v.get("dtype").and_then(Value::as_str).unwrap_or("?");
            let shape: Vec<usize> = v
                .get("shape")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
                .ok_or_else(|| bad(format!("tensor {name} has no valid shape")))?;
            let offs: Vec<usize> = v
                .get("data_offsets")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
                .filter(|o: &Vec<usize>| o.len() == 2)
                .ok_or_else(|| bad(format!("tensor {name} has no valid data_offsets")))?;
            let (s, e) = (offs[0], offs[1]);
            let elem = match dt {
                "F32" | "I32" | "U32" => Some(4),
                "BF16" | "F16" | "I16" | "U16" => Some(2),
                "F8_E4M3" | "F8_E5M2" | "F8_E8M0" | "U8" | "I8" | "BOOL" => Some(1),
                "F64" | "I64" | "U64" => Some(8),
                _ => None,
            };
            let want = elem.and_then(|b| shape.iter().try_fold(b, |acc: usize, &d| acc.checked_mul(d)));
            if s > e || e > data_len || (elem.is_some() && Some(e - s) != want) {
                return Err(bad(format!(
                    "tensor {name}: data_offsets {s}..{e} do not fit its {dt} shape {shape:?} inside the {data_len} data bytes; truncated or corrupt file?"
                )));
            }
            let t =
                RawTensor { dtype: dt.to_string(), shape, at: Span { file: fi, start: hdr_end + s, end: hdr_end + e } };
            if raw.insert(name.clone(), t).is_some() {
                return Err(bad(format!("tensor {name} appears in more than one file")));
            }
        }
        self.files.push((path.to_path_buf(), map));
        Ok(())
    }

    /// The checkpoint folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Looks a tensor up by its Hub name.
    pub fn get(&self, name: &str) -> Option<&SrcTensor> {
        self.tensors.get(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    fn span(&self, s: Span) -> &[u8] {
        &self.files[s.file].1[s.start..s.end]
    }

    /// The bytes of a plain tensor (`None` for a quantised encoding).
    pub fn plain_bytes(&self, t: &SrcTensor) -> Option<(DType, &[u8])> {
        match t.enc {
            Encoding::Plain(d) => Some((d, self.span(t.at))),
            _ => None,
        }
    }

    /// Path of the file holding `t`.
    pub fn file_of(&self, t: &SrcTensor) -> &Path {
        &self.files[t.at.file].0
    }

    /// Decodes `t` to f32: all of it, or only slice `index` of its first axis.
    /// Returns the decoded shape and values.
    pub fn decode_f32(&self, name: &str, t: &SrcTensor, index: Option<usize>) -> Result<(Vec<usize>, Vec<f32>)> {
        let (shape, outer) = match index {
            None => (t.shape.clone(), 0),
            Some(i) => {
                if t.shape.len() < 2 || i >= t.shape[0] || matches!(t.enc, Encoding::Fp8 { .. }) {
                    return Err(Error::checkpoint(
                        self.file_of(t),
                        format!("tensor {name} of shape {:?} has no slice {i}", t.shape),
                    ));
                }
                (t.shape[1..].to_vec(), i)
            }
        };
        let n: usize = shape.iter().product();
        let mut out = vec![0.0f32; n];
        let bytes = self.span(t.at);
        match &t.enc {
            Encoding::Plain(d) => {
                let per = d.tensor_bytes(&[n]).expect("a plain type");
                let cols = *shape.last().unwrap_or(&1);
                crate::quant::decode(*d, &bytes[outer * per..(outer + 1) * per], cols.max(1), &mut out);
            }
            Encoding::Fp8 { scales, block, ue8m0 } => {
                // FP8 tensors are 2-D (checked when resolved), so never sliced.
                let (rows, cols) = (shape[0], shape[1]);
                let sc: Vec<f32> = if *ue8m0 {
                    self.span(*scales).iter().map(|&b| e8m0(b)).collect()
                } else {
                    self.span(*scales).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect()
                };
                super::dequant::dequant_fp8_block(bytes, rows, cols, &sc, *block, &mut out);
            }
            Encoding::PackedInt4 { scales, scale_dtype } => {
                let groups = n / dequant::INT4_GROUP;
                let sc = self.int4_scale_values(*scales, *scale_dtype, outer * groups, groups);
                let codes = &bytes[outer * groups * 16..(outer + 1) * groups * 16];
                dequant::dequant_int4(codes, &sc, &mut out);
            }
            Encoding::Int { bytes: w } => {
                let vals = &bytes[outer * n * w..(outer + 1) * n * w];
                for (o, c) in out.iter_mut().zip(vals.chunks_exact(*w)) {
                    let v = if *w == 8 {
                        i64::from_le_bytes(c.try_into().expect("8 bytes"))
                    } else {
                        i64::from(i32::from_le_bytes(c.try_into().expect("4 bytes")))
                    };
                    if v.unsigned_abs() > 1 << 24 {
                        return Err(Error::checkpoint(
                            self.file_of(t),
                            format!("integer tensor {name}: value {v} is beyond what f32 holds exactly"),
                        ));
                    }
                    *o = v as f32;
                }
            }
            Encoding::Mxfp4 { scales } => {
                let groups = n / 32;
                let sc = &self.span(*scales)[outer * groups..(outer + 1) * groups];
                let codes = &bytes[outer * groups * 16..(outer + 1) * groups * 16];
                if let Err(g) = super::dequant::dequant_mxfp4(codes, sc, &mut out) {
                    return Err(Error::checkpoint(
                        self.file_of(t),
                        format!("MXFP4 tensor {name}: scale {} is 255 (NaN)", outer * groups + g),
                    ));
                }
            }
        }
        Ok((shape, out))
    }

    /// `count` scales of an int4 tensor from group `first` on, as f32.
    fn int4_scale_values(&self, scales: Span, dtype: DType, first: usize, count: usize) -> Vec<f32> {
        let per = dtype.tensor_bytes(&[1]).expect("an element type");
        let bytes = &self.span(scales)[first * per..(first + count) * per];
        let mut out = vec![0f32; count];
        crate::quant::decode(dtype, bytes, 1, &mut out);
        out
    }

    /// Reads every scale of the int4 tensor `t` (named `name`) and sorts
    /// them by how q4_0 can hold them; a NaN or infinite scale is an error.
    pub fn int4_scales(&self, name: &str, t: &SrcTensor) -> Result<Int4Scales> {
        let Encoding::PackedInt4 { scales, scale_dtype } = t.enc else {
            return Ok(Int4Scales::default());
        };
        let groups = t.shape.iter().product::<usize>() / dequant::INT4_GROUP;
        let mut out = Int4Scales { groups, ..Default::default() };
        // In slices of 64k scales, so memory stays flat on huge tensors.
        let step = 1 << 16;
        for first in (0..groups).step_by(step) {
            let sc = self.int4_scale_values(scales, scale_dtype, first, step.min(groups - first));
            for (i, &s) in sc.iter().enumerate() {
                match dequant::scale_fit(s) {
                    dequant::ScaleFit::Exact => {}
                    dequant::ScaleFit::Inexact => out.inexact += 1,
                    dequant::ScaleFit::Overflow => out.overflow += 1,
                    dequant::ScaleFit::NotFinite => {
                        return Err(Error::checkpoint(
                            self.file_of(t),
                            format!("packed int4 tensor {name}: scale {} is {s}", first + i),
                        ));
                    }
                }
            }
        }
        Ok(out)
    }

    /// The int4 tensor `t` (or slice `index` of its first axis, one expert
    /// of a stacked tensor) as `dtype` (q4_0 or its interleaved q4_0x8):
    /// each group whose scale is an f16 becomes a q4_0 block as it is, any
    /// other is quantised from its exact values (`dequant::int4_to_q4_0`).
    /// The caller has checked that no scale overflows f16
    /// ([`Checkpoint::int4_scales`]) and that a slice exists.
    pub fn int4_as_q4_0(&self, t: &SrcTensor, dtype: DType, index: Option<usize>) -> Vec<u8> {
        use crate::quant::q4_0::BlockQ4_0;
        use crate::quant::x8::{self, BlockQ4_0x8};
        let Encoding::PackedInt4 { scales, scale_dtype } = t.enc else {
            unreachable!("int4_as_q4_0 takes packed int4 tensors")
        };
        debug_assert_eq!(dtype.base(), DType::Q4_0);
        let all = t.shape.iter().product::<usize>() / dequant::INT4_GROUP;
        let (first, groups) = match index {
            None => (0, all),
            Some(i) => (i * (all / t.shape[0]), all / t.shape[0]),
        };
        let sc = self.int4_scale_values(scales, scale_dtype, first, groups);
        let half = dequant::INT4_GROUP / 2;
        let blocks: Vec<BlockQ4_0> = self.span(t.at)[first * half..(first + groups) * half]
            .chunks_exact(half)
            .zip(&sc)
            .map(|(p, &s)| dequant::int4_to_q4_0(p, s))
            .collect();
        if dtype == DType::Q4_0 {
            return bytemuck::cast_slice(&blocks).to_vec();
        }
        let nb = t.shape[t.shape.len() - 1] / dequant::INT4_GROUP;
        let mut grouped = vec![BlockQ4_0x8 { d: [0; 8], qs: [0; 128] }; blocks.len() / x8::ROWS];
        x8::pack::<BlockQ4_0x8>(&blocks, nb, &mut grouped);
        bytemuck::cast_slice(&grouped).to_vec()
    }
}

/// Checks that a compressed-tensors `quantization_config` describes what
/// colibri reads: the `pack-quantized` format with every config group's
/// weights symmetric int4 in groups of 32, static, without activation
/// order or block structure, and no activation or KV-cache quantisation.
/// The error names the key.
pub fn check_compressed_tensors(q: &Value) -> std::result::Result<(), String> {
    let key = "quantization_config";
    // "mixed-precision" names the format per config group instead.
    let mixed = q.get("format").and_then(Value::as_str) == Some("mixed-precision");
    if !mixed && q.get("format").and_then(Value::as_str) != Some("pack-quantized") {
        return Err(format!(
            "{key}.format is {}; of compressed-tensors checkpoints only \"pack-quantized\" (int4 in groups of 32) is supported",
            q.get("format").map_or("missing".into(), Value::to_string)
        ));
    }
    if let Some(kv) = q.get("kv_cache_scheme").filter(|v| !v.is_null()) {
        return Err(format!("{key}.kv_cache_scheme {kv} is not supported (a quantised KV cache)"));
    }
    let groups = q
        .get("config_groups")
        .and_then(Value::as_object)
        .filter(|g| !g.is_empty())
        .ok_or_else(|| format!("{key}.config_groups is missing or empty"))?;
    for (g, scheme) in groups {
        let at = format!("{key}.config_groups.{g}");
        let f = scheme.get("format").filter(|v| !v.is_null());
        if (mixed || f.is_some()) && f.and_then(Value::as_str) != Some("pack-quantized") {
            let f = f.map_or("missing".into(), Value::to_string);
            return Err(format!("{at}.format is {f}; only \"pack-quantized\" is supported"));
        }
        for side in ["input_activations", "output_activations"] {
            if let Some(a) = scheme.get(side).filter(|v| !v.is_null()) {
                return Err(format!("{at}.{side} is {a}; quantised activations are not supported (weights only)"));
            }
        }
        let w = scheme.get("weights").filter(|v| v.is_object()).ok_or_else(|| format!("{at}.weights is missing"))?;
        let want = [
            ("num_bits", Value::from(4)),
            ("type", Value::from("int")),
            ("symmetric", Value::from(true)),
            ("strategy", Value::from("group")),
            ("group_size", Value::from(dequant::INT4_GROUP)),
        ];
        for (k, v) in want {
            let got = w.get(k);
            // Numbers compare by value (a group size may be written 32.0).
            let same = match (got.and_then(Value::as_f64), v.as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => got == Some(&v),
            };
            if !same {
                return Err(format!(
                    "{at}.weights.{k} is {}; colibri reads symmetric int4 with one scale per group of 32 \
                     (num_bits 4, type int, symmetric true, strategy group, group_size 32)",
                    got.map_or("missing".into(), Value::to_string)
                ));
            }
        }
        for k in ["actorder", "block_structure"] {
            if let Some(v) = w.get(k).filter(|v| !v.is_null() && *v != &Value::Bool(false)) {
                return Err(format!("{at}.weights.{k} is {v}; not supported"));
            }
        }
        if let Some(v) = w.get("dynamic").filter(|v| !v.is_null() && **v != Value::Bool(false)) {
            return Err(format!("{at}.weights.dynamic is {v}; only static weight scales are supported"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of `(name, dtype, shape, bytes)`.
    fn write(path: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let e = serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]});
            header.insert(name.to_string(), e);
            data.extend_from_slice(bytes);
        }
        let h = serde_json::to_vec(&header).unwrap();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(data);
        std::fs::write(path, out).unwrap();
    }

    fn int4_config() -> Value {
        serde_json::json!({
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"g": {"weights": {
                "num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32
            }}}
        })
    }

    /// `rows × cols` packed int4 codes, their bf16 scales (one set to an inexact value) and `weight_shape`.
    fn packed(base: &str, rows: usize, cols: usize) -> Vec<(String, &'static str, Vec<usize>, Vec<u8>)> {
        let codes: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 37 % 256) as u8).collect();
        let mut scales: Vec<u16> =
            (0..rows * cols / 32).map(|g| half::bf16::from_f32(0.01 * (g as f32 + 1.0)).to_bits()).collect();
        scales[1] = half::bf16::from_f32(1.0e-6).to_bits();
        vec![
            (format!("{base}_packed"), "I32", vec![rows, cols / 8], codes),
            (
                format!("{base}_scale"),
                "BF16",
                vec![rows, cols / 32],
                scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            ),
            (
                format!("{base}_shape"),
                "I32",
                vec![2],
                [rows as i32, cols as i32].iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
        ]
    }

    /// DeepSeek-V4's Hub formats: FP4 experts (E2M1 pairs in I8 bytes, an
    /// E8M0 exponent per 32 values, `.scale` beside `.weight`) read as
    /// MXFP4; FP8 with E8M0 block scales; an I64 token → experts table read
    /// as whole f32 values.
    #[test]
    fn deepseek_v4_fp4_fp8_and_index_tables_read_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let (rows, cols) = (2usize, 64usize);
        let codes: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 29 % 256) as u8).collect();
        let scales: Vec<u8> = vec![126, 127, 128, 130]; // 2^-1, 1, 2, 8 per 32 values
        let fp8: Vec<u8> = (0..4 * 4).map(|i| [0x38u8, 0xb8, 0x40, 0x00][i % 4]).collect(); // 1, -1, 2, 0
        let table: Vec<u8> = [3i64, 0, 5, 1].iter().flat_map(|v| v.to_le_bytes()).collect();
        write(
            &dir.path().join("model.safetensors"),
            &[
                ("e.w1.weight", "I8", vec![rows, cols / 2], codes.clone()),
                ("e.w1.scale", "F8_E8M0", vec![rows, cols / 32], scales.clone()),
                ("d.weight", "F8_E4M3", vec![4, 4], fp8),
                ("d.weight_scale_inv", "F8_E8M0", vec![2, 2], vec![127, 128, 126, 129]),
                ("g.tid2eid", "I64", vec![2, 2], table),
            ],
        );
        let q = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [2, 2],
            "scale_fmt": "ue8m0", "expert_dtype": "fp4"});
        let ck = Checkpoint::open(dir.path(), Some(&q)).unwrap();
        assert_eq!(ck.names().collect::<Vec<_>>(), ["d.weight", "e.w1.weight", "g.tid2eid"]);
        let t = ck.get("e.w1.weight").unwrap();
        assert!(matches!(t.enc, Encoding::Mxfp4 { .. }) && t.shape == [rows, cols]);
        let (_, got) = ck.decode_f32("e.w1.weight", t, None).unwrap();
        let lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
        for (i, &v) in got.iter().enumerate() {
            let nib = if i % 2 == 0 { codes[i / 2] & 15 } else { codes[i / 2] >> 4 };
            let scale = 2f32.powi(scales[i / 32] as i32 - 127);
            assert_eq!(v, lut[nib as usize] * scale, "value {i}");
        }
        let (_, d) = ck.decode_f32("d.weight", ck.get("d.weight").unwrap(), None).unwrap();
        // Row 0: blocks scaled 1 and 2; row 2: 0.5 and 4.
        assert_eq!(&d[..4], &[1.0, -1.0, 4.0, 0.0]);
        assert_eq!(&d[8..12], &[0.5, -0.5, 8.0, 0.0]);
        let (_, tab) = ck.decode_f32("g.tid2eid", ck.get("g.tid2eid").unwrap(), None).unwrap();
        assert_eq!(tab, [3.0, 0.0, 5.0, 1.0]);
    }

    #[test]
    fn int4_tensor_reads_as_q4_0_rows_or_groups_of_eight() {
        let dir = tempfile::tempdir().unwrap();
        let mut tensors = packed("a.weight", 3, 64);
        tensors.extend(packed("b.weight", 16, 32));
        let named: Vec<(&str, &str, Vec<usize>, Vec<u8>)> =
            tensors.iter().map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone())).collect();
        write(&dir.path().join("model.safetensors"), &named);
        let ck = Checkpoint::open(dir.path(), Some(&int4_config())).unwrap();
        assert_eq!(ck.names().collect::<Vec<_>>(), ["a.weight", "b.weight"]);
        for (name, dtype) in [("a.weight", DType::Q4_0), ("b.weight", DType::Q4_0x8), ("b.weight", DType::Q4_0)] {
            let t = ck.get(name).unwrap();
            let c = ck.int4_scales(name, t).unwrap();
            assert_eq!((c.groups, c.inexact, c.overflow), (t.shape[0] * t.shape[1] / 32, 1, 0));
            let (shape, exact) = ck.decode_f32(name, t, None).unwrap();
            let bytes = ck.int4_as_q4_0(t, dtype, None);
            assert_eq!(Some(bytes.len()), dtype.tensor_bytes(&shape));
            let aligned: Vec<u16> = bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
            let mut back = vec![0f32; exact.len()];
            crate::quant::decode(dtype, bytemuck::cast_slice(&aligned), shape[1], &mut back);
            // Every group but the inexact one (group 1) comes back exactly.
            for (g, (x, y)) in back.chunks_exact(32).zip(exact.chunks_exact(32)).enumerate() {
                if g != 1 {
                    assert_eq!(x, y, "{name} {dtype} group {g}");
                }
            }
        }
    }

    #[test]
    fn int4_stacked_tensor_slices_read_as_q4_0() {
        let dir = tempfile::tempdir().unwrap();
        let (e, rows, cols) = (3usize, 8usize, 64usize);
        let codes: Vec<u8> = (0..e * rows * cols / 2).map(|i| (i * 53 % 256) as u8).collect();
        let scales: Vec<u8> = (0..e * rows * cols / 32)
            .flat_map(|g| half::bf16::from_f32(0.003 * (g as f32 + 1.0)).to_bits().to_le_bytes())
            .collect();
        let shape: Vec<u8> = [e as i64, rows as i64, cols as i64].iter().flat_map(|v| v.to_le_bytes()).collect();
        write(
            &dir.path().join("model.safetensors"),
            &[
                ("x.weight_packed", "I32", vec![e, rows, cols / 8], codes),
                ("x.weight_scale", "BF16", vec![e, rows, cols / 32], scales),
                ("x.weight_shape", "I64", vec![3], shape),
            ],
        );
        let ck = Checkpoint::open(dir.path(), Some(&int4_config())).unwrap();
        let t = ck.get("x.weight").unwrap();
        assert_eq!(t.shape, [e, rows, cols]);
        for i in 0..e {
            let (shape, exact) = ck.decode_f32("x.weight", t, Some(i)).unwrap();
            assert_eq!(shape, [rows, cols]);
            let bytes = ck.int4_as_q4_0(t, DType::Q4_0x8, Some(i));
            let aligned: Vec<u16> = bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
            let mut back = vec![0f32; exact.len()];
            crate::quant::decode(DType::Q4_0x8, bytemuck::cast_slice(&aligned), cols, &mut back);
            assert_eq!(back, exact, "expert {i}");
        }
    }
}
