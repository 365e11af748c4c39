//! The forward pass: one implementation for every architecture, driven by the
//! canonical config. Reads top to bottom like the maths; no ISA, dtype or
//! architecture branches (those live in `kernels`, `quant` and `arch`).
//!
//! Tokens are processed in chunks of at most C (the session's chunk size):
//! a prompt is a few batched passes, decoding is a pass of one token.

use super::Model;
use super::blocks::attention::{Heads, attend};
use super::blocks::ffn::{Mlp, MlpScratch, gated_mlp, sigmoid};
use super::blocks::moe::{MoeLayer, moe_forward, predict};
use super::blocks::norm::{rmsnorm, rmsnorm_rows_inplace};
use super::blocks::rope;
use super::config::QkNorm;
use super::{FfnRefs, MlpRefs};
use crate::engine::session::Session;
use crate::error::{Error, Result};
use crate::kernels::{Input, matmul, matmul_many};

/// Optional outputs beyond the last token's logits (always left in
/// `Session::logits`).
#[derive(Default)]
pub struct Capture<'a> {
    /// [T, V]: logits of every token of the call.
    pub logits: Option<&'a mut [f32]>,
    /// [L+1, T, D]: the embedding, then each layer's output, the last one
    /// after the final norm (transformers' `output_hidden_states` convention).
    pub hidden: Option<&'a mut [f32]>,
}

/// Checks that `tokens` can be appended to the session.
pub fn check_tokens(model: &Model, s: &Session, tokens: &[u32]) -> Result<()> {
    let v = model.config.vocab_size;
    if tokens.is_empty() {
        return Err(Error::InvalidInput("empty token sequence: give at least one token id".into()));
    }
    if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, t)| **t as usize >= v) {
        return Err(Error::InvalidInput(format!(
            "token id {t} at position {i} is out of range for a vocabulary of {v}"
        )));
    }
    let end = s.pos + tokens.len();
    if end > s.max_seq {
        return Err(Error::ContextOverflow(format!(
            "sequence of {end} tokens does not fit: the context holds {} (model maximum {})",
            s.max_seq, model.config.max_seq_len
        )));
    }
    Ok(())
}

/// Appends `tokens` to the session's sequence and runs the model over them,
/// each chunk on `pool` (or the current rayon pool when `None`).
/// `interrupted` is polled between chunks on the calling thread, so a Python
/// caller's Ctrl-C is seen even during a long prompt.
pub fn forward(
    model: &Model,
    s: &mut Session,
    tokens: &[u32],
    mut cap: Capture,
    pool: Option<&rayon::ThreadPool>,
    interrupted: &dyn Fn() -> bool,
) -> Result<()> {
    check_tokens(model, s, tokens)?;
    let total = tokens.len();
    let mut done = 0;
    while done < total {
        if interrupted() {
            return Err(Error::Interrupted);
        }
        let n = (total - done).min(s.chunk);
        let chunk = &tokens[done..done + n];
        match pool {
            Some(p) => p.install(|| forward_chunk(model, s, chunk, done, total, &mut cap))?,
            None => forward_chunk(model, s, chunk, done, total, &mut cap)?,
        }
        done += n;
    }
    Ok(())
}

/// One chunk of `n <= C` tokens at positions `s.pos..s.pos+n`; `off` is the
/// chunk's index within the call's `total` tokens (for the captures).
fn forward_chunk(
    model: &Model,
    s: &mut Session,
    tokens: &[u32],
    off: usize,
    total: usize,
    cap: &mut Capture,
) -> Result<()> {
    let c = &model.config;
    let (n, d, pos0) = (tokens.len(), c.hidden_size, s.pos);
    let (qd, kvd, dh, eps) = (c.q_dim(), c.kv_dim(), c.head_dim, c.norm.eps);
    let half = c.rope.rotary_dim / 2;
    let layers = c.num_layers();
    let snap = |hidden: &mut Option<&mut [f32]>, slot: usize, x: &[f32]| {
        if let Some(h) = hidden.as_deref_mut() {
            let at = (slot * total + off) * d;
            h[at..at + n * d].copy_from_slice(&x[..n * d]);
        }
    };

    // Token embeddings.
    let embed = model.mat(model.embed);
    for (t, &tok) in tokens.iter().enumerate() {
        embed.decode_row(tok as usize, &mut s.x[t * d..(t + 1) * d]); // [T, D]
    }
    snap(&mut cap.hidden, 0, &s.x);
    // RoPE angles for this chunk's positions.
    for t in 0..n {
        model.rope.angles(pos0 + t, &mut s.cos[t * half..(t + 1) * half], &mut s.sin[t * half..(t + 1) * half]);
    }

    for (l, (lw, spec)) in model.layers.iter().zip(&c.layers).enumerate() {
        // Attention: norm → q, k, v projections (+ bias, q/k norm, clip, RoPE).
        let x = &s.x[..n * d];
        let xn = &mut s.xn[..n * d];
        for t in 0..n {
            rmsnorm(&x[t * d..(t + 1) * d], model.vec(lw.attn_norm), eps, &mut xn[t * d..(t + 1) * d]);
        }
        let (q, k, v) = (&mut s.q[..n * qd], &mut s.k[..n * kvd], &mut s.v[..n * kvd]);
        let inp = Input::prepare(xn, d, s.quantize, &mut s.xq); // quantised once for q, k and v
        matmul_many(&mut [(model.mat(lw.wq), &mut *q), (model.mat(lw.wk), &mut *k), (model.mat(lw.wv), &mut *v)], &inp); // [T, H·Dh], [T, Hkv·Dh], [T, Hkv·Dh]
        if let Some([bq, bk, bv]) = lw.qkv_bias {
            add_rows(q, model.vec(bq));
            add_rows(k, model.vec(bk));
            add_rows(v, model.vec(bv));
        }
        if let Some([qn, kn]) = lw.qk_norm {
            // Per head: rows of Dh; full: rows of the whole projection.
            let (wq, wk) = (model.vec(qn), model.vec(kn));
            debug_assert!(c.attention.qk_norm == QkNorm::PerHead || wq.len() == qd);
            rmsnorm_rows_inplace(q, wq, eps);
            rmsnorm_rows_inplace(k, wk, eps);
        }
        if let Some(clip) = c.attention.clip_qkv {
            for a in q.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
                *a = a.clamp(-clip, clip);
            }
        }
        for t in 0..n {
            let (cs, sn) = (&s.cos[t * half..(t + 1) * half], &s.sin[t * half..(t + 1) * half]);
            for head in q[t * qd..(t + 1) * qd].chunks_exact_mut(dh) {
                rope::apply(head, cs, sn);
            }
            for head in k[t * kvd..(t + 1) * kvd].chunks_exact_mut(dh) {
                rope::apply(head, cs, sn);
            }
        }
        // Append this chunk's keys and values to the cache, then attend.
        s.kv.store(l, pos0, kvd, &s.k[..n * kvd], &s.v[..n * kvd]);
        let heads = Heads { h: c.num_heads, hkv: c.num_kv_heads, dh, window: spec.sliding_window };
        attend(&s.q[..n * qd], s.kv.view(l, pos0 + n), pos0, heads, &mut s.att[..n * qd]); // [T, H·Dh]
        let proj = &mut s.proj[..n * d];
        matmul(&model.mat(lw.wo), &Input::prepare(&s.att[..n * qd], qd, s.quantize, &mut s.xq), proj); // [T, D]
        if let Some(bo) = lw.o_bias {
            add_rows(proj, model.vec(bo));
        }
        add(&mut s.x[..n * d], proj); // residual

        // Prefetch: when the next layer is a MoE block and experts stream,
        // run its router on this residual, normed as the next layer will
        // norm its own, and queue the experts it picks for background reads
        // while this layer's FFN and the next attention compute. Only the
        // store's reads change; the numbers below do not depend on it.
        if model.experts.wants_prefetch()
            && let Some(next) = model.layers.get(l + 1)
            && let FfnRefs::Moe { router, .. } = next.ffn
        {
            let moe = c.moe.as_ref().expect("validated: MoE layer has a spec");
            let x = &s.x[..n * d];
            for t in 0..n {
                let row = t * d..(t + 1) * d;
                rmsnorm(&x[row.clone()], model.vec(next.ffn_norm), eps, &mut s.moe.pred_x[row]);
            }
            let experts = predict(&model.mat(router), &moe.router, n, &mut s.moe);
            model.experts.prefetch(l + 1, experts);
        }

        // Feed-forward: norm → dense MLP or MoE block (+ shared expert).
        let (x, xn) = (&s.x[..n * d], &mut s.xn[..n * d]);
        for t in 0..n {
            rmsnorm(&x[t * d..(t + 1) * d], model.vec(lw.ffn_norm), eps, &mut xn[t * d..(t + 1) * d]);
        }
        let proj = &mut s.proj[..n * d];
        let inp = Input::prepare(xn, d, s.quantize, &mut s.xq); // shared by router, experts, shared expert
        let scratch = MlpScratch { g: &mut s.g, u: &mut s.u, hq: &mut s.hq };
        match lw.ffn {
            FfnRefs::Dense(m) => gated_mlp(&mlp(model, m), &inp, scratch, proj, true),
            FfnRefs::Moe { router, shared, shared_gate } => {
                let moe = c.moe.as_ref().expect("validated: MoE layer has a spec");
                let layer = MoeLayer {
                    layer: l,
                    router: model.mat(router),
                    spec: &moe.router,
                    store: model.experts.as_ref(),
                    telemetry: model.telemetry.layers.get(l),
                };
                moe_forward(&layer, &inp, &mut s.moe, proj)?;
                if let Some(m) = shared {
                    let sh = &mut s.shared[..n * d];
                    gated_mlp(&mlp(model, m), &inp, scratch, sh, true); // [T, D]
                    let gate = shared_gate.map(|g| model.vec(g));
                    for t in 0..n {
                        let row = t * d..(t + 1) * d;
                        let scale = gate.map_or(1.0, |w| sigmoid(dot(w, &xn[row.clone()])));
                        proj[row.clone()].iter_mut().zip(&sh[row]).for_each(|(p, v)| *p += scale * v);
                    }
                }
            }
        }
        add(&mut s.x[..n * d], proj); // residual
        if l + 1 < layers {
            snap(&mut cap.hidden, l + 1, &s.x);
        }
    }

    // Final norm and lm_head.
    let (x, xn) = (&s.x[..n * d], &mut s.xn[..n * d]);
    for t in 0..n {
        rmsnorm(&x[t * d..(t + 1) * d], model.vec(model.final_norm), eps, &mut xn[t * d..(t + 1) * d]);
    }
    snap(&mut cap.hidden, layers, xn);
    let head = model.mat(model.lm_head);
    let vocab = c.vocab_size;
    if let Some(all) = cap.logits.as_deref_mut() {
        let inp = Input::prepare(xn, d, s.quantize, &mut s.xq);
        matmul(&head, &inp, &mut all[off * vocab..(off + n) * vocab]); // [T, V]
        if off + n == total {
            s.logits.copy_from_slice(&all[(off + n - 1) * vocab..(off + n) * vocab]);
        }
    } else if off + n == total {
        let inp = Input::prepare(&xn[(n - 1) * d..n * d], d, s.quantize, &mut s.xq);
        matmul(&head, &inp, &mut s.logits); // [V]
    }
    s.pos += n;
    model.telemetry.tokens.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

fn mlp(model: &Model, m: MlpRefs) -> Mlp<'_> {
    Mlp { gate: model.mat(m.gate), up: model.mat(m.up), down: model.mat(m.down) }
}

fn add(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}

fn add_rows(a: &mut [f32], bias: &[f32]) {
    for row in a.chunks_exact_mut(bias.len()) {
        add(row, bias);
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
