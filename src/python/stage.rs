//! One pipeline stage for `colibri.ray`: an engine running a range of the
//! model's layers, and the sequences it holds state for, by id. The actor
//! around it owns placement and lifetime; this only computes.
//!
//! A stage before the last keeps a session per sequence and hands on the
//! residual stream (`forward`); the last stage keeps a generation per
//! sequence and returns tokens (`step`), so sampling, stop ids and seeds are
//! the single-process engine's own.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use super::{f32_bytes, generate_options, interrupted, routing_stats_json, to_ids, to_py};
use crate::engine::{Engine, EngineOptions, Generation, SamplingParams};
use crate::error::Error;
use crate::format::reader::ColibriFile;
use crate::model::forward::Capture;
use crate::model::forward::Segment;
use crate::model::session::{KvCacheType, Session, Workspace};
use crate::model::stage;
use crate::model::store::{Backing, StoreOptions};

/// What the last stage's `step` returns: the token, why the generation
/// ended, and the token's log-probabilities (`None` unless asked for).
type StepOut = (Option<u32>, Option<&'static str>, Option<(f32, Vec<(u32, f32)>)>);

/// What a stage holds for one sequence.
enum Held {
    /// A stage before the last: the layers' state.
    Session(Box<Session>),
    /// The last stage: the layers' state and the decoder.
    Generation(Box<Generation>),
}

#[pyclass(frozen, module = "colibri._colibri", name = "NativeStage")]
pub(super) struct NativeStage {
    inner: Engine,
    /// Sequences by the caller's id; one is taken out while it runs.
    held: Mutex<HashMap<u64, Held>>,
    /// The workspace of batched decode passes, made at the first.
    batch_ws: Mutex<Option<Workspace>>,
}

/// Most sequences one batched decode pass of a stage takes.
const MAX_BATCH: usize = 64;

impl NativeStage {
    fn take(&self, id: u64) -> PyResult<Held> {
        let mut held = self.held.lock().map_err(|_| to_py(Error::InvalidInput("a stage call panicked".into())))?;
        held.remove(&id).ok_or_else(|| {
            to_py(Error::InvalidInput(format!(
                "stage of layers {:?} holds no sequence {id} (never begun, released, or in use)",
                self.inner.model().stage.layers
            )))
        })
    }

    fn put(&self, id: u64, h: Held) {
        if let Ok(mut held) = self.held.lock() {
            held.insert(id, h);
        }
    }

    fn insert(&self, id: u64, h: Held) -> PyResult<()> {
        let mut held = self.held.lock().map_err(|_| to_py(Error::InvalidInput("a stage call panicked".into())))?;
        if held.contains_key(&id) {
            return Err(to_py(Error::InvalidInput(format!("sequence {id} is already begun on this stage"))));
        }
        held.insert(id, h);
        Ok(())
    }
}

/// Residual rows from Python bytes (f32, native order).
fn rows(b: Option<&[u8]>) -> PyResult<Option<Vec<f32>>> {
    match b {
        None => Ok(None),
        Some(b) if b.len() % 4 != 0 => {
            Err(to_py(Error::InvalidInput(format!("residual rows of {} bytes: not whole f32 values", b.len()))))
        }
        Some(b) => Ok(Some(b.chunks_exact(4).map(|w| f32::from_ne_bytes([w[0], w[1], w[2], w[3]])).collect())),
    }
}

#[pymethods]
impl NativeStage {
    #[new]
    #[pyo3(signature = (path, *, start=None, end=None, threads=None, kv_cache_dtype="auto", weights="auto",
                        ram_budget=None))]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    fn new(
        py: Python<'_>,
        path: PathBuf,
        start: Option<usize>,
        end: Option<usize>,
        threads: Option<usize>,
        kv_cache_dtype: &str,
        weights: &str,
        ram_budget: Option<u64>,
    ) -> PyResult<Self> {
        let kv_cache = KvCacheType::parse(kv_cache_dtype).ok_or_else(|| {
            to_py(Error::InvalidInput(format!(
                "kv_cache_dtype must be \"auto\", \"f32\" or \"f16\", got {kv_cache_dtype:?}"
            )))
        })?;
        let store =
            StoreOptions { backing: Backing::parse(weights).map_err(to_py)?, ram_budget, ..StoreOptions::default() };
        let inner = py
            .detach(|| {
                // A stage file's own layers unless told otherwise; a whole
                // file needs both ends.
                let held = ColibriFile::open(&path)?.part().map(|p| p.range());
                let layers = match (start, end, held.clone()) {
                    (Some(a), Some(b), _) => a..b,
                    (None, None, Some(r)) => r,
                    (a, b, held) => {
                        let r = held.unwrap_or_default();
                        a.unwrap_or(r.start)..b.unwrap_or(r.end)
                    }
                };
                if layers.is_empty() && held.is_none() {
                    return Err(Error::InvalidInput(
                        "a stage of a whole model file needs its layers: give start and end".into(),
                    ));
                }
                Engine::open(&path, &EngineOptions { threads, store, kv_cache, stage: Some(layers) })
            })
            .map_err(to_py)?;
        Ok(NativeStage { inner, held: Mutex::new(HashMap::new()), batch_ws: Mutex::new(None) })
    }

    /// `(start, end)`: the layers this stage runs.
    #[getter]
    fn layers(&self) -> (usize, usize) {
        let r = &self.inner.model().stage.layers;
        (r.start, r.end)
    }

    /// True for the last stage (it returns tokens and logits).
    #[getter]
    fn is_last(&self) -> bool {
        self.inner.model().stage.heads()
    }

    /// Sequences this stage holds state for.
    #[getter]
    fn sequences(&self) -> usize {
        self.held.lock().map(|h| h.len()).unwrap_or(0)
    }

    /// Worker threads.
    #[getter]
    fn threads(&self) -> usize {
        self.inner.threads()
    }

    /// Makes room for sequence `id` of up to `max_seq` tokens on a stage
    /// before the last.
    fn begin(&self, id: u64, max_seq: usize) -> PyResult<()> {
        if self.inner.model().stage.heads() {
            return Err(to_py(Error::InvalidInput("the last stage begins sequences with start()".into())));
        }
        let ctx = self.inner.model().config.max_seq_len;
        self.insert(id, Held::Session(Box::new(self.inner.session(max_seq.min(ctx)))))
    }

    /// Starts generation `id` continuing `token_ids` on the last stage (the
    /// options are `NativeEngine.start`'s; speculative decoding is refused).
    #[pyo3(signature = (
        id, token_ids, *, max_new_tokens, stop_ids, temperature, top_k, top_p, min_p,
        repetition_penalty, presence_penalty, frequency_penalty, seed, logprobs=None,
        json_schema=None, regex=None, grammar=None,
    ))]
    #[allow(clippy::too_many_arguments)] // keyword-only on the Python side
    fn start(
        &self,
        py: Python<'_>,
        id: u64,
        token_ids: Vec<i64>,
        max_new_tokens: usize,
        stop_ids: Vec<i64>,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        repetition_penalty: f32,
        presence_penalty: f32,
        frequency_penalty: f32,
        seed: u64,
        logprobs: Option<usize>,
        json_schema: Option<String>,
        regex: Option<String>,
        grammar: Option<String>,
    ) -> PyResult<()> {
        if !self.inner.model().stage.heads() {
            return Err(to_py(Error::InvalidInput("only the last stage starts generations".into())));
        }
        let ids = to_ids(token_ids).map_err(to_py)?;
        let sampling = SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            seed,
        };
        let opts = generate_options(
            max_new_tokens,
            stop_ids,
            sampling,
            logprobs,
            [json_schema, regex, grammar],
            None,
            0,
            Vec::new(),
        )?;
        let g = py.detach(|| self.inner.start(&ids, &opts)).map_err(to_py)?;
        self.insert(id, Held::Generation(Box::new(g)))
    }

    /// Runs `token_ids` of sequence `id` through this stage (not the last)
    /// and returns its residual rows, f32 `[T, D]`; `residual` is the stage
    /// before's (none on the first stage).
    #[pyo3(signature = (id, token_ids, residual=None))]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        id: u64,
        token_ids: Vec<i64>,
        residual: Option<&[u8]>,
    ) -> PyResult<Bound<'py, PyByteArray>> {
        let ids = to_ids(token_ids).map_err(to_py)?;
        let input = rows(residual)?;
        let Held::Session(mut s) = self.take(id)? else {
            return Err(to_py(Error::InvalidInput("the last stage steps generations with step()".into())));
        };
        let d = self.inner.model().config.hidden_size;
        let mut out = vec![0.0; ids.len() * d];
        let done = py.detach(|| {
            let cap = Capture { residual: Some(&mut out), ..Capture::default() };
            self.inner.run_stage(&mut s, &ids, input.as_deref(), cap, &interrupted)
        });
        // A failed pass may have left the sequence mid-update: it is dropped.
        done.map_err(to_py)?;
        self.put(id, Held::Session(s));
        Ok(f32_bytes(py, &out))
    }

    /// One step of generation `id` on the last stage from the stage
    /// before's residual rows for its pending tokens (the prompt, then the
    /// last token): `(token, finish reason, its log-probabilities)`, the
    /// token `None` once the generation has finished, the reason `None`
    /// while it goes on and the log-probabilities `None` unless asked for.
    fn step(&self, py: Python<'_>, id: u64, residual: Option<&[u8]>) -> PyResult<StepOut> {
        let input = rows(residual)?;
        let Held::Generation(mut g) = self.take(id)? else {
            return Err(to_py(Error::InvalidInput("a stage before the last runs sequences with forward()".into())));
        };
        let t = py.detach(|| g.next_token_from(input.as_deref(), &interrupted)).map_err(to_py)?;
        let lp = t.and_then(|_| g.logprobs().last()).map(|l| (l.logprob, l.top.clone()));
        let finish = g.finish_reason().map(|f| f.as_str());
        self.put(id, Held::Generation(g));
        Ok((t, finish, lp))
    }

    /// One decode step of several sequences in one batched pass: `ids[i]`
    /// feeds `token_ids[i]` (stages before the last) and `residual` holds
    /// the stage before's rows for them in order (none on the first stage).
    /// A stage before the last returns its rows `[n, D]` (f32 bytes); the
    /// last returns one `step` result per sequence. A failure drops every
    /// sequence of the batch.
    #[pyo3(signature = (ids, token_ids, residual=None))]
    fn step_many<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u64>,
        token_ids: Vec<i64>,
        residual: Option<&[u8]>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if ids.is_empty() || ids.len() > MAX_BATCH {
            return Err(to_py(Error::InvalidInput(format!(
                "a batched step takes 1 to {MAX_BATCH} sequences, got {}",
                ids.len()
            ))));
        }
        let input = rows(residual)?;
        let last = self.inner.model().stage.heads();
        let mut taken = Vec::with_capacity(ids.len());
        for &id in &ids {
            match self.take(id) {
                Ok(h) => taken.push((id, h)),
                Err(e) => {
                    taken.into_iter().for_each(|(id, h)| self.put(id, h));
                    return Err(e);
                }
            }
        }
        let mut ws = self.batch_ws.lock().map_err(|_| to_py(Error::InvalidInput("a stage call panicked".into())))?;
        let ws = ws.get_or_insert_with(|| Workspace::new(self.inner.model(), MAX_BATCH, MAX_BATCH));
        let d = self.inner.model().config.hidden_size;
        let mut out = vec![0.0; if last { 0 } else { ids.len() * d }];
        let began = std::time::Instant::now();
        let result = py.detach(|| -> Result<Vec<StepOut>, Error> {
            let fed: Vec<[u32; 1]> =
                if last { Vec::new() } else { to_ids(token_ids.clone())?.into_iter().map(|t| [t]).collect() };
            if !last && fed.len() != ids.len() {
                return Err(Error::InvalidInput(format!("{} sequences but {} tokens", ids.len(), fed.len())));
            }
            let mut segs = Vec::with_capacity(taken.len());
            let mut last_tokens = Vec::with_capacity(taken.len());
            for (i, (id, h)) in taken.iter_mut().enumerate() {
                let (seq, tokens): (&mut crate::model::session::Sequence, &[u32]) = match h {
                    Held::Session(s) if !last => (&mut s.seq, &fed[i][..]),
                    Held::Generation(g) if last => match g.decode_parts() {
                        Some((seq, t)) => {
                            last_tokens.push([t]);
                            (seq, &[])
                        }
                        None => return Err(Error::InvalidInput(format!("generation {id} is not decoding"))),
                    },
                    _ => return Err(Error::InvalidInput(format!("sequence {id} is not this stage's kind"))),
                };
                segs.push((seq, tokens));
            }
            let mut segments: Vec<Segment> = segs
                .into_iter()
                .enumerate()
                .map(|(i, (seq, tokens))| {
                    let tokens = if last { &last_tokens[i][..] } else { tokens };
                    let end = seq.pos + 1;
                    Segment { seq, tokens, end, logit_rows: usize::from(last) }
                })
                .collect();
            let residual = (!last).then_some(&mut out[..]);
            self.inner.run_batch_stage(ws, &mut segments, input.as_deref(), residual)?;
            drop(segments);
            let mut steps = Vec::with_capacity(taken.len());
            for (_, h) in taken.iter_mut() {
                if let Held::Generation(g) = h {
                    let t = g.step_after_pass(began);
                    let lp = g.logprobs().last().filter(|_| g.logprobs().len() == g.tokens().len());
                    steps.push((
                        Some(t),
                        g.finish_reason().map(|f| f.as_str()),
                        lp.map(|l| (l.logprob, l.top.clone())),
                    ));
                }
            }
            Ok(steps)
        });
        match result {
            Err(e) => Err(to_py(e)), // the batch's sequences are dropped with `taken`
            Ok(steps) => {
                taken.into_iter().for_each(|(id, h)| self.put(id, h));
                if last { Ok(steps.into_pyobject(py)?.into_any()) } else { Ok(f32_bytes(py, &out).into_any()) }
            }
        }
    }

    /// Routing statistics of this stage's layers as JSON text (the other
    /// layers' counts are zero), as `NativeEngine.routing_stats_json`.
    #[pyo3(signature = (since=None, until=None))]
    fn routing_stats_json(&self, since: Option<&str>, until: Option<&str>) -> PyResult<String> {
        routing_stats_json(&self.inner, since, until)
    }

    /// Expert-store statistics of this stage as JSON text.
    fn store_stats_json(&self) -> String {
        serde_json::to_string(&self.inner.model().store_stats()).unwrap_or_default()
    }

    /// The KV cache element type.
    fn kv_dtype(&self) -> &'static str {
        self.inner.kv_dtype().name()
    }

    /// State memory of one sequence of the whole model: (bytes per token,
    /// bytes per sequence).
    fn state_bytes(&self) -> (usize, usize) {
        let layout = self.inner.state_layout();
        (layout.bytes_per_token, layout.bytes_per_sequence)
    }

    /// The file's metadata as JSON text (`NativeEngine.metadata_json`'s).
    fn metadata_json(&self) -> String {
        super::metadata_json(&self.inner)
    }

    /// The file's tokenizer.json, if it keeps one.
    fn tokenizer_json(&self, py: Python<'_>) -> Option<String> {
        let tok = self.inner.model().file().meta().source.tokenizer.as_ref()?;
        Some(py.detach(|| tok.to_string()))
    }

    /// Forgets sequence `id` (a no-op for an id it does not hold).
    fn release(&self, id: u64) {
        if let Ok(mut held) = self.held.lock() {
            held.remove(&id);
        }
    }

    /// A fresh sequence of `token_ids` through this stage, nothing kept:
    /// the residual rows `[T, D]`, or on the last stage the logits of
    /// every position `[T, V]` (f32 bytes).
    #[pyo3(signature = (token_ids, residual=None))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        token_ids: Vec<i64>,
        residual: Option<&[u8]>,
    ) -> PyResult<Bound<'py, PyByteArray>> {
        let ids = to_ids(token_ids).map_err(to_py)?;
        let input = rows(residual)?;
        let c = &self.inner.model().config;
        if ids.len() > c.max_seq_len {
            return Err(to_py(Error::ContextOverflow(format!(
                "sequence of {} tokens is longer than the model's context of {}",
                ids.len(),
                c.max_seq_len
            ))));
        }
        let last = self.inner.model().stage.heads();
        let mut out = vec![0.0; ids.len() * if last { c.vocab_size } else { c.hidden_size }];
        let mut s = self.inner.session(ids.len().max(1));
        py.detach(|| {
            let cap = match last {
                true => Capture { logits: Some(&mut out), ..Capture::default() },
                false => Capture { residual: Some(&mut out), ..Capture::default() },
            };
            self.inner.run_stage(&mut s, &ids, input.as_deref(), cap, &interrupted)
        })
        .map_err(to_py)?;
        Ok(f32_bytes(py, &out))
    }
}

/// Stage boundaries for `path` split across nodes with the relative
/// `shares` (one per stage), balanced by weight bytes: `[(start, end)]`.
#[pyfunction]
pub(super) fn stage_plan(path: PathBuf, shares: Vec<f64>) -> PyResult<Vec<(usize, usize)>> {
    let file = ColibriFile::open(&path).map_err(to_py)?;
    let (bytes, embed, head) = stage::layer_bytes(&file);
    let plan = stage::balance(&bytes, (embed, head), &stage::can_start(&file.meta().config), &shares).map_err(to_py)?;
    Ok(plan.into_iter().map(|r| (r.start, r.end)).collect())
}

/// What part of its model the stage file `path` holds, as JSON (stage,
/// stages, layers, origin, plus `of`: the model's layers, and `bytes`: the
/// file's size), or `None` for a whole model file.
#[pyfunction]
pub(super) fn stage_file_info(py: Python<'_>, path: PathBuf) -> PyResult<Option<String>> {
    py.detach(|| {
        let file = ColibriFile::open(&path)?;
        Ok(file.part().map(|p| {
            serde_json::json!({
                "stage": p.stage, "stages": p.stages, "layers": p.layers, "origin": p.origin,
                "of": file.meta().config.main_layers(), "bytes": file.file_len(),
            })
            .to_string()
        }))
    })
    .map_err(to_py)
}

/// Cuts the model file `path` into stage files in the folder `out`, one per
/// `(start, end)` of `plan`; returns each file's `(path, start, end, bytes)`.
#[pyfunction]
#[pyo3(signature = (path, out, plan, *, force=false, progress=true))]
pub(super) fn split_model(
    py: Python<'_>,
    path: PathBuf,
    out: PathBuf,
    plan: Vec<(usize, usize)>,
    force: bool,
    progress: bool,
) -> PyResult<Vec<(PathBuf, usize, usize, u64)>> {
    let plan: Vec<_> = plan.into_iter().map(|(a, b)| a..b).collect();
    let files =
        py.detach(|| crate::convert::split::split(&path, &plan, &out, force, progress, &interrupted)).map_err(to_py)?;
    Ok(files.into_iter().map(|f| (f.path, f.layers.start, f.layers.end, f.bytes)).collect())
}

/// The weight bytes of `path`'s layers `(per layer, embedding, final norm
/// and head)`, what a stage's share of the file is made of.
#[pyfunction]
pub(super) fn stage_bytes(path: PathBuf) -> PyResult<(Vec<u64>, u64, u64)> {
    let file = ColibriFile::open(&path).map_err(to_py)?;
    Ok(stage::layer_bytes(&file))
}
