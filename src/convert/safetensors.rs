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
//!
//! The companion tensors are consumed into the tensor they scale, so the
//! converter's "every tensor used" check sees only logical tensors.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde_json::Value;

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
        /// The `_scale_inv` tensor's bytes: `[ceil(rows/b0), ceil(cols/b1)]` f32.
        scales: Span,
        /// Block size (rows, cols).
        block: [usize; 2],
    },
    /// E2M1 pairs with one E8M0 exponent per 32 values.
    Mxfp4 {
        /// One byte per 32 values.
        scales: Span,
    },
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
            Some(other) => {
                return Err(cfg_err(format!(
                    "quantization_config.quant_method \"{other}\" is not supported (supported: fp8 with block scales, mxfp4)"
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
                "F32" | "BF16" | "F16" => self.plain(&name, raw.remove(&name).expect("present"))?,
                "F8_E4M3" => {
                    let Some(block) = fp8_block else {
                        return Err(bad(format!(
                            "tensor {name} is F8_E4M3, but config.json declares no fp8 quantization_config with weight_block_size"
                        )));
                    };
                    let t = raw.remove(&name).expect("present");
                    let sname = format!("{name}_scale_inv");
                    let s = raw.remove(&sname).ok_or_else(|| bad(format!("FP8 tensor {name} has no {sname}")))?;
                    let [rows, cols] = t.shape[..] else {
                        return Err(bad(format!("FP8 tensor {name} has shape {:?}; expected 2 dimensions", t.shape)));
                    };
                    let want = vec![rows.div_ceil(block[0]), cols.div_ceil(block[1])];
                    if s.dtype != "F32" || s.shape != want {
                        return Err(bad(format!(
                            "{sname} is {} {:?}; FP8 tensor {name} [{rows}, {cols}] with blocks {block:?} needs F32 {want:?}",
                            s.dtype, s.shape
                        )));
                    }
                    self.insert(
                        &name,
                        SrcTensor { enc: Encoding::Fp8 { scales: s.at, block }, shape: t.shape, at: t.at },
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
                other => {
                    return Err(Error::Unsupported(format!(
                        "{}: tensor {name} has dtype {other}; supported source dtypes are F32, BF16, F16, and F8_E4M3 / MXFP4 with their scales",
                        file.display()
                    )));
                }
            }
        }
        Ok(())
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
                "F8_E4M3" | "F8_E5M2" | "U8" | "I8" | "BOOL" => Some(1),
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
            Encoding::Fp8 { scales, block } => {
                // FP8 tensors are 2-D (checked when resolved), so never sliced.
                let (rows, cols) = (shape[0], shape[1]);
                let sc: Vec<f32> =
                    self.span(*scales).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect();
                super::dequant::dequant_fp8_block(bytes, rows, cols, &sc, *block, &mut out);
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
}
