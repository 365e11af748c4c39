//! Reading Hugging Face safetensors checkpoints, single-file or sharded.
//!
//! A safetensors file is an 8-byte little-endian header length `n`, `n` bytes
//! of JSON mapping each tensor name to `{dtype, shape, data_offsets}`, then the
//! raw data; offsets are relative to the end of the JSON. Sharded checkpoints
//! add `model.safetensors.index.json` whose `weight_map` names each tensor's
//! file. Every file is mapped read-only and validated before use.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::quant::DType;

/// One source tensor: where its bytes are and what they hold.
#[derive(Clone, Debug)]
pub struct SrcTensor {
    /// Element type.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Index of the file in [`Checkpoint::files`].
    file: usize,
    /// Absolute byte range in that file.
    start: usize,
    end: usize,
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
    pub fn open(dir: &Path) -> Result<Checkpoint> {
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
                if f.contains('/') || f.contains('\\') || f.contains("..") {
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
        for p in names {
            ck.add_file(&p)?;
        }
        Ok(ck)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
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
            let dtype = st_dtype(dt).ok_or_else(|| {
                Error::Unsupported(format!(
                    "{}: tensor {name} has dtype {dt}; supported source dtypes are F32, BF16, F16",
                    path.display()
                ))
            })?;
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
            let want = dtype.tensor_bytes(&shape);
            if s > e || e > data_len || Some(e - s) != want {
                return Err(bad(format!(
                    "tensor {name}: data_offsets {s}..{e} do not fit its {dt} shape {shape:?} inside the {data_len} data bytes; truncated or corrupt file?"
                )));
            }
            let t = SrcTensor { dtype, shape, file: fi, start: hdr_end + s, end: hdr_end + e };
            if self.tensors.insert(name.clone(), t).is_some() {
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

    /// The raw bytes of a tensor.
    pub fn bytes(&self, t: &SrcTensor) -> &[u8] {
        &self.files[t.file].1[t.start..t.end]
    }

    /// Path of the file holding `t`.
    pub fn file_of(&self, t: &SrcTensor) -> &Path {
        &self.files[t.file].0
    }
}
