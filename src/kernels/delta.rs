//! The recurrent step of the gated delta rule (Gated DeltaNet; KDA with a
//! decay per key channel), written once over a register type ([`Lanes`])
//! for the SIMD tables; the oracle is [`super::scalar::delta_step`].
//!
//! One head, one token, state `S` `[dk, dv]` row-major (row `i` is key
//! channel `i`), decay `d` (one value, or one per key channel):
//!
//! 1. `S' = S · d_i` (row `i` by its decay),
//! 2. `kv[j] = Σ_i S'[i, j] · k[i]`,
//! 3. `delta[j] = (v[j] − kv[j]) · beta`,
//! 4. `S[i, j] = S'[i, j] + k[i] · delta[j]`,
//! 5. `out[j] = Σ_i S[i, j] · q[i]` (the updated state).
//!
//! In every table `kv` sums over `i` from the first key channel up and
//! `out` from the last one down, one lane per column `j`; the SIMD tables
//! use FMA for steps 2, 4 and 5, the scalar one multiplies and adds.
//!
//! The state is the step's only large operand (64 KiB per head at
//! 128 × 128; 2 MiB per layer on Qwen3.6), so the kernels read it once and
//! write it once. They take the columns in strips of `U` registers (the
//! strip's sums and deltas live in registers): pass one reads the strip's
//! rows (steps 1-2, `S'` kept in registers only), pass two reads them again,
//! recomputes `S'` (the same single rounding as in pass one) and writes the
//! new state (steps 4-5). Pass two walks the rows backwards, so it starts
//! on the rows pass one has just left in L1 and only the strip's first rows
//! come back from L2. Measured on one core of an AVX-512 Xeon (one head after
//! another, 32 heads of 128 × 128, `examples/kernel_speed.rs 1 delta`):
//! backwards 2.73 µs per head-step against 2.93 forwards (sixteen lanes);
//! storing `S'` in pass one instead of recomputing it was level there and
//! 10% slower on eight lanes (3.64 against 3.31 µs); whole 512-byte rows
//! per strip (eight registers of sixteen lanes) beat strips of four
//! registers, whose rows, 512 bytes apart, crowd into half of L1's sets
//! (16 lines a set against 12 ways) and miss there anyway (2.87 µs
//! backwards); eight lanes keep eight registers (sixteen spill: 3.66 µs);
//! a software prefetch of rows ahead in pass one changed nothing.
//!
//! The whole body of each `unsafe fn` here is the unsafe operation (raw
//! loads and stores through the register type); its caller is a
//! `#[target_feature]` entry point of an ISA folder, and [`step`] checks
//! the lengths before any pointer is formed.
#![allow(unsafe_op_in_unsafe_fn)]

/// `(dk, dv)` of a step's operands, after checking that they agree:
/// `k` and `q` are `dk` long, `v` and `out` `dv`, `s` `dk · dv`, `decay`
/// one value or `dk`.
pub(super) fn check(s: &[f32], decay: &[f32], k: &[f32], v: &[f32], q: &[f32], out: &[f32]) -> (usize, usize) {
    let (dk, dv) = (k.len(), v.len());
    assert!(
        q.len() == dk && out.len() == dv,
        "delta step: q is {} for k {}, out {} for v {}",
        q.len(),
        dk,
        out.len(),
        dv
    );
    assert_eq!(s.len(), dk * dv, "delta step: state is not [dk, dv] = [{dk}, {dv}]");
    assert!(decay.len() == 1 || decay.len() == dk, "delta step: {} decay values for {dk} key channels", decay.len());
    (dk, dv)
}

/// A register of f32 lanes and the operations the step uses. Every method
/// needs the CPU features of its register type (checked once by the
/// caller's table), and pointers valid for the lanes it touches.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(super) trait Lanes: Copy {
    /// Lanes per register.
    const LANES: usize;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    /// The first `n` lanes (`0 < n < LANES`) from `p`, the others zero;
    /// nothing past `p + n` is read.
    unsafe fn load_part(p: *const f32, n: usize) -> Self;
    /// The first `n` lanes to `p`; nothing past `p + n` is written.
    unsafe fn store_part(self, p: *mut f32, n: usize);
    unsafe fn mul(a: Self, b: Self) -> Self;
    unsafe fn sub(a: Self, b: Self) -> Self;
    /// `a · b + c`, one rounding.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
}

/// The step over every column, in strips of `U` registers, then single
/// registers, then one partial register.
///
/// # Safety
/// The CPU must have the features of `V`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
pub(super) unsafe fn step<V: Lanes, const U: usize>(
    s: &mut [f32],
    decay: &[f32],
    k: &[f32],
    v: &[f32],
    beta: f32,
    q: &[f32],
    out: &mut [f32],
) {
    let (dk, dv) = check(s, decay, k, v, q, out);
    let op = Operands {
        s: s.as_mut_ptr(),
        decay: decay.as_ptr(),
        ds: usize::from(decay.len() > 1),
        k: k.as_ptr(),
        v: v.as_ptr(),
        beta,
        q: q.as_ptr(),
        out: out.as_mut_ptr(),
        dk,
        dv,
    };
    let w = V::LANES;
    let mut j = 0;
    // SAFETY (all three loops): `check` gave `s` `dk · dv` values and `v`,
    // `out` `dv`; each strip touches columns `j..j + width` with
    // `j + width <= dv` (the last one `dv - j` lanes), of rows below `dk`.
    while j + U * w <= dv {
        strip::<V, U>(op, j, w);
        j += U * w;
    }
    while j + w <= dv {
        strip::<V, 1>(op, j, w);
        j += w;
    }
    if j < dv {
        strip::<V, 1>(op, j, dv - j);
    }
}

/// A step's operands as raw pointers, with `ds` the decay's stride (0: one
/// decay for every key channel).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[derive(Clone, Copy)]
struct Operands {
    s: *mut f32,
    decay: *const f32,
    ds: usize,
    k: *const f32,
    v: *const f32,
    beta: f32,
    q: *const f32,
    out: *mut f32,
    dk: usize,
    dv: usize,
}

/// Columns `j..j + (U − 1)·LANES + last` (`last` lanes in the last
/// register, `0 < last <= LANES`): both passes over the strip's rows.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn strip<V: Lanes, const U: usize>(op: Operands, j: usize, last: usize) {
    let w = V::LANES;
    // Lanes of register `u` of the strip: whole but for the last.
    let n = |u: usize| if u == U - 1 { last } else { w };
    // Pass one: kv = Σ_i (S[i] · d_i) · k_i.
    let mut kv = [V::zero(); U];
    for i in 0..op.dk {
        let d = V::splat(*op.decay.add(i * op.ds));
        let ki = V::splat(*op.k.add(i));
        let row = op.s.add(i * op.dv + j);
        for (u, kv) in kv.iter_mut().enumerate() {
            let sd = V::mul(lanes_load::<V>(row.add(u * w), n(u)), d);
            *kv = V::fma(sd, ki, *kv);
        }
    }
    let beta = V::splat(op.beta);
    let mut delta = [V::zero(); U];
    for (u, (e, kv)) in delta.iter_mut().zip(&kv).enumerate() {
        *e = V::mul(V::sub(lanes_load::<V>(op.v.add(j + u * w), n(u)), *kv), beta);
    }
    // Pass two, last row first (see the module docs): S[i] = S[i] · d_i +
    // k_i · delta, out = Σ_i S[i] · q_i.
    let mut o = [V::zero(); U];
    for i in (0..op.dk).rev() {
        let d = V::splat(*op.decay.add(i * op.ds));
        let ki = V::splat(*op.k.add(i));
        let qi = V::splat(*op.q.add(i));
        let row = op.s.add(i * op.dv + j);
        for (u, o) in o.iter_mut().enumerate() {
            let p = row.add(u * w);
            let sn = V::fma(ki, delta[u], V::mul(lanes_load::<V>(p, n(u)), d));
            lanes_store(sn, p, n(u));
            *o = V::fma(sn, qi, *o);
        }
    }
    for (u, o) in o.iter().enumerate() {
        lanes_store(*o, op.out.add(j + u * w), n(u));
    }
}

/// `n` lanes (`0 < n <= LANES`) from `p`, the rest zero.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn lanes_load<V: Lanes>(p: *const f32, n: usize) -> V {
    if n < V::LANES { V::load_part(p, n) } else { V::load(p) }
}

/// The first `n` lanes (`0 < n <= LANES`) of `x` to `p`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn lanes_store<V: Lanes>(x: V, p: *mut f32, n: usize) {
    if n < V::LANES { x.store_part(p, n) } else { x.store(p) }
}

/// `(N, P)` of a Mamba2 step's operands, after checking that they agree:
/// `b` and `c` are `N` long, `x` and `out` `P`, `s` `N · P`.
pub(super) fn ssm_check(s: &[f32], b: &[f32], x: &[f32], c: &[f32], out: &[f32]) -> (usize, usize) {
    let (n, p) = (b.len(), x.len());
    assert!(c.len() == n && out.len() == p, "ssm step: c is {} for b {}, out {} for x {}", c.len(), n, out.len(), p);
    assert_eq!(s.len(), n * p, "ssm step: state is not [N, P] = [{n}, {p}]");
    (n, p)
}

/// One token of Mamba2's scan for one head ([`super::SsmFn`]) over every
/// column, in strips of `U` registers, then single registers, then one
/// partial register: per state row `i`, `S[i] = fma(dt·b_i, x, S[i]·decay)`
/// and `o = fma(S[i], c_i, o)`, rows in order; `out = fma(x, d, o)`.
///
/// # Safety
/// The CPU must have the features of `V`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn ssm<V: Lanes, const U: usize>(
    s: &mut [f32],
    decay: f32,
    dt: f32,
    b: &[f32],
    x: &[f32],
    c: &[f32],
    d: f32,
    out: &mut [f32],
) {
    let (n, p) = ssm_check(s, b, x, c, out);
    let op = SsmOperands {
        s: s.as_mut_ptr(),
        decay,
        dt,
        b: b.as_ptr(),
        x: x.as_ptr(),
        c: c.as_ptr(),
        d,
        out: out.as_mut_ptr(),
        n,
        p,
    };
    let w = V::LANES;
    let mut j = 0;
    // SAFETY (all three loops): `ssm_check` gave `s` `n · p` values and `x`,
    // `out` `p`; each strip touches columns `j..j + width` with
    // `j + width <= p` (the last one `p - j` lanes), of rows below `n`.
    while j + U * w <= p {
        ssm_strip::<V, U>(op, j, w);
        j += U * w;
    }
    while j + w <= p {
        ssm_strip::<V, 1>(op, j, w);
        j += w;
    }
    if j < p {
        ssm_strip::<V, 1>(op, j, p - j);
    }
}

/// A Mamba2 step's operands as raw pointers.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[derive(Clone, Copy)]
struct SsmOperands {
    s: *mut f32,
    decay: f32,
    dt: f32,
    b: *const f32,
    x: *const f32,
    c: *const f32,
    d: f32,
    out: *mut f32,
    n: usize,
    p: usize,
}

/// Columns `j..j + (U − 1)·LANES + last` of a Mamba2 step: each state row
/// read and written once, the output's sums in registers.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn ssm_strip<V: Lanes, const U: usize>(op: SsmOperands, j: usize, last: usize) {
    let w = V::LANES;
    let n = |u: usize| if u == U - 1 { last } else { w };
    let xs: [V; U] = std::array::from_fn(|u| lanes_load::<V>(op.x.add(j + u * w), n(u)));
    let decay = V::splat(op.decay);
    let mut o = [V::zero(); U];
    for i in 0..op.n {
        let db = V::splat(op.dt * *op.b.add(i));
        let ci = V::splat(*op.c.add(i));
        let row = op.s.add(i * op.p + j);
        for (u, o) in o.iter_mut().enumerate() {
            let at = row.add(u * w);
            let sn = V::fma(db, xs[u], V::mul(lanes_load::<V>(at, n(u)), decay));
            lanes_store(sn, at, n(u));
            *o = V::fma(sn, ci, *o);
        }
    }
    let d = V::splat(op.d);
    for (u, o) in o.iter().enumerate() {
        lanes_store(V::fma(xs[u], d, *o), op.out.add(j + u * w), n(u));
    }
}
