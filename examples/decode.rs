//! Quick decode/prefill timing on a synthetic model of real MoE widths.
//!
//! ```text
//! cargo run --release --example decode -- [olmoe|qwen3|dsv2lite|gptoss] [DTYPE] [LAYERS] [THREADS] [TOKENS] [PROMPT]
//! ```
//!
//! The model is written once to `.cache/synth/` (random weights, so routing is
//! near uniform: a fair test of expert streaming, not of cache locality).
//! The side-by-side comparison with llama.cpp lives in `benches/`.

use std::path::PathBuf;
use std::time::Instant;

use colibri::engine::never;
use colibri::model::forward::Capture;
use colibri::quant::DType;
use colibri::{Engine, EngineOptions};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let shape = args.first().map(String::as_str).unwrap_or("olmoe");
    let dtype = DType::parse(args.get(1).map(String::as_str).unwrap_or("q8_0")).expect("unknown dtype");
    let layers: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(4);
    let threads: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(2);
    let tokens: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(32);
    let prompt_len: u32 = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(64);
    let cfg = match shape {
        "olmoe" => colibri::synth::olmoe_width(layers),
        "qwen3" => colibri::synth::qwen3_30b_width(layers),
        "dsv2lite" => colibri::synth::deepseek_v2_lite_width(layers),
        "gptoss" => colibri::synth::gpt_oss_20b_width(layers),
        other => panic!("unknown shape {other}"),
    };
    let dir = PathBuf::from(".cache/synth");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{shape}-{layers}l-{dtype}.colibri"));
    if !path.exists() {
        let t = Instant::now();
        let tmp = path.with_extension("partial");
        let _ = std::fs::remove_file(&tmp);
        colibri::synth::write_random_model(&tmp, &cfg, dtype, 1);
        std::fs::rename(&tmp, &path).unwrap();
        eprintln!("wrote {} in {:.1?}", path.display(), t.elapsed());
    }
    let t = Instant::now();
    let engine = Engine::open(&path, &EngineOptions { threads: Some(threads), ..Default::default() }).unwrap();
    eprintln!("open: {:.1?}, kernels: {:?}", t.elapsed(), colibri::kernels::isa());
    let prompt: Vec<u32> = (0..prompt_len).map(|i| (i * 7919) % cfg.vocab_size as u32).collect();
    for round in 0..3 {
        let mut s = engine.session(prompt.len() + tokens + 1);
        let t = Instant::now();
        engine.run(&mut s, &prompt, Capture::default(), &never).unwrap();
        let prefill = t.elapsed();
        let t = Instant::now();
        let mut next = colibri::engine::sampling::argmax(&s.seq.logits);
        for _ in 0..tokens {
            engine.run(&mut s, &[next], Capture::default(), &never).unwrap();
            next = colibri::engine::sampling::argmax(&s.seq.logits);
        }
        let decode = t.elapsed();
        println!(
            "{shape} {dtype} {layers}L {threads}T round {round}: prefill {} tok in {:.1?} ({:.1} tok/s), decode {:.1} tok/s",
            prompt.len(),
            prefill,
            prompt.len() as f64 / prefill.as_secs_f64(),
            tokens as f64 / decode.as_secs_f64()
        );
    }
}
