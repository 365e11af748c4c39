//! The forward pass: one implementation for every architecture, driven by the
//! canonical config. Reads top to bottom like the maths; no ISA, dtype or
//! architecture branches (those live in `kernels`, `quant` and `arch`).
//!
//! ```text
//! x = embed(tokens) · s_emb                                [T, D]
//! for each layer:
//!     x += s_res · attention(norm(x))                      GQA or MLA, over the KV cache
//!     x += s_res · ffn_or_moe(norm(x))                     dense MLP, or router + experts + shared
//! logits = lm_head(norm(x)) / s_logits                     [T, V]
//! ```
//!
//! Tokens are processed in chunks of at most C (the session's chunk size):
//! a prompt is a few batched passes, decoding is a pass of one token.

use rayon::prelude::*;

use super::blocks::attention::{Heads, attend};
use super::blocks::ffn::{MlpScratch, add_bias, gated_mlp};
use super::blocks::moe::{MoeBlock, MoeLayer, moe_block, predict};
use super::blocks::norm::{norm_rows, rmsnorm_rows_inplace};
use super::session::{HeadScratch, Sequence, Session, Workspace};
use super::weights::Mlp;
use super::{FfnRefs, LayerRefs, MlaQuery, MlpRefs, Model, NormRefs, QkvRefs};
use crate::canonical::config::{Activation, QkNorm};
use crate::error::{Error, Result};
use crate::kernels::{Input, Matrix, matmul, matmul_many, matmul_serial, observe_unmultiplied};

/// Optional outputs beyond the last token's logits (always left in
/// `Sequence::logits`).
#[derive(Default)]
pub struct Capture<'a> {
    /// [T, V]: logits of every token of the call.
    pub logits: Option<&'a mut [f32]>,
    /// [L+1, T, D]: the embedding, then each layer's output, the last one
    /// after the final norm (transformers' `output_hidden_states` convention).
    pub hidden: Option<&'a mut [f32]>,
}

/// Checks that `tokens` can be appended to the sequence.
pub fn check_tokens(model: &Model, s: &Sequence, tokens: &[u32]) -> Result<()> {
    check_ids(model, tokens)?;
    let end = s.pos + tokens.len();
    if end > s.max_seq {
        return Err(Error::ContextOverflow(format!(
            "sequence of {end} tokens does not fit: the context holds {} (model maximum {})",
            s.max_seq, model.config.max_seq_len
        )));
    }
    Ok(())
}

/// Checks that `tokens` is not empty and that every id is in the vocabulary.
pub fn check_ids(model: &Model, tokens: &[u32]) -> Result<()> {
    let v = model.config.vocab_size;
    if tokens.is_empty() {
        return Err(Error::InvalidInput("empty token sequence: give at least one token id".into()));
    }
    if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, t)| **t as usize >= v) {
        return Err(Error::InvalidInput(format!(
            "token id {t} at position {i} is out of range for a vocabulary of {v}"
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
    check_tokens(model, &s.seq, tokens)?;
    let total = tokens.len();
    let end = s.seq.pos + total;
    let mut done = 0;
    while done < total {
        if interrupted() {
            return Err(Error::Interrupted);
        }
        let n = (total - done).min(s.ws.chunk);
        let seg = Segment { seq: &mut s.seq, tokens: &tokens[done..done + n], end, logits: done + n == total };
        let ws = &mut s.ws;
        let mut segs = [seg];
        match pool {
            Some(p) => p.install(|| forward_chunk(model, ws, &mut segs, done, total, &mut cap))?,
            None => forward_chunk(model, ws, &mut segs, done, total, &mut cap)?,
        }
        done += n;
    }
    Ok(())
}

/// Some tokens of one sequence in a batched pass.
pub struct Segment<'a> {
    /// The sequence they continue (at its `pos`).
    pub seq: &'a mut Sequence,
    /// The tokens, in order.
    pub tokens: &'a [u32],
    /// Where the run of tokens these belong to ends (a prompt fed over several
    /// passes ends where the prompt does): LongRoPE's sequence length.
    pub end: usize,
    /// Leave the logits of the last token in `seq.logits`.
    pub logits: bool,
}

/// One pass over the tokens of several sequences at once: every weight is
/// read once for all of them and each routed expert once for all the tokens
/// routed to it, while each sequence attends only to its own cache. Each
/// row's numbers are those it would get alone (the kernels give every row
/// the same bits whatever the rows beside it), so batching never changes a
/// token. At most `ws.chunk` tokens and `ws.heads` logit rows in all; the
/// tokens are checked as [`forward`] checks them.
pub fn forward_batch(
    model: &Model,
    ws: &mut Workspace,
    segs: &mut [Segment],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    let n: usize = segs.iter().map(|g| g.tokens.len()).sum();
    let heads = segs.iter().filter(|g| g.logits).count();
    if n > ws.chunk || heads > ws.heads {
        return Err(Error::InvalidInput(format!(
            "a batch of {n} tokens and {heads} logit rows does not fit a workspace of {} and {}",
            ws.chunk, ws.heads
        )));
    }
    for g in segs.iter() {
        check_tokens(model, g.seq, g.tokens)?;
    }
    let mut cap = Capture::default();
    match pool {
        Some(p) => p.install(|| forward_chunk(model, ws, segs, 0, n, &mut cap)),
        None => forward_chunk(model, ws, segs, 0, n, &mut cap),
    }
}

/// One chunk of `n <= C` tokens: each segment's tokens at its positions
/// `seq.pos..`, their rows one after another. `off` is the chunk's index
/// within the call's `total` tokens (for the captures, which only a single
/// segment takes).
fn forward_chunk(
    model: &Model,
    s: &mut Workspace,
    segs: &mut [Segment],
    off: usize,
    total: usize,
    cap: &mut Capture,
) -> Result<()> {
    let c = &model.config;
    let d = c.hidden_size;
    let n: usize = segs.iter().map(|g| g.tokens.len()).sum();
    debug_assert!(segs.len() == 1 || (cap.logits.is_none() && cap.hidden.is_none()));
    let snap = |hidden: &mut Option<&mut [f32]>, slot: usize, x: &[f32]| {
        if let Some(h) = hidden.as_deref_mut() {
            let at = (slot * total + off) * d;
            h[at..at + n * d].copy_from_slice(&x[..n * d]);
        }
    };

    embed(model, s, segs); // x: [T, D]
    snap(&mut cap.hidden, 0, &s.x);
    rope_angles(model, s, segs);
    for (l, lw) in model.layers.iter().enumerate() {
        norm(model, lw.attn_norm, &s.x[..n * d], &mut s.xn[..n * d]);
        attention(model, l, s, segs, n); // proj: [T, D]
        residual(&mut s.x[..n * d], &s.proj[..n * d], c.scales.residual);
        prefetch_next_layer(model, l, s, n);
        norm(model, lw.ffn_norm, &s.x[..n * d], &mut s.xn[..n * d]);
        ffn_or_moe(model, l, s, n)?; // proj: [T, D]
        residual(&mut s.x[..n * d], &s.proj[..n * d], c.scales.residual);
        if l + 1 < c.num_layers() {
            snap(&mut cap.hidden, l + 1, &s.x);
        }
    }
    norm(model, model.final_norm, &s.x[..n * d], &mut s.xn[..n * d]);
    snap(&mut cap.hidden, c.num_layers(), &s.xn);
    lm_head(model, s, segs, n, off, cap);
    for g in segs.iter_mut() {
        g.seq.pos += g.tokens.len();
    }
    model.telemetry.tokens.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// `f(first row, segment, its rows of out, its rows of scratch)` for every
/// segment, the segments side by side: halves of the list under
/// `rayon::join` (no allocation: the forward pass never allocates), so a
/// batch of sequences is one parallel region per layer rather than one per
/// sequence (batched decode of eight sequences, OLMoE width, timed inside
/// the pass: attention over the cache 1.23 → 0.91 ms of a 20 ms step).
/// `out` and `scratch` hold `width` values per row of the segments, in
/// order. Each segment's work is what it would be alone, so its bits are
/// too.
fn each_segment<F>(segs: &mut [Segment], r0: usize, width: usize, out: &mut [f32], scratch: &mut [f32], f: &F)
where
    F: Fn(usize, &mut Segment, &mut [f32], &mut [f32]) + Sync,
{
    match segs {
        [] => {}
        [g] => f(r0, g, out, scratch),
        _ => {
            let (a, b) = segs.split_at_mut(segs.len() / 2);
            let rows: usize = a.iter().map(|g| g.tokens.len()).sum();
            let (out_a, out_b) = out.split_at_mut(rows * width);
            let (scratch_a, scratch_b) = scratch.split_at_mut(rows * width);
            rayon::join(
                || each_segment(a, r0, width, out_a, scratch_a, f),
                || each_segment(b, r0 + rows, width, out_b, scratch_b, f),
            );
        }
    }
}

/// Each segment's first row and its row count, in order.
fn rows<'a>(segs: &'a [Segment]) -> impl Iterator<Item = (usize, usize)> + 'a {
    segs.iter().scan(0, |r0, g| {
        let at = *r0;
        *r0 += g.tokens.len();
        Some((at, g.tokens.len()))
    })
}

/// `x[t] = embedding[token t] · s_emb`.
fn embed(model: &Model, s: &mut Workspace, segs: &[Segment]) {
    let d = model.config.hidden_size;
    let table = model.mat(model.embed);
    let scale = model.config.scales.embedding;
    for (t, &tok) in segs.iter().flat_map(|g| g.tokens).enumerate() {
        let row = &mut s.x[t * d..(t + 1) * d];
        table.decode_row(tok as usize, row); // [D]
        if scale != 1.0 {
            row.iter_mut().for_each(|v| *v *= scale);
        }
    }
}

/// RoPE cosines and sines of this chunk's positions: `[T, R/2]` each. Each
/// segment's `end` is where its run of tokens ends (LongRoPE's switch, as
/// transformers decides it per call).
fn rope_angles(model: &Model, s: &mut Workspace, segs: &[Segment]) {
    let half = model.config.rope.rotary_dim / 2;
    for ((r0, m), g) in rows(segs).zip(segs) {
        for i in 0..m {
            let t = r0 + i;
            let (cs, sn) = (&mut s.cos[t * half..(t + 1) * half], &mut s.sin[t * half..(t + 1) * half]);
            model.rope.angles(g.seq.pos + i, g.end, cs, sn);
        }
    }
}

/// The model's norm (RMSNorm, or LayerNorm with its bias) of each row.
fn norm(model: &Model, w: NormRefs, x: &[f32], out: &mut [f32]) {
    norm_rows(model.config.norm, x, model.vec(w.w), model.opt_vec(w.b), out);
}

/// `x += scale · y`.
fn residual(x: &mut [f32], y: &[f32], scale: f32) {
    if scale == 1.0 {
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
    } else {
        x.iter_mut().zip(y).for_each(|(a, b)| *a += scale * b);
    }
}

/// `proj = W_o · attend(q, cache)`: projects this chunk's queries, keys and
/// values from `xn`, appends the keys and values to the cache, attends.
fn attention(model: &Model, l: usize, s: &mut Workspace, segs: &mut [Segment], n: usize) {
    let c = &model.config;
    let lw = &model.layers[l];
    let (d, h, dh) = (c.hidden_size, c.num_heads, c.head_dim);
    let window = c.layers[l].sliding_window;
    let sinks = model.opt_vec(lw.sinks);
    let ad = c.att_dim();
    // Over the q/k head width Dh (MLA: nope + rope, not the latent's width).
    let scale = c.attention.softmax_scale.unwrap_or(1.0 / (dh as f32).sqrt());
    match lw.qkv {
        QkvRefs::Gqa { wq, wk, wv } => {
            let (qd, kvd) = (c.q_dim(), c.kv_dim());
            gqa_qkv(model, lw, [wq, wk, wv], s, n); // q: [T, H·Dh], k, v: [T, Hkv·Dh]
            let heads = Heads { h, hkv: c.num_kv_heads, dk: dh, dv: dh, window, scale, sinks };
            let (q, k, v) = (&s.q, &s.k, &s.v);
            let (att, order) = (&mut s.att[..n * ad], &mut s.att_order[..n * ad]);
            each_segment(segs, 0, ad, att, order, &|r0, g, att, order| {
                let (m, pos0) = (g.tokens.len(), g.seq.pos);
                let r = r0..r0 + m;
                g.seq.kv.store(l, pos0, &k[r.start * kvd..r.end * kvd], &v[r.start * kvd..r.end * kvd]);
                attend(&q[r.start * qd..r.end * qd], g.seq.kv.view(l, pos0 + m), pos0, heads, order, att); // [m, H·Dh]
            });
        }
        QkvRefs::Mla { q, wkv_a, kv_a_norm, wk_b, wv_b } => {
            let m = *c.mla().expect("MLA weights imply an MLA config");
            let (r, dr) = (m.kv_lora_rank, m.qk_rope_dim);
            mla_latent(model, q, wkv_a, kv_a_norm, s, n); // q: [T, H·Dh], k: [T, R + Dr]
            // Absorbed queries: q_abs[t, h] = [W_UK_hᵀ · q_nope[t, h], q_pe[t, h]]   [T, H·(R + Dr)]
            let quantize = s.quantize;
            per_head_matmul(
                &model.mat(wk_b),
                h,
                &s.q[..n * h * dh],
                dh,
                &mut s.mla.q_abs,
                r + dr,
                quantize,
                &mut s.mla.heads,
            );
            for (qa, qh) in s.mla.q_abs[..n * h * (r + dr)].chunks_exact_mut(r + dr).zip(s.q.chunks_exact(dh)) {
                qa[r..].copy_from_slice(&qh[m.qk_nope_dim..]);
            }
            // One latent "kv head" shared by all heads; the values are the latent.
            let heads = Heads { h, hkv: 1, dk: r + dr, dv: r, window, scale, sinks };
            let (qw, ow) = (h * (r + dr), h * r);
            let (k, q_abs) = (&s.k, &s.mla.q_abs);
            let (o_lat, order) = (&mut s.mla.o_lat[..n * ow], &mut s.att_order[..n * ow]);
            each_segment(segs, 0, ow, o_lat, order, &|r0, g, o_lat, order| {
                let (t, pos0) = (g.tokens.len(), g.seq.pos);
                g.seq.kv.store(l, pos0, &k[r0 * (r + dr)..(r0 + t) * (r + dr)], &[]);
                let qa = &q_abs[r0 * qw..(r0 + t) * qw];
                attend(qa, g.seq.kv.view(l, pos0 + t), pos0, heads, order, o_lat); // [t, H·R]
            });
            // att[t, h] = W_UV_h · o_lat[t, h]   [T, H·Dv]
            let o_lat = &s.mla.o_lat[..n * h * r];
            per_head_matmul(&model.mat(wv_b), h, o_lat, r, &mut s.att, m.v_head_dim, quantize, &mut s.mla.heads);
        }
    }
    let proj = &mut s.proj[..n * d];
    matmul(&model.mat(lw.wo), &Input::prepare(&s.att[..n * ad], ad, s.quantize, &mut s.xq), proj); // [T, D]
    if let Some(bo) = model.opt_vec(lw.o_bias) {
        add_bias(proj, bo);
    }
}

/// GQA projections: q, k, v from `xn` (+ bias, q/k norm, clip, RoPE).
fn gqa_qkv(model: &Model, lw: &LayerRefs, [wq, wk, wv]: [super::TensorRef; 3], s: &mut Workspace, n: usize) {
    let c = &model.config;
    let (d, qd, kvd, dh, half) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim, c.rope.rotary_dim / 2);
    let (q, k, v) = (&mut s.q[..n * qd], &mut s.k[..n * kvd], &mut s.v[..n * kvd]);
    let inp = Input::prepare(&s.xn[..n * d], d, s.quantize, &mut s.xq); // quantised once for q, k and v
    matmul_many(&mut [(model.mat(wq), &mut *q), (model.mat(wk), &mut *k), (model.mat(wv), &mut *v)], &inp); // [T, H·Dh], [T, Hkv·Dh] ×2
    if let Some([bq, bk, bv]) = lw.qkv_bias {
        add_bias(q, model.vec(bq));
        add_bias(k, model.vec(bk));
        add_bias(v, model.vec(bv));
    }
    if let Some([qn, kn]) = lw.qk_norm {
        // Per head: rows of Dh; full: rows of the whole projection.
        let (wqn, wkn) = (model.vec(qn), model.vec(kn));
        debug_assert!(c.attention.qk_norm == QkNorm::PerHead || wqn.len() == qd);
        rmsnorm_rows_inplace(q, wqn, c.norm.eps);
        rmsnorm_rows_inplace(k, wkn, c.norm.eps);
    }
    if let Some(clip) = c.attention.clip_qkv {
        for a in q.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
            *a = a.clamp(-clip, clip);
        }
    }
    for t in 0..n {
        let (cs, sn) = (&s.cos[t * half..(t + 1) * half], &s.sin[t * half..(t + 1) * half]);
        for head in q[t * qd..(t + 1) * qd].chunks_exact_mut(dh).chain(k[t * kvd..(t + 1) * kvd].chunks_exact_mut(dh)) {
            model.rope.rotate(head, cs, sn);
        }
    }
}

/// MLA projections: q (directly or through its normed low-rank latent) into
/// `s.q` [T, H·(Dn + Dr)], and the normed latent plus the rotated shared key
/// into `s.k` [T, R + Dr]; RoPE on each head's last Dr query values and on
/// the shared key.
fn mla_latent(
    model: &Model,
    q: MlaQuery,
    wkv_a: super::TensorRef,
    kv_a_norm: super::TensorRef,
    s: &mut Workspace,
    n: usize,
) {
    let c = &model.config;
    let m = c.mla().expect("MLA config");
    let (d, qd, dh, half) = (c.hidden_size, c.q_dim(), c.head_dim, c.rope.rotary_dim / 2);
    let kw = m.kv_lora_rank + m.qk_rope_dim;
    let (qo, kv) = (&mut s.q[..n * qd], &mut s.k[..n * kw]);
    let inp = Input::prepare(&s.xn[..n * d], d, s.quantize, &mut s.xq); // shared by q (or q_a) and kv_a
    match q {
        MlaQuery::Direct(wq) => matmul_many(&mut [(model.mat(wq), &mut *qo), (model.mat(wkv_a), &mut *kv)], &inp), // [T, H·Dh], [T, R + Dr]
        MlaQuery::LowRank(wa, norm_w, wb) => {
            let rq = m.q_lora_rank.expect("low-rank query");
            let lat = &mut s.mla.q_lat[..n * rq];
            matmul_many(&mut [(model.mat(wa), &mut *lat), (model.mat(wkv_a), &mut *kv)], &inp); // [T, Rq], [T, R + Dr]
            rmsnorm_rows_inplace(lat, model.vec(norm_w), m.latent_eps);
            matmul(&model.mat(wb), &Input::prepare(lat, rq, s.quantize, &mut s.xq), qo); // [T, H·Dh]
        }
    }
    let kn = model.vec(kv_a_norm);
    for t in 0..n {
        let row = &mut kv[t * kw..(t + 1) * kw];
        rmsnorm_rows_inplace(&mut row[..m.kv_lora_rank], kn, m.latent_eps); // the latent, [R]
        let (cs, sn) = (&s.cos[t * half..(t + 1) * half], &s.sin[t * half..(t + 1) * half]);
        model.rope.rotate(&mut row[m.kv_lora_rank..], cs, sn); // k_pe, [Dr]
        for head in qo[t * qd..(t + 1) * qd].chunks_exact_mut(dh) {
            model.rope.rotate(&mut head[m.qk_nope_dim..], cs, sn); // q_pe, [Dr]
        }
    }
}

/// For each of the `h` heads: `out[t, head][..rh] = W_head · x[t, head][..W.cols]`,
/// where `x` rows are `[T, H, sx]`, `out` rows `[T, H, so]` (each head's part
/// at the start of its stride) and `W_head` is rows `head·rh..(head+1)·rh` of
/// `w` (per-head matrices stacked, rh = rows / H). The heads run side by
/// side, each on one thread, through gathered rows.
#[allow(clippy::too_many_arguments)]
fn per_head_matmul(
    w: &Matrix,
    h: usize,
    x: &[f32],
    sx: usize,
    out: &mut [f32],
    so: usize,
    quantize: bool,
    s: &mut HeadScratch,
) {
    let (n, rh, ci) = (x.len() / (h * sx), w.rows / h, w.cols);
    let (input, output) = (&mut s.input[..h * n * ci], &mut s.output[..h * n * rh]);
    for (head, rows) in input.chunks_exact_mut(n * ci).enumerate() {
        for (t, row) in rows.chunks_exact_mut(ci).enumerate() {
            let at = (t * h + head) * sx;
            row.copy_from_slice(&x[at..at + ci]); // [T, ci] of this head
        }
    }
    // Blocks per head when quantised (at least one slot per head either way,
    // so the zip below visits every head).
    let qw = if quantize && w.dtype.is_quantized() && ci.is_multiple_of(32) { n * ci / 32 } else { 0 };
    let q = &mut s.q[..h * qw.max(1)];
    input.par_chunks(n * ci).zip(output.par_chunks_mut(n * rh)).zip(q.par_chunks_mut(qw.max(1))).enumerate().for_each(
        |(head, ((xin, y), q))| {
            let inp = Input::prepare(xin, ci, qw > 0, q);
            matmul_serial(&w.row_range(head * rh, rh), &inp, y); // [T, rh]
        },
    );
    for (head, rows) in output.chunks_exact(n * rh).enumerate() {
        for (t, row) in rows.chunks_exact(rh).enumerate() {
            let at = (t * h + head) * so;
            out[at..at + rh].copy_from_slice(row);
        }
    }
}

/// When the next layer is a MoE block and experts stream: run its router on
/// this residual, normed as the next layer will norm its own, and queue the
/// experts it picks for background reads while this layer's FFN and the next
/// attention compute. Only the store's reads change; no number does.
fn prefetch_next_layer(model: &Model, l: usize, s: &mut Workspace, n: usize) {
    if !model.experts.wants_prefetch() {
        return;
    }
    let Some(next) = model.layers.get(l + 1) else { return };
    let Some(layer) = moe_layer(model, l + 1, next) else { return };
    let d = model.config.hidden_size;
    norm(model, next.ffn_norm, &s.x[..n * d], &mut s.moe.pred_x[..n * d]);
    let experts = predict(&layer, n, &mut s.moe);
    model.experts.prefetch(l + 1, experts);
}

/// The routed half of layer `l`'s MoE block, if it has one.
fn moe_layer<'a>(model: &'a Model, l: usize, lw: &LayerRefs) -> Option<MoeLayer<'a>> {
    let FfnRefs::Moe { router, router_bias, correction, .. } = lw.ffn else { return None };
    let moe = model.config.moe.as_ref().expect("validated: MoE layer has a spec");
    Some(MoeLayer {
        layer: l,
        router: model.mat(router),
        router_bias: model.opt_vec(router_bias),
        correction: model.opt_vec(correction),
        spec: &moe.router,
        act: moe.activation,
        store: model.experts.as_ref(),
        telemetry: model.telemetry.layers.get(l),
    })
}

/// `proj = ffn(xn)`: the dense MLP, or the MoE block (router, routed
/// experts, shared expert).
fn ffn_or_moe(model: &Model, l: usize, s: &mut Workspace, n: usize) -> Result<()> {
    let lw = &model.layers[l];
    let d = model.config.hidden_size;
    let proj = &mut s.proj[..n * d];
    let inp = Input::prepare(&s.xn[..n * d], d, s.quantize, &mut s.xq); // shared by router, experts, shared expert
    let scratch = MlpScratch { g: &mut s.g, u: &mut s.u, hq: &mut s.hq };
    match lw.ffn {
        FfnRefs::Dense(m) => {
            // Every supported family's dense layers are SiLU-gated.
            gated_mlp(&mlp(model, m), Activation::Silu, &inp, scratch, proj, true);
            Ok(())
        }
        FfnRefs::Moe { shared, shared_gate, .. } => {
            let block = MoeBlock {
                routed: moe_layer(model, l, lw).expect("a MoE layer"),
                shared: shared.map(|m| mlp(model, m)),
                shared_gate: model.opt_vec(shared_gate),
            };
            moe_block(&block, &inp, &mut s.moe, scratch, &mut s.shared[..n * d], proj)
        }
    }
}

/// `logits = lm_head · xn (+ bias) / s_logits` for the last token of each
/// segment that asks, into its sequence; for every token when captured (one
/// segment).
fn lm_head(model: &Model, s: &mut Workspace, segs: &mut [Segment], n: usize, off: usize, cap: &mut Capture) {
    let c = &model.config;
    let (d, vocab) = (c.hidden_size, c.vocab_size);
    let head = model.mat(model.lm_head);
    let finish = |y: &mut [f32]| {
        if let Some(b) = model.opt_vec(model.lm_head_bias) {
            add_bias(y, b);
        }
        if c.scales.logits_divisor != 1.0 {
            y.iter_mut().for_each(|v| *v /= c.scales.logits_divisor);
        }
    };
    let xn = &s.xn[..n * d];
    if let Some(all) = cap.logits.as_deref_mut() {
        let y = &mut all[off * vocab..(off + n) * vocab];
        matmul(&head, &Input::prepare(xn, d, s.quantize, &mut s.xq), y); // [T, V]
        finish(y);
        for g in segs.iter_mut().filter(|g| g.logits) {
            g.seq.logits.copy_from_slice(&y[(n - 1) * vocab..n * vocab]);
        }
        return;
    }
    // The rows whose logits nobody asked for are still the head's input to
    // a calibration (a no-op otherwise); the others are gathered, [S, D].
    let mut wanted = 0;
    for (g, (r0, m)) in segs.iter().zip(rows(segs)) {
        let plain = if g.logits { m - 1 } else { m };
        observe_unmultiplied(&head, &Input::plain(&xn[r0 * d..(r0 + plain) * d], d));
        if g.logits {
            let last = r0 + m - 1;
            s.head_x[wanted * d..(wanted + 1) * d].copy_from_slice(&xn[last * d..(last + 1) * d]);
            wanted += 1;
        }
    }
    if wanted == 0 {
        return;
    }
    let y = &mut s.head_y[..wanted * vocab];
    matmul(&head, &Input::prepare(&s.head_x[..wanted * d], d, s.quantize, &mut s.xq), y); // [S, V]
    for (row, g) in y.chunks_exact_mut(vocab).zip(segs.iter_mut().filter(|g| g.logits)) {
        finish(row);
        g.seq.logits.copy_from_slice(row);
    }
}

fn mlp(model: &Model, m: MlpRefs) -> Mlp<'_> {
    Mlp { gate: model.mat(m.gate), up: model.mat(m.up), down: model.mat(m.down), bias: None }
}
