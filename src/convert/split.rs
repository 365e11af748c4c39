//! Cutting a `.colibri` file into stage files, one per pipeline stage, each
//! holding only its own layers' weights ([`crate::format::Part`]). A model
//! larger than any one machine's disk then runs across several machines,
//! each keeping just its stage file. Bytes are copied as they are: a stage
//! file's tensors are the whole file's, so a pipeline over stage files gives
//! the same bits as one over the whole file.

use std::ops::Range;
use std::path::{Path, PathBuf};

use super::{commit, write_staged};
use crate::error::{Error, Result};
use crate::format::reader::ColibriFile;
use crate::format::writer::{ToPlace, layout};
use crate::format::{FileMeta, Part};
use crate::io::fnv1a;

/// One stage file written by [`split`].
#[derive(Clone, Debug)]
pub struct StageFile {
    /// Where it was written.
    pub path: PathBuf,
    /// The decoder layers it holds.
    pub layers: Range<usize>,
    /// Its size in bytes.
    pub bytes: u64,
}

/// The name of stage `i` of `k` cut from a model file whose stem is `stem`.
pub fn stage_file_name(stem: &str, i: usize, k: usize) -> String {
    format!("{stem}.stage-{}-of-{k}.colibri", i + 1)
}

/// Writes one stage file per range of `plan` (contiguous ranges covering
/// every layer of the model's forward pass, in order) into the folder
/// `out` (made if missing), named by [`stage_file_name`]. An existing file is replaced only
/// with `force`; the checks all run before anything is written. `progress`
/// draws a bar per file on stderr; `interrupted` is polled between tensors,
/// and an interrupted split removes the file it was writing.
pub fn split(
    src: &Path,
    plan: &[Range<usize>],
    out: &Path,
    force: bool,
    progress: bool,
    interrupted: &dyn Fn() -> bool,
) -> Result<Vec<StageFile>> {
    let file = ColibriFile::open(src)?;
    let meta = file.meta();
    if let Some(p) = &meta.part {
        return Err(Error::InvalidInput(format!(
            "{} is already a stage file (layers {}..{}, stage {} of {}); split the whole model",
            src.display(),
            p.layers[0],
            p.layers[1],
            p.stage + 1,
            p.stages
        )));
    }
    check_plan(&file, plan)?;
    if out.exists() && !out.is_dir() {
        return Err(Error::InvalidInput(format!("cannot write stage files into {}: not a folder", out.display())));
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let stem = src.file_stem().map_or("model".into(), |s| s.to_string_lossy().into_owned());
    let paths: Vec<PathBuf> = (0..plan.len()).map(|i| out.join(stage_file_name(&stem, i, plan.len()))).collect();
    if !force && let Some(p) = paths.iter().find(|p| p.exists()) {
        return Err(Error::OutputExists(p.clone()));
    }
    let origin = format!("{}-{:016x}", file.file_len(), fnv1a(file.head_bytes()));
    let mut written = Vec::with_capacity(plan.len());
    for (i, (layers, path)) in plan.iter().zip(&paths).enumerate() {
        let part = Part { stage: i, stages: plan.len(), layers: [layers.start, layers.end], origin: origin.clone() };
        let (part_meta, sources) = part_meta(meta, part)?;
        let source = |t: usize| {
            let view = file.tensor_at(sources[t]);
            Ok((view.dtype, std::borrow::Cow::Borrowed(view.bytes)))
        };
        let verb = format!("stage {}/{}", i + 1, plan.len());
        let staged = write_staged(path, &part_meta, &verb, progress, interrupted, None, &source)?;
        let bytes = commit(staged, path)?;
        written.push(StageFile { path: path.clone(), layers: layers.clone(), bytes });
    }
    Ok(written)
}

/// Refuses a plan that is not contiguous ranges covering the model's layers
/// in order, or that begins a stage where none may begin.
fn check_plan(file: &ColibriFile, plan: &[Range<usize>]) -> Result<()> {
    let cfg = &file.meta().config;
    let n = cfg.main_layers();
    let mut next = 0;
    for r in plan {
        if r.start != next || r.end <= r.start {
            return Err(Error::InvalidInput(format!(
                "stage plan {plan:?}: give contiguous, non-empty layer ranges from 0 to {n}"
            )));
        }
        if !cfg.stage_can_begin(r.start) {
            return Err(Error::InvalidInput(format!(
                "stage plan {plan:?}: layer {} reuses the key selection of the layer before it, so no stage \
                 can begin there",
                r.start
            )));
        }
        next = r.end;
    }
    if next != n {
        return Err(Error::InvalidInput(format!("stage plan {plan:?} covers layers 0..{next} of the model's {n}")));
    }
    Ok(())
}

/// The metadata of the stage file for `part` of the whole model `meta`, and
/// for each of its tensors the index of the same tensor in `meta`.
fn part_meta(meta: &FileMeta, part: Part) -> Result<(FileMeta, Vec<usize>)> {
    let mut out = FileMeta { part: Some(part), ..meta.clone() };
    let keep = out.plan();
    let wanted: std::collections::HashSet<String> = keep.iter().map(|p| p.id.to_string()).collect();
    let slab_of: std::collections::HashMap<String, (usize, usize)> = keep
        .iter()
        .filter_map(|p| match p.id {
            crate::canonical::tensors::TensorId::Expert(l, e, _) => Some((p.id.to_string(), (l, e))),
            _ => None,
        })
        .collect();
    // The whole file's order: expert slabs stay whole and in place.
    let (mut items, mut sources) = (Vec::new(), Vec::new());
    for (i, t) in meta.tensors.iter().enumerate().filter(|(_, t)| wanted.contains(&t.name)) {
        items.push(ToPlace {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            expert: slab_of.get(&t.name).copied(),
        });
        sources.push(i);
    }
    (out.tensors, out.experts) = layout(&items)?;
    Ok((out, sources))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, EngineOptions, never};
    use crate::quant::DType;
    use crate::synth::{tiny_config, write_random_model};

    fn whole(dir: &Path) -> (PathBuf, usize) {
        let p = dir.join("m.colibri");
        let mut cfg = tiny_config();
        cfg.tie_embeddings = false;
        write_random_model(&p, &cfg, DType::F32, 3);
        (p, cfg.main_layers())
    }

    #[test]
    fn stage_files_hold_their_own_layers_and_are_refused_where_a_whole_model_is_meant() {
        let dir = tempfile::tempdir().unwrap();
        let (p, n) = whole(dir.path());
        assert!(n >= 2);
        let plan = [0..1, 1..n];
        let files = split(&p, &plan, dir.path(), false, false, &never).unwrap();
        assert_eq!(files.len(), 2);
        let src = ColibriFile::open(&p).unwrap();
        let (a, b) = (ColibriFile::open(&files[0].path).unwrap(), ColibriFile::open(&files[1].path).unwrap());
        // Every tensor of the whole file is in exactly one stage file, byte for byte.
        for t in &src.meta().tensors {
            let held: Vec<_> = [&a, &b].into_iter().filter_map(|f| f.tensor(&t.name).ok()).collect();
            assert_eq!(held.len(), 1, "{}", t.name);
            assert_eq!(held[0].bytes, src.tensor(&t.name).unwrap().bytes, "{}", t.name);
        }
        assert!(a.tensor("embed").is_ok() && a.tensor("lm_head").is_err() && b.tensor("lm_head").is_ok());
        assert_eq!(a.part().unwrap().origin, b.part().unwrap().origin);
        assert!(a.holds_layer(0) && !a.holds_layer(1) && b.holds_layer(n - 1) && !b.holds_layer(0));

        // Opened as a whole model: refused, saying what the file is.
        let e = Engine::open(&files[1].path, &EngineOptions::default()).unwrap_err().to_string();
        assert!(e.contains("is a stage file (stage 2 of 2"), "{e}");
        // A stage outside the file's layers.
        let outside = EngineOptions { stage: Some(0..n), ..Default::default() };
        let e = Engine::open(&files[1].path, &outside).unwrap_err().to_string();
        assert!(e.contains("holding layers 1.."), "{e}");
        // A stage file is not split again; a plan must cover the model in order.
        let e = split(&files[0].path, &plan, dir.path(), true, false, &never).unwrap_err().to_string();
        assert!(e.contains("already a stage file"), "{e}");
        #[allow(clippy::single_range_in_vec_init)] // one-stage plans are among the cases
        let bad_plans = [&[0..1][..], &[0..1, 2..n], &[1..n], &[0..0, 0..n]];
        for bad in bad_plans {
            assert!(split(&p, bad, dir.path(), true, false, &never).is_err(), "{bad:?}");
        }
        // Nothing is overwritten unless asked.
        let e = split(&p, &plan, dir.path(), false, false, &never).unwrap_err();
        assert!(matches!(e, crate::error::Error::OutputExists(_)), "{e}");
        assert!(split(&p, &plan, dir.path(), true, false, &never).is_ok());
        // An interrupted split leaves no file behind.
        let fresh = dir.path().join("fresh");
        std::fs::create_dir(&fresh).unwrap();
        assert!(split(&p, &plan, &fresh, false, false, &|| true).is_err());
        assert_eq!(std::fs::read_dir(&fresh).unwrap().count(), 0);
    }

    #[test]
    fn the_header_flag_and_the_metadata_must_agree() {
        let dir = tempfile::tempdir().unwrap();
        let (p, n) = whole(dir.path());
        let files = split(&p, &[0..1, 1..n], dir.path(), false, false, &never).unwrap();
        let flip = |path: &Path, flags: u32| {
            let mut b = std::fs::read(path).unwrap();
            b[12..16].copy_from_slice(&flags.to_le_bytes());
            ColibriFile::from_bytes(path, &b).map(|_| ()).unwrap_err().to_string()
        };
        assert!(flip(&files[0].path, 0).contains("disagree"));
        assert!(flip(&p, crate::format::FLAG_PART).contains("disagree"));
        assert!(flip(&files[0].path, 3).contains("unknown header flags"));
    }
}
