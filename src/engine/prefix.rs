//! The prefix cache: the state of prompts already processed, kept in blocks
//! of [`BLOCK`] tokens, so a request that begins with the same tokens starts
//! from it instead of computing it again (an agent's every turn resends the
//! whole conversation).
//!
//! ```text
//! block i of a token list ─► key = hash(key of block i−1, its BLOCK tokens)
//!                            Block { parent key, tokens, per-layer rows, recurrent state? }
//! lookup(prompt): follow the keys from the start while blocks match (tokens
//!   compared, not only hashed), at most up to the prompt's last token; take
//!   the longest run whose end every layer can resume from; copy it in.
//! insert(tokens, sequence): add the blocks the sequence computed and the
//!   cache lacks; fill in rows an existing block lacks. The scheduler
//!   inserts as each block is computed, while a sliding window still holds
//!   its rows.
//! over budget: drop the least recently used block, deepest first.
//! ```
//!
//! What a layer needs to resume at block end `e`:
//! - a KV, latent or sparse layer of every position: its rows of `0..e`,
//!   which every block has (such a cache keeps every position);
//! - a sliding-window layer: the rows of its window before `e`; a block
//!   copied after the window moved on has none for that layer;
//! - a linear-attention layer: its whole recurrent state at `e`. A state
//!   is as big as hundreds of positions' rows and holds no history, so it
//!   is saved only where a later request is likely to resume: at the last
//!   block end of each prompt (the scheduler ends a prefill chunk there)
//!   and at the last block end the generation reached when it ends (the
//!   next turn of a conversation starts with it).
//!
//! Blocks are copied into a new sequence rather than shared in place: a
//! sequence's cache is one contiguous buffer per layer, which the attention
//! kernels stream. The copy is a memcpy of the rows, against a forward pass
//! over the same tokens: far cheaper at any width.
//!
//! Exactness: a row's bits do not depend on what else ran in its pass (the
//! kernels' contract), and the linear-attention recurrence runs token by
//! token whatever the chunking, so a sequence resumed from the cache
//! computes what it would have from scratch, bit for bit.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

use crate::model::session::{Keeps, Sequence};

/// Tokens per cached block. Smaller blocks reuse more of a prompt that
/// diverges mid-block (at most `BLOCK − 1` tokens are recomputed) and cost
/// more bookkeeping per token; 16 is vLLM's default too.
pub const BLOCK: usize = 16;

/// The key of the empty prefix.
const ROOT: u64 = 0x636f_6c69_6272_6921;

/// Bookkeeping bytes counted per block besides its rows.
const OVERHEAD: usize = 160;

/// Counters of a prefix cache, for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Most bytes the cache holds.
    pub budget: usize,
    /// Bytes it holds now (rows, states and bookkeeping).
    pub bytes: usize,
    /// Blocks it holds now.
    pub blocks: usize,
    /// Requests looked up.
    pub lookups: u64,
    /// Requests that started from cached state.
    pub hits: u64,
    /// Prompt tokens of the requests looked up.
    pub prompt_tokens: u64,
    /// Prompt tokens taken from the cache instead of computed.
    pub cached_tokens: u64,
    /// Blocks dropped to stay within the budget.
    pub evicted: u64,
}

struct Block {
    parent: u64,
    tokens: [u32; BLOCK],
    /// Blocks before it: its place in eviction among blocks used together.
    depth: usize,
    /// Per layer: the rows of the block's positions (`None` for a
    /// recurrent layer, or a window's rows no longer held when copied).
    rows: Vec<Option<Box<[u8]>>>,
    /// Every recurrent layer's state at the block's end, if saved.
    state: Option<Box<[f32]>>,
    /// The clock of its last use.
    used: u64,
    bytes: usize,
}

/// Cached prefix state within a byte budget; see the module notes.
pub struct PrefixCache {
    /// LongRoPE's threshold (see [`Regime`]).
    long_after: Option<usize>,
    blocks: HashMap<u64, Block>,
    /// (last use, deepest first, key): eviction takes the first.
    order: BTreeSet<(u64, Reverse<usize>, u64)>,
    clock: u64,
    stats: PrefixStats,
}

/// A lookup's result: how many prompt tokens come from the cache.
pub struct Hit {
    /// Tokens restored (a multiple of [`BLOCK`]).
    pub tokens: usize,
}

fn key(parent: u64, tokens: &[u32], regime: Regime) -> u64 {
    // SipHash with fixed keys: the same tokens give the same key in every
    // run. A collision is harmless: blocks are matched on their tokens.
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    regime.hash(&mut h);
    h.finish()
}

/// Which LongRoPE magnitude a block's rows were rotated with: a row's bits
/// depend on the length of the run of tokens it was computed in (past the
/// threshold, the long one), so blocks of one regime serve only prompts of
/// that regime. Always `Short` without LongRoPE.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Regime {
    Short,
    Long,
    /// Rows of both (a block across a prompt's end past the threshold):
    /// kept for its children's keys, never resumed from.
    Mixed,
}

impl PrefixCache {
    /// An empty cache of at most `budget` bytes, for a model whose LongRoPE
    /// threshold is `long_after` ([`crate::canonical::config::ModelConfig::long_rope_after`]).
    pub fn new(budget: usize, long_after: Option<usize>) -> PrefixCache {
        PrefixCache {
            long_after,
            blocks: HashMap::new(),
            order: BTreeSet::new(),
            clock: 0,
            stats: PrefixStats { budget, ..PrefixStats::default() },
        }
    }

    /// Counters and sizes now.
    pub fn stats(&self) -> PrefixStats {
        PrefixStats { blocks: self.blocks.len(), ..self.stats.clone() }
    }

    /// The regime of a row at `pos` of a sequence whose prompt has
    /// `prompt` tokens: prompt rows are computed in runs ending at the
    /// prompt's end, each generated row in a run ending just after it.
    fn regime(&self, pos: usize, prompt: usize) -> Regime {
        let end = if pos < prompt { prompt } else { pos + 1 };
        if self.long_after.is_some_and(|t| end > t) { Regime::Long } else { Regime::Short }
    }

    /// The keys of the cached blocks `tokens` (a whole prompt) begins
    /// with, in order.
    fn chain(&self, tokens: &[u32], most: usize) -> Vec<u64> {
        let mut out = Vec::new();
        let mut parent = ROOT;
        let regime = self.regime(0, tokens.len());
        for part in tokens.chunks_exact(BLOCK).take(most) {
            let k = key(parent, part, regime);
            match self.blocks.get(&k) {
                Some(b) if b.parent == parent && b.tokens == part => out.push(k),
                _ => break,
            }
            parent = k;
        }
        out
    }

    /// Whether a sequence whose layers keep `keeps` can resume at the end
    /// of `chain` from the blocks' contents.
    fn resumable(&self, chain: &[u64], keeps: &[Keeps]) -> bool {
        let end = chain.len() * BLOCK;
        keeps.iter().enumerate().all(|(l, k)| match k.rows_for(end) {
            Some(r) => (r.start / BLOCK..r.end.div_ceil(BLOCK)).all(|i| self.blocks[&chain[i]].rows[l].is_some()),
            None => chain.last().is_some_and(|k| self.blocks[k].state.is_some()),
        })
    }

    /// Marks `chain` used now, its deepest block the first to go.
    fn touch(&mut self, chain: &[u64]) {
        self.clock += 1;
        for k in chain {
            let b = self.blocks.get_mut(k).expect("a cached block");
            self.order.remove(&(b.used, Reverse(b.depth), *k));
            b.used = self.clock;
            self.order.insert((b.used, Reverse(b.depth), *k));
        }
    }

    /// Starts `seq` (fresh) from the longest cached prefix of `prompt` it
    /// can resume from, leaving at least the prompt's last token to compute
    /// (its logits choose the first new token).
    pub fn lookup(&mut self, prompt: &[u32], seq: &mut Sequence) -> Hit {
        self.stats.lookups += 1;
        self.stats.prompt_tokens += prompt.len() as u64;
        let most = prompt.len().saturating_sub(1) / BLOCK;
        let mut chain = self.chain(prompt, most);
        let keeps = seq.keeps();
        while !chain.is_empty() && !self.resumable(&chain, &keeps) {
            chain.pop();
        }
        if chain.is_empty() {
            return Hit { tokens: 0 };
        }
        let n = chain.len() * BLOCK;
        let blocks: Vec<&[Option<Box<[u8]>>]> = chain.iter().map(|k| &self.blocks[k].rows[..]).collect();
        let state = self.blocks[chain.last().expect("a block")].state.as_deref();
        seq.resume(n, BLOCK, &blocks, state);
        self.touch(&chain);
        self.stats.hits += 1;
        self.stats.cached_tokens += n as u64;
        Hit { tokens: n }
    }

    /// Adds what `seq` computed of `prompt` followed by `more` (its first
    /// `seq.pos` tokens): every whole block the cache lacks, the rows an
    /// existing block lacks, and `state` (every recurrent layer's state at
    /// position `state.0`, a block end) to its block. Then drops blocks
    /// beyond the budget.
    pub fn insert(&mut self, prompt: &[u32], more: &[u32], seq: &Sequence, state: Option<(usize, &[f32])>) {
        let n = (prompt.len() + more.len()).min(seq.pos) / BLOCK;
        let layers = seq.keeps().len();
        let mut parent = ROOT;
        let mut chain = Vec::with_capacity(n);
        let mut part = [0u32; BLOCK];
        for i in 0..n {
            let pos0 = i * BLOCK;
            for (j, t) in part.iter_mut().enumerate() {
                let at = pos0 + j;
                *t = if at < prompt.len() { prompt[at] } else { more[at - prompt.len()] };
            }
            let (first, last) = (self.regime(pos0, prompt.len()), self.regime(pos0 + BLOCK - 1, prompt.len()));
            let k = key(parent, &part, if first == last { first } else { Regime::Mixed });
            let saved = state.filter(|s| s.0 == pos0 + BLOCK).map(|s| s.1);
            match self.blocks.get_mut(&k) {
                Some(b) if b.parent == parent && b.tokens == part => {
                    for l in 0..layers {
                        if b.rows[l].is_none()
                            && let Some(r) = seq.copy_rows(l, pos0, BLOCK)
                        {
                            b.bytes += r.len();
                            self.stats.bytes += r.len();
                            b.rows[l] = Some(r);
                        }
                    }
                    if b.state.is_none()
                        && let Some(s) = saved
                    {
                        b.bytes += 4 * s.len();
                        self.stats.bytes += 4 * s.len();
                        b.state = Some(s.into());
                    }
                }
                Some(_) => break, // another prefix's block under the same key: keep it
                None => {
                    let rows: Vec<_> = (0..layers).map(|l| seq.copy_rows(l, pos0, BLOCK)).collect();
                    let state = saved.map(Box::<[f32]>::from);
                    let bytes = OVERHEAD
                        + rows.iter().flatten().map(|r| r.len()).sum::<usize>()
                        + state.as_ref().map_or(0, |s| 4 * s.len());
                    let b = Block { parent, tokens: part, depth: i, rows, state, used: 0, bytes };
                    self.order.insert((0, Reverse(i), k));
                    self.blocks.insert(k, b);
                    self.stats.bytes += bytes;
                }
            }
            chain.push(k);
            parent = k;
        }
        self.touch(&chain);
        self.evict();
    }

    /// Drops least recently used blocks until the cache fits its budget.
    fn evict(&mut self) {
        while self.stats.bytes > self.stats.budget {
            let Some((_, _, k)) = self.order.pop_first() else { break };
            let b = self.blocks.remove(&k).expect("an ordered block");
            self.stats.bytes -= b.bytes;
            self.stats.evicted += 1;
        }
    }
}
