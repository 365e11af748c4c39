//! Scalar reference kernels: always compiled, the oracle every SIMD kernel is
//! tested against. Written with eight independent accumulators so the summation
//! order is fixed and documented (lane i sums elements i, i+8, i+16, …; the
//! lanes are then added pairwise, then the tail), which SIMD twins reproduce.
//! Plain multiply-then-add, not `mul_add`: without hardware FMA in the
//! baseline target, `mul_add` becomes a slow library call.

/// Sums eight lane accumulators in a fixed tree order.
#[inline(always)]
fn reduce8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// Dot product of an f32 weight row with an f32 activation vector.
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for i in 0..8 {
            acc[i] += a[i] * b[i];
        }
    }
    let mut s = reduce8(acc);
    for (a, b) in wt.iter().zip(xt) {
        s += a * *b;
    }
    s
}

/// bf16 → f32 is exact: the bf16 bits are the top half of the f32.
#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Dot product of a bf16 weight row (raw bits) with an f32 vector.
pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for i in 0..8 {
            acc[i] += bf16_to_f32(a[i]) * b[i];
        }
    }
    let mut s = reduce8(acc);
    for (a, b) in wt.iter().zip(xt) {
        s += bf16_to_f32(*a) * *b;
    }
    s
}

/// Dot product of an f16 weight row (raw bits) with an f32 vector.
pub fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let h = |b: u16| half::f16::from_bits(b).to_f32();
    let mut acc = [0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for i in 0..8 {
            acc[i] += h(a[i]) * b[i];
        }
    }
    let mut s = reduce8(acc);
    for (a, b) in wt.iter().zip(xt) {
        s += h(*a) * *b;
    }
    s
}
