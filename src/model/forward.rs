//! The forward pass: one implementation for every architecture, driven by the
//! canonical config. Reads top to bottom like the maths; no ISA, dtype or
//! architecture branches (those live in `kernels`, `quant` and `arch`).
//!
//! ```text
//! x = embed(tokens) · s_emb                                [T, D]
//! for each layer:
//!     x += s_res · post(attention(norm(x)))                GQA or MLA, over the KV cache
//!     x += s_res · post(ffn_or_moe(norm(x)))               dense MLP, or router + experts + shared
//!     x *= layer scale                                     (post norms and scale where the model has them)
//! logits = softcap(lm_head(norm(x)) / s_logits)            [T, V]
//! ```
//!
//! Tokens are processed in chunks of at most C (the session's chunk size):
//! a prompt is a few batched passes, decoding is a pass of one token.

use super::blocks::attention::{Heads, attend};
use super::blocks::block_index::{BlockIndexRefs, BlockIndexer};
use super::blocks::delta::{Delta, DeltaRefs};
use super::blocks::ffn::{MlpScratch, add_bias, gated_mlp, sigmoid};
use super::blocks::gqa::Gqa;
use super::blocks::hyper::Hyper;
use super::blocks::indexer::{IndexRefs, Indexer, attend_rows};
use super::blocks::mla::{Mla, MlaQ};
use super::blocks::moe::{MoeBlock, MoeLayer, moe_block, moe_forward, predict};
use super::blocks::norm::{norm_rows, rmsnorm_rows_inplace};
use super::blocks::pooled::{PoolRefs, PoolW, Pooled, PooledRefs};
use super::blocks::rope::Rope;
use super::session::{Sequence, Session, Workspace};
use super::weights::{Mlp, TensorRef};
use super::{FfnRefs, LayerRefs, MlaQuery, MlpRefs, Model, NormRefs, QkvRefs};
use crate::canonical::config::{Activation, MixerSpec, Pool, QkNorm};
use crate::error::{Error, Result};
use crate::kernels::matmul;

/// Optional outputs beyond the last token's logits (always left in
/// `Sequence::logits`).
#[derive(Default)]
pub struct Capture<'a> {
    /// [T, V]: logits of every token of the call.
    pub logits: Option<&'a mut [f32]>,
    /// [L+1, T, D]: the embedding, then each layer's output, the last one
    /// after the final norm (transformers' `output_hidden_states` convention).
    pub hidden: Option<&'a mut [f32]>,
    /// [P, V]: the multi-token-prediction layer's logits of every row a
    /// drafting sequence computes, by position (row `i` predicts token
    /// `i + 2`).
    pub mtp_logits: Option<&'a mut [f32]>,
    /// [T, D]: the residual stream after the last layer, which a pipeline
    /// stage other than the last hands to the next (it computes no logits).
    pub residual: Option<&'a mut [f32]>,
}

/// Checks what a call gives and asks of a pipeline stage: input rows when
/// (and only when) the stage does not embed, and a residual output when
/// (and only when) it computes no logits; captures of the whole model's
/// outputs only from the whole model.
fn check_stage_io(model: &Model, n: usize, input: Option<&[f32]>, cap: &Capture) -> Result<()> {
    let (st, d) = (&model.stage, model.config.residual_width());
    let bad = |what: String| Err(Error::InvalidInput(format!("pipeline stage of layers {:?}: {what}", st.layers)));
    match input {
        None if !st.embeds() => {
            return bad("it does not embed tokens: give the residual rows of the stage before".into());
        }
        Some(_) if st.embeds() => return bad("it embeds the tokens itself: give no residual rows".into()),
        Some(h) if h.len() != n * d => {
            return bad(format!("{} residual values for {n} tokens of width {d}: expected {}", h.len(), n * d));
        }
        _ => {}
    }
    match cap.residual.as_deref() {
        None if !st.heads() => bad("it is not the last stage: give room for its residual rows".into()),
        Some(_) if st.heads() => bad("it is the last stage: it computes logits, not residual rows".into()),
        Some(r) if r.len() != n * d => bad(format!("room for {} residual values, expected {}", r.len(), n * d)),
        _ if !st.is_whole() && (cap.hidden.is_some() || cap.mtp_logits.is_some()) => {
            bad("hidden states and drafts are captured from a whole model only".into())
        }
        _ if !st.heads() && cap.logits.is_some() => bad("only the last stage computes logits".into()),
        _ => Ok(()),
    }
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
    cap: Capture,
    pool: Option<&rayon::ThreadPool>,
    interrupted: &dyn Fn() -> bool,
) -> Result<()> {
    forward_stage(model, s, tokens, None, cap, pool, interrupted)
}

/// [`forward`] for a model that is one pipeline stage
/// ([`Model::stage`](super::Model)): `input` is the residual stream `[T, D]`
/// the stage before left after its last layer (`None` for the first
/// stage, which embeds `tokens`), and a stage that is not the last leaves
/// its own in `cap.residual` instead of computing logits. Every stage is
/// given the tokens too: they fix the positions, and the checks are the
/// same as the whole model's.
pub fn forward_stage(
    model: &Model,
    s: &mut Session,
    tokens: &[u32],
    input: Option<&[f32]>,
    mut cap: Capture,
    pool: Option<&rayon::ThreadPool>,
    interrupted: &dyn Fn() -> bool,
) -> Result<()> {
    check_tokens(model, &s.seq, tokens)?;
    check_stage_io(model, tokens.len(), input, &cap)?;
    let total = tokens.len();
    let end = s.seq.pos + total;
    let mut done = 0;
    while done < total {
        if interrupted() {
            return Err(Error::Interrupted);
        }
        let n = (total - done).min(s.ws.chunk);
        let logit_rows = usize::from(done + n == total);
        let seg = Segment { seq: &mut s.seq, tokens: &tokens[done..done + n], end, logit_rows };
        let ws = &mut s.ws;
        let mut segs = [seg];
        match pool {
            Some(p) => p.install(|| forward_chunk(model, ws, &mut segs, input, done, total, &mut cap))?,
            None => forward_chunk(model, ws, &mut segs, input, done, total, &mut cap)?,
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
    /// How many of the last tokens' logits to compute (0 or 1, or more to
    /// verify drafted tokens): the last one's go to `seq.logits`, the ones
    /// before it to `seq.earlier_logits`.
    pub logit_rows: usize,
}

/// One pass over the tokens of several sequences at once: every weight is
/// read once for all of them and each routed expert once for all the tokens
/// routed to it, while each sequence attends only to its own cache. Each
/// row's numbers are those it would get alone (the kernels give every row
/// the same bits whatever the rows beside it), so batching never changes a
/// token. At most `ws.chunk` tokens and `ws.logit_rows` logit rows in all; the
/// tokens are checked as [`forward`] checks them.
pub fn forward_batch(
    model: &Model,
    ws: &mut Workspace,
    segs: &mut [Segment],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    forward_batch_stage(model, ws, segs, None, None, pool)
}

/// [`forward_batch`] on a model that is one pipeline stage: `input` is the
/// stage before's residual rows for every segment's tokens, in order (`None`
/// on the first stage), and a stage before the last leaves its own in
/// `residual` (see [`forward_stage`]).
pub fn forward_batch_stage(
    model: &Model,
    ws: &mut Workspace,
    segs: &mut [Segment],
    input: Option<&[f32]>,
    residual: Option<&mut [f32]>,
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    let n: usize = segs.iter().map(|g| g.tokens.len()).sum();
    let logit_rows: usize = segs.iter().map(|g| g.logit_rows).sum();
    if let Some(g) = segs.iter().find(|g| {
        g.logit_rows > g.tokens.len()
            || g.seq.earlier_logits.len() < g.logit_rows.saturating_sub(1) * model.config.vocab_size
    }) {
        return Err(Error::InvalidInput(format!(
            "a segment of {} tokens asks the logits of {} rows, more than it has or its sequence holds",
            g.tokens.len(),
            g.logit_rows
        )));
    }
    if n > ws.chunk || logit_rows > ws.logit_rows {
        return Err(Error::InvalidInput(format!(
            "a batch of {n} tokens and {logit_rows} logit rows does not fit a workspace of {} and {}",
            ws.chunk, ws.logit_rows
        )));
    }
    for g in segs.iter() {
        check_tokens(model, g.seq, g.tokens)?;
    }
    let mut cap = Capture { residual, ..Capture::default() };
    check_stage_io(model, n, input, &cap)?;
    match pool {
        Some(p) => p.install(|| forward_chunk(model, ws, segs, input, 0, n, &mut cap)),
        None => forward_chunk(model, ws, segs, input, 0, n, &mut cap),
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
    input: Option<&[f32]>,
    off: usize,
    total: usize,
    cap: &mut Capture,
) -> Result<()> {
    let c = &model.config;
    let (d, wres) = (c.hidden_size, c.residual_width());
    let n: usize = segs.iter().map(|g| g.tokens.len()).sum();
    debug_assert!(segs.len() == 1 || (cap.logits.is_none() && cap.hidden.is_none() && cap.mtp_logits.is_none()));
    // A hidden state is D wide: with hyper-connections, the first stream.
    let snap = |hidden: &mut Option<&mut [f32]>, slot: usize, x: &[f32]| {
        if let Some(h) = hidden.as_deref_mut() {
            let at = (slot * total + off) * d;
            for t in 0..n {
                h[at + t * d..at + (t + 1) * d].copy_from_slice(&x[t * wres..t * wres + d]);
            }
        }
    };
    for (t, &tok) in segs.iter().flat_map(|g| g.tokens).enumerate() {
        s.tokens[t] = tok;
    }

    match input {
        None => {
            embed(model, s, segs); // x: [T, D]
            if let Some(hc) = c.hyper {
                // Every stream starts as the embedding: [T, N·D].
                for t in (0..n).rev() {
                    for k in (0..hc.streams).rev() {
                        s.x.copy_within(t * d..(t + 1) * d, t * wres + k * d);
                    }
                }
            }
        }
        Some(h) => s.x[..n * wres].copy_from_slice(&h[off * wres..(off + n) * wres]),
    }
    snap(&mut cap.hidden, 0, &s.x);
    rope_angles(model, s, segs);
    let layers = c.main_layers();
    for l in model.stage.layers.clone() {
        layer(model, l, s, segs, n)?; // x: [T, D]
        if l + 1 < layers {
            snap(&mut cap.hidden, l + 1, &s.x);
        }
    }
    if let Some(out) = cap.residual.as_deref_mut() {
        // A stage before the last: its rows go on to the next stage.
        out[off * wres..(off + n) * wres].copy_from_slice(&s.x[..n * wres]);
        for g in segs.iter_mut() {
            g.seq.pos += g.tokens.len();
        }
        model.telemetry.tokens.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        return Ok(());
    }
    let (final_norm, _) = model.head();
    match model.hc_head {
        Some(head) => {
            hyper(model, head).head(&s.x[..n * wres], &mut s.hc_col[..n * d]); // [T, D]
            norm(model, final_norm, &s.hc_col[..n * d], &mut s.xn[..n * d]);
        }
        None => norm(model, final_norm, &s.x[..n * d], &mut s.xn[..n * d]),
    }
    if let Some(h) = cap.hidden.as_deref_mut() {
        let at = (layers * total + off) * d;
        h[at..at + n * d].copy_from_slice(&s.xn[..n * d]);
    }
    lm_head(model, s, segs, n, off, cap);
    let mut r0 = 0;
    for g in segs.iter_mut() {
        let m = g.tokens.len();
        if let Some(rows) = g.seq.mtp.as_mut() {
            rows.keep(g.seq.pos, &s.xn[r0 * d..(r0 + m) * d], d);
        }
        r0 += m;
    }
    for g in segs.iter_mut() {
        g.seq.pos += g.tokens.len();
    }
    model.telemetry.tokens.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    for g in segs.iter_mut() {
        mtp_rows_of_pass(model, s, g, cap.mtp_logits.as_deref_mut())?;
    }
    Ok(())
}

/// A hyper-connection's weights.
fn hyper(model: &Model, [f, b, sc]: [TensorRef; 3]) -> Hyper<'_> {
    let spec = model.config.hyper.expect("hyper-connection weights imply the spec");
    Hyper { spec, norm_eps: model.config.norm.eps, fn_: model.vec(f), base: model.vec(b), scale: model.vec(sc) }
}

/// One decoder layer with hyper-connections: the streams `x` ([T, N·D])
/// collapse into each block's input and take its output back.
fn hyper_layer(model: &Model, l: usize, s: &mut Workspace, segs: &mut [Segment], n: usize) -> Result<()> {
    let (c, lw) = (&model.config, model.layer(l));
    let (d, w, nh) = (c.hidden_size, c.residual_width(), c.hyper.map_or(1, |h| h.streams));
    let [attn_hc, ffn_hc] = lw.hyper.expect("a hyper layer has its weights");
    let (post, comb) = (&mut s.hc_post[..n * nh], &mut s.hc_comb[..n * nh * nh]);
    hyper(model, attn_hc).before(&s.x[..n * w], &mut s.hc_col[..n * d], post, comb); // [T, D]
    norm(model, lw.attn_norm, &s.hc_col[..n * d], &mut s.xn[..n * d]);
    attention(model, l, s, segs, n); // proj: [T, D]
    hyper(model, attn_hc).after(
        &mut s.x[..n * w],
        &s.proj[..n * d],
        &s.hc_post[..n * nh],
        &s.hc_comb[..n * nh * nh],
        &mut s.hc_tmp,
    );
    let (post, comb) = (&mut s.hc_post[..n * nh], &mut s.hc_comb[..n * nh * nh]);
    hyper(model, ffn_hc).before(&s.x[..n * w], &mut s.hc_col[..n * d], post, comb); // [T, D]
    let ffn_norm = lw.ffn_norm.expect("a layer with hyper-connections has an FFN");
    norm(model, ffn_norm, &s.hc_col[..n * d], &mut s.xn[..n * d]);
    ffn_or_moe(model, l, s, n)?; // proj: [T, D]
    hyper(model, ffn_hc).after(
        &mut s.x[..n * w],
        &s.proj[..n * d],
        &s.hc_post[..n * nh],
        &s.hc_comb[..n * nh * nh],
        &mut s.hc_tmp,
    );
    Ok(())
}

/// One decoder layer over the chunk's `n` rows of `x`, in place.
fn layer(model: &Model, l: usize, s: &mut Workspace, segs: &mut [Segment], n: usize) -> Result<()> {
    let (c, lw) = (&model.config, model.layer(l));
    if lw.hyper.is_some() {
        return hyper_layer(model, l, s, segs, n);
    }
    let d = c.hidden_size;
    norm(model, lw.attn_norm, &s.x[..n * d], &mut s.xn[..n * d]);
    attention(model, l, s, segs, n); // proj: [T, D]
    post_norm(model, lw.post_norms.map(|[a, _]| a), &mut s.proj[..n * d]);
    residual(&mut s.x[..n * d], &s.proj[..n * d], c.scales.residual);
    prefetch_next_layer(model, l, s, n);
    if let Some(ffn_norm) = lw.ffn_norm {
        norm(model, ffn_norm, &s.x[..n * d], &mut s.xn[..n * d]);
        ffn_or_moe(model, l, s, n)?; // proj: [T, D]
        post_norm(model, lw.post_norms.map(|[_, f]| f), &mut s.proj[..n * d]);
        residual(&mut s.x[..n * d], &s.proj[..n * d], c.scales.residual);
    }
    if let Some(scale) = model.opt_vec(lw.layer_scale) {
        s.x[..n * d].iter_mut().for_each(|v| *v *= scale[0]);
    }
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
    let table = model.mat(model.embedding());
    let scale = model.config.scales.embedding;
    for (t, &tok) in segs.iter().flat_map(|g| g.tokens).enumerate() {
        let row = &mut s.x[t * d..(t + 1) * d];
        table.decode_row(tok as usize, row); // [D]
        if scale != 1.0 {
            row.iter_mut().for_each(|v| *v *= scale);
        }
    }
}

/// RoPE cosines and sines of this chunk's positions: `[T, R/2]` each (and
/// `[T, Rg/2]` for the global layers' RoPE, if they have their own). Each
/// segment's `end` is where its run of tokens ends (LongRoPE's switch, as
/// transformers decides it per call).
fn rope_angles(model: &Model, s: &mut Workspace, segs: &[Segment]) {
    let ropes = [(&model.rope, &mut s.cos, &mut s.sin)];
    let global = model.global_rope.as_ref().map(|r| (r, &mut s.global_cos, &mut s.global_sin));
    for (rope, cos, sin) in ropes.into_iter().chain(global) {
        let half = rope.inv_freq.len();
        for ((r0, m), g) in rows(segs).zip(segs) {
            for i in 0..m {
                let t = r0 + i;
                let (cs, sn) = (&mut cos[t * half..(t + 1) * half], &mut sin[t * half..(t + 1) * half]);
                rope.angles(g.seq.pos + i, g.end, cs, sn);
            }
        }
    }
}

/// `y = rmsnorm(y) · w` of each row, in place, when the block's output is
/// normed before the residual add.
fn post_norm(model: &Model, w: Option<TensorRef>, y: &mut [f32]) {
    if let Some(w) = model.opt_vec(w) {
        rmsnorm_rows_inplace(y, w, model.config.norm.eps);
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
/// values from `xn`, appends each sequence's keys and values to its cache,
/// attends over it.
fn attention(model: &Model, l: usize, s: &mut Workspace, segs: &mut [Segment], n: usize) {
    let c = &model.config;
    let lw = model.layer(l);
    // This layer's heads and RoPE (a global layer may have its own).
    let shape = c.head_shape(l);
    let (rope, cos, sin) = match (&model.global_rope, shape.global) {
        (Some(r), true) => (r, &s.global_cos, &s.global_sin),
        _ => (&model.rope, &s.cos, &s.sin),
    };
    let (d, h, dh, half) = (c.hidden_size, c.num_heads, shape.head_dim, rope.inv_freq.len());
    let window = c.layers[l].mixer.window();
    let sinks = model.opt_vec(lw.sinks);
    let ad = if c.mla().is_some() { c.att_dim() } else { h * dh };
    // Over the q/k head width Dh (MLA: nope + rope, not the latent's width).
    let scale = c.attention.softmax_scale.unwrap_or(1.0 / (dh as f32).sqrt());
    let temperature = c.attention.temperature;
    let (xn, cos, sin) = (&s.xn[..n * d], &cos[..n * half], &sin[..n * half]);
    match lw.qkv {
        QkvRefs::Gqa { wq, wk, wv, index } => {
            let (qd, kvd) = (h * dh, shape.kv_heads * dh);
            let (q, k, v) = (&mut s.q[..n * qd], &mut s.k[..n * kvd], &mut s.v[..n * kvd]);
            let gate = &mut s.gate[..if lw.wg.is_some() { n * qd } else { 0 }];
            gqa(model, lw, wq, wk, wv, dh, rope).project(xn, &mut s.xq, cos, sin, q, k, v, gate); // q: [T, H·Dh], k, v: [T, Hkv·Dh]
            let heads = Heads { h, hkv: shape.kv_heads, dk: dh, dv: dh, window, scale, sinks, temperature };
            if let Some(index) = index {
                block_sparse_attention(model, l, index, heads, s, segs, n);
            } else {
                let (q, k, v) = (&s.q, &s.k, &s.v);
                let (att, order) = (&mut s.att[..n * ad], &mut s.att_order[..n * ad]);
                each_segment(segs, 0, ad, att, order, &|r0, g, att, order| {
                    let (m, pos0) = (g.tokens.len(), g.seq.pos);
                    let r = r0..r0 + m;
                    let cache = g.seq.kv(l);
                    cache.store(pos0, &k[r.start * kvd..r.end * kvd], &v[r.start * kvd..r.end * kvd]);
                    attend(&q[r.start * qd..r.end * qd], cache.view(pos0 + m), pos0, heads, order, att); // [m, H·Dh]
                });
            }
            if lw.wg.is_some() {
                // att · sigmoid(gate), before the output projection.
                s.att[..n * ad].iter_mut().zip(&s.gate[..n * qd]).for_each(|(a, &g)| *a *= sigmoid(g));
            }
        }
        QkvRefs::Delta(refs) => {
            linear_attention(model, l, refs, s, segs, n);
            return;
        }
        QkvRefs::Pooled(refs) => {
            pooled_attention(model, l, refs, s, segs, n);
            return;
        }
        QkvRefs::Mla { q, wkv_a, kv_a_norm, wk_b, wv_b, index } => {
            let block = mla(model, q, wkv_a, kv_a_norm, wk_b, wv_b);
            let (r, dr) = (block.spec.kv_lora_rank, block.spec.qk_rope_dim);
            let (qs, kv) = (&mut s.q[..n * h * dh], &mut s.k[..n * (r + dr)]);
            block.project(xn, &mut s.xq, cos, sin, qs, kv, &mut s.mla); // q: [T, H·Dh], k: [T, R + Dr]
            block.absorb(&s.q[..n * h * dh], &mut s.mla); // q_abs: [T, H·(R + Dr)]
            // One latent "kv head" shared by all heads; the values are the latent.
            let heads = Heads { h, hkv: 1, dk: r + dr, dv: r, window, scale, sinks, temperature };
            if let Some(index) = index {
                sparse_attention(model, l, index, heads, s, segs, n);
            } else {
                let (qw, ow) = (h * (r + dr), h * r);
                let (k, q_abs) = (&s.k, &s.mla.q_abs);
                let (o_lat, order) = (&mut s.mla.o_lat[..n * ow], &mut s.att_order[..n * ow]);
                each_segment(segs, 0, ow, o_lat, order, &|r0, g, o_lat, order| {
                    let (t, pos0) = (g.tokens.len(), g.seq.pos);
                    let cache = g.seq.kv(l);
                    cache.store(pos0, &k[r0 * (r + dr)..(r0 + t) * (r + dr)], &[]);
                    let qa = &q_abs[r0 * qw..(r0 + t) * qw];
                    attend(qa, cache.view(pos0 + t), pos0, heads, order, o_lat); // [t, H·R]
                });
            }
            block.expand(n, &mut s.mla, &mut s.att); // att: [T, H·Dv]
        }
    }
    let proj = &mut s.proj[..n * d];
    matmul(&model.mat(lw.wo), &s.xq.prepare(&s.att[..n * ad], ad), proj); // [T, D]
    if let Some(bo) = model.opt_vec(lw.o_bias) {
        add_bias(proj, bo);
    }
}

/// DeepSeek Sparse Attention, after the latent projections: the layer's
/// indexer appends its keys and, for each query that sees more than K keys,
/// selects K of them (a layer that shares reads the selection the layer
/// before it left in the workspace); then each sequence's latent rows are
/// stored and attended, over the whole cache for queries that keep every key
/// and over the selected rows for the others. The selection of a query is
/// one task parallel over its keys, and its attention one task parallel over
/// heads, so the sequences go one after another.
fn sparse_attention(
    model: &Model,
    l: usize,
    index: IndexRefs,
    heads: Heads,
    s: &mut Workspace,
    segs: &mut [Segment],
    n: usize,
) {
    let c = &model.config;
    let m = c.mla().expect("a sparse layer is latent attention");
    let spec = m.indexer.expect("validated: a sparse layer has an indexer spec");
    let (d, half, kw) = (c.hidden_size, c.rope.rotary_dim / 2, m.kv_lora_rank + m.qk_rope_dim);
    let rq = m.q_lora_rank.expect("validated: the indexer reads the query latent");
    if let IndexRefs::Own(refs) = index {
        let ix = Indexer::new(&refs, spec, |t| model.mat(t), |t| model.vec(t));
        // Queries are needed only when some row sees more than K keys.
        let selects = segs.iter().any(|g| g.seq.pos + g.tokens.len() > spec.top_k);
        let (xn, q_lat) = (&s.xn[..n * d], &s.mla.q_lat[..n * rq]);
        let (cos, sin) = (&s.cos[..n * half], &s.sin[..n * half]);
        ix.project(xn, q_lat, selects, &mut s.xq, cos, sin, &mut s.index); // keys [T, Di]; queries [T, Hi·Di]
        let mut r0 = 0;
        for g in segs.iter_mut() {
            let (t, pos0) = (g.tokens.len(), g.seq.pos);
            let keys = g.seq.index_keys(l);
            keys.store(pos0, &s.index.keys(r0 + t, spec.head_dim)[r0 * spec.head_dim..]);
            for i in (spec.top_k.saturating_sub(pos0)).min(t)..t {
                ix.select(r0 + i, pos0 + i, keys.view(pos0 + t), &mut s.index); // sel: [K]
            }
            r0 += t;
        }
    }
    let (qw, ow) = (heads.h * heads.dk, heads.h * heads.dv);
    let mut r0 = 0;
    for g in segs.iter_mut() {
        let (t, pos0) = (g.tokens.len(), g.seq.pos);
        let cache = g.seq.kv(l);
        cache.store(pos0, &s.k[r0 * kw..(r0 + t) * kw], &[]);
        let q_abs = &s.mla.q_abs[r0 * qw..(r0 + t) * qw];
        let (o_lat, order) = (&mut s.mla.o_lat[r0 * ow..(r0 + t) * ow], &mut s.att_order[..t * ow]);
        attend_rows(q_abs, cache.view(pos0 + t), pos0, heads, &mut s.index, r0, order, o_lat); // [t, H·R]
        r0 += t;
    }
}

/// MiniMax Sparse Attention, after the GQA projections: the layer's block
/// indexer appends its keys and each sequence's keys and values are stored;
/// the rows that see no more than K blocks attend to the whole cache (one
/// call), each other row selects K blocks per index head and attends to
/// their rows only. A row's selection is one task parallel over its blocks,
/// its attention one task per index head, so rows and sequences go one
/// after another.
fn block_sparse_attention(
    model: &Model,
    l: usize,
    refs: BlockIndexRefs,
    heads: Heads,
    s: &mut Workspace,
    segs: &mut [Segment],
    n: usize,
) {
    let c = &model.config;
    let spec = c.attention.block_index.expect("validated: a block-sparse layer has a block indexer");
    let (d, half, di) = (c.hidden_size, model.rope.inv_freq.len(), spec.head_dim);
    let ix = BlockIndexer::new(&refs, spec, c.norm.eps, &model.rope, |t| model.mat(t), |t| model.vec(t));
    // Rows past the first K blocks select; queries are needed only then.
    let span = spec.top_blocks * spec.block;
    let selects = segs.iter().any(|g| g.seq.pos + g.tokens.len() > span);
    let (xn, cos, sin) = (&s.xn[..n * d], &s.cos[..n * half], &s.sin[..n * half]);
    ix.project(xn, selects, &mut s.xq, cos, sin, &mut s.block_index); // keys [T, Di]; queries [T, Hi·Di]
    let (qd, kvd) = (heads.h * heads.dk, heads.hkv * heads.dk);
    let mut r0 = 0;
    for g in segs.iter_mut() {
        let (m, pos0) = (g.tokens.len(), g.seq.pos);
        let (cache, keys) = g.seq.kv_and_index_keys(l);
        keys.store(pos0, s.block_index.keys(r0, r0 + m, di));
        cache.store(pos0, &s.k[r0 * kvd..(r0 + m) * kvd], &s.v[r0 * kvd..(r0 + m) * kvd]);
        let dense = m.min(span.saturating_sub(pos0));
        let (q, att) = (&s.q[r0 * qd..(r0 + m) * qd], &mut s.att[r0 * qd..(r0 + m) * qd]);
        if dense > 0 {
            let order = &mut s.att_order[..dense * qd];
            attend(&q[..dense * qd], cache.view(pos0 + m), pos0, heads, order, &mut att[..dense * qd]); // [dense, H·Dh]
        }
        for i in dense..m {
            let p = pos0 + i;
            ix.select(r0 + i, p, keys.view(p + 1), &mut s.block_index); // [Hi, K] blocks
            let (qi, oi) = (&q[i * qd..(i + 1) * qd], &mut att[i * qd..(i + 1) * qd]);
            ix.attend_selected(qi, p, cache.view(p + 1), heads, &mut s.block_index, oi); // [H·Dh]
        }
        r0 += m;
    }
}

/// `proj = W_o · grouped(attend(q, window + pool))`: DeepSeek-V4's pooled
/// attention over each sequence's window and pools.
fn pooled_attention(model: &Model, l: usize, refs: PooledRefs, s: &mut Workspace, segs: &mut [Segment], n: usize) {
    let c = &model.config;
    let d = c.hidden_size;
    let spec = c.pooled().expect("validated: a pooled layer has a pooled spec");
    let pool = match c.layers[l].mixer {
        MixerSpec::Pooled { pool } => pool,
        _ => Pool::Window,
    };
    let pool_rope = model.pool_rope.as_ref().expect("pooled attention has its RoPE");
    let pw = |r: &PoolRefs| PoolW::new(r, |t| model.mat(t), |t| model.vec(t));
    let block = Pooled {
        spec,
        pool,
        h: c.num_heads,
        dh: c.head_dim,
        eps: c.norm.eps,
        rope: if pool == Pool::Window { &model.rope } else { pool_rope },
        pool_rope,
        wq_a: model.mat(refs.wq_a),
        q_a_norm: model.vec(refs.q_a_norm),
        wq_b: model.mat(refs.wq_b),
        wkv: model.mat(refs.wkv),
        kv_norm: model.vec(refs.kv_norm),
        sinks: model.vec(refs.sinks),
        wo_a: model.mat(refs.wo_a),
        pooler: refs.pool.as_ref().map(pw),
        index: refs.index.as_ref().map(|ix| (pw(&ix.pool), model.mat(ix.wq), model.vec(ix.weights))),
    };
    let hd = c.num_heads * c.head_dim;
    for ((r0, m), g) in rows(segs).zip(segs.iter()) {
        for i in 0..m {
            s.positions[r0 + i] = g.seq.pos + i;
        }
    }
    let (xn, q) = (&s.xn[..n * d], &mut s.q[..n * hd]);
    block.project(xn, &s.positions[..n], &mut s.xq, q, &mut s.pooled); // q: [T, H·Dh]
    let mut r0 = 0;
    for g in segs.iter_mut() {
        let m = g.tokens.len();
        let pos0 = g.seq.pos;
        let att = &mut s.att[r0 * hd..(r0 + m) * hd];
        block.attend(g.seq.pooled(l), &s.q[..n * hd], r0, m, pos0, &mut s.pooled, att); // [m, H·Dh]
        r0 += m;
    }
    let grouped = block.group_out(&s.att[..n * hd], n, &mut s.xq, &mut s.pooled); // [T, G·Ro]
    let go = spec.o_groups * spec.o_lora_rank;
    matmul(&model.mat(model.layer(l).wo), &s.xq.prepare(grouped, go), &mut s.proj[..n * d]); // [T, D]
}

/// `proj = W_o · delta_rule(xn)`: a linear-attention layer over each
/// sequence's recurrent state.
fn linear_attention(model: &Model, l: usize, refs: DeltaRefs, s: &mut Workspace, segs: &mut [Segment], n: usize) {
    let c = &model.config;
    let d = c.hidden_size;
    let spec = c.linear.expect("validated: a linear layer has a linear spec");
    let block = Delta::new(&refs, spec, c.norm.eps, |t| model.mat(t), |t| model.vec(t));
    block.project(&s.xn[..n * d], &mut s.xq, &mut s.delta); // q | k | v, z, b, a
    // The convolution of every sequence first (cheap, serial), then the rule
    // of each sequence side by side, its value heads in parallel inside.
    let mut r0 = 0;
    for g in segs.iter_mut() {
        let m = g.tokens.len();
        block.conv(&mut s.delta, n, r0, m, g.seq.pos, g.seq.delta(l));
        r0 += m;
    }
    let vd = block.spec.value_dim();
    let (rows, by_head, out) = s.delta.split(n);
    each_segment(segs, 0, vd, out, by_head, &|r0, g, out, by_head| {
        block.rule(&rows, r0, g.seq.delta(l), by_head, out); // [m, Hv·Dv]
    });
    let wo = model.mat(model.layer(l).wo);
    matmul(&wo, &s.xq.prepare(s.delta.out(n), vd), &mut s.proj[..n * d]); // [T, D]
}

/// Layer `lw`'s GQA projections, of head width `dh`, rotated by `rope`.
fn gqa<'a>(
    model: &'a Model,
    lw: &LayerRefs,
    wq: TensorRef,
    wk: TensorRef,
    wv: Option<TensorRef>,
    dh: usize,
    rope: &'a Rope,
) -> Gqa<'a> {
    let c = &model.config;
    let qk_norm = lw.qk_norm.map(|[qn, kn]| [model.vec(qn), model.vec(kn)]);
    debug_assert!(qk_norm.is_none_or(|[wqn, _]| c.attention.qk_norm == QkNorm::PerHead || wqn.len() == c.q_dim()));
    Gqa {
        wq: model.mat(wq),
        wk: model.mat(wk),
        wv: wv.map(|t| model.mat(t)),
        wg: lw.wg.map(|t| model.mat(t)),
        bg: model.opt_vec(lw.bg),
        bias: lw.qkv_bias.map(|b| b.map(|t| model.vec(t))),
        qk_norm,
        eps: c.norm.eps,
        clip: c.attention.clip_qkv,
        v_norm: c.attention.value_norm,
        dh,
        rope,
        rotate: !c.attention.no_rope,
    }
}

/// A layer's MLA weights.
fn mla<'a>(
    model: &'a Model,
    q: MlaQuery,
    wkv_a: TensorRef,
    kv_a_norm: TensorRef,
    wk_b: TensorRef,
    wv_b: TensorRef,
) -> Mla<'a> {
    let c = &model.config;
    Mla {
        q: match q {
            MlaQuery::Direct(wq) => MlaQ::Direct(model.mat(wq)),
            MlaQuery::LowRank(wa, norm, wb) => MlaQ::LowRank(model.mat(wa), model.vec(norm), model.mat(wb)),
        },
        wkv_a: model.mat(wkv_a),
        kv_a_norm: model.vec(kv_a_norm),
        wk_b: model.mat(wk_b),
        wv_b: model.mat(wv_b),
        spec: *c.mla().expect("MLA weights imply an MLA config"),
        h: c.num_heads,
        dh: c.head_dim,
        rope: (!c.attention.no_rope).then_some(&model.rope),
    }
}

/// When the next layer is a MoE block and experts stream: run its router on
/// this residual, normed as the next layer will norm its own, and queue the
/// experts it picks for background reads while this layer's FFN and the next
/// attention compute. Only the store's reads change; no number does.
fn prefetch_next_layer(model: &Model, l: usize, s: &mut Workspace, n: usize) {
    if !model.experts.wants_prefetch() || model.config.hyper.is_some() {
        return; // (with hyper-connections the router's input is not a norm of one stream)
    }
    if l + 1 >= model.config.main_layers() || !model.stage.runs(l + 1) {
        return; // the multi-token-prediction layer runs in a pass of its own; another stage's layers are not ours
    }
    let next = model.layer(l + 1);
    let Some(layer) = moe_layer(model, l + 1, next, &s.tokens[..n]) else { return };
    let d = model.config.hidden_size;
    router_input(model, next, &s.x[..n * d], &mut s.moe.pred_x[..n * d]);
    let experts = predict(&layer, n, &mut s.moe);
    model.experts.prefetch(l + 1, experts);
}

/// What layer `lw`'s router reads of the residual `x` ([T, D]), into `out`:
/// its own norm times the spec's constant, or the FFN's norm.
fn router_input(model: &Model, lw: &LayerRefs, x: &[f32], out: &mut [f32]) {
    let own = model.config.moe.as_ref().and_then(|m| m.router.own_norm);
    match (lw.ffn, own) {
        (FfnRefs::Moe { router_norm: Some(w), .. }, Some(c)) => {
            norm_rows(model.config.norm, x, model.vec(w), None, out); // [T, D]
            out.iter_mut().for_each(|v| *v *= c);
        }
        _ => norm(model, lw.ffn_norm.expect("a MoE layer has an FFN norm"), x, out),
    }
}

/// The routed half of layer `l`'s MoE block, if it has one.
fn moe_layer<'a>(model: &'a Model, l: usize, lw: &LayerRefs, tokens: &'a [u32]) -> Option<MoeLayer<'a>> {
    let FfnRefs::Moe { router, router_bias, correction, expert_scale, hash_table, .. } = lw.ffn else {
        return None;
    };
    let moe = model.config.moe.as_ref().expect("validated: MoE layer has a spec");
    Some(MoeLayer {
        layer: l,
        router: model.mat(router),
        router_bias: model.opt_vec(router_bias),
        correction: model.opt_vec(correction),
        spec: &moe.router,
        expert_scale: model.opt_vec(expert_scale),
        router_x: None,
        act: moe.activation,
        store: model.experts.as_ref(),
        telemetry: model.telemetry.layers.get(l),
        hash: None,
    })
    .map(|mut m| {
        m.hash = hash_table.map(|t| (model.vec(t), tokens));
        m
    })
}

/// `proj = ffn(xn)`: the dense MLP, or the MoE block (router, routed
/// experts, shared expert).
fn ffn_or_moe(model: &Model, l: usize, s: &mut Workspace, n: usize) -> Result<()> {
    let lw = model.layer(l);
    let d = model.config.hidden_size;
    let proj = &mut s.proj[..n * d];
    let inp = s.xq.prepare(&s.xn[..n * d], d); // shared by router, experts, shared expert
    let scratch = MlpScratch { g: &mut s.g, u: &mut s.u, hq: &mut s.hq };
    match lw.ffn {
        FfnRefs::None => Ok(()),
        FfnRefs::Dense(m) => {
            gated_mlp(&mlp(model, m), model.config.dense_activation, &inp, scratch, proj);
            Ok(())
        }
        FfnRefs::Moe { shared, shared_gate, router_norm, branch_norms, latent, .. } => {
            let mut routed = moe_layer(model, l, lw, &s.tokens[..n]).expect("a MoE layer");
            if let Some([w_in, w_out]) = latent {
                // Latent MoE: the shared expert and the router read xn, the
                // routed experts its projection into the latent width L.
                let act = model.config.moe.as_ref().map_or(Activation::Silu, |m| m.activation);
                let (w_in, w_out) = (model.mat(w_in), model.mat(w_out));
                let ld = w_in.rows;
                let shared = shared.map(|m| mlp(model, m));
                if let Some(shared) = &shared {
                    gated_mlp(shared, act, &inp, scratch, &mut s.shared[..n * d]); // [T, D]
                }
                matmul(&w_in, &inp, &mut s.xr[..n * ld]); // [T, L]
                routed.router_x = Some(&s.xn[..n * d]);
                let y_lat = &mut s.xrt[..n * ld];
                moe_forward(&routed, &s.xq.prepare(&s.xr[..n * ld], ld), &mut s.moe, y_lat)?; // [T, L]
                matmul(&w_out, &s.xq.prepare(&s.xrt[..n * ld], ld), proj); // [T, D]
                if shared.is_some() {
                    proj.iter_mut().zip(&s.shared[..n * d]).for_each(|(p, y)| *p += y);
                }
                return Ok(());
            }
            if router_norm.is_some() {
                router_input(model, lw, &s.x[..n * d], &mut s.xrt[..n * d]); // [T, D]
                routed.router_x = Some(&s.xrt[..n * d]);
            }
            let Some([moe_norm, moe_post, shared_post]) = branch_norms else {
                let block =
                    MoeBlock { routed, shared: shared.map(|m| mlp(model, m)), shared_gate: model.opt_vec(shared_gate) };
                return moe_block(&block, &inp, &mut s.moe, scratch, &mut s.shared[..n * d], proj);
            };
            // Branch norms: the shared expert on the FFN norm's output, the
            // routed experts on their own norm of the residual, each output
            // normed, then added.
            let shared = mlp(model, shared.expect("validated: branch norms come with a shared expert"));
            let act = model.config.moe.as_ref().map_or(Activation::Silu, |m| m.activation);
            let y_shared = &mut s.shared[..n * d];
            gated_mlp(&shared, act, &inp, scratch, y_shared); // [T, D]
            rmsnorm_rows_inplace(y_shared, model.vec(shared_post), model.config.norm.eps);
            norm_rows(model.config.norm, &s.x[..n * d], model.vec(moe_norm), None, &mut s.xr[..n * d]); // [T, D]
            let inp = s.xq.prepare(&s.xr[..n * d], d);
            moe_forward(&routed, &inp, &mut s.moe, proj)?; // [T, D]
            rmsnorm_rows_inplace(proj, model.vec(moe_post), model.config.norm.eps);
            proj.iter_mut().zip(y_shared.iter()).for_each(|(p, y)| *p += y);
            Ok(())
        }
    }
}

/// `logits = lm_head · xn (+ bias) / s_logits` for the last token of each
/// segment that asks, into its sequence; for every token when captured (one
/// segment).
fn lm_head(model: &Model, s: &mut Workspace, segs: &mut [Segment], n: usize, off: usize, cap: &mut Capture) {
    let c = &model.config;
    let (d, vocab) = (c.hidden_size, c.vocab_size);
    let head = model.mat(model.head().1);
    let bias_and_scale = |y: &mut [f32]| finish_logits(model, y);
    let xn = &s.xn[..n * d];
    if let Some(all) = cap.logits.as_deref_mut() {
        let y = &mut all[off * vocab..(off + n) * vocab];
        matmul(&head, &s.xq.prepare(xn, d), y); // [T, V]
        bias_and_scale(y);
        for g in segs.iter_mut().filter(|g| g.logit_rows > 0) {
            keep_logits(g, &y[(n - g.logit_rows) * vocab..n * vocab], vocab);
        }
        return;
    }
    // The last rows whose logits are wanted, gathered: [S, D].
    let mut wanted = 0;
    for (g, (r0, m)) in segs.iter().zip(rows(segs)) {
        let first = r0 + m - g.logit_rows;
        s.head_x[wanted * d..(wanted + g.logit_rows) * d].copy_from_slice(&xn[first * d..(r0 + m) * d]);
        wanted += g.logit_rows;
    }
    if wanted == 0 {
        return;
    }
    let y = &mut s.head_y[..wanted * vocab];
    matmul(&head, &s.xq.prepare(&s.head_x[..wanted * d], d), y); // [S, V]
    y.chunks_exact_mut(vocab).for_each(bias_and_scale);
    let mut at = 0;
    for g in segs.iter_mut() {
        keep_logits(g, &y[at * vocab..(at + g.logit_rows) * vocab], vocab);
        at += g.logit_rows;
    }
}

/// The output head's bias, divisor and soft-cap on one row of logits.
fn finish_logits(model: &Model, y: &mut [f32]) {
    let c = &model.config;
    if let Some(b) = model.opt_vec(model.lm_head_bias) {
        add_bias(y, b);
    }
    if c.scales.logits_divisor != 1.0 {
        y.iter_mut().for_each(|v| *v /= c.scales.logits_divisor);
    }
    if let Some(cap) = c.logit_softcap {
        y.iter_mut().for_each(|v| *v = crate::math::tanhf(*v / cap) * cap);
    }
}

/// A segment's logit rows `[R, V]` into its sequence: the last to `logits`,
/// the ones before it to `earlier_logits`.
fn keep_logits(g: &mut Segment, y: &[f32], vocab: usize) {
    if let Some((earlier, last)) = g.logit_rows.checked_sub(1).map(|r| y.split_at(r * vocab)) {
        g.seq.earlier_logits[..earlier.len()].copy_from_slice(earlier);
        g.seq.logits.copy_from_slice(last);
    }
}

fn mlp(model: &Model, m: MlpRefs) -> Mlp<'_> {
    Mlp { gate: model.mat(m.gate), up: model.mat(m.up), down: model.mat(m.down), bias: None }
}

/// After a pass over a drafting sequence: the multi-token-prediction
/// layer's rows whose next token the pass fed (positions `held..pos − 1`;
/// the last position's waits for the token chosen from it). A sequence
/// whose rows cannot go on (a hidden state they need is gone) drafts no
/// more; its ordinary output is unaffected.
fn mtp_rows_of_pass(model: &Model, s: &mut Workspace, g: &mut Segment, logits: Option<&mut [f32]>) -> Result<()> {
    let d = model.config.hidden_size;
    let Some(rows) = g.seq.mtp.as_mut().filter(|r| !r.lost) else { return Ok(()) };
    let (pos, from) = (g.seq.pos, rows.held);
    let count = (pos - 1).saturating_sub(from);
    if count == 0 {
        return Ok(());
    }
    let p0 = pos - g.tokens.len();
    let Some(hidden) = rows.hidden_rows(from, count, d).filter(|_| from + 1 >= p0) else {
        rows.lost = true;
        return Ok(());
    };
    s.mtp_h[..count * d].copy_from_slice(hidden);
    let next = &g.tokens[from + 1 - p0..];
    let t0 = std::time::Instant::now();
    mtp_layer(model, s, g.seq, from, next, g.end)?; // x: [count, D]
    if let Some(out) = logits {
        let vocab = model.config.vocab_size;
        mtp_head(model, s, count, Some(&mut out[from * vocab..(from + count) * vocab]));
    }
    let rows = g.seq.mtp.as_mut().expect("checked above");
    rows.held = from + count;
    rows.secs += t0.elapsed().as_secs_f64();
    Ok(())
}

/// The multi-token-prediction layer over the rows of positions
/// `from..from + t`, reading the hidden states in `s.mtp_h` ([t, D]) and the
/// tokens `next` (the token after each position): its KV cache rows are
/// stored, its output left in `s.x` ([t, D]).
fn mtp_layer(
    model: &Model,
    s: &mut Workspace,
    seq: &mut Sequence,
    from: usize,
    next: &[u32],
    end: usize,
) -> Result<()> {
    let c = &model.config;
    let (d, t) = (c.hidden_size, next.len());
    let mtp = model.mtp.expect("a drafting sequence's model has the layer");
    let at = c.mtp_layer().expect("a drafting sequence's model has the layer");
    let (embed_norm, hidden_norm) = (model.vec(mtp.embed_norm), model.vec(mtp.hidden_norm));
    // The layer sees the sequence shifted by one: at position i, token i + 1.
    let pos = seq.pos;
    seq.pos = from;
    let mut one = [Segment { seq, tokens: next, end, logit_rows: 0 }];
    embed(model, s, &one); // x: [t, D]
    for i in 0..t {
        let (e_out, h_out) = s.mtp_in[i * 2 * d..(i + 1) * 2 * d].split_at_mut(d);
        norm_rows(c.norm, &s.x[i * d..(i + 1) * d], embed_norm, None, e_out);
        norm_rows(c.norm, &s.mtp_h[i * d..(i + 1) * d], hidden_norm, None, h_out);
    }
    matmul(&model.mat(mtp.proj), &s.xq.prepare(&s.mtp_in[..t * 2 * d], 2 * d), &mut s.x[..t * d]); // [t, D]
    rope_angles(model, s, &one);
    let done = layer(model, at, s, &mut one, t);
    one[0].seq.pos = pos;
    done
}

/// The logits `[t, V]` of the multi-token-prediction layer's `t` rows in
/// `s.x`, into `out` (or `s.head_y`): its output norm, then the model's
/// output head (the norm's output is left in `s.xn`).
fn mtp_head(model: &Model, s: &mut Workspace, t: usize, out: Option<&mut [f32]>) {
    let c = &model.config;
    let d = c.hidden_size;
    let out_norm = model.vec(model.mtp.expect("the layer's glue").out_norm);
    norm_rows(c.norm, &s.x[..t * d], out_norm, None, &mut s.xn[..t * d]);
    let out = match out {
        Some(o) => o,
        None => &mut s.head_y[..t * c.vocab_size],
    };
    matmul(&model.mat(model.head().1), &s.xq.prepare(&s.xn[..t * d], d), out); // [t, V]
    out.chunks_exact_mut(c.vocab_size).for_each(|y| finish_logits(model, y));
}

/// Drafts up to `k` tokens with the multi-token-prediction layer into
/// `out`: `last` is the token just chosen for the sequence's position (not
/// fed yet). The first step reads the hidden state of the position before
/// and `last`; each later one the step before's output and draft. Greedy:
/// each draft is its row's most likely token. Nothing is drafted for a
/// sequence whose layer rows are not up to its position. With `logits`,
/// each step's logits row goes there too ([k, V]).
#[allow(clippy::too_many_arguments)]
pub fn mtp_draft(
    model: &Model,
    s: &mut Workspace,
    seq: &mut Sequence,
    last: u32,
    k: usize,
    out: &mut Vec<u32>,
    mut logits: Option<&mut [f32]>,
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    out.clear();
    let (d, vocab) = (model.config.hidden_size, model.config.vocab_size);
    let pos = seq.pos;
    let Some(rows) = seq.mtp.as_ref().filter(|r| !r.lost && pos > 0 && r.held + 1 == pos) else { return Ok(()) };
    let Some(h) = rows.hidden_rows(pos - 1, 1, d) else { return Ok(()) };
    s.mtp_h[..d].copy_from_slice(h);
    check_ids(model, &[last])?;
    let chain_normed = model.config.mtp.is_some_and(|m| m.chain_normed);
    let mut tok = last;
    for j in 0..k.min(seq.max_seq.saturating_sub(pos)) {
        let step = |s: &mut Workspace, seq: &mut Sequence| -> Result<()> {
            mtp_layer(model, s, seq, pos - 1 + j, std::slice::from_ref(&tok), pos + k)?; // x: [1, D]
            mtp_head(model, s, 1, None);
            Ok(())
        };
        match pool {
            Some(p) => p.install(|| step(s, seq))?,
            None => step(s, seq)?,
        }
        if j == 0 {
            seq.mtp.as_mut().expect("checked above").held = pos;
        }
        let row = &s.head_y[..vocab];
        if let Some(l) = logits.as_deref_mut() {
            l[j * vocab..(j + 1) * vocab].copy_from_slice(row);
        }
        tok = crate::math::argmax(row);
        out.push(tok);
        let chained = if chain_normed { &s.xn[..d] } else { &s.x[..d] };
        s.mtp_h[..d].copy_from_slice(chained);
    }
    Ok(())
}
