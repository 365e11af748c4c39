//! `.colibri` file → `.colibri` file in another weight type.
//!
//! The source is opened and validated like any model file. Each tensor is
//! decoded to f32 and encoded again into the type [`super::storage_dtype`]
//! picks for the requested weight type, exactly as a conversion from a
//! Hugging Face folder would store an f32 source; a tensor whose storage type
//! does not change is copied byte for byte. Everything else in the metadata
//! (architecture, config, tokenizer, chat template, generation defaults,
//! source information) is carried over unchanged.
//!
//! Re-encoding never recovers precision: going from q4_0 to q8_0 stores the
//! q4_0 values more finely, and going from one quantised type to another adds
//! the second rounding to the first. Re-encoding an f32, bf16 or f16 file to a
//! block type gives the same tensor bytes as converting the original
//! checkpoint directly (when the file holds the checkpoint's values exactly).
//!
//! The output is written the same way as by [`super::convert`]: to a hidden
//! temporary beside `dst`, renamed into place when complete, never replacing
//! an existing file unless `force` is set, with the same progress bar and
//! Ctrl-C polling between tensors.

use std::io::Read;
use std::path::Path;

use super::{ConvertOptions, ConvertReport, Recipe, commit, coverage, load_imatrix, storage_dtype, write_staged};
use crate::canonical::tensors::TensorId;
use crate::error::{Error, Result};
use crate::format::FileMeta;
use crate::format::reader::ColibriFile;
use crate::format::writer::{ToPlace, layout};

/// Re-encodes the `.colibri` file `src` into `dst` with the weight type
/// `opts.recipe` (`None` keeps the source's types). `interrupted` is polled between
/// tensors, as in [`super::convert`].
pub(super) fn recode(
    src: &Path,
    dst: &Path,
    opts: &ConvertOptions,
    interrupted: &dyn Fn() -> bool,
) -> Result<ConvertReport> {
    // A file that is not a .colibri at all was most likely meant as a
    // checkpoint; say what convert accepts rather than "bad magic".
    let mut head = Vec::with_capacity(8);
    std::fs::File::open(src).and_then(|f| f.take(8).read_to_end(&mut head)).map_err(|e| Error::io(src, e))?;
    if head != crate::format::MAGIC {
        return Err(Error::format(
            src,
            "is neither a .colibri file nor a folder; convert takes a Hugging Face checkpoint folder \
             (config.json, *.safetensors) or a .colibri file to re-encode",
        ));
    }
    let file = ColibriFile::open(src)?;
    let old = file.meta();
    // The recorded weight type is a user-facing name (q4_0, not q4_0x8);
    // `base` guards against a file that recorded the interleaved form.
    let recipe = opts.recipe.as_ref();
    let weight_dtype = recipe.and_then(Recipe::primary).unwrap_or(old.weight_dtype).base();

    // The tensor plan fixes the order, roles and shapes; the reader has
    // already checked that the file holds exactly these tensors.
    let plan = old.plan();
    let mut sources = Vec::with_capacity(plan.len());
    let mut items = Vec::with_capacity(plan.len());
    for p in &plan {
        let name = p.id.to_string();
        let i = file.index_of(&name).ok_or_else(|| Error::format(src, format!("tensor {name} is missing")))?;
        sources.push(i);
        // Without a requested type each tensor keeps its own (a file may mix
        // types, e.g. MXFP4 experts beside bf16 attention).
        let own = file.meta().tensors[i].dtype.base();
        let wanted = recipe.and_then(|r| r.dtype(p.id.class_in(old.config.tie_embeddings)?)).unwrap_or(own);
        items.push(ToPlace {
            dtype: storage_dtype(p.role, wanted, &p.shape),
            shape: p.shape.clone(),
            expert: match p.id {
                TensorId::Expert(l, e, _) => Some((l, e)),
                _ => None,
            },
            name,
        });
    }
    let (tensors, experts) = layout(&items)?;
    let quantised =
        tensors.iter().filter(|t| t.dtype.is_quantized()).map(|t| (t.name.as_str(), *t.shape.last().unwrap_or(&1)));
    let imatrix = load_imatrix(opts, &old.architecture, quantised)?;
    let recorded = match recipe {
        Some(r) => (!r.is_uniform()).then(|| r.name.clone()),
        None => old.recipe.clone(),
    };
    let meta = FileMeta {
        architecture: old.architecture.clone(),
        config: old.config.clone(),
        weight_dtype,
        recipe: recorded,
        source: old.source.clone(),
        tensors,
        experts,
        part: old.part.clone(),
    };

    let source = |i: usize| {
        let view = file.tensor_at(sources[i]);
        Ok((view.dtype, std::borrow::Cow::Borrowed(view.bytes)))
    };
    let staged = write_staged(dst, &meta, "re-encoding", opts.progress, interrupted, imatrix.as_ref(), &source)?;
    // The source stays mapped until here; unmap it before renaming over it
    // (src == dst with `force`), which some systems refuse for a mapped file.
    drop(file);
    let bytes = commit(staged, dst)?;
    let tensors = meta.tensors.len();
    let weighted = coverage(&meta, imatrix.as_ref());
    Ok(ConvertReport {
        path: dst.to_path_buf(),
        architecture: meta.architecture,
        dtype: weight_dtype,
        tensors,
        bytes,
        weighted,
        int4: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, EngineOptions};
    use crate::quant::DType;
    use crate::synth::{tiny_config_blocks, write_random_model};

    fn never() -> bool {
        false
    }

    fn opts(dtype: Option<DType>) -> ConvertOptions {
        ConvertOptions::with_dtype(dtype)
    }

    /// Every tensor's (name, dtype, shape, bytes) in file order.
    fn contents(path: &Path) -> Vec<(String, DType, Vec<usize>, Vec<u8>)> {
        let f = ColibriFile::open(path).unwrap();
        (0..f.meta().tensors.len())
            .map(|i| {
                let v = f.tensor_at(i);
                (f.meta().tensors[i].name.clone(), v.dtype, v.shape.to_vec(), v.bytes.to_vec())
            })
            .collect()
    }

    #[test]
    fn f32_file_recoded_equals_writing_that_type_directly() {
        // The synthetic writer encodes the same f32 values straight into the
        // requested type, so a re-encoded f32 file must match it byte for
        // byte, including the interleaved layouts and the file layout.
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny_config_blocks();
        let f32_path = dir.path().join("f32.colibri");
        write_random_model(&f32_path, &cfg, DType::F32, 7);
        for dt in [DType::Bf16, DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let direct = dir.path().join(format!("direct-{dt}.colibri"));
            write_random_model(&direct, &cfg, dt, 7);
            let recoded = dir.path().join(format!("recoded-{dt}.colibri"));
            let report = recode(&f32_path, &recoded, &opts(Some(dt)), &never).unwrap();
            assert_eq!(report.dtype, dt);
            assert_eq!(report.bytes, std::fs::metadata(&recoded).unwrap().len());
            assert_eq!(contents(&recoded), contents(&direct), "{dt}");
            if dt.is_quantized() {
                let kinds: std::collections::HashSet<DType> = contents(&recoded).iter().map(|t| t.1).collect();
                assert!(kinds.contains(&dt.interleaved().unwrap()), "{dt}: no interleaved matrix in {kinds:?}");
            }
        }
    }

    #[test]
    fn keeps_metadata_and_runs() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny_config_blocks();
        let src = dir.path().join("src.colibri");
        write_random_model(&src, &cfg, DType::Bf16, 3);
        let dst = dir.path().join("q8.colibri");
        recode(&src, &dst, &opts(Some(DType::Q8_0)), &never).unwrap();
        let (a, b) = (ColibriFile::open(&src).unwrap(), ColibriFile::open(&dst).unwrap());
        assert_eq!(b.meta().weight_dtype, DType::Q8_0);
        assert_eq!(a.meta().architecture, b.meta().architecture);
        assert_eq!(serde_json::to_value(&a.meta().config).unwrap(), serde_json::to_value(&b.meta().config).unwrap());
        assert_eq!(serde_json::to_value(&a.meta().source).unwrap(), serde_json::to_value(&b.meta().source).unwrap());
        // Small tensors stay f32 and are copied bit for bit.
        for (ta, tb) in contents(&src).iter().zip(contents(&dst)) {
            if ta.1 == DType::F32 {
                assert_eq!(ta, &tb);
            }
        }
        // No dtype given: the source's type, with identical tensors.
        let same = dir.path().join("same.colibri");
        let r = recode(&dst, &same, &opts(None), &never).unwrap();
        assert_eq!(r.dtype, DType::Q8_0);
        assert_eq!(contents(&same), contents(&dst));
        let e = Engine::open(&same, &EngineOptions { threads: Some(1), ..Default::default() }).unwrap();
        let logits = e.logits(&[1, 2, 3], &never).unwrap();
        assert!(logits.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn refuses_what_the_folder_path_refuses_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny_config_blocks();
        let src = dir.path().join("src.colibri");
        write_random_model(&src, &cfg, DType::F32, 1);
        let dst = dir.path().join("out.colibri");
        std::fs::write(&dst, b"keep").unwrap();
        let e = crate::convert::convert(&src, &dst, &opts(Some(DType::Q4_0)), &never).unwrap_err();
        assert!(matches!(e, Error::OutputExists(_)), "{e}");
        assert_eq!(std::fs::read(&dst).unwrap(), b"keep");
        // With force the file is replaced.
        let forced = ConvertOptions { force: true, ..opts(Some(DType::Q4_0)) };
        crate::convert::convert(&src, &dst, &forced, &never).unwrap();
        assert_eq!(ColibriFile::open(&dst).unwrap().meta().weight_dtype, DType::Q4_0);

        // In place, with force: the source is read to the end before the rename.
        let inplace = dir.path().join("inplace.colibri");
        std::fs::copy(&src, &inplace).unwrap();
        let e = crate::convert::convert(&inplace, &inplace, &opts(Some(DType::Q8_0)), &never).unwrap_err();
        assert!(matches!(e, Error::OutputExists(_)), "{e}");
        crate::convert::convert(&inplace, &inplace, &ConvertOptions { force: true, ..opts(Some(DType::Q8_0)) }, &never)
            .unwrap();
        assert_eq!(ColibriFile::open(&inplace).unwrap().meta().weight_dtype, DType::Q8_0);
        std::fs::remove_file(&inplace).unwrap();

        let e = crate::convert::convert(&src, dir.path(), &opts(None), &never).unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "{e}");

        // A corrupt source is a format error naming the file.
        let bad = dir.path().join("bad.colibri");
        let mut bytes = std::fs::read(&src).unwrap();
        bytes.truncate(bytes.len() / 2);
        std::fs::write(&bad, &bytes).unwrap();
        let e = crate::convert::convert(&bad, &dir.path().join("x.colibri"), &opts(None), &never).unwrap_err();
        assert!(matches!(e, Error::Format { .. }), "{e}");
        assert!(e.to_string().contains("bad.colibri"), "{e}");
        let json = dir.path().join("config.json");
        std::fs::write(&json, b"{}").unwrap();
        let e = crate::convert::convert(&json, &dir.path().join("x.colibri"), &opts(None), &never).unwrap_err();
        assert!(matches!(e, Error::Format { .. }) && e.to_string().contains("folder"), "{e}");

        // Interrupted: an error, and no output or temporary left.
        let stop = || true;
        let e =
            crate::convert::convert(&src, &dir.path().join("y.colibri"), &opts(Some(DType::Q8_0)), &stop).unwrap_err();
        assert!(matches!(e, Error::Interrupted), "{e}");
        let mut names: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|d| d.unwrap().file_name().to_string_lossy().into()).collect();
        names.sort();
        assert_eq!(names, ["bad.colibri", "config.json", "out.colibri", "src.colibri"]);
    }

    #[test]
    fn through_convert_a_file_source_is_recoded() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src.colibri");
        write_random_model(&src, &tiny_config_blocks(), DType::F32, 5);
        let dst = dir.path().join("q41.colibri");
        let r = crate::convert::convert(&src, &dst, &opts(Some(DType::Q4_1)), &never).unwrap();
        assert_eq!(r.dtype, DType::Q4_1);
        let e = crate::convert::convert(&dir.path().join("nope.colibri"), &dst, &opts(None), &never).unwrap_err();
        assert!(matches!(e, Error::NotFound(_)), "{e}");
    }
}
