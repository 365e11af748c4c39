//! One generation call as a value: a session, a sampler and the loop state,
//! advanced one token at a time by [`Generation::next_token`].
//!
//! Keeping the loop in a value (rather than a function taking a callback)
//! lets a caller do its own work between tokens — incremental
//! detokenisation, stop strings, Ctrl-C — without this module knowing about
//! text. The value owns a clone of its [`Engine`] (two `Arc`s), so it can
//! outlive the borrow that created it; weights and pool stay shared.

use std::time::{Duration, Instant};

use super::Engine;
use super::sampling::{Sampler, SamplingParams};
use crate::error::{Error, Result};
use crate::model::forward::{Capture, check_ids};
use crate::model::session::Session;

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
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 16,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            logprobs: None,
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
    /// Tokens generated so far.
    pub generated_tokens: usize,
    /// Time to run the prompt and choose the first token.
    pub prefill: Duration,
    /// Time of every later step (one forward pass of one token, and a choice).
    pub decode: Duration,
}

impl Timings {
    /// Prompt tokens per second of prefill (0 before the first token).
    pub fn prefill_tokens_per_second(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill)
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

/// A generation in progress. Create with [`Engine::start`].
pub struct Generation {
    engine: Engine,
    session: Session,
    sampler: Sampler,
    prompt: Vec<u32>,
    stop_ids: Vec<u32>,
    max_new_tokens: usize,
    tokens: Vec<u32>,
    logprobs_k: Option<usize>,
    logprobs: Vec<TokenLogprobs>,
    finish: Option<FinishReason>,
    /// A step failed (interrupted, most likely): the session is mid-update.
    broken: bool,
    timings: Timings,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("prompt_tokens", &self.prompt.len())
            .field("tokens", &self.tokens)
            .field("finish", &self.finish)
            .finish_non_exhaustive()
    }
}

/// Checks a request before any work (prompt ids and length, sampling
/// options) and makes its sampler; shared by [`Generation`] and the
/// scheduler.
pub(super) fn check_request(engine: &Engine, prompt: &[u32], opts: &GenerateOptions) -> Result<Sampler> {
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
    Ok(sampler)
}

impl Generation {
    /// Checks the prompt and options and allocates the session; no compute.
    pub(super) fn new(engine: &Engine, prompt: &[u32], opts: &GenerateOptions) -> Result<Generation> {
        let sampler = check_request(engine, prompt, opts)?;
        let ctx = engine.model().config.max_seq_len;
        let session = engine.session(prompt.len().saturating_add(opts.max_new_tokens).min(ctx));
        Ok(Generation {
            engine: engine.clone(),
            session,
            sampler,
            prompt: prompt.to_vec(),
            stop_ids: opts.stop_ids.clone(),
            max_new_tokens: opts.max_new_tokens,
            tokens: Vec::with_capacity(opts.max_new_tokens.min(ctx)),
            logprobs_k: opts.logprobs,
            logprobs: Vec::new(),
            finish: None,
            broken: false,
            timings: Timings { prompt_tokens: prompt.len(), ..Timings::default() },
        })
    }

    /// Runs one step and returns the new token, or `None` once the
    /// generation has finished (see [`Generation::finish_reason`]). The first
    /// call runs the whole prompt. `interrupted` is polled between prompt
    /// chunks; an interrupted or failed generation cannot be resumed.
    pub fn next_token(&mut self, interrupted: &dyn Fn() -> bool) -> Result<Option<u32>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        if self.broken {
            return Err(Error::InvalidInput("this generation was interrupted or failed and cannot go on".into()));
        }
        let start = Instant::now();
        let step = match self.tokens.last() {
            None if self.max_new_tokens == 0 => {
                self.finish = Some(FinishReason::Length);
                return Ok(None);
            }
            None => self.engine.run(&mut self.session, &self.prompt, Capture::default(), interrupted),
            Some(&last) => self.engine.run(&mut self.session, &[last], Capture::default(), interrupted),
        };
        if let Err(e) = step {
            self.broken = true;
            return Err(e);
        }
        let tok = self.sampler.sample(&self.session.seq.logits);
        self.sampler.accept(tok);
        self.tokens.push(tok);
        if let Some(k) = self.logprobs_k {
            self.logprobs.push(TokenLogprobs::of(&self.session.seq.logits, tok, k));
        }
        let spent = start.elapsed();
        if self.tokens.len() == 1 {
            self.timings.prefill = spent;
        } else {
            self.timings.decode += spent;
        }
        self.timings.generated_tokens = self.tokens.len();
        if self.stop_ids.contains(&tok) {
            self.finish = Some(FinishReason::Stop);
        } else if self.tokens.len() >= self.max_new_tokens || self.session.seq.pos + 1 >= self.session.seq.max_seq {
            // The last condition: prompt plus output now fill the session (at
            // most the context), so there is no room to run this token.
            self.finish = Some(FinishReason::Length);
        }
        Ok(Some(tok))
    }

    /// Why the generation ended; `None` while it can go on.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// The tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Each generated token's log-probabilities, when asked for
    /// ([`GenerateOptions::logprobs`]; empty otherwise).
    pub fn logprobs(&self) -> &[TokenLogprobs] {
        &self.logprobs
    }

    /// The generated tokens, consuming the generation.
    pub fn into_tokens(self) -> Vec<u32> {
        self.tokens
    }

    /// Counts and times so far.
    pub fn timings(&self) -> Timings {
        self.timings
    }

    /// The sampling parameters in use.
    pub fn sampling(&self) -> &SamplingParams {
        self.sampler.params()
    }
}
