//! The decode step every loop shares: from the logits a forward pass left in
//! a sequence to the next token, its log-probabilities, its time and whether
//! the generation ends there.
//!
//! ```text
//! seq.logits ─► [mask] ─► sample ─► accept (penalties) ─► logprobs ─► time ─► finish?
//! ```
//!
//! A request with a [`Constraint`] has its mask (`engine/guide.rs`) applied
//! by the sampler after the penalties and before temperature and truncation;
//! one without pays a `None` check.
//!
//! A [`Decoder`] is one generation's side of that step: its sampler, its stop
//! rules and the tokens so far. [`Generation`](super::Generation) (one
//! sequence, a workspace of its own, prompt chunks polled for Ctrl-C) and the
//! [`Scheduler`](super::Scheduler) (many sequences in one batched pass) each
//! run the forward pass their own way and then hand every sequence that has
//! new logits to its decoder. The single generation is not a scheduler of
//! one: it runs on the caller's thread with its own workspace and polls
//! `interrupted` between prompt chunks, which a scheduler thread cannot, and
//! a batched pass over one sequence gains nothing. What the two loops share,
//! and what speculative decoding will extend (accepting several tokens of one
//! pass), lives here, so a rule changed here changes for both.

use std::time::{Duration, Instant};

use super::Engine;
use super::draft::Speculation;
use super::guide::{After, Constraint, Guided};
use super::sampling::{Sampler, SamplingParams};
use crate::error::{Error, Result};
use crate::model::forward::check_ids;
use crate::model::session::Sequence;

/// What to generate and when to stop.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Stop after this many new tokens.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: SamplingParams,
    /// Stop when one of these ids is produced (it is included in the output).
    pub stop_ids: Vec<u32>,
    /// Record each generated token's log-probability and this many of the
    /// most likely alternatives (at most [`MAX_TOP_LOGPROBS`]); `None`: off.
    pub logprobs: Option<usize>,
    /// What the output must be (a JSON Schema, a regex, a grammar); `None`:
    /// anything.
    pub constraint: Option<Constraint>,
    /// Speculative decoding (drafted tokens verified in one pass; the same
    /// output); `None`: one token per pass. Verification lives in the
    /// [`Scheduler`](crate::engine::Scheduler): a generation on the caller's
    /// thread ([`Engine::generate`](crate::engine::Engine::generate)) decodes
    /// one token per pass whatever this says.
    pub speculation: Option<Speculation>,
    /// What the output is expected to be, mostly (OpenAI's predicted
    /// outputs: the file an edit rewrites): n-gram drafts are looked up in
    /// it too. Changes no token; empty: none.
    pub prediction: Vec<u32>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 16,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            logprobs: None,
            constraint: None,
            speculation: None,
            prediction: Vec::new(),
        }
    }
}

/// Most alternatives [`GenerateOptions::logprobs`] may ask for per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log-probability of one generated token and of the most likely
/// tokens at its position, under the model's own distribution (softmax of
/// the logits, before temperature, penalties or truncation change it).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// ln p(the chosen token).
    pub logprob: f32,
    /// The most likely tokens and their ln p, most likely first (ties: the
    /// lower id first).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// Of `token` and the `k` most likely tokens under `logits`.
    pub fn of(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // In f64, so the normaliser of a large vocabulary loses nothing.
        let sum: f64 = logits.iter().map(|&x| crate::math::exp((x - max) as f64)).sum();
        let lse = max as f64 + crate::math::ln(sum);
        let lp = |x: f32| (x as f64 - lse) as f32;
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
        if k > 0 {
            for (i, &x) in logits.iter().enumerate() {
                if top.len() == k && x <= top[k - 1].1 {
                    continue;
                }
                // After every kept entry at least as large (ids ascend, so
                // an equal one already kept has the lower id).
                let at = top.partition_point(|&(_, y)| y >= x);
                top.insert(at, (i as u32, x));
                top.truncate(k);
            }
        }
        for t in &mut top {
            t.1 = lp(t.1);
        }
        TokenLogprobs { logprob: logits.get(token as usize).map_or(f32::NEG_INFINITY, |&x| lp(x)), top }
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id was produced.
    Stop,
    /// `max_new_tokens` were produced, or prompt plus output filled the context.
    Length,
}

impl FinishReason {
    /// `"stop"` or `"length"`, as OpenAI-style APIs spell them.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Counts and wall-clock times of one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Of them, tokens whose state came from the prefix cache instead of
    /// being computed.
    pub cached_tokens: usize,
    /// Tokens generated so far.
    pub generated_tokens: usize,
    /// Time to run the prompt and choose the first token.
    pub prefill: Duration,
    /// Tokens drafted for speculative decoding.
    pub drafted_tokens: usize,
    /// Of them, tokens the model's own choice confirmed (each saves a
    /// forward pass).
    pub accepted_tokens: usize,
    /// Forward passes after the first token (one per token without
    /// speculation, fewer with accepted drafts).
    pub decode_passes: usize,
    /// Time of every later step (one forward pass, and its choices).
    pub decode: Duration,
}

impl Timings {
    /// Prompt tokens computed per second of prefill (those from the prefix
    /// cache not counted; 0 before the first token).
    pub fn prefill_tokens_per_second(&self) -> f64 {
        rate(self.prompt_tokens - self.cached_tokens, self.prefill)
    }

    /// Generated tokens per second of decoding, not counting the first token
    /// (which prefill produced); 0 with fewer than two tokens.
    pub fn decode_tokens_per_second(&self) -> f64 {
        rate(self.generated_tokens.saturating_sub(1), self.decode)
    }
}

fn rate(n: usize, t: Duration) -> f64 {
    if n == 0 || t.is_zero() { 0.0 } else { n as f64 / t.as_secs_f64() }
}

/// One generation's decoding state: its sampler, its stop rules, the tokens
/// chosen so far, their times and, once decided, why it ended.
#[derive(Debug)]
pub(super) struct Decoder {
    sampler: Sampler,
    stop_ids: Vec<u32>,
    max_new_tokens: usize,
    logprobs_k: Option<usize>,
    tokens: Vec<u32>,
    timings: Timings,
    finish: Option<FinishReason>,
    /// The mask of a constrained request.
    guided: Option<Box<Guided>>,
    speculation: Option<Speculation>,
    /// The expected output drafts are also looked up in (moved out at admission).
    prediction: Vec<u32>,
}

/// What one step decided.
pub(super) struct Decoded {
    /// The new token.
    pub token: u32,
    /// Its log-probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
    /// Why the generation ends with this token, if it does.
    pub finish: Option<FinishReason>,
    /// When the token was chosen (the next step's time runs from here).
    pub at: Instant,
}

impl Decoder {
    /// Checks a request before any work (prompt length and ids, sampling
    /// options) and makes its decoder. A request for no new tokens is
    /// finished from the start.
    pub fn new(engine: &Engine, prompt: &[u32], opts: &GenerateOptions) -> Result<Decoder> {
        let model = engine.model();
        let ctx = model.config.max_seq_len;
        if prompt.len() > ctx {
            return Err(Error::ContextOverflow(format!(
                "prompt of {} tokens is longer than the model's context of {ctx}",
                prompt.len()
            )));
        }
        if let Some(k) = opts.logprobs
            && k > MAX_TOP_LOGPROBS
        {
            return Err(Error::InvalidInput(format!("logprobs: at most {MAX_TOP_LOGPROBS} alternatives, got {k}")));
        }
        let sampler = Sampler::new(opts.sampling.clone(), model.config.vocab_size, prompt)?;
        check_ids(model, prompt)?;
        if let Some(s) = &opts.speculation {
            s.check(model.mtp.is_some())?;
        }
        let v = model.config.vocab_size;
        if let Some(t) = opts.prediction.iter().find(|&&t| t as usize >= v) {
            return Err(Error::InvalidInput(format!(
                "prediction: token id {t} is out of range for a vocabulary of {v}"
            )));
        }
        let guided = match &opts.constraint {
            None => None,
            Some(c) => Some(Box::new(Guided::new(&*engine.guides()?, c, &opts.stop_ids)?)),
        };
        Ok(Decoder {
            sampler,
            stop_ids: opts.stop_ids.clone(),
            max_new_tokens: opts.max_new_tokens,
            logprobs_k: opts.logprobs,
            tokens: Vec::with_capacity(opts.max_new_tokens.min(ctx)),
            timings: Timings { prompt_tokens: prompt.len(), ..Timings::default() },
            finish: (opts.max_new_tokens == 0).then_some(FinishReason::Length),
            guided,
            speculation: opts.speculation,
            prediction: opts.prediction.clone(),
        })
    }

    /// Chooses the next token from the logits the last pass left in `seq`,
    /// records it, and decides whether the generation ends with it. The
    /// step's time runs from `began` (when its forward pass started; for the
    /// first token, when the prompt's first chunk did) to the choice.
    pub fn step(&mut self, seq: &Sequence, began: Instant) -> Decoded {
        self.step_row(&seq.logits, seq.pos, seq.max_seq, began)
    }

    /// [`Decoder::step`] from one row of logits: those after the sequence's
    /// first `fed` tokens, in a sequence of at most `max_seq` (a drafted
    /// token's row, when a pass verifies several).
    pub fn step_row(&mut self, logits: &[f32], fed: usize, max_seq: usize, began: Instant) -> Decoded {
        debug_assert!(self.finish.is_none(), "a finished generation takes no more steps");
        let mut done = false;
        let token = match self.guided.as_deref_mut() {
            None => self.sampler.sample(logits),
            Some(g) => match g.mask() {
                Some(mask) => {
                    let t = self.sampler.sample_masked(logits, mask.as_slice());
                    done = g.is_end(t) || matches!(g.consume(t), After::Done);
                    t
                }
                // llguidance failed (it should not): end here with the
                // first end id rather than write text the grammar refuses.
                None => {
                    done = true;
                    g.first_end()
                }
            },
        };
        self.sampler.accept(token);
        self.tokens.push(token);
        let logprobs = self.logprobs_k.map(|k| TokenLogprobs::of(logits, token, k));
        let at = Instant::now();
        if self.tokens.len() == 1 {
            self.timings.prefill = at - began;
        } else {
            self.timings.decode += at - began;
        }
        self.timings.generated_tokens = self.tokens.len();
        // A constrained output ends where its grammar says (a stop id the
        // grammar took as text does not end it).
        let stop = if self.guided.is_some() { done } else { self.stop_ids.contains(&token) };
        if stop {
            self.finish = Some(FinishReason::Stop);
        } else if self.tokens.len() >= self.max_new_tokens || fed + 1 >= max_seq {
            // The last condition: prompt plus output now fill the sequence (at
            // most the context), so there is no room to run this token.
            self.finish = Some(FinishReason::Length);
        }
        Decoded { token, logprobs, finish: self.finish, at }
    }

    /// The tokens chosen so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The chosen tokens, consuming the decoder.
    pub fn into_tokens(self) -> Vec<u32> {
        self.tokens
    }

    /// Most new tokens the request asked for.
    pub fn max_new_tokens(&self) -> usize {
        self.max_new_tokens
    }

    /// Why the generation ended; `None` while it can go on.
    pub fn finish(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Counts and times so far.
    pub fn timings(&self) -> Timings {
        self.timings
    }

    /// Speculative decoding, if asked for.
    pub fn speculation(&self) -> Option<Speculation> {
        self.speculation
    }

    /// The expected output, once (empty afterwards).
    pub fn take_prediction(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.prediction)
    }

    /// Counts one decode pass, which verifies `drafted` tokens.
    pub fn record_pass(&mut self, drafted: usize) {
        self.timings.decode_passes += 1;
        self.timings.drafted_tokens += drafted;
    }

    /// Counts a drafted token the model's choice confirmed.
    pub fn record_accepted(&mut self) {
        self.timings.accepted_tokens += 1;
    }

    /// Records that the first `n` prompt tokens came from the prefix cache.
    pub fn set_cached(&mut self, n: usize) {
        self.timings.cached_tokens = n;
    }

    /// The sampling parameters in use.
    pub fn sampling(&self) -> &SamplingParams {
        self.sampler.params()
    }
}
