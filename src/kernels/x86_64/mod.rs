//! x86_64 kernels: AVX2 + FMA + F16C, and the same with AVX-VNNI for the
//! integer sums of the group kernels. The functions here are safe wrappers
//! over `unsafe` kernels that need those features; they are reachable only
//! through [`Avx2::kernels`] / [`AvxVnni::kernels`], and an [`Avx2`] /
//! [`AvxVnni`] is made only by its `detect` after run-time detection of
//! every feature its kernels use.

mod amx;
mod avx2;
mod avx512;
mod delta;
mod kquant;
mod kv;
mod kx8;
mod pack;
mod pairs;
mod prim;

use super::{
    DeltaFn, Dot4Fn, DotFn, DotsFn, Gemm8Fn, Gemv8Fn, GroupKernels, InputKind, KvKernels, Layout, QuantizeFn, SsmFn,
    TileFn, Tiles, TypeKernels,
};
use crate::quant::DType;
use crate::quant::act::BlockQ8;
use std::arch::x86_64::__cpuid;

/// The prefetch distance of the light one-token weight streams (one-token
/// passes of the 8-row q8_0, q4_0, q4_1 and q4k kernels: decode) on AMD Zen
/// 2 and Zen 3 (family 17h, and 19h's Zen 3 models; see
/// [`short_light_streams`]). There the L2 hardware streamer keeps ahead of a
/// sequential read by itself, and a request 16 KiB ahead goes to DRAM and
/// holds one of the core's few L1 miss buffers the whole way; asked for 1
/// KiB ahead, the lines are already in L2. Zen 2 EPYC (kernel_speed over a
/// streamed q4_0x8 matrix, GB/s on one | two threads): 14.8-15.4 |
/// 28.1-29.7 at 16 KiB, 17.3-18.0 | 29.8-33.4 at 1 KiB, the read probe's
/// 17.4 | 31-35; q8_0x8 and q4_1x8 about +17% on one thread, q4kx8 +7%; 2
/// KiB was the worst distance there (13.2-14.4 on one thread). Zen 3 EPYC
/// (q8_0x8, 4096 columns, medians of five): 19.6 | 31.9 at 16 KiB, 22.6 |
/// 37.0 at 1 KiB (2 KiB the same, 4 KiB as 16); the 4-bit streams read
/// alike at both distances, and Nemotron 3 Nano's q8_0 decode went from 41.5
/// to 46 tok/s on two threads. The heavier streams (mxfp4, q5k, q6k at one
/// token, every pass of two tokens and more) read as fast or faster at 4-16
/// KiB, so they keep [`prim::PREFETCH_AHEAD`]. So do other CPUs (on the host
/// where 16 KiB was chosen, 1 and 4 KiB were slower).
const SHORT_ONE_TOKEN_AHEAD: usize = 1024;

/// Sets the prefetch distance of the light one-token streams for this CPU,
/// once, when the process's kernel table is chosen (before any kernel is
/// reached through `kernels::table()`; tables made directly, as the kernel
/// tests do, run at the default): `COLIBRI_PREFETCH` (bytes, or KiB with
/// that suffix; 64 bytes to 1 MiB; `auto` or unset: the default) when
/// given, else [`SHORT_ONE_TOKEN_AHEAD`] where [`short_light_streams`]
/// says so, else [`prim::PREFETCH_AHEAD`]. Returns a note for stderr when
/// the variable could not be followed.
pub fn tune_streams() -> Option<String> {
    let short = amd_cpu().is_some_and(|(family, model)| short_light_streams(family, model));
    let (bytes, note) = one_token_ahead_for(std::env::var("COLIBRI_PREFETCH").ok().as_deref(), short);
    prim::set_one_token_ahead(bytes);
    note
}

/// The distance of the light one-token streams in use (bytes).
pub fn one_token_ahead() -> usize {
    prim::stream_ahead::<1>(true)
}

/// Whether the light one-token streams read fastest at
/// [`SHORT_ONE_TOKEN_AHEAD`] on an AMD CPU of this family and model: family
/// 17h (Zen, Zen+, Zen 2; Zen 2 measured), and in family 19h the Zen 3
/// models (0x00-0x0F, 0x20-0x2F, 0x40-0x5F; Milan measured), not Zen 4's,
/// which nobody has measured.
fn short_light_streams(family: u32, model: u32) -> bool {
    family == 0x17 || (family == 0x19 && matches!(model >> 4, 0x0 | 0x2 | 0x4 | 0x5))
}

/// The distance for a `COLIBRI_PREFETCH` value on a CPU whose light streams
/// do (or do not) read best from close by, and a note when the value could
/// not be followed.
fn one_token_ahead_for(request: Option<&str>, short: bool) -> (usize, Option<String>) {
    let default = if short { SHORT_ONE_TOKEN_AHEAD } else { prim::PREFETCH_AHEAD };
    let text = request.map(str::trim).unwrap_or_default();
    if text.is_empty() || text.eq_ignore_ascii_case("auto") {
        return (default, None);
    }
    let (digits, unit) = match text.len().checked_sub(3).filter(|&i| text.is_char_boundary(i)) {
        Some(i) if text[i..].eq_ignore_ascii_case("kib") => (text[..i].trim_end(), 1024),
        _ => (text, 1),
    };
    let why = match digits.parse::<usize>() {
        Ok(n) if (64..=1 << 20).contains(&n.saturating_mul(unit)) => return (n * unit, None),
        Ok(_) => "outside 64 bytes to 1 MiB".to_string(),
        Err(_) => "not a byte count (write e.g. 1024 or 4KiB)".to_string(),
    };
    (default, Some(format!("COLIBRI_PREFETCH={text}: {why}; using {default} bytes")))
}

/// The CPU's family and model when the vendor is AMD (`None` otherwise).
fn amd_cpu() -> Option<(u32, u32)> {
    #[allow(unused_unsafe)]
    // SAFETY: CPUID leaves 0 and 1 exist on every x86_64 CPU. (`__cpuid`
    // is an unsafe fn on the oldest Rust this crate builds with.)
    let (v, eax) = unsafe { (__cpuid(0), __cpuid(1).eax) };
    let vendor: Vec<u8> = [v.ebx, v.edx, v.ecx].iter().flat_map(|r| r.to_le_bytes()).collect();
    (vendor == b"AuthenticAMD").then(|| (family(eax), model(eax)))
}

/// The family in CPUID leaf 1's EAX: the base family (bits 8-11), plus the
/// extended family (bits 20-27) when the base is 0xF.
fn family(eax: u32) -> u32 {
    let base = (eax >> 8) & 0xF;
    if base == 0xF { base + ((eax >> 20) & 0xFF) } else { base }
}

/// The model in CPUID leaf 1's EAX: the base model (bits 4-7), with the
/// extended model (bits 16-19) above it when the base family is 6 or 0xF.
fn model(eax: u32) -> u32 {
    let base = (eax >> 4) & 0xF;
    if matches!((eax >> 8) & 0xF, 0x6 | 0xF) { (((eax >> 16) & 0xF) << 4) | base } else { base }
}

/// Proof that this CPU runs the AVX2 table: only [`Avx2::detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub struct Avx2(());

impl Avx2 {
    /// `Some` when this CPU has everything the AVX2 kernels use.
    pub fn detect() -> Option<Avx2> {
        let has =
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        has.then_some(Avx2(()))
    }

    /// The AVX2 activation quantiser.
    pub fn quantize_fn(self) -> QuantizeFn {
        quantize_act
    }

    /// The AVX2 step of the gated delta rule.
    pub fn delta_fn(self) -> DeltaFn {
        ymm_delta
    }

    /// The AVX2 step of Mamba2's scan.
    pub fn ssm_fn(self) -> SsmFn {
        ymm_ssm
    }

    /// The AVX2 kernels of `dtype`: every type has its own.
    pub fn kernels(self, dtype: DType) -> TypeKernels {
        use InputKind::{F32, Q8};
        let rows = |input: InputKind, dot: DotFn, tile: Option<Dot4Fn>| TypeKernels {
            input,
            layout: Layout::Rows { dot, tile, dots: None },
            kv: None,
        };
        let elems = |dot: DotFn, dots: DotsFn| TypeKernels {
            input: F32,
            layout: Layout::Rows { dot, tile: None, dots: Some(dots) },
            kv: None,
        };
        let group = |one: Gemv8Fn, many: Gemm8Fn| TypeKernels {
            input: Q8,
            layout: Layout::Groups(GroupKernels { one, many: Some(many), tile: None, direct: None }),
            kv: None,
        };
        match dtype {
            DType::F32 => TypeKernels {
                kv: Some(KvKernels { dots: f32_dots, axpys: f32_axpys, pv: f32_pv }),
                ..elems(f32_dot, f32_dots)
            },
            DType::Bf16 => elems(bf16_dot, bf16_dots),
            DType::F16 => TypeKernels {
                kv: Some(KvKernels { dots: f16_dots, axpys: f16_axpys, pv: f16_pv }),
                ..elems(f16_dot, f16_dots)
            },
            DType::Q8_0 => rows(Q8, q8_0_dot, Some(q8_0_dot4)),
            DType::Q4_0 => rows(Q8, q4_0_dot, Some(q4_0_dot4)),
            DType::Q4_1 => rows(Q8, q4_1_dot, Some(q4_1_dot4)),
            DType::Q8_0x8 => group(q8_0x8_gemv, q8_0x8_gemmn),
            DType::Q4_0x8 => group(q4_0x8_gemv, q4_0x8_gemmn),
            DType::Q4_1x8 => group(q4_1x8_gemv, q4_1x8_gemmn),
            DType::Mxfp4 => rows(Q8, mxfp4_dot, None),
            DType::Mxfp4x8 => group(mxfp4x8_gemv, mxfp4x8_gemmn),
            DType::Q4K => rows(Q8, q4k_dot, None),
            DType::Q5K => rows(Q8, q5k_dot, None),
            DType::Q6K => rows(Q8, q6k_dot, None),
            DType::Q4Kx8 => group(q4kx8_gemv, q4kx8_gemmn),
            DType::Q5Kx8 => group(q5kx8_gemv, q5kx8_gemmn),
            DType::Q6Kx8 => group(q6kx8_gemv, q6kx8_gemmn),
        }
    }
}

/// Proof that this CPU runs the AVX-VNNI table (AVX2, FMA, F16C and
/// AVX-VNNI): only [`AvxVnni::detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub struct AvxVnni(Avx2);

impl AvxVnni {
    /// `Some` when this CPU has everything the AVX-VNNI kernels use.
    pub fn detect() -> Option<AvxVnni> {
        let avx2 = Avx2::detect()?;
        is_x86_feature_detected!("avxvnni").then_some(AvxVnni(avx2))
    }

    /// The AVX2 activation quantiser.
    pub fn quantize_fn(self) -> QuantizeFn {
        quantize_act
    }

    /// The AVX2 step of the gated delta rule (no integer sums in it).
    pub fn delta_fn(self) -> DeltaFn {
        self.0.delta_fn()
    }

    /// The AVX2 step of Mamba2's scan.
    pub fn ssm_fn(self) -> SsmFn {
        self.0.ssm_fn()
    }

    /// The AVX2 kernels of `dtype`, with `vpdpbusd` in the group kernels
    /// (where prefill spends its time); the integer sums are the same, so
    /// the results are the AVX2 table's bit for bit.
    pub fn kernels(self, dtype: DType) -> TypeKernels {
        let group = |one: Gemv8Fn, many: Gemm8Fn| TypeKernels {
            input: InputKind::Q8,
            layout: Layout::Groups(GroupKernels { one, many: Some(many), tile: None, direct: None }),
            kv: None,
        };
        match dtype {
            DType::F32
            | DType::Bf16
            | DType::F16
            | DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Mxfp4
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K => self.0.kernels(dtype),
            DType::Q8_0x8 => group(vnni_q8_0x8_gemv, vnni_q8_0x8_gemmn),
            DType::Q4_0x8 => group(vnni_q4_0x8_gemv, vnni_q4_0x8_gemmn),
            DType::Q4_1x8 => group(vnni_q4_1x8_gemv, vnni_q4_1x8_gemmn),
            DType::Mxfp4x8 => group(vnni_mxfp4x8_gemv, vnni_mxfp4x8_gemmn),
            DType::Q4Kx8 => group(vnni_q4kx8_gemv, vnni_q4kx8_gemmn),
            DType::Q5Kx8 => group(vnni_q5kx8_gemv, vnni_q5kx8_gemmn),
            DType::Q6Kx8 => group(vnni_q6kx8_gemv, vnni_q6kx8_gemmn),
        }
    }
}

/// Proof that this CPU runs the AVX-512 table: the AVX-VNNI table (the AVX2
/// one on a CPU without AVX-VNNI) with sixteen-lane attention and element
/// weight kernels and, where the CPU has AVX-512BW/VL/VNNI, 16-row VNNI
/// kernels for prefill (and the EVEX `vpdpbusd` in the 8-row kernels when
/// it has no AVX-VNNI). Only [`Avx512::detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub struct Avx512 {
    base: Base,
    /// AVX-512BW, AVX-512VL and AVX-512VNNI (the 16-row prefill kernels,
    /// and the EVEX `vpdpbusd` in the 8-row kernels where the base has no
    /// AVX-VNNI).
    vnni: bool,
}

/// The table an [`Avx512`] builds on.
#[derive(Clone, Copy, Debug)]
enum Base {
    Avx2(Avx2),
    AvxVnni(AvxVnni),
}

/// The AVX-512 16-row kernels of a type, and the fewest tokens they take
/// (`Tiles::min`): with fewer, repacking the weights costs more than the
/// wider tile saves, and the 8-row kernels are faster. Measured on matrices
/// streamed from memory, as decode and prefill read them (Zen 5 EPYC, two
/// threads, `examples/kernel_speed.rs N TYPE 262144 2`, ns per 32 weights
/// and token, 8-row kernels on run pairs against tiles): q4_0x8, q8_0x8,
/// q4kx8 and q5kx8 are level at 8-10 tokens and the tiles ahead from 12
/// (q4_0x8 0.091 against 0.079), q4_1x8 level from 4 to 12; mxfp4x8, whose
/// 8-row kernels are the 256-bit ones, takes tiles from 6 (0.175 against
/// 0.126 without the tiles' prefetch of the next pair). Before that
/// prefetch (`avx512::rows16`) a streamed tile was 1.2-1.5x slower and the
/// run pairs won up to 16-32 tokens; in L2 the tiles cross at 5-9. Since
/// sessions 14-15 only mxfp4x8 has tiles here: the other interleaved
/// types take every count from two tokens on (q8_0x8 from four) with their
/// direct kernel (`avx512::direct16`).
const fn rows16(f: TileFn, min: usize) -> Option<Tiles> {
    Some(Tiles { f, min })
}

impl Avx512 {
    /// `Some` when this CPU has AVX-512F besides the AVX2 table's features.
    pub fn detect() -> Option<Avx512> {
        let avx2 = Avx2::detect()?;
        if !is_x86_feature_detected!("avx512f") {
            return None;
        }
        let vnni = is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        Some(Avx512 { base: AvxVnni::detect().map_or(Base::Avx2(avx2), Base::AvxVnni), vnni })
    }

    /// The AVX2 activation quantiser.
    pub fn quantize_fn(self) -> QuantizeFn {
        quantize_act
    }

    /// The sixteen-lane step of the gated delta rule.
    pub fn delta_fn(self) -> DeltaFn {
        zmm_delta
    }

    /// The sixteen-lane step of Mamba2's scan.
    pub fn ssm_fn(self) -> SsmFn {
        zmm_ssm
    }

    /// The base table's kernels, with sixteen-lane attention kernels for the
    /// KV cache's types and, in the interleaved types, 16-row VNNI kernels
    /// for prefill and 8-row kernels whose integer sums run two 32-byte runs
    /// per 512-bit `vpdpbusd` (`pairs.rs`) for one to four tokens: decode
    /// and small batches. The 8-row layout is kept, so decode reads the
    /// same bytes in the same order.
    pub fn kernels(self, dtype: DType) -> TypeKernels {
        let mut k = match self.base {
            Base::Avx2(t) => t.kernels(dtype),
            Base::AvxVnni(t) => t.kernels(dtype),
        };
        // The 16-row VNNI tiles (now only mxfp4's: the direct kernels,
        // below, took the other types' place) and the 8-row kernels on run
        // pairs (mxfp4: with the 256-bit EVEX `vpdpbusd`, used only where
        // the base has no AVX-VNNI). All give the integers the other
        // tables sum.
        let vnni: Option<(Option<Tiles>, Gemv8Fn, Gemm8Fn)> = match dtype {
            DType::F32
            | DType::Bf16
            | DType::F16
            | DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Mxfp4
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K => None,
            DType::Q8_0x8 => Some((None, zmm_q8_0x8_gemv, zmm_q8_0x8_gemmn)),
            DType::Q4_0x8 => Some((None, zmm_q4_0x8_gemv, zmm_q4_0x8_gemmn)),
            DType::Q4_1x8 => Some((None, zmm_q4_1x8_gemv, zmm_q4_1x8_gemmn)),
            DType::Mxfp4x8 => Some((rows16(z_mxfp4x8, 6), evex_mxfp4x8_gemv, evex_mxfp4x8_gemmn)),
            DType::Q4Kx8 => Some((None, zmm_q4kx8_gemv, zmm_q4kx8_gemmn)),
            DType::Q5Kx8 => Some((None, zmm_q5kx8_gemv, zmm_q5kx8_gemmn)),
            DType::Q6Kx8 => Some((None, zmm_q6kx8_gemv, zmm_q6kx8_gemmn)),
        };
        // Run pairs take fewer instructions per weight than either 256-bit
        // form (docs/design/kernels.md), so they replace AVX-VNNI's too.
        let pairs = !matches!(dtype, DType::Mxfp4x8);
        if let (Layout::Groups(g), Some((tiles, one, many)), true) = (&mut k.layout, vnni, self.vnni) {
            g.tile = tiles;
            // These read sixteen rows straight from the matrix
            // (`avx512::direct16`): level with or faster than the run pairs
            // and the tiles at every count from 4 to 128 tokens, in L2 and
            // streamed, and, since their prefetch goes to L2 only
            // (`prim::prefetch_ahead_l2`), at two and three tokens too, over
            // a streamed matrix 1.3-1.65x the run pairs' GB/s (Zen 4 EPYC,
            // one and two threads; docs/design/kernels.md), except q8_0x8,
            // whose pairs stay ahead at two tokens (48 against 40 GB/s, two
            // threads) and level at three: it keeps them below four. One
            // token stays on the 8-row kernels (level or ahead there).
            g.direct = match dtype {
                DType::Q4_0x8 => rows16(z_direct_q4_0x8, 2),
                DType::Q4_1x8 => rows16(z_direct_q4_1x8, 2),
                DType::Q8_0x8 => rows16(z_direct_q8_0x8, 4),
                DType::Q4Kx8 => rows16(z_direct_q4kx8, 2),
                DType::Q5Kx8 => rows16(z_direct_q5kx8, 2),
                DType::Q6Kx8 => rows16(z_direct_q6kx8, 2),
                _ => None,
            };
            if pairs || matches!(self.base, Base::Avx2(_)) {
                (g.one, g.many) = (one, Some(many));
            }
        }
        let elems = |dot: DotFn, dots: DotsFn| Layout::Rows { dot, tile: None, dots: Some(dots) };
        let kv = match dtype {
            DType::F32 => {
                k.layout = elems(z_f32_dot, z_f32_dots);
                KvKernels { dots: z_f32_dots, axpys: z_f32_axpys, pv: z_f32_pv }
            }
            DType::F16 => {
                k.layout = elems(z_f16_dot, z_f16_dots);
                KvKernels { dots: z_f16_dots, axpys: z_f16_axpys, pv: z_f16_pv }
            }
            DType::Bf16 => {
                k.layout = elems(z_bf16_dot, z_bf16_dots);
                return k;
            }
            DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Mxfp4
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K
            | DType::Q8_0x8
            | DType::Q4_0x8
            | DType::Q4_1x8
            | DType::Mxfp4x8
            | DType::Q4Kx8
            | DType::Q5Kx8
            | DType::Q6Kx8 => return k,
        };
        TypeKernels { kv: Some(kv), ..k }
    }
}

/// Proof that this CPU and OS run the AMX table (the AVX-512 table, plus
/// AMX-TILE and AMX-INT8 with the tile state granted and a probe product
/// that ran): only [`Amx::detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub struct Amx(Avx512);

/// Fewest tokens the AMX kernels take. They compute the tokens short of a
/// whole tile (fewer than `amx::PAD_MIN`) with AVX-512 on the weights
/// packed for the tiles; on the Xeon those were level with the 8-row
/// AVX-VNNI kernels from 10 tokens. (Not measured against the run pairs
/// nor on streamed matrices: no AMX machine since.)
const AMX_MIN_TOKENS: usize = 10;

impl Amx {
    /// `Some` when this process can run the AMX tiles (see [`amx::usable`]).
    pub fn detect() -> Option<Amx> {
        let base = Avx512::detect()?;
        (base.vnni && amx::usable()).then_some(Amx(base))
    }

    /// The AVX2 activation quantiser.
    pub fn quantize_fn(self) -> QuantizeFn {
        quantize_act
    }

    /// The AVX-512 table's step of the gated delta rule (no tiles in it).
    pub fn delta_fn(self) -> DeltaFn {
        self.0.delta_fn()
    }

    /// The AVX-512 table's step of Mamba2's scan.
    pub fn ssm_fn(self) -> SsmFn {
        self.0.ssm_fn()
    }

    /// The AVX-512 table's kernels, with int8 tiles for prefill in the interleaved
    /// block types (decode, one token per call, stays on the vectors; the
    /// tiles give the same bits).
    pub fn kernels(self, dtype: DType) -> TypeKernels {
        let mut k = self.0.kernels(dtype);
        let tile: Option<TileFn> = match dtype {
            DType::F32
            | DType::Bf16
            | DType::F16
            | DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Mxfp4
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K
            | DType::Q6Kx8 => None,
            DType::Q8_0x8 => Some(amx_q8_0x8),
            DType::Q4_0x8 => Some(amx_q4_0x8),
            DType::Q4_1x8 => Some(amx_q4_1x8),
            DType::Mxfp4x8 => Some(amx_mxfp4x8),
            DType::Q4Kx8 => Some(amx_q4kx8),
            DType::Q5Kx8 => Some(amx_q5kx8),
        };
        if let (Layout::Groups(g), Some(f)) = (&mut k.layout, tile) {
            g.tile = Some(Tiles { f, min: AMX_MIN_TOKENS });
        }
        k
    }
}

macro_rules! safe_tile {
    ($name:ident, $block:ty) => {
        fn $name(group: &[u8], q: &[BlockQ8], tokens: usize, out: &mut [f32]) {
            // SAFETY: reachable only through `Amx::kernels`, which needs an
            // `Amx`, made only by `Amx::detect` once this CPU has shown
            // AVX2, FMA, F16C, AVX-512F/BW/VNNI (through `Avx512::detect`)
            // and AMX and the process holds the tile permission (a probe
            // product ran in a child).
            unsafe { amx::tiles::<$block>(group, q, tokens, out) }
        }
    };
}

safe_tile!(amx_q8_0x8, crate::quant::x8::BlockQ8_0x8);
safe_tile!(amx_q4_0x8, crate::quant::x8::BlockQ4_0x8);
safe_tile!(amx_q4_1x8, crate::quant::x8::BlockQ4_1x8);
safe_tile!(amx_mxfp4x8, crate::quant::x8::BlockMxfp4x8);
safe_tile!(amx_q4kx8, kx8::Q4KTile);
safe_tile!(amx_q5kx8, kx8::Q5KTile);

macro_rules! safe_rows16 {
    ($name:ident, $block:ty) => {
        fn $name(group: &[u8], q: &[BlockQ8], tokens: usize, out: &mut [f32]) {
            // SAFETY: reachable only through `Avx512::kernels` when its
            // `vnni` is set, which `Avx512::detect` does only after seeing
            // AVX2, FMA, F16C, AVX-512F, AVX-512BW and AVX-512VNNI on this CPU.
            unsafe { avx512::rows16::<$block>(group, q, tokens, out) }
        }
    };
}

macro_rules! safe_direct16 {
    ($name:ident, $block:ty) => {
        fn $name(group: &[u8], q: &[BlockQ8], tokens: usize, out: &mut [f32]) {
            // SAFETY: as `safe_rows16`'s wrappers: reachable only through
            // `Avx512::kernels` with `vnni` set, after `Avx512::detect` saw
            // AVX2, FMA, F16C, AVX-512F, AVX-512BW and AVX-512VNNI on this CPU.
            unsafe { avx512::direct16::<$block>(group, q, tokens, out) }
        }
    };
}

safe_direct16!(z_direct_q4_0x8, crate::quant::x8::BlockQ4_0x8);
safe_direct16!(z_direct_q4_1x8, crate::quant::x8::BlockQ4_1x8);
safe_direct16!(z_direct_q8_0x8, crate::quant::x8::BlockQ8_0x8);
safe_direct16!(z_direct_q4kx8, kx8::Q4KTile);
safe_direct16!(z_direct_q5kx8, kx8::Q5KTile);
safe_direct16!(z_direct_q6kx8, kx8::Q6KTile);

safe_rows16!(z_mxfp4x8, crate::quant::x8::BlockMxfp4x8);

macro_rules! safe_wrapper {
    ($name:ident, $inner:path) => {
        fn $name(row: &[u8], x: &[f32], q: &[BlockQ8]) -> f32 {
            // SAFETY: this wrapper is reachable only through `Avx2::kernels`,
            // which needs an `Avx2`, made only by `Avx2::detect` once it has
            // seen AVX2, FMA and F16C on this CPU: the target features the
            // inner function enables are present.
            unsafe { $inner(row, x, q) }
        }
    };
}

fn quantize_act(x: &[f32], out: &mut [BlockQ8]) {
    // SAFETY: reachable only through the `quantize_fn` of the x86 tables,
    // each made only once AVX2, FMA and F16C were seen on this CPU.
    unsafe { avx2::quantize_act(x, out) }
}

/// An element type's row dot as a 1 × 1 call of its score kernel, so a
/// single dot and the register tiles of prefill give the same bits.
macro_rules! dot_by_dots {
    ($name:ident, $dots:ident) => {
        fn $name(row: &[u8], x: &[f32], _q: &[BlockQ8]) -> f32 {
            let mut out = [0f32];
            $dots(row, x.len(), 1, &[x], &mut out, 1);
            out[0]
        }
    };
}

dot_by_dots!(f32_dot, f32_dots);
dot_by_dots!(bf16_dot, bf16_dots);
dot_by_dots!(f16_dot, f16_dots);
dot_by_dots!(z_f32_dot, z_f32_dots);
dot_by_dots!(z_bf16_dot, z_bf16_dots);
dot_by_dots!(z_f16_dot, z_f16_dots);

fn bf16_dots(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
    // SAFETY: reachable only through `Avx2::kernels` (and the tables built
    // on it), which needs an `Avx2`, made only once AVX2, FMA and F16C were seen.
    unsafe { kv::ymm_dots_bf16(k, ks, nk, x, out, os) }
}

fn z_bf16_dots(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
    // SAFETY: reachable only through `Avx512::kernels`, which needs an
    // `Avx512`, made only once AVX-512F, AVX2, FMA and F16C were seen.
    unsafe { kv::zmm_dots_bf16(k, ks, nk, x, out, os) }
}
safe_wrapper!(q8_0_dot, avx2::dot_q8_0);
safe_wrapper!(q4_0_dot, avx2::dot_q4_0);
safe_wrapper!(q4_1_dot, avx2::dot_q4_1);
safe_wrapper!(q4k_dot, kquant::dot_q4k);
safe_wrapper!(q5k_dot, kquant::dot_q5k);
safe_wrapper!(q6k_dot, kquant::dot_q6k);
safe_wrapper!(mxfp4_dot, avx2::dot_mxfp4);

macro_rules! safe_wrapper4 {
    ($name:ident, $inner:path) => {
        fn $name(row: &[u8], q: [&[BlockQ8]; 4]) -> [f32; 4] {
            // SAFETY: as `safe_wrapper`: reachable only through `Avx2::kernels`.
            unsafe { $inner(row, q) }
        }
    };
}

safe_wrapper4!(q8_0_dot4, avx2::dot4_q8_0);
safe_wrapper4!(q4_0_dot4, avx2::dot4_q4_0);
safe_wrapper4!(q4_1_dot4, avx2::dot4_q4_1);

macro_rules! safe_group {
    ($proof:ident: $one:ident, $four:ident, $inner1:path, $inner4:path) => {
        fn $one(group: &[u8], q: &[BlockQ8]) -> [f32; 8] {
            // SAFETY: reachable only through the `kernels` of the proof type
            // named beside this wrapper, made only by its `detect` once it has
            // seen on this CPU every feature the inner kernel enables.
            unsafe { $inner1(group, q) }
        }
        fn $four(group: &[u8], q: &[&[BlockQ8]], out: &mut [[f32; 8]]) {
            // SAFETY: as above.
            unsafe { $inner4(group, q, out) }
        }
    };
}

safe_group!(Avx2: q8_0x8_gemv, q8_0x8_gemmn, avx2::gemv8_q8_0, avx2::gemm8xn_q8_0);
safe_group!(Avx2: q4_0x8_gemv, q4_0x8_gemmn, avx2::gemv8_q4_0, avx2::gemm8xn_q4_0);
safe_group!(Avx2: q4_1x8_gemv, q4_1x8_gemmn, avx2::gemv8_q4_1, avx2::gemm8xn_q4_1);
safe_group!(Avx2: mxfp4x8_gemv, mxfp4x8_gemmn, avx2::gemv8_mxfp4, avx2::gemm8xn_mxfp4);
safe_group!(Avx2: q4kx8_gemv, q4kx8_gemmn, kx8::gemv8_q4k, kx8::gemm8xn_q4k);
safe_group!(Avx2: q5kx8_gemv, q5kx8_gemmn, kx8::gemv8_q5k, kx8::gemm8xn_q5k);
safe_group!(Avx2: q6kx8_gemv, q6kx8_gemmn, kx8::gemv8_q6k, kx8::gemm8xn_q6k);
safe_group!(AvxVnni: vnni_q4kx8_gemv, vnni_q4kx8_gemmn, kx8::vnni_gemv8_q4k, kx8::vnni_gemm8xn_q4k);
safe_group!(AvxVnni: vnni_q5kx8_gemv, vnni_q5kx8_gemmn, kx8::vnni_gemv8_q5k, kx8::vnni_gemm8xn_q5k);
safe_group!(AvxVnni: vnni_q6kx8_gemv, vnni_q6kx8_gemmn, kx8::vnni_gemv8_q6k, kx8::vnni_gemm8xn_q6k);
safe_group!(AvxVnni: vnni_q8_0x8_gemv, vnni_q8_0x8_gemmn, avx2::vnni_gemv8_q8_0, avx2::vnni_gemm8xn_q8_0);
safe_group!(AvxVnni: vnni_q4_0x8_gemv, vnni_q4_0x8_gemmn, avx2::vnni_gemv8_q4_0, avx2::vnni_gemm8xn_q4_0);
safe_group!(AvxVnni: vnni_q4_1x8_gemv, vnni_q4_1x8_gemmn, avx2::vnni_gemv8_q4_1, avx2::vnni_gemm8xn_q4_1);
safe_group!(AvxVnni: vnni_mxfp4x8_gemv, vnni_mxfp4x8_gemmn, avx2::vnni_gemv8_mxfp4, avx2::vnni_gemm8xn_mxfp4);
safe_group!(Avx512: evex_mxfp4x8_gemv, evex_mxfp4x8_gemmn, avx2::evex_gemv8_mxfp4, avx2::evex_gemm8xn_mxfp4);
safe_group!(Avx512: zmm_q8_0x8_gemv, zmm_q8_0x8_gemmn, avx2::zmm_gemv8_q8_0, avx2::zmm_gemm8xn_q8_0);
safe_group!(Avx512: zmm_q4_0x8_gemv, zmm_q4_0x8_gemmn, avx2::zmm_gemv8_q4_0, avx2::zmm_gemm8xn_q4_0);
safe_group!(Avx512: zmm_q4_1x8_gemv, zmm_q4_1x8_gemmn, avx2::zmm_gemv8_q4_1, avx2::zmm_gemm8xn_q4_1);
safe_group!(Avx512: zmm_q4kx8_gemv, zmm_q4kx8_gemmn, kx8::zmm_gemv8_q4k, kx8::zmm_gemm8xn_q4k);
safe_group!(Avx512: zmm_q5kx8_gemv, zmm_q5kx8_gemmn, kx8::zmm_gemv8_q5k, kx8::zmm_gemm8xn_q5k);
safe_group!(Avx512: zmm_q6kx8_gemv, zmm_q6kx8_gemmn, kx8::zmm_gemv8_q6k, kx8::zmm_gemm8xn_q6k);

macro_rules! safe_kv {
    ($proof:ident: $dots:ident, $axpys:ident, $pv:ident, $inner_dots:path, $inner_axpys:path, $inner_pv:path) => {
        fn $dots(k: &[u8], ks: usize, nk: usize, x: &[&[f32]], out: &mut [f32], os: usize) {
            // SAFETY: reachable only through the `kernels` of the proof type
            // named beside this wrapper, made only by its `detect` once it has
            // seen on this CPU every feature the inner kernel enables.
            unsafe { $inner_dots(k, ks, nk, x, out, os) }
        }
        fn $axpys(o: &mut [f32], a: &[f32], v: &[u8]) {
            // SAFETY: as above.
            unsafe { $inner_axpys(o, a, v) }
        }
        fn $pv(o: &mut [f32], p: &[f32], ps: usize, v: &[u8], vs: usize, nk: usize) {
            // SAFETY: as above.
            unsafe { $inner_pv(o, p, ps, v, vs, nk) }
        }
    };
}

safe_kv!(Avx2: f32_dots, f32_axpys, f32_pv, kv::ymm_dots_f32, kv::ymm_axpys_f32, kv::ymm_pv_f32);
safe_kv!(Avx2: f16_dots, f16_axpys, f16_pv, kv::ymm_dots_f16, kv::ymm_axpys_f16, kv::ymm_pv_f16);
safe_kv!(Avx512: z_f32_dots, z_f32_axpys, z_f32_pv, kv::zmm_dots_f32, kv::zmm_axpys_f32, kv::zmm_pv_f32);
safe_kv!(Avx512: z_f16_dots, z_f16_axpys, z_f16_pv, kv::zmm_dots_f16, kv::zmm_axpys_f16, kv::zmm_pv_f16);

fn ymm_delta(s: &mut [f32], decay: &[f32], k: &[f32], v: &[f32], beta: f32, q: &[f32], out: &mut [f32]) {
    // SAFETY: reachable only through `Avx2::delta_fn` (and the tables built
    // on it), which needs an `Avx2`, made only once AVX2, FMA and F16C were seen.
    unsafe { delta::ymm_delta_step(s, decay, k, v, beta, q, out) }
}

fn zmm_delta(s: &mut [f32], decay: &[f32], k: &[f32], v: &[f32], beta: f32, q: &[f32], out: &mut [f32]) {
    // SAFETY: reachable only through `Avx512::delta_fn` (and `Amx`'s), which
    // needs an `Avx512`, made only once AVX-512F, AVX2, FMA and F16C were seen.
    unsafe { delta::zmm_delta_step(s, decay, k, v, beta, q, out) }
}

#[allow(clippy::too_many_arguments)]
fn ymm_ssm(s: &mut [f32], decay: f32, dt: f32, b: &[f32], x: &[f32], c: &[f32], d: f32, out: &mut [f32]) {
    // SAFETY: reachable only through `Avx2::ssm_fn` (and the tables built on
    // it), which needs an `Avx2`, made only once AVX2, FMA and F16C were seen.
    unsafe { delta::ymm_ssm_step(s, decay, dt, b, x, c, d, out) }
}

#[allow(clippy::too_many_arguments)]
fn zmm_ssm(s: &mut [f32], decay: f32, dt: f32, b: &[f32], x: &[f32], c: &[f32], d: f32, out: &mut [f32]) {
    // SAFETY: reachable only through `Avx512::ssm_fn` (and `Amx`'s), which
    // needs an `Avx512`, made only once AVX-512F, AVX2, FMA and F16C were seen.
    unsafe { delta::zmm_ssm_step(s, decay, dt, b, x, c, d, out) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colibri_prefetch_is_followed_or_refused_with_a_note() {
        let d = prim::PREFETCH_AHEAD;
        assert_eq!(one_token_ahead_for(None, false), (d, None));
        assert_eq!(one_token_ahead_for(None, true), (SHORT_ONE_TOKEN_AHEAD, None));
        assert_eq!(one_token_ahead_for(Some(" auto "), true), (SHORT_ONE_TOKEN_AHEAD, None));
        assert_eq!(one_token_ahead_for(Some("4096"), true), (4096, None));
        assert_eq!(one_token_ahead_for(Some("2KiB"), false), (2048, None));
        assert_eq!(one_token_ahead_for(Some("4 kib"), false), (4096, None));
        assert_eq!((family(0x0087_0F10), family(0x0083_0F10), family(0x00A2_0F10)), (0x17, 0x17, 0x19));
        assert_eq!(family(0x0009_06EA), 6);
        // CPUID leaf 1's EAX of Zen 2 Rome, Zen 3 Milan and Vermeer, Zen 4
        // Genoa and Raphael, Zen 5 Turin, Sapphire Rapids.
        let cpus = [0x0083_0F10, 0x00A0_0F11, 0x00A2_0F10, 0x00A1_0F11, 0x00A6_0F12, 0x00B0_0F21, 0x0008_06F8];
        let ids = cpus.map(|eax| (family(eax), model(eax)));
        assert_eq!(
            ids,
            [(0x17, 0x31), (0x19, 0x01), (0x19, 0x21), (0x19, 0x11), (0x19, 0x61), (0x1A, 0x02), (6, 0x8F)]
        );
        let short = ids.map(|(f, m)| short_light_streams(f, m));
        assert_eq!(short, [true, true, true, false, false, false, false]);
        for bad in ["32", "2048KiB", "2MiB", "soon", "-1", "KiB"] {
            let (bytes, note) = one_token_ahead_for(Some(bad), false);
            assert_eq!(bytes, d, "{bad}");
            let note = note.unwrap_or_default();
            assert!(
                note.starts_with(&format!("COLIBRI_PREFETCH={bad}: ")) && note.ends_with(&format!("using {d} bytes")),
                "{note}"
            );
        }
    }

    /// The AVX-512 VNNI group kernels (run pairs, and mxfp4's EVEX form,
    /// which the tables of a CPU with AVX-VNNI never reach) give the AVX2
    /// kernels' bits, called directly here.
    #[test]
    fn avx512_vnni_group_kernels_give_the_avx2_bits() {
        if !Avx512::detect().is_some_and(|t| t.vnni) {
            eprintln!("this CPU has no AVX-512 VNNI: nothing to compare");
            return;
        }
        let avx2 = Avx2::detect().expect("AVX-512 implies the AVX2 table");
        let evex: [(DType, Gemv8Fn, Gemm8Fn); 7] = [
            (DType::Q8_0x8, zmm_q8_0x8_gemv, zmm_q8_0x8_gemmn),
            (DType::Q4_0x8, zmm_q4_0x8_gemv, zmm_q4_0x8_gemmn),
            (DType::Q4_1x8, zmm_q4_1x8_gemv, zmm_q4_1x8_gemmn),
            (DType::Mxfp4x8, evex_mxfp4x8_gemv, evex_mxfp4x8_gemmn),
            (DType::Q4Kx8, zmm_q4kx8_gemv, zmm_q4kx8_gemmn),
            (DType::Q5Kx8, zmm_q5kx8_gemv, zmm_q5kx8_gemmn),
            (DType::Q6Kx8, zmm_q6kx8_gemv, zmm_q6kx8_gemmn),
        ];
        for (dtype, one, many) in evex {
            let Layout::Groups(a) = avx2.kernels(dtype).layout else { panic!("{dtype} is interleaved") };
            let b = GroupKernels { one, many: Some(many), tile: None, direct: None };
            crate::kernels::tests::assert_group_kernels_agree(dtype, a, b);
        }
    }
}
