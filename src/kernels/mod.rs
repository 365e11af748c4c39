//! Matrix kernels: `y = W · x` for every weight type, split across threads.
//!
//! Model code calls [`matmul`] (or [`matmul_many`]) with [`Matrix`] views and
//! an [`Input`], and never names a dtype or an ISA. The dot product for each
//! dtype comes from a [`Table`] chosen once at start-up by run-time feature
//! detection: AVX2+FMA+F16C on x86_64 (with AVX-VNNI, AVX-512 attention
//! kernels, and AMX tiles for prefill, where the CPU and OS have them), NEON
//! on aarch64, the scalar reference everywhere else;
//! `COLIBRI_ISA=scalar|avx2|avxvnni|avx512|amx|neon` asks for one (a table
//! this CPU cannot run is refused with a note on stderr, and the best one is
//! used). Each table gives
//! every weight type its [`TypeKernels`] by an exhaustive `match` over
//! [`DType`], so a type without kernels does not compile.
//!
//! Block-quantised weights are multiplied with the activation quantised to
//! 8 bits ([`BlockQ8`]); an [`Input`] carries both forms so one quantisation
//! serves every matrix that reads the same activation (q, k and v; the K
//! experts' gate and up projections).
//!
//! Interleaved types (`q8_0x8`, ..., see [`crate::quant::x8`]; the
//! super-block types' `q4kx8`, ..., [`crate::quant::kx8`]) are multiplied
//! eight rows at a time by group kernels ([`GroupKernels`]), for one token or
//! up to eight per call (eight or four per weight load, by type and table);
//! row-major types go one row at a time (four tokens per weight load for the
//! block types).
//!
//! Work is split by output rows only (never one dot product across threads;
//! whole 8-row groups for interleaved types), so results do not depend on the
//! thread count.

#[cfg(target_arch = "aarch64")]
mod aarch64;
mod delta;
pub mod heads;
pub mod scalar;
mod table;
#[cfg(target_arch = "x86_64")]
mod x86_64;

use rayon::prelude::*;

use crate::quant::DType;
use crate::quant::act::BlockQ8;

/// A dot product of one weight row (raw bytes of its dtype) with an
/// activation row given both as f32 and, for block types, quantised.
pub type DotFn = fn(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32;

/// Quantises activation rows (a multiple of 32 values) into [`BlockQ8`]s.
pub type QuantizeFn = fn(x: &[f32], out: &mut [BlockQ8]);

/// One weight row against four activation rows (block types only).
pub type Dot4Fn = fn(row: &[u8], q: [&[BlockQ8]; 4]) -> [f32; 4];

/// Up to [`KV_QUERIES`] query rows `x` against `nk` KV-cache key rows given
/// as the raw bytes of their f32 or f16 values, key `j` starting at element
/// `j · ks` of `k`: `out[q · os + j] = key_j · x[q]`. Per (query, key) the
/// same bits whatever the numbers of queries and keys (decode passes one
/// query).
pub type DotsFn = fn(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize);

/// `o[i] += a[i] · v` for up to [`KV_QUERIES`] rows `o` (`[a.len(), len]`)
/// and one KV-cache row `v`; per row the same bits whatever the number of rows.
pub type AxpysFn = fn(o: &mut [f32], a: &[f32], v: &[u8]);

/// `o[i] += Σ_j p[i·ps + j] · v_j` for up to [`KV_QUERIES`] rows `o`
/// (`[n, len]`, n = ⌈p.len() / ps⌉) and `nk` value rows, `v_j` starting at
/// element `j · vs` of `v`: the same bits as `nk` [`AxpysFn`] calls, key by
/// key, with the sums kept in registers across the keys.
pub type PvFn = fn(o: &mut [f32], p: &[f32], ps: usize, v: &[u8], vs: usize, nk: usize);

/// Most queries one [`DotsFn`], [`AxpysFn`] or [`PvFn`] call takes.
pub const KV_QUERIES: usize = 8;

/// The attention kernels of a KV-cache element type: each key and value row
/// is read once for up to eight queries.
#[derive(Clone, Copy)]
pub struct KvKernels {
    /// Scores.
    pub dots: DotsFn,
    /// Value accumulation, one key.
    pub axpys: AxpysFn,
    /// Value accumulation, a run of keys every query sees.
    pub pv: PvFn,
}

/// One token of the gated delta rule for one head (Gated DeltaNet; KDA):
/// with `dk = k.len() = q.len()`, `dv = v.len() = out.len()` and the head's
/// f32 state `s` row-major `[dk, dv]` (row `i` is key channel `i`),
/// `S' = S · decay_i`, `delta = (v − S'ᵀ k) · beta`, `S = S' + k ⊗ delta`
/// (written back into `s`), `out = Sᵀ q`. `decay` holds one multiplier for
/// the whole head (Gated DeltaNet) or one per key channel (KDA), already
/// `exp(g)`; `k` and `q` come l2-normalised (q also scaled), `beta` after
/// its sigmoid. The state is read from memory once and written once; the
/// sums run over the key channels in a fixed order, so the result depends
/// on the inputs only (the caller runs heads in parallel).
pub type DeltaFn = fn(s: &mut [f32], decay: &[f32], k: &[f32], v: &[f32], beta: f32, q: &[f32], out: &mut [f32]);

/// One token of Mamba2's scan for one head: with the head's f32 state `s`
/// row-major `[N, P]` (row `i` is state channel `i`), `b` and `c` `[N]`,
/// `x` and `out` `[P]`, `S[i] = S[i] · decay + (dt · b_i) · x` (written
/// back into `s`) and `out = Σ_i S[i] · c_i + d · x`. The sum runs over the
/// state channels in order, so the result depends on the inputs only (the
/// caller runs heads in parallel).
pub type SsmFn = fn(s: &mut [f32], decay: f32, dt: f32, b: &[f32], x: &[f32], c: &[f32], d: f32, out: &mut [f32]);

/// Eight interleaved rows (one group of an interleaved type) against one
/// activation row: the eight outputs.
pub type Gemv8Fn = fn(group: &[u8], q: &[BlockQ8]) -> [f32; 8];

/// Eight interleaved rows against 1 to [`GEMM8_TOKENS`] activation rows
/// (`q.len()`, the same as `out.len()`), reading the weights once per run of
/// as many tokens as the kernel holds in registers (eight for the 4-bit
/// types in the AVX2 and AVX-VNNI tables; four for q8_0, the super-block
/// types and the AVX-512 kernels); per (row, token) the same bits as
/// [`Gemv8Fn`].
pub type Gemm8Fn = fn(group: &[u8], q: &[&[BlockQ8]], out: &mut [[f32; 8]]);

/// Most tokens one [`Gemm8Fn`] call takes.
pub const GEMM8_TOKENS: usize = 8;

/// One or two interleaved groups (8 or 16 rows, `group` holding whole
/// groups) against `tokens` activation rows (`q` is `[tokens, cols / 32]`),
/// into `out` (`[tokens, TILE_ROWS]`, token major; the rows past one group
/// come out zero). Per (row, token) the same bits as [`Gemv8Fn`].
pub type TileFn = fn(group: &[u8], q: &[BlockQ8], tokens: usize, out: &mut [f32]);

/// The weight rows of one [`TileFn`] call at most: two groups.
pub const TILE_ROWS: usize = 16;

/// A kernel over 16 rows ([`TileFn`]) and the fewest tokens it takes.
#[derive(Clone, Copy)]
pub struct Tiles {
    /// The kernel (any number of tokens).
    pub f: TileFn,
    /// Fewest tokens worth a call (the tiles repack the weights first; the
    /// direct kernels do not, but a call for one token streams worse than
    /// the 8-row kernel); fewer go to the 8-row kernels.
    pub min: usize,
}

/// The kernels of one interleaved type.
#[derive(Clone, Copy)]
pub struct GroupKernels {
    /// One token.
    pub one: Gemv8Fn,
    /// Up to [`GEMM8_TOKENS`] tokens (`None`: single calls).
    pub many: Option<Gemm8Fn>,
    /// Sixteen-row kernels for prefill (AMX tiles, AVX-512 VNNI; `None`:
    /// the 8-row kernels do all tokens).
    pub tile: Option<Tiles>,
    /// Sixteen rows read straight from two groups, without the tiles'
    /// repack, from its `min` tokens on (up to the tiles' `min` where there
    /// are tiles); `None`: the 8-row kernels or the tiles take them.
    pub direct: Option<Tiles>,
}

/// The form of the [`Input`] a weight type's kernels read: the activation
/// rows as f32, or quantised to 8 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// The f32 rows as they are (element types).
    F32,
    /// The rows quantised to [`BlockQ8`] (block types). In every table this
    /// is exactly the types with [`DType::is_quantized`] (tested), which is
    /// what callers of [`Input::prepare`] go by.
    Q8,
}

/// How a weight type's rows are stored, with the kernels for that layout.
#[derive(Clone, Copy)]
pub enum Layout {
    /// Row-major: one dot per (row, token).
    Rows {
        /// One row against one token.
        dot: DotFn,
        /// One row against four tokens, the same bits as four `dot`s
        /// (block types; `None`: four single dots).
        tile: Option<Dot4Fn>,
        /// Up to [`KV_QUERIES`] tokens against a run of rows, in register
        /// tiles of several rows by several tokens, the same bits as `dot`
        /// per (row, token): the attention score kernel, with weight rows
        /// as keys (element types; `None`: single dots).
        dots: Option<DotsFn>,
    },
    /// Interleaved in groups of eight rows ([`crate::quant::x8`]).
    Groups(GroupKernels),
}

/// One weight type's entry in a kernel table (ggml's `type_traits_cpu`).
#[derive(Clone, Copy)]
pub struct TypeKernels {
    /// The form of the input the kernels multiply against.
    pub input: InputKind,
    /// The storage layout and its kernels.
    pub layout: Layout,
    /// Attention over rows of this type (the KV cache's types: f32 and f16;
    /// `None` for the others).
    pub kv: Option<KvKernels>,
}

pub use table::{Isa, Table};

/// The table in use (decided on first use; see [`Table`] and `COLIBRI_ISA`).
pub fn table() -> Table {
    table::active()
}

/// The instruction set in use (decided on first use).
pub fn isa() -> Isa {
    table().isa()
}

/// How far ahead (bytes) the light one-token weight streams prefetch on
/// this CPU (x86_64; set with the table, `COLIBRI_PREFETCH` overrides it),
/// `None` on other architectures.
pub fn one_token_prefetch() -> Option<usize> {
    table();
    #[cfg(target_arch = "x86_64")]
    return Some(x86_64::one_token_ahead());
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The kernels the current table has for `dtype`.
pub fn kernels(dtype: DType) -> TypeKernels {
    table().kernels(dtype)
}

/// The active table's delta-rule step (see [`DeltaFn`]).
pub fn delta_fn() -> DeltaFn {
    table().delta_fn()
}

/// The active table's Mamba2 step (see [`SsmFn`]).
pub fn ssm_fn() -> SsmFn {
    table().ssm_fn()
}

/// The attention kernels for a KV cache of `dtype` (f32 or f16; `None` for
/// other types).
pub fn kv_fns(dtype: DType) -> Option<KvKernels> {
    kernels(dtype).kv
}

/// The kernels for an interleaved `dtype` (`None` for row-major types).
pub fn group_fns(dtype: DType) -> Option<GroupKernels> {
    match kernels(dtype).layout {
        Layout::Groups(k) => Some(k),
        Layout::Rows { .. } => None,
    }
}

/// A borrowed `[rows, cols]` weight matrix, row-major, in any storage type.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    /// Storage type of the rows.
    pub dtype: DType,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// `rows * row_bytes(cols)` bytes, aligned for the element type.
    pub bytes: &'a [u8],
}

impl<'a> Matrix<'a> {
    /// Wraps `bytes` as a `[rows, cols]` matrix of `dtype`; `None` if the
    /// length or alignment does not fit.
    pub fn new(dtype: DType, rows: usize, cols: usize, bytes: &'a [u8]) -> Option<Matrix<'a>> {
        let want = dtype.tensor_bytes(&[rows, cols])?;
        (bytes.len() == want && (bytes.as_ptr() as usize).is_multiple_of(dtype.align())).then_some(Matrix {
            dtype,
            rows,
            cols,
            bytes,
        })
    }

    fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols).expect("checked in new")
    }

    /// Rows `start..start + n` as a matrix of their own (one head of a
    /// stacked per-head tensor). `start` and `n` must be whole row groups of
    /// an interleaved type (the converter stores such tensors interleaved only then).
    pub fn row_range(&self, start: usize, n: usize) -> Matrix<'a> {
        let g = self.dtype.group_rows();
        assert!(start.is_multiple_of(g) && n.is_multiple_of(g) && start + n <= self.rows, "row range off the groups");
        let rb = self.row_bytes();
        Matrix { dtype: self.dtype, rows: n, cols: self.cols, bytes: &self.bytes[start * rb..(start + n) * rb] }
    }

    /// Decodes row `r` into `out` (length `cols`), e.g. an embedding lookup.
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        let g = self.dtype.group_rows();
        if g > 1 {
            let start = (r / g) * g * rb;
            crate::quant::decode_group_row(self.dtype, &self.bytes[start..start + g * rb], r % g, out);
        } else {
            crate::quant::decode(self.dtype, &self.bytes[r * rb..(r + 1) * rb], self.cols, out);
        }
    }
}

/// The activation rows a matmul reads: `[n, cols]` f32 and, when `cols` is a
/// multiple of 32 and some weight needs it, the same rows quantised.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    /// `[n, cols]` f32.
    pub x: &'a [f32],
    /// `[n, cols / 32]` quantised blocks (empty when not prepared).
    pub q: &'a [BlockQ8],
    /// Row length.
    pub cols: usize,
}

impl<'a> Input<'a> {
    /// Rows as they are, without a quantised copy (enough for f32/bf16/f16 weights).
    pub fn plain(x: &'a [f32], cols: usize) -> Input<'a> {
        Input { x, q: &[], cols }
    }

    /// Quantises `x` into `buf` (when `quantize` and `cols` is a whole number
    /// of blocks) and returns the input over both. `buf` needs `x.len() / 32` blocks.
    pub fn prepare(x: &'a [f32], cols: usize, quantize: bool, buf: &'a mut [BlockQ8]) -> Input<'a> {
        if !quantize || !cols.is_multiple_of(32) {
            return Input::plain(x, cols);
        }
        let nb = x.len() / 32;
        let q = &mut buf[..nb];
        (table().quantize_fn())(x, q);
        Input { x, q, cols }
    }

    fn rows(&self) -> usize {
        self.x.len() / self.cols
    }

    #[inline]
    fn row(&self, t: usize) -> (&[f32], &[BlockQ8]) {
        let x = &self.x[t * self.cols..(t + 1) * self.cols];
        let nb = self.cols / 32;
        let q = if self.q.is_empty() { &[][..] } else { &self.q[t * nb..(t + 1) * nb] };
        (x, q)
    }
}

fn check(w: &Matrix, k: &TypeKernels, inp: &Input, y: &[f32]) -> usize {
    assert_eq!(inp.cols, w.cols, "matmul: input width {} vs matrix cols {}", inp.cols, w.cols);
    let n = inp.rows();
    assert_eq!(y.len(), n * w.rows, "matmul: y is not [n, rows]");
    let q8 = k.input == InputKind::Q8;
    assert!(!q8 || inp.q.len() == n * w.cols / 32, "matmul: {} weights need a quantised input", w.dtype);
    n
}

/// Rows `r0..r1` of `W · x` for every input row, into `y` (`[n, rows]`).
/// With several input rows and a tile kernel, four input rows share each
/// weight block load (the row stays in L1 across the token loop anyway; the
/// tile saves the unpacking).
fn rows_into(w: &Matrix, k: &TypeKernels, inp: &Input, r0: usize, r1: usize, y: YOut) {
    let (dot, tile) = match k.layout {
        Layout::Rows { dots: Some(dots), .. } => return elems_into(w, inp, dots, r0, r1, y),
        Layout::Rows { dot, tile, dots: None } => (dot, tile),
        Layout::Groups(g) => return groups_into(w, inp, g, r0, r1, y),
    };
    let rb = w.row_bytes();
    let n = inp.rows();
    let tile = if n >= 4 { tile } else { None };
    for r in r0..r1 {
        let row = &w.bytes[r * rb..(r + 1) * rb];
        let mut t = 0;
        if let Some(tile) = tile {
            while t + 4 <= n {
                let q = [inp.row(t).1, inp.row(t + 1).1, inp.row(t + 2).1, inp.row(t + 3).1];
                for (k, v) in tile(row, q).into_iter().enumerate() {
                    y.set((t + k) * w.rows + r, v);
                }
                t += 4;
            }
        }
        while t < n {
            let (x, q) = inp.row(t);
            y.set(t * w.rows + r, dot(row, x, q));
            t += 1;
        }
    }
}

/// Rows one [`DotsFn`] call of [`elems_into`] takes at most (its output
/// lives on the stack: 8 KiB).
const ELEM_ROWS: usize = 256;

/// Bytes of weight rows one [`DotsFn`] call of [`elems_into`] takes: the
/// rows stay in L1 while each token's activations stream past them.
const ELEM_RUN_BYTES: usize = 24 * 1024;

/// Tokens whose activations [`elems_into`] keeps hot while it runs through
/// the task's rows (64 tokens of 2048 f32 values: 512 KiB, in L2).
const ELEM_TOKENS: usize = 64;

/// [`rows_into`] for an element type with a [`DotsFn`]: rows `r0..r1` in
/// runs of up to [`ELEM_ROWS`], against the tokens [`KV_QUERIES`] at a
/// time, [`ELEM_TOKENS`] tokens per sweep of the rows.
fn elems_into(w: &Matrix, inp: &Input, dots: DotsFn, r0: usize, r1: usize, y: YOut) {
    let rb = w.row_bytes();
    let n = inp.rows();
    // One token (decode) streams every row once anyway: whole runs. Else
    // rows that stay in L1, a multiple of twelve or else of three where it
    // can be (the register tiles take three or four rows).
    let run = if n == 1 { ELEM_ROWS } else { (ELEM_RUN_BYTES / rb).clamp(1, ELEM_ROWS) };
    let run = match run {
        12.. => run / 12 * 12,
        3.. => run / 3 * 3,
        _ => run,
    };
    let mut out = [0f32; KV_QUERIES * ELEM_ROWS];
    for t0 in (0..n).step_by(ELEM_TOKENS) {
        let t1 = (t0 + ELEM_TOKENS).min(n);
        for ra in (r0..r1).step_by(run) {
            let nr = run.min(r1 - ra);
            let rows = &w.bytes[ra * rb..(ra + nr) * rb];
            for t in (t0..t1).step_by(KV_QUERIES) {
                let nt = KV_QUERIES.min(t1 - t);
                let x: [&[f32]; KV_QUERIES] = std::array::from_fn(|i| inp.row((t + i).min(n - 1)).0);
                dots(rows, w.cols, nr, &x[..nt], &mut out, ELEM_ROWS);
                for (i, o) in out.chunks_exact(ELEM_ROWS).take(nt).enumerate() {
                    for (j, v) in o[..nr].iter().enumerate() {
                        y.set((t + i) * w.rows + ra + j, *v);
                    }
                }
            }
        }
    }
}

/// [`rows_into`] for an interleaved type: `r0` and `r1` are multiples of 8.
/// With 16-row kernels and at least [`Tiles::min`] tokens, pairs of groups
/// take every token on them (up to [`TILE_BATCH`] tokens per call, which
/// repacks the pair once); else each group of eight rows takes the tokens
/// [`GEMM8_TOKENS`] at a time (a last single one by the one-token kernel).
/// Every path gives the same bits per (row, token).
fn groups_into(w: &Matrix, inp: &Input, k: GroupKernels, r0: usize, r1: usize, y: YOut) {
    const G: usize = crate::quant::x8::ROWS;
    debug_assert!(r0.is_multiple_of(G) && r1.is_multiple_of(G));
    let gb = G * w.row_bytes();
    let n = inp.rows();
    let put = |t: usize, g: usize, v: [f32; G]| y.set_run(t * w.rows + g * G, &v);
    let tiled = match (k.tile, k.direct) {
        (Some(tiles), _) if n >= tiles.min => {
            tiles_into(w, inp, tiles.f, n, r0, r1, y);
            n
        }
        (_, Some(direct)) if n >= direct.min => {
            tiles_into(w, inp, direct.f, n, r0, r1, y);
            n
        }
        _ => 0,
    };
    for g in r0 / G..r1 / G {
        let group = &w.bytes[g * gb..(g + 1) * gb];
        let mut t = tiled;
        while t < n {
            let m = (n - t).min(GEMM8_TOKENS);
            match k.many {
                Some(many) if m > 1 => {
                    let q: [&[BlockQ8]; GEMM8_TOKENS] = std::array::from_fn(|i| inp.row((t + i).min(n - 1)).1);
                    let mut out = [[0f32; G]; GEMM8_TOKENS];
                    many(group, &q[..m], &mut out[..m]);
                    for (i, v) in out[..m].iter().enumerate() {
                        put(t + i, g, *v);
                    }
                    t += m;
                }
                _ => {
                    put(t, g, (k.one)(group, inp.row(t).1));
                    t += 1;
                }
            }
        }
    }
}

/// Most tokens one [`TileFn`] call of [`tiles_into`] takes (its output
/// lives on the stack: 8 KiB).
const TILE_BATCH: usize = 128;

/// The first `n` tokens of rows `r0..r1` (whole groups) on `tile`.
fn tiles_into(w: &Matrix, inp: &Input, tile: TileFn, n: usize, r0: usize, r1: usize, y: YOut) {
    const G: usize = crate::quant::x8::ROWS;
    let gb = G * w.row_bytes();
    let nb = w.cols / 32;
    let mut out = [0f32; TILE_BATCH * TILE_ROWS];
    let mut g = r0 / G;
    while g < r1 / G {
        let pair = (r1 / G - g).min(TILE_ROWS / G);
        let groups = &w.bytes[g * gb..(g + pair) * gb];
        let mut t = 0;
        while t < n {
            let m = (n - t).min(TILE_BATCH);
            tile(groups, &inp.q[t * nb..(t + m) * nb], m, &mut out[..m * TILE_ROWS]);
            for (i, o) in out[..m * TILE_ROWS].as_chunks::<TILE_ROWS>().0.iter().enumerate() {
                let at = (t + i) * w.rows + g * G;
                match o.first_chunk::<G>() {
                    Some(one) if pair == 1 => y.set_run(at, one),
                    _ => y.set_run(at, o),
                }
            }
            t += m;
        }
        g += pair;
    }
}

/// Where a task writes its results: a raw pointer to a `[n, rows]` output.
#[derive(Clone, Copy)]
struct YOut(*mut f32, usize);

// SAFETY: `YOut` is only created by the matmul functions below over an
// exclusively borrowed output, and their tasks write disjoint rows.
unsafe impl Send for YOut {}
// SAFETY: as above.
unsafe impl Sync for YOut {}

impl YOut {
    fn new(y: &mut [f32]) -> YOut {
        YOut(y.as_mut_ptr(), y.len())
    }

    #[inline(always)]
    fn set(self, i: usize, v: f32) {
        assert!(i < self.1);
        // SAFETY: `i` is in bounds (checked above); the output is exclusively
        // borrowed for the whole matmul call, and each element is written by
        // exactly one task because tasks own disjoint weight rows.
        unsafe { *self.0.add(i) = v };
    }

    /// `v` to elements `i..i + N`, one bounds check for the run (a copy of
    /// a length known when compiled, so no call to `memcpy`).
    #[inline(always)]
    fn set_run<const N: usize>(self, i: usize, v: &[f32; N]) {
        assert!(i <= self.1 && N <= self.1 - i);
        // SAFETY: the run is in bounds (checked above) and cannot overlap
        // `v`, a task's own buffer; exclusivity as in `set`.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), self.0.add(i), N) };
    }
}

/// Rows per task: about 32 KiB of weights, and at least four tasks per
/// thread; whole groups for the interleaved types (whole pairs of groups
/// where the table has tiles).
fn rows_per_task(w: &Matrix, k: &TypeKernels, threads: usize) -> usize {
    let by_bytes = (32 * 1024 / w.row_bytes().max(1)).max(1);
    let by_threads = w.rows.div_ceil(threads * 4).max(1);
    let unit = match k.layout {
        Layout::Groups(GroupKernels { tile: Some(_), .. } | GroupKernels { direct: Some(_), .. }) => TILE_ROWS,
        // Whole register tiles of three or four rows.
        Layout::Rows { dots: Some(_), .. } => 12,
        _ => w.dtype.group_rows(),
    };
    by_bytes.min(by_threads).max(1).next_multiple_of(unit)
}

/// Sees the weight matrix and the input of every matmul while installed
/// ([`observe_matmuls`]): calibration's hook (the importance matrix records
/// each matrix's input columns). Called from whichever thread runs the
/// matmul, before it runs.
pub type Observer = dyn Fn(&Matrix, &Input) + Send + Sync;

/// The installed observer; `OBSERVING` says whether there is one, so the hot
/// path pays one relaxed load per matmul when there is none.
static OBSERVER: std::sync::RwLock<Option<std::sync::Arc<Observer>>> = std::sync::RwLock::new(None);
static OBSERVING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Installs `f` as the process's matmul observer (`None` removes it). Every
/// matmul of every engine in the process calls it until removed; an observer
/// ignores the matrices it does not know (calibration looks them up by
/// address).
pub fn observe_matmuls(f: Option<std::sync::Arc<Observer>>) {
    let on = f.is_some();
    *OBSERVER.write().unwrap_or_else(|p| p.into_inner()) = f;
    OBSERVING.store(on, std::sync::atomic::Ordering::Release);
}

#[inline]
fn observe(w: &Matrix, inp: &Input) {
    if OBSERVING.load(std::sync::atomic::Ordering::Relaxed) {
        let f = OBSERVER.read().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(f) = f {
            f(w, inp);
        }
    }
}

/// `y[t, r] = Σ_c W[r, c] · x[t, c]` for every row `t` of the input, split by
/// output rows over the current rayon pool.
pub fn matmul(w: &Matrix, inp: &Input, y: &mut [f32]) {
    matmul_many(&mut [(*w, y)], inp);
}

/// Several matrices reading the same input, as ONE parallel region (e.g.
/// q, k and v; or an MLP's gate and up): fewer fork-joins per token.
pub fn matmul_many(jobs: &mut [(Matrix, &mut [f32])], inp: &Input) {
    matmul_many_in(table(), jobs, inp);
}

/// [`matmul_many`] with the kernels of `table`.
fn matmul_many_in(table: Table, jobs: &mut [(Matrix, &mut [f32])], inp: &Input) {
    let threads = rayon::current_num_threads();
    let mut tasks = 0;
    for (w, y) in jobs.iter() {
        let k = table.kernels(w.dtype);
        check(w, &k, inp, y);
        observe(w, inp);
        tasks += w.rows.div_ceil(rows_per_task(w, &k, threads));
    }
    if threads == 1 || tasks <= 1 {
        for (w, y) in jobs.iter_mut() {
            rows_into(w, &table.kernels(w.dtype), inp, 0, w.rows, YOut::new(y));
        }
        return;
    }
    // A fixed-size plan: no allocation on the hot path.
    const MAX_JOBS: usize = 4;
    assert!(jobs.len() <= MAX_JOBS, "matmul_many takes at most {MAX_JOBS} matrices");
    let mut plan: [Option<(Matrix, TypeKernels, YOut, usize)>; MAX_JOBS] = [None; MAX_JOBS];
    for (slot, (w, y)) in plan.iter_mut().zip(jobs.iter_mut()) {
        let k = table.kernels(w.dtype);
        *slot = Some((*w, k, YOut::new(y), rows_per_task(w, &k, threads)));
    }
    (0..tasks).into_par_iter().for_each(|mut i| {
        for (w, k, y, chunk) in plan.iter().flatten() {
            let n = w.rows.div_ceil(*chunk);
            if i < n {
                rows_into(w, k, inp, i * chunk, ((i + 1) * chunk).min(w.rows), *y);
                return;
            }
            i -= n;
        }
    });
}

/// As [`matmul`], on the calling thread only (for work already split across
/// threads at a coarser grain, such as one expert per task).
pub fn matmul_serial(w: &Matrix, inp: &Input, y: &mut [f32]) {
    matmul_serial_in(table(), w, inp, y);
}

/// [`matmul_serial`] with the kernels of `table`.
fn matmul_serial_in(table: Table, w: &Matrix, inp: &Input, y: &mut [f32]) {
    let k = table.kernels(w.dtype);
    check(w, &k, inp, y);
    observe(w, inp);
    rows_into(w, &k, inp, 0, w.rows, YOut::new(y));
}

#[cfg(test)]
mod tests;
