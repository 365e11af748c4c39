//! Engine-level invariants on a random model: the way a sequence is fed
//! (one pass, chunks, token by token) and the thread count change nothing.

use super::*;
use crate::model::forward::{Capture, forward};
use crate::model::store::StoreOptions;
use crate::quant::DType;
use crate::synth::{config_for, write_random_model};

fn engine(dtype: DType, threads: usize) -> (tempfile::TempDir, Engine) {
    engine_with(&config_for(dtype), dtype, threads)
}

fn engine_with(
    cfg: &crate::canonical::config::ModelConfig,
    dtype: DType,
    threads: usize,
) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.colibri");
    write_random_model(&p, cfg, dtype, 9);
    let e = Engine::open(&p, &EngineOptions { threads: Some(threads), ..Default::default() }).unwrap();
    (dir, e)
}

fn ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 53).collect()
}

#[test]
fn prefill_then_decode_equals_one_full_forward() {
    let frontier = crate::synth::frontier_config();
    let hybrid = crate::synth::hybrid_config();
    let kda = crate::synth::kda_hybrid_config();
    let cases = DType::ALL
        .map(|dt| (dt, config_for(dt)))
        .into_iter()
        .chain(DType::ALL.map(|dt| (dt, frontier.clone())))
        .chain(DType::ALL.map(|dt| (dt, hybrid.clone())))
        .chain(DType::ALL.map(|dt| (dt, kda.clone())))
        .chain(DType::ALL.map(|dt| (dt, crate::synth::mamba_hybrid_config())))
        .chain(DType::ALL.map(|dt| (dt, crate::synth::gemma4_config())))
        .chain(DType::ALL.map(|dt| (dt, crate::synth::sparse_config())))
        .chain(DType::ALL.map(|dt| (dt, crate::synth::block_sparse_config())))
        .chain([DType::F32, DType::Bf16].map(|dt| (dt, crate::synth::pooled_config())));
    for (dt, cfg) in cases {
        let (_d, e) = engine_with(&cfg, dt, 2);
        let toks = ids(29);
        let full = e.logits(&toks, &never).unwrap();
        let v = e.model().config.vocab_size;
        let mut s = e.session(toks.len());
        e.run(&mut s, &toks[..11], Capture::default(), &never).unwrap();
        assert_eq!(s.seq.logits, full[10 * v..11 * v], "{dt}: prefill's last row");
        for (i, &t) in toks.iter().enumerate().skip(11) {
            e.run(&mut s, &[t], Capture::default(), &never).unwrap();
            assert_eq!(s.seq.logits, full[i * v..(i + 1) * v], "{dt}: decode at position {i}");
        }
    }
}

/// A sequence rolled back and fed again gives the bits of one plain
/// prefill: the same tokens again, or others in place of rejected ones, on
/// GQA with sliding-window layers and on MLA, f32 and f16 caches.
#[test]
fn truncating_and_feeding_again_equals_a_plain_prefill() {
    let block_sparse = crate::synth::block_sparse_config();
    for cfg in [config_for(DType::F32), crate::synth::frontier_config(), crate::synth::sparse_config(), block_sparse] {
        let (_d, e) = engine_with(&cfg, DType::F32, 2);
        let v = e.model().config.vocab_size;
        let toks = ids(if cfg.attention.block_index.is_some() { 16 } else { 10 });
        let want = e.logits(&toks, &never).unwrap();
        let rejected: Vec<u32> = toks.iter().map(|&t| (t + 5) % v as u32).collect();
        for kv_dtype in [DType::F32, DType::F16] {
            let want = if kv_dtype == DType::F32 {
                want.clone()
            } else {
                let mut s = Session::with_kv(e.model(), 16, DEFAULT_CHUNK, kv_dtype);
                let mut got = vec![0.0; toks.len() * v];
                forward(
                    e.model(),
                    &mut s,
                    &toks,
                    Capture { logits: Some(&mut got), ..Capture::default() },
                    None,
                    &never,
                )
                .unwrap();
                got
            };
            for first in [&toks[6..], &rejected[6..]] {
                let mut s = Session::with_kv(e.model(), 16, DEFAULT_CHUNK, kv_dtype);
                e.run(&mut s, &toks[..6], Capture::default(), &never).unwrap();
                e.run(&mut s, first, Capture::default(), &never).unwrap();
                assert_eq!(s.pos(), toks.len());
                s.truncate(6).unwrap();
                assert_eq!(s.pos(), 6);
                let mut got = vec![0.0; (toks.len() - 6) * v];
                let cap = Capture { logits: Some(&mut got), ..Capture::default() };
                e.run(&mut s, &toks[6..], cap, &never).unwrap();
                assert_eq!(got, want[6 * v..], "{kv_dtype} cache, fed {first:?} before the rollback");
            }
            let mut s = Session::with_kv(e.model(), 16, DEFAULT_CHUNK, kv_dtype);
            e.run(&mut s, &toks[..3], Capture::default(), &never).unwrap();
            assert!(matches!(s.truncate(4), Err(Error::InvalidInput(_))), "only back");
            assert_eq!(s.pos(), 3);
            s.truncate(3).unwrap();
            s.truncate(0).unwrap();
            assert_eq!(s.pos(), 0);
        }
    }
}

#[test]
fn chunked_prefill_equals_single_pass() {
    let cases = [
        (config_for(DType::F32), DType::F32),
        (crate::synth::hybrid_config(), DType::Q8_0),
        (crate::synth::kda_hybrid_config(), DType::F32),
        (crate::synth::mamba_hybrid_config(), DType::Q8_0),
        (crate::synth::gemma4_config(), DType::Q4_0),
        (crate::synth::sparse_config(), DType::F32),
        (crate::synth::sparse_config(), DType::Q8_0),
        (crate::synth::block_sparse_config(), DType::F32),
        (crate::synth::block_sparse_config(), DType::Q8_0),
        (crate::synth::pooled_config(), DType::F32),
    ];
    for (cfg, dt) in cases {
        let (_d, e) = engine_with(&cfg, dt, 2);
        let toks = ids(40);
        let v = e.model().config.vocab_size;
        let want = e.logits(&toks, &never).unwrap();
        for chunk in [1, 3, 7, 40] {
            let mut s = session::Session::new(e.model(), toks.len(), chunk);
            let mut got = vec![0.0; toks.len() * v];
            forward(e.model(), &mut s, &toks, Capture { logits: Some(&mut got), ..Capture::default() }, None, &never)
                .unwrap();
            assert_eq!(got, want, "{dt} chunk size {chunk}");
        }
    }
}

/// A linear-attention model rolls back to its start (the zero state), to
/// its checkpoint (the saved states) or nowhere: the recurrent state keeps
/// no per-position history. Fed again from there, the logits are those of a
/// plain prefill, whatever was fed (and dropped) in between.
#[test]
fn a_hybrid_sequence_goes_back_to_its_start_or_its_checkpoint() {
    let configs = [
        crate::synth::hybrid_config(),
        crate::synth::kda_hybrid_config(),
        crate::synth::mamba_hybrid_config(),
        crate::synth::pooled_config(),
    ];
    for cfg in configs {
        let (_d, e) = engine_with(&cfg, DType::F32, 2);
        let v = e.model().config.vocab_size;
        let toks = ids(12);
        let want = e.logits(&toks, &never).unwrap();
        let mut s = e.session(16);
        e.run(&mut s, &toks[..7], Capture::default(), &never).unwrap();
        assert!(matches!(s.truncate(3), Err(Error::InvalidInput(_))));
        assert_eq!(s.pos(), 7);
        s.truncate(7).unwrap();
        s.truncate(0).unwrap();
        let mut got = vec![0.0; want.len()];
        e.run(&mut s, &toks, Capture { logits: Some(&mut got), ..Capture::default() }, &never).unwrap();
        assert_eq!(got, want);
        s.reset();
        e.run(&mut s, &toks[..5], Capture::default(), &never).unwrap();
        assert_eq!(s.seq.logits, want[4 * v..5 * v]);
        // Checkpoint at 5, feed drafts (the right ones, then wrong ones),
        // go back to 5 each time and feed the right ones.
        s.checkpoint();
        let wrong: Vec<u32> = toks[5..9].iter().map(|&t| (t + 7) % v as u32).collect();
        for drafts in [&toks[5..9], &wrong[..]] {
            e.run(&mut s, drafts, Capture::default(), &never).unwrap();
            assert!(matches!(s.truncate(6), Err(Error::InvalidInput(_))), "only to the checkpoint");
            s.truncate(5).unwrap();
            let mut got = vec![0.0; 7 * v];
            e.run(&mut s, &toks[5..], Capture { logits: Some(&mut got), ..Capture::default() }, &never).unwrap();
            assert_eq!(got, want[5 * v..], "after dropping {drafts:?}");
            s.truncate(5).unwrap();
        }
        // Going back before the checkpoint forgets it.
        s.truncate(0).unwrap();
        e.run(&mut s, &toks[..6], Capture::default(), &never).unwrap();
        assert!(matches!(s.truncate(5), Err(Error::InvalidInput(_))));
    }
}

#[test]
fn thread_count_does_not_change_a_single_bit() {
    let toks = ids(23);
    let hybrid = crate::synth::hybrid_config();
    let cases = [
        (crate::synth::frontier_config(), DType::Q4_1),
        (crate::synth::frontier_config(), DType::F32),
        (hybrid.clone(), DType::F32),
        (hybrid, DType::Q4_0),
        (crate::synth::kda_hybrid_config(), DType::Q8_0),
        (crate::synth::mamba_hybrid_config(), DType::F32),
        (crate::synth::gemma4_config(), DType::Q8_0),
        (crate::synth::sparse_config(), DType::F32),
        (crate::synth::block_sparse_config(), DType::Q8_0),
        (crate::synth::pooled_config(), DType::F32),
    ];
    for (cfg, dt) in cases {
        let (_a, one) = engine_with(&cfg, dt, 1);
        let (_b, three) = engine_with(&cfg, dt, 3);
        assert_eq!(three.logits(&toks, &never).unwrap(), one.logits(&toks, &never).unwrap(), "frontier {dt}");
    }
    let (_a, one) = engine(DType::Bf16, 1);
    let (_b, two) = engine(DType::Bf16, 2);
    let (_c, three) = engine(DType::Bf16, 3);
    let want = one.logits(&toks, &never).unwrap();
    assert_eq!(two.logits(&toks, &never).unwrap(), want);
    assert_eq!(three.logits(&toks, &never).unwrap(), want);
    // Every sampling knob at once: the same seed gives the same tokens.
    let sampling = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.95,
        min_p: 0.01,
        repetition_penalty: 1.2,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        seed: 5,
    };
    let opts = GenerateOptions { max_new_tokens: 9, sampling, stop_ids: vec![], ..Default::default() };
    let g1 = one.generate(&toks[..4], &opts, &never, &mut |_| true).unwrap();
    assert_eq!(g1.len(), 9);
    assert_eq!(two.generate(&toks[..4], &opts, &never, &mut |_| true).unwrap(), g1);
    assert_eq!(three.generate(&toks[..4], &opts, &never, &mut |_| true).unwrap(), g1);
}

#[test]
fn greedy_generation_matches_argmax_of_full_forwards() {
    let (_d, e) = engine(DType::F16, 2);
    let mut seq = ids(5);
    let opts = GenerateOptions { max_new_tokens: 6, ..Default::default() };
    let got = e.generate(&seq, &opts, &never, &mut |_| true).unwrap();
    let v = e.model().config.vocab_size;
    for &g in &got {
        let l = e.logits(&seq, &never).unwrap();
        assert_eq!(sampling::argmax(&l[(seq.len() - 1) * v..]), g);
        seq.push(g);
    }
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let (_d, e) = engine(DType::F32, 1);
    assert!(matches!(e.logits(&[], &never), Err(Error::InvalidInput(_))));
    let msg = e.logits(&[1, 2, 53], &never).unwrap_err().to_string();
    assert!(msg.contains("53") && msg.contains("position 2"), "{msg}");
    assert!(matches!(e.logits(&ids(65), &never), Err(Error::ContextOverflow(_))));
    assert!(matches!(
        e.generate(&ids(65), &GenerateOptions::default(), &never, &mut |_| true),
        Err(Error::ContextOverflow(_))
    ));
    // Generation stops when the context is full instead of failing.
    let opts = GenerateOptions { max_new_tokens: 100, ..Default::default() };
    assert_eq!(e.generate(&ids(60), &opts, &never, &mut |_| true).unwrap().len(), 4);
    assert!(matches!(e.logits(&ids(3), &|| true), Err(Error::Interrupted)));
}

#[test]
fn hidden_states_end_with_the_final_norm_of_the_last_layer() {
    let (_d, e) = engine(DType::F32, 2);
    let toks = ids(6);
    let c = &e.model().config;
    let (l, d) = (c.num_layers(), c.hidden_size);
    let h = e.hidden_states(&toks, &never).unwrap();
    assert_eq!(h.len(), (l + 1) * toks.len() * d);
    // Row 0 is the embedding of each token.
    let mut row = vec![0.0; d];
    e.model().mat(e.model().embedding()).decode_row(toks[2] as usize, &mut row);
    assert_eq!(&h[2 * d..3 * d], &row[..]);
    // The last slot has unit RMS up to the norm weights: not the raw residual.
    assert_ne!(&h[l * toks.len() * d..], &h[(l - 1) * toks.len() * d..l * toks.len() * d]);
}

#[test]
fn a_generation_reports_why_it_ended_and_how_long_it_took() {
    let (_d, e) = engine(DType::F32, 2);
    let prompt = ids(7);
    let greedy =
        e.generate(&prompt, &GenerateOptions { max_new_tokens: 6, ..Default::default() }, &never, &mut |_| true);
    let greedy = greedy.unwrap();

    let mut g = e.start(&prompt, &GenerateOptions { max_new_tokens: 6, ..Default::default() }).unwrap();
    assert_eq!(g.finish_reason(), None);
    let mut got = Vec::new();
    while let Some(t) = g.next_token(&never).unwrap() {
        got.push(t);
    }
    assert_eq!(got, greedy);
    assert_eq!(g.finish_reason(), Some(FinishReason::Length));
    assert_eq!(g.next_token(&never).unwrap(), None, "a finished generation stays finished");
    let t = g.timings();
    assert_eq!((t.prompt_tokens, t.generated_tokens), (7, 6));
    assert!(t.prefill > std::time::Duration::ZERO && t.decode > std::time::Duration::ZERO);
    assert!(t.prefill_tokens_per_second() > 0.0 && t.decode_tokens_per_second() > 0.0);

    // A stop id ends it with "stop" and is kept.
    let stop = greedy[2];
    let opts = GenerateOptions { max_new_tokens: 6, stop_ids: vec![stop], ..Default::default() };
    let mut g = e.start(&prompt, &opts).unwrap();
    while g.next_token(&never).unwrap().is_some() {}
    let first = greedy.iter().position(|&t| t == stop).unwrap();
    assert_eq!(g.tokens(), &greedy[..=first]);
    assert_eq!(g.finish_reason(), Some(FinishReason::Stop));

    // Zero new tokens: finished at once, nothing computed.
    let mut g = e.start(&prompt, &GenerateOptions { max_new_tokens: 0, ..Default::default() }).unwrap();
    assert_eq!(g.next_token(&never).unwrap(), None);
    assert_eq!(g.finish_reason(), Some(FinishReason::Length));
}

#[test]
fn an_interrupted_generation_fails_and_the_engine_goes_on() {
    let (_d, e) = engine(DType::F32, 2);
    let opts = GenerateOptions { max_new_tokens: 5, ..Default::default() };
    let want = e.generate(&ids(9), &opts, &never, &mut |_| true).unwrap();
    let mut g = e.start(&ids(9), &opts).unwrap();
    g.next_token(&never).unwrap();
    assert!(matches!(g.next_token(&|| true), Err(Error::Interrupted)));
    assert!(matches!(g.next_token(&never), Err(Error::InvalidInput(_))), "no resuming a half-run step");
    assert_eq!(e.generate(&ids(9), &opts, &never, &mut |_| true).unwrap(), want);
}

#[test]
fn bad_sampling_options_are_refused_before_any_work() {
    let (_d, e) = engine(DType::F32, 1);
    let opts = GenerateOptions {
        sampling: SamplingParams { top_p: 2.0, temperature: 1.0, ..Default::default() },
        ..Default::default()
    };
    let err = e.start(&ids(3), &opts).unwrap_err();
    assert!(matches!(&err, Error::InvalidInput(m) if m.contains("top_p")), "{err}");
    assert!(matches!(e.start(&[], &GenerateOptions::default()), Err(Error::InvalidInput(_))));
}

#[test]
fn a_generation_outlives_the_engine_handle_that_started_it() {
    let (_d, e) = engine(DType::F32, 1);
    let opts = GenerateOptions { max_new_tokens: 3, ..Default::default() };
    let want = e.generate(&ids(4), &opts, &never, &mut |_| true).unwrap();
    let mut g = e.start(&ids(4), &opts).unwrap();
    drop(e);
    let mut got = Vec::new();
    while let Some(t) = g.next_token(&never).unwrap() {
        got.push(t);
    }
    assert_eq!(got, want);
}

/// Top-1 agreement and mean KL(f32 ‖ q) of a quantised model against the
/// same weights in f32, over every position of a 48-token sequence.
fn agreement(dtype: DType) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = crate::synth::tiny_config_blocks();
    let (pf, pq) = (dir.path().join("f.colibri"), dir.path().join("q.colibri"));
    write_random_model(&pf, &cfg, DType::F32, 4);
    write_random_model(&pq, &cfg, dtype, 4);
    let ef = Engine::open(&pf, &EngineOptions { threads: Some(2), ..Default::default() }).unwrap();
    let eq = Engine::open(&pq, &EngineOptions { threads: Some(2), ..Default::default() }).unwrap();
    let toks: Vec<u32> = (0..48u32).map(|i| (i * 29 + 3) % 61).collect();
    let (lf, lq) = (ef.logits(&toks, &never).unwrap(), eq.logits(&toks, &never).unwrap());
    let v = cfg.vocab_size;
    let (mut agree, mut kl) = (0usize, 0f64);
    for t in 0..toks.len() {
        let (a, b) = (&lf[t * v..(t + 1) * v], &lq[t * v..(t + 1) * v]);
        agree += (sampling::argmax(a) == sampling::argmax(b)) as usize;
        let lse = |x: &[f32]| {
            let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            m + x.iter().map(|&y| (y as f64 - m).exp()).sum::<f64>().ln()
        };
        let (za, zb) = (lse(a), lse(b));
        kl += a.iter().zip(b).map(|(&x, &y)| (x as f64 - za).exp() * ((x as f64 - za) - (y as f64 - zb))).sum::<f64>();
    }
    (agree as f64 / toks.len() as f64, kl / toks.len() as f64)
}

#[test]
fn quantised_types_stay_close_to_f32() {
    // A random 3-layer model with uniformly distributed weights and flat
    // logits is a harsh case: 4-bit codes carry ~8% relative error per matrix
    // and three layers compound it, so near-ties flip. Measured here: q8_0
    // top-1 0.979 / KL 4.8e-4; q4_1 0.667 / 5.9e-2; q4_0 0.458 / 1.0e-1.
    // Asserted: q8_0 is near-lossless, the 4-bit types stay bounded, and
    // q4_1 (the better 4-bit type) beats q4_0 clearly. Figures on the parity
    // fixtures and the trained demo model are in docs/accuracy.md.
    let (t8, k8) = agreement(DType::Q8_0);
    let (_, k41) = agreement(DType::Q4_1);
    let (_, k40) = agreement(DType::Q4_0);
    eprintln!("KL: q8_0 {k8:.2e} (top-1 {t8:.3}), q4_1 {k41:.2e}, q4_0 {k40:.2e}");
    assert!(t8 >= 0.95 && k8 <= 2e-3, "q8_0: top-1 {t8}, KL {k8}");
    assert!(k41 <= 0.2 && k40 <= 0.3, "4-bit KL out of bounds: q4_1 {k41}, q4_0 {k40}");
    assert!(k41 < 0.8 * k40, "q4_1 ({k41}) should be clearly closer to f32 than q4_0 ({k40})");
}

#[test]
fn an_f16_kv_cache_is_exact_across_feeding_and_threads_and_close_to_f32() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.colibri");
    write_random_model(&p, &config_for(DType::F32), DType::F32, 9);
    let open = |threads, kv_cache| {
        Engine::open(&p, &EngineOptions { threads: Some(threads), kv_cache, ..Default::default() }).unwrap()
    };
    let (f32_kv, f16_kv, f16_kv3) =
        (open(2, session::KvCacheType::Auto), open(2, session::KvCacheType::F16), open(3, session::KvCacheType::F16));
    assert_eq!((f32_kv.kv_dtype(), f16_kv.kv_dtype()), (DType::F32, DType::F16));
    let toks = ids(40);
    let v = f32_kv.model().config.vocab_size;
    let want = f32_kv.logits(&toks, &never).unwrap();
    let got = f16_kv.logits(&toks, &never).unwrap();
    assert_eq!(f16_kv3.logits(&toks, &never).unwrap(), got, "thread count");
    // Token by token gives the same bits as one pass.
    let mut s = f16_kv.session(toks.len());
    for (i, &t) in toks.iter().enumerate() {
        f16_kv.run(&mut s, &[t], Capture::default(), &never).unwrap();
        assert_eq!(s.seq.logits, got[i * v..(i + 1) * v], "decode at position {i}");
    }
    // f16 keeps 11 bits of mantissa: relative error ~5e-4 per cached value.
    let range = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = want.iter().zip(&got).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst > 0.0 && worst < 1e-2 * range, "f16 cache moved logits by {worst} (range {range})");
    // Block-quantised models default to the f16 cache.
    let q = dir.path().join("q.colibri");
    write_random_model(&q, &config_for(DType::Q8_0), DType::Q8_0, 9);
    let e = Engine::open(&q, &EngineOptions::default()).unwrap();
    assert_eq!(e.kv_dtype(), DType::F16);
}

#[test]
fn a_batch_of_sequences_gives_each_the_bits_it_gets_alone() {
    use crate::model::forward::{Segment, forward_batch};
    use session::{Sequence, Workspace};
    let frontier = crate::synth::frontier_config();
    let hybrid = crate::synth::hybrid_config();
    let kda = crate::synth::kda_hybrid_config();
    let cases = DType::ALL
        .map(|dt| (dt, config_for(dt)))
        .into_iter()
        .chain(DType::ALL.map(|dt| (dt, frontier.clone())))
        .chain(DType::ALL.map(|dt| (dt, hybrid.clone())))
        .chain(DType::ALL.map(|dt| (dt, kda.clone())))
        .chain(DType::ALL.map(|dt| (dt, crate::synth::mamba_hybrid_config())))
        .chain(DType::ALL.map(|dt| (dt, crate::synth::gemma4_config())))
        .chain(DType::ALL.map(|dt| (dt, crate::synth::sparse_config())))
        .chain([DType::F32, DType::Bf16].map(|dt| (dt, crate::synth::pooled_config())));
    for (dt, cfg) in cases {
        let (_d, e) = engine_with(&cfg, dt, 2);
        let m = e.model();
        let v = m.config.vocab_size;
        // Four sequences of their own tokens, each alone in one pass.
        let streams: Vec<Vec<u32>> =
            (0..4u32).map(|k| (0..24u32).map(|i| (i * 31 + k * 17 + 5) % 53).collect()).collect();
        let alone: Vec<Vec<f32>> = streams.iter().map(|t| e.logits(t, &never).unwrap()).collect();
        let mut seqs: Vec<Sequence> = (0..4).map(|_| Sequence::new(m, 24, 12, e.kv_dtype())).collect();
        let mut ws = Workspace::new(m, 12, 4);
        // Steps of (tokens per sequence, logits wanted): prompts of unequal
        // lengths fed over several passes beside sequences that decode.
        let steps: [[(usize, bool); 4]; 6] = [
            [(1, true), (5, true), (6, false), (0, false)],
            [(1, true), (1, true), (3, true), (7, false)],
            [(1, true), (1, true), (1, true), (6, true)],
            [(4, true), (1, true), (1, true), (1, true)],
            [(1, true), (1, true), (1, true), (1, true)],
            [(2, true), (3, true), (1, false), (1, true)],
        ];
        for (step, plan) in steps.iter().enumerate() {
            let mut segs: Vec<Segment> = Vec::new();
            for ((seq, stream), &(n, logits)) in seqs.iter_mut().zip(&streams).zip(plan) {
                if n > 0 {
                    let p = seq.pos;
                    segs.push(Segment { seq, tokens: &stream[p..p + n], end: p + n, logit_rows: usize::from(logits) });
                }
            }
            forward_batch(m, &mut ws, &mut segs, None).unwrap();
            for (k, (seq, &(n, logits))) in seqs.iter().zip(plan).enumerate() {
                if n > 0 && logits {
                    let row = seq.pos - 1;
                    assert_eq!(seq.logits, alone[k][row * v..(row + 1) * v], "{dt}: step {step}, sequence {k}");
                }
            }
        }
        // A batch larger than the workspace is refused, not run.
        let mut big = Sequence::new(m, 24, 12, e.kv_dtype());
        let toks = ids(13);
        let err =
            forward_batch(m, &mut ws, &mut [Segment { seq: &mut big, tokens: &toks, end: 13, logit_rows: 1 }], None);
        assert!(matches!(err, Err(Error::InvalidInput(_))), "{dt}: {err:?}");
    }
}

fn collect(t: &mut Ticket) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some(tok) = t.next_token(&never).unwrap() {
        out.push(tok);
    }
    out
}

#[test]
fn batched_generations_give_the_tokens_each_gives_alone() {
    let frontier = crate::synth::frontier_config();
    let cases = [DType::F32, DType::Q8_0, DType::Q4K]
        .map(|dt| (dt, config_for(dt)))
        .into_iter()
        .chain([(DType::Q4_0, frontier)]);
    for (dt, cfg) in cases {
        let (_d, e) = engine_with(&cfg, dt, 2);
        // A small step budget, so prompts are fed in pieces beside decoders.
        let sched = Scheduler::new(&e, BatchOptions { max_batch: 4, step_tokens: 8, ..Default::default() }).unwrap();
        let prompts: Vec<Vec<u32>> =
            (0..8u32).map(|k| (0..1 + 3 * k).map(|i| (i * 29 + k * 7 + 3) % 53).collect()).collect();
        let opts = |k: usize| GenerateOptions {
            max_new_tokens: 6 + k,
            sampling: if k.is_multiple_of(2) {
                SamplingParams::default()
            } else {
                SamplingParams { temperature: 0.8, top_p: 0.9, seed: k as u64, ..SamplingParams::default() }
            },
            stop_ids: Vec::new(),
            // Some ask for log-probabilities (which change no token).
            logprobs: [None, Some(0), Some(3)][k % 3],
            constraint: None,
            speculation: None,
            prediction: Vec::new(),
        };
        let alone: Vec<(Vec<u32>, Vec<TokenLogprobs>)> = prompts
            .iter()
            .enumerate()
            .map(|(k, p)| {
                let mut g = e.start(p, &opts(k)).unwrap();
                while g.next_token(&never).unwrap().is_some() {}
                (g.tokens().to_vec(), g.logprobs().to_vec())
            })
            .collect();
        let mut tickets: Vec<Ticket> =
            prompts.iter().enumerate().map(|(k, p)| sched.submit(p, &opts(k)).unwrap()).collect();
        for (k, t) in tickets.iter_mut().enumerate() {
            assert_eq!(collect(t), alone[k].0, "{dt}: request {k}");
            assert_eq!(t.logprobs(), alone[k].1, "{dt}: request {k}: the same log-probabilities");
            let want = opts(k).logprobs.map_or(0, |_| 6 + k);
            assert_eq!(t.logprobs().len(), want);
            assert!(t.logprobs().iter().all(|l| Some(l.top.len()) == opts(k).logprobs));
            assert_eq!(t.finish_reason(), Some(FinishReason::Length));
            assert_eq!(t.timings().generated_tokens, 6 + k);
        }
        let st = sched.stats();
        assert!(st.step_sequences[2..].iter().sum::<u64>() > 0, "{dt}: no step ran two decoders: {st:?}");
        assert_eq!(st.generated_tokens, (0..8).map(|k| 6 + k as u64).sum::<u64>());
        assert_eq!(st.prompt_tokens, prompts.iter().map(|p| p.len() as u64).sum::<u64>());
    }
}

#[test]
fn token_logprobs_are_a_normalised_log_softmax() {
    let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5, 1e-3];
    let t = TokenLogprobs::of(&logits, 4, 3);
    let total: f64 = (0..logits.len() as u32).map(|i| (TokenLogprobs::of(&logits, i, 0).logprob as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-6, "{total}");
    let lse = logits.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
    assert!((t.logprob as f64 - (0.5 - lse)).abs() < 1e-6);
    // Most likely first; of two equal ones the lower id first.
    assert_eq!(t.top.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 3, 0]);
    assert_eq!(t.top[0].1, t.top[1].1);
    assert!(t.top[1].1 > t.top[2].1);
    // More asked than there are tokens: all of them; none asked: none.
    assert_eq!(TokenLogprobs::of(&logits, 0, 20).top.len(), logits.len());
    assert!(TokenLogprobs::of(&logits, 0, 0).top.is_empty());
    // Huge logits do not overflow.
    let big = TokenLogprobs::of(&[1e30, 1e30 - 1e24, 0.0], 0, 1);
    assert!(big.logprob.is_finite() && big.logprob <= 0.0);
}

#[test]
fn a_scheduler_refuses_bad_requests_and_survives_cancellation() {
    let (_d, e) = engine(DType::Q8_0, 2);
    let sched =
        Scheduler::new(&e, BatchOptions { max_batch: 2, step_tokens: 16, max_queue: 2, ..Default::default() }).unwrap();
    let long = GenerateOptions { max_new_tokens: 40, ..GenerateOptions::default() };
    // Refused at submission: empty prompt, id out of range, bad sampling.
    assert!(matches!(sched.submit(&[], &long), Err(Error::InvalidInput(_))));
    assert!(matches!(sched.submit(&[1, 999_999], &long), Err(Error::InvalidInput(_))));
    let bad = GenerateOptions { sampling: SamplingParams { top_p: 2.0, ..SamplingParams::default() }, ..long.clone() };
    assert!(matches!(sched.submit(&[1, 2], &bad), Err(Error::InvalidInput(_))));
    let bad = GenerateOptions { logprobs: Some(21), ..long.clone() };
    assert!(matches!(sched.submit(&[1, 2], &bad), Err(Error::InvalidInput(m)) if m.contains("logprobs")));
    // Nothing to generate: finished at once.
    let mut none = sched.submit(&[1, 2], &GenerateOptions { max_new_tokens: 0, ..long.clone() }).unwrap();
    assert_eq!(none.next_token(&never).unwrap(), None);
    // Three requests, the first two running (they have tokens) before the third comes.
    let mut t: Vec<Ticket> = (0..2).map(|k| sched.submit(&ids(3 + k), &long).unwrap()).collect();
    t.iter_mut().for_each(|t| assert!(t.next_token(&never).unwrap().is_some()));
    t.push(sched.submit(&ids(5), &long).unwrap());
    // A full queue refuses: two run, the queue holds two more, the next
    // submission (kept alive, so not cancelled) is Busy.
    let mut held = Vec::new();
    let full = loop {
        match sched.submit(&ids(2), &GenerateOptions { max_new_tokens: 1_000, ..long.clone() }) {
            Ok(h) if held.len() < 50 => held.push(h),
            other => break other,
        }
    };
    assert!(matches!(full, Err(Error::Busy(_))), "{full:?}");
    drop(held);
    // One is dropped mid-way, one interrupted; the others finish unchanged.
    drop(t.remove(0));
    assert!(matches!(t[0].next_token(&|| true), Err(Error::Interrupted) | Ok(Some(_))));
    let alone = e.generate(&ids(5), &long, &never, &mut |_| true).unwrap();
    assert_eq!(collect(&mut t[1]), alone);
    let after = sched.submit(&ids(5), &long).unwrap();
    drop(t);
    let mut after = after;
    assert_eq!(collect(&mut after), alone, "the scheduler still serves");
    // Closing the scheduler fails what still runs, with an error.
    let mut left = sched.submit(&ids(4), &GenerateOptions { max_new_tokens: 1_000, ..long }).unwrap();
    assert!(left.next_token(&never).unwrap().is_some());
    drop(sched);
    let mut r = Ok(Some(0));
    while let Ok(Some(_)) = r {
        r = left.next_token(&never);
    }
    assert!(r.is_err(), "{r:?}");
}

/// The scheduler admits by state bytes: under a budget one sequence fills,
/// sequences run one after another (never two decoding in one step) and
/// give the tokens they give alone; one that alone needs more is refused.
#[test]
fn a_state_budget_admits_sequences_by_their_bytes() {
    let (_d, e) = engine_with(&crate::synth::hybrid_config(), DType::F32, 2);
    let opts = GenerateOptions { max_new_tokens: 5, ..GenerateOptions::default() };
    let layout = e.state_layout();
    assert!(layout.bytes_per_sequence > 0 && layout.bytes_per_token > 0);
    let one = layout.bytes_for(6 + 5);
    let budget = BatchOptions { max_batch: 4, max_state_bytes: one + one / 2, ..Default::default() };
    let sched = Scheduler::new(&e, budget).unwrap();
    let prompts: Vec<Vec<u32>> = (0..3).map(|k| ids(6).iter().map(|t| (t + k) % 53).collect()).collect();
    let mut tickets: Vec<Ticket> = prompts.iter().map(|p| sched.submit(p, &opts).unwrap()).collect();
    for (p, t) in prompts.iter().zip(&mut tickets) {
        assert_eq!(collect(t), e.generate(p, &opts, &never, &mut |_| true).unwrap());
    }
    assert!(sched.stats().step_sequences[2..].iter().all(|&n| n == 0), "{:?}", sched.stats().step_sequences);
    let long = GenerateOptions { max_new_tokens: 40, ..opts };
    assert!(matches!(sched.submit(&ids(6), &long), Err(Error::ContextOverflow(_))));
}

/// A sliding-window layer's cache keeps only its window (and a rollback
/// reach) and slides as the sequence grows: fed in small passes or token
/// by token it gives the bits of one pass over a cache of every position,
/// on GQA and on MLA, and it goes back only as far as it still holds.
#[test]
fn a_sliding_window_cache_slides_and_gives_the_bits_of_a_full_one() {
    for mut cfg in [config_for(DType::F32), crate::synth::frontier_config()] {
        cfg.max_seq_len = 400;
        let (_d, e) = engine_with(&cfg, DType::F32, 2);
        let v = e.model().config.vocab_size;
        let toks = ids(300);
        // One pass: the window's cache holds all 300 rows and never slides.
        let want = e.logits(&toks, &never).unwrap();
        for chunk in [1, 7, 64] {
            let mut s = session::Session::new(e.model(), toks.len(), chunk);
            let mut got = vec![0.0; toks.len() * v];
            forward(e.model(), &mut s, &toks, Capture { logits: Some(&mut got), ..Capture::default() }, None, &never)
                .unwrap();
            assert_eq!(got, want, "chunk {chunk}");
        }
        // Back within the rollback reach, and fed again: the same bits.
        let mut s = session::Session::new(e.model(), toks.len(), 7);
        e.run(&mut s, &toks[..250], Capture::default(), &never).unwrap();
        s.truncate(250 - crate::canonical::state::ROLLBACK).unwrap();
        let at = s.pos();
        let mut got = vec![0.0; (toks.len() - at) * v];
        e.run(&mut s, &toks[at..], Capture { logits: Some(&mut got), ..Capture::default() }, &never).unwrap();
        assert_eq!(got, want[at * v..]);
        // Beyond it: an error, and the sequence is unchanged.
        assert!(matches!(s.truncate(100), Err(Error::InvalidInput(m)) if m.contains("sliding-window")));
        assert_eq!(s.pos(), 300);
        s.reset();
        e.run(&mut s, &toks[..5], Capture::default(), &never).unwrap();
        assert_eq!(s.seq.logits, want[4 * v..5 * v], "after a reset");
    }
}

/// The synthetic vocabulary as text: 52 one-character byte-level tokens
/// (enough for JSON) and an end token, id 52.
const CHARS: &str = "{}[]\":, abcdefghijklmnopqrstuvwxyz0123456789-._ABCDE";

fn with_tiny_tokenizer(e: &Engine) {
    let table: serde_json::Map<String, serde_json::Value> =
        CHARS.chars().enumerate().map(|(i, c)| (if c == ' ' { "Ġ".into() } else { c.to_string() }, i.into())).collect();
    let tok = serde_json::json!({
        "added_tokens": [{"id": 52, "content": "<|end|>", "special": true}],
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": table},
    });
    let guides = guide::Guides::new(&tok, e.model().config.vocab_size, &[52]).unwrap();
    e.guides.set(Ok(Arc::new(guides))).unwrap();
}

fn text(tokens: &[u32]) -> String {
    tokens.iter().filter(|&&t| t != 52).map(|&t| CHARS.chars().nth(t as usize).unwrap()).collect()
}

/// Constrained and free sequences share a batch: the free ones give the
/// tokens they give alone, the constrained ones the tokens they give alone,
/// which follow their constraint (greedy and seeded), and a seed repeats.
#[test]
fn constrained_and_free_sequences_share_a_batch() {
    let (_d, e) = engine(DType::F32, 2);
    with_tiny_tokenizer(&e);
    let schema = r#"{"type": "object", "properties": {"k": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
        "required": ["k", "b"], "additionalProperties": false}"#;
    let hot = SamplingParams { temperature: 0.9, seed: 5, ..SamplingParams::default() };
    let reqs = [
        GenerateOptions { max_new_tokens: 12, ..Default::default() },
        GenerateOptions {
            max_new_tokens: 30,
            stop_ids: vec![52],
            constraint: Some(Constraint::Regex("[a-z]{3,8}".into())),
            ..Default::default()
        },
        GenerateOptions { max_new_tokens: 12, sampling: hot.clone(), ..Default::default() },
        GenerateOptions {
            max_new_tokens: 40,
            sampling: hot,
            stop_ids: vec![52],
            constraint: Some(Constraint::JsonSchema(schema.into())),
            ..Default::default()
        },
    ];
    let prompts: Vec<Vec<u32>> = (0..4u32).map(|k| ids(5 + k as usize)).collect();
    let alone: Vec<Vec<u32>> =
        prompts.iter().zip(&reqs).map(|(p, o)| e.generate(p, o, &never, &mut |_| true).unwrap()).collect();
    let sched = Scheduler::new(&e, BatchOptions { max_batch: 4, ..Default::default() }).unwrap();
    let mut tickets: Vec<Ticket> = prompts.iter().zip(&reqs).map(|(p, o)| sched.submit(p, o).unwrap()).collect();
    for (k, t) in tickets.iter_mut().enumerate() {
        assert_eq!(collect(t), alone[k], "request {k}: batched as alone");
    }
    let word = text(&alone[1]);
    assert!((3..=8).contains(&word.len()) && word.chars().all(|c| c.is_ascii_lowercase()), "{word:?}");
    assert_eq!(tickets[1].finish_reason(), Some(FinishReason::Stop));
    let json: serde_json::Value = serde_json::from_str(&text(&alone[3])).unwrap();
    assert!(json["k"] == "x" || json["k"] == "yy", "{json}");
    assert!(json["b"].is_boolean() && json.as_object().unwrap().len() == 2, "{json}");
    // Cut short by max_new_tokens: "length", as an unconstrained one would be.
    let short = GenerateOptions { max_new_tokens: 3, ..reqs[3].clone() };
    let mut g = e.start(&prompts[3], &short).unwrap();
    while g.next_token(&never).unwrap().is_some() {}
    assert_eq!(g.finish_reason(), Some(FinishReason::Length));
    assert_eq!(g.tokens(), &alone[3][..3], "a seed repeats");
    // A grammar that cannot compile is refused at submission.
    let bad = GenerateOptions { constraint: Some(Constraint::Regex("(".into())), ..Default::default() };
    assert!(matches!(sched.submit(&prompts[0], &bad), Err(Error::InvalidInput(m)) if m.starts_with("regex")));
}

/// One random model per kind of layer state (full and sliding-window KV,
/// MLA's latent, DSA's latent and index keys, Gated DeltaNet, KDA and Mamba2
/// states, Gemma 4's shape, block-sparse GQA's keys, values and index
/// keys), each with room for 400 positions.
fn every_state_kind() -> Vec<crate::canonical::config::ModelConfig> {
    let mut configs = vec![
        config_for(DType::F32),
        crate::synth::frontier_config(),
        crate::synth::sparse_config(),
        crate::synth::hybrid_config(),
        crate::synth::kda_hybrid_config(),
        crate::synth::mamba_hybrid_config(),
        crate::synth::gemma4_config(),
        crate::synth::block_sparse_config(),
        crate::synth::pooled_config(),
    ];
    configs.iter_mut().for_each(|c| c.max_seq_len = 400);
    configs
}

/// A scheduler with a prefix cache gives every request the tokens and
/// log-probabilities of one without, bit for bit, for every kind of layer
/// state (full and sliding-window KV, MLA's latent, DSA's latent and index
/// keys, the recurrent states of Gated DeltaNet and KDA), and starts from
/// cached state where it can: a repeated prompt, a conversation's next
/// turn, a prompt that diverges mid-way. Two requests sharing a prefix run
/// side by side, and a budget too small for everything evicts and stays
/// exact.
#[test]
fn a_prefix_cache_is_exact_for_every_state_kind() {
    use super::prefix::BLOCK;
    for (case, cfg) in every_state_kind().into_iter().enumerate() {
        let (_d, e) = engine_with(&cfg, DType::F32, 2);
        let arch = format!("config {case}");
        let v = e.model().config.vocab_size as u32;
        let opts = GenerateOptions { max_new_tokens: 9, logprobs: Some(2), ..GenerateOptions::default() };
        let batch = BatchOptions { max_batch: 4, step_tokens: 8, ..Default::default() };
        let plain = Scheduler::new(&e, batch).unwrap();
        for budget in [64 << 20, 40 * 1024] {
            let cached = Scheduler::new(&e, BatchOptions { prefix_cache_bytes: budget, ..batch }).unwrap();
            let run = |s: &Scheduler, p: &[u32]| {
                let mut t = s.submit(p, &opts).unwrap();
                let toks = collect(&mut t);
                (toks, t.logprobs().to_vec(), t.timings().cached_tokens)
            };
            let first: Vec<u32> = (0..150).map(|i| (i * 31 + 7) % v).collect();
            let (out, ..) = run(&plain, &first);
            let next: Vec<u32> = first.iter().chain(&out).copied().chain([3, 1, 4]).collect();
            let mut diverged = first[..100].to_vec();
            diverged.extend([5, 9, 2, 6, 5, 3]);
            // (prompt, tokens a big enough cache serves)
            let turns = [
                (&first, 0),
                (&first, (first.len() - 1) / BLOCK * BLOCK),
                // (the last generated token was never fed)
                (&next, (first.len() + out.len() - 1) / BLOCK * BLOCK),
                (&diverged, 100 / BLOCK * BLOCK),
            ];
            for (k, (p, hit)) in turns.iter().enumerate() {
                let want = run(&plain, p);
                let got = run(&cached, p);
                assert_eq!((&got.0, &got.1), (&want.0, &want.1), "{arch}, budget {budget}: turn {k}");
                let hybrid = cfg.linear.is_some() || cfg.pooled().is_some();
                if budget > 1 << 20 {
                    // A hybrid resumes only where its recurrent states were
                    // saved: the prompt's and the generation's last block
                    // ends; the diverging prompt has neither.
                    let hit = if hybrid && k == 3 { 0 } else { *hit };
                    assert_eq!(got.2, hit, "{arch}: turn {k} from the cache");
                }
            }
            // Side by side, sharing the cached prefix.
            let (a, b) = (next[..140].to_vec(), next[..150].iter().map(|t| (t + 1) % v).collect::<Vec<u32>>());
            let mut both = [cached.submit(&a, &opts).unwrap(), cached.submit(&b, &opts).unwrap()];
            for (t, p) in both.iter_mut().zip([&a, &b]) {
                assert_eq!(collect(t), run(&plain, p).0, "{arch}: side by side");
            }
            let st = cached.stats().prefix.expect("a prefix cache");
            assert!(st.bytes <= budget && st.lookups == 6, "{arch}: {st:?}");
            if budget < 1 << 20 {
                assert!(st.evicted > 0, "{arch}: {st:?}");
            } else {
                assert!(st.hits >= 3 && st.evicted == 0, "{arch}: {st:?}");
            }
        }
        assert!(plain.stats().prefix.is_none());
    }
}

/// Speculative decoding with n-gram drafts gives the tokens and
/// log-probabilities of plain decoding, bit for bit, greedy and seeded, for
/// every kind of layer state (rejected drafts roll KV rows back; a
/// linear-attention state goes back to its checkpoint and the confirmed
/// tokens are fed again), alone and beside other requests, with and
/// without a prefix cache, from n-grams of prompt and output and from a
/// predicted output that is wrong in places; drafts are made and confirmed.
#[test]
fn speculative_decoding_changes_no_token() {
    use super::draft::{Drafts, Speculation};
    for (case, cfg) in every_state_kind().into_iter().enumerate() {
        let (_d, e) = engine_with(&cfg, DType::F32, 2);
        let v = e.model().config.vocab_size as u32;
        let mut accepted = 0;
        // A prompt that repeats itself, so n-grams recur.
        let unit: Vec<u32> = (0..9).map(|i| (i * 7 + 3) % v).collect();
        let prompt: Vec<u32> = unit.iter().cycle().take(40).copied().collect();
        let spec = Some(Speculation { drafts: Drafts::Ngram, tokens: 5 });
        for sampling in [
            SamplingParams::default(),
            SamplingParams { temperature: 0.9, top_p: 0.95, seed: 11, ..SamplingParams::default() },
        ] {
            let greedy = sampling.temperature == 0.0;
            let plain = GenerateOptions { max_new_tokens: 80, logprobs: Some(2), sampling, ..Default::default() };
            let fast = GenerateOptions { speculation: spec, ..plain.clone() };
            for prefix_cache_bytes in [0, 8 << 20] {
                let batch = BatchOptions { max_batch: 4, step_tokens: 16, prefix_cache_bytes, ..Default::default() };
                let sched = Scheduler::new(&e, batch).unwrap();
                let mut want = sched.submit(&prompt, &plain).unwrap();
                let want_ids = collect(&mut want);
                // The output as the prediction, wrong at three places: drafts
                // from it hold up to a wrong token, which is rejected there.
                let mut predicted = want_ids.clone();
                for at in [9, 10, 31] {
                    predicted[at] = (predicted[at] + 1) % v;
                }
                // Beside a plain request, and thrice (the later ones from the
                // prefix cache when there is one; the last with the prediction).
                for round in 0..3 {
                    let mut other = sched.submit(&prompt[..13], &plain).unwrap();
                    let prediction = if round == 2 { predicted.clone() } else { Vec::new() };
                    let mut got = sched.submit(&prompt, &GenerateOptions { prediction, ..fast.clone() }).unwrap();
                    assert_eq!(collect(&mut got), want_ids, "config {case}, round {round}");
                    assert_eq!(got.logprobs(), want.logprobs(), "config {case}, round {round}");
                    collect(&mut other);
                    let t = got.timings();
                    // (Greedy output of a random model repeats itself; sampled
                    // output may never repeat an n-gram.)
                    assert!(
                        t.accepted_tokens <= t.drafted_tokens && (t.drafted_tokens > 0 || !greedy),
                        "{case}: {t:?}"
                    );
                    assert_eq!(t.decode_passes + t.accepted_tokens + 1, t.generated_tokens, "config {case}: {t:?}");
                    if round == 2 {
                        assert!(t.accepted_tokens >= 20, "config {case}: the prediction's drafts held: {t:?}");
                    }
                }
                let st = sched.stats();
                assert!(st.accepted_tokens <= st.drafted_tokens, "config {case}: {st:?}");
                accepted += st.accepted_tokens;
            }
        }
        assert!(accepted > 0, "config {case}: no draft was ever confirmed");
    }
}

/// The multi-token-prediction layer keeps its rows exactly through what
/// speculative decoding does to a sequence: prompt chunks, draft steps,
/// verification passes whose rejected drafts are rolled back (KV rows
/// truncated; recurrent states restored from their checkpoint and the
/// confirmed tokens fed again). Its drafts at the end are those of a fresh
/// sequence fed the kept tokens at once, for every state kind the layer can
/// follow (a sparse-attention model's MTP layer is refused at conversion).
#[test]
fn mtp_rows_survive_rollbacks_for_every_state_kind() {
    use crate::canonical::config::{FfnSpec, LayerSpec, MixerSpec, MtpSpec, NormKind};
    use crate::model::forward::mtp_draft;
    use crate::model::session::Session;
    for (case, mut cfg) in every_state_kind().into_iter().enumerate() {
        // (DeepSeek's sparse and pooled models have no MTP layer colibri keeps.)
        if cfg.layers.iter().any(|l| matches!(l.mixer, MixerSpec::Sparse { .. } | MixerSpec::Pooled { .. })) {
            continue;
        }
        let ffn = if cfg.moe.is_some() { FfnSpec::Moe } else { cfg.layers[0].ffn.clone() };
        cfg.layers.push(LayerSpec { mixer: MixerSpec::Attention { window: None }, ffn });
        cfg.mtp = Some(MtpSpec { chain_normed: case % 2 == 0 });
        cfg.norm.kind = NormKind::Rms; // every model with MTP layers uses RMSNorm
        let (_d, e) = engine_with(&cfg, DType::F32, 2);
        let m = e.model();
        let (v, k) = (m.config.vocab_size, 3);
        let toks: Vec<u32> = (0..120).map(|i| ((i * 13 + 5) % v) as u32).collect();
        let draft = |s: &mut Session, last: u32| {
            let (mut out, mut logits) = (Vec::new(), vec![0.0; k * v]);
            mtp_draft(m, &mut s.ws, &mut s.seq, last, k, &mut out, Some(&mut logits), None).unwrap();
            (out, logits)
        };
        let fresh = || {
            let mut s = Session::new(m, 200, 8);
            s.seq.enable_mtp(m).unwrap();
            s
        };
        let mut s = fresh();
        forward(m, &mut s, &toks[..21], Capture::default(), None, &never).unwrap(); // 3 chunks
        let recurrent = s.seq.is_recurrent();
        // (drafts the text confirms, wrong drafts after them)
        for (j, wrong) in [(0, 3), (2, 1), (3, 0), (1, 2), (0, 3), (2, 1)] {
            let n = s.seq.pos;
            let last = toks[n];
            let (made, _) = draft(&mut s, last);
            assert_eq!(made.len(), k, "case {case}: a sequence up to date drafts");
            let mut feed = toks[n..=n + j].to_vec();
            feed.extend((0..wrong).map(|i| (toks[n + j + 1] + 1 + i as u32) % v as u32));
            if recurrent {
                s.seq.checkpoint();
            }
            forward(m, &mut s, &feed, Capture::default(), None, &never).unwrap();
            if wrong > 0 {
                if recurrent {
                    s.seq.truncate(n).unwrap();
                    forward(m, &mut s, &toks[n..=n + j], Capture::default(), None, &never).unwrap();
                } else {
                    s.seq.truncate(n + 1 + j).unwrap();
                }
            }
            assert_eq!(s.seq.pos, n + 1 + j, "case {case}");
        }
        let pos = s.seq.pos;
        let (got, got_logits) = draft(&mut s, toks[pos]);
        let mut r = fresh();
        forward(m, &mut r, &toks[..pos], Capture::default(), None, &never).unwrap();
        let (want, want_logits) = draft(&mut r, toks[pos]);
        assert_eq!(got, want, "case {case}: drafts after rollbacks");
        let scale = want_logits.iter().fold(1f32, |a, x| a.max(x.abs()));
        let err = got_logits.iter().zip(&want_logits).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        assert!(err <= 1e-5 * scale, "case {case}: draft logits differ by {err} (scale {scale})");
    }
}

/// A model split into pipeline stages gives the whole model's logits bit
/// for bit, through a chunked prompt and token-by-token decoding, for every
/// kind of layer state and every split into 2 and 3 stages the balancer
/// makes, over the whole file and over stage files whose stages stream
/// their experts; a stage refuses input of the wrong kind or width.
#[test]
fn pipeline_stages_equal_the_whole_model_for_every_state_kind() {
    use crate::model::session::Session;
    use crate::model::stage::{balance, can_start, layer_bytes};
    let mut streamed = 0;
    for (case, cfg) in every_state_kind().into_iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.colibri");
        write_random_model(&p, &cfg, DType::F32, 9);
        let open = |stage| Engine::open(&p, &EngineOptions { threads: Some(2), stage, ..Default::default() }).unwrap();
        let whole = open(None);
        // A stage hands on the whole residual: every hyper-connection stream.
        let (v, d) = (cfg.vocab_size, cfg.residual_width());
        let toks: Vec<u32> = (0..40).map(|i| ((i * 13 + 5) % v) as u32).collect();
        let feeds = [&toks[..21], &toks[21..22], &toks[22..23], &toks[23..27], &toks[27..28]];
        let mut want = Vec::new();
        let mut s = Session::new(whole.model(), 64, 8);
        for f in feeds {
            whole.run(&mut s, f, Capture::default(), &never).unwrap();
            want.push(s.seq.logits.clone());
        }
        let (bytes, embed, head) = layer_bytes(whole.model().file());
        let starts = can_start(&cfg);
        for (k, files) in [(2, false), (3, false), (2, true), (3, true)] {
            let Ok(plan) = balance(&bytes, (embed, head), &starts, &vec![1.0; k]) else { continue };
            let stages: Vec<Engine> = match files {
                false => plan.iter().map(|r| open(Some(r.clone()))).collect(),
                // Stage files, each stage streaming its experts through as
                // few slots as it can run with.
                true => {
                    let out = dir.path().join(format!("split{k}"));
                    std::fs::create_dir(&out).unwrap();
                    let written = crate::convert::split::split(&p, &plan, &out, false, false, &never).unwrap();
                    written
                        .iter()
                        .map(|f| {
                            let plan = crate::model::store::plan_path(&f.path, None).unwrap();
                            let (min, streams) = (plan.min_budget, plan.min_budget < plan.expert_bytes);
                            let store = StoreOptions {
                                ram_budget: (min > 0).then_some(min),
                                heat_file: crate::model::store::HeatFile::Off,
                                ..StoreOptions::default()
                            };
                            let e = Engine::open(
                                &f.path,
                                &EngineOptions {
                                    threads: Some(2),
                                    store,
                                    stage: Some(f.layers.clone()),
                                    ..Default::default()
                                },
                            )
                            .unwrap();
                            assert_eq!(e.model().streams_experts(), streams, "case {case}: {}", f.path.display());
                            streamed += usize::from(streams);
                            e
                        })
                        .collect()
                }
            };
            let mut sessions: Vec<Session> = stages.iter().map(|e| Session::new(e.model(), 64, 8)).collect();
            for (i, f) in feeds.iter().enumerate() {
                let mut h: Option<Vec<f32>> = None;
                for (j, (e, s)) in stages.iter().zip(&mut sessions).enumerate() {
                    if j + 1 < k {
                        let mut out = vec![0.0; f.len() * d];
                        let cap = Capture { residual: Some(&mut out), ..Capture::default() };
                        e.run_stage(s, f, h.as_deref(), cap, &never).unwrap();
                        h = Some(out);
                    } else {
                        e.run_stage(s, f, h.as_deref(), Capture::default(), &never).unwrap();
                        assert!(
                            s.seq.logits == want[i],
                            "case {case}, stages {plan:?} (files: {files}): feed {i} differs"
                        );
                    }
                }
            }
        }
        // Wrong input: a later stage without rows, a first stage with them, a short row.
        let cut = (1..cfg.main_layers()).find(|&l| starts[l]).unwrap();
        assert!(Engine::open(&p, &EngineOptions { stage: Some(cut..cut), ..Default::default() }).is_err());
        let (first, last) = (open(Some(0..cut)), open(Some(cut..cfg.main_layers())));
        let mut s = Session::new(last.model(), 64, 8);
        assert!(last.run_stage(&mut s, &toks[..2], None, Capture::default(), &never).is_err());
        assert!(last.run_stage(&mut s, &toks[..2], Some(&vec![0.0; d]), Capture::default(), &never).is_err());
        let mut s = Session::new(first.model(), 64, 8);
        let mut out = vec![0.0; 2 * d];
        let cap = Capture { residual: Some(&mut out), ..Capture::default() };
        assert!(first.run_stage(&mut s, &toks[..2], Some(&vec![0.0; 2 * d]), cap, &never).is_err());
        assert!(first.run(&mut s, &toks[..2], Capture::default(), &never).is_err(), "a first stage has no logits");
    }
    assert!(streamed > 0, "no stage file streamed its experts");
}
