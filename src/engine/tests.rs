//! Engine-level invariants on a random model: the way a sequence is fed
//! (one pass, chunks, token by token) and the thread count change nothing.

use super::*;
use crate::model::forward::{Capture, forward};
use crate::quant::DType;
use crate::testutil::{tiny_config, write_random_model};

fn engine(dtype: DType, threads: usize) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.colibri");
    write_random_model(&p, &tiny_config(), dtype, 9);
    let e = Engine::open(&p, &EngineOptions { threads: Some(threads) }).unwrap();
    (dir, e)
}

fn ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 53).collect()
}

#[test]
fn prefill_then_decode_equals_one_full_forward() {
    for dt in DType::ALL {
        let (_d, e) = engine(dt, 2);
        let toks = ids(29);
        let full = e.logits(&toks, &never).unwrap();
        let v = e.model().config.vocab_size;
        let mut s = e.session(toks.len());
        e.run(&mut s, &toks[..11], Capture::default(), &never).unwrap();
        assert_eq!(s.logits, full[10 * v..11 * v], "{dt}: prefill's last row");
        for (i, &t) in toks.iter().enumerate().skip(11) {
            e.run(&mut s, &[t], Capture::default(), &never).unwrap();
            assert_eq!(s.logits, full[i * v..(i + 1) * v], "{dt}: decode at position {i}");
        }
    }
}

#[test]
fn chunked_prefill_equals_single_pass() {
    let (_d, e) = engine(DType::F32, 2);
    let toks = ids(40);
    let v = e.model().config.vocab_size;
    let want = e.logits(&toks, &never).unwrap();
    for chunk in [1, 3, 7, 40] {
        let mut s = session::Session::new(e.model(), toks.len(), chunk);
        let mut got = vec![0.0; toks.len() * v];
        forward(e.model(), &mut s, &toks, Capture { logits: Some(&mut got), hidden: None }, None, &never).unwrap();
        assert_eq!(got, want, "chunk size {chunk}");
    }
}

#[test]
fn thread_count_does_not_change_a_single_bit() {
    let toks = ids(23);
    let (_a, one) = engine(DType::Bf16, 1);
    let (_b, two) = engine(DType::Bf16, 2);
    let (_c, three) = engine(DType::Bf16, 3);
    let want = one.logits(&toks, &never).unwrap();
    assert_eq!(two.logits(&toks, &never).unwrap(), want);
    assert_eq!(three.logits(&toks, &never).unwrap(), want);
    let opts = GenerateOptions { max_new_tokens: 9, temperature: 0.8, seed: 5, stop_ids: vec![] };
    let g1 = one.generate(&toks[..4], &opts, &never, &mut |_| true).unwrap();
    assert_eq!(two.generate(&toks[..4], &opts, &never, &mut |_| true).unwrap(), g1);
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
    e.model().mat(e.model().embed).decode_row(toks[2] as usize, &mut row);
    assert_eq!(&h[2 * d..3 * d], &row[..]);
    // The last slot has unit RMS up to the norm weights: not the raw residual.
    assert_ne!(&h[l * toks.len() * d..], &h[(l - 1) * toks.len() * d..l * toks.len() * d]);
}
