//! AVX-512F attention kernels over the KV cache (f32 and f16 rows): the
//! same shapes as the AVX2 ones with sixteen lanes per chain and the 32
//! registers AVX-512 has: up to eight queries per call, score tiles of four
//! queries by four keys or eight by three.
//! Each `unsafe fn` needs AVX-512F, AVX2, FMA and F16C (checked once by the
//! caller); lengths are asserted by the `*_any` entry points.
//!
//! Per (query, key) a score is one FMA chain of sixteen lanes, the lanes'
//! sum, then the scalar tail; per output element a value sum is `fma(p, v,
//! o)` key after key (the scalar `o += p · v` past the last whole sixteen),
//! whether one key or a run of keys is added and however many queries share
//! the call: a query's bits do not depend on its batch, so prefill and
//! decode agree within this table (the AVX2 table's bits differ: eight
//! lanes per chain).
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

/// A KV-cache element type: sixteen values as f32 lanes, one as an f32.
trait Elem: Copy {
    unsafe fn load16(p: *const Self) -> __m512;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

/// f16 as its raw bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct F16(u16);

impl Elem for F16 {
    #[inline(always)]
    unsafe fn load16(p: *const F16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }
}

/// `NQ` queries × `NK` keys (key `j` at `k + j·ks` elements), into
/// `out[q·os + j]`.
#[inline(always)]
unsafe fn dots_tile<E: Elem, const NQ: usize, const NK: usize>(
    k: *const E,
    ks: usize,
    x: [*const f32; NQ],
    len: usize,
    out: *mut f32,
    os: usize,
) {
    let mut c = [[_mm512_setzero_ps(); NK]; NQ];
    let mut i = 0;
    while i + 16 <= len {
        let kv: [__m512; NK] = std::array::from_fn(|j| E::load16(k.add(j * ks + i)));
        for (q, c) in c.iter_mut().enumerate() {
            let xv = _mm512_loadu_ps(x[q].add(i));
            for (c, kv) in c.iter_mut().zip(&kv) {
                *c = _mm512_fmadd_ps(*kv, xv, *c);
            }
        }
        i += 16;
    }
    for (q, c) in c.iter().enumerate() {
        for (j, c) in c.iter().enumerate() {
            let mut s = _mm512_reduce_add_ps(*c);
            for e in i..len {
                s += k.add(j * ks + e).read_unaligned().to_f32() * *x[q].add(e);
            }
            *out.add(q * os + j) = s;
        }
    }
}

#[inline(always)]
unsafe fn dots_any<E: Elem>(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
    let nq = x.len();
    let len = x.first().map_or(0, |q| q.len());
    let es = std::mem::size_of::<E>();
    assert!((1..=8).contains(&nq) && x.iter().all(|q| q.len() == len), "dots: queries");
    assert!(nk == 0 || k.len() >= ((nk - 1) * ks + len) * es, "dots: key rows");
    assert!(nk == 0 || (nk <= os && out.len() >= (nq - 1) * os + nk), "dots: out");
    let kp = k.as_ptr() as *const E;
    let o = out.as_mut_ptr();
    let p = |i: usize| x[i].as_ptr();
    macro_rules! run {
        ($nq:literal, $tile:literal, [$($q:literal),*]) => {{
            let mut j = 0;
            while j + $tile <= nk {
                dots_tile::<E, $nq, $tile>(kp.add(j * ks), ks, [$(p($q)),*], len, o.add(j), os);
                j += $tile;
            }
            while j < nk {
                dots_tile::<E, $nq, 1>(kp.add(j * ks), ks, [$(p($q)),*], len, o.add(j), os);
                j += 1;
            }
        }};
    }
    match nq {
        1 => run!(1, 4, [0]),
        2 => run!(2, 4, [0, 1]),
        3 => run!(3, 4, [0, 1, 2]),
        4 => run!(4, 4, [0, 1, 2, 3]),
        5 => run!(5, 3, [0, 1, 2, 3, 4]),
        6 => run!(6, 3, [0, 1, 2, 3, 4, 5]),
        7 => run!(7, 3, [0, 1, 2, 3, 4, 5, 6]),
        _ => run!(8, 3, [0, 1, 2, 3, 4, 5, 6, 7]),
    }
}

/// `o[q] += Σ_j p[q·ps + j] · v_j` over `nk` value rows (`v_j` at `v + j·vs`).
#[inline(always)]
unsafe fn pv_elems<E: Elem, const N: usize>(
    o: *mut f32,
    len: usize,
    p: *const f32,
    ps: usize,
    v: *const E,
    vs: usize,
    nk: usize,
) {
    let mut i = 0;
    while i + 32 <= len {
        let mut a0: [__m512; N] = std::array::from_fn(|q| _mm512_loadu_ps(o.add(q * len + i)));
        let mut a1: [__m512; N] = std::array::from_fn(|q| _mm512_loadu_ps(o.add(q * len + i + 16)));
        for j in 0..nk {
            let (x0, x1) = (E::load16(v.add(j * vs + i)), E::load16(v.add(j * vs + i + 16)));
            for q in 0..N {
                let pj = _mm512_set1_ps(*p.add(q * ps + j));
                a0[q] = _mm512_fmadd_ps(pj, x0, a0[q]);
                a1[q] = _mm512_fmadd_ps(pj, x1, a1[q]);
            }
        }
        for q in 0..N {
            _mm512_storeu_ps(o.add(q * len + i), a0[q]);
            _mm512_storeu_ps(o.add(q * len + i + 16), a1[q]);
        }
        i += 32;
    }
    while i + 16 <= len {
        let mut a0: [__m512; N] = std::array::from_fn(|q| _mm512_loadu_ps(o.add(q * len + i)));
        for j in 0..nk {
            let x0 = E::load16(v.add(j * vs + i));
            for (q, a) in a0.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_set1_ps(*p.add(q * ps + j)), x0, *a);
            }
        }
        for (q, a) in a0.iter().enumerate() {
            _mm512_storeu_ps(o.add(q * len + i), *a);
        }
        i += 16;
    }
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

#[inline(always)]
unsafe fn pv_any<E: Elem>(o: &mut [f32], p: &[f32], ps: usize, v: &[u8], vs: usize, nk: usize) {
    let n = p.len().div_ceil(ps.max(1));
    let len = o.len() / n.max(1);
    let es = std::mem::size_of::<E>();
    assert!(n >= 1 && o.len() == n * len && nk <= ps && p.len() >= (n - 1) * ps + nk, "pv: shapes");
    assert!(nk == 0 || v.len() >= ((nk - 1) * vs + len) * es, "pv: value rows");
    let (op, pp, vp) = (o.as_mut_ptr(), p.as_ptr(), v.as_ptr() as *const E);
    match n {
        1 => pv_elems::<E, 1>(op, len, pp, ps, vp, vs, nk),
        2 => pv_elems::<E, 2>(op, len, pp, ps, vp, vs, nk),
        3 => pv_elems::<E, 3>(op, len, pp, ps, vp, vs, nk),
        4 => pv_elems::<E, 4>(op, len, pp, ps, vp, vs, nk),
        5 => pv_elems::<E, 5>(op, len, pp, ps, vp, vs, nk),
        6 => pv_elems::<E, 6>(op, len, pp, ps, vp, vs, nk),
        7 => pv_elems::<E, 7>(op, len, pp, ps, vp, vs, nk),
        8 => pv_elems::<E, 8>(op, len, pp, ps, vp, vs, nk),
        n => panic!("pv takes 1 to 8 rows, got {n}"),
    }
}

/// One key: `pv` over a run of one (the same per-element operations).
#[inline(always)]
unsafe fn axpys_any<E: Elem>(o: &mut [f32], a: &[f32], v: &[u8]) {
    let len = v.len() / std::mem::size_of::<E>();
    assert!((1..=8).contains(&a.len()) && o.len() == a.len() * len, "axpys: shapes");
    // Row q's weight at a[q]: a run of one key with the rows one apart.
    pv_any::<E>(o, a, 1, v, len, 1)
}

macro_rules! kv_kernels {
    ($dots:ident, $axpys:ident, $pv:ident, $elem:ty) => {
        /// # Safety
        /// AVX-512F, AVX2, FMA and F16C must be available.
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        pub unsafe fn $dots(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
            dots_any::<$elem>(k, ks, nk, x, out, os)
        }

        /// # Safety
        /// As above.
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        pub unsafe fn $axpys(o: &mut [f32], a: &[f32], v: &[u8]) {
            axpys_any::<$elem>(o, a, v)
        }

        /// # Safety
        /// As above.
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        pub unsafe fn $pv(o: &mut [f32], p: &[f32], ps: usize, v: &[u8], vs: usize, nk: usize) {
            pv_any::<$elem>(o, p, ps, v, vs, nk)
        }
    };
}

kv_kernels!(dots_f32, axpys_f32, pv_f32, f32);
kv_kernels!(dots_f16, axpys_f16, pv_f16, F16);
