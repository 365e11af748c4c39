//! The x86_64 vector layer every kernel file of this folder is written
//! over: the `#[inline(always)]` intrinsic wrappers (horizontal sums, f16
//! scales, the int8 multiply-adds and the `vpdpbusd` forms), the tags that
//! name an integer-sum form or a super-block kind as a const parameter, the
//! activation broadcasts, the late accumulators of the 8-row group kernels,
//! and the weight-stream prefetch helpers. It imports no kernel file, so
//! every kernel file sits above it and none imports another's primitives.
//! Inlined into the `#[target_feature]` outer functions of the kernel files,
//! these compile to the same code wherever they are defined.
//!
//! The whole body of each `unsafe fn` here is the unsafe operation (raw
//! loads and intrinsics); its caller is a `#[target_feature]` kernel that
//! enables the features and checks the lengths.
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::quant::act::BlockQ8;
use crate::quant::kquant::Kind;

// ------------------------------------------------------------------
// Intrinsic wrappers and the integer-sum forms.

#[inline(always)]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// An f16 scale as a broadcast f32 vector. Built from a broadcast (not an
/// insert into some register), so it never waits on an unrelated register:
/// an insert let the compiler merge into the accumulator, chaining every
/// block's scale conversion behind the previous block's FMA (5x slower).
#[inline(always)]
pub(super) unsafe fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits as i16)))
}

/// Unsigned bytes x · signed bytes y, summed in groups of four into 8 i32
/// lanes (`maddubs` then `madd` by ones: what AVX-VNNI's `vpdpbusd` does in
/// one instruction). `maddubs` saturates its 16-bit pair sums, so callers
/// keep `x` below 128 (|w| or 4-bit codes).
#[inline(always)]
pub(super) unsafe fn sum4_u8_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

/// How the group kernels sum bytes: `maddubs` + `madd` (AVX2), or one
/// `vpdpbusd` in its VEX form (AVX-VNNI) or its 256-bit EVEX form (AVX-512
/// VNNI with VL; mxfp4 only, on CPUs that have that and not AVX-VNNI:
/// Cascade Lake, Ice Lake, Zen 4), or the 512-bit one over run pairs
/// ([`ZMM_VNNI`], `pairs.rs`). All give the same integers.
pub(super) const MADD: u8 = 0;
/// See [`MADD`].
pub(super) const AVX_VNNI: u8 = 1;
/// See [`MADD`].
pub(super) const EVEX_VNNI: u8 = 2;

/// `acc + Σ4 x·y` by `vpdpbusd` in the form `V` names ([`AVX_VNNI`] or
/// [`EVEX_VNNI`]).
#[inline(always)]
pub(super) unsafe fn vpdpbusd<const V: u8>(acc: __m256i, x: __m256i, y: __m256i) -> __m256i {
    match V {
        EVEX_VNNI => _mm256_dpbusd_epi32(acc, x, y),
        _ => _mm256_dpbusd_avx_epi32(acc, x, y),
    }
}

/// `acc + sum4_u8_i8(x, y)`: one `vpdpbusd` with VNNI (`V` other than
/// [`MADD`]), else `maddubs` + `madd` + add. The two give the same
/// integers: callers keep `x` below 128, so `maddubs` never saturates.
#[inline(always)]
pub(super) unsafe fn dp4<const V: u8>(acc: __m256i, x: __m256i, y: __m256i) -> __m256i {
    if V != MADD { vpdpbusd::<V>(acc, x, y) } else { _mm256_add_epi32(acc, sum4_u8_i8(x, y)) }
}

/// Unsigned bytes x (< 128) · signed bytes y, summed into 8 f32 lanes.
#[inline(always)]
pub(super) unsafe fn dot_u8_i8(x: __m256i, y: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(sum4_u8_i8(x, y))
}

/// Signed bytes x · signed bytes y, summed in groups of four into 8 f32
/// lanes, by the sign trick: `|x|` · `sign(x)·y`.
#[inline(always)]
pub(super) unsafe fn dot_i8(x: __m256i, y: __m256i) -> __m256 {
    dot_u8_i8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

/// 16 bytes of packed nibbles → 32 bytes: low nibbles, then high nibbles.
#[inline(always)]
pub(super) unsafe fn unpack_nibbles(p: *const u8) -> __m256i {
    let raw = _mm_loadu_si128(p as *const __m128i);
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(raw, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    _mm256_set_m128i(hi, lo)
}

/// The integer sums by 512-bit `vpdpbusd` over pairs of runs (`pairs.rs`):
/// a value of the group kernels' `VNNI` parameter beside [`MADD`],
/// [`AVX_VNNI`] and [`EVEX_VNNI`].
pub(super) const ZMM_VNNI: u8 = 3;

#[inline(always)]
pub(super) unsafe fn store8(v: __m256) -> [f32; 8] {
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), v);
    out
}

/// One pass of `$f::<T, $g...>($a..., tokens)` over a group's weights per
/// run of up to N tokens, where `[$t]` lists 1 to N (the counts the
/// kernel's registers hold), each run's eight sums per token into `$out`:
/// the body of every several-token group kernel of `avx2.rs` and `kx8.rs`,
/// with the length checks they share. The expansion site has `store8` and
/// `GEMM8_TOKENS` in scope.
macro_rules! in_passes {
    ($q:ident, $out:ident, [$($t:literal)+], $f:ident::<_ $(, $g:ident)*>($($a:expr),*)) => {
        in_passes!(@runs $q, $out, [$($t)+], $f, [$($g),*], [$($a),*])
    };
    (@runs $q:ident, $out:ident, [$($t:literal)+], $f:ident, $gs:tt, $args:tt) => {{
        assert_eq!($q.len(), $out.len(), "one output per token");
        assert!($q.len() <= GEMM8_TOKENS, "group kernels take 1 to {GEMM8_TOKENS} tokens, got {}", $q.len());
        const PASS: usize = [$($t),+].len();
        for (q, out) in $q.chunks(PASS).zip($out.chunks_mut(PASS)) {
            let p = |t: usize| q[t].as_ptr();
            let mut put = |acc: &[__m256]| {
                for (o, a) in out.iter_mut().zip(acc) {
                    *o = store8(*a);
                }
            };
            match q.len() {
                $($t => put(&in_passes!(@call $f, $t, $gs, $args, p)),)+
                _ => unreachable!("runs of 1 to {PASS} tokens"),
            }
        }
    }};
    (@call $f:ident, $t:literal, [$($g:ident),*], [$($a:expr),*], $p:ident) => {
        $f::<$t $(, $g)*>($($a,)* std::array::from_fn($p))
    };
}
pub(super) use in_passes;

// ------------------------------------------------------------------
// Super-block kinds as const parameters.

/// The kinds as const parameters.
pub(super) const Q4K: u8 = 0;
/// See [`Q4K`].
pub(super) const Q5K: u8 = 1;
/// See [`Q4K`].
pub(super) const Q6K: u8 = 2;

pub(super) const fn kind_of(k: u8) -> Kind {
    match k {
        Q4K => Kind::Q4K,
        Q5K => Kind::Q5K,
        _ => Kind::Q6K,
    }
}

/// The extra-bit words `kx8::run_codes` takes of the sub-block at `sub`: q5k's
/// fifth bits; q6k's top bits of codes 0..16 and 16..32; zeros for q4k.
#[inline(always)]
pub(super) unsafe fn extra_words<const K: u8>(sub: *const u8) -> (__m256i, __m256i) {
    let word = |at: usize| _mm256_loadu_si256(sub.add(at) as *const __m256i);
    match K {
        Q5K => (word(128), _mm256_setzero_si256()),
        Q6K => (word(128), word(160)),
        _ => (_mm256_setzero_si256(), _mm256_setzero_si256()),
    }
}

// ------------------------------------------------------------------
// Activation broadcasts, late accumulators and weight-stream prefetches.

/// Four activation bytes `4k..4k+4` of a block, broadcast to all eight lanes.
#[inline(always)]
pub(super) unsafe fn act4(ba: &BlockQ8, at: usize) -> __m256i {
    _mm256_set1_epi32((ba.qs.as_ptr().add(at) as *const i32).read_unaligned())
}

/// One group block's integer sums per token and what scales them: per
/// token `dw · d` (row scales times the activation scale) and, for a type
/// with an offset (`OFFSET`, q4_1), the row offsets `m` and the token's
/// `d · Σq`.
pub(super) struct BlockSums<const T: usize> {
    pub(super) scale: [__m256; T],
    pub(super) sums: [__m256i; T],
    pub(super) m: __m256,
    pub(super) scaled_sum: [f32; T],
}

impl<const T: usize> BlockSums<T> {
    #[inline(always)]
    pub(super) unsafe fn new(dw: __m256, ba: [&BlockQ8; T], sums: [__m256i; T]) -> Self {
        let scale = std::array::from_fn(|t| _mm256_mul_ps(dw, _mm256_set1_ps(ba[t].d)));
        BlockSums { scale, sums, m: _mm256_setzero_ps(), scaled_sum: [0.0; T] }
    }
}

/// The accumulators of a group kernel, one f32 lane per row and token,
/// into which each block's [`BlockSums`] go one block late: a block's
/// float work (convert, scale, add) is issued after the next block's
/// integer work, so it no longer stalls the end of every block. It adds
/// what `scale · sums (+ m · d·Σq)` added block by block before, in the
/// same order, so the bits are the same. On a Zen 2 EPYC (kernel_speed,
/// one thread, in L2), less time per weight and token: q4_0x8 4-11% at 3
/// to 8 tokens, q4_1x8 9-12% at four and eight, mxfp4x8 8-16% at 2 to 6
/// (2% more at seven and eight); q8_0x8, and every type at one token,
/// level. The block's float work at the end of its own iteration had
/// stalled the next block's integer work. (The 512-bit instances, `ZMM_VNNI`,
/// changed the same way and were not timed: no AVX-512 on that host.)
pub(super) struct LateAcc<const T: usize, const OFFSET: bool> {
    acc: [__m256; T],
    pending: Option<BlockSums<T>>,
}

impl<const T: usize, const OFFSET: bool> LateAcc<T, OFFSET> {
    #[inline(always)]
    pub(super) unsafe fn new() -> Self {
        LateAcc { acc: [_mm256_setzero_ps(); T], pending: None }
    }

    /// Adds the block held back, if any: called before the next block's
    /// integer work (in source order: the compiler then interleaves it).
    #[inline(always)]
    pub(super) unsafe fn settle(&mut self) {
        if let Some(prev) = self.pending.take() {
            self.add(&prev);
        }
    }

    /// Holds back a block's sums until the next [`Self::settle`].
    #[inline(always)]
    pub(super) fn hold(&mut self, block: BlockSums<T>) {
        debug_assert!(self.pending.is_none(), "a block held back was never added");
        self.pending = Some(block);
    }

    #[inline(always)]
    unsafe fn add(&mut self, b: &BlockSums<T>) {
        for t in 0..T {
            self.acc[t] = _mm256_fmadd_ps(b.scale[t], _mm256_cvtepi32_ps(b.sums[t]), self.acc[t]);
            if OFFSET {
                self.acc[t] = _mm256_fmadd_ps(b.m, _mm256_set1_ps(b.scaled_sum[t]), self.acc[t]);
            }
        }
    }

    #[inline(always)]
    pub(super) unsafe fn finish(mut self) -> [__m256; T] {
        self.settle();
        self.acc
    }
}

/// How far ahead of the group block being multiplied the kernels ask for
/// weights. The hardware prefetcher stops at 4 KiB page boundaries; asking
/// four pages ahead keeps the stream going (measured on the OLMoE-width
/// q4_0 decode, one thread: 61 tok/s without, about 80 with 16 KiB; 1 and
/// 4 KiB helped less, 32 KiB no more).
pub(super) const PREFETCH_AHEAD: usize = 16 * 1024;

/// Asks for the cache lines of the `len`-byte block at `p`, [`PREFETCH_AHEAD`]
/// bytes on. The address may lie past the data: a prefetch never faults, and
/// the pointer is never dereferenced.
#[inline(always)]
pub(super) unsafe fn prefetch_ahead(p: *const u8, len: usize) {
    prefetch_by(p, PREFETCH_AHEAD, len);
}

/// How far ahead of the group block being multiplied the light one-token
/// streams ask for weights (q8_0, q4_0, q4_1, q4k: the kernels that read
/// fastest): [`PREFETCH_AHEAD`] unless `tune_streams` (`x86_64/mod.rs`) set another
/// distance for this CPU.
static ONE_TOKEN_AHEAD: AtomicUsize = AtomicUsize::new(PREFETCH_AHEAD);

/// Sets the distance of the light one-token streams (see
/// [`ONE_TOKEN_AHEAD`]); a prefetch never faults, so any value is safe.
pub(super) fn set_one_token_ahead(bytes: usize) {
    ONE_TOKEN_AHEAD.store(bytes, Ordering::Relaxed);
}

/// How far ahead a group kernel's weight stream of `T` tokens a pass asks
/// for weights: with one token through a `light` kernel (a constant at
/// every call), the distance tuned for this CPU (see `tune_streams` in
/// `x86_64/mod.rs`), else [`PREFETCH_AHEAD`]. Read once per call.
#[inline(always)]
pub(super) fn stream_ahead<const T: usize>(light: bool) -> usize {
    if T == 1 && light { ONE_TOKEN_AHEAD.load(Ordering::Relaxed) } else { PREFETCH_AHEAD }
}

/// Asks for the cache lines of the `len`-byte block at `p`, `ahead` bytes
/// on ([`stream_ahead`]); as [`prefetch_ahead`], never dereferenced.
#[inline(always)]
pub(super) unsafe fn prefetch_by(p: *const u8, ahead: usize, len: usize) {
    prefetch_lines::<_MM_HINT_T0>(p.wrapping_add(ahead), len);
}

/// Asks for the `len` bytes at `p + ahead` into L2 only, for kernels that
/// read two groups side by side (the direct 16-row kernels): two streams
/// each [`PREFETCH_AHEAD`] bytes ahead into L1 would fill its 32 KiB and
/// evict lines before their use. On a Zen 4 EPYC, one thread over a q4_0
/// matrix far past the caches, the direct kernel read 19.3 GB/s at two
/// tokens and 17.5 at three with the L1 hint, 36.6 and 28.5 with this one
/// (in L2 it computes 37.6 and 29.6: the stream no longer holds it back).
/// The 8-row kernels' one stream streamed no faster with it (Zen 3, AVX2,
/// one and two tokens). The caller chooses `ahead` (`avx512::pair_ahead`).
#[inline(always)]
pub(super) unsafe fn prefetch_ahead_l2(p: *const u8, ahead: usize, len: usize) {
    prefetch_lines::<_MM_HINT_T1>(p.wrapping_add(ahead), len);
}

/// One prefetch with hint `H` per 64-byte line of the `len` bytes at `p`.
#[inline(always)]
unsafe fn prefetch_lines<const H: i32>(p: *const u8, len: usize) {
    let mut off = 0;
    while off < len {
        _mm_prefetch::<H>(p.wrapping_add(off) as *const i8);
        off += 64;
    }
}
