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

mod dequant;
mod mtp;
pub mod recipe;
mod recode;
pub mod safetensors;
pub mod split;

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;

use crate::arch::{self, HfConfig, Source};
use crate::canonical::tensors::{PlannedTensor, Role, TensorId, tensor_plan};
use crate::error::{Error, Result};
use crate::format::writer::{ToPlace, Writer, layout};
use crate::format::{FileMeta, SourceInfo, TensorEntry};
use crate::imatrix::Imatrix;
use crate::quant::{self, DType};
pub use recipe::Recipe;
use safetensors::{Checkpoint, SrcTensor};

/// Conversion settings.
#[derive(Clone, Debug, Default)]
pub struct ConvertOptions {
    /// Storage types of the weight matrices, by class ([`recipe`]); `None`
    /// keeps the source's types.
    pub recipe: Option<Recipe>,
    /// An importance matrix ([`crate::imatrix`]) the quantisers weight their
    /// errors by.
    pub imatrix: Option<PathBuf>,
    /// Replace an existing output file.
    pub force: bool,
    /// Draw a progress bar on stderr (only when it is a terminal).
    pub progress: bool,
    /// Keep the checkpoint's multi-token-prediction layer (drafts for
    /// speculative decoding): `None` keeps it when it adds at most a few
    /// percent to the file.
    pub keep_mtp: Option<bool>,
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
    /// With an importance matrix: quantised matrices it weighted, and those
    /// it had no entry for (or no token reached, e.g. an expert the
    /// calibration text never routed to), quantised unweighted.
    pub weighted: Option<(usize, usize)>,
    /// With packed int4 source tensors (compressed-tensors): how their
    /// groups were stored.
    pub int4: Option<Int4Report>,
}

/// How the groups of a packed int4 source (compressed-tensors
/// `pack-quantized`) went into the file. A group whose bf16 scale is an f16
/// value is a q4_0 block as it stands; the others are the exceptions counted
/// here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Int4Report {
    /// Packed int4 tensors converted.
    pub tensors: usize,
    /// Their groups of 32 values.
    pub groups: usize,
    /// Groups of tensors stored as q4_0 whose scale is not an f16 value
    /// (too fine, or below f16's smallest subnormal): quantised again from
    /// their exact values, as a dequantised copy would be.
    pub requantised: usize,
    /// Tensors with a scale beyond f16's range, which no q4_0 block holds:
    /// stored in f32 instead (exactly) unless the recipe names a type.
    pub widened: Vec<String>,
}

impl ConvertOptions {
    /// Every matrix in `dtype` (`None`: the source's own).
    pub fn with_dtype(dtype: Option<DType>) -> ConvertOptions {
        ConvertOptions { recipe: dtype.map(Recipe::uniform), ..ConvertOptions::default() }
    }
}

/// The importance matrix of `opts`, loaded and checked against the matrices
/// this conversion quantises (`(name, cols)`).
fn load_imatrix<'a>(
    opts: &ConvertOptions,
    architecture: &str,
    quantised: impl IntoIterator<Item = (&'a str, usize)>,
) -> Result<Option<Imatrix>> {
    let Some(path) = &opts.imatrix else { return Ok(None) };
    let m = Imatrix::load(path)?;
    m.check_fits(path, architecture, quantised)?;
    Ok(Some(m))
}

/// How many of the quantised tensors of `meta` the importance matrix covers.
fn coverage(meta: &FileMeta, m: Option<&Imatrix>) -> Option<(usize, usize)> {
    let m = m?;
    let quantised: Vec<&TensorEntry> = meta.tensors.iter().filter(|t| t.dtype.is_quantized()).collect();
    let weighted = quantised.iter().filter(|t| m.weights(&t.name).is_some()).count();
    Some((weighted, quantised.len() - weighted))
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
    // A stacked [H, rows, cols] tensor is viewed one [rows, cols] matrix at a
    // time, so its groups must not straddle two of them.
    let rows = if shape.len() >= 2 { shape[shape.len() - 2] } else { 1 };
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
/// `source(i)` gives the stored type and bytes of tensor `i` (made on
/// demand, so at most one tensor is materialised at a time); a tensor whose
/// type differs from the planned one is decoded to f32 and encoded again, in
/// chunks of about 1M values so memory stays flat on huge tensors. `verb`
/// labels the progress bar; `interrupted` is polled between tensors; with
/// `imatrix`, every matrix it has an entry for is quantised weighted by it.
#[allow(clippy::too_many_arguments)] // the steps of one conversion, each with its own input
fn write_staged<'a>(
    dst: &Path,
    meta: &FileMeta,
    verb: &str,
    progress: bool,
    interrupted: &dyn Fn() -> bool,
    imatrix: Option<&Imatrix>,
    source: &dyn Fn(usize) -> Result<(DType, Cow<'a, [u8]>)>,
) -> Result<TempGuard> {
    let file_name =
        dst.file_name().ok_or_else(|| Error::InvalidInput(format!("output {} has no file name", dst.display())))?;
    let folder = dst.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !folder.is_dir() {
        return Err(Error::InvalidInput(format!(
            "cannot write {}: the folder {} does not exist",
            dst.display(),
            folder.display()
        )));
    }
    let tmp = dst.with_file_name(format!(".{}.partial-{}", file_name.to_string_lossy(), std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let guard = TempGuard(Some(tmp.clone()));
    // A write error (a full disk, most likely) names the output the user
    // asked for, not the hidden temporary the guard removes.
    let named = |e: Error| match e {
        Error::Io { path, source } if path == tmp => Error::Io { path: dst.to_path_buf(), source },
        e => e,
    };
    let mut w = Writer::create(&tmp, meta).map_err(named)?;

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
        let (dtype, raw) = source(i)?;
        let raw = &raw[..];
        w.begin(&entry.name).map_err(named)?;
        if dtype == entry.dtype {
            w.write(raw).map_err(named)?;
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
                let importance = imatrix.and_then(|m| m.weights(&entry.name));
                encode_parallel(entry.dtype, &f32_buf, cols, importance, out);
                w.write(out).map_err(named)?;
                r += n;
            }
        }
        w.end();
        bar.inc(entry.nbytes);
    }
    w.finish().map_err(named)?;
    bar.finish_and_clear();
    Ok(guard)
}

/// [`quant::encode_weighted`] with the rows split across the rayon pool
/// (whole groups of the type's rows per task): every row is encoded on its
/// own, so the bytes are the same on any thread count.
fn encode_parallel(dtype: DType, src: &[f32], cols: usize, importance: Option<&[f32]>, dst: &mut [u8]) {
    use rayon::prelude::*;
    let rows = src.len() / cols.max(1);
    let group = dtype.group_rows();
    let per = rows.div_ceil(4 * rayon::current_num_threads()).next_multiple_of(group).max(group);
    let row_bytes = dst.len() / rows.max(1);
    src.par_chunks(per * cols).zip(dst.par_chunks_mut(per * row_bytes)).for_each(|(x, out)| {
        quant::encode_weighted(dtype, x, cols, importance, out);
    });
}

/// `[rows, cols]` of a tensor of any rank: the leading dimensions flattened.
fn as_matrix(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        None => (1, 1),
        Some((&c, rest)) => (rest.iter().product(), c),
    }
}

/// The shape `s` makes of a source tensor of shape `shape`, or why it cannot.
fn derived_shape(s: &Source, shape: &[usize]) -> std::result::Result<Vec<usize>, String> {
    let mut shape = shape.to_vec();
    if let Some(i) = s.index {
        if shape.len() < 2 || i >= shape[0] {
            return Err(format!("tensor {} of shape {shape:?} has no slice {i}", s.name));
        }
        shape.remove(0);
    }
    let mut shape = squeeze_middle(shape);
    if s.transpose || s.rows.is_some() || s.transpose_blocks {
        // A vector takes row picks as a column (e.g. half of a stacked gate/up bias).
        let vector = shape.len() == 1 && !s.transpose && !s.transpose_blocks;
        let (r, c) = match shape[..] {
            [r, c] => (r, c),
            [r] if vector => (r, 1),
            _ => return Err(format!("tensor {} has shape {shape:?}; the adapter needs 2 dimensions here", s.name)),
        };
        let (mut r, mut c) = if s.transpose { (c, r) } else { (r, c) };
        let mut len = r;
        if let Some(p) = s.rows {
            if p.period == 0 || !r.is_multiple_of(p.period) || p.offset + p.len > p.period {
                return Err(format!(
                    "tensor {} has {r} rows, which do not split into the groups of {} rows config.json implies \
                     (the checkpoint and its config disagree)",
                    s.name, p.period
                ));
            }
            len = p.len;
            r = r / p.period * p.len;
        }
        if s.transpose_blocks {
            (r, c) = (r / len * c, len);
        }
        shape = if vector { vec![r] } else { vec![r, c] };
    }
    Ok(shape)
}

/// The bytes of one canonical tensor to be stored as `want`: borrowed from
/// the checkpoint when the source is used as it is, a packed int4 source
/// (or one expert's slice of a stacked one) moved into q4_0 blocks when
/// `want` is q4_0 (or its interleaved form), otherwise decoded to f32 and
/// reshaped as `s` says.
fn materialize<'a>(ck: &'a Checkpoint, s: &Source, t: &SrcTensor, want: DType) -> Result<(DType, Cow<'a, [u8]>)> {
    if s.is_whole()
        && let Some((d, b)) = ck.plain_bytes(t)
    {
        return Ok((d, Cow::Borrowed(b)));
    }
    if int4_native(s, t, want) {
        return Ok((want, Cow::Owned(ck.int4_as_q4_0(t, want, s.index))));
    }
    let (shape, mut v) = ck.decode_f32(&s.name, t, s.index)?;
    let shape = squeeze_middle(shape);
    if s.add_one {
        v.iter_mut().for_each(|x| *x += 1.0);
    }
    if s.transpose || s.rows.is_some() || s.transpose_blocks {
        let (mut r, mut c) = (shape[0], shape.get(1).copied().unwrap_or(1));
        if s.transpose {
            v = transpose(&v, r, c);
            (r, c) = (c, r);
        }
        let mut len = r;
        if let Some(p) = s.rows {
            let keep: Vec<f32> = v
                .chunks_exact(c)
                .enumerate()
                .filter(|(i, _)| (p.offset..p.offset + p.len).contains(&(i % p.period)))
                .flat_map(|(_, row)| row.iter().copied())
                .collect();
            v = keep;
            r = r / p.period * p.len;
            len = p.len;
        }
        if s.transpose_blocks {
            v = v.chunks_exact(len * c).flat_map(|b| transpose(b, len, c)).collect();
        }
        debug_assert_eq!(v.len(), r * c);
    }
    Ok((DType::F32, Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())))
}

/// True when `s` takes the packed int4 tensor `t` whole or one slice of
/// its first axis, into q4_0 blocks (`want`): then the groups move as they are.
fn int4_native(s: &Source, t: &SrcTensor, want: DType) -> bool {
    let slice_only = Source { index: None, ..s.clone() }.is_whole();
    slice_only
        && t.shape.len() >= 2
        && matches!(t.enc, safetensors::Encoding::PackedInt4 { .. })
        && want.base() == DType::Q4_0
}

/// The tensors an adapter skipped, grouped by their first two name parts
/// (`model.visual.* (24 tensors)`, `mtp.layers.* (9 tensors)`), in name order.
fn skipped_parts<'a>(names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut groups: std::collections::BTreeMap<String, usize> = Default::default();
    for n in names {
        let prefix: Vec<&str> = n.split('.').take(2).collect();
        *groups.entry(prefix.join(".")).or_default() += 1;
    }
    groups.into_iter().map(|(p, k)| format!("{p}.* ({k} tensor{})", if k == 1 { "" } else { "s" })).collect()
}

/// `[r, 1, c]` → `[r, c]`: a depthwise convolution's `[channels, 1, taps]`
/// weight is a matrix of taps per channel.
fn squeeze_middle(shape: Vec<usize>) -> Vec<usize> {
    match shape[..] {
        [r, 1, c] => vec![r, c],
        _ => shape,
    }
}

/// `[r, c]` → `[c, r]`.
fn transpose(v: &[f32], r: usize, c: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = v[i * c + j];
        }
    }
    out
}

/// Renames a staged output into place; returns its size in bytes.
fn commit(mut staged: TempGuard, dst: &Path) -> Result<u64> {
    let tmp = staged.0.clone().expect("a staged output has its temporary");
    std::fs::rename(&tmp, dst).map_err(|e| Error::io(dst, e))?;
    staged.0 = None;
    Ok(std::fs::metadata(dst).map_err(|e| Error::io(dst, e))?.len())
}

/// Converts the Hugging Face checkpoint in `src` into the `.colibri` file `dst`.
/// When `src` is a `.colibri` file, re-encodes it with `opts.recipe` instead.
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

    // A conditional-generation checkpoint (Kimi-K2.5) may declare its
    // quantisation in text_config.
    let quant = hf.get("quantization_config").or_else(|| hf.get("text_config")?.get("quantization_config"));
    let ck = Checkpoint::open(src, quant.filter(|q| !q.is_null()))?;
    let mtp_layout = mtp::Layout::find(&hf, |n| ck.get(n).is_some());
    let cfg = mtp::with_mtp(&hf, cfg, mtp_layout, opts.keep_mtp)?;
    cfg.validate().map_err(|e| Error::checkpoint(&cfg_path, e.to_string()))?;
    let source_of = |id| {
        mtp_layout.and_then(|l| mtp::source(arch, &hf, &cfg, l, id)).unwrap_or_else(|| (arch.source)(&hf, &cfg, id))
    };
    let ignored = |n: &str| (arch.ignored)(&hf, n) || mtp_layout.is_some_and(|l| l.owns(n));
    let plan = tensor_plan(&cfg);

    // Map every planned tensor to its source, checking presence and shape.
    let mut sources: Vec<(&_, Source, &SrcTensor)> = Vec::with_capacity(plan.len());
    let mut missing = Vec::new();
    for p in &plan {
        let s = source_of(p.id).resolve(|n| ck.get(n).is_some());
        match ck.get(&s.name) {
            None => missing.push(format!("{} (shape {:?})", s.name, p.shape)),
            Some(t) => {
                let got = derived_shape(&s, &t.shape).map_err(|m| Error::checkpoint(ck.file_of(t), m))?;
                // A whole tensor may carry extra unit axes (Kimi's `A_log` is [1, 1, H, 1]).
                let unit_free = |v: &[usize]| v.iter().copied().filter(|&x| x != 1).collect::<Vec<_>>();
                let fits = if s.is_whole() {
                    got == p.shape || unit_free(&got) == unit_free(&p.shape)
                } else {
                    as_matrix(&got) == as_matrix(&p.shape)
                };
                if !fits {
                    let what = if s.is_whole() { String::new() } else { format!(" (taken as {s:?})") };
                    return Err(Error::checkpoint(
                        ck.file_of(t),
                        format!(
                            "tensor {}{what} has shape {got:?}, but config.json implies {:?} for {}",
                            s.name, p.shape, p.id
                        ),
                    ));
                }
                // Whole numbers only where the model reads an index table.
                let table = matches!(p.id, TensorId::Layer(_, crate::canonical::tensors::LayerTensor::HashTable));
                if let (safetensors::Encoding::Int { bytes }, false) = (&t.enc, table) {
                    return Err(Error::Unsupported(format!(
                        "{}: tensor {} has dtype I{}; integer tensors are read only as index tables (supported: \
                         F32, BF16, F16, and F8_E4M3 / MXFP4 / packed int4 with their scales)",
                        ck.file_of(t).display(),
                        s.name,
                        bytes * 8
                    )));
                }
                sources.push((p, s, t));
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
    let used: std::collections::HashSet<&str> = sources.iter().map(|(_, s, _)| s.name.as_str()).collect();
    let tied_head = |n: &str| cfg.tie_embeddings && n == "lm_head.weight";
    let unused: Vec<&str> =
        ck.names().filter(|n| !used.contains(n) && !ignorable(n) && !tied_head(n) && !ignored(n)).collect();
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

    // Storage types: matrices in the requested type; by default in the
    // source's own, as closely as colibri stores it (MXFP4 stays mxfp4, FP8
    // becomes q8_0: no element type holds it, and bf16 would store it at
    // twice the size; compressed-tensors int4 becomes q4_0, which is the
    // same format where the scale is an f16); small tensors in f32.
    let embed_src = sources.iter().find(|(p, _, _)| p.id == TensorId::Embed).and_then(|(_, _, t)| match t.enc {
        safetensors::Encoding::Plain(d) => Some(d),
        _ => None,
    });
    let plain_default = embed_src.unwrap_or(DType::F32);
    // Packed int4 sources: every scale read once, to know which groups q4_0
    // holds as they are (an error for a NaN or infinite scale).
    let mut int4_scales = std::collections::BTreeMap::new();
    for (_, s, t) in &sources {
        if matches!(t.enc, safetensors::Encoding::PackedInt4 { .. }) && !int4_scales.contains_key(s.name.as_str()) {
            int4_scales.insert(s.name.as_str(), ck.int4_scales(&s.name, t)?);
        }
    }
    // Packed int4 becomes q4_0 (the same values where the scale is an f16),
    // or f32 for a tensor with a scale beyond f16's range.
    let own = |name: &str, t: &SrcTensor| match t.enc {
        safetensors::Encoding::Plain(_) | safetensors::Encoding::Int { .. } => plain_default,
        safetensors::Encoding::Fp8 { .. } => DType::Q8_0,
        safetensors::Encoding::Mxfp4 { .. } => DType::Mxfp4,
        safetensors::Encoding::PackedInt4 { .. } if int4_scales.get(name).is_some_and(|c| c.overflow > 0) => DType::F32,
        safetensors::Encoding::PackedInt4 { .. } => DType::Q4_0,
    };
    // The type recorded for the file: the requested one, else that of the
    // quantised source tensors (they hold most of the bytes), else the embedding's.
    let recipe = opts.recipe.as_ref();
    let weight_dtype = recipe.and_then(Recipe::primary).unwrap_or_else(|| {
        sources.iter().map(|(_, s, t)| own(&s.name, t)).find(|d| d.is_quantized()).unwrap_or(plain_default)
    });
    let wanted = |p: &PlannedTensor, s: &Source, t: &SrcTensor| {
        recipe.and_then(|r| r.dtype(p.id.class_in(cfg.tie_embeddings)?)).unwrap_or_else(|| own(&s.name, t))
    };
    let items: Vec<ToPlace> = sources
        .iter()
        .map(|(p, s, t)| ToPlace {
            name: p.id.to_string(),
            dtype: storage_dtype(p.role, wanted(p, s, t), &p.shape),
            shape: p.shape.clone(),
            expert: match p.id {
                TensorId::Expert(l, e, _) => Some((l, e)),
                _ => None,
            },
        })
        .collect();
    let (tensors, experts) = layout(&items)?;
    let int4 = (!int4_scales.is_empty()).then(|| {
        let mut r = Int4Report { tensors: int4_scales.len(), ..Default::default() };
        for (name, c) in &int4_scales {
            r.groups += c.groups;
            if c.overflow > 0 {
                r.widened.push(name.to_string());
            }
        }
        // The inexact groups of the tensors that go the q4_0 way.
        let mut counted = std::collections::HashSet::new();
        for ((_, s, t), item) in sources.iter().zip(&items) {
            if int4_native(s, t, item.dtype) && counted.insert(s.name.as_str()) {
                r.requantised += int4_scales.get(s.name.as_str()).map_or(0, |c| c.inexact);
            }
        }
        r
    });
    let quantised =
        tensors.iter().filter(|t| t.dtype.is_quantized()).map(|t| (t.name.as_str(), *t.shape.last().unwrap_or(&1)));
    let imatrix = load_imatrix(opts, arch.hf_class, quantised)?;

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
        skipped: skipped_parts(ck.names().filter(|n| !used.contains(n) && ignored(n))),
    };
    let meta = FileMeta {
        architecture: arch.hf_class.to_string(),
        config: cfg.clone(),
        weight_dtype,
        recipe: recipe.filter(|r| !r.is_uniform()).map(|r| r.name.clone()),
        source,
        tensors,
        experts,
        part: None,
    };

    // Write to a hidden temporary beside the output, then rename.
    let source = |i: usize| {
        let (_, s, t) = &sources[i];
        materialize(&ck, s, t, meta.tensors[i].dtype)
    };
    let staged = write_staged(dst, &meta, "converting", opts.progress, interrupted, imatrix.as_ref(), &source)?;
    let bytes = commit(staged, dst)?;
    Ok(ConvertReport {
        path: dst.to_path_buf(),
        architecture: arch.hf_class.into(),
        dtype: weight_dtype,
        tensors: meta.tensors.len(),
        bytes,
        weighted: coverage(&meta, imatrix.as_ref()),
        int4,
    })
}
