//! The Rust-facing engine: a model plus its thread pool, and the calls the
//! Python layer wraps (logits, hidden states, generation). Usable without
//! Python; every call makes its own [`Session`], so one `Engine` serves many
//! threads at once.

pub mod sampling;
pub mod session;

#[cfg(test)]
mod tests;

use std::path::Path;

use crate::error::{Error, Result};
use crate::model::Model;
use crate::model::forward::{Capture, forward};
use sampling::{Rng, sample};
use session::{DEFAULT_CHUNK, Session};

/// Options for opening an engine.
#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// Worker threads; `None` = physical cores.
    pub threads: Option<usize>,
}

/// Options for [`Engine::generate`].
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Stop after this many new tokens.
    pub max_new_tokens: usize,
    /// 0 = greedy.
    pub temperature: f32,
    /// Seed of the sampler (ignored when greedy).
    pub seed: u64,
    /// Stop when one of these ids is produced (it is included in the output).
    pub stop_ids: Vec<u32>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions { max_new_tokens: 16, temperature: 0.0, seed: 0, stop_ids: Vec::new() }
    }
}

/// A loaded model ready to run.
pub struct Engine {
    model: Model,
    pool: rayon::ThreadPool,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("model", &self.model).field("threads", &self.pool.current_num_threads()).finish()
    }
}

/// Never interrupted.
pub fn never() -> bool {
    false
}

impl Engine {
    /// Opens a `.colibri` file.
    pub fn open(path: &Path, opts: &EngineOptions) -> Result<Engine> {
        let pool = crate::threads::pool(opts.threads)?;
        Ok(Engine { model: Model::open(path)?, pool })
    }

    /// The loaded model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Worker threads in the pool.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// A fresh session able to hold `max_seq` tokens.
    pub fn session(&self, max_seq: usize) -> Session {
        Session::new(&self.model, max_seq, DEFAULT_CHUNK)
    }

    fn check_len(&self, n: usize) -> Result<()> {
        let ctx = self.model.config.max_seq_len;
        if n > ctx {
            return Err(Error::ContextOverflow(format!(
                "sequence of {n} tokens is longer than the model's context of {ctx}"
            )));
        }
        Ok(())
    }

    /// Logits of every position for a fresh sequence: `[T, V]` row-major.
    pub fn logits(&self, ids: &[u32], interrupted: &dyn Fn() -> bool) -> Result<Vec<f32>> {
        self.check_len(ids.len())?;
        let mut s = self.session(ids.len());
        crate::model::forward::check_tokens(&self.model, &s, ids)?;
        let mut out = vec![0.0; ids.len() * self.model.config.vocab_size];
        self.run(&mut s, ids, Capture { logits: Some(&mut out), hidden: None }, interrupted)?;
        Ok(out)
    }

    /// Hidden states `[L+1, T, D]` for a fresh sequence (see [`Capture::hidden`]).
    pub fn hidden_states(&self, ids: &[u32], interrupted: &dyn Fn() -> bool) -> Result<Vec<f32>> {
        self.check_len(ids.len())?;
        let mut s = self.session(ids.len());
        crate::model::forward::check_tokens(&self.model, &s, ids)?;
        let c = &self.model.config;
        let mut out = vec![0.0; (c.num_layers() + 1) * ids.len() * c.hidden_size];
        self.run(&mut s, ids, Capture { logits: None, hidden: Some(&mut out) }, interrupted)?;
        Ok(out)
    }

    /// Runs `ids` through the session on this engine's pool.
    pub fn run(&self, s: &mut Session, ids: &[u32], cap: Capture, interrupted: &dyn Fn() -> bool) -> Result<()> {
        forward(&self.model, s, ids, cap, Some(&self.pool), interrupted)
    }

    /// Continues `prompt` with up to `opts.max_new_tokens` new tokens and
    /// returns them. Stops early on a stop id or when prompt plus output fill
    /// the context.
    /// `on_token` sees each new token as it is produced and may stop the
    /// generation by returning `false`.
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        interrupted: &dyn Fn() -> bool,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        self.check_len(prompt.len())?;
        let max_seq = (prompt.len() + opts.max_new_tokens).min(self.model.config.max_seq_len);
        let mut s = self.session(max_seq);
        crate::model::forward::check_tokens(&self.model, &s, prompt)?;
        let mut rng = Rng::new(opts.seed);
        let mut out = Vec::with_capacity(opts.max_new_tokens);
        if opts.max_new_tokens == 0 {
            return Ok(out);
        }
        self.run(&mut s, prompt, Capture::default(), interrupted)?;
        loop {
            let next = sample(&s.logits, opts.temperature, &mut rng);
            out.push(next);
            let keep_going = on_token(next);
            if !keep_going
                || out.len() >= opts.max_new_tokens
                || opts.stop_ids.contains(&next)
                || s.pos + 1 >= s.max_seq
            {
                break;
            }
            if interrupted() {
                return Err(Error::Interrupted);
            }
            self.run(&mut s, &[next], Capture::default(), interrupted)?;
        }
        Ok(out)
    }
}
