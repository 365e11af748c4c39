//! One generation call as a value: a session of its own and the decoder of
//! `engine/step.rs`, advanced one token at a time by
//! [`Generation::next_token`].
//!
//! Keeping the loop in a value (rather than a function taking a callback)
//! lets a caller do its own work between tokens — incremental
//! detokenisation, stop strings, Ctrl-C — without this module knowing about
//! text. The value owns a clone of its [`Engine`] (two `Arc`s), so it can
//! outlive the borrow that created it; weights and pool stay shared.

use std::time::Instant;

use super::Engine;
use super::sampling::SamplingParams;
use super::step::{Decoder, FinishReason, GenerateOptions, Timings, TokenLogprobs};
use crate::error::{Error, Result};
use crate::model::forward::Capture;
use crate::model::session::Session;

/// A generation in progress. Create with [`Engine::start`].
pub struct Generation {
    engine: Engine,
    session: Session,
    prompt: Vec<u32>,
    decoder: Decoder,
    logprobs: Vec<TokenLogprobs>,
    /// A step failed (interrupted, most likely): the session is mid-update.
    broken: bool,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("prompt_tokens", &self.prompt.len())
            .field("tokens", &self.decoder.tokens())
            .field("finish", &self.decoder.finish())
            .finish_non_exhaustive()
    }
}

impl Generation {
    /// Checks the prompt and options and allocates the session; no compute.
    pub(super) fn new(engine: &Engine, prompt: &[u32], opts: &GenerateOptions) -> Result<Generation> {
        let decoder = Decoder::new(engine, prompt, opts)?;
        let ctx = engine.model().config.max_seq_len;
        let session = engine.session(prompt.len().saturating_add(opts.max_new_tokens).min(ctx));
        Ok(Generation {
            engine: engine.clone(),
            session,
            prompt: prompt.to_vec(),
            decoder,
            logprobs: Vec::new(),
            broken: false,
        })
    }

    /// Runs one step and returns the new token, or `None` once the
    /// generation has finished (see [`Generation::finish_reason`]). The first
    /// call runs the whole prompt. `interrupted` is polled between prompt
    /// chunks; an interrupted or failed generation cannot be resumed.
    pub fn next_token(&mut self, interrupted: &dyn Fn() -> bool) -> Result<Option<u32>> {
        self.next_token_from(None, interrupted)
    }

    /// The token ids the next step feeds: the prompt at first, then the
    /// last token chosen (empty once finished).
    pub fn pending(&self) -> &[u32] {
        match (self.decoder.finish(), self.decoder.tokens().last()) {
            (Some(_), _) => &[],
            (None, None) => &self.prompt,
            (None, Some(_)) => &self.decoder.tokens()[self.decoder.tokens().len() - 1..],
        }
    }

    /// [`Generation::next_token`] on the last stage of a pipeline: `input`
    /// is the residual stream `[T, D]` the stage before computed for
    /// [`Generation::pending`]'s tokens (`None` on a whole model).
    pub fn next_token_from(&mut self, input: Option<&[f32]>, interrupted: &dyn Fn() -> bool) -> Result<Option<u32>> {
        if self.decoder.finish().is_some() {
            return Ok(None);
        }
        if self.broken {
            return Err(Error::InvalidInput("this generation was interrupted or failed and cannot go on".into()));
        }
        let began = Instant::now();
        let last;
        let ids = match self.decoder.tokens().last() {
            None => &self.prompt[..],
            Some(&t) => {
                last = [t];
                &last[..]
            }
        };
        if let Err(e) = self.engine.run_stage(&mut self.session, ids, input, Capture::default(), interrupted) {
            self.broken = true;
            return Err(e);
        }
        let step = self.decoder.step(&self.session.seq, began);
        self.logprobs.extend(step.logprobs);
        Ok(Some(step.token))
    }

    /// For a batched pass run by the caller (a pipeline stage): this
    /// generation's sequence and the one token its next step feeds, or
    /// `None` when it has not started (its prompt goes through
    /// [`Generation::next_token_from`]), has finished, or failed.
    pub fn decode_parts(&mut self) -> Option<(&mut crate::model::session::Sequence, u32)> {
        match (self.decoder.finish(), self.decoder.tokens().last(), self.broken) {
            (None, Some(&t), false) => Some((&mut self.session.seq, t)),
            _ => None,
        }
    }

    /// After a batched pass over [`Generation::decode_parts`]'s token:
    /// chooses the next token from the logits it left, as
    /// [`Generation::next_token`] would have.
    pub fn step_after_pass(&mut self, began: Instant) -> u32 {
        let step = self.decoder.step(&self.session.seq, began);
        self.logprobs.extend(step.logprobs);
        step.token
    }

    /// Marks the generation failed (a batched pass over it failed).
    pub fn fail(&mut self) {
        self.broken = true;
    }

    /// Why the generation ended; `None` while it can go on.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.decoder.finish()
    }

    /// The tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        self.decoder.tokens()
    }

    /// Each generated token's log-probabilities, when asked for
    /// ([`GenerateOptions::logprobs`]; empty otherwise).
    pub fn logprobs(&self) -> &[TokenLogprobs] {
        &self.logprobs
    }

    /// The generated tokens, consuming the generation.
    pub fn into_tokens(self) -> Vec<u32> {
        self.decoder.into_tokens()
    }

    /// Counts and times so far.
    pub fn timings(&self) -> Timings {
        self.decoder.timings()
    }

    /// The sampling parameters in use.
    pub fn sampling(&self) -> &SamplingParams {
        self.decoder.sampling()
    }
}
