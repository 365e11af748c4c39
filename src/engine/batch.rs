//! Continuous batching: one thread advances every running generation
//! together, a step at a time.
//!
//! Each step is one [`forward_batch`] over the next token of every decoding
//! sequence plus chunks of waiting prompts (decoders first, prompts filling
//! the rest of the step's token budget in arrival order), so the dense
//! weights are read once per step for all of them and each routed expert
//! once for all the tokens routed to it. Every sequence keeps its own KV
//! cache and decoder (the decode step of `engine/step.rs`, which the
//! single [`Generation`](super::Generation) uses too); requests join between
//! steps and leave the moment they finish or are cancelled (a dropped
//! [`Ticket`] cancels). The kernels give a row the same bits whatever rows
//! run beside it, so a sequence's tokens do not depend on what else is
//! running.
//!
//! ```text
//! submit ─► waiting (FIFO, at most max_queue) ─► running (at most max_batch)
//!                                                   │ step: decoders' last tokens + prompt chunks
//!                                                   ▼
//!                              decode step of each finished row ─► Ticket's channel
//! ```

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Engine;
use super::draft::Drafts;
use super::prefix::{BLOCK, PrefixCache, PrefixStats};
use super::step::{Decoder, FinishReason, GenerateOptions, Timings, TokenLogprobs};
use crate::canonical::state::StateLayout;
use crate::error::{Error, Result};
use crate::model::forward::{Segment, forward_batch, mtp_draft};
use crate::model::session::{DEFAULT_CHUNK, Sequence, Workspace};

/// How a scheduler batches.
#[derive(Clone, Copy, Debug)]
pub struct BatchOptions {
    /// Most sequences running at once (each step computes at most this many
    /// sequences' logits).
    pub max_batch: usize,
    /// Most tokens in one step (decoding tokens plus prompt chunks).
    pub step_tokens: usize,
    /// Most requests waiting for a place; a submission beyond it is refused
    /// with [`Error::Busy`]. `0` = unbounded.
    pub max_queue: usize,
    /// Most bytes of sequence state (KV caches and recurrent states) the
    /// running sequences may hold together, each counted at its full length
    /// (prompt plus `max_new_tokens`, within the context): a request that
    /// would pass it waits for running ones to finish, and one that alone
    /// needs more is refused. `0` = unbounded.
    pub max_state_bytes: usize,
    /// Most bytes the prefix cache holds (see [`super::prefix`]); `0` = no
    /// prefix cache.
    pub prefix_cache_bytes: usize,
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            max_batch: 16,
            step_tokens: DEFAULT_CHUNK,
            max_queue: 0,
            max_state_bytes: 0,
            prefix_cache_bytes: 0,
        }
    }
}

/// Upper bounds of the step-size histogram's buckets (tokens per step); a
/// last bucket counts the larger steps.
pub const STEP_BUCKETS: [usize; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

/// Counters of a scheduler since it started; read with [`Scheduler::stats`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BatchStats {
    /// Requests waiting for a place.
    pub waiting: usize,
    /// Requests running (prefilling or decoding).
    pub running: usize,
    /// Steps run.
    pub steps: u64,
    /// Prompt tokens processed.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Sequences in the last step.
    pub last_batch: usize,
    /// Steps by tokens per step, bucketed by [`STEP_BUCKETS`] (one more
    /// bucket at the end for larger steps).
    pub step_tokens: Vec<u64>,
    /// Steps by decoding sequences per step (index = count, the last slot
    /// for `max_batch` and more).
    pub step_sequences: Vec<u64>,
    /// Requests finished, cancelled or failed.
    pub finished: u64,
    /// Seconds spent in steps.
    pub busy_seconds: f64,
    /// Positions held in the KV caches of the running requests.
    pub kv_tokens: usize,
    /// The prefix cache's counters (`None` without one).
    pub prefix: Option<PrefixStats>,
    /// Tokens drafted for speculative decoding.
    pub drafted_tokens: u64,
    /// Of them, tokens the model's own choice confirmed.
    pub accepted_tokens: u64,
}

/// What a running request sends its ticket.
enum Event {
    Token(u32, Option<TokenLogprobs>, Timings, Option<FinishReason>),
    Failed(Error),
}

struct Request {
    prompt: Vec<u32>,
    decoder: Decoder,
    tx: Sender<Event>,
    cancel: Arc<AtomicBool>,
    /// The state bytes it holds at its longest, counted against
    /// [`BatchOptions::max_state_bytes`].
    state_bytes: usize,
}

/// A speculating request's drafts and buffers (allocated once).
struct Spec {
    /// Where its drafts come from.
    from: Drafts,
    /// Most tokens drafted per step.
    tokens: usize,
    /// The expected output, the prompt and the output so far: where n-gram
    /// drafts are looked up.
    text: Vec<u32>,
    /// This step's drafts.
    drafts: Vec<u32>,
    /// This step's tokens: the last chosen one and the drafts.
    feed: Vec<u32>,
    /// Confirmed tokens a linear-attention rollback dropped, fed again next.
    refeed: Vec<u32>,
    /// Passes in a row whose drafts all failed, and steps left before the
    /// next draft: a text that does not repeat itself stops paying for
    /// rows that are thrown away.
    misses: u32,
    pause: usize,
    /// Tokens to draft next: one more than the last pass confirmed, up to
    /// `tokens`, so rows that would be thrown away are not computed.
    next: usize,
    /// Time per emitted token of its steps with drafts and without.
    pays: Payoff,
    /// Steps in a row it could not draft in because too many sequences decode.
    crowded: u32,
}

/// Whether MTP drafting pays for one sequence, measured: the time per
/// emitted token of its decode steps with drafts (and the confirmed tokens
/// a rollback feeds again) and of a few without. The MTP layer costs a
/// layer per token fed and a layer and the output head per draft; on a
/// model as small as the demo, whose weights sit in the CPU caches, that is
/// more than the 87% of drafts that hold save (0.65-0.78x measured without
/// this rule). N-gram drafts cost nothing while paused, and their back-off
/// after failed drafts is enough (this rule cut their 1.5-1.8x on an edit
/// to 1.25x, judging on the early steps before the text repeats).
#[derive(Clone, Copy, Default)]
struct Payoff {
    drafted: Spent,
    plain: Spent,
}

/// Decode steps with drafts and without that [`Payoff`] needs to judge.
const PAYOFF_DRAFTED: u32 = 8;
const PAYOFF_PLAIN: u32 = 4;

/// Seconds and tokens of some decode steps.
#[derive(Clone, Copy, Default)]
struct Spent {
    secs: f64,
    tokens: usize,
    steps: u32,
}

impl Payoff {
    /// Counts a decode step that took `secs` and emitted `tokens`.
    fn record(&mut self, drafted: bool, secs: f64, tokens: usize) {
        let s = if drafted { &mut self.drafted } else { &mut self.plain };
        s.secs += secs;
        s.tokens += tokens;
        s.steps += 1;
    }

    /// `None` while measuring; then steps to go without drafts to measure
    /// those (once), or whether drafting costs more per token than it
    /// saves. A verdict that it pays starts the drafted figures again, so
    /// it is judged afresh.
    fn verdict(&mut self) -> Verdict {
        if self.drafted.steps < PAYOFF_DRAFTED {
            return Verdict::Measuring;
        }
        if self.plain.steps < PAYOFF_PLAIN {
            return Verdict::MeasurePlain((PAYOFF_PLAIN - self.plain.steps) as usize);
        }
        let per = |s: Spent| s.secs / s.tokens.max(1) as f64;
        if per(self.drafted) > per(self.plain) {
            return Verdict::Loses;
        }
        self.drafted = Spent::default();
        Verdict::Measuring
    }
}

/// What [`Payoff::verdict`] found.
enum Verdict {
    Measuring,
    MeasurePlain(usize),
    Loses,
}

/// Most steps a sequence whose drafts keep failing waits before drafting
/// again (the wait doubles with each failed pass: 2, 4, ... this).
const MAX_DRAFT_PAUSE: usize = 32;

/// A request with its place: its sequence, how much of the prompt is in.
struct Running {
    req: Request,
    seq: Sequence,
    fed: usize,
    /// Whether some layer keeps a recurrent state, which the prefix cache
    /// saves at block ends only.
    recurrent: bool,
    /// The recurrent states at position `saved_at`, for the prefix cache.
    saved: Vec<f32>,
    saved_at: Option<usize>,
    /// Blocks of it already offered to the prefix cache.
    offered: usize,
    /// Speculative decoding's state, when asked for.
    spec: Option<Box<Spec>>,
    /// The model's LongRoPE threshold: no draft pass crosses it.
    long_after: Option<usize>,
    /// Where the time of its next token runs from: the start of its first
    /// step, then the moment its last token was chosen.
    since: Option<Instant>,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Request>,
    shutdown: bool,
}

struct Counters {
    running: AtomicUsize,
    steps: AtomicU64,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    last_batch: AtomicUsize,
    step_tokens: Vec<AtomicU64>,
    step_sequences: Vec<AtomicU64>,
    finished: AtomicU64,
    busy_nanos: AtomicU64,
    kv_tokens: AtomicUsize,
    drafted_tokens: AtomicU64,
    accepted_tokens: AtomicU64,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    counters: Counters,
    /// The prefix cache's counters as of its last change.
    prefix: Mutex<Option<PrefixStats>>,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        // A panic elsewhere cannot leave the queue half-updated: every
        // critical section is a push, a pop or a flag.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Runs generations side by side on one engine. Dropping it stops its
/// thread; requests still running then fail with an error saying so.
pub struct Scheduler {
    engine: Engine,
    opts: BatchOptions,
    /// Its sequences' state layout (sliding windows sized for its steps).
    layout: StateLayout,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler").field("opts", &self.opts).finish_non_exhaustive()
    }
}

impl Scheduler {
    /// Starts the scheduling thread of `engine` (idle until a submission).
    pub fn new(engine: &Engine, opts: BatchOptions) -> Result<Scheduler> {
        if opts.max_batch == 0 || opts.step_tokens == 0 {
            return Err(Error::InvalidInput(format!(
                "max_batch and step_tokens must be at least 1, got {} and {}",
                opts.max_batch, opts.step_tokens
            )));
        }
        let opts = BatchOptions { step_tokens: opts.step_tokens.max(opts.max_batch), ..opts };
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            counters: Counters {
                running: AtomicUsize::new(0),
                steps: AtomicU64::new(0),
                prompt_tokens: AtomicU64::new(0),
                generated_tokens: AtomicU64::new(0),
                last_batch: AtomicUsize::new(0),
                step_tokens: (0..=STEP_BUCKETS.len()).map(|_| AtomicU64::new(0)).collect(),
                step_sequences: (0..=opts.max_batch).map(|_| AtomicU64::new(0)).collect(),
                finished: AtomicU64::new(0),
                busy_nanos: AtomicU64::new(0),
                kv_tokens: AtomicUsize::new(0),
                drafted_tokens: AtomicU64::new(0),
                accepted_tokens: AtomicU64::new(0),
            },
            prefix: Mutex::new(
                (opts.prefix_cache_bytes > 0).then(|| PrefixCache::new(opts.prefix_cache_bytes, None).stats()),
            ),
        });
        let (e, sh) = (engine.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("colibri-scheduler".into())
            .spawn(move || run(e, opts, sh))
            .map_err(|err| Error::InvalidInput(format!("cannot start the scheduler thread: {err}")))?;
        let elem = engine.kv_dtype().row_bytes(1).expect("an element type");
        let layout = StateLayout::new(&engine.model().config, elem, opts.step_tokens);
        Ok(Scheduler { engine: engine.clone(), opts, layout, shared, thread: Mutex::new(Some(thread)) })
    }

    /// The options in force (`step_tokens` raised to `max_batch` if below).
    pub fn options(&self) -> BatchOptions {
        self.opts
    }

    /// Queues a generation continuing `prompt`. The prompt and options are
    /// checked here, so a bad request is an error at once; the work starts
    /// when a place is free. A full queue is [`Error::Busy`].
    pub fn submit(&self, prompt: &[u32], opts: &GenerateOptions) -> Result<Ticket> {
        let decoder = Decoder::new(&self.engine, prompt, opts)?;
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let ticket = Ticket {
            rx,
            cancel: cancel.clone(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish: decoder.finish(),
            broken: false,
            timings: decoder.timings(),
        };
        if ticket.finish.is_some() {
            return Ok(ticket);
        }
        // At its longest, capped at the model's context.
        let longest = prompt.len().saturating_add(decoder.max_new_tokens());
        let need = self.layout.bytes_for(longest.min(self.engine.model().config.max_seq_len));
        if self.opts.max_state_bytes > 0 && need > self.opts.max_state_bytes {
            return Err(Error::ContextOverflow(format!(
                "this generation needs {need} bytes of sequence state (prompt of {} tokens plus up to {} new), \
                 more than the scheduler's whole budget of {} bytes",
                prompt.len(),
                decoder.max_new_tokens(),
                self.opts.max_state_bytes
            )));
        }
        let req = Request { prompt: prompt.to_vec(), decoder, tx, cancel, state_bytes: need };
        let mut q = self.shared.queue();
        if q.shutdown {
            return Err(Error::InvalidInput("the engine is closed".into()));
        }
        q.waiting.retain(|r| !r.cancel.load(Ordering::Relaxed));
        if self.opts.max_queue > 0 && q.waiting.len() >= self.opts.max_queue {
            return Err(Error::Busy(format!(
                "the queue is full: {} requests are waiting (max_queue {})",
                q.waiting.len(),
                self.opts.max_queue
            )));
        }
        q.waiting.push_back(req);
        drop(q);
        self.shared.wake.notify_one();
        Ok(ticket)
    }

    /// Counters since the scheduler started.
    pub fn stats(&self) -> BatchStats {
        let c = &self.shared.counters;
        let load = |v: &[AtomicU64]| v.iter().map(|a| a.load(Ordering::Relaxed)).collect();
        BatchStats {
            waiting: self.shared.queue().waiting.len(),
            running: c.running.load(Ordering::Relaxed),
            steps: c.steps.load(Ordering::Relaxed),
            prompt_tokens: c.prompt_tokens.load(Ordering::Relaxed),
            generated_tokens: c.generated_tokens.load(Ordering::Relaxed),
            last_batch: c.last_batch.load(Ordering::Relaxed),
            step_tokens: load(&c.step_tokens),
            step_sequences: load(&c.step_sequences),
            finished: c.finished.load(Ordering::Relaxed),
            busy_seconds: c.busy_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            kv_tokens: c.kv_tokens.load(Ordering::Relaxed),
            prefix: self.shared.prefix.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            drafted_tokens: c.drafted_tokens.load(Ordering::Relaxed),
            accepted_tokens: c.accepted_tokens.load(Ordering::Relaxed),
        }
    }
}

impl Scheduler {
    /// Stops the scheduling thread and waits for it: waiting and running
    /// generations end with an error saying the engine was closed, and later
    /// submissions are refused. Calling it again does nothing; dropping the
    /// scheduler closes it.
    pub fn close(&self) {
        self.shared.queue().shutdown = true;
        self.shared.wake.notify_all();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.close();
    }
}

/// A submitted generation: its tokens arrive as the scheduler makes them.
/// Dropping it (or [`Ticket::cancel`]) frees its place at the next step.
pub struct Ticket {
    rx: Receiver<Event>,
    cancel: Arc<AtomicBool>,
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
    finish: Option<FinishReason>,
    broken: bool,
    timings: Timings,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket").field("tokens", &self.tokens).field("finish", &self.finish).finish_non_exhaustive()
    }
}

/// Cancels one ticket's generation; see [`Ticket::canceller`].
#[derive(Clone, Debug)]
pub struct Canceller(Arc<AtomicBool>);

impl Canceller {
    /// Stops the generation; a thread waiting for its next token gets `None`.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// How often a waiting ticket polls `interrupted`.
const POLL: Duration = Duration::from_millis(20);

impl Ticket {
    /// The next new token, waiting for it; `None` once the generation has
    /// finished. `interrupted` is polled while waiting: when it says so the
    /// request is cancelled and this fails with [`Error::Interrupted`].
    pub fn next_token(&mut self, interrupted: &dyn Fn() -> bool) -> Result<Option<u32>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        if self.broken {
            return Err(Error::InvalidInput("this generation was interrupted or failed and cannot go on".into()));
        }
        loop {
            match self.rx.recv_timeout(POLL) {
                Ok(Event::Token(t, lp, timings, finish)) => {
                    self.tokens.push(t);
                    self.logprobs.extend(lp);
                    self.timings = timings;
                    self.finish = finish;
                    return Ok(Some(t));
                }
                Ok(Event::Failed(e)) => {
                    self.broken = true;
                    return Err(e);
                }
                Err(_) if self.cancel.load(Ordering::Relaxed) => {
                    // Cancelled (from another thread, say), perhaps while still
                    // in the queue behind a full batch: it ends here.
                    return Ok(None);
                }
                Err(RecvTimeoutError::Timeout) => {
                    if interrupted() {
                        self.cancel();
                        self.broken = true;
                        return Err(Error::Interrupted);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.broken = true;
                    return Err(Error::InvalidInput(
                        "the engine's scheduler stopped before this generation ended".into(),
                    ));
                }
            }
        }
    }

    /// Stops the generation; its place is freed at the next step.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// A handle that cancels this generation from anywhere (another thread
    /// included, while this one waits for a token).
    pub fn canceller(&self) -> Canceller {
        Canceller(self.cancel.clone())
    }

    /// Why the generation ended; `None` while it can go on.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// The tokens received so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Their log-probabilities, when the request asked for them
    /// ([`GenerateOptions::logprobs`]; empty otherwise).
    pub fn logprobs(&self) -> &[TokenLogprobs] {
        &self.logprobs
    }

    /// Counts and times as of the last token received.
    pub fn timings(&self) -> Timings {
        self.timings
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.cancel();
    }
}

impl Running {
    /// Its prompt is in and it has tokens of its own: it feeds one a step.
    fn decoding(&self) -> bool {
        !self.req.decoder.tokens().is_empty()
    }

    /// After a pass: saves the recurrent states where the prefix cache
    /// keeps them, and offers the cache the blocks completed since the last
    /// offer (while a sliding window still holds their rows).
    fn offer(&mut self, cache: &mut PrefixCache, prefilling: bool) {
        let pos = self.seq.pos;
        let last_block_end = self.req.prompt.len().saturating_sub(1) / BLOCK * BLOCK;
        // At the prompt's last block end (a prefill chunk ends there), kept
        // at once; at each block end of the generation, kept when it ends.
        let prompt_state = prefilling && pos == last_block_end;
        if self.recurrent && pos > 0 && (prompt_state || (!prefilling && pos.is_multiple_of(BLOCK))) {
            self.seq.copy_recurrent(&mut self.saved);
            self.saved_at = Some(pos);
        }
        if pos / BLOCK > self.offered {
            let state = self.saved_at.filter(|_| prompt_state).map(|p| (p, &self.saved[..]));
            cache.insert(&self.req.prompt, self.req.decoder.tokens(), &self.seq, state);
            self.offered = pos / BLOCK;
        }
    }

    /// Puts what this sequence computed into the prefix cache as it ends:
    /// the rest of its blocks and its last saved recurrent states.
    fn keep_state(&self, cache: &mut PrefixCache) {
        let state = self.saved_at.map(|p| (p, &self.saved[..]));
        cache.insert(&self.req.prompt, self.req.decoder.tokens(), &self.seq, state);
    }
}

/// Makes the prefix cache's counters readable from other threads.
fn publish(shared: &Shared, cache: Option<&PrefixCache>) {
    if let Some(pc) = cache {
        *shared.prefix.lock().unwrap_or_else(|p| p.into_inner()) = Some(pc.stats());
    }
}

/// The scheduling thread: admit, step, deliver, until shut down.
fn run(engine: Engine, opts: BatchOptions, shared: Arc<Shared>) {
    let model = engine.model();
    let mut ws = Workspace::new(model, opts.step_tokens, opts.max_batch + DRAFT_ROWS);
    let mut running: Vec<Running> = Vec::new();
    let c = &shared.counters;
    let long_after = model.config.long_rope_after();
    let mut cache = (opts.prefix_cache_bytes > 0).then(|| PrefixCache::new(opts.prefix_cache_bytes, long_after));
    loop {
        {
            let mut q = shared.queue();
            while q.waiting.is_empty() && running.is_empty() && !q.shutdown {
                q = shared.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if q.shutdown {
                let stopped = Error::InvalidInput("the engine was closed while this generation ran".into());
                for r in q.waiting.drain(..).chain(running.drain(..).map(|r| r.req)) {
                    let _ = r.tx.send(Event::Failed(stopped.clone()));
                }
                return;
            }
            // Requests cancelled while they waited leave the queue now, not
            // when a place frees for them.
            q.waiting.retain(|r| !r.cancel.load(Ordering::Relaxed));
            let mut held: usize = running.iter().map(|r| r.req.state_bytes).sum();
            while running.len() < opts.max_batch {
                let Some(req) = q.waiting.front() else { break };
                let need = req.state_bytes;
                if opts.max_state_bytes > 0 && !running.is_empty() && held + need > opts.max_state_bytes {
                    break; // first come, first served: it waits for memory to free
                }
                let mut req = q.waiting.pop_front().expect("peeked");
                let max_seq = req.prompt.len().saturating_add(req.decoder.max_new_tokens());
                let mut seq = Sequence::new(model, max_seq, opts.step_tokens, engine.kv_dtype());
                let mtp = req.decoder.speculation().is_some_and(|s| s.drafts == Drafts::Mtp);
                if mtp {
                    // Checked when the request was made: the model has the layer.
                    seq.enable_mtp(model).expect("a model with a multi-token-prediction layer");
                }
                // A resumed prefix would leave the multi-token-prediction
                // layer without the rows of its positions: such a sequence
                // computes its whole prompt (its blocks are still offered).
                let fed = match cache.as_mut() {
                    Some(pc) if !mtp => pc.lookup(&req.prompt, &mut seq).tokens,
                    _ => 0,
                };
                req.decoder.set_cached(fed);
                held += need;
                let recurrent = seq.is_recurrent();
                let offered = fed / BLOCK;
                let spec = req.decoder.speculation().map(|s| {
                    seq.allow_logit_rows(1 + s.tokens);
                    let cap = s.tokens + 1;
                    Box::new(Spec {
                        from: s.drafts,
                        tokens: s.tokens,
                        // The expected output first: the prompt and the
                        // output, later in the text, are matched first.
                        text: [req.decoder.take_prediction(), req.prompt.clone()].concat(),
                        drafts: Vec::with_capacity(cap),
                        feed: Vec::with_capacity(2 * cap),
                        refeed: Vec::with_capacity(cap),
                        misses: 0,
                        pause: 0,
                        next: s.tokens,
                        pays: Payoff::default(),
                        crowded: 0,
                    })
                });
                let saved = Vec::new();
                running.push(Running {
                    req,
                    seq,
                    fed,
                    recurrent,
                    saved,
                    saved_at: None,
                    offered,
                    spec,
                    long_after,
                    since: None,
                });
            }
        }
        let before = running.len();
        running.retain(|r| {
            let cancelled = r.req.cancel.load(Ordering::Relaxed);
            if cancelled && let Some(pc) = cache.as_mut() {
                r.keep_state(pc); // what it computed stays useful
            }
            !cancelled
        });
        publish(&shared, cache.as_ref());
        c.finished.fetch_add((before - running.len()) as u64, Ordering::Relaxed);
        c.running.store(running.len(), Ordering::Relaxed);
        if running.is_empty() {
            c.kv_tokens.store(0, Ordering::Relaxed);
            continue;
        }
        step(&engine, &mut ws, &mut running, opts, c, cache.as_mut());
        publish(&shared, cache.as_ref());
        c.running.store(running.len(), Ordering::Relaxed);
        c.kv_tokens.store(running.iter().map(|r| r.seq.pos).sum(), Ordering::Relaxed);
    }
}

/// Extra logit rows a step may spend verifying drafted tokens, shared by
/// the speculating sequences in arrival order (each decoder and finishing
/// prompt has its own row besides).
pub const DRAFT_ROWS: usize = 16;

/// Most sequences decoding at once for drafts to be made. A drafted token's
/// row costs nearly a token's whole pass on a fine-grained MoE (it is routed
/// to experts of its own: a pass of 5 tokens takes 2.6x one of 1 at
/// Qwen3-30B-A3B's widths), and a batch already fills its pass with other
/// sequences' tokens. On the demo model drafting gained 4-9% at 2 sequences
/// and ranged from -9% to +5% at 4 and -22% to -1% at 8 (medians of 5, on a
/// busy machine).
pub const DRAFT_MAX_DECODERS: usize = 2;

/// What a step feeds one request.
#[derive(Clone, Copy, Default)]
struct Planned {
    /// Tokens fed.
    tokens: usize,
    /// Of them, the last ones whose logits are computed.
    rows: usize,
    /// Of them, drafted tokens to verify.
    drafted: usize,
    /// The sequence's position before the pass.
    pos: usize,
}

/// One step over every running request; delivers the new tokens and drops
/// the requests that finished, failed or whose ticket is gone.
fn step(
    engine: &Engine,
    ws: &mut Workspace,
    running: &mut Vec<Running>,
    opts: BatchOptions,
    c: &Counters,
    mut cache: Option<&mut PrefixCache>,
) {
    let t0 = Instant::now();
    // Decoders first (one token each, and their drafts), then prompt chunks
    // in arrival order.
    let decoding = running.iter().filter(|r| r.decoding()).count();
    let mut budget = opts.step_tokens - decoding;
    let mut rows = ws.logit_rows.saturating_sub(running.len());
    let mut plan: Vec<Planned> = Vec::with_capacity(running.len());
    for r in running.iter_mut() {
        let pos = r.seq.pos;
        if r.decoding() {
            let mut none = 0;
            let crowded = decoding > DRAFT_MAX_DECODERS;
            if let Some(spec) = r.spec.as_deref_mut() {
                spec.crowded = if crowded { spec.crowded + 1 } else { 0 };
                if spec.crowded >= PAYOFF_DRAFTED && spec.from == Drafts::Mtp {
                    // A batch this large drafts nothing, while the MTP layer's
                    // rows still cost a layer per token: they stop for good.
                    r.seq.mtp = None;
                }
            }
            let rows = if crowded { &mut none } else { &mut rows };
            let planned = match r.draft(&mut budget, rows, engine, ws) {
                Ok(p) => p,
                Err(e) => {
                    // The drafting layer failed: the request fails, as a failed pass's would.
                    let _ = r.req.tx.send(Event::Failed(e));
                    r.req.cancel.store(true, Ordering::Relaxed);
                    Planned::default()
                }
            };
            plan.push(Planned { pos, ..planned });
        } else {
            let mut take = (r.req.prompt.len() - r.fed).min(budget);
            if cache.is_some() && r.recurrent {
                // End a chunk at the prompt's last block end, where the
                // cache keeps the recurrent states.
                let at = r.req.prompt.len().saturating_sub(1) / BLOCK * BLOCK;
                if r.fed < at {
                    take = take.min(at - r.fed);
                }
            }
            budget -= take;
            let rows = usize::from(take > 0 && r.fed + take == r.req.prompt.len());
            plan.push(Planned { tokens: take, rows, drafted: 0, pos });
        }
    }
    let mut prompt_tokens = 0;
    let mut segs: Vec<Segment> = Vec::with_capacity(running.len());
    for (r, p) in running.iter_mut().zip(&plan) {
        if p.tokens == 0 {
            continue;
        }
        r.since.get_or_insert(t0);
        let Running { req, seq, fed, spec, .. } = r;
        let generated = req.decoder.tokens();
        let tokens = if generated.is_empty() {
            prompt_tokens += p.tokens;
            &req.prompt[*fed..*fed + p.tokens]
        } else if let Some(s) = spec {
            &s.feed[..]
        } else {
            &generated[generated.len() - 1..]
        };
        let end = if generated.is_empty() { req.prompt.len() } else { seq.pos + tokens.len() };
        segs.push(Segment { seq, tokens, end, logit_rows: p.rows });
    }
    let n_tokens: usize = segs.iter().map(|g| g.tokens.len()).sum();
    let result = forward_batch(engine.model(), ws, &mut segs, Some(&engine.pool));
    drop(segs);
    let now = Instant::now();
    c.steps.fetch_add(1, Ordering::Relaxed);
    c.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
    c.last_batch.store(plan.iter().filter(|p| p.tokens > 0).count(), Ordering::Relaxed);
    let bucket = STEP_BUCKETS.iter().position(|&b| n_tokens <= b).unwrap_or(STEP_BUCKETS.len());
    c.step_tokens[bucket].fetch_add(1, Ordering::Relaxed);
    c.step_sequences[decoding.min(opts.max_batch)].fetch_add(1, Ordering::Relaxed);
    c.busy_nanos.fetch_add((now - t0).as_nanos() as u64, Ordering::Relaxed);
    if let Err(e) = result {
        // The step's sequences are mid-update: all of them fail.
        let before = running.len();
        let mut i = 0;
        running.retain(|r| {
            let took = plan[i].tokens > 0;
            i += 1;
            if took {
                let _ = r.req.tx.send(Event::Failed(e.clone()));
            }
            !took
        });
        c.finished.fetch_add((before - running.len()) as u64, Ordering::Relaxed);
        return;
    }
    let mut keep = Vec::with_capacity(running.len());
    for (mut r, p) in running.drain(..).zip(plan) {
        let prefilling = !r.decoding();
        if prefilling {
            r.fed += p.tokens;
        }
        let before = r.req.decoder.tokens().len();
        let done = if p.rows > 0 { r.choose(p, prefilling, t0, c) } else { Ok(false) };
        if let Some(spec) = r.spec.as_deref_mut()
            && !prefilling
            && prompt_tokens == 0
        {
            // A decode step: its time per emitted token, with drafts (or the
            // confirmed tokens a rollback feeds again) or without.
            let emitted = r.req.decoder.tokens().len() - before;
            let drafted = p.tokens > 1;
            // A step without drafts would not run the MTP layer at all
            // without speculation: its time counts without the layer's.
            let mtp = r.seq.mtp.as_mut().map_or(0.0, |m| std::mem::take(&mut m.secs));
            let secs = (now - t0).as_secs_f64() - if drafted { 0.0 } else { mtp };
            spec.pays.record(drafted, secs, emitted);
        }
        let done = match done {
            Ok(done) => done,
            Err(e) => {
                let _ = r.req.tx.send(Event::Failed(e));
                c.finished.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        if let Some(pc) = cache.as_deref_mut()
            && p.tokens > 0
        {
            r.offer(pc, prefilling);
        }
        if !done {
            keep.push(r);
        } else {
            if let Some(pc) = cache.as_deref_mut() {
                r.keep_state(pc);
            }
            c.finished.fetch_add(1, Ordering::Relaxed);
        }
    }
    *running = keep;
}

impl Running {
    /// Plans a decoding step: its tokens (the last chosen one, after any
    /// tokens a rollback left to feed again, and the drafts) into
    /// `spec.feed`, within the step's token and logit-row budgets (its own
    /// token and row are reserved).
    fn draft(&mut self, budget: &mut usize, rows: &mut usize, engine: &Engine, ws: &mut Workspace) -> Result<Planned> {
        let Some(spec) = self.spec.as_deref_mut() else {
            return Ok(Planned { tokens: 1, rows: 1, ..Planned::default() });
        };
        let last = *self.req.decoder.tokens().last().expect("a decoding sequence has a token");
        spec.feed.clear();
        if !spec.refeed.is_empty() {
            // A rollback left confirmed tokens to feed again: no drafts this
            // step (a second rollback would have to feed them once more).
            if spec.refeed.len() > *budget {
                // More than the step has room for: some now, no choice yet.
                spec.feed.extend(spec.refeed.drain(..*budget + 1));
                *budget = 0;
                return Ok(Planned { tokens: spec.feed.len(), ..Planned::default() });
            }
            *budget -= spec.refeed.len();
            spec.feed.append(&mut spec.refeed);
            spec.feed.push(last);
            return Ok(Planned { tokens: spec.feed.len(), rows: 1, ..Planned::default() });
        }
        spec.feed.push(last);
        let left = self.req.decoder.max_new_tokens() - self.req.decoder.tokens().len();
        let room = self.seq.max_seq.saturating_sub(self.seq.pos + 1);
        let mut k = spec.next.min(*budget).min(*rows).min(left.saturating_sub(1)).min(room);
        if let Some(t) = self.long_after
            && self.seq.pos < t
        {
            // A pass ending past LongRoPE's threshold rotates all its rows
            // with the long magnitude; one token at a time, the rows before
            // the threshold keep the short one.
            k = k.min(t - self.seq.pos - 1);
        }
        if spec.pause == 0 && spec.from == Drafts::Mtp && self.seq.mtp.is_some() {
            match spec.pays.verdict() {
                Verdict::Measuring => {}
                Verdict::MeasurePlain(steps) => spec.pause = steps,
                // The MTP layer's rows cost a layer per token fed even while
                // nothing is drafted: they stop for good, and so do its drafts.
                Verdict::Loses => self.seq.mtp = None,
            }
        }
        if spec.pause > 0 {
            spec.pause -= 1;
            k = 0;
        }
        if k > 0 {
            match spec.from {
                Drafts::Ngram => crate::engine::draft::ngram(&spec.text, k, &mut spec.drafts),
                Drafts::Mtp => {
                    let (model, pool) = (engine.model(), Some(&*engine.pool));
                    mtp_draft(model, ws, &mut self.seq, last, k, &mut spec.drafts, None, pool)?;
                }
            }
            spec.feed.extend_from_slice(&spec.drafts);
        }
        let drafted = spec.feed.len() - 1;
        *budget -= drafted;
        *rows -= drafted;
        if drafted > 0 && self.recurrent {
            // A linear-attention state goes back only to a checkpoint.
            self.seq.checkpoint();
        }
        Ok(Planned { tokens: spec.feed.len(), rows: 1 + drafted, drafted, pos: 0 })
    }

    /// After a pass that computed `p.rows` logit rows: chooses a token from
    /// each in turn and delivers it, while the choices confirm the drafted
    /// tokens, then rolls the sequence back past rejected ones. Returns
    /// whether the request is done (finished, or its ticket is gone).
    fn choose(&mut self, p: Planned, prefilling: bool, t0: Instant, c: &Counters) -> Result<bool> {
        let vocab = self.seq.logits.len();
        let mut accepted = 0;
        let mut done = false;
        if !prefilling {
            self.req.decoder.record_pass(p.drafted);
            c.drafted_tokens.fetch_add(p.drafted as u64, Ordering::Relaxed);
        }
        for i in 0..p.rows {
            let logits = if i + 1 == p.rows {
                &self.seq.logits[..]
            } else {
                &self.seq.earlier_logits[i * vocab..(i + 1) * vocab]
            };
            // Tokens in the sequence once row i's token is: the rows end the pass.
            let fed = p.pos + p.tokens - p.rows + i + 1;
            let step = self.req.decoder.step_row(logits, fed, self.seq.max_seq, self.since.unwrap_or(t0));
            self.since = Some(step.at);
            c.generated_tokens.fetch_add(1, Ordering::Relaxed);
            if let Some(spec) = self.spec.as_deref_mut() {
                spec.text.push(step.token);
            }
            let event = Event::Token(step.token, step.logprobs, self.req.decoder.timings(), step.finish);
            let delivered = self.req.tx.send(event).is_ok();
            done = !delivered || step.finish.is_some();
            let confirmed = i < p.drafted && self.spec.as_ref().is_some_and(|s| s.drafts[i] == step.token);
            if done || !confirmed {
                break;
            }
            accepted += 1;
            self.req.decoder.record_accepted();
            c.accepted_tokens.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(spec) = self.spec.as_deref_mut()
            && p.drafted > 0
        {
            if accepted == 0 {
                spec.misses += 1;
                spec.pause = (1usize << spec.misses.min(16)).min(MAX_DRAFT_PAUSE);
            } else {
                spec.misses = 0;
            }
            spec.next = (accepted + 1).min(spec.tokens);
        }
        if accepted < p.drafted {
            // The rows of the rejected drafts go.
            let keep = p.pos + p.tokens - p.drafted + accepted;
            if self.recurrent {
                self.seq.truncate(p.pos)?;
                let spec = self.spec.as_deref_mut().expect("drafts come from speculation");
                spec.refeed.extend_from_slice(&spec.feed[..keep - p.pos]);
            } else {
                self.seq.truncate(keep)?;
            }
        }
        Ok(done)
    }
}
