//! Speed of attention over an f16 KV cache, as one sequence's decode step or
//! prefill chunk calls it:
//! `cargo run --release --example attention_speed -- [CTX] [TOKENS] [HEADS] [KV_HEADS] [HEAD_DIM] [THREADS] [CACHES]`
//! (defaults 128 1 16 16 128 1 1: one decode token of the OLMoE width at a
//! context of 128; 32 4 128 is the Qwen3-30B-A3B width). The last TOKENS
//! positions of the CTX cached ones are the queries. CACHES distinct caches
//! are attended to in turn, as a batched decode step goes through its
//! sequences and layers: enough of them (64 at the defaults) that each call
//! finds its cache out of the CPU's caches, as serving does; one keeps it
//! warm. Reports µs per call, multiply-adds per second (scores and value
//! sums) and cache bytes read per second.

use std::time::Instant;

use colibri::model::blocks::attention::{Heads, KvView, attend};
use colibri::quant::DType;

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let (ctx, t, h, hkv, dh, threads) = (arg(1, 128), arg(2, 1), arg(3, 16), arg(4, 16), arg(5, 128), arg(6, 1));
    let caches = arg(7, 1).max(1);
    assert!(
        t >= 1 && t <= ctx && hkv >= 1 && h.is_multiple_of(hkv),
        "want 1 <= TOKENS <= CTX and KV_HEADS dividing HEADS"
    );
    let row = hkv * dh;
    let mut cache = vec![0u8; 4 * ctx * row * caches];
    for (i, v) in cache.chunks_exact_mut(2).enumerate() {
        v.copy_from_slice(&half::f16::from_f32(((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.5).to_le_bytes());
    }
    // Cache c's keys and values: the two halves of its share (f16: 2
    // bytes), head by head as the engine's cache holds them, or, with
    // POSITION_MAJOR set, all heads of a position side by side.
    let bytes = 2 * ctx * row;
    let (k_row, k_head) = if std::env::var_os("POSITION_MAJOR").is_some() { (row, dh) } else { (dh, ctx * dh) };
    let kv = |c: usize| {
        let (k, v) = cache[2 * c * bytes..2 * (c + 1) * bytes].split_at(bytes);
        KvView { dtype: DType::F16, k, v, k_row, v_row: k_row, k_head, v_head: k_head, base: 0 }
    };
    let q: Vec<f32> = (0..t * h * dh).map(|i| (i * 31 % 100) as f32 / 50.0 - 1.0).collect();
    let (mut scratch, mut out) = (vec![0f32; t * h * dh], vec![0f32; t * h * dh]);
    let heads =
        Heads { h, hkv, dk: dh, dv: dh, window: None, scale: 1.0 / (dh as f32).sqrt(), sinks: None, temperature: None };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let reps = (400_000_000 / (ctx * t * h * dh)).max(8).next_multiple_of(caches);
    let mut best = f64::MAX;
    pool.install(|| {
        for _ in 0..7 {
            let start = Instant::now();
            for r in 0..reps {
                attend(&q, kv(r % caches), ctx - t, heads, &mut scratch, &mut out);
            }
            best = best.min(start.elapsed().as_secs_f64() / reps as f64);
        }
    });
    // Query at position p reads p + 1 keys and values.
    let seen: usize = (ctx - t..ctx).map(|p| p + 1).sum();
    let macs = (seen * h * dh * 2) as f64;
    println!(
        "ctx {ctx}, {t} token(s), {h}/{hkv} heads of {dh}, {threads} thread(s): {:.2} µs, {:.1} GMAC/s, {:.1} GB/s of cache",
        best * 1e6,
        macs / best / 1e9,
        (2 * ctx * row * 2) as f64 / best / 1e9
    );
}
