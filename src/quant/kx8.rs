//! Interleaved super-block types q4kx8, q5kx8, q6kx8: eight rows of a q4k,
//! q5k or q6k matrix ([`super::kquant`]) stored together, super-block
//! column by super-block column, in the order the eight-row kernels read
//! them (as [`super::x8`] does for the 32-value block types).
//!
//! A row-major kernel of these types sums each sub-block's 32 products
//! across a register and pays a horizontal sum per super-block. With eight
//! rows side by side each 32-bit lane of a register holds one row: four code
//! bytes of every row against four activation bytes broadcast to all lanes,
//! so a sub-block ends as eight row sums in eight lanes and the scale
//! arithmetic runs on the eight rows at once. The values are exactly those
//! of the row type; only where each bit sits differs, so [`pack`] and
//! [`unpack`] are lossless for any bytes (every code layout involved is a
//! bijection between a sub-block's bytes and its 32 codes).
//!
//! # Columns
//!
//! A group of eight rows of `n` values (`n` a multiple of 32) is
//! `⌈n/256⌉` columns back to back; column `b` holds super-block `b` of the
//! eight rows: first the eight headers (`8 · header` bytes), then per
//! sub-block `j` the eight rows' codes (`8 · chunk` bytes). A partial last
//! super-block of `s` sub-blocks gives a column of the headers and `s`
//! sub-blocks only, so a group takes exactly `8 · row_bytes(n)` bytes, the
//! size of the eight rows row-major, and every column but the last is
//! `8 · block` bytes.
//!
//! | type | column header | sub-block | full column |
//! | --- | --- | --- | --- |
//! | q4kx8 | 128 | 128 | 1152 |
//! | q5kx8 | 128 | 160 | 1408 |
//! | q6kx8 | 144 | 192 | 1680 |
//!
//! Below, `l` (0..8) is the row in the group, `j` (0..8) the sub-block,
//! `c[l][i]` the code of value `i` (0..32) of row `l` in the sub-block, and
//! for `i` the pair `r = (i mod 16) / 4` (the *run*, 0..4) and `k = i mod 4`.
//! Offsets are from the start of the column (headers) or of the sub-block
//! (codes). All fields are little-endian.
//!
//! # Headers
//!
//! q4kx8, q5kx8 (each row's 16-byte header, [`super::kquant::HeaderK`]):
//!
//! | bytes | field |
//! | --- | --- |
//! | `2l`, `2l+1` | row `l`'s `d` (f16) |
//! | `16+2l`, `17+2l` | row `l`'s `dmin` (f16) |
//! | `32 + 8j + l` | row `l`'s scale byte `j` (low four bits of `sc[j]` and, high nibble, of `m[j]`) |
//! | `96 + 4l` – `99 + 4l` | row `l`'s u32 of the scales' top bits |
//!
//! q6kx8 (each row's 18-byte header):
//!
//! | bytes | field |
//! | --- | --- |
//! | `2l`, `2l+1` | row `l`'s `d` (f16) |
//! | `16 + 8h + l` | row `l`'s `sc[h]` (i8), `h` in 0..16 |
//!
//! So one 16-byte load is the eight `d` (and the next the eight `dmin`), and
//! one 8-byte load the eight rows' scale bytes of sub-block `j` (q6k: of
//! half-sub-block `h`, so sub-block `j` is the two loads at `16 + 16j` and
//! `24 + 16j`), each widening to one 32-bit lane per row.
//!
//! # Codes of a sub-block
//!
//! | bytes | field |
//! | --- | --- |
//! | `32r + 4l + k` (0..128) | `c[l][4r+k] & 15` (low nibble) and `c[l][16+4r+k] & 15` (high nibble): q4_0x8's order |
//! | q5kx8: `128 + 4l + k` | bit `r` = bit 4 of `c[l][4r+k]`; bit `4 + r` = bit 4 of `c[l][16+4r+k]` |
//! | q6kx8: `128 + 4l + k` | bits `2r, 2r+1` = bits 4–5 of `c[l][4r+k]` |
//! | q6kx8: `160 + 4l + k` | bits `2r, 2r+1` = bits 4–5 of `c[l][16+4r+k]` |
//!
//! A 32-byte run `r` of nibbles is, per 32-bit lane `l`, codes `4r..4r+4`
//! (low nibbles) and `16+4r..` (high nibbles) of row `l`. The extra bits
//! are the rows' words side by side (the 32 extra bits of a q5k row's
//! sub-block as one u32 at `4l`; a q6k row's 64 as two), with the bits in
//! each word permuted from the row-major order so that the extra bits of
//! run `r` sit at the same bit of every byte: one shift (by `4 − r`, `r`,
//! or `4 − 2r`) and one mask put them at bit 4 of the byte whose nibble
//! they complete, for all eight rows at once. The row-major order (bit `i`
//! for code `i`) would need a byte shuffle and a compare per run instead.
//!
//! The values, the decoder and the row-major dot are those of the row type
//! ([`super::kquant`]); the eight-row kernels' operation order is
//! documented with the scalar reference,
//! [`crate::kernels::scalar::gemv8_kx8`].

use super::kquant::{self, Kind, QK, QK_K, SUBS};
use super::x8::ROWS;

/// Bytes of a column's eight headers.
pub const fn header_bytes(kind: Kind) -> usize {
    ROWS * kind.header_bytes()
}

/// Bytes of one sub-block of eight rows.
pub const fn sub_bytes(kind: Kind) -> usize {
    ROWS * kind.sub_bytes()
}

/// Bytes of a full column (eight full super-blocks).
pub const fn column_bytes(kind: Kind) -> usize {
    ROWS * kind.block_bytes()
}

/// Values per row of a group of `bytes` bytes (`None` when no row length
/// gives that size): the inverse of `8 · row_bytes(n)`.
pub fn row_len(kind: Kind, bytes: usize) -> Option<usize> {
    let full = bytes / column_bytes(kind);
    let rest = bytes % column_bytes(kind);
    let subs = match rest {
        0 => 0,
        _ if rest < header_bytes(kind) + sub_bytes(kind) => return None,
        _ if !(rest - header_bytes(kind)).is_multiple_of(sub_bytes(kind)) => return None,
        _ => (rest - header_bytes(kind)) / sub_bytes(kind),
    };
    Some(full * QK_K + subs * QK)
}

/// The columns of a group of rows of `n` values: each one's start in the
/// group and its number of sub-blocks (8 but for a partial last one).
pub fn columns(kind: Kind, n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n.div_ceil(QK_K)).map(move |b| (b * column_bytes(kind), (n - b * QK_K).min(QK_K) / QK))
}

/// Where byte `b` of row `l`'s super-block header sits in a column.
fn head_pos(kind: Kind, l: usize, b: usize) -> usize {
    match (kind, b) {
        (_, 0 | 1) => 2 * l + b,
        (Kind::Q6K, _) => 16 + 8 * (b - 2) + l,
        (_, 2 | 3) => 16 + 2 * l + (b - 2),
        (_, 4..12) => 32 + 8 * (b - 4) + l,
        _ => 96 + 4 * l + (b - 12),
    }
}

/// Byte (in an interleaved sub-block) and shift of the low four bits of
/// code `i` of row `l`.
#[inline]
fn nibble_pos(l: usize, i: usize) -> (usize, u32) {
    let c = i % 16;
    (32 * (c / 4) + 4 * l + c % 4, if i < 16 { 0 } else { 4 })
}

/// Byte (in an interleaved sub-block) and shift of the bits above the
/// nibble of code `i` of row `l` (q5k: one, q6k: two), and their mask.
#[inline]
fn high_pos(kind: Kind, l: usize, i: usize) -> (usize, u32, u8) {
    let (r, k, upper) = ((i % 16) / 4, i % 4, i >= 16);
    match kind {
        Kind::Q4K => unreachable!("q4k codes have no bits above the nibble"),
        Kind::Q5K => (128 + 4 * l + k, (r + if upper { 4 } else { 0 }) as u32, 1),
        Kind::Q6K => (128 + if upper { 32 } else { 0 } + 4 * l + k, 2 * r as u32, 3),
    }
}

/// Row `l`'s 32 codes of one interleaved sub-block (`sub_bytes(kind)` bytes).
pub fn codes(kind: Kind, sub: &[u8], l: usize) -> [u8; QK] {
    match kind {
        Kind::Q4K => codes_of::<4>(sub, l),
        Kind::Q5K => codes_of::<5>(sub, l),
        Kind::Q6K => codes_of::<6>(sub, l),
    }
}

/// [`codes`] for codes of `BITS` bits, run by run (the scalar kernel's hot
/// loop: no per-code position arithmetic).
#[inline(always)]
fn codes_of<const BITS: u32>(sub: &[u8], l: usize) -> [u8; QK] {
    let mut c = [0u8; QK];
    for r in 0..4 {
        for k in 0..4 {
            let (lo, hi) = (4 * r + k, 16 + 4 * r + k);
            let byte = sub[32 * r + 4 * l + k];
            (c[lo], c[hi]) = (byte & 0xF, byte >> 4);
            if BITS == 5 {
                let h = sub[128 + 4 * l + k];
                c[lo] |= ((h >> r) & 1) << 4;
                c[hi] |= ((h >> (4 + r)) & 1) << 4;
            } else if BITS == 6 {
                c[lo] |= ((sub[128 + 4 * l + k] >> (2 * r)) & 3) << 4;
                c[hi] |= ((sub[160 + 4 * l + k] >> (2 * r)) & 3) << 4;
            }
        }
    }
    c
}

/// Sets row `l`'s 32 codes in one interleaved sub-block.
fn put_codes(kind: Kind, sub: &mut [u8], l: usize, codes: &[u8; QK]) {
    for (i, &c) in codes.iter().enumerate() {
        let (at, s) = nibble_pos(l, i);
        sub[at] = (sub[at] & !(0xF << s)) | (c & 0xF) << s;
        if kind != Kind::Q4K {
            let (at, s, mask) = high_pos(kind, l, i);
            sub[at] = (sub[at] & !(mask << s)) | ((c >> 4) & mask) << s;
        }
    }
}

/// One row's header fields, read from a column's headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowScales {
    /// `d`, f16 bits.
    pub d: u16,
    /// `dmin`, f16 bits (0 for q6k).
    pub dmin: u16,
    /// Sub-block scales, 0..=63 (q4k, q5k: the first eight), or the scales
    /// of the sixteen half-sub-blocks, −128..=127 (q6k).
    pub sc: [i32; kquant::HALVES],
    /// Sub-block minimums, 0..=63 (0 for q6k).
    pub m: [i32; SUBS],
}

/// Row `l`'s header fields in a column whose headers are `head`.
pub fn scales(kind: Kind, head: &[u8], l: usize) -> RowScales {
    const _: () = assert!(Kind::Q6K.header_bytes() >= Kind::Q4K.header_bytes(), "q6k's header is the longest");
    let mut row = [0u8; Kind::Q6K.header_bytes()];
    for (b, v) in row.iter_mut().enumerate().take(kind.header_bytes()) {
        *v = head[head_pos(kind, l, b)];
    }
    let d = u16::from_le_bytes([row[0], row[1]]);
    if kind == Kind::Q6K {
        let sc = std::array::from_fn(|j| row[2 + j] as i8 as i32);
        return RowScales { d, dmin: 0, sc, m: [0; SUBS] };
    }
    let (sc, m) = kquant::unpack_scales(row[4..16].try_into().expect("12 bytes"));
    let sc = std::array::from_fn(|j| sc.get(j).map_or(0, |&v| v as i32));
    RowScales { d, dmin: u16::from_le_bytes([row[2], row[3]]), sc, m: m.map(i32::from) }
}

/// Writes row `l`'s super-block `row` (header and `subs` sub-blocks, row
/// major) into its places in `col` (a column of `subs` sub-blocks).
fn pack_column_row(kind: Kind, row: &[u8], subs: usize, l: usize, col: &mut [u8]) {
    let (hb, sb) = (kind.header_bytes(), kind.sub_bytes());
    for (b, &v) in row[..hb].iter().enumerate() {
        col[head_pos(kind, l, b)] = v;
    }
    for j in 0..subs {
        let codes = kquant::sub_codes(kind, &row[hb + j * sb..hb + (j + 1) * sb]);
        let at = header_bytes(kind) + j * sub_bytes(kind);
        put_codes(kind, &mut col[at..at + sub_bytes(kind)], l, &codes);
    }
}

/// Row `l`'s super-block out of a column of `subs` sub-blocks, row major
/// (`header + subs · chunk` bytes into `row`).
pub fn unpack_column_row(kind: Kind, col: &[u8], subs: usize, l: usize, row: &mut [u8]) {
    let (hb, sb) = (kind.header_bytes(), kind.sub_bytes());
    debug_assert_eq!(row.len(), hb + subs * sb);
    for (b, v) in row[..hb].iter_mut().enumerate() {
        *v = col[head_pos(kind, l, b)];
    }
    for j in 0..subs {
        let at = header_bytes(kind) + j * sub_bytes(kind);
        let codes = codes(kind, &col[at..at + sub_bytes(kind)], l);
        kquant::put_sub_codes(kind, &codes, &mut row[hb + j * sb..hb + (j + 1) * sb]);
    }
}

/// Panics unless `bytes` is whole groups of rows of `n` values.
fn check(kind: Kind, bytes: usize, n: usize) -> usize {
    let rb = kquant::row_bytes(kind, n).expect("rows of whole sub-blocks");
    assert!(rb > 0 && bytes.is_multiple_of(ROWS * rb), "{kind:?}: {bytes} bytes are not groups of rows of {n}");
    rb
}

/// Interleaves `rows` (a multiple of eight rows of `n` values, row major)
/// into `out` (as many bytes).
pub fn pack(kind: Kind, rows: &[u8], n: usize, out: &mut [u8]) {
    let rb = check(kind, rows.len(), n);
    assert_eq!(rows.len(), out.len(), "{kind:?}: pack changes no size");
    for (src, dst) in rows.chunks_exact(ROWS * rb).zip(out.chunks_exact_mut(ROWS * rb)) {
        for (b, (start, subs)) in columns(kind, n).enumerate() {
            let len = kind.header_bytes() + subs * kind.sub_bytes();
            let col = &mut dst[start..start + ROWS * len];
            for l in 0..ROWS {
                let at = l * rb + b * kind.block_bytes();
                pack_column_row(kind, &src[at..at + len], subs, l, col);
            }
        }
    }
}

/// The inverse of [`pack`].
pub fn unpack(kind: Kind, groups: &[u8], n: usize, out: &mut [u8]) {
    let rb = check(kind, groups.len(), n);
    assert_eq!(groups.len(), out.len(), "{kind:?}: unpack changes no size");
    for (src, dst) in groups.chunks_exact(ROWS * rb).zip(out.chunks_exact_mut(ROWS * rb)) {
        for l in 0..ROWS {
            unpack_row(kind, src, l, n, &mut dst[l * rb..(l + 1) * rb]);
        }
    }
}

/// Row `l` (0..8) of one group of rows of `n` values, row major (`out`:
/// `row_bytes(n)` bytes).
pub fn unpack_row(kind: Kind, group: &[u8], l: usize, n: usize, out: &mut [u8]) {
    for (b, (start, subs)) in columns(kind, n).enumerate() {
        let len = kind.header_bytes() + subs * kind.sub_bytes();
        let at = b * kind.block_bytes();
        unpack_column_row(kind, &group[start..start + ROWS * len], subs, l, &mut out[at..at + len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{self, DType};

    const KINDS: [Kind; 3] = [Kind::Q4K, Kind::Q5K, Kind::Q6K];
    const LENGTHS: [usize; 7] = [32, 96, 224, 256, 288, 1408, 2080];

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn sizes_and_row_lengths() {
        assert_eq!(KINDS.map(header_bytes), [128, 128, 144]);
        assert_eq!(KINDS.map(sub_bytes), [128, 160, 192]);
        assert_eq!(KINDS.map(column_bytes), [1152, 1408, 1680]);
        for kind in KINDS {
            for n in (32..=4096).step_by(32) {
                let g = ROWS * kquant::row_bytes(kind, n).unwrap();
                assert_eq!(row_len(kind, g), Some(n), "{kind:?} n={n}");
                assert_eq!(row_len(kind, g + 2), None, "{kind:?} n={n}");
            }
            assert_eq!(row_len(kind, 0), Some(0));
            assert_eq!(row_len(kind, header_bytes(kind)), None, "a column needs a sub-block");
        }
    }

    /// Any bytes, valid quantisations or not, survive both directions: the
    /// layout is a permutation of bits.
    #[test]
    fn pack_and_unpack_are_inverse_on_any_bytes() {
        for kind in KINDS {
            for n in LENGTHS {
                let size = 2 * ROWS * kquant::row_bytes(kind, n).unwrap();
                let rows = bytes(size, n as u64 + kind as u64);
                let mut g = vec![0u8; size];
                pack(kind, &rows, n, &mut g);
                assert_ne!(g, rows, "{kind:?} n={n}");
                let mut back = vec![0u8; size];
                unpack(kind, &g, n, &mut back);
                assert_eq!(back, rows, "{kind:?} n={n}: unpack(pack(x))");
                let rb = kquant::row_bytes(kind, n).unwrap();
                let mut one = vec![0u8; rb];
                for l in 0..ROWS {
                    unpack_row(kind, &g[ROWS * rb..], l, n, &mut one);
                    assert_eq!(one, rows[(ROWS + l) * rb..(ROWS + l + 1) * rb], "{kind:?} n={n} row {l}");
                }
                let x8 = bytes(size, 7 * n as u64 + kind as u64);
                unpack(kind, &x8, n, &mut back);
                pack(kind, &back, n, &mut g);
                assert_eq!(g, x8, "{kind:?} n={n}: pack(unpack(x))");
            }
        }
    }

    #[test]
    fn fields_sit_where_the_docs_say() {
        let at = |kind: Kind, rows: &[u8], n: usize| {
            let mut g = vec![0u8; rows.len()];
            pack(kind, rows, n, &mut g);
            g
        };
        // q4k, n = 288 (one full super-block and one sub-block): row 5's d,
        // row 6's scale byte 2, row 1's top-bit word, in column 1 too.
        let rb = kquant::row_bytes(Kind::Q4K, 288).unwrap();
        let mut rows = vec![0u8; ROWS * rb];
        rows[5 * rb..5 * rb + 2].copy_from_slice(&0xABCDu16.to_le_bytes());
        rows[6 * rb + 4 + 2] = 0x5A;
        rows[rb + 12..rb + 16].copy_from_slice(&[1, 2, 3, 4]);
        rows[2 * rb + 144 + 2] = 0x77; // row 2's dmin low byte, column 1
        let g = at(Kind::Q4K, &rows, 288);
        assert_eq!((g[10], g[11]), (0xCD, 0xAB));
        assert_eq!(g[32 + 8 * 2 + 6], 0x5A);
        assert_eq!(g[100..104], [1, 2, 3, 4]);
        assert_eq!(g[1152 + 16 + 2 * 2], 0x77);
        assert_eq!(g.iter().filter(|&&b| b != 0).count(), 8);
        // Codes: sub-block 1 of row 3, code 21 = 0b1_0110 (q5k); of row 2,
        // code 7 = 0b11_0011 (q6k).
        let mut codes = [0u8; QK];
        codes[21] = 0b1_0110;
        let rb = kquant::row_bytes(Kind::Q5K, 256).unwrap();
        let mut rows = vec![0u8; ROWS * rb];
        let sub = 3 * rb + 16 + 20;
        kquant::put_sub_codes(Kind::Q5K, &codes, &mut rows[sub..sub + 20]);
        let g = at(Kind::Q5K, &rows, 256);
        let s = &g[128 + 160..128 + 320];
        // 21 = 16 + 4·1 + 1: run 1, k = 1, high nibble; fifth bit at bit 4 + 1.
        assert_eq!((s[32 + 4 * 3 + 1], s[128 + 4 * 3 + 1]), (0x60, 1 << 5));
        assert_eq!(g.iter().filter(|&&b| b != 0).count(), 2);
        let mut codes = [0u8; QK];
        codes[7] = 0b11_0011;
        let rb = kquant::row_bytes(Kind::Q6K, 64).unwrap();
        let mut rows = vec![0u8; ROWS * rb];
        let sub = 2 * rb + 18 + 24;
        kquant::put_sub_codes(Kind::Q6K, &codes, &mut rows[sub..sub + 24]);
        // Row 4's scale 3 (sub-block 1, values 16..32).
        rows[4 * rb + 2 + 3] = 0x81;
        let g = at(Kind::Q6K, &rows, 64);
        let s = &g[144 + 192..144 + 384];
        // 7 = 4·1 + 3: run 1, k = 3, low nibble; top bits at bits 2–3.
        assert_eq!((s[32 + 4 * 2 + 3], s[128 + 4 * 2 + 3]), (0x03, 0b11 << 2));
        assert_eq!(g[16 + 8 * 3 + 4], 0x81);
        assert_eq!(g.iter().filter(|&&b| b != 0).count(), 3);
        assert_eq!(codes_of(Kind::Q6K, &g, 64, 2, 1)[7], 0b11_0011);
    }

    /// Row `l`'s codes of sub-block `j` (of the first column) of a group.
    fn codes_of(kind: Kind, g: &[u8], n: usize, l: usize, j: usize) -> [u8; QK] {
        let (_, subs) = columns(kind, n).next().unwrap();
        assert!(j < subs);
        let at = header_bytes(kind) + j * sub_bytes(kind);
        codes(kind, &g[at..at + sub_bytes(kind)], l)
    }

    /// Quantised values: the interleaved matrix decodes (whole, and row by
    /// row as embedding lookups do) to the row-major one's values, and the
    /// header accessor reads each row's fields.
    #[test]
    fn decode_and_decode_group_row_match_row_major() {
        for (dt, kind) in [(DType::Q4Kx8, Kind::Q4K), (DType::Q5Kx8, Kind::Q5K), (DType::Q6Kx8, Kind::Q6K)] {
            assert_eq!((dt.base().kquant(), dt.group_rows()), (Some(kind), ROWS));
            for n in [32, 96, 288, 1408] {
                let rows = 16;
                let x: Vec<f32> = bytes(rows * n, n as u64).iter().map(|&b| (b as f32 - 127.5) * 1e-3).collect();
                let size = dt.tensor_bytes(&[rows, n]).unwrap();
                assert_eq!(Some(size), dt.base().tensor_bytes(&[rows, n]));
                let (mut a, mut b) = (vec![0u16; size / 2], vec![0u16; size / 2]);
                quant::encode(dt, &x, n, bytemuck::cast_slice_mut(&mut a));
                quant::encode(dt.base(), &x, n, bytemuck::cast_slice_mut(&mut b));
                let (a, b): (&[u8], &[u8]) = (bytemuck::cast_slice(&a), bytemuck::cast_slice(&b));
                let (mut ya, mut yb) = (vec![0f32; rows * n], vec![0f32; rows * n]);
                quant::decode(dt, a, n, &mut ya);
                quant::decode(dt.base(), b, n, &mut yb);
                assert_eq!(ya, yb, "{dt} n={n}");
                let rb = dt.row_bytes(n).unwrap();
                let mut y = vec![0f32; n];
                for r in 0..rows {
                    let g = &a[(r / ROWS) * ROWS * rb..(r / ROWS + 1) * ROWS * rb];
                    quant::decode_group_row(dt, g, r % ROWS, &mut y);
                    assert_eq!(y, yb[r * n..(r + 1) * n], "{dt} n={n} row {r}");
                    let head = scales(kind, g, r % ROWS);
                    let row = &b[r * rb..];
                    assert_eq!(head.d, u16::from_le_bytes([row[0], row[1]]), "{dt} n={n} row {r}");
                    if kind == Kind::Q6K {
                        let sc: Vec<i32> = row[2..18].iter().map(|&v| v as i8 as i32).collect();
                        assert_eq!(head.sc[..], sc[..], "{dt} n={n} row {r}");
                    } else {
                        let (sc, m) = kquant::unpack_scales(row[4..16].try_into().unwrap());
                        assert_eq!((&head.sc[..8], head.m), (&sc.map(i32::from)[..], m.map(i32::from)));
                        assert!(head.sc[8..].iter().all(|&v| v == 0));
                    }
                }
            }
        }
    }
}
