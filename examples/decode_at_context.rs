//! Decode speed of one sequence at a long context, without paying for a long
//! prefill each run:
//! `cargo run --release --example decode_at_context -- MODEL.colibri CTX [TOKENS] [THREADS] [FILL]`
//! (defaults 16 new tokens, 2 threads, a real prefill of FILL = 256 tokens).
//!
//! The sequence is prefilled with FILL real tokens; then every layer's cache
//! rows (MLA latents and a DSA layer's index keys: latent-attention models;
//! a pooled layer's entries and index keys: DeepSeek-V4) of those positions
//! are copied, in order and over and over, into positions FILL..CTX, and the
//! sequence's position is set to CTX (FILL and CTX whole multiples of the
//! largest pool rate, 128, for pooled layers, so the window and the
//! unfinished blocks are where they would be). The next TOKENS
//! greedy tokens are timed one by one. A decode step then does exactly the
//! work of one at CTX: it reads CTX cache rows per layer (a DSA layer scores
//! CTX index keys and attends to its `index_topk` picks), whatever the rows
//! hold; only the values are repeats of the first FILL. With FILL = CTX the
//! run is an ordinary prefill of CTX tokens followed by decode (the check
//! that the copies change nothing in the timing).
//!
//! Prints one JSON line: context, fill, prefill seconds, decode tokens and
//! seconds, median step time.

use std::path::PathBuf;
use std::time::Instant;

use colibri::canonical::config::MixerSpec;
use colibri::engine::never;
use colibri::model::blocks::attention::KvView;
use colibri::model::forward::Capture;
use colibri::quant::DType;
use colibri::{Engine, EngineOptions};

/// Rows `0..n` of a one-head cache view (`k_row` values each) as f32.
fn rows_f32(view: &KvView, n: usize) -> Vec<f32> {
    let w = view.k_row;
    match view.dtype {
        DType::F16 => {
            view.k[..n * w * 2].chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
        }
        DType::F32 => bytemuck::cast_slice::<u8, f32>(&view.k[..n * w * 4]).to_vec(),
        other => panic!("a cache of {other}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = PathBuf::from(args.first().expect("MODEL.colibri"));
    let arg = |i: usize, default: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let (ctx, tokens, threads) = (arg(1, 2048), arg(2, 16), arg(3, 2));
    let fill = arg(4, 256).min(ctx);
    let engine = Engine::open(&path, &EngineOptions { threads: Some(threads), ..Default::default() }).unwrap();
    let cfg = &engine.model().config;
    let vocab = cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..fill as u32).map(|i| 1000 + (i * 7919) % (vocab - 1000)).collect();
    let mut s = engine.session(ctx + tokens + 1);
    let t = Instant::now();
    engine.run(&mut s, &prompt, Capture::default(), &never).unwrap();
    let prefill_s = t.elapsed().as_secs_f64();
    if fill < ctx {
        for (l, layer) in cfg.layers.iter().enumerate() {
            if matches!(layer.mixer, MixerSpec::Pooled { .. }) {
                // The window ring is the same at CTX as at FILL (both whole
                // blocks); the pooled entries and index keys repeat.
                let st = s.seq.pooled(l);
                for p in st.pool.iter_mut().chain(st.index.iter_mut()) {
                    let n = ctx / p.rate();
                    p.repeat_to(n);
                }
                continue;
            }
            let own_keys = matches!(layer.mixer, MixerSpec::Sparse { shared: false });
            let sources: Vec<bool> = if own_keys { vec![false, true] } else { vec![false] };
            for index in sources {
                // MLA latents and index keys are one-head caches without values.
                let rows = {
                    let view = if index { s.seq.index_keys(l).view(fill) } else { s.seq.kv(l).view(fill) };
                    assert!(view.v_row == view.k_row && view.k_head >= ctx * view.k_row, "a one-head cache");
                    (rows_f32(&view, fill), view.k_row)
                };
                let (data, w) = rows;
                let mut pos = fill;
                while pos < ctx {
                    let n = fill.min(ctx - pos);
                    if index {
                        s.seq.index_keys(l).store(pos, &data[..n * w]);
                    } else {
                        s.seq.kv(l).store(pos, &data[..n * w], &[]);
                    }
                    pos += n;
                }
            }
        }
        s.seq.pos = ctx;
    }
    let mut next = colibri::engine::sampling::argmax(&s.seq.logits);
    let mut steps = Vec::with_capacity(tokens);
    let t = Instant::now();
    for _ in 0..tokens {
        let step = Instant::now();
        engine.run(&mut s, &[next], Capture::default(), &never).unwrap();
        next = colibri::engine::sampling::argmax(&s.seq.logits);
        steps.push(step.elapsed().as_secs_f64());
    }
    let decode_s = t.elapsed().as_secs_f64();
    steps.sort_by(f64::total_cmp);
    println!(
        "{{\"ctx\": {ctx}, \"fill\": {fill}, \"prefill_s\": {prefill_s:.4}, \"decode_tokens\": {tokens}, \
         \"decode_s\": {decode_s:.4}, \"median_step_s\": {:.5}, \"tok_s\": {:.3}, \"threads\": {threads}}}",
        steps[steps.len() / 2],
        tokens as f64 / decode_s
    );
}
