//! Importance matrices: for every weight matrix, the mean square of each
//! input column over a calibration text, so the quantisers can spend their
//! precision where the activations are large.
//!
//! A weight `W[r, c]` contributes `W[r, c] · x[c]` to an output, so its
//! rounding error matters in proportion to `x[c]²`; averaged over text, the
//! expected squared output error of row `r` is `Σ_c E[x_c²] · e_rc²`. The
//! quantisers of [`crate::quant`] minimise exactly that sum when given the
//! vector `E[x_c²]` ([`crate::quant::encode_weighted`]).
//!
//! [`calibrate`] runs token windows through an engine with every matrix in
//! the file (no expert streaming, so each matmul's weights are the file's own
//! bytes and are found by address) and records every matmul's input rows
//! through the kernels' observer hook ([`crate::kernels::observe_matmuls`]),
//! asking for every position's logits so the lm_head sees every row too.
//! Routed experts are separate tensors, so each expert's entry counts only
//! the tokens routed to it.
//!
//! File (`.imatrix`, little-endian):
//!
//! ```text
//! magic "CLBIMTX\0" · u32 version (1) · u32 reserved (0) · u64 header length n
//! header: n bytes of JSON {"architecture", "tokens", "source",
//!         "entries": [{"name", "cols", "tokens", "offset"}]}
//! data:   per entry, `cols` f32 mean squares at header end + offset
//!         (offsets in bytes from the end of the header, 4-aligned)
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::kernels::{Input, Matrix};
use crate::model::forward::Capture;

/// First bytes of every importance-matrix file.
pub const MAGIC: &[u8; 8] = b"CLBIMTX\0";
/// The file version this build reads and writes.
pub const VERSION: u32 = 1;

/// One weight matrix's statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// Input columns of the matrix.
    pub cols: usize,
    /// Activation rows (tokens) that went through it.
    pub tokens: u64,
    /// Mean square of each input column over those rows.
    pub values: Vec<f32>,
}

/// An importance matrix: entries by canonical tensor name.
#[derive(Clone, Debug, PartialEq)]
pub struct Imatrix {
    /// The architecture of the model it was made on (`MixtralForCausalLM` ...).
    pub architecture: String,
    /// Calibration tokens run.
    pub tokens: u64,
    /// What the text was (a file name, "default text" ...).
    pub source: String,
    /// Per weight matrix.
    pub entries: BTreeMap<String, Entry>,
}

#[derive(Serialize, Deserialize)]
struct Header {
    architecture: String,
    tokens: u64,
    source: String,
    entries: Vec<HeaderEntry>,
}

#[derive(Serialize, Deserialize)]
struct HeaderEntry {
    name: String,
    cols: usize,
    tokens: u64,
    offset: u64,
}

/// Most columns an entry may claim (the bound `ModelConfig::validate` puts
/// on every size).
const MAX_COLS: usize = crate::canonical::config::SIZE_LIMIT;

impl Imatrix {
    /// Writes the file (into a temporary beside `path`, then renamed: a
    /// failure leaves nothing behind).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut entries = Vec::with_capacity(self.entries.len());
        let mut offset = 0u64;
        for (name, e) in &self.entries {
            entries.push(HeaderEntry { name: name.clone(), cols: e.cols, tokens: e.tokens, offset });
            offset += 4 * e.cols as u64;
        }
        let header = Header {
            architecture: self.architecture.clone(),
            tokens: self.tokens,
            source: self.source.clone(),
            entries,
        };
        let mut json = serde_json::to_vec(&header).expect("a header always serialises");
        json.resize(json.len().next_multiple_of(4), b' ');
        let mut out = Vec::with_capacity(24 + json.len() + offset as usize);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        for e in self.entries.values() {
            out.extend(e.values.iter().flat_map(|v| v.to_le_bytes()));
        }
        let name =
            path.file_name().ok_or_else(|| Error::InvalidInput(format!("{} has no file name", path.display())))?;
        let tmp = path.with_file_name(format!(".{}.partial-{}", name.to_string_lossy(), std::process::id()));
        let written = std::fs::write(&tmp, &out).and_then(|_| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::io(path, e));
        }
        Ok(())
    }

    /// Reads and checks a file: a foreign, truncated or corrupt one is an
    /// [`Error::Format`] naming it.
    pub fn load(path: &Path) -> Result<Imatrix> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Imatrix::from_bytes(path, &bytes)
    }

    /// [`Imatrix::load`] from bytes already read (`path` names them in errors).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Imatrix> {
        let bad = |m: String| Error::format(path, m);
        if bytes.len() < 24 || &bytes[..8] != MAGIC {
            let hint = if bytes.starts_with(b"GGUF") {
                " (it looks like llama.cpp's GGUF imatrix; make one with `colibri calibrate`)"
            } else {
                ""
            };
            return Err(bad(format!("not a colibri importance matrix{hint}")));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(bad(format!("importance matrix version {version}; this colibri reads version {VERSION}")));
        }
        let n = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        let data_start =
            24u64.checked_add(n).filter(|&e| e <= bytes.len() as u64).ok_or_else(|| {
                bad(format!("header of {n} bytes runs past the end of the file ({} bytes)", bytes.len()))
            })? as usize;
        let header: Header = serde_json::from_slice(&bytes[24..data_start])
            .map_err(|e| bad(format!("header is not valid importance-matrix JSON: {e}")))?;
        let data = &bytes[data_start..];
        let mut entries = BTreeMap::new();
        for e in header.entries {
            if e.cols == 0 || e.cols > MAX_COLS {
                return Err(bad(format!("entry {} claims {} columns", e.name, e.cols)));
            }
            let end = e.offset.checked_add(4 * e.cols as u64).filter(|&end| end <= data.len() as u64);
            let Some(end) = end.filter(|_| e.offset.is_multiple_of(4)) else {
                return Err(bad(format!("entry {} lies outside the file", e.name)));
            };
            let values: Vec<f32> = data[e.offset as usize..end as usize]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
            if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !(v.is_finite() && **v >= 0.0)) {
                return Err(bad(format!("entry {} column {i} is {v}, not a mean square", e.name)));
            }
            if entries.insert(e.name.clone(), Entry { cols: e.cols, tokens: e.tokens, values }).is_some() {
                return Err(bad(format!("entry {} appears twice", e.name)));
            }
        }
        Ok(Imatrix { architecture: header.architecture, tokens: header.tokens, source: header.source, entries })
    }

    /// Checks that this matrix was made for a model with these weight
    /// matrices (`(name, cols)`, the tensors a conversion quantises): the
    /// same architecture, every shared name with the same width, and at
    /// least one name shared. `path` names the file in errors.
    pub fn check_fits<'a>(
        &self,
        path: &Path,
        architecture: &str,
        matrices: impl IntoIterator<Item = (&'a str, usize)>,
    ) -> Result<()> {
        let foreign = |m: String| Error::InvalidInput(format!("importance matrix {}: {m}", path.display()));
        if self.architecture != architecture {
            return Err(foreign(format!("made for a {}, not a {architecture}", self.architecture)));
        }
        let mut shared = 0;
        for (name, cols) in matrices {
            if let Some(e) = self.entries.get(name) {
                if e.cols != cols {
                    return Err(foreign(format!(
                        "made for another model: {name} has {} columns there and {cols} here",
                        e.cols
                    )));
                }
                shared += 1;
            }
        }
        if shared == 0 && !self.entries.is_empty() {
            return Err(foreign("made for another model: it names none of this model's matrices".into()));
        }
        Ok(())
    }

    /// The column weights of a matrix, if recorded (and seen by any token).
    pub fn weights(&self, name: &str) -> Option<&[f32]> {
        self.entries.get(name).filter(|e| e.tokens > 0).map(|e| e.values.as_slice())
    }
}

/// Running sums of one matrix's input squares.
struct Acc {
    sums: Vec<f64>,
    rows: u64,
}

/// Address ranges of the file's tensors and their accumulators.
struct Recorder {
    /// (first byte, one past the last, tensor index), sorted by start.
    ranges: Vec<(usize, usize, usize)>,
    accs: Vec<Mutex<Acc>>,
}

impl Recorder {
    fn record(&self, w: &Matrix, inp: &Input) {
        let p = w.bytes.as_ptr() as usize;
        let i = self.ranges.partition_point(|r| r.0 <= p);
        let Some(&(_, end, idx)) = i.checked_sub(1).map(|i| &self.ranges[i]) else { return };
        if p + w.bytes.len() > end {
            return;
        }
        let mut acc = self.accs[idx].lock().unwrap_or_else(|p| p.into_inner());
        if acc.sums.len() != inp.cols {
            return;
        }
        for row in inp.x.chunks_exact(inp.cols) {
            for (s, &x) in acc.sums.iter_mut().zip(row) {
                *s += (x as f64) * (x as f64);
            }
            acc.rows += 1;
        }
    }
}

/// Removes the observer when calibration ends, however it ends.
struct Uninstall;

impl Drop for Uninstall {
    fn drop(&mut self) {
        crate::kernels::observe_matmuls(None);
    }
}

/// Only one calibration at a time: the observer is process-wide.
static CALIBRATING: Mutex<()> = Mutex::new(());

/// Runs `windows` (token ids, each a fresh sequence) through `engine` and
/// returns the importance matrix of every weight matrix that saw a token.
/// `progress(done, total)` is called after each window; `interrupted` is
/// polled between prompt chunks. Needs every expert in the file (an engine
/// opened without a RAM budget).
pub fn calibrate(
    engine: &Engine,
    windows: &[Vec<u32>],
    source: &str,
    progress: &dyn Fn(usize, usize),
    interrupted: &dyn Fn() -> bool,
) -> Result<Imatrix> {
    let model = engine.model();
    if model.streams_experts() {
        return Err(Error::InvalidInput(
            "calibration needs the whole model in memory: open the engine without a RAM budget".into(),
        ));
    }
    if windows.iter().all(|w| w.is_empty()) {
        return Err(Error::InvalidInput("calibration needs some text: every window is empty".into()));
    }
    let file = model.file();
    let meta = file.meta();
    let mut ranges = Vec::new();
    let mut accs = Vec::with_capacity(meta.tensors.len());
    for (idx, t) in meta.tensors.iter().enumerate() {
        let cols = if t.shape.len() >= 2 { *t.shape.last().expect("2-D") } else { 0 };
        if cols > 0 {
            let b = file.tensor_at(idx).bytes;
            ranges.push((b.as_ptr() as usize, b.as_ptr() as usize + b.len(), idx));
        }
        accs.push(Mutex::new(Acc { sums: vec![0.0; cols], rows: 0 }));
    }
    ranges.sort_unstable();
    let rec = Arc::new(Recorder { ranges, accs });

    let _one = CALIBRATING.lock().unwrap_or_else(|p| p.into_inner());
    let observer = rec.clone();
    crate::kernels::observe_matmuls(Some(Arc::new(move |w: &Matrix, inp: &Input| observer.record(w, inp))));
    let uninstall = Uninstall;
    // Every position's logits, so the lm_head multiplies (and the observer
    // records) every row of its input, not only the last of each window.
    let longest = windows.iter().map(Vec::len).max().unwrap_or(0);
    let mut logits = vec![0.0; longest * model.config.vocab_size];
    let mut tokens = 0u64;
    for (i, w) in windows.iter().enumerate() {
        if !w.is_empty() {
            let mut s = engine.session(w.len());
            if model.mtp.is_some() {
                // The multi-token-prediction layer runs too, so its matrices
                // are weighted by what they see when drafting.
                s.seq.enable_mtp(model)?;
            }
            let all = Some(&mut logits[..w.len() * model.config.vocab_size]);
            engine.run(&mut s, w, Capture { logits: all, ..Capture::default() }, interrupted)?;
            tokens += w.len() as u64;
        }
        progress(i + 1, windows.len());
    }
    drop(uninstall);

    let mut entries = BTreeMap::new();
    for (idx, acc) in rec.accs.iter().enumerate() {
        let acc = acc.lock().unwrap_or_else(|p| p.into_inner());
        if acc.sums.is_empty() {
            continue;
        }
        let n = acc.rows.max(1) as f64;
        entries.insert(
            meta.tensors[idx].name.clone(),
            Entry { cols: acc.sums.len(), tokens: acc.rows, values: acc.sums.iter().map(|s| (s / n) as f32).collect() },
        );
    }
    Ok(Imatrix { architecture: meta.architecture.clone(), tokens, source: source.to_string(), entries })
}

/// Where a calibration run writes by default: `model.imatrix` beside the model.
pub fn default_output(model: &Path) -> PathBuf {
    model.with_extension("imatrix")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Imatrix {
        let mut entries = BTreeMap::new();
        entries.insert("a".to_string(), Entry { cols: 3, tokens: 5, values: vec![1.0, 0.5, 0.0] });
        entries.insert("b".to_string(), Entry { cols: 2, tokens: 0, values: vec![0.0, 0.0] });
        Imatrix { architecture: "MixtralForCausalLM".into(), tokens: 9, source: "test".into(), entries }
    }

    #[test]
    fn a_file_reads_back_as_written() {
        let dir = std::env::temp_dir().join(format!("colibri-imatrix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.imatrix");
        let m = sample();
        m.save(&path).unwrap();
        assert_eq!(Imatrix::load(&path).unwrap(), m);
        assert_eq!(m.weights("a"), Some(&[1.0, 0.5, 0.0][..]));
        assert_eq!(m.weights("b"), None, "no token went through b");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn foreign_truncated_and_corrupt_files_are_format_errors() {
        let dir = std::env::temp_dir().join(format!("colibri-imatrix-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.imatrix");
        sample().save(&path).unwrap();
        let good = std::fs::read(&path).unwrap();
        let p = Path::new("x.imatrix");
        let err = |b: &[u8]| match Imatrix::from_bytes(p, b) {
            Err(Error::Format { path, msg }) => {
                assert_eq!(path, p);
                msg
            }
            other => panic!("expected a format error, got {other:?}"),
        };
        assert!(err(b"GGUF\x03\x00\x00\x00").contains("llama.cpp"));
        assert!(err(b"hello").contains("not a colibri"));
        for cut in [23, 30, good.len() - 1] {
            err(&good[..cut]);
        }
        let mut v2 = good.clone();
        v2[8] = 2;
        assert!(err(&v2).contains("version 2"));
        let mut nan = good.clone();
        let at = good.len() - 4 * 5; // entry a's first value
        nan[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(err(&nan).contains("not a mean square"));
        let mut huge = good.clone();
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(&huge).contains("runs past the end"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_matrix_for_another_model_is_refused() {
        let m = sample();
        let p = Path::new("m.imatrix");
        assert!(m.check_fits(p, "MixtralForCausalLM", [("a", 3), ("c", 7)]).is_ok());
        let msg = |r: Result<()>| r.unwrap_err().to_string();
        assert!(msg(m.check_fits(p, "OlmoeForCausalLM", [("a", 3)])).contains("not a OlmoeForCausalLM"));
        assert!(msg(m.check_fits(p, "MixtralForCausalLM", [("a", 4)])).contains("3 columns there and 4 here"));
        assert!(msg(m.check_fits(p, "MixtralForCausalLM", [("z", 4)])).contains("names none"));
    }
}
