//! The C ABI (`include/colibri.h`): open a `.colibri` file, run logits,
//! generate token ids (whole or through a callback), free.
//!
//! `cargo build --release` gives `target/release/libcolibri.so` (`colibri.dll`,
//! `libcolibri.dylib`) exporting the `colibri_*` symbols; the header is made
//! from this file by cbindgen (`cbindgen.toml`) and CI checks it is current. Every function returns a [`Status`] (0 = ok) that
//! mirrors the Python exception classes; the message of the last failure on
//! the calling thread is `colibri_last_error()`. No panic crosses the
//! boundary: each body runs under `catch_unwind`, and a panic (a bug) is
//! `COLIBRI_ERR_INTERNAL` with its message.
//!
//! Threads: a `colibri_model` may be used from several threads at once (each
//! call makes its own KV cache and shares the weights and the thread pool);
//! `colibri_free` must not race with a call on the same handle.
//!
//! This file is the third place `unsafe` lives (after the kernels and the
//! mmap): raw pointers from C are turned into slices and references here and
//! nowhere else, each after the null and length checks its `SAFETY` note names.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use crate::engine::{
    BatchOptions, Constraint, Drafts, Engine, EngineOptions, GenerateOptions, SamplingParams, Scheduler, Speculation,
    never,
};
use crate::error::Error;
use crate::model::store::{HeatFile, StoreOptions};

/// Status codes (`colibri_status` in the header), one per Python exception class.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// FormatError: the `.colibri` file is malformed, truncated or of an unknown version.
    Format = 1,
    /// UnsupportedModelError.
    Unsupported = 2,
    /// CheckpointError.
    Checkpoint = 3,
    /// InvalidInputError: a bad argument (null pointer, id out of range, option out of range).
    InvalidInput = 4,
    /// ContextLengthError: the sequence does not fit the context window.
    ContextLength = 5,
    /// OutputExistsError.
    OutputExists = 6,
    /// ModelNotFoundError: no such file.
    NotFound = 7,
    /// ColibriIOError: any other OS error, a failed expert read among them.
    Io = 8,
    /// The operation was interrupted.
    Interrupted = 9,
    /// BusyError.
    Busy = 10,
    /// A bug in colibri (a caught panic, or an engine invariant that did not
    /// hold); the message says where.
    Internal = 11,
}

impl Status {
    fn of(e: &Error) -> Status {
        match e {
            Error::Format { .. } => Status::Format,
            Error::Unsupported(_) => Status::Unsupported,
            Error::Checkpoint { .. } => Status::Checkpoint,
            Error::InvalidInput(_) => Status::InvalidInput,
            Error::ContextOverflow(_) => Status::ContextLength,
            Error::OutputExists(_) => Status::OutputExists,
            Error::NotFound(_) => Status::NotFound,
            Error::Io { .. } | Error::ExpertRead { .. } => Status::Io,
            Error::Interrupted => Status::Interrupted,
            Error::Busy(_) => Status::Busy,
            Error::Internal(_) => Status::Internal,
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).expect("no NUL left");
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs `f`, turning an error or a panic into a status and the thread's last error.
fn guard(f: impl FnOnce() -> Result<(), Error>) -> Status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => Status::Ok,
        Ok(Err(e)) => {
            set_error(&e.to_string());
            Status::of(&e)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_error(&format!("internal error (please report): {what}"));
            Status::Internal
        }
    }
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidInput(msg.into())
}

/// An opened model (opaque to C).
pub struct Model {
    engine: Engine,
    eos: Vec<u32>,
    /// The scheduler that runs speculative generations, made at the first.
    scheduler: std::sync::OnceLock<Scheduler>,
}

/// Options for [`colibri_init_model`]; `colibri_options_default` fills them.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// `sizeof(colibri_options)` as the caller was compiled with.
    pub struct_size: u32,
    /// Worker threads; 0 = physical cores.
    pub threads: u32,
    /// RAM for routed experts in bytes (streamed from the file beyond it); 0 = all resident.
    pub ram_budget: u64,
}

/// Sampling and stopping for the generate calls; `colibri_sampling_default`
/// fills them (greedy, 16 tokens, the model's end-of-sequence ids).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    /// `sizeof(colibri_sampling)` as the caller was compiled with.
    pub struct_size: u32,
    /// Most new tokens.
    pub max_new_tokens: u32,
    /// 0 = greedy; otherwise the softmax temperature.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: u32,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Drop tokens below min_p times the most likely; 0 = off.
    pub min_p: f32,
    /// transformers' repetition penalty; 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI's presence penalty; 0 = off.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty; 0 = off.
    pub frequency_penalty: f32,
    /// Seed of the random draw.
    pub seed: u64,
    /// Nonzero: do not stop on the model's end-of-sequence ids.
    pub ignore_eos: c_int,
    /// Extra ids to stop on (kept in the output); may be null when `n_stop_ids` is 0.
    pub stop_ids: *const u32,
    /// Length of `stop_ids`.
    pub n_stop_ids: usize,
    /// A JSON Schema (NUL-terminated JSON text) the output must be valid
    /// against; null = none. At most one of `json_schema`, `regex` and
    /// `grammar` may be set. Callers built against the header before these
    /// three fields pass a smaller `struct_size` and get none of them.
    pub json_schema: *const c_char,
    /// A regular expression (NUL-terminated) the whole output must match; null = none.
    pub regex: *const c_char,
    /// A grammar in llguidance's Lark syntax (NUL-terminated) the output must follow; null = none.
    pub grammar: *const c_char,
    /// Speculative decoding: 0 = off, 1 = n-gram drafts (prompt lookup),
    /// 2 = the model's multi-token-prediction layer (a file converted with
    /// `--keep-mtp`). The output is the same as without; only its speed
    /// changes. Callers built against a header before this field get 0.
    pub speculative: c_int,
    /// Most tokens drafted per step, 1 to 16.
    pub draft_tokens: u32,
}

/// Called with each new token; return nonzero to stop the generation.
pub type TokenCallback = Option<unsafe extern "C" fn(token: u32, user: *mut c_void) -> c_int>;

/// Fills `opts` with the defaults (physical cores, all resident).
///
/// # Safety
/// `opts` is null or points to a writable `colibri_options`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn colibri_options_default(opts: *mut Options) {
    // SAFETY: the caller passes null or a valid, writable pointer.
    if let Some(o) = unsafe { opts.as_mut() } {
        *o = Options { struct_size: std::mem::size_of::<Options>() as u32, threads: 0, ram_budget: 0 };
    }
}

/// Fills `s` with the defaults (greedy, 16 new tokens, stop on end of sequence).
///
/// # Safety
/// `s` is null or points to a writable `colibri_sampling`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn colibri_sampling_default(s: *mut Sampling) {
    // SAFETY: the caller passes null or a valid, writable pointer.
    if let Some(s) = unsafe { s.as_mut() } {
        *s = default_sampling();
    }
}

fn default_sampling() -> Sampling {
    let d = SamplingParams::default();
    Sampling {
        struct_size: std::mem::size_of::<Sampling>() as u32,
        max_new_tokens: 16,
        temperature: d.temperature,
        top_k: d.top_k as u32,
        top_p: d.top_p,
        min_p: d.min_p,
        repetition_penalty: d.repetition_penalty,
        presence_penalty: d.presence_penalty,
        frequency_penalty: d.frequency_penalty,
        seed: d.seed,
        ignore_eos: 0,
        stop_ids: std::ptr::null(),
        n_stop_ids: 0,
        json_schema: std::ptr::null(),
        regex: std::ptr::null(),
        grammar: std::ptr::null(),
        speculative: 0,
        draft_tokens: 4,
    }
}

/// Opens a `.colibri` file. `opts` may be null (the defaults). On success
/// `*out` is a handle to pass to the other calls and finally to `colibri_free`.
///
/// # Safety
/// `path` is null or a NUL-terminated string; `opts` is null or points to a
/// `colibri_options`; `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn colibri_init_model(path: *const c_char, opts: *const Options, out: *mut *mut Model) -> Status {
    guard(|| {
        if out.is_null() {
            return Err(invalid("colibri_init_model: out is NULL"));
        }
        // SAFETY: checked non-null above; the caller gives a writable pointer.
        unsafe { *out = std::ptr::null_mut() };
        if path.is_null() {
            return Err(invalid("colibri_init_model: path is NULL"));
        }
        // SAFETY: non-null and NUL-terminated per the contract.
        let path = unsafe { CStr::from_ptr(path) };
        let path = PathBuf::from(path.to_str().map_err(|_| invalid("colibri_init_model: path is not valid UTF-8"))?);
        // SAFETY: null or a valid pointer per the contract.
        let o = match unsafe { opts.as_ref() } {
            None => Options { struct_size: 0, threads: 0, ram_budget: 0 },
            Some(o) if (o.struct_size as usize) < std::mem::size_of::<Options>() => {
                return Err(invalid(format!(
                    "colibri_init_model: opts.struct_size is {}, expected {} (call colibri_options_default first)",
                    o.struct_size,
                    std::mem::size_of::<Options>()
                )));
            }
            Some(o) => *o,
        };
        let store = StoreOptions {
            ram_budget: (o.ram_budget > 0).then_some(o.ram_budget),
            heat_file: HeatFile::Beside,
            ..StoreOptions::default()
        };
        let eo = EngineOptions { threads: (o.threads > 0).then_some(o.threads as usize), store, ..Default::default() };
        let engine = Engine::open(&path, &eo)?;
        let eos = engine.eos_ids();
        let scheduler = std::sync::OnceLock::new();
        // SAFETY: checked non-null above.
        unsafe { *out = Box::into_raw(Box::new(Model { engine, eos, scheduler })) };
        Ok(())
    })
}

/// Closes a handle (null is a no-op). Routing heat is saved beside the file
/// when experts were streamed.
///
/// # Safety
/// `m` is null or a handle from `colibri_init_model` not yet freed, with no
/// other call on it running.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn colibri_free(m: *mut Model) {
    if !m.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: made by Box::into_raw in colibri_init_model and freed once, per the contract.
            drop(unsafe { Box::from_raw(m) })
        }));
    }
}

/// The message of the last failed call on this thread ("" if none). Valid
/// until the next failing call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn colibri_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The library's version, e.g. "0.1.0" (static).
#[unsafe(no_mangle)]
pub extern "C" fn colibri_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

/// # Safety
/// `m` is null or a live handle.
unsafe fn model<'a>(m: *const Model) -> Result<&'a Model, Error> {
    // SAFETY: null or a live handle per the caller's contract.
    unsafe { m.as_ref() }.ok_or_else(|| invalid("the model handle is NULL"))
}

/// Vocabulary size (the width of a logits row); 0 for a null handle.
///
/// # Safety
/// `m` is null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn colibri_vocab_size(m: *const Model) -> usize {
    // SAFETY: per the contract.
    unsafe { m.as_ref() }.map_or(0, |m| m.engine.model().config.vocab_size)
}

/// Context length in tokens; 0 for a null handle.
///
/// # Safety
/// `m` is null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn colibri_context_length(m: *const Model) -> usize {
    // SAFETY: per the contract.
    unsafe { m.as_ref() }.map_or(0, |m| m.engine.model().config.max_seq_len)
}

/// Copies up to `cap` of the model's end-of-sequence ids to `out` and
/// returns how many there are (call with `cap = 0` to ask).
///
/// # Safety
/// `m` is null or a live handle; `out` is null or has room for `cap` ids.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn colibri_eos_ids(m: *const Model, out: *mut u32, cap: usize) -> usize {
    // SAFETY: per the contract.
    let Some(m) = (unsafe { m.as_ref() }) else { return 0 };
    if !out.is_null() {
        let n = cap.min(m.eos.len());
        // SAFETY: out has room for cap >= n ids per the contract.
        unsafe { std::slice::from_raw_parts_mut(out, n) }.copy_from_slice(&m.eos[..n]);
    }
    m.eos.len()
}

/// # Safety
/// `ids` is valid for `n` reads when non-null.
unsafe fn ids<'a>(ids: *const u32, n: usize, what: &str) -> Result<&'a [u32], Error> {
    if n == 0 {
        return Err(invalid(format!("{what}: no token ids (n is 0)")));
    }
    if ids.is_null() {
        return Err(invalid(format!("{what}: ids is NULL")));
    }
    // SAFETY: non-null, and the caller guarantees n readable u32s.
    Ok(unsafe { std::slice::from_raw_parts(ids, n) })
}

/// Logits of every position of a fresh sequence: writes `n * vocab_size`
/// floats, row-major, to `logits_out`.
///
/// # Safety
/// `m` is a live handle; `ids` has `n` ids; `logits_out` has room for
/// `n * colibri_vocab_size(m)` floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn colibri_forward(m: *const Model, ids: *const u32, n: usize, logits_out: *mut f32) -> Status {
    guard(|| {
        // SAFETY: per the contract.
        let m = unsafe { model(m) }?;
        // SAFETY: per the contract.
        let ids = unsafe { self::ids(ids, n, "colibri_forward") }?;
        if logits_out.is_null() {
            return Err(invalid("colibri_forward: logits_out is NULL"));
        }
        let logits = m.engine.logits(ids, &never)?;
        // SAFETY: non-null, and the caller gives room for n * vocab floats, which is logits.len().
        unsafe { std::slice::from_raw_parts_mut(logits_out, logits.len()) }.copy_from_slice(&logits);
        Ok(())
    })
}

/// The generate options from C's, checked.
///
/// # Safety
/// `s` is null or points to a `colibri_sampling` (of at least its declared
/// `struct_size` bytes) whose `stop_ids` has `n_stop_ids` ids and whose
/// constraint fields are null or NUL-terminated.
unsafe fn options(m: &Model, s: *const Sampling) -> Result<GenerateOptions, Error> {
    let mut d = default_sampling();
    if !s.is_null() {
        // The struct as the caller was compiled: every field up to the
        // constraints (which came later) at least.
        let oldest = std::mem::offset_of!(Sampling, json_schema);
        // SAFETY: non-null and pointing to a colibri_sampling per the contract,
        // whose first field is its size; read through the raw pointer, since
        // a caller of an older header has a shorter struct.
        let size = unsafe { std::ptr::addr_of!((*s).struct_size).read() } as usize;
        if size < oldest {
            return Err(invalid(format!(
                "sampling.struct_size is {size}, expected {} (call colibri_sampling_default first)",
                std::mem::size_of::<Sampling>()
            )));
        }
        let n = size.min(std::mem::size_of::<Sampling>());
        // SAFETY: the caller's struct has `size >= n` readable bytes; `d` is a
        // Sampling of size_of::<Sampling>() >= n bytes, every bit pattern of
        // its prefix fields is a valid value (numbers and raw pointers), and
        // the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(s.cast::<u8>(), (&raw mut d).cast::<u8>(), n) };
    }
    let sampling = SamplingParams {
        temperature: d.temperature,
        top_k: d.top_k as usize,
        top_p: d.top_p,
        min_p: d.min_p,
        repetition_penalty: d.repetition_penalty,
        presence_penalty: d.presence_penalty,
        frequency_penalty: d.frequency_penalty,
        seed: d.seed,
    };
    let mut stop_ids = if d.ignore_eos != 0 { Vec::new() } else { m.eos.clone() };
    if d.n_stop_ids > 0 {
        if d.stop_ids.is_null() {
            return Err(invalid(format!("sampling.stop_ids is NULL but n_stop_ids is {}", d.n_stop_ids)));
        }
        // SAFETY: non-null with n_stop_ids readable ids per the contract.
        stop_ids.extend_from_slice(unsafe { std::slice::from_raw_parts(d.stop_ids, d.n_stop_ids) });
    }
    let mut constraint = None;
    for (p, what) in [(d.json_schema, "json_schema"), (d.regex, "regex"), (d.grammar, "grammar")] {
        if p.is_null() {
            continue;
        }
        if constraint.is_some() {
            return Err(invalid("sampling: at most one of json_schema, regex and grammar may be set"));
        }
        // SAFETY: non-null and NUL-terminated per the field's contract.
        let text = unsafe { CStr::from_ptr(p) }
            .to_str()
            .map_err(|_| invalid(format!("sampling.{what} is not valid UTF-8")))?
            .to_string();
        constraint = Some(match what {
            "json_schema" => Constraint::JsonSchema(text),
            "regex" => Constraint::Regex(text),
            _ => Constraint::Grammar(text),
        });
    }
    let speculation = match d.speculative {
        0 => None,
        1 => Some(Drafts::Ngram),
        2 => Some(Drafts::Mtp),
        other => return Err(invalid(format!("sampling.speculative must be 0, 1 (ngram) or 2 (mtp), got {other}"))),
    }
    .map(|drafts| Speculation { drafts, tokens: d.draft_tokens as usize });
    Ok(GenerateOptions {
        max_new_tokens: d.max_new_tokens as usize,
        sampling,
        stop_ids,
        logprobs: None,
        constraint,
        speculation,
        prediction: Vec::new(),
    })
}

/// Runs a generation, handing each new id to `on_token` (which returns
/// false to stop): in the calling thread, or through the model's scheduler
/// when it drafts (verification lives there).
fn run(m: &Model, prompt: &[u32], opts: &GenerateOptions, on_token: &mut dyn FnMut(u32) -> bool) -> Result<(), Error> {
    if opts.speculation.is_none() {
        m.engine.generate(prompt, opts, &never, on_token)?;
        return Ok(());
    }
    let scheduler = match m.scheduler.get() {
        Some(s) => s,
        None => {
            let made = Scheduler::new(&m.engine, BatchOptions::default())?;
            m.scheduler.get_or_init(|| made)
        }
    };
    let mut ticket = scheduler.submit(prompt, opts)?;
    while let Some(t) = ticket.next_token(&never)? {
        if !on_token(t) {
            break; // dropping the ticket cancels the rest
        }
    }
    Ok(())
}

/// Continues `prompt` (`n` ids): writes the new ids to `out` (room for
/// `cap`, which must be at least `sampling.max_new_tokens`) and their count
/// to `*n_out`. `sampling` may be null (the defaults). Stops on an
/// end-of-sequence or stop id (kept in the output), after `max_new_tokens`,
/// when the context is full, or when the output's constraint
/// (`sampling.json_schema`, `regex` or `grammar`) is complete. A constraint
/// that cannot be compiled, or that matches no text, is
/// `COLIBRI_ERR_INVALID_INPUT` with the library's message.
///
/// # Safety
/// `m` is a live handle; `prompt` has `n` ids; `sampling` is null or valid;
/// `out` has room for `cap` ids; `n_out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn colibri_generate(
    m: *const Model,
    prompt: *const u32,
    n: usize,
    sampling: *const Sampling,
    out: *mut u32,
    cap: usize,
    n_out: *mut usize,
) -> Status {
    guard(|| {
        if n_out.is_null() || out.is_null() {
            return Err(invalid("colibri_generate: out or n_out is NULL"));
        }
        // SAFETY: checked non-null.
        unsafe { *n_out = 0 };
        // SAFETY: per the contract.
        let m = unsafe { model(m) }?;
        // SAFETY: per the contract.
        let prompt = unsafe { ids(prompt, n, "colibri_generate") }?;
        // SAFETY: per the contract.
        let opts = unsafe { options(m, sampling) }?;
        if cap < opts.max_new_tokens {
            return Err(invalid(format!(
                "colibri_generate: out has room for {cap} ids, fewer than max_new_tokens = {}",
                opts.max_new_tokens
            )));
        }
        let mut tokens = Vec::with_capacity(opts.max_new_tokens);
        run(m, prompt, &opts, &mut |t| {
            tokens.push(t);
            true
        })?;
        // SAFETY: non-null with room for cap >= max_new_tokens >= tokens.len() ids.
        unsafe { std::slice::from_raw_parts_mut(out, tokens.len()) }.copy_from_slice(&tokens);
        // SAFETY: checked non-null.
        unsafe { *n_out = tokens.len() };
        Ok(())
    })
}

/// As `colibri_generate`, but hands each new id to `callback(id, user)` as it
/// is made, and stops early when the callback returns nonzero. `*n_out`
/// (if `n_out` is not null) is the number of ids handed over.
///
/// # Safety
/// As `colibri_generate`; `callback` is a valid function that may be called
/// from this thread with `user`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn colibri_generate_stream(
    m: *const Model,
    prompt: *const u32,
    n: usize,
    sampling: *const Sampling,
    callback: TokenCallback,
    user: *mut c_void,
    n_out: *mut usize,
) -> Status {
    guard(|| {
        // SAFETY: null or writable per the contract.
        if let Some(k) = unsafe { n_out.as_mut() } {
            *k = 0;
        }
        // SAFETY: per the contract.
        let m = unsafe { model(m) }?;
        // SAFETY: per the contract.
        let prompt = unsafe { ids(prompt, n, "colibri_generate_stream") }?;
        // SAFETY: per the contract.
        let opts = unsafe { options(m, sampling) }?;
        let cb = callback.ok_or_else(|| invalid("colibri_generate_stream: callback is NULL"))?;
        let mut count = 0usize;
        run(m, prompt, &opts, &mut |t| {
            count += 1;
            // SAFETY: a valid callback per the contract, called on this thread.
            unsafe { cb(t, user) == 0 }
        })?;
        // SAFETY: null or writable per the contract.
        if let Some(k) = unsafe { n_out.as_mut() } {
            *k = count;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_codes_and_messages_not_crashes() {
        let mut m: *mut Model = std::ptr::dangling_mut();
        // SAFETY: valid arguments for the contract (a null path is what is tested).
        let st = unsafe { colibri_init_model(std::ptr::null(), std::ptr::null(), &mut m) };
        assert_eq!(st, Status::InvalidInput);
        assert!(m.is_null());
        // SAFETY: the pointer is this thread's last error, NUL-terminated.
        let msg = unsafe { CStr::from_ptr(colibri_last_error()) }.to_str().unwrap().to_string();
        assert!(msg.contains("path is NULL"), "{msg}");

        let missing = CString::new("/nonexistent/model.colibri").unwrap();
        // SAFETY: as above.
        let st = unsafe { colibri_init_model(missing.as_ptr(), std::ptr::null(), &mut m) };
        assert_eq!(st, Status::NotFound);
        // SAFETY: as above.
        let msg = unsafe { CStr::from_ptr(colibri_last_error()) }.to_str().unwrap().to_string();
        assert!(msg.contains("/nonexistent/model.colibri"), "{msg}");

        // SAFETY: a null handle is refused before any dereference.
        let st = unsafe { colibri_forward(std::ptr::null(), [1u32].as_ptr(), 1, std::ptr::null_mut()) };
        assert_eq!(st, Status::InvalidInput);
        // SAFETY: null is a no-op.
        unsafe { colibri_free(std::ptr::null_mut()) };
    }

    #[test]
    fn a_panic_is_an_internal_error() {
        let st = guard(|| panic!("boom at the boundary"));
        assert_eq!(st, Status::Internal);
        // SAFETY: this thread's last error.
        let msg = unsafe { CStr::from_ptr(colibri_last_error()) }.to_str().unwrap().to_string();
        assert!(msg.contains("boom at the boundary"), "{msg}");
    }
}
