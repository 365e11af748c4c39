//! The PyO3 layer: thin wrappers over [`crate::engine`] and [`crate::convert`].
//!
//! Compute runs with the interpreter detached (other Python threads keep
//! running); Ctrl-C is polled between tokens and chunks. A generation is a
//! native iterator ([`NativeGeneration`]) that runs one step per `__next__`,
//! so the Python side can detokenise, match stop strings and see Ctrl-C
//! between tokens. Every Rust error
//! becomes one class of the hierarchy in `colibri/_errors.py`, mapped in
//! [`to_py`] and nowhere else.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

use crate::convert::{ConvertOptions, Recipe, convert};
use crate::engine::batch::Canceller;
use crate::engine::{
    BatchOptions, Constraint, Drafts, Engine, EngineOptions, GenerateOptions, SamplingParams, Scheduler, Speculation,
    Ticket,
};
use crate::error::Error;
use crate::io::IoMode;
use crate::model::session::KvCacheType;
use crate::model::store::{Backing, HeatFile, Policy, StoreOptions};
use crate::quant::DType;

mod stage;

/// The classes of `colibri/_errors.py`, each imported on first use and kept.
mod exceptions {
    pyo3::import_exception!(colibri._errors, BusyError);
    pyo3::import_exception!(colibri._errors, CheckpointError);
    pyo3::import_exception!(colibri._errors, ColibriError);
    pyo3::import_exception!(colibri._errors, ColibriIOError);
    pyo3::import_exception!(colibri._errors, ContextLengthError);
    pyo3::import_exception!(colibri._errors, FormatError);
    pyo3::import_exception!(colibri._errors, InvalidInputError);
    pyo3::import_exception!(colibri._errors, ModelNotFoundError);
    pyo3::import_exception!(colibri._errors, OutputExistsError);
    pyo3::import_exception!(colibri._errors, UnsupportedModelError);
}

/// Maps an error to its Python exception class.
fn to_py(e: Error) -> PyErr {
    use exceptions::*;
    let new_err: fn(String) -> PyErr = match &e {
        Error::Format { .. } => FormatError::new_err,
        Error::Unsupported(_) => UnsupportedModelError::new_err,
        Error::Checkpoint { .. } => CheckpointError::new_err,
        Error::InvalidInput(_) => InvalidInputError::new_err,
        Error::ContextOverflow(_) => ContextLengthError::new_err,
        Error::OutputExists(_) => OutputExistsError::new_err,
        Error::NotFound(_) => ModelNotFoundError::new_err,
        Error::Io { .. } | Error::ExpertRead { .. } => ColibriIOError::new_err,
        Error::Busy(_) => BusyError::new_err,
        Error::Internal(_) => ColibriError::new_err,
        Error::Interrupted => {
            // The exception the signal handler raised (KeyboardInterrupt for
            // Ctrl-C, whatever a caller's SIGTERM handler raises), so it
            // propagates as if Python code had been running.
            let pending = PENDING_SIGNAL.lock().unwrap_or_else(|p| p.into_inner()).take();
            return pending.unwrap_or_else(|| PyKeyboardInterrupt::new_err("interrupted"));
        }
    };
    new_err(e.to_string())
}

/// The exception a signal handler raised during the last poll that stopped
/// a call, handed to [`to_py`].
static PENDING_SIGNAL: Mutex<Option<PyErr>> = Mutex::new(None);

/// Polls for signals (Ctrl-C, or any signal with a Python handler); only the
/// main thread ever sees them. A handler that raises stops the call.
fn interrupted() -> bool {
    Python::attach(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            *PENDING_SIGNAL.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            true
        }
    })
}

/// Token ids from Python ints, refusing negatives here (ids too large are
/// refused by the forward pass, which knows the vocabulary).
fn to_ids(ids: Vec<i64>) -> Result<Vec<u32>, Error> {
    ids.iter()
        .enumerate()
        .map(|(i, &t)| {
            u32::try_from(t).map_err(|_| Error::InvalidInput(format!("token id {t} at position {i} is out of range")))
        })
        .collect()
}

fn f32_bytes<'py>(py: Python<'py>, v: &[f32]) -> Bound<'py, PyByteArray> {
    PyByteArray::new(py, bytemuck::cast_slice(v))
}

/// Native engine; `colibri.Engine` wraps it and builds NumPy arrays.
#[pyclass(frozen, module = "colibri._colibri", name = "NativeEngine")]
struct NativeEngine {
    inner: Engine,
    /// Every generation goes through it, so concurrent callers share steps.
    batch: Scheduler,
}

#[pymethods]
impl NativeEngine {
    #[new]
    #[pyo3(signature = (
        path, *, threads=None, ram_budget=None, lru=true, pin_hot=true, prefetch=false, io="buffered",
        heat_file=None, kv_cache_dtype="auto", max_batch=16, max_queue=0, weights="auto", max_state_bytes=0,
        prefix_cache_bytes=0,
    ))]
    #[allow(clippy::too_many_arguments)] // mirrors keyword arguments of the Python constructor
    fn new(
        py: Python<'_>,
        path: PathBuf,
        threads: Option<usize>,
        ram_budget: Option<u64>,
        lru: bool,
        pin_hot: bool,
        prefetch: bool,
        io: &str,
        heat_file: Option<&str>,
        kv_cache_dtype: &str,
        max_batch: usize,
        max_queue: usize,
        weights: &str,
        max_state_bytes: u64,
        prefix_cache_bytes: u64,
    ) -> PyResult<Self> {
        let io = IoMode::parse(io).map_err(to_py)?;
        let backing = Backing::parse(weights).map_err(to_py)?;
        let kv_cache = KvCacheType::parse(kv_cache_dtype).ok_or_else(|| {
            to_py(Error::InvalidInput(format!(
                "kv_cache_dtype must be \"auto\", \"f32\" or \"f16\", got {kv_cache_dtype:?}"
            )))
        })?;
        let heat_file = match heat_file {
            None => HeatFile::Beside,
            Some("off") => HeatFile::Off,
            Some(p) => HeatFile::At(PathBuf::from(p)),
        };
        let store = StoreOptions {
            ram_budget,
            policy: Policy { lru, pin_hot, prefetch },
            io,
            heat_file,
            io_threads: 0,
            backing,
        };
        let opts = EngineOptions { threads, store, kv_cache, stage: None };
        let inner = py.detach(|| Engine::open(&path, &opts)).map_err(to_py)?;
        let max_state_bytes = usize::try_from(max_state_bytes).unwrap_or(usize::MAX);
        let prefix_cache_bytes = usize::try_from(prefix_cache_bytes).unwrap_or(usize::MAX);
        let batch_opts =
            BatchOptions { max_batch, max_queue, max_state_bytes, prefix_cache_bytes, ..BatchOptions::default() };
        let batch = Scheduler::new(&inner, batch_opts).map_err(to_py)?;
        Ok(NativeEngine { inner, batch })
    }

    /// Element type of the KV cache sessions use: "f32" or "f16".
    fn kv_dtype(&self) -> &'static str {
        self.inner.kv_dtype().name()
    }

    /// Bytes the KV cache takes per token, all layers.
    fn kv_bytes_per_token(&self) -> usize {
        self.inner.kv_bytes_per_token()
    }

    /// State memory of one sequence: (bytes per token, bytes per sequence), all layers.
    fn state_bytes(&self) -> (usize, usize) {
        let layout = self.inner.state_layout();
        (layout.bytes_per_token, layout.bytes_per_sequence)
    }

    /// Routing statistics as JSON text: counts since the file was opened, or
    /// since `since` (the JSON of an earlier snapshot of this model), up to
    /// now or to `until` (the JSON of a later snapshot).
    #[pyo3(signature = (since=None, until=None))]
    fn routing_stats_json(&self, since: Option<&str>, until: Option<&str>) -> PyResult<String> {
        routing_stats_json(&self.inner, since, until)
    }

    /// Expert-store statistics as JSON text (counts since the file was opened).
    fn store_stats_json(&self) -> String {
        serde_json::to_string(&self.inner.model().store_stats()).unwrap_or_default()
    }

    /// Logits as a bytearray of f32, shape (T, V).
    fn logits<'py>(&self, py: Python<'py>, token_ids: Vec<i64>) -> PyResult<Bound<'py, PyByteArray>> {
        let ids = to_ids(token_ids).map_err(to_py)?;
        let out = py.detach(|| self.inner.logits(&ids, &interrupted)).map_err(to_py)?;
        Ok(f32_bytes(py, &out))
    }

    /// Hidden states as a bytearray of f32, shape (L+1, T, D).
    fn hidden_states<'py>(&self, py: Python<'py>, token_ids: Vec<i64>) -> PyResult<Bound<'py, PyByteArray>> {
        let ids = to_ids(token_ids).map_err(to_py)?;
        let out = py.detach(|| self.inner.hidden_states(&ids, &interrupted)).map_err(to_py)?;
        Ok(f32_bytes(py, &out))
    }

    /// The multi-token-prediction layer's logits as a bytearray of f32,
    /// shape (T − 1 + k, V) (see `Engine::mtp_draft_logits`).
    fn mtp_draft_logits<'py>(
        &self,
        py: Python<'py>,
        token_ids: Vec<i64>,
        k: usize,
    ) -> PyResult<Bound<'py, PyByteArray>> {
        let ids = to_ids(token_ids).map_err(to_py)?;
        let out = py.detach(|| self.inner.mtp_draft_logits(&ids, k, &interrupted)).map_err(to_py)?;
        Ok(f32_bytes(py, &out))
    }

    /// Queues a generation on the engine's scheduler; it runs beside every
    /// other one, its tokens arriving through `__next__`.
    #[pyo3(signature = (
        token_ids, *, max_new_tokens, stop_ids, temperature, top_k, top_p, min_p,
        repetition_penalty, presence_penalty, frequency_penalty, seed, logprobs=None,
        json_schema=None, regex=None, grammar=None, speculative=None, draft_tokens=4, prediction=Vec::new(),
    ))]
    #[allow(clippy::too_many_arguments)] // keyword-only on the Python side
    fn start(
        &self,
        py: Python<'_>,
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
        speculative: Option<&str>,
        draft_tokens: usize,
        prediction: Vec<i64>,
    ) -> PyResult<NativeGeneration> {
        let ids = to_ids(token_ids).map_err(to_py)?;
        let opts = generate_options(
            max_new_tokens,
            stop_ids,
            SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty,
                presence_penalty,
                frequency_penalty,
                seed,
            },
            logprobs,
            [json_schema, regex, grammar],
            speculative,
            draft_tokens,
            prediction,
        )?;
        let t = py.detach(|| self.batch.submit(&ids, &opts)).map_err(to_py)?;
        Ok(NativeGeneration { canceller: t.canceller(), inner: Mutex::new(t) })
    }

    /// Stops the scheduler (waiting and running generations end with an
    /// error, later ones are refused) and saves routing heat now; returns
    /// where it went, if experts streamed. The weights stay mapped until the
    /// last object using them is gone.
    fn close(&self, py: Python<'_>) -> PyResult<Option<String>> {
        py.detach(|| {
            self.batch.close();
            self.inner.model().save_heat()
        })
        .map(|p| p.map(|p| p.display().to_string()))
        .map_err(to_py)
    }

    /// The scheduler's counters as JSON (see `BatchStats`).
    fn batch_stats_json(&self) -> String {
        let s = self.batch.stats();
        let o = self.batch.options();
        serde_json::json!({
            "waiting": s.waiting,
            "running": s.running,
            "steps": s.steps,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "last_batch": s.last_batch,
            "step_token_buckets": crate::engine::batch::STEP_BUCKETS,
            "step_tokens": s.step_tokens,
            "step_sequences": s.step_sequences,
            "finished": s.finished,
            "busy_seconds": s.busy_seconds,
            "kv_tokens": s.kv_tokens,
            "drafted_tokens": s.drafted_tokens,
            "accepted_tokens": s.accepted_tokens,
            "max_batch": o.max_batch,
            "max_queue": o.max_queue,
            "step_budget": o.step_tokens,
            "prefix_cache": s.prefix.map(|p| serde_json::json!({
                "budget_bytes": p.budget,
                "bytes": p.bytes,
                "blocks": p.blocks,
                "block_tokens": crate::engine::prefix::BLOCK,
                "lookups": p.lookups,
                "hits": p.hits,
                "prompt_tokens": p.prompt_tokens,
                "cached_tokens": p.cached_tokens,
                "evicted_blocks": p.evicted,
            })),
        })
        .to_string()
    }

    /// The metadata block as JSON text, without the tokenizer (see
    /// `tokenizer_json`) and the tensor table (see `tensors`), which can be
    /// large and are fetched only when needed.
    fn metadata_json(&self) -> String {
        metadata_json(&self.inner)
    }

    /// The embedded tokenizer.json as text, if the file has one.
    fn tokenizer_json(&self, py: Python<'_>) -> Option<String> {
        let tok = self.inner.model().file().meta().source.tokenizer.as_ref()?;
        Some(py.detach(|| tok.to_string()))
    }

    /// Every tensor as (name, dtype, shape, bytes), in file order.
    fn tensors(&self) -> Vec<(String, &'static str, Vec<usize>, u64)> {
        let meta = self.inner.model().file().meta();
        meta.tensors.iter().map(|t| (t.name.clone(), t.dtype.name(), t.shape.clone(), t.nbytes)).collect()
    }

    /// The recipe class (`attn`, `experts`, ...) of every weight matrix, by
    /// tensor name (norms, biases and the router have none; a tied
    /// embedding is `lm_head`).
    fn tensor_classes(&self) -> Vec<(String, &'static str)> {
        let cfg = &self.inner.model().config;
        let plan = crate::canonical::tensors::tensor_plan(cfg);
        plan.iter().filter_map(|p| Some((p.id.to_string(), p.id.class_in(cfg.tie_embeddings)?.name()))).collect()
    }

    /// The conversion recipe recorded in the file (mixed types only).
    fn recipe(&self) -> Option<String> {
        self.inner.model().file().meta().recipe.clone()
    }

    /// Runs token windows through the model recording each weight matrix's
    /// input columns, and writes the importance matrix to `output`; returns
    /// (tokens run, matrices recorded).
    #[pyo3(signature = (windows, output, source, *, progress=true))]
    fn calibrate(
        &self,
        py: Python<'_>,
        windows: Vec<Vec<i64>>,
        output: PathBuf,
        source: &str,
        progress: bool,
    ) -> PyResult<(u64, usize)> {
        let windows: Vec<Vec<u32>> = windows.into_iter().map(to_ids).collect::<Result<_, _>>().map_err(to_py)?;
        let run = || -> Result<(u64, usize), Error> {
            let total: u64 = windows.iter().map(|w| w.len() as u64).sum();
            let bar = if progress {
                let b = indicatif::ProgressBar::with_draw_target(Some(total), indicatif::ProgressDrawTarget::stderr());
                b.set_style(
                    indicatif::ProgressStyle::with_template("calibrating {bar:40} {pos}/{len} tokens ({eta})")
                        .expect("static template")
                        .progress_chars("=> "),
                );
                b
            } else {
                indicatif::ProgressBar::hidden()
            };
            let lens: Vec<u64> = windows.iter().map(|w| w.len() as u64).collect();
            let tick = |done: usize, _total: usize| bar.set_position(lens[..done].iter().sum());
            let m = crate::imatrix::calibrate(&self.inner, &windows, source, &tick, &interrupted)?;
            bar.finish_and_clear();
            m.save(&output)?;
            Ok((m.tokens, m.entries.len()))
        };
        py.detach(run).map_err(to_py)
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.threads()
    }
}

/// One generation in progress: an iterator of new token ids. Each
/// `__next__` waits for the scheduler's next token with the interpreter
/// detached. The lock makes a second thread calling `__next__` on the same
/// object at the same time an error rather than a data race; distinct
/// generations never contend. Dropping it cancels the generation.
/// Per token: its log-probability and the top alternatives.
type LogprobRows = Vec<(f32, Vec<(u32, f32)>)>;

/// What `NativeGeneration.timings` returns (see there).
type TimingsTuple = (usize, usize, f64, f64, usize, usize, usize, usize);

/// Routing statistics of `engine` as JSON text, since `since` and up to
/// `until` when given (see `NativeEngine.routing_stats_json`).
fn routing_stats_json(engine: &Engine, since: Option<&str>, until: Option<&str>) -> PyResult<String> {
    let parse = |what: &str, text: &str| -> PyResult<crate::model::store::RoutingStats> {
        serde_json::from_str(text)
            .map_err(|e| to_py(Error::InvalidInput(format!("{what}: not a routing_stats() snapshot: {e}"))))
    };
    // The window's end: a snapshot the caller holds, or now.
    let end = match until {
        None => engine.model().routing_stats(),
        Some(text) => parse("until", text)?,
    };
    let stats = match since {
        None => end,
        Some(text) => end.since(&parse("since", text)?).map_err(to_py)?,
    };
    Ok(serde_json::to_string(&stats).unwrap_or_default())
}

/// The file's metadata as JSON text (see `NativeEngine.metadata_json`).
fn metadata_json(engine: &Engine) -> String {
    let file = engine.model().file();
    let meta = file.meta();
    let src = &meta.source;
    serde_json::json!({
        "architecture": meta.architecture,
        "config": meta.config,
        "weight_dtype": meta.weight_dtype,
        "source_config": src.config,
        "source_dtype": src.dtype,
        "skipped": src.skipped,
        "generation_config": src.generation_config,
        "tokenizer_config": src.tokenizer_config,
        "chat_template": src.chat_template,
        "has_tokenizer": src.tokenizer.is_some(),
        "tensors": meta.tensors.len(),
        "file_bytes": file.file_len(),
    })
    .to_string()
}

/// A generation's options from the keyword arguments `start` takes.
#[allow(clippy::too_many_arguments)] // keyword-only on the Python side
fn generate_options(
    max_new_tokens: usize,
    stop_ids: Vec<i64>,
    sampling: SamplingParams,
    logprobs: Option<usize>,
    [json_schema, regex, grammar]: [Option<String>; 3],
    speculative: Option<&str>,
    draft_tokens: usize,
    prediction: Vec<i64>,
) -> PyResult<GenerateOptions> {
    // An id no token can have never matches; dropping it is harmless.
    let stop_ids = stop_ids.into_iter().filter_map(|t| u32::try_from(t).ok()).collect();
    let mut given =
        [json_schema.map(Constraint::JsonSchema), regex.map(Constraint::Regex), grammar.map(Constraint::Grammar)]
            .into_iter()
            .flatten();
    let constraint = given.next();
    if given.next().is_some() {
        return Err(to_py(Error::InvalidInput("at most one of json_schema, regex and grammar may be given".into())));
    }
    let speculation = match speculative {
        None => None,
        Some(s) => Some(Speculation { drafts: Drafts::parse(s).map_err(to_py)?, tokens: draft_tokens }),
    };
    let prediction = to_ids(prediction).map_err(to_py)?;
    Ok(GenerateOptions { max_new_tokens, sampling, stop_ids, logprobs, constraint, speculation, prediction })
}

#[pyclass(frozen, module = "colibri._colibri", name = "NativeGeneration")]
struct NativeGeneration {
    inner: Mutex<Ticket>,
    /// Reaches the ticket without its lock, so another thread can cancel.
    canceller: Canceller,
}

impl NativeGeneration {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, Ticket>> {
        self.inner.try_lock().map_err(|e| match e {
            std::sync::TryLockError::WouldBlock => to_py(Error::InvalidInput(
                "this generation is being advanced by another thread; use one generation per thread".into(),
            )),
            std::sync::TryLockError::Poisoned(_) => {
                PyRuntimeError::new_err("this generation failed in an earlier step and cannot go on")
            }
        })
    }
}

#[pymethods]
impl NativeGeneration {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<u32>> {
        let mut guard = self.lock()?;
        let g: &mut Ticket = &mut guard;
        py.detach(|| g.next_token(&interrupted)).map_err(to_py)
    }

    /// Stops the generation (from any thread); the scheduler frees its
    /// place at the next step and a waiting `__next__` ends the iteration.
    fn cancel(&self) {
        self.canceller.cancel();
    }

    /// "stop", "length", or None while the generation can go on.
    #[getter]
    fn finish_reason(&self) -> PyResult<Option<&'static str>> {
        Ok(self.lock()?.finish_reason().map(|r| r.as_str()))
    }

    /// The tokens generated so far.
    #[getter]
    fn token_ids(&self) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.tokens().to_vec())
    }

    /// How many tokens were generated so far (`len(token_ids)` without the copy).
    #[getter]
    fn num_tokens(&self) -> PyResult<usize> {
        Ok(self.lock()?.tokens().len())
    }

    /// Log-probabilities of the tokens from index `start` on, when asked for:
    /// one `(logprob, [(token id, logprob), ...])` per token.
    #[pyo3(signature = (start=0))]
    fn logprobs(&self, start: usize) -> PyResult<LogprobRows> {
        let g = self.lock()?;
        let rows = g.logprobs().get(start..).unwrap_or_default();
        Ok(rows.iter().map(|t| (t.logprob, t.top.clone())).collect())
    }

    /// (prompt tokens, generated tokens, prefill seconds, decode seconds,
    /// prompt tokens from the prefix cache, drafted tokens, accepted
    /// drafts, decode passes).
    fn timings(&self) -> PyResult<TimingsTuple> {
        let t = self.lock()?.timings();
        Ok((
            t.prompt_tokens,
            t.generated_tokens,
            t.prefill.as_secs_f64(),
            t.decode.as_secs_f64(),
            t.cached_tokens,
            t.drafted_tokens,
            t.accepted_tokens,
            t.decode_passes,
        ))
    }
}

/// Converts a Hugging Face folder to a .colibri file (or re-encodes a
/// .colibri file into another weight type); returns a summary dict.
#[pyfunction]
#[pyo3(signature = (src, dst, *, dtype=None, force=false, progress=true, imatrix=None, keep_mtp=None))]
#[allow(clippy::too_many_arguments)] // keyword-only on the Python side
fn convert_checkpoint<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    dtype: Option<&str>,
    force: bool,
    progress: bool,
    imatrix: Option<PathBuf>,
    keep_mtp: Option<bool>,
) -> PyResult<Bound<'py, PyDict>> {
    let recipe = match dtype {
        None | Some("auto") => None,
        Some(s) => Some(Recipe::parse(s).map_err(to_py)?),
    };
    let opts = ConvertOptions { recipe, imatrix, force, progress, keep_mtp };
    let report = py.detach(|| convert(&src, &dst, &opts, &interrupted)).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("path", report.path)?;
    d.set_item("architecture", report.architecture)?;
    d.set_item("dtype", report.dtype.name())?;
    d.set_item("recipe", opts.recipe.filter(|r| !r.is_uniform()).map(|r| r.name))?;
    d.set_item("tensors", report.tensors)?;
    d.set_item("bytes", report.bytes)?;
    d.set_item("weighted", report.weighted)?;
    let int4 = match &report.int4 {
        None => None,
        Some(r) => {
            let i = PyDict::new(py);
            i.set_item("tensors", r.tensors)?;
            i.set_item("groups", r.groups)?;
            i.set_item("requantised", r.requantised)?;
            i.set_item("widened", r.widened.clone())?;
            Some(i)
        }
    };
    d.set_item("int4", int4)?;
    Ok(d)
}

/// The named conversion recipes: (name, spec, description).
#[pyfunction]
fn recipes() -> Vec<(&'static str, &'static str, &'static str)> {
    crate::convert::recipe::PRESETS.to_vec()
}

/// The recipe classes of weight matrices (`embed`, `attn`, ...), in the
/// order `colibri info` lists them.
#[pyfunction]
fn weight_classes() -> Vec<&'static str> {
    crate::canonical::tensors::TensorClass::ALL.iter().map(|c| c.name()).collect()
}

/// Weight types `convert` can write, by name.
#[pyfunction]
fn supported_dtypes() -> Vec<&'static str> {
    DType::ALL.iter().map(|d| d.name()).collect()
}

/// The kernel table in use (`COLIBRI_ISA` or the best this CPU runs) and
/// every table this CPU and build can run, best last.
#[pyfunction]
fn kernel_tables() -> (&'static str, Vec<&'static str>) {
    let available = crate::kernels::Table::available().iter().map(|t| t.isa().name()).collect();
    (crate::kernels::isa().name(), available)
}

/// Parses a size such as "4GB" or "512MiB" into bytes.
#[pyfunction]
fn parse_bytes(text: &str) -> PyResult<u64> {
    crate::model::store::parse_bytes(text).map_err(to_py)
}

/// What a RAM budget means for a model file, as JSON text.
#[pyfunction]
#[pyo3(signature = (path, ram_budget=None))]
fn plan_json(py: Python<'_>, path: PathBuf, ram_budget: Option<u64>) -> PyResult<String> {
    let plan = py.detach(|| crate::model::store::plan_path(&path, ram_budget)).map_err(to_py)?;
    Ok(serde_json::to_string(&plan).unwrap_or_default())
}

/// Architectures the converter accepts.
#[pyfunction]
fn supported_architectures() -> Vec<&'static str> {
    crate::arch::REGISTRY.iter().map(|a| a.hf_class).collect()
}

/// The bytes constrained decoding gives each of `vocab` token ids of a
/// tokenizer.json (special tokens after a 0xFF marker), for tests.
#[pyfunction]
fn token_bytes<'py>(py: Python<'py>, tokenizer_json: &str, vocab: usize) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let tok: serde_json::Value = serde_json::from_str(tokenizer_json)
        .map_err(|e| to_py(Error::InvalidInput(format!("tokenizer_json: not JSON: {e}"))))?;
    let words = crate::engine::guide::token_bytes(&tok, vocab).map_err(to_py)?;
    Ok(words.iter().map(|w| PyBytes::new(py, w)).collect())
}

#[pymodule]
fn _colibri(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeEngine>()?;
    m.add_class::<NativeGeneration>()?;
    m.add_class::<stage::NativeStage>()?;
    m.add_function(wrap_pyfunction!(stage::stage_plan, m)?)?;
    m.add_function(wrap_pyfunction!(stage::stage_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(stage::stage_file_info, m)?)?;
    m.add_function(wrap_pyfunction!(stage::split_model, m)?)?;
    m.add_function(wrap_pyfunction!(convert_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(supported_architectures, m)?)?;
    m.add_function(wrap_pyfunction!(supported_dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(recipes, m)?)?;
    m.add_function(wrap_pyfunction!(weight_classes, m)?)?;
    m.add_function(wrap_pyfunction!(parse_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_tables, m)?)?;
    m.add_function(wrap_pyfunction!(plan_json, m)?)?;
    m.add_function(wrap_pyfunction!(token_bytes, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
