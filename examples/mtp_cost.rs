//! What drafting with a multi-token-prediction (MTP) layer costs, against
//! the decode pass it is meant to save, and the speed-up that projects to
//! for a given acceptance rate. Random-weight models accept no drafts, so
//! the gain itself cannot be measured on them; what it costs can.
//!
//! ```text
//! cargo run --release --example mtp_cost -- MODEL IDS.json [REPS] [DEPTH]
//! ```
//!
//! `MODEL` must hold an MTP layer (`colibri convert --keep-mtp`); `IDS.json`
//! is the prompt as a JSON array of token ids. At the prompt's end, in
//! `REPS` rounds (default 7; every measurement once a round, so a change
//! in the machine's load falls on all of them alike), it times:
//!
//! - `t(n)`: a pass of `n` = 1..9 tokens of a sequence that does not draft
//!   (`t(1)` is plain decoding's cost per token);
//! - `draft(k)`: one `mtp_draft` call of `k` = 1..8 steps (each step is the
//!   MTP decoder layer and the output head over one row);
//! - `verify(1 + k)`: the pass that checks `k` drafts on a drafting
//!   sequence, which also runs the MTP layer (not its head) over the `k` rows
//!   it now has the next token of;
//! - `cycle(k)`: `draft(k)` then `verify(1 + k)`, timed together: one step
//!   of `speculative="mtp"` for a single sequence;
//! - `head(n)`: the output head alone over `n` rows.
//!
//! and prints medians, then for per-draft acceptance rates `p` the
//! projected speed-up of each `k`: with `a = 1 + p + p² + … + p^k` tokens
//! per step, `a · t(1) / cycle(k)`, and the simpler
//! `a · t(1) / (t(1 + k) + k · draft(1))`. With `DEPTH` (> 0) it also projects to
//! a model of that many layers, scaling what the model's own layers cost
//! (`t(n) − head(n)`) by `DEPTH / layers` and keeping the draft step's cost.

use std::time::Instant;

use colibri::kernels::matmul;
use colibri::model::forward::{Segment, forward_batch, mtp_draft};
use colibri::model::session::{DEFAULT_CHUNK, Sequence, Workspace};
use colibri::{Engine, EngineOptions};

const MAX_DRAFTS: usize = 8;
const RATES: [f64; 4] = [0.5, 0.7, 0.8, 0.9];

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Expected tokens a step yields with `k` drafts each accepted with
/// probability `p` until the first rejection: `1 + p + … + p^k`.
fn tokens_per_step(p: f64, k: usize) -> f64 {
    (0..=k).map(|i| p.powi(i as i32)).sum()
}

/// Median timings in ms, indexed by token or draft count.
struct Costs {
    pass: Vec<f64>,   // [n] for n in 0..=9 (0 unused)
    draft: Vec<f64>,  // [k] for k in 0..=8 (0 unused)
    verify: Vec<f64>, // [k]: verify(1 + k)
    cycle: Vec<f64>,  // [k]
    head: Vec<f64>,   // [n] for n in 0..=9 (0 unused)
}

impl Costs {
    /// The costs of a model of `depth` layers instead of `layers`: its own
    /// layers' share of each pass scaled, the drafts' steps as they are.
    fn deeper(&self, layers: usize, depth: usize) -> Costs {
        let f = depth as f64 / layers as f64;
        let pass: Vec<f64> = (0..self.pass.len())
            .map(|n| if n == 0 { 0.0 } else { self.head[n] + f * (self.pass[n] - self.head[n]) })
            .collect();
        let grow = |k: usize| pass[1 + k] - self.pass[1 + k];
        Costs {
            verify: (0..self.verify.len()).map(|k| if k == 0 { 0.0 } else { self.verify[k] + grow(k) }).collect(),
            cycle: (0..self.cycle.len()).map(|k| if k == 0 { 0.0 } else { self.cycle[k] + grow(k) }).collect(),
            draft: self.draft.clone(),
            head: self.head.clone(),
            pass,
        }
    }

    fn print(&self, title: &str) {
        let (t1, step) = (self.pass[1], self.draft[1]);
        println!("\n### {title}\n");
        println!("t(1) = {t1:.3} ms (a decode pass), one draft step = {step:.3} ms = {:.3} t(1)\n", step / t1);
        println!("| k | t(1+k) ms | draft(k) ms | per step / t(1) | verify(1+k) ms | cycle(k) ms | cycle / t(1) |");
        println!("|---|---|---|---|---|---|---|");
        for k in 1..=MAX_DRAFTS {
            println!(
                "| {k} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} |",
                self.pass[1 + k],
                self.draft[k],
                self.draft[k] / k as f64 / t1,
                self.verify[k],
                self.cycle[k],
                self.cycle[k] / t1
            );
        }
        println!(
            "\nProjected speed-up over plain decoding, a · t(1) / cycle(k) (in brackets: a · t(1) / (t(1+k) + k · draft(1))):\n"
        );
        print!("| p |");
        (1..=MAX_DRAFTS).for_each(|k| print!(" k={k} |"));
        println!(" best k |");
        println!("|---|{}---|", "---|".repeat(MAX_DRAFTS));
        for p in RATES {
            print!("| {p} |");
            let mut best = (0, 1.0);
            for k in 1..=MAX_DRAFTS {
                let a = tokens_per_step(p, k);
                let measured = a * t1 / self.cycle[k];
                let formula = a * t1 / (self.pass[1 + k] + k as f64 * self.draft[1]);
                if measured > best.1 {
                    best = (k, measured);
                }
                print!(" {measured:.2}x ({formula:.2}x) |");
            }
            if best.0 == 0 {
                println!(" none (plain decoding is faster) |");
            } else {
                println!(" {} ({:.2}x) |", best.0, best.1);
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(model), Some(ids)) = (args.first(), args.get(1)) else {
        eprintln!("usage: mtp_cost MODEL IDS.json [REPS] [DEPTH]");
        std::process::exit(2);
    };
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(7).max(1);
    let depth: Option<usize> = args.get(3).and_then(|s| s.parse().ok()).filter(|&d| d > 0);
    let prompt: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(ids).expect("the ids file")).expect("ids");
    assert!(prompt.len() >= 2, "a prompt of at least two tokens");
    let e = Engine::open(model.as_ref(), &EngineOptions::default()).expect("the model");
    let m = e.model();
    let c = &m.config;
    let (d, vocab, layers) = (c.hidden_size, c.vocab_size, c.main_layers());
    assert!(m.mtp.is_some(), "{model} holds no multi-token-prediction layer: convert with --keep-mtp");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(e.threads()).build().expect("a pool");
    let rows = 1 + MAX_DRAFTS;
    let mut ws = Workspace::new(m, DEFAULT_CHUNK, rows);
    let cap = prompt.len() + rows + 8;
    // A sequence that does not draft (plain decoding) and one that does.
    let mut plain = Sequence::new(m, cap, DEFAULT_CHUNK, e.kv_dtype());
    let mut drafting = Sequence::new(m, cap, DEFAULT_CHUNK, e.kv_dtype());
    drafting.enable_mtp(m).expect("a model with the layer");
    let n0 = prompt.len() - 1;
    let last = prompt[n0];
    for seq in [&mut plain, &mut drafting] {
        seq.allow_logit_rows(rows);
        let mut segs = [Segment { seq, tokens: &prompt[..n0], end: n0, logit_rows: 1 }];
        forward_batch(m, &mut ws, &mut segs, Some(&pool)).expect("the prompt");
    }
    let pass = |ws: &mut Workspace, seq: &mut Sequence, toks: &[u32]| {
        let mut segs = [Segment { seq, tokens: toks, end: toks.len(), logit_rows: toks.len() }];
        forward_batch(m, ws, &mut segs, Some(&pool)).expect("a pass");
    };
    let mut drafts = Vec::with_capacity(MAX_DRAFTS);
    let draft = |ws: &mut Workspace, seq: &mut Sequence, k: usize, out: &mut Vec<u32>| {
        mtp_draft(m, ws, seq, last, k, out, None, Some(&pool)).expect("a draft");
        assert_eq!(out.len(), k, "the layer drafted");
    };
    let head_in = vec![0.05f32; rows * d];
    let mut head_out = vec![0.0f32; rows * vocab];

    let mut t_pass = vec![Vec::new(); rows + 1];
    let mut t_draft = vec![Vec::new(); MAX_DRAFTS + 1];
    let mut t_verify = vec![Vec::new(); MAX_DRAFTS + 1];
    let mut t_cycle = vec![Vec::new(); MAX_DRAFTS + 1];
    let mut t_head = vec![Vec::new(); rows + 1];
    // The passes' tokens: the prompt's last ones again, then its first.
    let inputs: Vec<Vec<u32>> = (1..=rows).map(|n| (0..n).map(|i| prompt[(n0 + i) % prompt.len()]).collect()).collect();
    // One untimed round first: page the weights in and warm the caches.
    for round in 0..=reps {
        let keep = round > 0;
        for (times, toks) in t_pass[1..].iter_mut().zip(&inputs) {
            plain.truncate(n0).expect("back to the prompt");
            let t = Instant::now();
            pass(&mut ws, &mut plain, toks);
            let ms = ms_since(t);
            if keep {
                times.push(ms);
            }
        }
        for k in 1..=MAX_DRAFTS {
            drafting.truncate(n0).expect("back to the prompt");
            let t = Instant::now();
            draft(&mut ws, &mut drafting, k, &mut drafts);
            let ms = ms_since(t);
            let feed: Vec<u32> = std::iter::once(last).chain(drafts.iter().copied()).collect();
            let t = Instant::now();
            pass(&mut ws, &mut drafting, &feed);
            let verify = ms_since(t);
            drafting.truncate(n0).expect("back to the prompt");
            let t = Instant::now();
            draft(&mut ws, &mut drafting, k, &mut drafts);
            pass(&mut ws, &mut drafting, &feed);
            let cycle = ms_since(t);
            if keep {
                t_draft[k].push(ms);
                t_verify[k].push(verify);
                t_cycle[k].push(cycle);
            }
        }
        for n in [1, 2, 3, 5, rows] {
            let t = Instant::now();
            pool.install(|| {
                matmul(&m.mat(m.head().1), &ws.xq.prepare(&head_in[..n * d], d), &mut head_out[..n * vocab])
            });
            let ms = ms_since(t);
            if keep {
                t_head[n].push(ms);
            }
        }
    }
    // The head's rows not timed: interpolated (it is nearly flat in n).
    let mut head = vec![0.0; rows + 1];
    for n in 1..=rows {
        head[n] = if t_head[n].is_empty() { 0.0 } else { median(&t_head[n]) };
    }
    for n in 1..=rows {
        if head[n] == 0.0 {
            let lo = (1..n).rev().find(|&i| head[i] > 0.0).expect("head(1) is timed");
            let hi = (n + 1..=rows).find(|&i| head[i] > 0.0).expect("head(9) is timed");
            head[n] = head[lo] + (head[hi] - head[lo]) * (n - lo) as f64 / (hi - lo) as f64;
        }
    }
    let med = |v: &[Vec<f64>]| -> Vec<f64> { v.iter().map(|x| if x.is_empty() { 0.0 } else { median(x) }).collect() };
    let costs = Costs { pass: med(&t_pass), draft: med(&t_draft), verify: med(&t_verify), cycle: med(&t_cycle), head };
    println!(
        "{model}: {layers} layers + the MTP layer, D = {d}, vocabulary {vocab}, {} threads, prompt of {} tokens, \
         medians of {reps} rounds",
        e.threads(),
        prompt.len()
    );
    println!("\nOutput head alone: {:.3} ms for 1 row, {:.3} ms for {rows}", costs.head[1], costs.head[rows]);
    costs.print(&format!("As measured ({layers} layers)"));
    if let Some(depth) = depth {
        costs.deeper(layers, depth).print(&format!("Projected to {depth} layers (the draft step's cost as measured)"));
    }
}
