//! Speed of a decode step's routed experts alone, as the MoE block runs them:
//! `cargo run --release --example expert_speed -- [TOKENS] [THREADS] [EXPERTS] [TOP_K] [D] [F] [LAYERS]`
//! (defaults 8 2 64 8 2048 1024 16: eight decoding sequences on the OLMoE
//! width). Each layer's TOKENS tokens choose TOP_K distinct experts each at
//! random; the experts chosen run side by side, whole experts per thread,
//! each its gate and up projections over its tokens and then its down
//! projection, in q4_0 groups on 2 MiB pages. LAYERS layers of experts are
//! laid out one after another, far past the caches, so every step streams
//! them from memory as decode does. Reports the experts' bytes per second
//! beside the same bytes read as one tall matrix split by rows (the kernel's
//! streaming rate), so the gap is what running experts one by one costs.

use std::time::Instant;

use colibri::kernels::{Input, Matrix, matmul, matmul_serial};
use colibri::quant::act::BlockQ8;
use colibri::quant::{self, DType};

fn arg(i: usize, default: usize) -> usize {
    std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default)
}

struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// Runs experts `list` (expert, token count) on the pool, halving the list
/// under `rayon::join` (the engine halves by cost, rows + 2 an expert), each
/// expert on one thread. The down projection reads a fixed input: no
/// activation or re-quantising between, which the engine does.
fn run(list: &[(usize, usize)], mats: &[[Matrix; 3]], x: &Input, h: &Input, g: &mut [f32], o: &mut [f32], f: usize) {
    match list {
        [] => {}
        [(e, n)] => {
            let [gate, up, down] = &mats[*e];
            let (gg, uu) = g[..2 * n * f].split_at_mut(n * f);
            let xs = Input { x: &x.x[..n * x.cols], q: &x.q[..n * x.cols / 32], cols: x.cols };
            matmul_serial(gate, &xs, gg);
            matmul_serial(up, &xs, uu);
            let hs = Input { x: &h.x[..n * f], q: &h.q[..n * f / 32], cols: f };
            matmul_serial(down, &hs, &mut o[..n * x.cols]);
        }
        _ => {
            let (a, b) = list.split_at(list.len() / 2);
            let rows: usize = a.iter().map(|&(_, n)| n).sum();
            let (ga, gb) = g.split_at_mut(2 * rows * f);
            let (oa, ob) = o.split_at_mut(rows * x.cols);
            rayon::join(|| run(a, mats, x, h, ga, oa, f), || run(b, mats, x, h, gb, ob, f));
        }
    }
}

fn main() {
    let (tokens, threads, experts, top_k) = (arg(1, 8), arg(2, 2), arg(3, 64), arg(4, 8));
    let (d, f, layers) = (arg(5, 2048), arg(6, 1024), arg(7, 16));
    assert!(top_k <= experts && d % 32 == 0 && f % 32 == 0);
    let dtype = DType::INTERLEAVED.into_iter().find(|t| t.name() == "q4_0x8").expect("q4_0x8");
    let mat_bytes = dtype.tensor_bytes(&[f, d]).expect("shape fits q4_0 groups");
    let expert_bytes = 3 * mat_bytes;
    let total = expert_bytes * experts * layers;
    let mut buf = memmap2::MmapMut::map_anon(total).expect("map the experts");
    #[cfg(target_os = "linux")]
    let _ = buf.advise(memmap2::Advice::HugePage);
    // One encoded tile repeated (the speed does not depend on the values).
    let vals: Vec<f32> = (0..f * d).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.05).collect();
    quant::encode(dtype, &vals, d, &mut buf[..mat_bytes]);
    for at in (mat_bytes..total).step_by(mat_bytes) {
        buf.copy_within(..mat_bytes, at);
    }
    let mats: Vec<[Matrix; 3]> = buf
        .chunks_exact(expert_bytes)
        .map(|e| {
            let (gate, rest) = e.split_at(mat_bytes);
            let (up, down) = rest.split_at(mat_bytes);
            [
                Matrix::new(dtype, f, d, gate).unwrap(),
                Matrix::new(dtype, f, d, up).unwrap(),
                Matrix::new(dtype, d, f, down).unwrap(),
            ]
        })
        .collect();
    let x: Vec<f32> = (0..tokens * d).map(|i| (i * 31 % 100) as f32 / 50.0 - 1.0).collect();
    let hv: Vec<f32> = (0..tokens * f).map(|i| (i * 17 % 100) as f32 / 50.0 - 1.0).collect();
    let (mut qx, mut qh) = (vec![BlockQ8::default(); tokens * d / 32], vec![BlockQ8::default(); tokens * f / 32]);
    let xi = Input::prepare(&x, d, true, &mut qx);
    let hi = Input::prepare(&hv, f, true, &mut qh);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    // Scratch for every expert's rows side by side (each gets a disjoint slice).
    let mut g = vec![0f32; 2 * tokens * top_k * f];
    let mut o = vec![0f32; tokens * top_k * d];
    let mut rng = Lcg(7);
    let steps = 6;
    let (mut best, mut bytes, mut sum_t, mut sum_b) = (f64::MAX, 0usize, 0f64, 0usize);
    for _ in 0..steps {
        let mut step_bytes = 0;
        let t = Instant::now();
        for l in 0..layers {
            let mut count = vec![0usize; experts];
            for _ in 0..tokens {
                let mut chosen = Vec::with_capacity(top_k);
                while chosen.len() < top_k {
                    let e = rng.below(experts);
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                chosen.iter().for_each(|&e| count[e] += 1);
            }
            let list: Vec<(usize, usize)> =
                (0..experts).filter(|&e| count[e] > 0).map(|e| (l * experts + e, count[e])).collect();
            step_bytes += list.len() * expert_bytes;
            pool.install(|| run(&list, &mats, &xi, &hi, &mut g, &mut o, f));
        }
        let dt = t.elapsed().as_secs_f64();
        (sum_t, sum_b) = (sum_t + dt, sum_b + step_bytes);
        if dt < best {
            (best, bytes) = (dt, step_bytes);
        }
    }
    println!(
        "experts: {tokens} tokens, top {top_k} of {experts}, {layers} layers: {:.2} ms a step, {:.1} MB, {:.1} GB/s (mean {:.1})",
        best * 1e3,
        bytes as f64 / 1e6,
        bytes as f64 / best / 1e9,
        sum_b as f64 / sum_t / 1e9
    );
    // The same bytes as one tall matrix (gate-shaped rows), one token, split by rows.
    let rows = total / mat_bytes * f;
    let tall = Matrix::new(dtype, rows, d, &buf[..]).unwrap();
    let one = Input { x: &x[..d], q: &qx[..d / 32], cols: d };
    let mut y = vec![0f32; rows];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        pool.install(|| matmul(&tall, &one, &mut y));
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!("one tall matrix, 1 token: {:.1} GB/s", total as f64 / best / 1e9);
}
