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

use std::time::Instant;

use colibri::kernels::{Input, Matrix, matmul, matmul_serial};
use colibri::quant::act::BlockQ8;
use colibri::quant::{self, DType};

fn main() {
    let rows: usize = std::env::args().nth(3).and_then(|s| s.parse().ok()).unwrap_or(256);
    let cols: usize = std::env::args().nth(5).and_then(|s| s.parse().ok()).unwrap_or(2048);
    assert!(cols > 0 && cols.is_multiple_of(32), "COLS must be a positive multiple of 32, got {cols}");
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1);
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
