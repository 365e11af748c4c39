//! Constrained decoding: a per-sequence token mask from llguidance, applied
//! by the sampler before it chooses.
//!
//! ```text
//! tokenizer.json ─► token bytes per id ─► TokTrie ─► ParserFactory   (once per engine, on first use)
//! JSON Schema / regex / Lark ─► Matcher ─► mask of allowed ids        (per sequence)
//!
//! inline:   [forward pass n ..........] mask n ─► sample ─► consume ─► [forward pass n+1 ...] mask n+1 ...
//! overlap:  [forward pass n ..........] sample(mask n) ─► consume ─► [forward pass n+1 ...] sample(mask n+1)
//! (worker)                                            └─► [mask n+1 computed meanwhile] ──┘
//! ```
//!
//! The vocabulary's bytes come from the tokenizer.json the `.colibri` file
//! embeds, so the Rust engine (and the C ABI) can constrain without Python:
//! byte-level BPE vocabularies (GPT-2's byte-to-character table, `Ġ` for a
//! space) and SentencePiece ones (`▁` for a space, `<0xNN>` byte fallback)
//! both map to the bytes each token writes; special tokens are marked so a
//! grammar never produces them unless it names them.
//!
//! A constrained sequence owns a `Guided`: its matcher, and with
//! `COLIBRI_GUIDE_OVERLAP=1` a worker thread that computes the next mask
//! while the next forward pass runs (the step consumes the chosen token at
//! once, since whether the grammar is finished decides whether there is a
//! next pass, and hands only the mask to the worker). By default the mask is
//! computed inline, when the step needs it: measured on the demo model (4096
//! tokens, 8 sequences under a JSON Schema, 2 cores; benches/guide_bench.py)
//! a mask costs a few microseconds, less than handing it to another thread
//! and back, and the worker competes with the forward pass's own threads for
//! the cores (inline -4%, worker -8% against unconstrained, medians of 7).
//! The worker can pay where masks are dear (large vocabularies, intricate
//! grammars) and cores are spare. A sequence without a constraint has no
//! `Guided` and pays one `Option` check per token.
//!
//! End of output: when the matcher says the text so far is complete, the
//! request's stop ids are allowed (llguidance's own end-of-sequence bit is
//! moved onto them), and a stop id ends a constrained output only then: one
//! the grammar allows as text elsewhere (a stop id the tokenizer does not
//! mark special, or a special token the grammar names) is text. When the
//! grammar cannot go on at all the generation finishes with
//! [`FinishReason::Stop`] without another pass; `max_new_tokens` cutting it
//! short is [`FinishReason::Length`].
//!
//! [`FinishReason::Stop`]: super::FinishReason::Stop
//! [`FinishReason::Length`]: super::FinishReason::Length

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::error::{Error, Result};

/// What a constrained generation must write.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// JSON text valid against this JSON Schema (its JSON text).
    JsonSchema(String),
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Text of this grammar in llguidance's Lark syntax (`%json {...}`
    /// embeds a JSON Schema).
    Grammar(String),
}

impl Constraint {
    fn what(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Grammar(_) => "grammar",
        }
    }

    /// The llguidance grammar of the constraint. A JSON Schema without an
    /// `x-guidance` entry of its own is compiled to compact JSON with one
    /// space after `,` and `:` (as Python's `json.dumps` writes it) and no
    /// other whitespace: llguidance's default lets a model pad with any
    /// whitespace, which a small model does without end.
    fn grammar(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Constraint::JsonSchema(text) => {
                let schema: Value = serde_json::from_str(text)
                    .map_err(|e| Error::InvalidInput(format!("json_schema: not valid JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(with_compact_json(schema))
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// The compile options colibri gives a JSON Schema that names none.
pub fn compact_json_options() -> Value {
    serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

fn with_compact_json(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        map.insert("x-guidance".into(), compact_json_options());
    }
    schema
}

/// The bytes each token id writes, from a Hugging Face tokenizer.json, for
/// a vocabulary of `vocab` ids (the model's logits width; ids the tokenizer
/// does not define get no bytes and are never allowed). Special added
/// tokens start with [`TokTrie::SPECIAL_TOKEN_MARKER`].
pub fn token_bytes(tokenizer: &Value, vocab: usize) -> Result<Vec<Vec<u8>>> {
    let bad = |msg: String| Error::InvalidInput(format!("constrained decoding: tokenizer.json: {msg}"));
    let decoder = tokenizer.get("decoder").unwrap_or(&Value::Null);
    let kind = |d: &Value| d.get("type").and_then(Value::as_str).unwrap_or("").to_string();
    // Which decoders run: one, or a Sequence of them.
    let decoders: Vec<&Value> = match decoder.get("decoders").and_then(Value::as_array) {
        Some(list) => list.iter().collect(),
        None => vec![decoder],
    };
    let byte_level = decoders.iter().any(|d| kind(d) == "ByteLevel")
        || (decoder.is_null()
            && tokenizer.get("pre_tokenizer").is_some_and(|p| p.to_string().contains("\"ByteLevel\"")));
    let byte_fallback = decoders.iter().any(|d| kind(d) == "ByteFallback")
        || tokenizer.get("model").and_then(|m| m.get("byte_fallback")).and_then(Value::as_bool) == Some(true);
    // SentencePiece writes a space as `▁`: a Replace decoder or a Metaspace one says so.
    let mut space: Option<String> = None;
    for d in &decoders {
        match kind(d).as_str() {
            "Replace" if d.get("content").and_then(Value::as_str) == Some(" ") => {
                space = d.get("pattern").and_then(|p| p.get("String")).and_then(Value::as_str).map(str::to_string);
            }
            "Metaspace" => {
                let r = d.get("replacement").and_then(Value::as_str).unwrap_or("\u{2581}");
                space = Some(r.to_string());
            }
            _ => {}
        }
    }
    if !byte_level && !byte_fallback && space.is_none() {
        return Err(bad(format!(
            "its decoder ({}) is neither byte-level BPE nor SentencePiece, so the bytes of its tokens are unknown",
            if decoder.is_null() { "none".to_string() } else { kind(decoder) }
        )));
    }
    let table = byte_level.then(gpt2_chars);
    let mut out: Vec<Vec<u8>> = vec![Vec::new(); vocab];
    let mut done = vec![false; vocab];
    let added = tokenizer.get("added_tokens").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
    for t in added {
        let (Some(id), Some(text)) = (t.get("id").and_then(Value::as_u64), t.get("content").and_then(Value::as_str))
        else {
            return Err(bad(format!("an added token without an id and content: {t}")));
        };
        let Some(slot) = out.get_mut(id as usize) else { continue };
        let special = t.get("special").and_then(Value::as_bool).unwrap_or(false);
        let mut bytes = Vec::with_capacity(text.len() + 1);
        if special {
            bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
        }
        bytes.extend_from_slice(text.as_bytes());
        *slot = bytes;
        done[id as usize] = true;
    }
    let vocab_map = tokenizer.get("model").and_then(|m| m.get("vocab"));
    // BPE and WordPiece: {"piece": id}; Unigram: [["piece", score], ...].
    let pieces: Vec<(&str, u64)> = match vocab_map {
        Some(Value::Object(m)) => m.iter().filter_map(|(k, v)| Some((k.as_str(), v.as_u64()?))).collect(),
        Some(Value::Array(a)) => {
            a.iter().enumerate().filter_map(|(i, p)| Some((p.get(0)?.as_str()?, i as u64))).collect()
        }
        _ => return Err(bad("model.vocab is missing".into())),
    };
    for (piece, id) in pieces {
        let id = id as usize;
        if id >= vocab || done[id] {
            continue;
        }
        out[id] = if let Some(table) = &table {
            let mut bytes = Vec::with_capacity(piece.len());
            for c in piece.chars() {
                match table.iter().position(|&x| x == c) {
                    Some(b) => bytes.push(b as u8),
                    None => return Err(bad(format!("token {id} ({piece:?}) has a character outside the byte table"))),
                }
            }
            bytes
        } else if let Some(b) = byte_fallback.then(|| fallback_byte(piece)).flatten() {
            vec![b]
        } else {
            match &space {
                Some(s) => piece.replace(s.as_str(), " ").into_bytes(),
                None => piece.as_bytes().to_vec(),
            }
        };
    }
    Ok(out)
}

/// `<0xNN>`: SentencePiece's byte fallback piece for byte NN.
fn fallback_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// GPT-2's byte-level table: the character standing for each byte. Printable
/// Latin-1 bytes stand for themselves; the others, in order, take the
/// characters from U+0100 on.
fn gpt2_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0x100u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        *slot = if printable {
            char::from(b as u8)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below the surrogates")
        };
    }
    table
}

/// What one engine builds once to constrain its sequences: the token trie
/// and llguidance's factory (which compiles each request's grammar).
pub struct Guides {
    factory: ParserFactory,
    /// The ids the trie treats as end of sequence.
    eos: Vec<u32>,
}

impl std::fmt::Debug for Guides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guides").field("eos", &self.eos).finish_non_exhaustive()
    }
}

impl Guides {
    /// From a tokenizer.json, for `vocab` ids, with `eos` as the model's
    /// end-of-sequence ids (the first stands for all in the trie; an empty
    /// list uses id 0, which then only ends a generation as a request's stop id).
    pub fn new(tokenizer: &Value, vocab: usize, eos: &[u32]) -> Result<Guides> {
        let words = token_bytes(tokenizer, vocab)?;
        let eos: Vec<u32> = if eos.is_empty() { vec![0] } else { eos.to_vec() };
        let info = TokRxInfo::new(vocab as u32, eos[0]);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::InvalidInput(format!("constrained decoding: cannot index the vocabulary: {e}")))?;
        factory.quiet();
        // Errors name the problem, without the parser's state and grammar.
        factory.limits_mut().verbose_errors = false;
        Ok(Guides { factory, eos })
    }

    /// A matcher for `c`, its first mask computed (so a grammar that cannot
    /// be compiled, or that matches nothing, fails here).
    fn start(&self, c: &Constraint) -> Result<(Matcher, (SimpleVob, bool))> {
        let what = c.what();
        let parser =
            self.factory.create_parser(c.grammar()?).map_err(|e| Error::InvalidInput(format!("{what}: {e}")))?;
        let mut m = Matcher::new(Ok(parser));
        let nothing =
            || Error::InvalidInput(format!("{what}: the constraint matches no text this vocabulary can write"));
        match next_mask(&mut m) {
            Ok((mask, _)) if mask.is_zero() => Err(nothing()),
            Ok(first) => Ok((m, first)),
            // llguidance stops at once when no token can start the text.
            Err(e) if e.contains("NoExtension") => Err(nothing()),
            Err(e) => Err(Error::InvalidInput(format!("{what}: {e}"))),
        }
    }
}

/// The mask of what may come next, and whether the text so far is complete
/// (may end here). The end is read from the matcher, not from the mask's
/// end-of-sequence bit: that bit is also the token's own, which a grammar
/// may ask for as text.
fn next_mask(m: &mut Matcher) -> std::result::Result<(SimpleVob, bool), String> {
    let mask = m.compute_mask().map_err(|e| e.to_string())?;
    let accepting = m.is_accepting().map_err(|e| e.to_string())?;
    Ok((mask, accepting))
}

/// The per-engine slot [`Guides`] are built in on first use.
pub(crate) type GuideSlot = Arc<OnceLock<std::result::Result<Arc<Guides>, Error>>>;

/// Whether masks are computed on a worker while the forward pass runs
/// (`COLIBRI_GUIDE_OVERLAP=1`); by default they are computed inline.
fn overlap() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("COLIBRI_GUIDE_OVERLAP").is_ok_and(|v| v == "1"))
}

/// A constrained sequence's side of the decode step.
pub(crate) struct Guided {
    matcher: Arc<Mutex<Matcher>>,
    /// The mask for the next token, when it is known here.
    ready: Option<SimpleVob>,
    /// The worker computing masks, when overlapping.
    worker: Option<Worker>,
    /// Ids that end the output when the grammar allows an end: the
    /// request's stop ids, or the model's end-of-sequence ids without them.
    ends: Vec<u32>,
    /// The ids llguidance marks as end of sequence.
    eos: Vec<u32>,
    /// The text so far is complete: the last mask allowed an end.
    end_ok: bool,
}

struct Worker {
    go: Option<Sender<()>>,
    masks: Receiver<std::result::Result<(SimpleVob, bool), String>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.go.take(); // the worker's loop ends when its channel closes
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Guided {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guided").field("ends", &self.ends).finish_non_exhaustive()
    }
}

/// What consuming a token left.
pub(crate) enum After {
    /// More may follow.
    Going,
    /// The grammar cannot go on: the generation is complete.
    Done,
}

impl Guided {
    /// Compiles `c` for a request stopping on `stop_ids`.
    pub fn new(guides: &Guides, c: &Constraint, stop_ids: &[u32]) -> Result<Guided> {
        Guided::with_worker(guides, c, stop_ids, overlap())
    }

    /// As [`Guided::new`], with masks computed on a worker thread or inline.
    fn with_worker(guides: &Guides, c: &Constraint, stop_ids: &[u32], worker: bool) -> Result<Guided> {
        let (matcher, first) = guides.start(c)?;
        let ends = if stop_ids.is_empty() { guides.eos.clone() } else { stop_ids.to_vec() };
        let matcher = Arc::new(Mutex::new(matcher));
        let worker = if worker { Some(spawn(matcher.clone())?) } else { None };
        let mut g = Guided { matcher, ready: None, worker, ends, eos: guides.eos.clone(), end_ok: false };
        g.ready = Some(g.ends_moved(first.0, first.1));
        Ok(g)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Matcher> {
        self.matcher.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The mask for the next token (waiting for the worker if it is still
    /// computing), with the end moved onto the request's end ids. `None`
    /// when llguidance failed or allows nothing (the caller ends the
    /// generation).
    pub fn mask(&mut self) -> Option<&SimpleVob> {
        if self.ready.is_none() {
            let got = match &self.worker {
                Some(w) => w.masks.recv().unwrap_or_else(|_| Err("the mask worker stopped".into())),
                None => next_mask(&mut self.lock()),
            };
            self.ready = match got {
                Ok((m, accepting)) => Some(self.ends_moved(m, accepting)),
                Err(_) => None,
            };
        }
        self.ready.as_ref().filter(|m| !m.is_zero())
    }

    /// `mask` with the end moved onto the request's end ids when the text so
    /// far is complete (`accepting`); otherwise as llguidance gave it (an
    /// end-of-sequence id set there is one the grammar wants as text).
    fn ends_moved(&mut self, mut mask: SimpleVob, accepting: bool) -> SimpleVob {
        self.end_ok = accepting;
        if accepting {
            for &t in &self.eos {
                if !self.ends.contains(&t) {
                    mask.disallow_token(t);
                }
            }
            for &t in &self.ends {
                if (t as usize) < mask.len() {
                    mask.allow_token(t);
                }
            }
        }
        mask
    }

    /// The id that ends the output when the matcher fails.
    pub fn first_end(&self) -> u32 {
        self.ends[0]
    }

    /// Whether `t`, chosen under the last mask, ends the output: an end id
    /// while the grammar accepts what was written. (An end id the grammar
    /// wants as text is text.)
    pub fn is_end(&self, t: u32) -> bool {
        self.end_ok && self.ends.contains(&t)
    }

    /// Feeds the chosen token (not an end id) to the matcher and starts the
    /// next mask.
    pub fn consume(&mut self, t: u32) -> After {
        self.ready = None;
        let done = {
            let mut m = self.lock();
            m.consume_token(t).is_err() || m.is_stopped()
        };
        if done {
            return After::Done;
        }
        if let Some(w) = &self.worker
            && let Some(go) = &w.go
        {
            let _ = go.send(());
        }
        After::Going
    }
}

fn spawn(matcher: Arc<Mutex<Matcher>>) -> Result<Worker> {
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (mask_tx, mask_rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("colibri-guide".into())
        .spawn(move || {
            while go_rx.recv().is_ok() {
                let r = next_mask(&mut matcher.lock().unwrap_or_else(|p| p.into_inner()));
                if mask_tx.send(r).is_err() {
                    break;
                }
            }
        })
        .map_err(|e| Error::InvalidInput(format!("constrained decoding: cannot start a mask worker: {e}")))?;
    Ok(Worker { go: Some(go_tx), masks: mask_rx, thread: Some(thread) })
}

/// The engine's [`Guides`], built on first use from the file's tokenizer.
pub(crate) fn guides(slot: &GuideSlot, engine: &super::Engine) -> Result<Arc<Guides>> {
    slot.get_or_init(|| {
        let model = engine.model();
        let Some(tok) = model.file().meta().source.tokenizer.as_ref() else {
            return Err(Error::InvalidInput(
                "constrained decoding needs the model's tokenizer, and this file has none".into(),
            ));
        };
        Guides::new(tok, model.config.vocab_size, &engine.eos_ids()).map(Arc::new)
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_table_is_gpt2s() {
        let t = gpt2_chars();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0xAD], 'Ń');
        let mut sorted = t.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 256, "one character per byte");
    }

    fn byte_level() -> Value {
        serde_json::json!({
            "added_tokens": [{"id": 5, "content": "<|end|>", "special": true}, {"id": 6, "content": "<x>", "special": false}],
            "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "vocab": {"a": 0, "Ġb": 1, "Ċ": 2, "Ã©": 3, "{\"": 4}},
        })
    }

    fn sentencepiece() -> Value {
        serde_json::json!({
            "added_tokens": [{"id": 0, "content": "</s>", "special": true}],
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "byte_fallback": true, "vocab": {"</s>": 0, "<0x0A>": 1, "▁hi": 2, "é": 3, "<0xC3>": 4}},
        })
    }

    #[test]
    fn byte_level_and_sentencepiece_tokens_map_to_their_bytes() {
        let b = token_bytes(&byte_level(), 8).unwrap();
        assert_eq!(b[0], b"a");
        assert_eq!(b[1], b" b");
        assert_eq!(b[2], b"\n");
        assert_eq!(b[3], "é".as_bytes());
        assert_eq!(b[4], b"{\"");
        assert_eq!(b[5], b"\xFF<|end|>");
        assert_eq!(b[6], b"<x>");
        assert!(b[7].is_empty(), "an id past the tokenizer writes nothing");
        let s = token_bytes(&sentencepiece(), 5).unwrap();
        assert_eq!(s[0], b"\xFF</s>");
        assert_eq!(s[1], b"\n");
        assert_eq!(s[2], b" hi");
        assert_eq!(s[3], "é".as_bytes());
        assert_eq!(s[4], [0xC3]);
        let metaspace = serde_json::json!({
            "decoder": {"type": "Metaspace", "replacement": "▁"},
            "model": {"type": "Unigram", "vocab": [["<unk>", 0.0], ["▁a", -1.0]]},
        });
        assert_eq!(token_bytes(&metaspace, 2).unwrap()[1], b" a");
        let wordpiece = serde_json::json!({"decoder": {"type": "WordPiece"}, "model": {"vocab": {"a": 0}}});
        assert!(matches!(token_bytes(&wordpiece, 1), Err(Error::InvalidInput(m)) if m.contains("WordPiece")));
    }

    /// A vocabulary of single printable characters plus an end token.
    fn tiny() -> Guides {
        let mut vocab = serde_json::Map::new();
        for (i, c) in (b' '..=b'~').enumerate() {
            let ch = gpt2_chars()[c as usize];
            vocab.insert(ch.to_string(), Value::from(i));
        }
        let n = vocab.len();
        let tok = serde_json::json!({
            "added_tokens": [{"id": n, "content": "<|end|>", "special": true}],
            "decoder": {"type": "ByteLevel"},
            "model": {"vocab": vocab},
        });
        Guides::new(&tok, n + 1, &[n as u32]).unwrap()
    }

    fn id(c: char) -> u32 {
        (c as u8 - b' ') as u32
    }

    #[test]
    fn a_regex_allows_only_its_text_then_the_end() {
        let g = tiny();
        let end = g.eos[0];
        let mut m = Guided::new(&g, &Constraint::Regex("ab+".into()), &[]).unwrap();
        let mask = m.mask().unwrap();
        assert!(mask.is_allowed(id('a')) && !mask.is_allowed(id('b')) && !mask.is_allowed(end));
        assert!(matches!(m.consume(id('a')), After::Going));
        let mask = m.mask().unwrap();
        assert!(mask.is_allowed(id('b')) && !mask.is_allowed(end) && !mask.is_allowed(id('a')));
        assert!(matches!(m.consume(id('b')), After::Going));
        let mask = m.mask().unwrap();
        assert!(mask.is_allowed(id('b')) && mask.is_allowed(end));
        assert!(m.is_end(end));
        // A fixed string is complete after its last byte.
        let mut m = Guided::new(&g, &Constraint::Regex("ok".into()), &[]).unwrap();
        m.mask().unwrap();
        assert!(matches!(m.consume(id('o')), After::Going));
        m.mask().unwrap();
        assert!(matches!(m.consume(id('k')), After::Done));
    }

    #[test]
    fn the_end_moves_onto_the_requests_stop_ids() {
        let g = tiny();
        let stop = id('!');
        let mut m = Guided::new(&g, &Constraint::Regex("[a!]*".into()), &[stop]).unwrap();
        let mask = m.mask().unwrap();
        assert!(mask.is_allowed(stop), "the grammar accepts the empty text: the stop id may end it");
        assert!(!mask.is_allowed(g.eos[0]), "the trie's own end is not the request's");
        let mut m = Guided::new(&g, &Constraint::Regex("a!a".into()), &[stop]).unwrap();
        m.mask().unwrap();
        m.consume(id('a'));
        assert!(m.mask().unwrap().is_allowed(stop), "the grammar wants the stop id's text");
        assert!(!m.is_end(stop), "so it is text, not the end");
        assert!(matches!(m.consume(stop), After::Going));
    }

    #[test]
    fn an_end_id_the_grammar_wants_as_text_is_text() {
        let g = tiny();
        let end = g.eos[0];
        let mut m = Guided::new(&g, &Constraint::Grammar(format!("start: \"a\" <[{end}]> \"b\"")), &[]).unwrap();
        m.mask().unwrap();
        assert!(matches!(m.consume(id('a')), After::Going));
        assert!(m.mask().unwrap().is_allowed(end));
        assert!(!m.is_end(end), "the grammar is not complete: the end id is its text");
        assert!(matches!(m.consume(end), After::Going));
        assert!(m.mask().unwrap().is_allowed(id('b')));
        assert!(matches!(m.consume(id('b')), After::Done));
    }

    /// Masks from the worker thread are the masks computed inline.
    #[test]
    fn the_worker_gives_the_inline_masks() {
        let g = tiny();
        let schema = r#"{"type": "object", "properties": {"k": {"enum": ["ab", "b c"]}, "n": {"type": "integer"}}}"#;
        let run = |worker: bool| {
            let c = Constraint::JsonSchema(schema.into());
            let mut m = Guided::with_worker(&g, &c, &[], worker).unwrap();
            let mut seen = Vec::new();
            for step in 0..40 {
                let Some(mask) = m.mask() else { break };
                let allowed = mask.to_list();
                // The lowest allowed id, now and then another one.
                let t = if step % 5 == 4 { allowed[allowed.len() / 2] } else { allowed[0] };
                seen.push((allowed, t));
                if m.is_end(t) || matches!(m.consume(t), After::Done) {
                    break;
                }
            }
            seen
        };
        let inline = run(false);
        assert!(inline.len() > 3);
        assert_eq!(run(true), inline);
    }

    #[test]
    fn bad_and_empty_constraints_are_invalid_input() {
        let g = tiny();
        for c in [
            Constraint::JsonSchema("{not json".into()),
            Constraint::JsonSchema(r#"{"type": "no-such-type"}"#.into()),
            Constraint::Regex("(".into()),
            Constraint::Grammar("start: undefined_rule".into()),
            Constraint::Grammar("start: A\nA: /a/ & /b/".into()),
        ] {
            let err = Guided::new(&g, &c, &[]).unwrap_err();
            assert!(matches!(&err, Error::InvalidInput(m) if m.starts_with(c.what())), "{c:?}: {err}");
        }
        let empty = Guided::new(&g, &Constraint::Grammar("start: A\nA: /a/ & /b/".into()), &[]).unwrap_err();
        assert!(empty.to_string().contains("matches no text"), "{empty}");
        // A vocabulary without the characters JSON needs cannot start an object.
        let no_brace = Guided::new(&g, &Constraint::Regex("\u{e9}+".into()), &[]).unwrap_err();
        assert!(no_brace.to_string().contains("matches no text"), "{no_brace}");
    }

    #[test]
    fn a_json_schema_is_compact_unless_it_says_otherwise() {
        let g = tiny();
        let schema = r#"{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}"#;
        let mut m = Guided::new(&g, &Constraint::JsonSchema(schema.into()), &[]).unwrap();
        let mut out = String::new();
        for c in "{\"a\": 12}".chars() {
            let mask = m.mask().unwrap();
            assert!(mask.is_allowed(id(c)), "{c:?} after {out:?}");
            out.push(c);
            if let After::Done = m.consume(id(c)) {
                break;
            }
        }
        assert_eq!(out, "{\"a\": 12}");
        let mut m = Guided::new(&g, &Constraint::JsonSchema(schema.into()), &[]).unwrap();
        m.mask().unwrap();
        m.consume(id('{'));
        assert!(!m.mask().unwrap().is_allowed(id(' ')), "no whitespace before the key");
    }
}
