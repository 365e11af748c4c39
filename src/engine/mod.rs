//! The Rust-facing engine: a model plus its thread pool, and the calls the
//! Python layer wraps (logits, hidden states, generation). Usable without
//! Python; every call makes its own [`Session`], so one `Engine` serves many
//! threads at once. An `Engine` is two `Arc`s: cloning it is cheap and shares
//! the weights and the pool, which is how a [`Generation`] outlives the call
//! that started it.

pub mod batch;
pub mod draft;
pub mod generation;
pub mod guide;
pub mod prefix;
pub mod sampling;
mod step;
use crate::model::session;

#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::Arc;

use crate::canonical::state::StateLayout;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::model::forward::{Capture, forward, forward_stage};
use crate::quant::DType;
pub use batch::{BatchOptions, BatchStats, Scheduler, Ticket};
pub use draft::{Drafts, Speculation};
pub use generation::Generation;
pub use guide::Constraint;
pub use prefix::{PrefixCache, PrefixStats};
pub use sampling::SamplingParams;
use session::{DEFAULT_CHUNK, Session};
pub use step::{FinishReason, GenerateOptions, MAX_TOP_LOGPROBS, Timings, TokenLogprobs};

/// Options for opening an engine.
#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// Worker threads; `None` = physical cores.
    pub threads: Option<usize>,
    /// Where routed experts live (resident, or streamed within a RAM budget).
    pub store: crate::model::store::StoreOptions,
    /// Element type of each session's KV cache.
    pub kv_cache: session::KvCacheType,
    /// Run only these layers, as one pipeline stage of a model split across
    /// processes (see [`crate::model::stage`]); `None` = the whole model.
    pub stage: Option<std::ops::Range<usize>>,
}

/// A loaded model ready to run.
#[derive(Clone)]
pub struct Engine {
    model: Arc<Model>,
    pool: Arc<rayon::ThreadPool>,
    /// The KV cache element type, resolved once at open.
    kv_dtype: DType,
    /// What constrained decoding needs of the vocabulary, built on the
    /// first constrained request.
    guides: guide::GuideSlot,
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
        let mut model = Model::open_with(path, &opts.store)?;
        match (&opts.stage, model.file().part()) {
            (Some(layers), _) => model.set_stage(layers.clone())?,
            (None, Some(p)) => {
                return Err(crate::error::Error::InvalidInput(format!(
                    "{} is a stage file (stage {} of {}, layers {}..{} of {}), not a whole model: run the \
                     folder of stage files with colibri.ray.Engine, or open the whole model",
                    path.display(),
                    p.stage + 1,
                    p.stages,
                    p.layers[0],
                    p.layers[1],
                    model.config.main_layers()
                )));
            }
            (None, None) => {}
        }
        let model = Arc::new(model);
        let kv_dtype = opts.kv_cache.resolve(&model);
        Ok(Engine { model, pool: Arc::new(pool), kv_dtype, guides: Default::default() })
    }

    /// The loaded model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The end-of-sequence ids the file names: generation_config.json's and
    /// config.json's `eos_token_id`, and tokenizer_config.json's `eos_token`
    /// looked up in the tokenizer (as the Python layer gathers them).
    pub fn eos_ids(&self) -> Vec<u32> {
        let src = &self.model.file().meta().source;
        let vocab = self.model.config.vocab_size as u64;
        let mut out = Vec::new();
        let mut push = |v: &serde_json::Value| {
            let ids: Vec<u64> = match v {
                serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_u64()).collect(),
                x => x.as_u64().into_iter().collect(),
            };
            for id in ids {
                if id < vocab && !out.contains(&(id as u32)) {
                    out.push(id as u32);
                }
            }
        };
        for cfg in [&src.generation_config, &src.config].into_iter().flatten() {
            if let Some(v) = cfg.get("eos_token_id") {
                push(v);
            }
        }
        let text = src.tokenizer_config.as_ref().and_then(|t| t.get("eos_token")).and_then(|e| match e {
            serde_json::Value::String(s) => Some(s.clone()),
            o => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        });
        if let (Some(text), Some(tok)) = (text, src.tokenizer.as_ref()) {
            let added = tok.get("added_tokens").and_then(|a| a.as_array()).into_iter().flatten();
            let id = added
                .filter(|t| t.get("content").and_then(|c| c.as_str()) == Some(text.as_str()))
                .find_map(|t| t.get("id").and_then(|i| i.as_u64()))
                .or_else(|| tok.get("model")?.get("vocab")?.get(&text)?.as_u64());
            if let Some(id) = id {
                push(&serde_json::Value::from(id));
            }
        }
        out
    }

    /// What constrained decoding needs of this engine's vocabulary (built
    /// once, on the first call, from the file's tokenizer.json).
    pub fn guides(&self) -> Result<Arc<guide::Guides>> {
        guide::guides(&self.guides, self)
    }

    /// Worker threads in the pool.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// A fresh session able to hold `max_seq` tokens.
    pub fn session(&self, max_seq: usize) -> Session {
        Session::with_kv(&self.model, max_seq, DEFAULT_CHUNK, self.kv_dtype)
    }

    /// The KV cache element type sessions of this engine use (f32 or f16).
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }

    /// The state memory of one sequence of this engine: bytes per token
    /// (the KV caches) and bytes per sequence, all layers, at its cache type.
    pub fn state_layout(&self) -> StateLayout {
        StateLayout::new(&self.model.config, self.kv_dtype.row_bytes(1).expect("an element type"), DEFAULT_CHUNK)
    }

    /// Bytes the KV cache of a session takes per token, all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.state_layout().bytes_per_token
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
        crate::model::forward::check_tokens(&self.model, &s.seq, ids)?;
        let mut out = vec![0.0; ids.len() * self.model.config.vocab_size];
        self.run(&mut s, ids, Capture { logits: Some(&mut out), ..Capture::default() }, interrupted)?;
        Ok(out)
    }

    /// Hidden states `[L+1, T, D]` for a fresh sequence (see [`Capture::hidden`]).
    pub fn hidden_states(&self, ids: &[u32], interrupted: &dyn Fn() -> bool) -> Result<Vec<f32>> {
        self.check_len(ids.len())?;
        let mut s = self.session(ids.len());
        crate::model::forward::check_tokens(&self.model, &s.seq, ids)?;
        let c = &self.model.config;
        let mut out = vec![0.0; (c.main_layers() + 1) * ids.len() * c.hidden_size];
        self.run(&mut s, ids, Capture { hidden: Some(&mut out), ..Capture::default() }, interrupted)?;
        Ok(out)
    }

    /// The multi-token-prediction layer's logits for a fresh sequence of
    /// `ids` (T tokens), `[T − 1 + k, V]` row-major: row `i < T − 1` from the
    /// hidden state of position `i` and token `i + 1` (predicting token
    /// `i + 2`), then `k` draft steps continuing from the token the model
    /// itself ranks first after `ids`, each from the one before's draft (its
    /// most likely token). What the drafts of speculative decoding are made
    /// of, for checking against a reference.
    pub fn mtp_draft_logits(&self, ids: &[u32], k: usize, interrupted: &dyn Fn() -> bool) -> Result<Vec<f32>> {
        let vocab = self.model.config.vocab_size;
        self.check_len(ids.len() + k)?;
        let mut s = self.session(ids.len() + k);
        s.seq.enable_mtp(&self.model)?;
        crate::model::forward::check_tokens(&self.model, &s.seq, ids)?;
        let teacher = (ids.len() - 1) * vocab;
        let mut out = vec![0.0; teacher + k * vocab];
        let (rows, steps) = out.split_at_mut(teacher);
        self.run(&mut s, ids, Capture { mtp_logits: Some(rows), ..Capture::default() }, interrupted)?;
        let first = crate::engine::sampling::argmax(&s.seq.logits);
        let mut drafts = Vec::with_capacity(k);
        let Session { seq, ws } = &mut s;
        crate::model::forward::mtp_draft(&self.model, ws, seq, first, k, &mut drafts, Some(steps), Some(&*self.pool))?;
        if drafts.len() < k {
            return Err(Error::InvalidInput(format!(
                "{k} draft steps do not fit a context of {} after {} tokens",
                self.model.config.max_seq_len,
                ids.len()
            )));
        }
        Ok(out)
    }

    /// Runs `ids` through the session on this engine's pool.
    pub fn run(&self, s: &mut Session, ids: &[u32], cap: Capture, interrupted: &dyn Fn() -> bool) -> Result<()> {
        forward(&self.model, s, ids, cap, Some(&self.pool), interrupted)
    }

    /// [`Engine::run`] for an engine that is one pipeline stage: `input` is
    /// the stage before's residual rows `[T, D]` (`None` on the first
    /// stage), and a stage before the last leaves its own in
    /// `cap.residual` (see [`forward_stage`]).
    pub fn run_stage(
        &self,
        s: &mut Session,
        ids: &[u32],
        input: Option<&[f32]>,
        cap: Capture,
        interrupted: &dyn Fn() -> bool,
    ) -> Result<()> {
        forward_stage(&self.model, s, ids, input, cap, Some(&self.pool), interrupted)
    }

    /// One batched pass of a pipeline stage over several sequences
    /// ([`crate::model::forward::forward_batch_stage`]) on this engine's pool.
    pub fn run_batch_stage(
        &self,
        ws: &mut session::Workspace,
        segs: &mut [crate::model::forward::Segment],
        input: Option<&[f32]>,
        residual: Option<&mut [f32]>,
    ) -> Result<()> {
        crate::model::forward::forward_batch_stage(&self.model, ws, segs, input, residual, Some(&self.pool))
    }

    /// Starts a generation continuing `prompt`: checks the prompt and the
    /// options and allocates the session, without computing anything yet.
    pub fn start(&self, prompt: &[u32], opts: &GenerateOptions) -> Result<Generation> {
        Generation::new(self, prompt, opts)
    }

    /// Continues `prompt` with up to `opts.max_new_tokens` new tokens and
    /// returns them. Stops early on a stop id (kept in the output) or when
    /// prompt plus output fill the context.
    /// `on_token` sees each new token as it is produced and may stop the
    /// generation by returning `false`.
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        interrupted: &dyn Fn() -> bool,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        let mut g = self.start(prompt, opts)?;
        while let Some(t) = g.next_token(interrupted)? {
            if !on_token(t) {
                break;
            }
        }
        Ok(g.into_tokens())
    }
}
