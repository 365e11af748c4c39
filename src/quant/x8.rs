//! Interleaved block types: eight rows of a q8_0, q4_0 or q4_1 matrix stored
//! together, block column by block column, in the order the matrix-vector
//! kernels consume them.
//!
//! A row-major kernel reads one row, reduces 32 products to one number per
//! block, then pays a horizontal sum and a scale conversion per row block.
//! With eight rows side by side a 32-byte register holds four consecutive
//! weights of each of the eight rows (one 32-bit lane per row); multiplied by
//! four activation bytes broadcast to every lane, each lane accumulates its own
//! row, the eight scales convert with one instruction and no horizontal sum is
//! ever needed. The values are exactly those of the row type; only the byte
//! order differs, so [`pack`] and [`unpack`] are lossless.
//!
//! Layout of one group of eight rows with `nb` blocks per row: `nb` group
//! blocks, one per block column. Within a group block, `l` is the row in the
//! group (0..8) and `w[l][i]` (`c[l][i]` for 4-bit codes) the `i`-th value of
//! that row in the block (0..32):
//!
//! - q8_0x8 (272 bytes): `d[8]` f16 scales, then `qs[32·k + 4·l + i] = w[l][4k + i]`
//!   for `k` in 0..8, `i` in 0..4.
//! - q4_0x8 (144 bytes): `d[8]`, then `qs[32·j + 4·l + i] = c[l][4j + i] | c[l][16 + 4j + i] << 4`
//!   for `j` in 0..4, `i` in 0..4 (the low nibbles of a 32-byte run are
//!   columns `4j..4j+4` of every row, the high nibbles columns `16+4j..`).
//! - q4_1x8 (160 bytes): `d[8]`, `m[8]` f16 minimums, then `qs` as q4_0x8.
//! - mxfp4x8 (136 bytes): `e[8]` E8M0 exponents, then `qs` as q4_0x8.

use super::mxfp4::BlockMxfp4;
use super::q4_0::BlockQ4_0;
use super::q4_1::BlockQ4_1;
use super::q8_0::BlockQ8_0;

/// Rows per interleaved group.
pub const ROWS: usize = 8;

/// One block column of eight q8_0 rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ8_0x8 {
    /// The eight rows' scales, f16 bits.
    pub d: [u16; ROWS],
    /// Weights, four per row per 32-byte run.
    pub qs: [i8; 32 * ROWS],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0x8>() == ROWS * std::mem::size_of::<BlockQ8_0>());

/// One block column of eight q4_0 rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4_0x8 {
    /// The eight rows' scales, f16 bits.
    pub d: [u16; ROWS],
    /// Packed codes.
    pub qs: [u8; 16 * ROWS],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0x8>() == ROWS * std::mem::size_of::<BlockQ4_0>());

/// One block column of eight q4_1 rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4_1x8 {
    /// The eight rows' scales, f16 bits.
    pub d: [u16; ROWS],
    /// The eight rows' minimums, f16 bits.
    pub m: [u16; ROWS],
    /// Packed codes.
    pub qs: [u8; 16 * ROWS],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1x8>() == ROWS * std::mem::size_of::<BlockQ4_1>());

/// One block column of eight mxfp4 rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockMxfp4x8 {
    /// The eight rows' shared exponents.
    pub e: [u8; ROWS],
    /// Packed codes.
    pub qs: [u8; 16 * ROWS],
}
const _: () = assert!(std::mem::size_of::<BlockMxfp4x8>() == ROWS * std::mem::size_of::<BlockMxfp4>());

/// Position in an interleaved `qs` of value `i` (0..32) of row `l`, for the
/// byte types, and (byte index, high nibble?) for the 4-bit types.
#[inline]
fn q8_pos(l: usize, i: usize) -> usize {
    32 * (i / 4) + 4 * l + i % 4
}

#[inline]
fn q4_pos(l: usize, i: usize) -> (usize, bool) {
    let c = i % 16;
    (32 * (c / 4) + 4 * l + c % 4, i >= 16)
}

/// The 4-bit code `i` (0..32) of a row-major q4 block (low nibbles hold 0..16).
#[inline]
fn row_code(qs: &[u8; 16], i: usize) -> u8 {
    if i < 16 { qs[i] & 0xF } else { qs[i - 16] >> 4 }
}

fn put_code(qs: &mut [u8], (at, high): (usize, bool), c: u8) {
    if high {
        qs[at] = (qs[at] & 0x0F) | (c << 4);
    } else {
        qs[at] = (qs[at] & 0xF0) | c;
    }
}

fn get_code(qs: &[u8], (at, high): (usize, bool)) -> u8 {
    if high { qs[at] >> 4 } else { qs[at] & 0xF }
}

/// Puts a row-major 4-bit block's codes into row `l` of a group's codes.
fn pack_codes(group: &mut [u8; 16 * ROWS], l: usize, row: &[u8; 16]) {
    for i in 0..32 {
        put_code(group, q4_pos(l, i), row_code(row, i));
    }
}

/// Row `l`'s codes of a group, as a row-major 4-bit block's.
fn unpack_codes(group: &[u8; 16 * ROWS], l: usize) -> [u8; 16] {
    std::array::from_fn(|j| get_code(group, q4_pos(l, j)) | get_code(group, q4_pos(l, j + 16)) << 4)
}

/// The interleaved twin of a row block type.
pub trait Interleave: bytemuck::Pod {
    /// The row-major block.
    type Row: bytemuck::Pod;
    /// Builds one group block from the same block column of eight rows.
    fn pack(rows: [&Self::Row; ROWS]) -> Self;
    /// Row `l`'s block back out.
    fn unpack(&self, l: usize) -> Self::Row;
}

impl Interleave for BlockQ8_0x8 {
    type Row = BlockQ8_0;
    fn pack(rows: [&BlockQ8_0; ROWS]) -> Self {
        let mut g: Self = bytemuck::Zeroable::zeroed();
        for (l, r) in rows.iter().enumerate() {
            g.d[l] = r.d;
            for i in 0..32 {
                g.qs[q8_pos(l, i)] = r.qs[i];
            }
        }
        g
    }
    fn unpack(&self, l: usize) -> BlockQ8_0 {
        BlockQ8_0 { d: self.d[l], qs: std::array::from_fn(|i| self.qs[q8_pos(l, i)]) }
    }
}

impl Interleave for BlockQ4_0x8 {
    type Row = BlockQ4_0;
    fn pack(rows: [&BlockQ4_0; ROWS]) -> Self {
        let mut g: Self = bytemuck::Zeroable::zeroed();
        for (l, r) in rows.iter().enumerate() {
            g.d[l] = r.d;
            pack_codes(&mut g.qs, l, &r.qs);
        }
        g
    }
    fn unpack(&self, l: usize) -> BlockQ4_0 {
        BlockQ4_0 { d: self.d[l], qs: unpack_codes(&self.qs, l) }
    }
}

impl Interleave for BlockQ4_1x8 {
    type Row = BlockQ4_1;
    fn pack(rows: [&BlockQ4_1; ROWS]) -> Self {
        let mut g: Self = bytemuck::Zeroable::zeroed();
        for (l, r) in rows.iter().enumerate() {
            g.d[l] = r.d;
            g.m[l] = r.m;
            pack_codes(&mut g.qs, l, &r.qs);
        }
        g
    }
    fn unpack(&self, l: usize) -> BlockQ4_1 {
        BlockQ4_1 { d: self.d[l], m: self.m[l], qs: unpack_codes(&self.qs, l) }
    }
}

impl Interleave for BlockMxfp4x8 {
    type Row = BlockMxfp4;
    fn pack(rows: [&BlockMxfp4; ROWS]) -> Self {
        let mut g: Self = bytemuck::Zeroable::zeroed();
        for (l, r) in rows.iter().enumerate() {
            g.e[l] = r.e;
            pack_codes(&mut g.qs, l, &r.qs);
        }
        g
    }
    fn unpack(&self, l: usize) -> BlockMxfp4 {
        BlockMxfp4 { e: self.e[l], qs: unpack_codes(&self.qs, l) }
    }
}

/// Interleaves `rows` (a multiple of eight rows of `nb` blocks each, row-major)
/// into `out` (the same number of blocks' worth of bytes).
pub fn pack<G: Interleave>(rows: &[G::Row], nb: usize, out: &mut [G]) {
    debug_assert_eq!(rows.len(), out.len() * ROWS);
    for (src, dst) in rows.chunks_exact(ROWS * nb).zip(out.chunks_exact_mut(nb)) {
        for (b, g) in dst.iter_mut().enumerate() {
            *g = G::pack(std::array::from_fn(|l| &src[l * nb + b]));
        }
    }
}

/// The inverse of [`pack`].
pub fn unpack<G: Interleave>(groups: &[G], nb: usize, out: &mut [G::Row]) {
    debug_assert_eq!(out.len(), groups.len() * ROWS);
    for (src, dst) in groups.chunks_exact(nb).zip(out.chunks_exact_mut(ROWS * nb)) {
        for (b, g) in src.iter().enumerate() {
            for l in 0..ROWS {
                dst[l * nb + b] = g.unpack(l);
            }
        }
    }
}

/// Row `l` (0..8) of one group of `nb` group blocks, as row-major blocks.
pub fn unpack_row<G: Interleave>(group: &[G], l: usize, out: &mut [G::Row]) {
    for (g, o) in group.iter().zip(out.iter_mut()) {
        *o = g.unpack(l);
    }
}
