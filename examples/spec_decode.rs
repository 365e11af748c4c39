//! Speculative decoding at the engine, without Python: decode tokens/s of
//! one sequence and the cost of a verification pass.
//!
//! ```text
//! cargo run --release --example spec_decode -- MODEL IDS.json [TOKENS] [DRAFTS] [REPS]
//! ```
//!
//! `IDS.json` is the prompt as a JSON array of token ids. For each draft
//! length in `DRAFTS` (comma-separated, 0 = no speculation) it prints the
//! median over `REPS` runs of greedy decode tokens/s through the scheduler
//! and the tokens per pass. Then it times single passes of 1 to 9 tokens
//! at the prompt's end (what verifying 0 to 8 drafts costs) against a pass
//! of one: with `a` tokens per pass, speculation gains `a · t(1) / t(1 + k)`.

use std::time::Instant;

use colibri::engine::{BatchOptions, Drafts, GenerateOptions, Scheduler, Speculation, never};
use colibri::model::forward::{Segment, forward_batch};
use colibri::model::session::{DEFAULT_CHUNK, Sequence, Workspace};
use colibri::{Engine, EngineOptions};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(model), Some(ids)) = (args.first(), args.get(1)) else {
        eprintln!("usage: spec_decode MODEL IDS.json [TOKENS] [DRAFTS] [REPS]");
        std::process::exit(2);
    };
    let tokens: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(128);
    let drafts: Vec<usize> =
        args.get(3).map_or("0,4,8", String::as_str).split(',').map(|s| s.parse().expect("a draft length")).collect();
    let reps: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(5);
    let prompt: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(ids).expect("the ids file")).expect("ids");
    let e = Engine::open(model.as_ref(), &EngineOptions::default()).expect("the model");
    let sched = Scheduler::new(&e, BatchOptions::default()).expect("a scheduler");
    println!("| drafts | decode tok/s | tokens per pass |\n|---|---|---|");
    for &k in &drafts {
        let speculation = (k > 0).then_some(Speculation { drafts: Drafts::Ngram, tokens: k });
        let opts = GenerateOptions { max_new_tokens: tokens, speculation, ..Default::default() };
        let (mut rates, mut per_pass) = (Vec::new(), 0.0);
        for _ in 0..reps {
            let mut t = sched.submit(&prompt, &opts).expect("a request");
            while t.next_token(&never).expect("a token").is_some() {}
            let tm = t.timings();
            rates.push(tm.decode_tokens_per_second());
            per_pass = (tm.generated_tokens - 1) as f64 / tm.decode_passes.max(1) as f64;
        }
        println!("| {k} | {:.1} | {per_pass:.2} |", median(rates));
    }
    // One pass of 1 + k tokens at the prompt's end, timed alone.
    let m = e.model();
    let mut seq = Sequence::new(m, prompt.len() + 16, DEFAULT_CHUNK, e.kv_dtype());
    seq.allow_logit_rows(9);
    let mut ws = Workspace::new(m, DEFAULT_CHUNK, 9);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(e.threads()).build().expect("a pool");
    let n0 = prompt.len() - 1;
    let mut pass = |seq: &mut Sequence, toks: &[u32], rows: usize| {
        let mut segs = [Segment { seq, tokens: toks, end: toks.len(), logit_rows: rows }];
        forward_batch(m, &mut ws, &mut segs, Some(&pool)).expect("a pass");
    };
    pass(&mut seq, &prompt[..n0], 1);
    println!("\n| tokens in the pass | ms per pass | vs one token |\n|---|---|---|");
    let mut one = 0.0;
    for n in 1..=9usize {
        let toks: Vec<u32> = (0..n).map(|i| prompt[(n0 + i) % prompt.len()]).collect();
        let mut times = Vec::new();
        for _ in 0..reps.max(3) {
            seq.truncate(n0).expect("back to the prompt");
            let t = Instant::now();
            pass(&mut seq, &toks, n);
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let ms = median(times);
        if n == 1 {
            one = ms;
        }
        println!("| {n} | {ms:.2} | {:.2}x |", ms / one);
    }
}
