//! AVX-512 VNNI kernels for prefill: sixteen weight rows (two interleaved
//! groups, repacked once per call by `pack.rs`) against a run of tokens,
//! one 512-bit register per token holding the sixteen rows' sums.
//!
//! A packed 64-byte row is weights `4k..4k+4` of each of the sixteen rows,
//! so `vpdpbusd` against the token's four activation bytes `4k..4k+4`
//! (broadcast to every lane) adds four products to each row's lane. The
//! instruction multiplies unsigned by signed bytes: the weights are signed,
//! so they enter as `w + 128` (one `xor` per load, shared by every token)
//! and `128 · Σ a` (the activation block's `sum`) comes off the block's
//! integer sum, which is then `Σ w · a` exactly, the integer every other
//! table sums. The scaling is the AVX2 group kernels' (`fma(dw · da, isum,
//! acc)`, q4_1's `fma(m, da · Σa, ·)` after it, in that order), so these
//! kernels give the AVX2 and AVX-VNNI tables' bits, and prefill here agrees
//! with decode on the 256-bit kernels.
//!
//! The direct kernels ([`direct16`]) take the same sixteen rows without the
//! repack, straight from the two groups as the matrix stores them, for
//! every interleaved type but mxfp4x8 (whose tiles stay): the batched
//! decode steps' few tokens and prefill. Their integer sums and scaling are
//! the 8-row kernels' as well.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::kx8::{self, KTile};
use super::pack::{self, GroupBlock, PACK, PACKED, Packed, ROWS, TileBlock};
use super::prim::{PREFETCH_AHEAD, Q4K, Q5K, Q6K, kind_of, prefetch_ahead_l2};
use crate::quant::act::BlockQ8;
use crate::quant::kquant::{QK, SUBS};
use crate::quant::kx8 as qkx8;
use crate::quant::x8::{BlockQ4_0x8, BlockQ4_1x8, BlockQ8_0x8};

/// Tokens whose sums live in registers at once: 2 · 12 accumulators plus
/// the weights leave a few of the 32 registers spare.
const TOKENS: usize = 12;

/// One or two interleaved groups (`groups`, whole groups of `B`) against
/// `tokens` tokens whose quantised rows are `q` (`[tokens, nb]`):
/// `out[t · 16 + r]` for token `t`, row `r` of the groups (rows past the
/// groups come out zero).
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512BW, AVX-512VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn rows16<B: TileBlock>(groups: &[u8], q: &[BlockQ8], tokens: usize, out: &mut [f32]) {
    let nb = pack::check::<B>(groups, q, tokens, out);
    PACK.with_borrow_mut(|p| {
        pack::pack::<B>(p, groups, nb);
        // The next pair of groups follows these in the matrix: ask for it
        // while the tile computes, a share per block column, so that its
        // packing finds it in cache (past the matrix's end the addresses
        // are never read: a prefetch does not fault).
        let ahead = Ahead { at: groups.as_ptr().wrapping_add(groups.len()), per_col: groups.len().div_ceil(nb) };
        packed_ahead::<B>(p, q.as_ptr(), nb, tokens, out.as_mut_ptr(), Some(ahead));
    });
}

/// `tokens` tokens (`q`, `[tokens, nb]`) against a packed pair, into `out`
/// (`[tokens, 16]`), [`TOKENS`] at a time (the AMX tiles use it for the
/// tokens short of a whole tile).
///
/// # Safety
/// As [`rows16`]; `q` and `out` hold that many tokens.
#[inline(always)]
pub unsafe fn packed<B: TileBlock>(p: &Packed, q: *const BlockQ8, nb: usize, tokens: usize, out: *mut f32) {
    packed_ahead::<B>(p, q, nb, tokens, out, None)
}

/// Bytes to ask for while a tile computes: `per_col` of them from `at` per
/// block column.
#[derive(Clone, Copy)]
struct Ahead {
    at: *const u8,
    per_col: usize,
}

/// [`packed`], asking for `ahead`'s bytes during the first run of tokens.
#[inline(always)]
unsafe fn packed_ahead<B: TileBlock>(
    p: &Packed,
    q: *const BlockQ8,
    nb: usize,
    tokens: usize,
    out: *mut f32,
    mut ahead: Option<Ahead>,
) {
    let mut t = 0;
    while t < tokens {
        let (qt, o) = (q.add(t * nb), out.add(t * ROWS));
        let m = (tokens - t).min(TOKENS);
        let a = ahead.take();
        match m {
            12 => run::<B, 12>(p, qt, nb, o, a),
            11 => run::<B, 11>(p, qt, nb, o, a),
            10 => run::<B, 10>(p, qt, nb, o, a),
            9 => run::<B, 9>(p, qt, nb, o, a),
            8 => run::<B, 8>(p, qt, nb, o, a),
            7 => run::<B, 7>(p, qt, nb, o, a),
            6 => run::<B, 6>(p, qt, nb, o, a),
            5 => run::<B, 5>(p, qt, nb, o, a),
            4 => run::<B, 4>(p, qt, nb, o, a),
            3 => run::<B, 3>(p, qt, nb, o, a),
            2 => run::<B, 2>(p, qt, nb, o, a),
            _ => run::<B, 1>(p, qt, nb, o, a),
        }
        t += m;
    }
}

/// `T` tokens (`q`, `[T, nb]`) against the packed pair, into `out`
/// (`[T, 16]`).
#[inline(always)]
unsafe fn run<B: TileBlock, const T: usize>(
    p: &Packed,
    q: *const BlockQ8,
    nb: usize,
    out: *mut f32,
    ahead: Option<Ahead>,
) {
    let flip = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..nb {
        if let Some(a) = ahead {
            let from = a.at.wrapping_add(b * a.per_col);
            let mut off = 0;
            while off < a.per_col {
                _mm_prefetch::<_MM_HINT_T0>(from.wrapping_add(off) as *const i8);
                off += 64;
            }
        }
        let w = p.w.as_ptr().add(b * PACKED);
        let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q.add(t * nb + b));
        let mut isum = [_mm512_setzero_si512(); T];
        for k in 0..8 {
            let wk = _mm512_xor_si512(_mm512_loadu_si512(w.add(64 * k) as *const __m512i), flip);
            for t in 0..T {
                let a = _mm512_set1_epi32((ba[t].qs.as_ptr().add(4 * k) as *const i32).read_unaligned());
                isum[t] = _mm512_dpbusd_epi32(isum[t], wk, a);
            }
        }
        let scales = pack::column_scales::<B>(p, b);
        for t in 0..T {
            // Σ (w + 128)·a − 128·Σa = Σ w·a.
            let s = _mm512_sub_epi32(isum[t], _mm512_set1_epi32(128 * ba[t].sum));
            acc[t] = pack::scale_token::<B>(acc[t], scales, ba[t], s);
        }
    }
    for (t, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * ROWS), *a);
    }
}

/// Tokens whose sums one [`DirectKernel::run`] keeps in registers: 2 · 8
/// accumulators, the code vectors and the scales leave room to spare (q6k's
/// 3 · 8, two half sums and the accumulator per token, fill most of the 32).
const DIRECT_TOKENS: usize = 8;

/// An interleaved type the direct 16-row kernel reads: the same block
/// column of two groups side by side, the first group's rows in lanes 0..8
/// and the second's in 8..16. Its checks and its scaling are the tiles'
/// (`TileBlock`, through `GroupBlock`), so the two give the same bits.
pub trait DirectBlock: GroupBlock {
    /// The sixteen rows' scales, and their minimums where the type has them.
    ///
    /// # Safety
    /// AVX-512F and F16C.
    unsafe fn head(b0: &Self, b1: &Self) -> (__m512, __m512);

    /// Each token's exact integer `Σ w · a` over the block column, per row.
    ///
    /// # Safety
    /// AVX-512F/BW/VNNI.
    unsafe fn sums<const T: usize>(b0: &Self, b1: &Self, ba: [&BlockQ8; T]) -> [__m512i; T];
}

/// The f16 words at `a` and `b` (eight each) as sixteen f32 lanes.
#[inline(always)]
unsafe fn halves_f16(a: *const u16, b: *const u16) -> __m512 {
    let d = _mm256_inserti128_si256::<1>(
        _mm256_castsi128_si256(_mm_loadu_si128(a as *const __m128i)),
        _mm_loadu_si128(b as *const __m128i),
    );
    _mm512_cvtph_ps(d)
}

/// The 32-byte runs at `a` and `b` as the halves of one register.
#[inline(always)]
unsafe fn halves_run(a: *const u8, b: *const u8) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_loadu_si256(a as *const __m256i)),
        _mm256_loadu_si256(b as *const __m256i),
    )
}

/// Activation word `k` (bytes `4k..4k+4`) of a token's block in every lane.
#[inline(always)]
unsafe fn act_word(ba: &BlockQ8, k: usize) -> __m512i {
    _mm512_set1_epi32((ba.qs.as_ptr().add(4 * k) as *const i32).read_unaligned())
}

/// `Σ c · a` of the two groups' nibble codes (q4_0x8, q4_1x8, a q4kx8
/// sub-block: run `j`'s low nibbles are columns `4j..4j+4` of each row, its
/// high ones `16+4j..`), with `K = Q5K` each code's fifth bit merged in from
/// `e0`, the two groups' fifth-bit words of the sub-block (bit `j` of each
/// byte completes the low nibble, bit `4 + j` the high one, as in `kx8`).
#[inline(always)]
unsafe fn nibble_sums16<const T: usize, const K: u8>(
    q0: *const u8,
    q1: *const u8,
    e0: __m512i,
    ba: [&BlockQ8; T],
) -> [__m512i; T] {
    // `a | (b & c)`: the fifth bits (`b`, masked by `c`) into the codes.
    const OR_MASKED: i32 = 0xF8;
    let nib = _mm512_set1_epi8(0x0F);
    let bit4 = _mm512_set1_epi8(0x10);
    let mut isum = [_mm512_setzero_si512(); T];
    for j in 0..4 {
        let raw = halves_run(q0.add(32 * j), q1.add(32 * j));
        let mut lo = _mm512_and_si512(raw, nib);
        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib);
        if K == Q5K {
            let up = _mm512_sllv_epi32(e0, _mm512_set1_epi32(4 - j as i32));
            let down = _mm512_srlv_epi32(e0, _mm512_set1_epi32(j as i32));
            lo = _mm512_ternarylogic_epi32::<OR_MASKED>(lo, up, bit4);
            hi = _mm512_ternarylogic_epi32::<OR_MASKED>(hi, down, bit4);
        }
        for t in 0..T {
            isum[t] =
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[t], lo, act_word(ba[t], j)), hi, act_word(ba[t], 4 + j));
        }
    }
    isum
}

impl DirectBlock for BlockQ4_0x8 {
    #[inline(always)]
    unsafe fn head(b0: &Self, b1: &Self) -> (__m512, __m512) {
        (halves_f16(b0.d.as_ptr(), b1.d.as_ptr()), _mm512_setzero_ps())
    }

    #[inline(always)]
    unsafe fn sums<const T: usize>(b0: &Self, b1: &Self, ba: [&BlockQ8; T]) -> [__m512i; T] {
        let mut s = nibble_sums16::<T, Q4K>(b0.qs.as_ptr(), b1.qs.as_ptr(), _mm512_setzero_si512(), ba);
        for t in 0..T {
            // Codes are stored +8: Σ (c − 8)·a = Σ c·a − 8·Σa.
            s[t] = _mm512_sub_epi32(s[t], _mm512_set1_epi32(8 * ba[t].sum));
        }
        s
    }
}

impl DirectBlock for BlockQ4_1x8 {
    #[inline(always)]
    unsafe fn head(b0: &Self, b1: &Self) -> (__m512, __m512) {
        (halves_f16(b0.d.as_ptr(), b1.d.as_ptr()), halves_f16(b0.m.as_ptr(), b1.m.as_ptr()))
    }

    #[inline(always)]
    unsafe fn sums<const T: usize>(b0: &Self, b1: &Self, ba: [&BlockQ8; T]) -> [__m512i; T] {
        nibble_sums16::<T, Q4K>(b0.qs.as_ptr(), b1.qs.as_ptr(), _mm512_setzero_si512(), ba)
    }
}

impl DirectBlock for BlockQ8_0x8 {
    #[inline(always)]
    unsafe fn head(b0: &Self, b1: &Self) -> (__m512, __m512) {
        (halves_f16(b0.d.as_ptr(), b1.d.as_ptr()), _mm512_setzero_ps())
    }

    #[inline(always)]
    unsafe fn sums<const T: usize>(b0: &Self, b1: &Self, ba: [&BlockQ8; T]) -> [__m512i; T] {
        // Run `k` is weights `4k..4k+4` of each row, signed: they enter as
        // `w + 128` and `128 · Σa` comes off.
        let flip = _mm512_set1_epi8(-128);
        let (q0, q1) = (b0.qs.as_ptr() as *const u8, b1.qs.as_ptr() as *const u8);
        let mut isum = [_mm512_setzero_si512(); T];
        for k in 0..8 {
            let w = _mm512_xor_si512(halves_run(q0.add(32 * k), q1.add(32 * k)), flip);
            for t in 0..T {
                isum[t] = _mm512_dpbusd_epi32(isum[t], w, act_word(ba[t], k));
            }
        }
        for t in 0..T {
            isum[t] = _mm512_sub_epi32(isum[t], _mm512_set1_epi32(128 * ba[t].sum));
        }
        isum
    }
}

/// A type the direct 16-row kernel takes: one run of tokens against two
/// groups side by side (the first group's rows in lanes 0..8, the second's
/// in 8..16).
pub trait DirectKernel: TileBlock {
    /// `T` tokens (`q`, `[T, nb]`) against the groups of `pair`, into `out`
    /// (`[T, 16]`).
    ///
    /// # Safety
    /// AVX-512F/BW/VNNI, AVX2, FMA and F16C; the groups and `q` passed
    /// [`pack::check`] with this `nb`, and `out` holds `T` tokens.
    unsafe fn run<const T: usize>(pair: Pair, q: *const BlockQ8, nb: usize, out: *mut f32);
}

/// The two groups a direct kernel reads side by side (`g1` is `g0` again
/// when there is one), and how far ahead in each it asks for weights
/// ([`pair_ahead`]).
#[derive(Clone, Copy)]
pub struct Pair {
    g0: *const u8,
    g1: *const u8,
    ahead: usize,
}

impl Pair {
    /// Asks for the `len` bytes at offset `at` of both groups, `ahead`
    /// bytes on, into L2.
    ///
    /// # Safety
    /// SSE (every x86_64); the addresses are never dereferenced.
    #[inline(always)]
    unsafe fn prefetch(self, at: usize, len: usize) {
        prefetch_ahead_l2(self.g0.wrapping_add(at), self.ahead, len);
        prefetch_ahead_l2(self.g1.wrapping_add(at), self.ahead, len);
    }
}

impl<B: DirectBlock> DirectKernel for B {
    #[inline(always)]
    unsafe fn run<const T: usize>(pair: Pair, q: *const BlockQ8, nb: usize, out: *mut f32) {
        let (g0, g1) = (pair.g0 as *const B, pair.g1 as *const B);
        let size = std::mem::size_of::<B>();
        let mut acc = [_mm512_setzero_ps(); T];
        for b in 0..nb {
            let (b0, b1) = (&*g0.add(b), &*g1.add(b));
            pair.prefetch(b * size, size);
            let head = B::head(b0, b1);
            let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q.add(t * nb + b));
            let isum = B::sums(b0, b1, ba);
            for t in 0..T {
                acc[t] = pack::scale_token::<B>(acc[t], head, ba[t], isum[t]);
            }
        }
        store_tokens(&acc, out);
    }
}

/// A column's sixteen `d` and `dmin` (two groups' q4kx8 or q5kx8 headers)
/// and the rows' words of the scales' top bits, walked sub-block by
/// sub-block: `kx8`'s 8-row header walk on both groups at once, the same
/// operations per lane.
struct KHead16 {
    d: __m512,
    dmin: __m512,
    /// Bits 2j, 2j+1 of each row's word (the scale's top bits) at bits 4-5
    /// for the next sub-block j.
    tsc: __m512i,
    /// Bits 16+2j, 17+2j (the minimum's) at bits 4-5.
    tm: __m512i,
}

impl KHead16 {
    /// The headers of the columns at `c0` and `c1`.
    #[inline(always)]
    unsafe fn load(c0: *const u8, c1: *const u8) -> KHead16 {
        let d = halves_f16(c0 as *const u16, c1 as *const u16);
        let dmin = halves_f16(c0.add(16) as *const u16, c1.add(16) as *const u16);
        let top = halves_run(c0.add(96), c1.add(96));
        KHead16 { d, dmin, tsc: _mm512_slli_epi32::<4>(top), tm: _mm512_srli_epi32::<12>(top) }
    }

    /// The sixteen rows' `s = d · sc` and `o = dmin · m` of sub-block `j`
    /// (called for j = 0, 1, ... in order).
    #[inline(always)]
    unsafe fn next(&mut self, c0: *const u8, c1: *const u8, j: usize) -> (__m512, __m512) {
        let bytes = _mm_unpacklo_epi64(
            _mm_loadl_epi64(c0.add(32 + 8 * j) as *const __m128i),
            _mm_loadl_epi64(c1.add(32 + 8 * j) as *const __m128i),
        );
        let b = _mm512_cvtepu8_epi32(bytes);
        let bits45 = _mm512_set1_epi32(0x30);
        let sc = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)), _mm512_and_si512(self.tsc, bits45));
        let m = _mm512_or_si512(_mm512_srli_epi32::<4>(b), _mm512_and_si512(self.tm, bits45));
        (self.tsc, self.tm) = (_mm512_srli_epi32::<2>(self.tsc), _mm512_srli_epi32::<2>(self.tm));
        (_mm512_mul_ps(self.d, _mm512_cvtepi32_ps(sc)), _mm512_mul_ps(self.dmin, _mm512_cvtepi32_ps(m)))
    }
}

/// The super-block types: each sub-block is a block column whose runs have
/// the 32-value types' layout (plus q5k's fifth-bit and q6k's top-bit
/// words), so the two groups' same runs share registers as theirs do. q4k
/// and q5k take their scales from the walk of both groups' headers and the
/// scaling of the tiles (`KTile`); q6k, which has no tiles (two scales per
/// sub-block), keeps its 8-row kernels' two half sums and operation order
/// ([`q6k_run`]). Either way the bits are the 8-row kernels'.
impl<const K: u8> DirectKernel for KTile<K> {
    #[inline(always)]
    unsafe fn run<const T: usize>(pair: Pair, q: *const BlockQ8, nb: usize, out: *mut f32) {
        if K == Q6K {
            return q6k_run::<T>(pair, q, nb, out);
        }
        let kind = kind_of(K);
        let (hb, sb) = (qkx8::header_bytes(kind), qkx8::sub_bytes(kind));
        let mut acc = [_mm512_setzero_ps(); T];
        for (c, (start, subs)) in qkx8::columns(kind, nb * QK).enumerate() {
            let (c0, c1) = (pair.g0.add(start), pair.g1.add(start));
            pair.prefetch(start, hb);
            let mut head = KHead16::load(c0, c1);
            for j in 0..subs {
                let b = c * SUBS + j;
                let (s0, s1) = (c0.add(hb + j * sb), c1.add(hb + j * sb));
                pair.prefetch(start + hb + j * sb, sb);
                let scales = head.next(c0, c1, j);
                let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q.add(t * nb + b));
                let e0 = if K == Q5K { halves_run(s0.add(128), s1.add(128)) } else { _mm512_setzero_si512() };
                let isum = nibble_sums16::<T, K>(s0, s1, e0, ba);
                for t in 0..T {
                    acc[t] = KTile::<K>::scale_token(acc[t], scales, ba[t], isum[t]);
                }
            }
        }
        store_tokens(&acc, out);
    }
}

/// q6kx8's direct run: per sub-block and token, `p₀` and `p₁` (the sums
/// over codes 0..16 and 16..32, the top bits merged in from the rows'
/// words), `n = sc₁ · f32(p₁ − 32·Σ₁) + sc₀ · f32(p₀ − 32·Σ₀)` (a multiply
/// and a fused multiply-add), `u = d_a · n`, `acc = acc + d · u`: `kx8`'s
/// `q6k_sums` and `gemm8` on sixteen lanes.
#[inline(always)]
unsafe fn q6k_run<const T: usize>(pair: Pair, q: *const BlockQ8, nb: usize, out: *mut f32) {
    // `a | (b & c)`: the top bits (`b`, masked by `c`) into the codes.
    const OR_MASKED: i32 = 0xF8;
    let kind = kind_of(Q6K);
    let (hb, sb) = (qkx8::header_bytes(kind), qkx8::sub_bytes(kind));
    let nib = _mm512_set1_epi8(0x0F);
    let bits45 = _mm512_set1_epi8(0x30);
    let mut acc = [_mm512_setzero_ps(); T];
    for (c, (start, subs)) in qkx8::columns(kind, nb * QK).enumerate() {
        let (c0, c1) = (pair.g0.add(start), pair.g1.add(start));
        pair.prefetch(start, hb);
        let d = halves_f16(c0 as *const u16, c1 as *const u16);
        for j in 0..subs {
            let b = c * SUBS + j;
            let (s0, s1) = (c0.add(hb + j * sb), c1.add(hb + j * sb));
            pair.prefetch(start + hb + j * sb, sb);
            let (sc0, sc1) = (q6k_scales(c0, c1, 16 + 16 * j), q6k_scales(c0, c1, 24 + 16 * j));
            let ba: [&BlockQ8; T] = std::array::from_fn(|t| &*q.add(t * nb + b));
            let (e0, e1) = (halves_run(s0.add(128), s1.add(128)), halves_run(s0.add(160), s1.add(160)));
            let mut p0 = [_mm512_setzero_si512(); T];
            let mut p1 = [_mm512_setzero_si512(); T];
            for r in 0..4 {
                let raw = halves_run(s0.add(32 * r), s1.add(32 * r));
                let lo = _mm512_ternarylogic_epi32::<OR_MASKED>(_mm512_and_si512(raw, nib), q6k_top(e0, r), bits45);
                let hi = _mm512_ternarylogic_epi32::<OR_MASKED>(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib),
                    q6k_top(e1, r),
                    bits45,
                );
                for t in 0..T {
                    p0[t] = _mm512_dpbusd_epi32(p0[t], lo, act_word(ba[t], r));
                    p1[t] = _mm512_dpbusd_epi32(p1[t], hi, act_word(ba[t], 4 + r));
                }
            }
            for t in 0..T {
                let (h0, h1) = half_sums32(ba[t]);
                let (n0, n1) = (_mm512_sub_epi32(p0[t], h0), _mm512_sub_epi32(p1[t], h1));
                let n = _mm512_fmadd_ps(sc1, _mm512_cvtepi32_ps(n1), _mm512_mul_ps(sc0, _mm512_cvtepi32_ps(n0)));
                let u = _mm512_mul_ps(_mm512_set1_ps(ba[t].d), n);
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(d, u));
            }
        }
    }
    store_tokens(&acc, out);
}

/// The sixteen rows' q6k scales at byte `at` of both groups' headers, as
/// f32. (This and [`q6k_top`] are functions, not closures: a closure does
/// not inherit the caller's target features, and one left out of line makes
/// each intrinsic in it a call.)
#[inline(always)]
unsafe fn q6k_scales(c0: *const u8, c1: *const u8, at: usize) -> __m512 {
    let b = _mm_unpacklo_epi64(
        _mm_loadl_epi64(c0.add(at) as *const __m128i),
        _mm_loadl_epi64(c1.add(at) as *const __m128i),
    );
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))
}

/// Run `r`'s top code bits at bits 4-5 of each byte: they are bits 2r,
/// 2r+1 of the rows' words `e`.
#[inline(always)]
unsafe fn q6k_top(e: __m512i, r: usize) -> __m512i {
    match r {
        0 => _mm512_slli_epi32::<4>(e),
        1 => _mm512_slli_epi32::<2>(e),
        2 => e,
        _ => _mm512_srli_epi32::<2>(e),
    }
}

/// `32 · Σ₀` and `32 · Σ₁` of an activation block (`Σ₀` over its first 16
/// codes, `Σ₁` over the rest), each in every lane (`kx8::half_sum32`).
#[inline(always)]
unsafe fn half_sums32(b: &BlockQ8) -> (__m512i, __m512i) {
    let low = _mm512_broadcastd_epi32(kx8::half_sum32(b));
    (low, _mm512_sub_epi32(_mm512_set1_epi32(32 * b.sum), low))
}

/// Each token's sixteen sums to `out` (`[T, 16]`).
#[inline(always)]
unsafe fn store_tokens<const T: usize>(acc: &[__m512; T], out: *mut f32) {
    for (t, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(t * ROWS), *a);
    }
}

/// How far ahead the direct kernels ask for weights, for groups of
/// `group_bytes`: the fewest whole pairs of groups (the calls walk the
/// matrix a pair at a time) that reach [`PREFETCH_AHEAD`] bytes, so that
/// each group's stream asks for its counterpart in a later pair and both
/// of that pair's groups arrive. A fixed 16 KiB reaches both groups of the
/// next pair only for groups of about 8-16 KiB; at 18 KiB (4096 columns of
/// q4_0) each stream's requests stayed in its own group and the next
/// pair's second group was never asked for. On a Zen 5 EPYC, one thread
/// over such a streamed matrix, the kernel read 20, 15 and 10 GB/s at two,
/// four and eight tokens (39, 36 and 23 at 2048 columns); a pair ahead,
/// 40, 25 and 23.
#[inline(always)]
fn pair_ahead(group_bytes: usize) -> usize {
    let pair = 2 * group_bytes;
    PREFETCH_AHEAD.div_ceil(pair) * pair
}

/// Sixteen rows of an interleaved type straight from the matrix, for the
/// few tokens of a batched decode step and for prefill: the 32-byte runs of
/// the two groups' same block column are the halves of one register, so
/// every `vpdpbusd` takes sixteen rows against one broadcast activation
/// word, with no repack and no per-token shuffle. One or two groups
/// (`groups`), `tokens` tokens (`q`, `[tokens, nb]`), `out[t · 16 + r]`
/// (rows past the groups come out zero). The integer sums and the scaling
/// (per block, in block order) are the 8-row kernels', so the bits are too.
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512BW, AVX-512VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn direct16<D: DirectKernel>(groups: &[u8], q: &[BlockQ8], tokens: usize, out: &mut [f32]) {
    let nb = pack::check::<D>(groups, q, tokens, out);
    let g0 = groups.as_ptr();
    let two = groups.len() == 2 * D::group_bytes(nb);
    // With one group the upper half repeats it and is cleared below.
    let g1 = if two { g0.add(D::group_bytes(nb)) } else { g0 };
    let pair = Pair { g0, g1, ahead: pair_ahead(D::group_bytes(nb)) };
    let mut t = 0;
    while t < tokens {
        let (qt, o) = (q.as_ptr().add(t * nb), out.as_mut_ptr().add(t * ROWS));
        let m = (tokens - t).min(DIRECT_TOKENS);
        match m {
            8 => D::run::<8>(pair, qt, nb, o),
            7 => D::run::<7>(pair, qt, nb, o),
            6 => D::run::<6>(pair, qt, nb, o),
            5 => D::run::<5>(pair, qt, nb, o),
            4 => D::run::<4>(pair, qt, nb, o),
            3 => D::run::<3>(pair, qt, nb, o),
            2 => D::run::<2>(pair, qt, nb, o),
            _ => D::run::<1>(pair, qt, nb, o),
        }
        t += m;
    }
    if !two {
        for row in out.chunks_exact_mut(ROWS) {
            row[ROWS / 2..].fill(0.0);
        }
    }
}
