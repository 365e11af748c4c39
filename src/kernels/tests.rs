//! Every kernel of every table this CPU runs against the scalar reference,
//! over every weight type at awkward lengths, and matmul against a naive
//! product. The tables are swept explicitly, so a run on an AVX2 machine tests
//! the AVX2 and the scalar kernels whatever `COLIBRI_ISA` says.

use super::*;
use crate::quant;
use crate::quant::act;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Encodes `vals` as `dtype` into a buffer aligned for any type.
fn encoded(dtype: DType, vals: &[f32], cols: usize) -> Vec<u64> {
    let rows = vals.len() / cols;
    let nbytes = dtype.row_bytes(cols).unwrap() * rows;
    let mut buf = vec![0u64; nbytes.div_ceil(8)];
    quant::encode(dtype, vals, cols, &mut bytemuck::cast_slice_mut(&mut buf)[..nbytes]);
    buf
}

fn lengths(dtype: DType) -> Vec<usize> {
    if dtype.is_quantized() {
        vec![32, 64, 96, 160, 1024, 2048 + 32]
    } else {
        vec![1, 3, 7, 8, 31, 33, 255, 1023, 2048]
    }
}

/// Every weight type, row-major and interleaved.
fn every_dtype() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().chain(DType::INTERLEAVED)
}

/// Every table this CPU runs (the scalar one first).
fn tables() -> Vec<Table> {
    let t = Table::available();
    eprintln!("tables under test: {:?} (active: {})", t.iter().map(|t| t.isa()).collect::<Vec<_>>(), isa());
    t
}

fn row_dot(table: Table, dtype: DType) -> DotFn {
    match table.kernels(dtype).layout {
        Layout::Rows { dot, .. } => dot,
        Layout::Groups(_) => panic!("{dtype} has no row dot"),
    }
}

/// Every table's activation quantiser gives the scalar one's blocks bit
/// for bit: random rows, rows with ties at ±0.5 steps, zeros, NaN and
/// infinities, tiny and huge values.
#[test]
fn activation_quantisers_of_every_table_give_the_scalar_blocks() {
    let mut s = 3u64;
    let mut rows: Vec<Vec<f32>> = (0..200).map(|_| (0..64).map(|_| lcg(&mut s) * 10.0).collect()).collect();
    // amax 127 makes id 1: codes are the values, halves exercise the ties.
    rows.push((0..64).map(|i| if i == 0 { 127.0 } else { (i as f32 - 32.0) * 0.5 + 0.5 }).collect());
    rows.push(vec![0.0; 64]);
    rows.push((0..64).map(|i| [f32::NAN, 1.0, -2.5, f32::INFINITY][i % 4]).collect());
    rows.push((0..64).map(|i| if i % 2 == 0 { f32::NEG_INFINITY } else { 3.0 }).collect());
    rows.push((0..64).map(|i| (i as f32 - 20.0) * 1e-41).collect());
    rows.push((0..64).map(|i| (i as f32 - 20.0) * 1e37).collect());
    for table in tables() {
        for x in &rows {
            let mut want = vec![BlockQ8::default(); 2];
            let mut got = vec![BlockQ8::default(); 2];
            act::quantize_act(x, &mut want);
            (table.quantize_fn())(x, &mut got);
            for (g, w) in got.iter().zip(&want) {
                let what = format!("{}: {:?}", table.isa(), &x[..8]);
                assert_eq!((g.d.to_bits(), g.sum, g.qs), (w.d.to_bits(), w.sum, w.qs), "{what}");
            }
        }
    }
}

#[test]
fn activation_rounding_is_round_half_away_from_zero() {
    let mut s = 99u64;
    let special = [0.5f32, -0.5, 1.5, -1.5, 126.5, -126.5, 127.0, 0.49999997, -0.49999997, 2.5000002, 0.0, -0.0];
    let sweep = (0..200_000).map(|_| lcg(&mut s) * 128.0);
    let halves = (-255..=255).map(|i| i as f32 * 0.5);
    for x in
        special.into_iter().chain(sweep).chain(halves).chain([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3e9, -3e9])
    {
        assert_eq!(act::round_i8(x), x.round() as i8, "{x}");
    }
}

/// The super-block types' scalar dots against the f64 product of the
/// decoded weights and the decoded activation, and near the f32 product.
#[test]
fn kquant_dots_match_dequantize() {
    use crate::quant::kquant::{Kind, QK, dequantize_row, quantize_row, row_bytes};
    // Seeded N(0, σ²) samples (LCG + Box–Muller).
    let gaussian = |n: usize, seed: u64, sigma: f32| -> Vec<f32> {
        let mut s = seed;
        let mut u = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n).map(|_| ((-2.0 * u().ln()).sqrt() * (2.0 * std::f64::consts::PI * u()).cos()) as f32 * sigma).collect()
    };
    let dot = |kind: Kind, row: &[u8], a: &[BlockQ8]| match kind {
        Kind::Q4K => scalar::dot_q4k(row, a),
        Kind::Q5K => scalar::dot_q5k(row, a),
        Kind::Q6K => scalar::dot_q6k(row, a),
    };
    for n in [32, 96, 288, 1408] {
        let w = gaussian(n, 100 + n as u64, 0.02);
        let a = gaussian(n, 200 + n as u64, 1.0);
        let mut qa = vec![BlockQ8 { d: 0.0, sum: 0, qs: [0; 32] }; n / QK];
        act::quantize_act(&a, &mut qa);
        for kind in [Kind::Q4K, Kind::Q5K, Kind::Q6K] {
            let mut row = vec![0u8; row_bytes(kind, n).unwrap()];
            quantize_row(kind, &w, None, &mut row);
            let mut y = vec![0f32; n];
            dequantize_row(kind, &row, &mut y);
            // The f64 dot of the decoded weights with the decoded activation.
            let (mut want, mut l1) = (0f64, 0f64);
            for (i, &y) in y.iter().enumerate() {
                let b = &qa[i / QK];
                let av = b.d as f64 * b.qs[i % QK] as f64;
                want += y as f64 * av;
                l1 += (y as f64 * av).abs();
            }
            let got = dot(kind, &row, &qa) as f64;
            assert!((got - want).abs() <= 1e-5 * l1, "{kind:?} n={n}: {got} vs {want}");
            // And near the f32 product (activation rounding only).
            let exact: f64 = y.iter().zip(&a).map(|(&y, &a)| y as f64 * a as f64).sum();
            assert!((got - exact).abs() <= 0.02 * l1, "{kind:?} n={n}: {got} vs {exact}");
        }
    }
}

#[test]
fn every_table_has_an_entry_of_the_right_shape_for_every_type() {
    for table in tables() {
        for dtype in every_dtype() {
            let k = table.kernels(dtype);
            let want = if dtype.is_quantized() { InputKind::Q8 } else { InputKind::F32 };
            assert_eq!(k.input, want, "{} {dtype}: Input::prepare goes by is_quantized", table.isa());
            let grouped = matches!(k.layout, Layout::Groups(_));
            assert_eq!(grouped, dtype.group_rows() > 1, "{} {dtype}: layout", table.isa());
            assert_eq!(k.kv.is_some(), matches!(dtype, DType::F32 | DType::F16), "{} {dtype}: kv", table.isa());
        }
    }
}

/// Allowed |simd - scalar| relative to Σ|w·x|: the two sum in different
/// orders (and the SIMD kernels use FMA), so they agree to f32 rounding of a
/// sum of n terms.
const REL_TOL: f32 = 2e-6;

#[test]
fn row_kernels_of_every_table_match_the_scalar_reference() {
    for table in tables() {
        let mut s = 17u64;
        for dtype in DType::ALL {
            for n in lengths(dtype) {
                let w: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
                let x: Vec<f32> = (0..n).map(|_| lcg(&mut s) * 3.0).collect();
                let buf = encoded(dtype, &w, n);
                let row = &bytemuck::cast_slice::<u64, u8>(&buf)[..dtype.row_bytes(n).unwrap()];
                let mut q = vec![BlockQ8::default(); n / 32];
                let inp = Input::prepare(&x, n, dtype.is_quantized(), &mut q);
                let (xr, qr) = inp.row(0);
                let want = row_dot(Table::SCALAR, dtype)(row, xr, qr);
                let got = row_dot(table, dtype)(row, xr, qr);
                let mut wd = vec![0f32; n];
                quant::decode(dtype, row, n, &mut wd);
                let scale: f32 = wd.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum::<f32>().max(1e-6);
                let tol = REL_TOL * scale * (n as f32).sqrt();
                assert!((got - want).abs() <= tol, "{} {dtype} n={n}: {got} vs {want}", table.isa());
            }
        }
    }
}

/// The super-block types' row dots are the scalar one's bits in every
/// table (their SIMD kernels keep its order exactly), at lengths with and
/// without a partial last super-block, on activations of very different
/// magnitudes per block.
#[test]
fn super_block_row_dots_of_every_table_are_the_scalar_bits() {
    for table in tables() {
        let mut s = 29u64;
        for dtype in [DType::Q4K, DType::Q5K, DType::Q6K] {
            for n in [32, 64, 96, 160, 224, 256, 288, 1024, 1408, 2080] {
                let w: Vec<f32> = (0..n).map(|i| lcg(&mut s) * if i % 97 == 5 { 9.0 } else { 1.0 }).collect();
                let x: Vec<f32> = (0..n).map(|i| lcg(&mut s) * (1.0 + (i / 32 % 5) as f32 * 40.0)).collect();
                let buf = encoded(dtype, &w, n);
                let row = &bytemuck::cast_slice::<u64, u8>(&buf)[..dtype.row_bytes(n).unwrap()];
                let mut q = vec![BlockQ8::default(); n / 32];
                let inp = Input::prepare(&x, n, true, &mut q);
                let (xr, qr) = inp.row(0);
                let want = row_dot(Table::SCALAR, dtype)(row, xr, qr);
                let got = row_dot(table, dtype)(row, xr, qr);
                assert_eq!(got.to_bits(), want.to_bits(), "{} {dtype} n={n}: {got} vs {want}", table.isa());
            }
        }
    }
}

#[test]
fn quantised_dots_approximate_the_exact_product() {
    // Against the f64 product of the DEQUANTISED weights with the f32
    // activation: the only remaining error is the 8-bit activation rounding,
    // ~ |w|·|x| / 254 per term in the worst case, far less on average.
    for table in tables() {
        let mut s = 5u64;
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q4K, DType::Q5K, DType::Q6K] {
            let n = 1024;
            let w: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            let x: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            let buf = encoded(dtype, &w, n);
            let row = &bytemuck::cast_slice::<u64, u8>(&buf)[..dtype.row_bytes(n).unwrap()];
            let mut wd = vec![0f32; n];
            quant::decode(dtype, row, n, &mut wd);
            let exact: f64 = wd.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mut q = vec![BlockQ8::default(); n / 32];
            let inp = Input::prepare(&x, n, true, &mut q);
            let (xr, qr) = inp.row(0);
            let got = row_dot(table, dtype)(row, xr, qr) as f64;
            let l1: f64 = wd.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            assert!((got - exact).abs() < 0.01 * l1, "{} {dtype}: {got} vs {exact} (l1 {l1})", table.isa());
        }
    }
}

/// Per table: parallel == serial, all tokens at once == one token at a time
/// (prefill and decode give the same bits), and both near the f64 product.
#[test]
fn matmul_matches_naive_for_every_table_type_and_shape() {
    for table in tables() {
        let mut s = 7u64;
        for dtype in every_dtype() {
            let shapes: &[(usize, usize, usize)] = if dtype.group_rows() > 1 {
                &[
                    (8, 32, 1),
                    (16, 64, 2),
                    (40, 96, 5),
                    (256, 32, 1),
                    (64, 1024, 3),
                    (24, 64, 9),
                    (24, 64, 37),
                    (48, 160, 16),
                    (40, 64, 15),
                    (32, 96, 30),
                ]
            } else if dtype.is_quantized() {
                &[(1, 32, 1), (3, 64, 2), (31, 96, 5), (255, 32, 1), (64, 1024, 3), (7, 64, 9)]
            } else {
                &[(1, 1, 1), (3, 7, 2), (31, 33, 5), (255, 17, 1), (64, 1023, 3), (7, 31, 9)]
            };
            for &(rows, cols, n) in shapes {
                let what = format!("{} {dtype} {rows}x{cols} n={n}", table.isa());
                let wf: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
                let buf = encoded(dtype, &wf, cols);
                let bytes = &bytemuck::cast_slice::<u64, u8>(&buf)[..dtype.row_bytes(cols).unwrap() * rows];
                let m = Matrix::new(dtype, rows, cols, bytes).unwrap();
                let mut wd = vec![0f32; rows * cols];
                quant::decode(dtype, bytes, cols, &mut wd);
                let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s)).collect();
                let mut q = vec![BlockQ8::default(); n * cols / 32];
                let inp = Input::prepare(&x, cols, dtype.is_quantized(), &mut q);
                let mut y = vec![0f32; n * rows];
                matmul_many_in(table, &mut [(m, &mut y)], &inp);
                let mut y2 = vec![0f32; n * rows];
                matmul_serial_in(table, &m, &inp, &mut y2);
                assert_eq!(y, y2, "{what}: parallel and serial differ");
                for t in 0..n {
                    let one = Input { x: inp.row(t).0, q: inp.row(t).1, cols };
                    let mut y1 = vec![0f32; rows];
                    matmul_serial_in(table, &m, &one, &mut y1);
                    assert_eq!(y1, y[t * rows..(t + 1) * rows], "{what}: token {t} alone differs");
                }
                // Quantised inputs lose ~1/254 of each term; element types only rounding.
                let tol = if dtype.is_quantized() { 0.01 } else { 1e-5 };
                for t in 0..n {
                    for r in 0..rows {
                        let terms = (0..cols).map(|c| wd[r * cols + c] as f64 * x[t * cols + c] as f64);
                        let (want, l1) = terms.fold((0.0, 0.0), |(s, a), v| (s + v, a + v.abs()));
                        let got = y[t * rows + r] as f64;
                        assert!((want - got).abs() <= tol * l1.max(1e-3), "{what}: {want} vs {got}");
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_many_equals_separate_matmuls() {
    let mut s = 3u64;
    let (cols, n) = (64, 3);
    let mats: Vec<(Vec<u64>, usize)> = [(DType::Q8_0, 40), (DType::Bf16, 17), (DType::Q4_1, 64)]
        .iter()
        .map(|&(d, rows)| (encoded(d, &(0..rows * cols).map(|_| lcg(&mut s)).collect::<Vec<_>>(), cols), rows))
        .collect();
    let dts = [DType::Q8_0, DType::Bf16, DType::Q4_1];
    let ms: Vec<Matrix> = mats
        .iter()
        .zip(dts)
        .map(|((b, rows), d)| {
            Matrix::new(d, *rows, cols, &bytemuck::cast_slice::<u64, u8>(b)[..d.row_bytes(cols).unwrap() * rows])
                .unwrap()
        })
        .collect();
    let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s)).collect();
    let mut q = vec![BlockQ8::default(); n * cols / 32];
    let inp = Input::prepare(&x, cols, true, &mut q);
    let mut ys: Vec<Vec<f32>> = ms.iter().map(|m| vec![0.0; n * m.rows]).collect();
    {
        let mut jobs: Vec<(Matrix, &mut [f32])> = ms.iter().copied().zip(ys.iter_mut().map(|v| &mut v[..])).collect();
        matmul_many(&mut jobs, &inp);
    }
    for (m, y) in ms.iter().zip(&ys) {
        let mut one = vec![0.0; n * m.rows];
        matmul(m, &inp, &mut one);
        assert_eq!(&one, y);
    }
}

#[test]
fn tiles_of_every_table_match_single_dots() {
    for table in tables() {
        let mut s = 23u64;
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let Layout::Rows { dot, tile: Some(tile), .. } = table.kernels(dtype).layout else { continue };
            for n in [32, 96, 2048] {
                let w: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
                let buf = encoded(dtype, &w, n);
                let row = &bytemuck::cast_slice::<u64, u8>(&buf)[..dtype.row_bytes(n).unwrap()];
                let x: Vec<f32> = (0..4 * n).map(|_| lcg(&mut s)).collect();
                let mut q = vec![BlockQ8::default(); 4 * n / 32];
                let inp = Input::prepare(&x, n, true, &mut q);
                let got = tile(row, [inp.row(0).1, inp.row(1).1, inp.row(2).1, inp.row(3).1]);
                for (t, g) in got.iter().enumerate() {
                    let what = format!("{} {dtype} n={n} t={t}", table.isa());
                    let (xr, qr) = inp.row(t);
                    assert_eq!(*g, dot(row, xr, qr), "{what}: tile and single dot must agree bit for bit");
                    let want = row_dot(Table::SCALAR, dtype)(row, xr, qr);
                    let scale: f32 = (0..n).map(|i| (w[i] * xr[i]).abs()).sum::<f32>().max(1e-6);
                    assert!((g - want).abs() <= REL_TOL * scale * (n as f32).sqrt(), "{what}: {g} vs {want}");
                }
            }
        }
    }
}

/// The register tiles of the element types (`Layout::Rows::dots`) give
/// every (row, token) the bits of the table's single dot, whatever the
/// numbers of rows and tokens in the call.
#[test]
fn element_row_tiles_give_the_single_dot_bits() {
    let mut ran = 0;
    for table in tables() {
        let mut s = 47u64;
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
            let Layout::Rows { dot, dots: Some(dots), .. } = table.kernels(dtype).layout else { continue };
            ran += 1;
            for n in [1, 15, 16, 33, 2048 + 7] {
                let rows = 13;
                let w: Vec<f32> = (0..rows * n).map(|_| lcg(&mut s)).collect();
                let buf = encoded(dtype, &w, n);
                let rb = dtype.row_bytes(n).unwrap();
                let m = &bytemuck::cast_slice::<u64, u8>(&buf)[..rows * rb];
                let x: Vec<f32> = (0..KV_QUERIES * n).map(|_| lcg(&mut s) * 2.0).collect();
                let toks: Vec<&[f32]> = x.chunks_exact(n).collect();
                for nt in 1..=KV_QUERIES {
                    for nr in [1, 3, 4, 5, 12, 13] {
                        let mut out = vec![f32::NAN; nt * rows];
                        dots(m, n, nr, &toks[..nt], &mut out, rows);
                        for (t, x) in toks[..nt].iter().enumerate() {
                            for r in 0..nr {
                                let want = dot(&m[r * rb..(r + 1) * rb], x, &[]);
                                let what =
                                    format!("{} {dtype} n={n} tokens={nt} rows={nr}: row {r} token {t}", table.isa());
                                assert_eq!(out[t * rows + r].to_bits(), want.to_bits(), "{what}");
                            }
                        }
                    }
                }
            }
        }
    }
    eprintln!("{ran} element tile kernels tested");
}

/// Each interleaved kernel of every table against its scalar twin, the
/// several-token kernel (every run of 1 to [`GEMM8_TOKENS`]) against the
/// one-token kernel (bit for bit), and both against the row-major kernels of
/// the same values.
#[test]
fn group_kernels_of_every_table_match_scalar_and_row_kernels() {
    let group = |table: Table, dtype: DType| match table.kernels(dtype).layout {
        Layout::Groups(k) => k,
        Layout::Rows { .. } => panic!("{dtype} is row-major"),
    };
    for table in tables() {
        let mut s = 31u64;
        for dtype in DType::INTERLEAVED {
            let k = group(table, dtype);
            for n in [32, 64, 160, 2048 + 32] {
                let w: Vec<f32> = (0..8 * n).map(|_| lcg(&mut s)).collect();
                let buf = encoded(dtype, &w, n);
                let g = &bytemuck::cast_slice::<u64, u8>(&buf)[..8 * dtype.row_bytes(n).unwrap()];
                let rbuf = encoded(dtype.base(), &w, n);
                let rows = &bytemuck::cast_slice::<u64, u8>(&rbuf)[..8 * dtype.row_bytes(n).unwrap()];
                let rb = dtype.row_bytes(n).unwrap();
                // Large activations make the 16-bit partial sums of the 4-bit
                // kernels approach their bound.
                const T: usize = GEMM8_TOKENS;
                let x: Vec<f32> = (0..T * n).map(|i| if i % 7 == 0 { 1.0 } else { lcg(&mut s) * 3.0 }).collect();
                let mut q = vec![BlockQ8::default(); T * n / 32];
                let inp = Input::prepare(&x, n, true, &mut q);
                let qs: [&[BlockQ8]; T] = std::array::from_fn(|t| inp.row(t).1);
                let ones = qs.map(|q| (k.one)(g, q));
                for t in 0..T {
                    let what = format!("{} {dtype} n={n} t={t}", table.isa());
                    let got = ones[t];
                    if let Some(many) = k.many {
                        // Every run length that includes token t, t first or
                        // last; every token of the run against its own
                        // one-token result.
                        for (lo, hi) in [(t, T), (0, t + 1)] {
                            let mut out = vec![[f32::NAN; 8]; hi - lo];
                            many(g, &qs[lo..hi], &mut out);
                            for (i, o) in out.iter().enumerate() {
                                assert_eq!(*o, ones[lo + i], "{what}: token {} of a {}-token run", lo + i, hi - lo);
                            }
                        }
                    }
                    let want = (group(Table::SCALAR, dtype).one)(g, qs[t]);
                    for l in 0..8 {
                        let row = &rows[l * rb..(l + 1) * rb];
                        let (xr, qr) = inp.row(t);
                        let plain = row_dot(Table::SCALAR, dtype.base())(row, xr, qr);
                        let scale: f32 = (0..n).map(|i| (w[l * n + i] * xr[i]).abs()).sum::<f32>().max(1e-6);
                        let tol = REL_TOL * scale * (n as f32).sqrt();
                        assert!((got[l] - want[l]).abs() <= tol, "{what} row {l}: {} vs {}", got[l], want[l]);
                        assert!((want[l] - plain).abs() <= tol, "{what} row {l}: {} vs row-major {plain}", want[l]);
                    }
                }
            }
        }
    }
}

/// The 4-bit group kernels at the bound of their 16-bit partial sums: every
/// code at 0 or 15 (a q4_0 code of 0 is the weight −8), activations of ±127
/// in whole blocks and in alternating halves of each run of four (the two
/// 16-bit lanes a row's sums are split into), one token and every run of
/// tokens. The integer sums are exact in every table, so a table agrees
/// with the scalar reference up to its last rounding; a sum that wrapped in
/// 16 bits would be off by 65536 steps.
#[test]
fn four_bit_group_kernels_hold_their_extreme_sums() {
    use crate::quant::x8::{BlockMxfp4x8, BlockQ4_0x8, BlockQ4_1x8};
    let codes_at = |dtype: DType| match dtype {
        DType::Q4_0x8 => (std::mem::offset_of!(BlockQ4_0x8, qs), std::mem::size_of::<BlockQ4_0x8>()),
        DType::Q4_1x8 => (std::mem::offset_of!(BlockQ4_1x8, qs), std::mem::size_of::<BlockQ4_1x8>()),
        DType::Mxfp4x8 => (std::mem::offset_of!(BlockMxfp4x8, qs), std::mem::size_of::<BlockMxfp4x8>()),
        _ => unreachable!(),
    };
    let n = 96;
    let mut s = 3u64;
    let w: Vec<f32> = (0..8 * n).map(|_| lcg(&mut s)).collect();
    // Activation patterns, one token each: a whole block of one sign, or
    // offsets 0-1 and 2-3 (mod 4) of opposite signs.
    let patterns: [fn(usize) -> i8; 6] = [
        |_| 127,
        |_| -127,
        |i| if i % 4 < 2 { -127 } else { 127 },
        |i| if i % 4 < 2 { 127 } else { -127 },
        |i| if i < 16 { -127 } else { 127 },
        |i| (i as i8 % 7 - 3) * 42,
    ];
    let q: Vec<BlockQ8> = patterns
        .iter()
        .flat_map(|f| {
            (0..n / 32).map(move |b| {
                let qs: [i8; 32] = std::array::from_fn(|i| f((i + b) % 32));
                BlockQ8 { d: 0.5 + b as f32, sum: qs.iter().map(|&v| v as i32).sum(), qs }
            })
        })
        .collect();
    let qs: Vec<&[BlockQ8]> = q.chunks_exact(n / 32).collect();
    for dtype in [DType::Q4_0x8, DType::Q4_1x8, DType::Mxfp4x8] {
        let (at, size) = codes_at(dtype);
        for fill in [0x00u8, 0xFF, 0x0F, 0xF0] {
            let mut buf = encoded(dtype, &w, n);
            let g = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut buf)[..8 * dtype.row_bytes(n).unwrap()];
            for block in g.chunks_exact_mut(size) {
                block[at..].fill(fill);
            }
            let g = &*g;
            let Layout::Groups(k0) = Table::SCALAR.kernels(dtype).layout else { panic!("{dtype} is interleaved") };
            let want: Vec<[f32; 8]> = qs.iter().map(|q| (k0.one)(g, q)).collect();
            for table in tables() {
                let Layout::Groups(k) = table.kernels(dtype).layout else { panic!("{dtype} is interleaved") };
                let what = |t: usize| format!("{} {dtype} codes {fill:#04x} pattern {t}", table.isa());
                let close = |got: [f32; 8], want: [f32; 8], t: usize| {
                    // Roundings apart (the sums are exact), against the size
                    // of the terms: weights are within ±2 and activations
                    // at most 127 steps of d.
                    let size: f32 = qs[t].iter().map(|b| b.d * 127.0 * 32.0 * 2.0).sum();
                    for (a, b) in got.iter().zip(want) {
                        assert!((a - b).abs() <= 2e-7 * size, "{}: {got:?} vs {want:?}", what(t));
                    }
                };
                let ones: Vec<[f32; 8]> = qs.iter().map(|q| (k.one)(g, q)).collect();
                for t in 0..qs.len() {
                    close(ones[t], want[t], t);
                }
                let Some(many) = k.many else { continue };
                for lo in 0..qs.len() {
                    for hi in lo + 1..=qs.len() {
                        let mut out = vec![[f32::NAN; 8]; hi - lo];
                        many(g, &qs[lo..hi], &mut out);
                        for (i, o) in out.iter().enumerate() {
                            assert_eq!(*o, ones[lo + i], "{}: tokens {lo}..{hi}", what(lo + i));
                        }
                    }
                }
            }
        }
    }
}

/// The super-block types' group kernels give their scalar reference's bits
/// in every table, one token at a time and in every run of 1 to
/// [`GEMM8_TOKENS`] tokens (so prefill and decode agree), at lengths with
/// and without a partial last super-block, on activations of very different
/// magnitudes per block; then with every code at its largest and
/// activations of ±127, the bound of the kernels' 16-bit partial sums.
#[test]
fn super_block_group_kernels_of_every_table_are_the_scalar_bits() {
    let groups = |table: Table, dtype: DType| match table.kernels(dtype).layout {
        Layout::Groups(k) => k,
        Layout::Rows { .. } => panic!("{dtype} is interleaved"),
    };
    let bits = |v: [f32; 8]| v.map(f32::to_bits);
    for table in tables() {
        let mut s = 59u64;
        for dtype in [DType::Q4Kx8, DType::Q5Kx8, DType::Q6Kx8] {
            let (k, k0) = (groups(table, dtype), groups(Table::SCALAR, dtype));
            let kind = dtype.base().kquant().unwrap();
            for n in [32, 96, 256, 288, 1408, 2080] {
                let w: Vec<f32> = (0..8 * n).map(|i| lcg(&mut s) * if i % 97 == 5 { 9.0 } else { 1.0 }).collect();
                let mut buf = encoded(dtype, &w, n);
                let gb = 8 * dtype.row_bytes(n).unwrap();
                let x: Vec<f32> =
                    (0..GEMM8_TOKENS * n).map(|i| lcg(&mut s) * (1.0 + (i / 32 % 5) as f32 * 40.0)).collect();
                let mut q = vec![BlockQ8::default(); GEMM8_TOKENS * n / 32];
                Input::prepare(&x, n, true, &mut q);
                let mut extreme = q.clone();
                for (i, b) in extreme.iter_mut().enumerate() {
                    let v = if i % 3 == 1 { -127 } else { 127 };
                    (b.qs, b.sum) = ([v; 32], 32 * v as i32);
                }
                for (case, q) in [("random", &q), ("extreme", &extreme)] {
                    if case == "extreme" {
                        // Every code bit set, the headers kept.
                        let g = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut buf)[..gb];
                        for (start, subs) in quant::kx8::columns(kind, n) {
                            let codes = start + quant::kx8::header_bytes(kind);
                            g[codes..codes + subs * quant::kx8::sub_bytes(kind)].fill(0xFF);
                        }
                    }
                    let g = &bytemuck::cast_slice::<u64, u8>(&buf)[..gb];
                    let qs: Vec<&[BlockQ8]> = q.chunks_exact(n / 32).collect();
                    let want: Vec<[f32; 8]> = qs.iter().map(|q| (k0.one)(g, q)).collect();
                    for (t, q) in qs.iter().enumerate() {
                        let what = format!("{} {dtype} n={n} {case} token {t}", table.isa());
                        assert_eq!(bits((k.one)(g, q)), bits(want[t]), "{what}: one token");
                    }
                    let Some(many) = k.many else { continue };
                    for lo in 0..GEMM8_TOKENS {
                        for hi in lo + 1..=GEMM8_TOKENS {
                            let mut out = vec![[f32::NAN; 8]; hi - lo];
                            many(g, &qs[lo..hi], &mut out);
                            for (i, o) in out.iter().enumerate() {
                                let what = format!("{} {dtype} n={n} {case} tokens {lo}..{hi}", table.isa());
                                assert_eq!(bits(*o), bits(want[lo + i]), "{what}: token {}", lo + i);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// 16-row kernels (AMX tiles, AVX-512 VNNI) against the one-token kernel of
/// the same table, bit for bit: one and two groups, one and several tiles
/// of tokens and partial tiles (padded, or short of `amx::PAD_MIN` and on
/// VNNI), awkward widths; the rows past one group come out zero.
#[test]
fn tiles_of_every_table_give_the_one_token_bits() {
    let mut ran = 0;
    for table in tables() {
        let mut s = 41u64;
        for dtype in DType::INTERLEAVED {
            let Layout::Groups(k) = table.kernels(dtype).layout else { panic!("{dtype} is interleaved") };
            // The tiles and the direct sixteen-row kernels keep one contract.
            for (kind, tile) in [("tile", k.tile.map(|t| t.f)), ("direct", k.direct.map(|t| t.f))] {
                let Some(tile) = tile else { continue };
                ran += 1;
                for (n, groups, tokens) in [
                    (32, 1, 16),
                    (96, 2, 32),
                    (2048 + 32, 2, 16),
                    (160, 1, 48),
                    (64, 2, 160),
                    (64, 2, 1),
                    (96, 1, 21),
                    (2048, 2, 37),
                    (96, 2, 29),
                    (32, 1, 12),
                    (160, 2, 9),
                    (64, 2, 4),
                    (2048, 2, 8),
                    (96, 1, 7),
                    // Two and three tokens (routed experts of a batched
                    // step take the direct kernels from two on), and a run
                    // of six after eight.
                    (2048, 2, 2),
                    (96, 1, 3),
                    (160, 2, 14),
                ] {
                    let what = format!("{} {dtype} {kind} n={n} groups={groups} tokens={tokens}", table.isa());
                    let w: Vec<f32> = (0..8 * groups * n).map(|_| lcg(&mut s)).collect();
                    let buf = encoded(dtype, &w, n);
                    let gb = 8 * dtype.row_bytes(n).unwrap();
                    let g = &bytemuck::cast_slice::<u64, u8>(&buf)[..groups * gb];
                    let x: Vec<f32> =
                        (0..tokens * n).map(|i| if i % 5 == 0 { 1.0 } else { lcg(&mut s) * 3.0 }).collect();
                    let mut q = vec![BlockQ8::default(); tokens * n / 32];
                    let inp = Input::prepare(&x, n, true, &mut q);
                    let mut out = vec![f32::NAN; tokens * TILE_ROWS];
                    tile(g, inp.q, tokens, &mut out);
                    for t in 0..tokens {
                        for h in 0..2 {
                            let got = &out[t * TILE_ROWS + 8 * h..t * TILE_ROWS + 8 * h + 8];
                            if h < groups {
                                let want = (k.one)(&g[h * gb..(h + 1) * gb], inp.row(t).1);
                                assert_eq!(got, want, "{what}: token {t} group {h}");
                            } else {
                                assert!(got.iter().all(|&v| v == 0.0), "{what}: token {t}: rows past the group");
                            }
                        }
                    }
                }
            }
        }
    }
    eprintln!("{ran} tile and direct kernels tested");
}

/// `a` and `b`, group kernels of `dtype` that sum the same integers
/// (`vpdpbusd` against `maddubs` + `madd`, which never saturates here), give
/// the same bits for one token and for runs of 2 to [`GEMM8_TOKENS`]; the
/// large activations reach the 16-bit bound of the AVX2 nibble sums. (Only
/// x86_64 has two tables that sum the same integers.)
#[cfg(target_arch = "x86_64")]
pub(super) fn assert_group_kernels_agree(dtype: DType, a: GroupKernels, b: GroupKernels) {
    let mut s = 7u64;
    for n in [32, 96, 2048 + 32] {
        let w: Vec<f32> = (0..8 * n).map(|_| lcg(&mut s)).collect();
        let buf = encoded(dtype, &w, n);
        let g = &bytemuck::cast_slice::<u64, u8>(&buf)[..8 * dtype.row_bytes(n).unwrap()];
        const T: usize = GEMM8_TOKENS;
        let x: Vec<f32> = (0..T * n).map(|i| if i % 5 == 0 { 1.0 } else { lcg(&mut s) * 3.0 }).collect();
        let mut q = vec![BlockQ8::default(); T * n / 32];
        let inp = Input::prepare(&x, n, true, &mut q);
        let qs: [&[BlockQ8]; T] = std::array::from_fn(|t| inp.row(t).1);
        assert_eq!((a.one)(g, qs[0]), (b.one)(g, qs[0]), "{dtype} n={n}: one token");
        let (ma, mb) = match (a.many, b.many) {
            (Some(ma), Some(mb)) => (ma, mb),
            (None, None) => continue,
            _ => panic!("{dtype}: one table has a several-token kernel, the other not"),
        };
        for m in 2..=T {
            let (mut oa, mut ob) = (vec![[0f32; 8]; m], vec![[0f32; 8]; m]);
            ma(g, &qs[..m], &mut oa);
            mb(g, &qs[..m], &mut ob);
            assert_eq!(oa, ob, "{dtype} n={n}: {m} tokens");
        }
    }
}

/// The AVX-VNNI table sums the same integers as the AVX2 one, so its group
/// kernels must give the AVX2 kernels' bits exactly.
#[test]
fn avx_vnni_group_kernels_give_the_avx2_bits() {
    #[cfg(target_arch = "x86_64")]
    {
        let (Some(avx2), Some(vnni)) = (Table::new(Isa::Avx2), Table::new(Isa::AvxVnni)) else {
            eprintln!("this CPU has no AVX-VNNI: nothing to compare");
            return;
        };
        for dtype in DType::INTERLEAVED {
            let (Layout::Groups(a), Layout::Groups(b)) = (avx2.kernels(dtype).layout, vnni.kernels(dtype).layout)
            else {
                panic!("{dtype} is interleaved");
            };
            assert_group_kernels_agree(dtype, a, b);
        }
    }
}

#[test]
fn interleaved_rows_decode_like_row_major() {
    let mut s = 41u64;
    for dtype in DType::INTERLEAVED {
        let (rows, cols) = (16, 96);
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
        let nbytes = dtype.tensor_bytes(&[rows, cols]).unwrap();
        let (a, b) = (encoded(dtype, &w, cols), encoded(dtype.base(), &w, cols));
        let (a, b) = (&bytemuck::cast_slice::<u64, u8>(&a)[..nbytes], &bytemuck::cast_slice::<u64, u8>(&b)[..nbytes]);
        assert_ne!(a, b, "{dtype}: the interleaved bytes should differ from row-major");
        let (mut da, mut db) = (vec![0f32; rows * cols], vec![0f32; rows * cols]);
        quant::decode(dtype, a, cols, &mut da);
        quant::decode(dtype.base(), b, cols, &mut db);
        assert_eq!(da, db, "{dtype}: interleaving must be lossless");
        let m = Matrix::new(dtype, rows, cols, a).unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.decode_row(r, &mut row);
            assert_eq!(row, db[r * cols..(r + 1) * cols], "{dtype} row {r}");
        }
        assert!(Matrix::new(dtype, rows - 1, cols, &a[..nbytes - dtype.row_bytes(cols).unwrap()]).is_none());
    }
}

/// The attention kernels of every table: scores and value sums near the
/// scalar ones, and per query the same bits whether it runs alone or with
/// up to three others (what makes prefill and decode agree).
#[test]
fn kv_kernels_of_every_table_match_the_scalar_reference_and_do_not_depend_on_the_batch() {
    for table in tables() {
        let mut s = 53u64;
        for dtype in [DType::F32, DType::F16] {
            let k = table.kernels(dtype).kv.unwrap();
            let k0 = Table::SCALAR.kernels(dtype).kv.unwrap();
            for n in [1, 7, 8, 9, 15, 16, 17, 31, 128, 129, 576] {
                let what = format!("{} {dtype} n={n}", table.isa());
                let v: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
                let buf = encoded(dtype, &v, n);
                let row = &bytemuck::cast_slice::<u64, u8>(&buf)[..dtype.row_bytes(n).unwrap()];
                let xs: Vec<Vec<f32>> = (0..KV_QUERIES).map(|_| (0..n).map(|_| lcg(&mut s) * 2.0).collect()).collect();
                let x: Vec<&[f32]> = xs.iter().map(|v| &v[..]).collect();
                // Seven keys, `ks` apart, against every number of queries.
                let (keys, ks) = (7, n + 5);
                let kvals: Vec<f32> = (0..keys * ks).map(|_| lcg(&mut s)).collect();
                let kbuf = encoded(dtype, &kvals, ks);
                let kbytes = &bytemuck::cast_slice::<u64, u8>(&kbuf)[..dtype.row_bytes(ks).unwrap() * keys];
                let es = dtype.row_bytes(1).unwrap();
                let os = keys + 2;
                let mut want = vec![0f32; KV_QUERIES * os];
                (k0.dots)(kbytes, ks, keys, &x, &mut want, os);
                for nq in 1..=KV_QUERIES {
                    let mut all = vec![0f32; KV_QUERIES * os];
                    (k.dots)(kbytes, ks, keys, &x[..nq], &mut all, os);
                    for q in 0..nq {
                        for j in 0..keys {
                            let mut one = [0f32];
                            let key = &kbytes[j * ks * es..(j * ks + n) * es];
                            (k.dots)(key, ks, 1, &x[q..q + 1], &mut one, 1);
                            let got = all[q * os + j];
                            assert_eq!(one[0], got, "{what}: query {q} key {j} alone and in a {nq}-query tile");
                            let kv = &kvals[j * ks..j * ks + n];
                            let scale: f32 = kv.iter().zip(x[q]).map(|(a, b)| (a * b).abs()).sum::<f32>().max(1e-6);
                            let w = want[q * os + j];
                            assert!(
                                (got - w).abs() <= REL_TOL * scale * (n as f32).sqrt(),
                                "{what}: dots {got} vs {w}"
                            );
                        }
                    }
                }
                let a: Vec<f32> =
                    (0..KV_QUERIES).map(|i| [0.37f32, -1.5, 0.0, 2.25][i % 4] * (1.0 + i as f32)).collect();
                let o0: Vec<f32> = (0..KV_QUERIES * n).map(|_| lcg(&mut s)).collect();
                let (mut got, mut want) = (o0.clone(), o0.clone());
                (k.axpys)(&mut got, &a, row);
                (k0.axpys)(&mut want, &a, row);
                for (g, w) in got.iter().zip(&want) {
                    // One rounding (FMA) against two: within an ulp or two.
                    assert!((g - w).abs() <= 1e-6 * (1.0 + w.abs()), "{what}: axpys {g} vs {w}");
                }
                for q in 0..KV_QUERIES {
                    let mut one = o0[q * n..(q + 1) * n].to_vec();
                    (k.axpys)(&mut one, &a[q..q + 1], row);
                    assert_eq!(one, got[q * n..(q + 1) * n], "{what}: axpys row {q} alone and in a batch");
                }
                // A run of keys (rows `vs` apart) in one `pv` call: the bits
                // of one `axpys` call per key, for every number of rows.
                let (keys, vs, ps) = (5, n + 3, 7);
                let vals: Vec<f32> = (0..keys * vs).map(|_| lcg(&mut s)).collect();
                let vbuf = encoded(dtype, &vals, vs);
                let vbytes = &bytemuck::cast_slice::<u64, u8>(&vbuf)[..dtype.row_bytes(vs).unwrap() * keys];
                let es = dtype.row_bytes(1).unwrap();
                let pr: Vec<f32> = (0..KV_QUERIES * ps).map(|_| lcg(&mut s).abs()).collect();
                for rows in 1..=KV_QUERIES {
                    let mut by_pv = o0[..rows * n].to_vec();
                    (k.pv)(&mut by_pv, &pr[..(rows - 1) * ps + keys], ps, vbytes, vs, keys);
                    let mut by_key = o0[..rows * n].to_vec();
                    for j in 0..keys {
                        let a: Vec<f32> = (0..rows).map(|i| pr[i * ps + j]).collect();
                        (k.axpys)(&mut by_key, &a, &vbytes[j * vs * es..(j * vs + n) * es]);
                    }
                    assert_eq!(by_pv, by_key, "{what}: pv over {rows} rows against axpys key by key");
                }
            }
        }
    }
}

/// Gated delta rule sizes: ones, odd widths, whole registers and one more
/// (8 and 16 lanes, strips of 32 and 64 columns), Qwen3.6's 128 and past it.
const DELTA_SIZES: [usize; 9] = [1, 3, 7, 16, 17, 33, 64, 128, 130];

/// Consecutive steps on one state in each delta-rule test.
const DELTA_STEPS: usize = 32;

/// Tolerance of the SIMD delta-rule steps against the scalar one, relative
/// to `1 + max |value|` of the vector compared (the state, or the output).
/// They differ only in rounding: FMA rounds each product-sum once where
/// the scalar step rounds twice, about one ulp (2^-24 relative) per term
/// of a sum over `dk <= 130` key channels, ~√dk ulp for random signs. The
/// step does not amplify an error already in the state (the decay is at
/// most 1, and `I − beta·k kᵀ` with a unit `k` and `beta` in [0, 1] has
/// norm at most 1), so over 32 steps the errors at most add up. The largest
/// seen is 1.4e-7 (printed by the test), 70 times below this.
const DELTA_TOL: f32 = 1e-5;

/// A unit vector of `n` random values, times `scale`.
fn unit(seed: &mut u64, n: usize, scale: f32) -> Vec<f32> {
    let x: Vec<f32> = (0..n).map(|_| lcg(seed)).collect();
    let norm = x.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-6);
    x.iter().map(|a| a / norm * scale).collect()
}

/// `|got − want| ≤ DELTA_TOL · (1 + max |want|)` element by element; the
/// largest ratio of the error to that bound's scale.
fn delta_close(got: &[f32], want: &[f32], what: &str) -> f32 {
    let scale = 1.0 + want.iter().fold(0f32, |m, w| m.max(w.abs()));
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / scale;
        assert!(err <= DELTA_TOL, "{what}: element {i}: {g} vs {w} (error {err:e} of 1 + max |value|)");
        worst = worst.max(err);
    }
    worst
}

/// The delta-rule step of every table against the scalar reference: every
/// pair of sizes, one decay per head and one per key channel, 32 steps on
/// the same state (state and output compared after each), with beta 0 and
/// 1 and decay 1 among the steps. The scalar table is the reference itself.
#[test]
fn delta_steps_of_every_table_match_the_scalar_reference() {
    for table in tables() {
        let step = table.delta_fn();
        let mut worst = 0f32;
        for dk in DELTA_SIZES {
            for dv in DELTA_SIZES {
                for per_channel in [false, true] {
                    let what = format!("{} dk={dk} dv={dv} per_channel={per_channel}", table.isa());
                    let mut s = 71u64 + (dk * 1000 + dv) as u64;
                    let s0: Vec<f32> = (0..dk * dv).map(|_| lcg(&mut s) * 0.5).collect();
                    let (mut got, mut want) = (s0.clone(), s0);
                    let (mut out, mut out0) = (vec![f32::NAN; dv], vec![f32::NAN; dv]);
                    for t in 0..DELTA_STEPS {
                        let k = unit(&mut s, dk, 1.0);
                        let q = unit(&mut s, dk, 1.0 / (dk as f32).sqrt());
                        let v: Vec<f32> = (0..dv).map(|_| lcg(&mut s) * 2.0).collect();
                        // exp(g) for g in (-0.2, 0]; exactly 1 every fifth step.
                        let n = if per_channel { dk } else { 1 };
                        let decay: Vec<f32> = (0..n)
                            .map(|_| if t % 5 == 0 { 1.0 } else { crate::math::expf(-0.1 * (lcg(&mut s) + 1.0)) })
                            .collect();
                        let beta = match t % 4 {
                            1 => 0.0,
                            2 => 1.0,
                            _ => 0.5 * (lcg(&mut s) + 1.0),
                        };
                        step(&mut got, &decay, &k, &v, beta, &q, &mut out);
                        scalar::delta_step(&mut want, &decay, &k, &v, beta, &q, &mut out0);
                        if table.isa() == Isa::Scalar {
                            assert_eq!((&got, &out), (&want, &out0), "{what}: step {t}");
                            continue;
                        }
                        worst = worst.max(delta_close(&out, &out0, &format!("{what}: step {t}: out")));
                        worst = worst.max(delta_close(&got, &want, &format!("{what}: step {t}: state")));
                    }
                }
            }
        }
        eprintln!("{}: largest delta-step error {worst:e} of 1 + max |value| (tolerance {DELTA_TOL:e})", table.isa());
    }
}

/// Mamba2's step of every table against the scalar reference: state sizes
/// of ones, odd widths and Nemotron-H's 128 × 64, 32 steps on one state
/// (state and output compared after each), with decay 1 and dt 0 among the
/// steps. The scalar table is the reference itself; the others fuse each
/// product-sum (about one ulp per term, as the delta rule's, which has the
/// same tolerance).
#[test]
fn ssm_steps_of_every_table_match_the_scalar_reference() {
    for table in tables() {
        let step = table.ssm_fn();
        let mut worst = 0f32;
        for n in [1usize, 3, 16, 17, 128] {
            for p in DELTA_SIZES {
                let what = format!("{} N={n} P={p}", table.isa());
                let mut s = 97u64 + (n * 1000 + p) as u64;
                let s0: Vec<f32> = (0..n * p).map(|_| lcg(&mut s) * 0.5).collect();
                let (mut got, mut want) = (s0.clone(), s0);
                let (mut out, mut out0) = (vec![f32::NAN; p], vec![f32::NAN; p]);
                for t in 0..DELTA_STEPS {
                    let b = unit(&mut s, n, 1.0);
                    let c = unit(&mut s, n, 1.0);
                    let x: Vec<f32> = (0..p).map(|_| lcg(&mut s) * 2.0).collect();
                    let decay = if t % 5 == 0 { 1.0 } else { crate::math::expf(-0.1 * (lcg(&mut s) + 1.0)) };
                    let dt = if t % 4 == 1 { 0.0 } else { 0.1 * (lcg(&mut s) + 1.0) };
                    let d = lcg(&mut s);
                    step(&mut got, decay, dt, &b, &x, &c, d, &mut out);
                    scalar::ssm_step(&mut want, decay, dt, &b, &x, &c, d, &mut out0);
                    if table.isa() == Isa::Scalar {
                        assert_eq!((&got, &out), (&want, &out0), "{what}: step {t}");
                        continue;
                    }
                    worst = worst.max(delta_close(&out, &out0, &format!("{what}: step {t}: out")));
                    worst = worst.max(delta_close(&got, &want, &format!("{what}: step {t}: state")));
                }
            }
        }
        eprintln!("{}: largest ssm-step error {worst:e} of 1 + max |value| (tolerance {DELTA_TOL:e})", table.isa());
    }
}

/// With beta 0 and decay 1 the step leaves the state's bits as they are
/// (`S · 1 + k · 0`, however rounded) and gives `Sᵀq`; with beta 1, one key
/// channel and k = ±1, the new state row is `v · k` (the rule's exact write),
/// so the output is `v · k · q`.
#[test]
fn delta_steps_hold_their_edge_cases() {
    for table in tables() {
        let step = table.delta_fn();
        let mut s = 5u64;
        for (dk, dv) in [(1, 1), (3, 17), (33, 130), (128, 128)] {
            let what = format!("{} dk={dk} dv={dv}", table.isa());
            let s0: Vec<f32> = (0..dk * dv).map(|_| lcg(&mut s)).collect();
            let k = unit(&mut s, dk, 1.0);
            let q = unit(&mut s, dk, 1.0);
            let v: Vec<f32> = (0..dv).map(|_| lcg(&mut s)).collect();
            let mut got = s0.clone();
            let mut out = vec![0f32; dv];
            step(&mut got, &[1.0], &k, &v, 0.0, &q, &mut out);
            assert_eq!(got, s0, "{what}: beta 0, decay 1 changed the state");
            let sq: Vec<f32> = (0..dv).map(|j| (0..dk).map(|i| s0[i * dv + j] * q[i]).sum()).collect();
            delta_close(&out, &sq, &format!("{what}: beta 0: out"));
        }
        for (kk, dv) in [(1f32, 1), (-1.0, 7), (1.0, 130)] {
            let mut st: Vec<f32> = (0..dv).map(|_| lcg(&mut s)).collect();
            let v: Vec<f32> = (0..dv).map(|_| lcg(&mut s)).collect();
            let mut out = vec![0f32; dv];
            step(&mut st, &[0.75], &[kk], &v, 1.0, &[0.5], &mut out);
            let row: Vec<f32> = v.iter().map(|v| v * kk).collect();
            let o: Vec<f32> = row.iter().map(|r| r * 0.5).collect();
            let what = format!("{} beta 1, k {kk}, dv={dv}", table.isa());
            delta_close(&st, &row, &format!("{what}: state"));
            delta_close(&out, &o, &format!("{what}: out"));
        }
    }
}

#[test]
#[should_panic(expected = "decay values")]
fn delta_step_refuses_a_decay_of_the_wrong_length() {
    let (mut st, mut out) = (vec![0f32; 6], vec![0f32; 2]);
    delta_fn()(&mut st, &[1.0, 1.0], &[1.0, 0.0, 0.0], &[1.0, 2.0], 0.5, &[1.0, 0.0, 0.0], &mut out);
}
