//! Attention kernels over the KV cache (f32 and f16 rows), written once
//! over a register type: [`Ymm`] (eight lanes, AVX2; up to four queries per
//! pass in its 16 registers) and [`Zmm`] (sixteen lanes, AVX-512F; up to
//! eight in its 32). Each `unsafe fn` needs the features of its register
//! type (checked once by the caller); lengths are asserted by the entry
//! points.
//!
//! Per (query, key) a score is one FMA chain of `V::LANES` lanes, the lanes'
//! sum, then the scalar tail; per output element a value sum is `fma(p, v,
//! o)` key after key (the scalar `o += p · v` past the last whole vector),
//! whether one key or a run of keys is added and however many queries share
//! the call. So a query's bits do not depend on its batch, and prefill and
//! decode agree within a table (the two register types give different bits:
//! their chains differ in width).
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

/// A register of f32 lanes and the operations the kernels use.
pub trait Lanes: Copy {
    /// Lanes per register.
    const LANES: usize;
    /// Most queries one pass keeps in registers.
    const QUERIES: usize;
    /// Registers a run of value sums may keep its sums in.
    const SUMS: usize;
    unsafe fn zero() -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn load_f16(p: *const u16) -> Self;
    /// bf16 values widened (exactly: a bf16 is the top half of an f32).
    unsafe fn load_bf16(p: *const u16) -> Self;
    unsafe fn store(self, p: *mut f32);
    unsafe fn splat(x: f32) -> Self;
    /// `a · b + c`, one rounding.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    /// The lanes' sum, in a fixed order.
    unsafe fn sum(self) -> f32;
}

/// Eight lanes (AVX2, FMA, F16C).
#[derive(Clone, Copy)]
pub struct Ymm(__m256);

impl Lanes for Ymm {
    const LANES: usize = 8;
    const QUERIES: usize = 4;
    const SUMS: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Ymm(_mm256_setzero_ps())
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Ymm(_mm256_loadu_ps(p))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self {
        Ymm(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)))
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self {
        let h = _mm_loadu_si128(p as *const __m128i);
        Ymm(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm256_storeu_ps(p, self.0)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Ymm(_mm256_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Ymm(_mm256_fmadd_ps(a.0, b.0, c.0))
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        super::prim::hsum(self.0)
    }
}

/// Sixteen lanes (AVX-512F, with AVX2, FMA, F16C).
#[derive(Clone, Copy)]
pub struct Zmm(__m512);

impl Lanes for Zmm {
    const LANES: usize = 16;
    const QUERIES: usize = 8;
    const SUMS: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Zmm(_mm512_setzero_ps())
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Zmm(_mm512_loadu_ps(p))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self {
        Zmm(_mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)))
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self {
        let h = _mm256_loadu_si256(p as *const __m256i);
        Zmm(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm512_storeu_ps(p, self.0)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Zmm(_mm512_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Zmm(_mm512_fmadd_ps(a.0, b.0, c.0))
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        _mm512_reduce_add_ps(self.0)
    }
}

/// A KV-cache element type: a register of values as f32 lanes, one as an f32.
pub trait Elem: Copy {
    unsafe fn load<V: Lanes>(p: *const Self) -> V;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load<V: Lanes>(p: *const f32) -> V {
        V::load(p)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

/// f16 as its raw bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct F16(u16);

impl Elem for F16 {
    #[inline(always)]
    unsafe fn load<V: Lanes>(p: *const F16) -> V {
        V::load_f16(p as *const u16)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }
}

/// bf16 as its raw bits (weight rows; the KV cache holds f32 or f16).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Bf16(u16);

impl Elem for Bf16 {
    #[inline(always)]
    unsafe fn load<V: Lanes>(p: *const Bf16) -> V {
        V::load_bf16(p as *const u16)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// `NQ` queries × `NK` keys of `E` (`len` values; key `j` at `k + j·ks`
/// elements) into `out[q·os + j]`.
#[inline(always)]
unsafe fn dots_tile<V: Lanes, E: Elem, const NQ: usize, const NK: usize>(
    k: *const E,
    ks: usize,
    x: [*const f32; NQ],
    len: usize,
    out: *mut f32,
    os: usize,
) {
    let mut c = [[V::zero(); NK]; NQ];
    let mut i = 0;
    while i + V::LANES <= len {
        let kv: [V; NK] = std::array::from_fn(|j| E::load::<V>(k.add(j * ks + i)));
        for (q, c) in c.iter_mut().enumerate() {
            let xv = V::load(x[q].add(i));
            for (c, kv) in c.iter_mut().zip(&kv) {
                *c = V::fma(*kv, xv, *c);
            }
        }
        i += V::LANES;
    }
    for (q, c) in c.iter().enumerate() {
        for (j, c) in c.iter().enumerate() {
            let mut s = c.sum();
            for e in i..len {
                s += k.add(j * ks + e).read_unaligned().to_f32() * *x[q].add(e);
            }
            *out.add(q * os + j) = s;
        }
    }
}

/// Scores of `x.len()` queries against `nk` keys, `V::QUERIES` queries per
/// pass, in tiles of 1-4 queries × 4 keys (4 × 3 with eight lanes, whose
/// 16 registers hold no more) or 5-8 queries × 3 keys, then single keys.
/// (A loop over passes, not recursion: a recursive function is not inlined
/// into its `#[target_feature]` caller, and outside it no intrinsic is.)
#[inline(always)]
pub unsafe fn dots<V: Lanes, E: Elem>(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
    for (c, xc) in x.chunks(V::QUERIES).enumerate() {
        dots_pass::<V, E>(k, ks, nk, xc, &mut out[c * V::QUERIES * os..], os);
    }
}

/// One pass of [`dots`]: at most `V::QUERIES` queries.
#[inline(always)]
unsafe fn dots_pass<V: Lanes, E: Elem>(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
    let nq = x.len();
    let len = x.first().map_or(0, |q| q.len());
    let es = std::mem::size_of::<E>();
    assert!((1..=V::QUERIES).contains(&nq) && x.iter().all(|q| q.len() == len), "dots: queries");
    assert!(nk == 0 || k.len() >= ((nk - 1) * ks + len) * es, "dots: key rows");
    assert!(nk == 0 || (nk <= os && out.len() >= (nq - 1) * os + nk), "dots: out");
    let kp = k.as_ptr() as *const E;
    let o = out.as_mut_ptr();
    let p = |i: usize| x[i].as_ptr();
    macro_rules! run {
        ($nq:literal, $tile:expr, [$($q:literal),*]) => {{
            const TILE: usize = $tile;
            let mut j = 0;
            while j + TILE <= nk {
                dots_tile::<V, E, $nq, TILE>(kp.add(j * ks), ks, [$(p($q)),*], len, o.add(j), os);
                j += TILE;
            }
            while j < nk {
                dots_tile::<V, E, $nq, 1>(kp.add(j * ks), ks, [$(p($q)),*], len, o.add(j), os);
                j += 1;
            }
        }};
    }
    match nq {
        1 => run!(1, 4, [0]),
        2 => run!(2, 4, [0, 1]),
        3 => run!(3, 4, [0, 1, 2]),
        4 if V::QUERIES == 4 => run!(4, 3, [0, 1, 2, 3]),
        4 => run!(4, 4, [0, 1, 2, 3]),
        5 => run!(5, 3, [0, 1, 2, 3, 4]),
        6 => run!(6, 3, [0, 1, 2, 3, 4, 5]),
        7 => run!(7, 3, [0, 1, 2, 3, 4, 5, 6]),
        _ => run!(8, 3, [0, 1, 2, 3, 4, 5, 6, 7]),
    }
}

/// A run of `nk` value rows (`v_j` at `v + j·vs`) to add into `N` output
/// rows of `len` (row `q` at `o + q·len`) with weights `p[q·ps + j]`.
#[derive(Clone, Copy)]
struct ValueRun<E> {
    o: *mut f32,
    len: usize,
    p: *const f32,
    ps: usize,
    v: *const E,
    vs: usize,
    nk: usize,
}

/// `o[q] += Σ_j p[q·ps + j] · v_j` over the run. The columns go `U`
/// registers at a time while the rows' sums fit in [`Lanes::SUMS`]
/// registers (each sum's chain of `nk` dependent FMAs is what bounds a
/// short run, so one query wants many of them side by side), then two, one
/// and the scalar tail; every output element is the same `fma(p, v, o)`
/// key after key whichever width took it.
#[inline(always)]
unsafe fn pv_rows<V: Lanes, E: Elem, const N: usize>(r: ValueRun<E>) {
    let mut i = 0;
    if N * 8 <= V::SUMS {
        i = pv_cols::<V, E, N, 8>(r, i);
    }
    if N * 4 <= V::SUMS {
        i = pv_cols::<V, E, N, 4>(r, i);
    }
    i = pv_cols::<V, E, N, 2>(r, i);
    i = pv_cols::<V, E, N, 1>(r, i);
    let ValueRun { o, len, p, ps, v, vs, nk } = r;
    while i < len {
        for j in 0..nk {
            let x = v.add(j * vs + i).read_unaligned().to_f32();
            for q in 0..N {
                *o.add(q * len + i) += *p.add(q * ps + j) * x;
            }
        }
        i += 1;
    }
}

/// [`pv_rows`]'s columns from `i` on, `U` registers of each row at a time,
/// while `U` whole registers remain; returns where it stopped.
#[inline(always)]
unsafe fn pv_cols<V: Lanes, E: Elem, const N: usize, const U: usize>(r: ValueRun<E>, mut i: usize) -> usize {
    let ValueRun { o, len, p, ps, v, vs, nk } = r;
    let w = V::LANES;
    while i + U * w <= len {
        let mut a: [[V; U]; N] = std::array::from_fn(|q| std::array::from_fn(|u| V::load(o.add(q * len + i + u * w))));
        for j in 0..nk {
            let x: [V; U] = std::array::from_fn(|u| E::load::<V>(v.add(j * vs + i + u * w)));
            for (q, a) in a.iter_mut().enumerate() {
                let pj = V::splat(*p.add(q * ps + j));
                for (a, x) in a.iter_mut().zip(&x) {
                    *a = V::fma(pj, *x, *a);
                }
            }
        }
        for (q, a) in a.iter().enumerate() {
            for (u, a) in a.iter().enumerate() {
                a.store(o.add(q * len + i + u * w));
            }
        }
        i += U * w;
    }
    i
}

/// Value sums of a run of `nk` keys into `⌈p.len() / ps⌉` rows of `o`,
/// `V::QUERIES` rows per pass.
/// (A loop over passes, as [`dots`].)
#[inline(always)]
pub unsafe fn pv<V: Lanes, E: Elem>(o: &mut [f32], p: &[f32], ps: usize, v: &[u8], vs: usize, nk: usize) {
    let n = p.len().div_ceil(ps.max(1));
    let len = o.len() / n.max(1);
    assert!(n >= 1 && o.len() == n * len, "pv: rows");
    for (c, oc) in o.chunks_mut(V::QUERIES * len.max(1)).enumerate() {
        let rows = oc.len() / len.max(1);
        let pc = &p[c * V::QUERIES * ps..(c * V::QUERIES + rows - 1) * ps + nk];
        pv_pass::<V, E>(oc, pc, ps, v, vs, nk);
    }
}

/// One pass of [`pv`]: at most `V::QUERIES` rows.
#[inline(always)]
unsafe fn pv_pass<V: Lanes, E: Elem>(o: &mut [f32], p: &[f32], ps: usize, v: &[u8], vs: usize, nk: usize) {
    let n = p.len().div_ceil(ps.max(1));
    let len = o.len() / n.max(1);
    let es = std::mem::size_of::<E>();
    assert!(n >= 1 && o.len() == n * len && nk <= ps && p.len() >= (n - 1) * ps + nk, "pv: shapes");
    assert!(nk == 0 || v.len() >= ((nk - 1) * vs + len) * es, "pv: value rows");
    let r = ValueRun { o: o.as_mut_ptr(), len, p: p.as_ptr(), ps, v: v.as_ptr() as *const E, vs, nk };
    match n {
        1 => pv_rows::<V, E, 1>(r),
        2 => pv_rows::<V, E, 2>(r),
        3 => pv_rows::<V, E, 3>(r),
        4 => pv_rows::<V, E, 4>(r),
        5 => pv_rows::<V, E, 5>(r),
        6 => pv_rows::<V, E, 6>(r),
        7 => pv_rows::<V, E, 7>(r),
        _ => pv_rows::<V, E, 8>(r),
    }
}

/// One key's values into the rows `o` (`[a.len(), len]`): [`pv`] over a run
/// of one key, the rows' weights one apart.
#[inline(always)]
pub unsafe fn axpys<V: Lanes, E: Elem>(o: &mut [f32], a: &[f32], v: &[u8]) {
    let len = v.len() / std::mem::size_of::<E>();
    assert!(!a.is_empty() && o.len() == a.len() * len, "axpys: shapes");
    pv::<V, E>(o, a, 1, v, len, 1)
}

/// The safe-to-call-only-with-the-features entry points of one register
/// type: scores, one key's values, a run of keys' values, for f32 and f16.
macro_rules! entry_points {
    ($lanes:ty, $features:literal: $($dots:ident, $axpys:ident, $pv:ident, $elem:ty;)*) => {$(
        /// # Safety
        #[doc = concat!("The CPU must have ", $features, ".")]
        #[target_feature(enable = $features)]
        pub unsafe fn $dots(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
            dots::<$lanes, $elem>(k, ks, nk, x, out, os)
        }

        /// # Safety
        #[doc = concat!("The CPU must have ", $features, ".")]
        #[target_feature(enable = $features)]
        pub unsafe fn $axpys(o: &mut [f32], a: &[f32], v: &[u8]) {
            axpys::<$lanes, $elem>(o, a, v)
        }

        /// # Safety
        #[doc = concat!("The CPU must have ", $features, ".")]
        #[target_feature(enable = $features)]
        pub unsafe fn $pv(o: &mut [f32], p: &[f32], ps: usize, v: &[u8], vs: usize, nk: usize) {
            pv::<$lanes, $elem>(o, p, ps, v, vs, nk)
        }
    )*};
}

entry_points!(Ymm, "avx2,fma,f16c":
    ymm_dots_f32, ymm_axpys_f32, ymm_pv_f32, f32;
    ymm_dots_f16, ymm_axpys_f16, ymm_pv_f16, F16;
);
entry_points!(Zmm, "avx512f,avx2,fma,f16c":
    zmm_dots_f32, zmm_axpys_f32, zmm_pv_f32, f32;
    zmm_dots_f16, zmm_axpys_f16, zmm_pv_f16, F16;
);

/// Scores against bf16 rows: the weight rows of a bf16 matrix, whose
/// tokens are the "queries" (`kernels::Layout::Rows::dots`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn ymm_dots_bf16(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
    dots::<Ymm, Bf16>(k, ks, nk, x, out, os)
}

/// As [`ymm_dots_bf16`], sixteen lanes.
///
/// # Safety
/// The CPU must have AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub unsafe fn zmm_dots_bf16(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
    dots::<Zmm, Bf16>(k, ks, nk, x, out, os)
}
