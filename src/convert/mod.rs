//! Hugging Face folder → `.colibri` file.
//!
//! 1. Read config.json, pick the adapter from [`crate::arch::REGISTRY`], build
//!    the canonical config.
//! 2. Open the safetensors files and check that every tensor the canonical
//!    plan needs is there with the right shape, and that every source tensor
//!    was used (a tensor left over means the adapter misunderstood the model).
//! 3. Lay out the file, then stream each tensor through the dtype conversion
//!    into a temporary file beside the output, and rename it into place only
//!    when complete: a failed or interrupted conversion leaves nothing behind,
//!    and an existing output is only replaced when `force` is set.
//!
//! A `.colibri` file as the source is re-encoded into another weight type
//! instead (`recode.rs`).

mod recode;
pub mod safetensors;

use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;

use crate::arch::{self, HfConfig};
use crate::error::{Error, Result};
use crate::format::writer::{ToPlace, Writer, layout};
use crate::format::{FileMeta, SourceInfo};
use crate::model::tensors::{Role, TensorId, tensor_plan};
use crate::quant::{self, DType};
use safetensors::Checkpoint;

/// Conversion settings.
#[derive(Clone, Debug, Default)]
pub struct ConvertOptions {
    /// Storage type of the large matrices; `None` keeps the source's type.
    pub dtype: Option<DType>,
    /// Replace an existing output file.
    pub force: bool,
    /// Draw a progress bar on stderr (only when it is a terminal).
    pub progress: bool,
}

/// What a conversion produced.
#[derive(Clone, Debug)]
pub struct ConvertReport {
    /// The output file.
    pub path: PathBuf,
    /// The architecture converted.
    pub architecture: String,
    /// Storage type of the matrices.
    pub dtype: DType,
    /// Number of tensors written.
    pub tensors: usize,
    /// Output size in bytes.
    pub bytes: u64,
}

/// Source tensors that carry no weights and are safe to drop.
fn ignorable(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map(Some).map_err(|e| Error::checkpoint(path, format!("not valid JSON: {e}")))
}

/// Storage type of one tensor of `shape`: small tensors in f32; matrices in
/// the requested type, except that a block type needs rows of whole 32-value
/// blocks (a matrix whose row length is not one, only in toy models, is kept
/// in bf16). Block-type matrices whose row count is a multiple of 8 are
/// stored interleaved (`q8_0x8`, ...: the same values, in the order the
/// kernels read them).
pub fn storage_dtype(role: Role, weights: DType, shape: &[usize]) -> DType {
    let cols = *shape.last().unwrap_or(&1);
    let rows: usize = shape[..shape.len().saturating_sub(1)].iter().product();
    match role {
        Role::Small => DType::F32,
        Role::Matrix if weights.row_bytes(cols).is_none() => DType::Bf16,
        Role::Matrix => match weights.interleaved() {
            Some(x8) if rows.is_multiple_of(x8.group_rows()) => x8,
            _ => weights,
        },
    }
}

/// Deletes the temporary output unless the conversion completed.
struct TempGuard(Option<PathBuf>);

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Writes `meta` into a hidden temporary beside `dst` and returns its guard
/// (the temporary is removed unless [`commit`] renames it into place).
/// `source(i)` gives the stored type and bytes of tensor `i`; a tensor whose
/// type differs from the planned one is decoded to f32 and encoded again, in
/// chunks of about 1M values so memory stays flat on huge tensors. `verb`
/// labels the progress bar; `interrupted` is polled between tensors.
fn write_staged<'a>(
    dst: &Path,
    meta: &FileMeta,
    verb: &str,
    progress: bool,
    interrupted: &dyn Fn() -> bool,
    source: &dyn Fn(usize) -> (DType, &'a [u8]),
) -> Result<TempGuard> {
    let file_name =
        dst.file_name().ok_or_else(|| Error::InvalidInput(format!("output {} has no file name", dst.display())))?;
    let tmp = dst.with_file_name(format!(".{}.partial-{}", file_name.to_string_lossy(), std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let guard = TempGuard(Some(tmp.clone()));
    let mut w = Writer::create(&tmp, meta)?;

    let total: u64 = meta.tensors.iter().map(|t| t.nbytes).sum();
    let bar = if progress {
        let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        b.set_style(
            ProgressStyle::with_template(&format!("{verb} {{bar:40}} {{bytes}}/{{total_bytes}} ({{eta}}) {{msg}}"))
                .expect("static template")
                .progress_chars("=> "),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    let mut f32_buf: Vec<f32> = Vec::new();
    // u16 storage keeps the encoder's output aligned for the 2-byte block fields.
    let mut out_buf: Vec<u16> = Vec::new();
    for (i, entry) in meta.tensors.iter().enumerate() {
        if interrupted() {
            bar.abandon_with_message("interrupted");
            return Err(Error::Interrupted);
        }
        let (dtype, raw) = source(i);
        w.begin(&entry.name)?;
        if dtype == entry.dtype {
            w.write(raw)?;
        } else {
            let cols = *entry.shape.last().unwrap_or(&1);
            let in_row = dtype.row_bytes(cols).expect("validated");
            let out_row = entry.dtype.row_bytes(cols).expect("chosen by storage_dtype");
            let rows_total = raw.len() / in_row.max(1);
            // Whole groups of eight rows when either side is interleaved
            // (both group sizes are 1 or 8).
            let group = dtype.group_rows().max(entry.dtype.group_rows());
            let rows_per = ((1 << 20) / cols.max(1)).max(1).next_multiple_of(group);
            let mut r = 0;
            while r < rows_total {
                let n = rows_per.min(rows_total - r);
                f32_buf.resize(n * cols, 0.0);
                quant::decode(dtype, &raw[r * in_row..(r + n) * in_row], cols, &mut f32_buf);
                let nbytes = out_row * n;
                out_buf.resize(nbytes.div_ceil(2), 0);
                let out = &mut bytemuck::cast_slice_mut::<u16, u8>(&mut out_buf)[..nbytes];
                quant::encode(entry.dtype, &f32_buf, cols, out);
                w.write(out)?;
                r += n;
            }
        }
        w.end();
        bar.inc(entry.nbytes);
    }
    w.finish()?;
    bar.finish_and_clear();
    Ok(guard)
}

/// Renames a staged output into place; returns its size in bytes.
fn commit(mut staged: TempGuard, dst: &Path) -> Result<u64> {
    let tmp = staged.0.clone().expect("a staged output has its temporary");
    std::fs::rename(&tmp, dst).map_err(|e| Error::io(dst, e))?;
    staged.0 = None;
    Ok(std::fs::metadata(dst).map_err(|e| Error::io(dst, e))?.len())
}

/// Converts the Hugging Face checkpoint in `src` into the `.colibri` file `dst`.
/// When `src` is a `.colibri` file, re-encodes it into `opts.dtype` instead.
/// `interrupted` is polled between tensors; when it returns true the
/// conversion stops with [`Error::Interrupted`] and removes its partial output.
pub fn convert(src: &Path, dst: &Path, opts: &ConvertOptions, interrupted: &dyn Fn() -> bool) -> Result<ConvertReport> {
    if !src.exists() {
        return Err(Error::NotFound(src.to_path_buf()));
    }
    if dst.is_dir() {
        return Err(Error::InvalidInput(format!("output {} is a directory; give a file name", dst.display())));
    }
    if dst.exists() && !opts.force {
        return Err(Error::OutputExists(dst.to_path_buf()));
    }
    if !src.is_dir() {
        return recode::recode(src, dst, opts, interrupted);
    }
    let cfg_path = src.join("config.json");
    if !cfg_path.exists() {
        return Err(Error::checkpoint(src, "has no config.json; is this a Hugging Face checkpoint folder?"));
    }
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
    let hf = HfConfig::parse(&cfg_path, &text)?;
    let arch = arch::lookup(&hf)?;
    let cfg = (arch.config)(&hf)?;
    cfg.validate().map_err(|e| Error::checkpoint(&cfg_path, e.to_string()))?;

    let ck = Checkpoint::open(src)?;
    let plan = tensor_plan(&cfg);

    // Map every planned tensor to its source, checking presence and shape.
    let mut sources = Vec::with_capacity(plan.len());
    let mut missing = Vec::new();
    for p in &plan {
        let name = (arch.hf_name)(&cfg, p.id);
        match ck.get(&name) {
            None => missing.push(format!("{name} (shape {:?})", p.shape)),
            Some(t) => {
                if t.shape != p.shape {
                    return Err(Error::checkpoint(
                        ck.file_of(t),
                        format!("tensor {name} has shape {:?}, but config.json implies {:?}", t.shape, p.shape),
                    ));
                }
                sources.push((p, name, t.clone()));
            }
        }
    }
    if !missing.is_empty() {
        let more = if missing.len() > 5 { format!(" and {} more", missing.len() - 5) } else { String::new() };
        return Err(Error::checkpoint(
            src,
            format!(
                "{} is missing {} tensor(s): {}{more}",
                arch.hf_class,
                missing.len(),
                missing[..missing.len().min(5)].join(", ")
            ),
        ));
    }
    let used: std::collections::HashSet<&str> = sources.iter().map(|(_, n, _)| n.as_str()).collect();
    let tied_head = |n: &str| cfg.tie_embeddings && n == "lm_head.weight";
    let unused: Vec<&str> = ck.names().filter(|n| !used.contains(n) && !ignorable(n) && !tied_head(n)).collect();
    if !unused.is_empty() {
        let more = if unused.len() > 5 { format!(" and {} more", unused.len() - 5) } else { String::new() };
        return Err(Error::checkpoint(
            src,
            format!(
                "{} tensor(s) were not consumed by the {} adapter (the checkpoint does not match the config): {}{more}",
                unused.len(),
                arch.hf_class,
                unused[..unused.len().min(5)].join(", ")
            ),
        ));
    }

    // Storage types: matrices in the requested type (default: the source's),
    // small tensors in f32.
    let embed_src = sources.iter().find(|(p, _, _)| p.id == TensorId::Embed).map(|(_, _, t)| t.dtype);
    let weight_dtype = opts.dtype.or(embed_src).unwrap_or(DType::F32);
    let items: Vec<ToPlace> = sources
        .iter()
        .map(|(p, _, _)| ToPlace {
            name: p.id.to_string(),
            dtype: storage_dtype(p.role, weight_dtype, &p.shape),
            shape: p.shape.clone(),
            expert: match p.id {
                TensorId::Expert(l, e, _) => Some((l, e)),
                _ => None,
            },
        })
        .collect();
    let (tensors, experts) = layout(&items)?;

    let tok_cfg = read_json(&src.join("tokenizer_config.json"))?;
    let template_file = src.join("chat_template.jinja");
    let chat_template = if template_file.exists() {
        Some(std::fs::read_to_string(&template_file).map_err(|e| Error::io(&template_file, e))?)
    } else {
        tok_cfg.as_ref().and_then(|t| t.get("chat_template")).and_then(Value::as_str).map(String::from)
    };
    let source = SourceInfo {
        dtype: hf.get("torch_dtype").or_else(|| hf.get("dtype")).and_then(Value::as_str).map(String::from),
        config: Some(hf.raw.clone()),
        tokenizer: read_json(&src.join("tokenizer.json"))?,
        tokenizer_config: tok_cfg,
        chat_template,
        generation_config: read_json(&src.join("generation_config.json"))?,
    };
    let meta = FileMeta {
        architecture: arch.hf_class.to_string(),
        config: cfg.clone(),
        weight_dtype,
        source,
        tensors,
        experts,
    };

    // Write to a hidden temporary beside the output, then rename.
    let source = |i: usize| {
        let st = &sources[i].2;
        (st.dtype, ck.bytes(st))
    };
    let staged = write_staged(dst, &meta, "converting", opts.progress, interrupted, &source)?;
    let bytes = commit(staged, dst)?;
    Ok(ConvertReport {
        path: dst.to_path_buf(),
        architecture: arch.hf_class.into(),
        dtype: weight_dtype,
        tensors: meta.tensors.len(),
        bytes,
    })
}
