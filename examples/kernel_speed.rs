//! Speed of each kernel on a matrix (L2-resident by default):
//! `cargo run --release --example kernel_speed -- [TOKENS] [DTYPE] [ROWS] [THREADS] [COLS]`
//! (default 1: decode; prefill-like counts such as 64 exercise the tiles; ROWS
//! default 256, e.g. 262144 for a matrix far past the caches, as decode reads
//! an output head; THREADS default 1, the kernel alone on one core, else the
//! engine's row split over a pool of that many threads; COLS default 2048,
//! the hidden width of the OLMoE and Qwen3-30B-A3B bench models, 4096 for
//! Mixtral's or Qwen3's attention output; a multiple of 32; each type skips
//! a shape it cannot hold). Reports ns per 32 weights and token,
//! multiply-adds per second and weight bytes per second.
//! The matrix lies on 2 MiB pages where the OS gives them (Linux), as the
//! engine's weights do; a stream over 4 KiB pages is slower.
//!
//! DTYPE `delta` times the gated delta rule's recurrent step instead:
//! ROWS heads (default 32) of COLS × COLS state (default 128: Qwen3.6's
//! 32 value heads of 128, 2 MiB), one after another on one thread, with one
//! decay per head and one per key channel; it reports ns per head-step and
//! the state bytes read and written per second, beside a copy of the same
//! footprint (half of it to the other half) as the memory system's pace.

use std::time::Instant;

use colibri::kernels::{Input, Matrix, matmul, matmul_serial};
use colibri::quant::act::BlockQ8;
use colibri::quant::{self, DType};

fn main() {
    let rows: usize = std::env::args().nth(3).and_then(|s| s.parse().ok()).unwrap_or(256);
    let cols: usize = std::env::args().nth(5).and_then(|s| s.parse().ok()).unwrap_or(2048);
    assert!(cols > 0 && cols.is_multiple_of(32), "COLS must be a positive multiple of 32, got {cols}");
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    if std::env::args().nth(2).as_deref() == Some("delta") {
        let heads = std::env::args().nth(3).and_then(|s| s.parse().ok()).unwrap_or(32);
        let width = std::env::args().nth(5).and_then(|s| s.parse().ok()).unwrap_or(128);
        return delta_speed(heads, width);
    }
    let prefetch = colibri::kernels::one_token_prefetch().map(|b| format!(", one-token streams prefetch {b} B ahead"));
    eprintln!("kernels: {}, {n} token(s){}", colibri::kernels::isa(), prefetch.unwrap_or_default());
    // A tall matrix repeats one encoded tile of up to 256 rows (the speed
    // does not depend on the values, and the super-block quantisers would
    // take minutes over a quarter of a billion of them).
    let tile_rows = rows.min(256);
    let vals: Vec<f32> = (0..tile_rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.05).collect();
    let x: Vec<f32> = (0..n * cols).map(|i| (i * 31 % 100) as f32 / 50.0 - 1.0).collect();
    let only = std::env::args().nth(2);
    let threads: usize = std::env::args().nth(4).and_then(|s| s.parse().ok()).unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    for dtype in
        DType::ALL.into_iter().chain(DType::INTERLEAVED).filter(|d| only.as_ref().is_none_or(|o| o == d.name()))
    {
        let Some(nbytes) = dtype.tensor_bytes(&[rows, cols]) else {
            eprintln!("{dtype:>7}: skipped ({rows} rows of {cols} columns do not fit its blocks or groups)");
            continue;
        };
        // On 2 MiB pages where the OS gives them, as the engine's weights
        // are (a file mapped from the page cache, or its expert slots).
        let mut buf = memmap2::MmapMut::map_anon(nbytes.max(1)).expect("map the matrix");
        #[cfg(target_os = "linux")]
        let _ = buf.advise(memmap2::Advice::HugePage);
        let bytes = &mut buf[..nbytes];
        let tile = dtype.row_bytes(cols).unwrap() * tile_rows;
        quant::encode(dtype, &vals, cols, &mut bytes[..tile]);
        for at in (tile..nbytes).step_by(tile) {
            bytes.copy_within(..tile.min(nbytes - at), at);
        }
        let m = Matrix::new(dtype, rows, cols, bytes).unwrap();
        let mut q = vec![BlockQ8::default(); n * cols / 32];
        let inp = Input::prepare(&x, cols, dtype.is_quantized(), &mut q);
        let mut y = vec![0f32; n * rows];
        let reps = (400 * 256 / rows / n).max(4);
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                if threads == 1 {
                    matmul_serial(&m, &inp, &mut y);
                } else {
                    pool.install(|| matmul(&m, &inp, &mut y));
                }
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        let blocks = (rows * cols / 32 * reps * n) as f64;
        println!(
            "{dtype:>7}: {:.3} ns / 32 weights / token, {:.1} GMAC/s, {:.1} GB/s of weights",
            best / blocks * 1e9,
            blocks * 32.0 / best / 1e9,
            (nbytes * reps) as f64 / best / 1e9
        );
    }
}

/// The delta-rule step over `heads` heads of `[width, width]` state: the
/// best of many short windows (a few ms each), so a busy machine's
/// preemptions fall in the windows that are thrown away.
fn delta_speed(heads: usize, width: usize) {
    const WINDOWS: usize = 40;
    let step = colibri::kernels::delta_fn();
    eprintln!("kernels: {}, delta rule: {heads} heads of {width} x {width}", colibri::kernels::isa());
    let hs = width * width;
    let mut state: Vec<f32> = (0..heads * hs).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
    let unit = |seed: usize, scale: f32| -> Vec<f32> {
        let x: Vec<f32> = (0..width).map(|i| ((i * 31 + seed * 17) % 100) as f32 / 50.0 - 1.0).collect();
        let norm = x.iter().map(|a| a * a).sum::<f32>().sqrt();
        x.iter().map(|a| a / norm * scale).collect()
    };
    let (k, q) = (unit(1, 1.0), unit(2, 1.0 / (width as f32).sqrt()));
    let v: Vec<f32> = (0..width).map(|i| (i * 13 % 100) as f32 / 50.0 - 1.0).collect();
    let mut out = vec![0f32; width];
    let bytes = (2 * heads * hs * 4) as f64; // the state read and written once per step
    let reps = (8 * 1024 * 1024 / (heads * hs * 4)).max(2);
    for (name, decay) in [("one decay per head", vec![0.97f32]), ("one per key channel", vec![0.97f32; width])] {
        let mut best = f64::MAX;
        for _ in 0..WINDOWS {
            let t = Instant::now();
            for _ in 0..reps {
                for s in state.chunks_exact_mut(hs) {
                    step(s, &decay, &k, &v, 0.5, &q, &mut out);
                }
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        let per = best / (reps * heads) as f64;
        println!(
            "  delta ({name}): {:.0} ns / head-step, {:.1} GB/s of state (read + write)",
            per * 1e9,
            bytes * reps as f64 / best / 1e9
        );
    }
    let half = heads * hs / 2;
    let mut best = f64::MAX;
    for _ in 0..WINDOWS {
        let t = Instant::now();
        for r in 0..reps {
            let (a, b) = state.split_at_mut(half);
            if r % 2 == 0 { b[..half].copy_from_slice(a) } else { a.copy_from_slice(&b[..half]) }
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "  copy of the same footprint: {:.1} GB/s (read + write)",
        (2 * half * 4) as f64 * reps as f64 / best / 1e9
    );
}
