//! Sixteen weight rows (two interleaved groups) repacked once per prefill
//! call into the layout the 16-row kernels read: for every block column,
//! eight 64-byte rows, row `k` holding weights `4k..4k+4` of each of the
//! sixteen rows as signed bytes (the interleaved groups already hold them
//! so, eight rows at a time; 4-bit codes are widened to bytes: q4_0 as
//! `c − 8`, mxfp4 through its value table; the super-block types' 4-, 5- and
//! 6-bit codes as `c`, `c` and `c − 32`, one block column per sub-block),
//! with the row scales (and minimums) as f32. That is the AMX tile unit's B
//! layout (`amx.rs`), and one 64-byte row is one 512-bit register of sixteen
//! 32-bit lanes, one per weight row (`avx512.rs`).
#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;
use std::cell::RefCell;

use crate::quant::act::BlockQ8;
use crate::quant::mxfp4::{LUT2, half_scale};
use crate::quant::x8::{BlockMxfp4x8, BlockQ4_0x8, BlockQ4_1x8, BlockQ8_0x8, ROWS as GROUP};

/// Weight rows of one packed pair: two groups.
pub const ROWS: usize = 2 * GROUP;
/// Bytes of one packed block column: 32 weights of each of the 16 rows.
pub const PACKED: usize = 32 * ROWS;

/// One call's weights in the B layout, with their scales (and minimums) as
/// f32: per block column `w[512 b..]`, `scales[16 b..]`, `mins[16 b..]`;
/// and a zero-padded copy of a last, partial tile of tokens.
#[derive(Default)]
pub struct Packed {
    pub w: Vec<i8>,
    pub scales: Vec<f32>,
    pub mins: Vec<f32>,
    pub pad: Vec<BlockQ8>,
}

impl Packed {
    /// Room for `nb` block columns (kept between calls: no clearing, every
    /// byte a call reads is written by its packing).
    pub(super) fn reserve(&mut self, nb: usize) {
        if self.w.len() < nb * PACKED {
            self.w.resize(nb * PACKED, 0);
            self.scales.resize(nb * ROWS, 0.0);
            self.mins.resize(nb * ROWS, 0.0);
        }
    }

    /// Half `h` of block column `b` as zeros (no second group).
    pub(super) fn zero(&mut self, b: usize, h: usize) {
        for k in 0..8 {
            let at = b * PACKED + 64 * k + 32 * h;
            self.w[at..at + 32].fill(0);
        }
        let at = ROWS * b + GROUP * h;
        self.scales[at..at + GROUP].fill(0.0);
        self.mins[at..at + GROUP].fill(0.0);
    }
}

thread_local! {
    /// Per-thread repacking buffer, grown to the widest matrix seen.
    pub static PACK: RefCell<Packed> = RefCell::new(Packed::default());
}

/// Where one group block goes in the packed buffers: its half of a block
/// column's B rows (`w`, rows 64 bytes apart), its eight scales and its
/// eight minimums.
pub struct Dest {
    w: *mut i8,
    scales: *mut f32,
    mins: *mut f32,
}

/// Eight f16 values as f32.
#[inline(always)]
unsafe fn f16x8(d: &[u16; GROUP], out: *mut f32) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr() as *const __m128i)));
}

/// Widens a group block's 4-bit codes into B rows: low nibbles of run `j`
/// are weights `4j..4j+4` of each row (B row `j`), high nibbles weights
/// `16 + 4j..` (B row `4 + j`), each code through `value` (32 at a time).
#[inline(always)]
unsafe fn unpack_codes(qs: &[u8; 16 * GROUP], w: *mut i8, value: impl Fn(__m256i) -> __m256i) {
    let mask = _mm256_set1_epi8(0x0F);
    for j in 0..4 {
        let raw = _mm256_loadu_si256(qs.as_ptr().add(32 * j) as *const __m256i);
        let lo = _mm256_and_si256(raw, mask);
        let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        _mm256_storeu_si256(w.add(64 * j) as *mut __m256i, value(lo));
        _mm256_storeu_si256(w.add(64 * (4 + j)) as *mut __m256i, value(hi));
    }
}

/// The interleaved types the 16-row kernels take: how a call's groups are
/// checked and packed, and how a token's block column is scaled into its
/// accumulator. The 32-value block types implement it through
/// [`GroupBlock`]; the super-block types in `kx8.rs`.
pub trait TileBlock {
    /// Whether a block column has minimums (`mins` is read).
    const MINS: bool;

    /// Bytes of a group of eight rows of `nb` block columns (32 values).
    fn group_bytes(nb: usize) -> usize;

    /// Packs one or two whole groups (`groups`, rows of `nb` block columns)
    /// into `p`; a missing second group packs as zeros.
    ///
    /// # Safety
    /// AVX2 and F16C; `groups` passed [`check`] with this `nb`.
    unsafe fn pack(p: &mut Packed, groups: &[u8], nb: usize);

    /// One token's block column into its accumulator, in the operation
    /// order of the type's 8-row kernels. `isum` is the exact `Σ w · a` of
    /// each row (over the packed signed bytes); `scales` from
    /// [`column_scales`].
    ///
    /// # Safety
    /// AVX-512F must be available.
    unsafe fn scale_token(acc: __m512, scales: (__m512, __m512), ba: &BlockQ8, isum: __m512i) -> __m512;
}

/// The 32-value interleaved block types: one group block per block column.
pub trait GroupBlock: bytemuck::Pod {
    /// Whether the type adds `min · Σ activations` per block (q4_1).
    const MINS: bool;
    /// Writes this group block to `to` as signed bytes and f32 scales.
    ///
    /// # Safety
    /// AVX2 and F16C; `to` points into buffers with room for a block column.
    unsafe fn pack(&self, to: &Dest);
}

impl<B: GroupBlock> TileBlock for B {
    const MINS: bool = <B as GroupBlock>::MINS;

    fn group_bytes(nb: usize) -> usize {
        nb * std::mem::size_of::<B>()
    }

    #[inline(always)]
    unsafe fn pack(p: &mut Packed, groups: &[u8], nb: usize) {
        pack_blocks::<B>(p, bytemuck::cast_slice(groups), nb);
    }

    /// `acc + (dw · da) · isum`, then q4_1's `m · (da · Σa)`, the AVX2
    /// group kernels' operations in their order (so the 16-row kernels give
    /// their bits).
    #[inline(always)]
    unsafe fn scale_token(acc: __m512, (dw, m): (__m512, __m512), ba: &BlockQ8, isum: __m512i) -> __m512 {
        let s = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(ba.d)), _mm512_cvtepi32_ps(isum), acc);
        if <B as GroupBlock>::MINS { _mm512_fmadd_ps(m, _mm512_set1_ps(ba.scaled_sum()), s) } else { s }
    }
}

impl GroupBlock for BlockQ8_0x8 {
    const MINS: bool = false;
    #[inline(always)]
    unsafe fn pack(&self, to: &Dest) {
        for k in 0..8 {
            let v = _mm256_loadu_si256(self.qs.as_ptr().add(32 * k) as *const __m256i);
            _mm256_storeu_si256(to.w.add(64 * k) as *mut __m256i, v);
        }
        f16x8(&self.d, to.scales);
    }
}

impl GroupBlock for BlockQ4_0x8 {
    const MINS: bool = false;
    #[inline(always)]
    unsafe fn pack(&self, to: &Dest) {
        // Codes are stored +8: the tile sums Σ (c − 8)·q directly.
        let eight = _mm256_set1_epi8(8);
        unpack_codes(&self.qs, to.w, |c| _mm256_sub_epi8(c, eight));
        f16x8(&self.d, to.scales);
    }
}

impl GroupBlock for BlockQ4_1x8 {
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn pack(&self, to: &Dest) {
        unpack_codes(&self.qs, to.w, |c| c);
        f16x8(&self.d, to.scales);
        f16x8(&self.m, to.mins);
    }
}

impl GroupBlock for BlockMxfp4x8 {
    const MINS: bool = false;
    #[inline(always)]
    unsafe fn pack(&self, to: &Dest) {
        let lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(LUT2.as_ptr() as *const __m128i));
        unpack_codes(&self.qs, to.w, |c| _mm256_shuffle_epi8(lut, c));
        for (l, &e) in self.e.iter().enumerate() {
            *to.scales.add(l) = half_scale(e);
        }
    }
}

/// Packs one or two whole groups of `B` (`blocks`, `nb` block columns each)
/// into `p`; a missing second group packs as zeros.
///
/// # Safety
/// AVX2 and F16C must be available.
#[inline(always)]
unsafe fn pack_blocks<B: GroupBlock>(p: &mut Packed, blocks: &[B], nb: usize) {
    let ng = blocks.len() / nb;
    p.reserve(nb);
    for (h, g) in blocks.chunks_exact(nb).enumerate() {
        for (b, blk) in g.iter().enumerate() {
            // The packing is the first touch of the weights: ask for them
            // ahead, as the vector kernels do.
            super::prim::prefetch_ahead(blk as *const B as *const u8, std::mem::size_of::<B>());
            let at = ROWS * b + GROUP * h;
            let to = Dest {
                w: p.w.as_mut_ptr().add(b * PACKED + 32 * h),
                scales: p.scales.as_mut_ptr().add(at),
                mins: p.mins.as_mut_ptr().add(at),
            };
            blk.pack(&to);
        }
    }
    if ng == 1 {
        (0..nb).for_each(|b| p.zero(b, 1));
    }
}

/// Block column `b`'s sixteen row scales and (q4_1) minimums, zero
/// otherwise, for [`scale_token`].
///
/// # Safety
/// AVX-512F must be available; `b` is a packed block column of `p`.
#[inline(always)]
pub unsafe fn column_scales<B: TileBlock>(p: &Packed, b: usize) -> (__m512, __m512) {
    let dw = _mm512_loadu_ps(p.scales.as_ptr().add(ROWS * b));
    let m = if B::MINS { _mm512_loadu_ps(p.mins.as_ptr().add(ROWS * b)) } else { _mm512_setzero_ps() };
    (dw, m)
}

/// One or two whole groups of `B` into `p` ([`TileBlock::pack`]).
///
/// # Safety
/// As [`TileBlock::pack`].
#[inline(always)]
pub unsafe fn pack<B: TileBlock>(p: &mut Packed, groups: &[u8], nb: usize) {
    B::pack(p, groups, nb)
}

/// One token's block column into its accumulator ([`TileBlock::scale_token`]).
///
/// # Safety
/// AVX-512F must be available.
#[inline(always)]
pub unsafe fn scale_token<B: TileBlock>(acc: __m512, scales: (__m512, __m512), ba: &BlockQ8, isum: __m512i) -> __m512 {
    B::scale_token(acc, scales, ba, isum)
}

/// Checks a 16-row kernel's arguments (`q` as `[tokens, nb]` with `nb > 0`,
/// `groups` one or two whole groups of `B`, `out` as `[tokens, 16]`) and
/// returns `nb`, the block columns (32 values) of a row.
pub fn check<B: TileBlock>(groups: &[u8], q: &[BlockQ8], tokens: usize, out: &[f32]) -> usize {
    assert!(tokens > 0, "16-row kernels need at least one token");
    let nb = q.len() / tokens;
    assert_eq!(q.len(), tokens * nb, "q is not [tokens, nb]");
    let gb = if nb > 0 { B::group_bytes(nb) } else { 0 };
    let ng = groups.len().checked_div(gb).unwrap_or(0);
    assert!((ng == 1 || ng == 2) && groups.len() == ng * gb, "16-row kernels take one or two whole groups");
    assert_eq!(out.len(), tokens * ROWS, "out is not [tokens, 16]");
    nb
}
