//! Linear attention by the gated delta rule: Gated DeltaNet (Qwen3-Next,
//! Qwen3.5) and Kimi Delta Attention (Kimi-Linear). Instead of a cache that
//! grows by a row per token, each value head keeps one float32 `[Dk, Dv]`
//! matrix S per sequence, and the layer's short causal convolution keeps its
//! last `Kc − 1` inputs.
//!
//! ```text
//! q, k, v, b = Wq·x, Wk·x, Wv·x, Wb·x                 [T, Hk·Dk] ×2, [T, Hv·Dv], [T, Hv]
//! GDN: a, z = Wa·x, Wz·x                              [T, Hv], [T, Hv·Dv]
//! KDA: a, z = Wf_b·Wf_a·x, Wg_b·Wg_a·x                [T, H·Dk], [T, H·Dv]  (low rank)
//! q, k, v = silu(conv(q)), silu(conv(k)), silu(conv(v))   depthwise, causal, over the last Kc inputs
//! per value head h (its key head h / (Hv/Hk)) and token t, in order:
//!     q, k = l2norm(q)·Dk^-½, l2norm(k)
//!     β = sigmoid(b)
//!     decay = exp(−exp(A_log[h])·softplus(a + dt_bias))  one per head (GDN) or per key channel (KDA)
//!     S = decay·S;  S += k ⊗ (v − Sᵀk)·β;  o = Sᵀq        (`kernels::delta_fn`)
//! o = rmsnorm(o per head)·w · silu(z) (GDN) or · sigmoid(z) (KDA)   [T, Hv·Dv]
//! proj = Wo·o                                          [T, D]
//! ```
//!
//! Mamba2 (Nemotron-H, Granite 4.0-H) is the third kind: the same
//! convolution (with a bias) over C | B | x in the q | k | v places, then per
//! head the gated rule without the delta correction and without l2 norms,
//! `S = exp(A·dt)·S + (dt·B) ⊗ x`, `o = Sᵀ·C + D·x` with
//! `dt = max(softplus(a + dt_bias), dt_min)`, B and C shared within a group
//! of heads (`kernels::ssm_fn`), and the norm `rmsnorm(o · silu(z))` per group.
//!
//! Prefill and decode both run the recurrence token by token. transformers
//! computes prefill in a chunked form instead (algebraically equal, rounded
//! differently: on the golden fixtures its full-forward logits and its own
//! token-by-token decode differ by up to 4e-5); the recurrence is a few
//! percent of a layer's arithmetic at Qwen3.6's width, and one form means a
//! prompt fed at once and token by token give the same bits, whatever the
//! chunking.

use rayon::prelude::*;

use super::Inputs;
use super::ffn::{sigmoid, silu};
use crate::canonical::config::{LinearKind, LinearSpec};
use crate::canonical::tensors::LayerTensor;
use crate::error::{Error, Result};
use crate::kernels::{Matrix, matmul, matmul_many};
use crate::model::weights::TensorRef;

/// One linear-attention layer's tensors in the file.
#[derive(Clone, Copy, Debug)]
pub struct DeltaRefs {
    /// [Hk·Dk, D] queries.
    pub wq: TensorRef,
    /// [Hk·Dk, D] keys.
    pub wk: TensorRef,
    /// [Hv·Dv, D] values.
    pub wv: TensorRef,
    /// [Hv, D] update strengths before their sigmoid (none in Mamba2).
    pub wb: Option<TensorRef>,
    /// The decay's input and the output gate's, by kind.
    pub gates: GateRefs,
    /// [Hk·Dk, Kc], [Hk·Dk, Kc], [Hv·Dv, Kc] convolution taps of q, k, v, oldest first.
    pub conv: [TensorRef; 3],
    /// `[Hk·Dk]`, `[Hk·Dk]`, `[Hv·Dv]` the convolution's biases (Mamba2).
    pub conv_bias: Option<[TensorRef; 3]>,
    /// `[Hv]` the skip weight `D` (Mamba2).
    pub skip: Option<TensorRef>,
    /// `[Hv]` A_log.
    pub a_log: TensorRef,
    /// `[Hv]` (GDN) or `[H·Dk]` (KDA) dt_bias.
    pub dt_bias: TensorRef,
    /// `[Dv]` output RMSNorm scale.
    pub norm: TensorRef,
}

/// Where a layer's decay input `a` and output gate `z` come from.
#[derive(Clone, Copy, Debug)]
pub enum GateRefs {
    /// Gated DeltaNet: `a` = [Hv, D], `z` = [Hv·Dv, D].
    Direct {
        /// [Hv, D]
        wa: TensorRef,
        /// [Hv·Dv, D]
        wz: TensorRef,
    },
    /// Kimi delta attention: two low-rank products.
    LowRank {
        /// [Rg, D], [H·Dk, Rg]: the forget gate's factors.
        f: [TensorRef; 2],
        /// [Rg, D], [H·Dv, Rg]: the output gate's factors.
        g: [TensorRef; 2],
    },
}

/// The gate matrices as views, as [`GateRefs`].
pub enum Gates<'a> {
    /// `a` = [Hv, D], `z` = [Hv·Dv, D].
    Direct(Matrix<'a>, Matrix<'a>),
    /// `f_a`, `f_b`, `g_a`, `g_b`.
    LowRank([Matrix<'a>; 4]),
}

/// One linear-attention layer's weights, as views.
pub struct Delta<'a> {
    /// [Hk·Dk, D]
    pub wq: Matrix<'a>,
    /// [Hk·Dk, D]
    pub wk: Matrix<'a>,
    /// [Hv·Dv, D]
    pub wv: Matrix<'a>,
    /// [Hv, D]
    pub wb: Option<Matrix<'a>>,
    /// The decay's and the output gate's projections.
    pub gates: Gates<'a>,
    /// Convolution taps of q, k, v: `[Hk·Dk, Kc]`, `[Hk·Dk, Kc]`, `[Hv·Dv, Kc]`.
    pub conv: [&'a [f32]; 3],
    /// `[Hk·Dk]`, `[Hk·Dk]`, `[Hv·Dv]`
    pub conv_bias: Option<[&'a [f32]; 3]>,
    /// `[Hv]`
    pub skip: Option<&'a [f32]>,
    /// `[Hv]`
    pub a_log: &'a [f32],
    /// `[Hv]` or `[H·Dk]`
    pub dt_bias: &'a [f32],
    /// `[Dv]`
    pub norm: &'a [f32],
    /// The layer's shape.
    pub spec: LinearSpec,
    /// Epsilon of the output RMSNorm.
    pub eps: f32,
}

impl DeltaRefs {
    /// The references of a layer of `spec`'s kind, `t` finding each of the
    /// layer's tensors in the file.
    pub fn load(spec: Option<&LinearSpec>, t: impl Fn(LayerTensor) -> Result<TensorRef>) -> Result<DeltaRefs> {
        use LayerTensor as L;
        let kind = spec
            .map(|s| s.kind)
            .ok_or_else(|| Error::Internal("a linear-attention layer in a model without a linear spec".into()))?;
        let mamba = matches!(kind, LinearKind::Mamba2 { .. });
        Ok(DeltaRefs {
            wq: t(L::LinQ)?,
            wk: t(L::LinK)?,
            wv: t(L::LinV)?,
            wb: if mamba { None } else { Some(t(L::LinB)?) },
            gates: match kind {
                LinearKind::GatedDeltaNet | LinearKind::Mamba2 { .. } => {
                    GateRefs::Direct { wa: t(L::LinA)?, wz: t(L::LinZ)? }
                }
                LinearKind::Kda { .. } => {
                    GateRefs::LowRank { f: [t(L::LinFa)?, t(L::LinFb)?], g: [t(L::LinGa)?, t(L::LinGb)?] }
                }
            },
            conv: [t(L::LinConvQ)?, t(L::LinConvK)?, t(L::LinConvV)?],
            conv_bias: if mamba { Some([t(L::LinConvBiasQ)?, t(L::LinConvBiasK)?, t(L::LinConvBiasV)?]) } else { None },
            skip: if mamba { Some(t(L::LinSkip)?) } else { None },
            a_log: t(L::LinALog)?,
            dt_bias: t(L::LinDtBias)?,
            norm: t(L::LinNorm)?,
        })
    }
}

impl<'a> Delta<'a> {
    /// The layer's weights as views: `mat` gives a matrix, `vec` an f32
    /// vector of the model's storage.
    pub fn new(
        refs: &DeltaRefs,
        spec: LinearSpec,
        eps: f32,
        mat: impl Fn(TensorRef) -> Matrix<'a>,
        vec: impl Fn(TensorRef) -> &'a [f32],
    ) -> Delta<'a> {
        Delta {
            wq: mat(refs.wq),
            wk: mat(refs.wk),
            wv: mat(refs.wv),
            wb: refs.wb.map(&mat),
            gates: match refs.gates {
                GateRefs::Direct { wa, wz } => Gates::Direct(mat(wa), mat(wz)),
                GateRefs::LowRank { f: [fa, fb], g: [ga, gb] } => Gates::LowRank([mat(fa), mat(fb), mat(ga), mat(gb)]),
            },
            conv: refs.conv.map(&vec),
            conv_bias: refs.conv_bias.map(|b| b.map(&vec)),
            skip: refs.skip.map(&vec),
            a_log: vec(refs.a_log),
            dt_bias: vec(refs.dt_bias),
            norm: vec(refs.norm),
            spec,
            eps,
        }
    }
}

/// What one linear-attention layer keeps for a sequence: fixed in size.
/// Zero at position 0; [`Delta::conv`] clears it when a sequence starts
/// again from position 0 (a reset or a truncation to nothing), so no other
/// code has to.
pub struct DeltaState {
    /// [Kc − 1, C] the last inputs of the convolution, oldest first.
    conv: Vec<f32>,
    /// [Hv, Dk, Dv] each value head's matrix.
    s: Vec<f32>,
    /// A copy of `conv` and `s` from [`DeltaState::save`] (empty until then).
    saved: Vec<f32>,
}

impl DeltaState {
    /// The zero state of a layer of `spec`'s shape.
    pub fn new(spec: &LinearSpec) -> DeltaState {
        DeltaState {
            conv: vec![0.0; (spec.conv_kernel - 1) * spec.conv_dim()],
            s: vec![0.0; spec.v_heads * spec.k_head_dim * spec.v_head_dim],
            saved: Vec::new(),
        }
    }

    fn clear(&mut self) {
        self.conv.fill(0.0);
        self.s.fill(0.0);
    }

    /// Keeps a copy of the state, for [`DeltaState::restore`] (the copy's
    /// buffer is allocated by the first save).
    pub fn save(&mut self) {
        self.saved.clear();
        self.saved.extend_from_slice(&self.conv);
        self.saved.extend_from_slice(&self.s);
    }

    /// Values in the state (`conv` and `s`).
    pub fn len(&self) -> usize {
        self.conv.len() + self.s.len()
    }

    /// Whether the state holds no values (a layer of no width).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the state to `out` (`conv`, then `s`).
    pub fn copy_to(&self, out: &mut Vec<f32>) {
        out.extend_from_slice(&self.conv);
        out.extend_from_slice(&self.s);
    }

    /// Takes the state from the front of `src` (as [`DeltaState::copy_to`]
    /// wrote it) and returns the rest.
    pub fn copy_from<'a>(&mut self, src: &'a [f32]) -> &'a [f32] {
        let (conv, rest) = src.split_at(self.conv.len());
        let (s, rest) = rest.split_at(self.s.len());
        self.conv.copy_from_slice(conv);
        self.s.copy_from_slice(s);
        rest
    }

    /// Goes back to the state of the last [`DeltaState::save`] (which stays
    /// saved).
    pub fn restore(&mut self) {
        let (conv, s) = self.saved.split_at(self.conv.len());
        self.conv.copy_from_slice(conv);
        self.s.copy_from_slice(s);
    }
}

/// Buffers of the linear-attention layers for up to C tokens (empty when
/// the model has none).
#[derive(Default)]
pub struct DeltaScratch {
    conv_dim: usize,
    value_dim: usize,
    v_heads: usize,
    a_width: usize,
    /// [C, C_conv] projected q | k | v, before the convolution.
    raw: Vec<f32>,
    /// [C, C_conv] after the convolution and SiLU.
    mixed: Vec<f32>,
    /// [C, Hv·Dv] output gates.
    z: Vec<f32>,
    /// [C, Hv] update strengths.
    b: Vec<f32>,
    /// [C, Hv] (GDN) or [C, H·Dk] (KDA) decay inputs.
    a: Vec<f32>,
    /// [C, Rg] a low-rank gate's first product (KDA; empty for GDN).
    low: Vec<f32>,
    /// [Hv, C, Dv] the rule's outputs, head by head (each head's thread
    /// writes its own rows).
    by_head: Vec<f32>,
    /// [C, Hv·Dv] the gated, normed output: the output projection's input.
    out: Vec<f32>,
}

impl DeltaScratch {
    /// Buffers for up to `chunk` tokens of layers of `spec`'s shape.
    pub fn new(spec: Option<&LinearSpec>, chunk: usize) -> DeltaScratch {
        let Some(s) = spec else { return DeltaScratch::default() };
        let (c, vd, hv) = (s.conv_dim(), s.value_dim(), s.v_heads);
        let (a_width, rank) = match s.kind {
            LinearKind::GatedDeltaNet | LinearKind::Mamba2 { .. } => (hv, 0),
            LinearKind::Kda { gate_rank } => (s.key_dim(), gate_rank),
        };
        DeltaScratch {
            conv_dim: c,
            value_dim: vd,
            v_heads: hv,
            a_width,
            raw: vec![0.0; chunk * c],
            mixed: vec![0.0; chunk * c],
            z: vec![0.0; chunk * vd],
            b: vec![0.0; chunk * hv],
            a: vec![0.0; chunk * a_width],
            low: vec![0.0; chunk * rank],
            by_head: vec![0.0; chunk * vd],
            out: vec![0.0; chunk * vd],
        }
    }
}

/// The projections of a chunk after the convolution: what the rule and the
/// output gate read, shared by every sequence of the chunk.
pub struct DeltaRows<'a> {
    /// [n, C] q | k | v per row, after the convolution and SiLU.
    mixed: &'a [f32],
    /// [n, Hv·Dv]
    z: &'a [f32],
    /// [n, Hv]
    b: &'a [f32],
    /// [n, Hv] or [n, H·Dk]
    a: &'a [f32],
}

impl DeltaScratch {
    /// The chunk's `n` rows as the rule reads them, and the rule's two
    /// output buffers (`by_head` and `out` of [`Delta::rule`]), `[n, Hv·Dv]` each.
    pub fn split(&mut self, n: usize) -> (DeltaRows<'_>, &mut [f32], &mut [f32]) {
        let (c, vd, hv, aw) = (self.conv_dim, self.value_dim, self.v_heads, self.a_width);
        let rows =
            DeltaRows { mixed: &self.mixed[..n * c], z: &self.z[..n * vd], b: &self.b[..n * hv], a: &self.a[..n * aw] };
        (rows, &mut self.by_head[..n * vd], &mut self.out[..n * vd])
    }

    /// `[n, Hv·Dv]` the output of the chunk's `n` rows (after [`Delta::rule`]).
    pub fn out(&self, n: usize) -> &[f32] {
        &self.out[..n * self.value_dim]
    }
}

impl Delta<'_> {
    /// Projects the `n` rows of `x` ([n, D]) into q | k | v, b, a and z.
    pub fn project(&self, x: &[f32], inputs: &mut Inputs, s: &mut DeltaScratch) {
        let d = self.wq.cols;
        let n = x.len() / d;
        let (kd, vd, hv) = (self.spec.key_dim(), self.spec.value_dim(), self.spec.v_heads);
        // Written part by part ([n, Hk·Dk] queries, then keys, then values);
        // the convolution reads them back by channel.
        let raw = &mut s.raw[..n * self.spec.conv_dim()];
        let (q, rest) = raw.split_at_mut(n * kd);
        let (k, v) = rest.split_at_mut(n * kd);
        let (b, a, z) = (&mut s.b[..n * hv], &mut s.a[..n * s.a_width], &mut s.z[..n * vd]);
        let inp = inputs.prepare(x, d); // quantised once for every projection of x
        match self.wb {
            Some(wb) => matmul_many(&mut [(self.wq, q), (self.wk, k), (self.wv, v), (wb, b)], &inp),
            None => matmul_many(&mut [(self.wq, q), (self.wk, k), (self.wv, v)], &inp),
        }
        match self.gates {
            Gates::Direct(wa, wz) => matmul_many(&mut [(wa, a), (wz, z)], &inp), // [n, Hv], [n, Hv·Dv]
            Gates::LowRank([fa, fb, ga, gb]) => {
                let r = fa.rows;
                let low = &mut s.low[..n * r];
                matmul(&fa, &inp, low); // [n, Rg]
                matmul(&fb, &inputs.prepare(low, r), a); // [n, H·Dk]
                matmul(&ga, &inputs.prepare(x, d), low);
                matmul(&gb, &inputs.prepare(low, r), z); // [n, H·Dv]
            }
        }
    }

    /// The causal convolution of one sequence's rows `r0..r0 + m` of the
    /// chunk's `n`, continuing `state` at position `pos0` (a sequence that
    /// starts again at 0 starts from the zero state):
    /// `mixed[t][c] = silu(Σ_j w[c][j] · in[t − (Kc−1) + j][c])`, inputs
    /// before the first row coming from the state, which then keeps the
    /// last Kc − 1 inputs.
    pub fn conv(&self, s: &mut DeltaScratch, n: usize, r0: usize, m: usize, pos0: usize, state: &mut DeltaState) {
        if pos0 == 0 {
            state.clear();
        }
        let (c, kc, kd, vd) = (self.spec.conv_dim(), self.spec.conv_kernel, self.spec.key_dim(), self.spec.value_dim());
        let keep = kc - 1;
        // (first channel, width, start in `raw`, taps) of queries, keys, values.
        let parts = [(0, kd, 0, self.conv[0]), (kd, kd, n * kd, self.conv[1]), (2 * kd, vd, 2 * n * kd, self.conv[2])];
        let bias = self.conv_bias;
        let raw = &s.raw;
        // Input `i` of the call (rows from the first, which is input `keep`;
        // inputs below `keep` are the state's rows), channel `ch` of a part.
        let input = |st: &[f32], i: usize, (c0, w, base): (usize, usize, usize), ch: usize| {
            if i < keep { st[i * c + c0 + ch] } else { raw[base + (r0 + i - keep) * w + ch] }
        };
        // Outputs depend on inputs only, never on earlier outputs: the rows
        // run in parallel, each channel summing its taps in order (tap by tap
        // over the whole part, so each input row is picked once).
        let st = &state.conv;
        s.mixed[r0 * c..(r0 + m) * c].par_chunks_mut(c).enumerate().for_each(|(t, row)| {
            for (p, (c0, w, base, conv)) in parts.into_iter().enumerate() {
                let out = &mut row[c0..c0 + w];
                out.fill(0.0);
                for j in 0..kc {
                    let i = t + j;
                    let inp = if i < keep {
                        &st[i * c + c0..i * c + c0 + w]
                    } else {
                        &raw[base + (r0 + i - keep) * w..][..w]
                    };
                    for (ch, (o, &x)) in out.iter_mut().zip(inp).enumerate() {
                        *o += conv[ch * kc + j] * x;
                    }
                }
                match bias {
                    Some(b) => out.iter_mut().zip(b[p]).for_each(|(o, &b)| *o = silu(*o + b)),
                    None => out.iter_mut().for_each(|o| *o = silu(*o)),
                }
            }
        });
        // The state keeps the last `keep` inputs of (state ++ rows): row j is
        // input m + j, from the rows or an older state row (rows go up, so a
        // row is read before it is overwritten).
        let st = &mut state.conv;
        for j in 0..keep {
            for (c0, w, base, _) in parts {
                for ch in 0..w {
                    st[j * c + c0 + ch] = input(st, m + j, (c0, w, base), ch);
                }
            }
        }
    }

    /// The gated delta rule over one sequence's rows `r0..r0 + m` (after
    /// [`Delta::conv`]) and the gated norm of its output into `out`
    /// (`[m, Hv·Dv]`); `by_head` is scratch of the same size. The value
    /// heads run in parallel, each on its own state, so the bits do not
    /// depend on the thread count.
    pub fn rule(&self, x: &DeltaRows, r0: usize, state: &mut DeltaState, by_head: &mut [f32], out: &mut [f32]) {
        if let LinearKind::Mamba2 { dt_min } = self.spec.kind {
            return self.ssm(x, r0, dt_min, state, by_head, out);
        }
        let sp = self.spec;
        let (dk, dv, c, kd, vd) = (sp.k_head_dim, sp.v_head_dim, sp.conv_dim(), sp.key_dim(), sp.value_dim());
        let (hv, per_key) = (sp.v_heads, sp.v_heads / sp.k_heads);
        let m = out.len() / vd;
        let step = crate::kernels::delta_fn();
        let scale = 1.0 / (dk as f32).sqrt();
        let heads = state.s.par_chunks_mut(dk * dv).zip(by_head.par_chunks_mut(m * dv));
        let kda = matches!(sp.kind, LinearKind::Kda { .. });
        // Qwen's l2 norm multiplies by 1/√, Kimi's divides by √ (as each reference does).
        let norm = if kda { l2norm_div } else { l2norm };
        let per = if kda { dk } else { 1 }; // decays per head and token
        heads.enumerate().for_each(|(h, (sh, oh))| {
            let kh = h / per_key;
            let (mut q, mut k, mut decay) = ([0f32; MAX_DK], [0f32; MAX_DK], [0f32; MAX_DK]);
            let rate = -crate::math::expf(self.a_log[h]);
            let bias = &self.dt_bias[h * per..(h + 1) * per];
            for t in 0..m {
                let r = r0 + t;
                let row = &x.mixed[r * c..(r + 1) * c];
                norm(&row[kh * dk..(kh + 1) * dk], &mut q[..dk]);
                norm(&row[kd + kh * dk..kd + (kh + 1) * dk], &mut k[..dk]);
                q[..dk].iter_mut().for_each(|v| *v *= scale);
                let v = &row[2 * kd + h * dv..2 * kd + (h + 1) * dv];
                let beta = sigmoid(x.b[r * hv + h]);
                let a = &x.a[(r * hv + h) * per..(r * hv + h + 1) * per];
                for ((g, &a), &bias) in decay.iter_mut().zip(a).zip(bias) {
                    *g = crate::math::expf(rate * softplus(a + bias));
                }
                step(sh, &decay[..per], &k[..dk], v, beta, &q[..dk], &mut oh[t * dv..(t + 1) * dv]);
            }
        });
        // out[t, h] = rmsnorm(o[h, t]) · w · silu(z[t, h]), the rows in parallel.
        let by_head = &*by_head;
        out.par_chunks_mut(vd).enumerate().for_each(|(t, out)| {
            for h in 0..hv {
                let o = &by_head[(h * m + t) * dv..(h * m + t + 1) * dv];
                let z = &x.z[(r0 + t) * vd + h * dv..(r0 + t) * vd + (h + 1) * dv];
                let y = &mut out[h * dv..(h + 1) * dv];
                let ms = o.iter().map(|&v| v * v).sum::<f32>() / dv as f32;
                let inv = 1.0 / (ms + self.eps).sqrt();
                for (((y, &o), &w), &z) in y.iter_mut().zip(o).zip(self.norm).zip(z) {
                    *y = w * (o * inv) * if kda { sigmoid(z) } else { silu(z) };
                }
            }
        });
    }

    /// Mamba2's selective scan over one sequence's rows `r0..r0 + m` (after
    /// [`Delta::conv`]) and its gated group norm into `out` (`[m, Hv·Dv]`);
    /// `by_head` is scratch of the same size. Each head's state `S` is
    /// `[N, P]` (N = Dk state channels, P = Dv head channels), the transpose of
    /// transformers' `[P, N]`; the heads run in parallel on their own states.
    fn ssm(&self, x: &DeltaRows, r0: usize, dt_min: f32, state: &mut DeltaState, by_head: &mut [f32], out: &mut [f32]) {
        let sp = self.spec;
        let (n_st, p, c, kd, vd) = (sp.k_head_dim, sp.v_head_dim, sp.conv_dim(), sp.key_dim(), sp.value_dim());
        let (hv, per_group) = (sp.v_heads, sp.v_heads / sp.k_heads);
        let m = out.len() / vd;
        let skip = self.skip.unwrap_or(&[]);
        let step = crate::kernels::ssm_fn();
        let heads = state.s.par_chunks_mut(n_st * p).zip(by_head.par_chunks_mut(m * p));
        heads.enumerate().for_each(|(h, (sh, oh))| {
            let g = h / per_group;
            let rate = -crate::math::expf(self.a_log[h]); // A
            let d_skip = skip.get(h).copied().unwrap_or(0.0);
            for t in 0..m {
                let r = r0 + t;
                let row = &x.mixed[r * c..(r + 1) * c];
                let cq = &row[g * n_st..(g + 1) * n_st]; // [N] C
                let bk = &row[kd + g * n_st..kd + (g + 1) * n_st]; // [N] B
                let xv = &row[2 * kd + h * p..2 * kd + (h + 1) * p]; // [P] x
                let dt = softplus(x.a[r * hv + h] + self.dt_bias[h]).max(dt_min);
                let decay = crate::math::expf(dt * rate);
                step(sh, decay, dt, bk, xv, cq, d_skip, &mut oh[t * p..(t + 1) * p]);
            }
        });
        // out[t] = rmsnorm_groups(o[t] · silu(z[t])) · w, the rows in parallel.
        let by_head = &*by_head;
        let group = vd / sp.k_heads;
        out.par_chunks_mut(vd).enumerate().for_each(|(t, y)| {
            let z = &x.z[(r0 + t) * vd..(r0 + t + 1) * vd];
            for (h, yh) in y.chunks_exact_mut(p).enumerate() {
                let o = &by_head[(h * m + t) * p..(h * m + t + 1) * p];
                let zh = &z[h * p..(h + 1) * p];
                yh.iter_mut().zip(o).zip(zh).for_each(|((y, &o), &z)| *y = o * silu(z));
            }
            for (yg, wg) in y.chunks_exact_mut(group).zip(self.norm.chunks_exact(group)) {
                let ms = yg.iter().map(|&v| v * v).sum::<f32>() / group as f32;
                let inv = 1.0 / (ms + self.eps).sqrt();
                yg.iter_mut().zip(wg).for_each(|(y, &w)| *y = w * (*y * inv));
            }
        });
    }
}

/// Widest query/key head the rule takes (checked by the config's validation).
const MAX_DK: usize = crate::canonical::config::MAX_LINEAR_KEY_DIM;

/// `out = x / sqrt(Σx² + 1e-6)`: the l2 norm transformers applies to
/// queries and keys inside the rule.
fn l2norm(x: &[f32], out: &mut [f32]) {
    let ss = x.iter().map(|&v| v * v).sum::<f32>();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = v * inv);
}

/// `out = x / sqrt(Σx² + 1e-6)`: Kimi's form of [`l2norm`].
fn l2norm_div(x: &[f32], out: &mut [f32]) {
    let n = (x.iter().map(|&v| v * v).sum::<f32>() + 1e-6).sqrt();
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = v / n);
}

/// `ln(1 + e^x)`, and x itself above 20 (torch's threshold).
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { crate::math::ln_1pf(crate::math::expf(x)) }
}
