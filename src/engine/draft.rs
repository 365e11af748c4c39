//! Drafts for speculative decoding: tokens guessed cheaply, then checked by
//! one forward pass over all of them (see the scheduler's verification in
//! `batch.rs`). A guess costs a row of the pass; a right one saves a whole
//! pass, whose cost is mostly reading the weights.
//!
//! N-gram drafts (prompt lookup): the tokens that followed the latest
//! earlier occurrence of the text's last few tokens. No weights, nothing to
//! train; they pay where the output repeats its input (code edits,
//! retrieval, structured answers).
//!
//! MTP drafts: the model's own multi-token-prediction layer, run one row
//! per drafted token from the last hidden state
//! ([`crate::model::forward::mtp_draft`]). They cost a layer and an output
//! head per token and guess any text the layer was trained on.

use crate::error::{Error, Result};

/// Most drafted tokens per step: a rejected draft rolls the sequence back
/// by up to this many positions, within a sliding window's rollback reach
/// ([`crate::canonical::state::ROLLBACK`]).
pub const MAX_DRAFT_TOKENS: usize = 16;

/// Longest and shortest n-gram looked up: longer matches first (they
/// predict better), down to two tokens (a single token matches everywhere
/// and predicts little).
const NGRAM_MAX: usize = 4;
const NGRAM_MIN: usize = 2;

/// Where drafts come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drafts {
    /// Prompt lookup: the continuation of an earlier occurrence of the last
    /// n-gram, in prompt and output.
    Ngram,
    /// The model's own multi-token-prediction layer (when the file keeps
    /// it: `convert --keep-mtp`).
    Mtp,
}

impl Drafts {
    /// Parses `ngram` or `mtp`.
    pub fn parse(s: &str) -> Result<Drafts> {
        match s {
            "ngram" => Ok(Drafts::Ngram),
            "mtp" => Ok(Drafts::Mtp),
            _ => Err(Error::InvalidInput(format!("speculative must be \"ngram\" or \"mtp\", got {s:?}"))),
        }
    }
}

/// Speculative decoding for one generation: where drafts come from and
/// most tokens drafted per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculation {
    /// Where drafts come from.
    pub drafts: Drafts,
    /// Most tokens drafted per step, 1 to [`MAX_DRAFT_TOKENS`].
    pub tokens: usize,
}

impl Speculation {
    /// Checks the options against what the model file holds (`has_mtp`:
    /// a multi-token-prediction layer).
    pub fn check(&self, has_mtp: bool) -> Result<()> {
        if !(1..=MAX_DRAFT_TOKENS).contains(&self.tokens) {
            return Err(Error::InvalidInput(format!(
                "draft_tokens must be 1 to {MAX_DRAFT_TOKENS}, got {}",
                self.tokens
            )));
        }
        if self.drafts == Drafts::Mtp && !has_mtp {
            return Err(Error::InvalidInput(format!("speculative=\"mtp\": {}", crate::model::session::NO_MTP)));
        }
        Ok(())
    }
}

/// Up to `k` tokens that followed an earlier occurrence of the last n
/// tokens of `text` (n from 4 down to 2; the latest occurrence with `k`
/// tokens after it, else the latest), into `out` (cleared first). Nothing
/// when no such n-gram occurred before.
pub fn ngram(text: &[u32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = text.len();
    for n in (NGRAM_MIN..=NGRAM_MAX.min(len.saturating_sub(1))).rev() {
        let tail = &text[len - n..];
        // Starts before the tail's own, so a continuation exists; a match
        // near the end has only a few tokens after it.
        let mut found = (0..len - n).rev().filter(|&i| &text[i..i + n] == tail);
        let Some(latest) = found.next() else { continue };
        let at = if latest + n + k <= len { latest } else { found.find(|&i| i + n + k <= len).unwrap_or(latest) };
        out.extend_from_slice(&text[at + n..(at + n + k).min(len)]);
        return;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_longest_match_with_room_gives_the_draft() {
        let mut out = Vec::new();
        // "a b c d" occurs twice; the text ends with "c d": the latest
        // earlier "c d" (at 6) is followed by "x y".
        let text = [1, 2, 3, 4, 9, 1, 3, 4, 7, 8, 5, 3, 4];
        ngram(&text, 2, &mut out);
        assert_eq!(out, [7, 8]);
        // Asked for more than the latest match has after it: an earlier
        // match with enough; none has, so the latest.
        ngram(&text, 6, &mut out);
        assert_eq!(out, [9, 1, 3, 4, 7, 8]);
        ngram(&text, 10, &mut out);
        assert_eq!(out, [7, 8, 5, 3, 4]);
        // A longer match wins over a later shorter one.
        let text = [5, 6, 7, 1, 2, 8, 6, 7, 3, 4, 5, 6, 7];
        ngram(&text, 1, &mut out);
        assert_eq!(out, [1]);
        // No repeated n-gram of two or more: no draft.
        ngram(&[1, 2, 3, 1], 3, &mut out);
        assert!(out.is_empty());
        ngram(&[], 3, &mut out);
        assert!(out.is_empty());
        ngram(&[4, 4], 3, &mut out);
        assert!(out.is_empty());
        ngram(&[4, 4, 4], 3, &mut out);
        assert_eq!(out, [4]);
    }

    #[test]
    fn bad_options_are_refused() {
        assert!(Speculation { drafts: Drafts::Ngram, tokens: 0 }.check(false).is_err());
        assert!(Speculation { drafts: Drafts::Ngram, tokens: MAX_DRAFT_TOKENS + 1 }.check(true).is_err());
        assert!(Speculation { drafts: Drafts::Ngram, tokens: 4 }.check(false).is_ok());
        assert!(Speculation { drafts: Drafts::Mtp, tokens: 4 }.check(false).is_err());
        assert!(Speculation { drafts: Drafts::Mtp, tokens: 4 }.check(true).is_ok());
        assert!(Drafts::parse("eagle").is_err());
    }
}
