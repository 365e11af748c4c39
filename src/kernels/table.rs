//! The kernel tables: one per instruction set, each giving every weight type
//! its kernels through an exhaustive `match` over [`DType`] (`scalar::kernels`,
//! `x86_64::Avx2::kernels`, `aarch64::Neon::kernels`), so a type without
//! kernels in some table does not compile.
//!
//! A [`Table`] is only made by [`Table::new`], which checks at run time that
//! this CPU has the features the table's kernels use: holding a `Table` is the
//! proof that calling its kernels cannot fault (memchr's safe constructor).
//! The process uses one table, chosen on first use: the best this CPU runs, or
//! the one `COLIBRI_ISA` names (see [`active`]).

use std::sync::OnceLock;

use super::TypeKernels;
#[cfg(target_arch = "aarch64")]
use super::aarch64;
use super::scalar;
#[cfg(target_arch = "x86_64")]
use super::x86_64;
use crate::quant::DType;
use crate::quant::act;

/// An instruction set with a kernel table in this build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable reference kernels (every CPU).
    Scalar,
    /// x86_64 AVX2 + FMA + F16C.
    Avx2,
    /// x86_64 AVX2 with AVX-VNNI (`vpdpbusd`) in the integer group kernels.
    AvxVnni,
    /// x86_64 AVX-VNNI (or AVX2) with AVX-512F attention kernels.
    Avx512,
    /// x86_64 AVX-512, with AMX int8 tiles for prefill (Linux).
    Amx,
    /// aarch64 NEON.
    Neon,
}

impl Isa {
    /// Every instruction set with a table, from the least to the most
    /// preferred (a CPU runs at most one of those after `Scalar` today).
    pub const ALL: [Isa; 6] = [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512, Isa::Amx, Isa::Neon];

    /// The target architecture whose builds have this table (`None`: all).
    pub fn arch(self) -> Option<&'static str> {
        match self {
            Isa::Scalar => None,
            Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Amx => Some("x86_64"),
            Isa::Neon => Some("aarch64"),
        }
    }

    /// The lowercase name `COLIBRI_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
            Isa::Neon => "neon",
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The kernels of one instruction set, for every weight type; made only by
/// [`Table::new`] (so only for a CPU that runs them).
#[derive(Clone, Copy, Debug)]
pub struct Table(Chosen);

#[derive(Clone, Copy, Debug)]
enum Chosen {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2(x86_64::Avx2),
    #[cfg(target_arch = "x86_64")]
    AvxVnni(x86_64::AvxVnni),
    #[cfg(target_arch = "x86_64")]
    Avx512(x86_64::Avx512),
    #[cfg(target_arch = "x86_64")]
    Amx(x86_64::Amx),
    #[cfg(target_arch = "aarch64")]
    Neon(aarch64::Neon),
}

impl Table {
    /// The scalar reference: runs everywhere, the oracle of the tests.
    pub const SCALAR: Table = Table(Chosen::Scalar);

    /// The table of `isa`, or `None` when this CPU (or this build's target)
    /// cannot run it.
    pub fn new(isa: Isa) -> Option<Table> {
        match isa {
            Isa::Scalar => Some(Table::SCALAR),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86_64::Avx2::detect().map(|t| Table(Chosen::Avx2(t))),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 => None,
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => x86_64::AvxVnni::detect().map(|t| Table(Chosen::AvxVnni(t))),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::AvxVnni => None,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86_64::Avx512::detect().map(|t| Table(Chosen::Avx512(t))),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx512 => None,
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => x86_64::Amx::detect().map(|t| Table(Chosen::Amx(t))),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Amx => None,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => aarch64::Neon::detect().map(|t| Table(Chosen::Neon(t))),
            #[cfg(not(target_arch = "aarch64"))]
            Isa::Neon => None,
        }
    }

    /// Every table this CPU runs, in the order of [`Isa::ALL`].
    pub fn available() -> Vec<Table> {
        Isa::ALL.into_iter().filter_map(Table::new).collect()
    }

    /// The most preferred table this CPU runs.
    pub fn best() -> Table {
        Isa::ALL.into_iter().rev().find_map(Table::new).unwrap_or(Table::SCALAR)
    }

    /// Which instruction set this table uses.
    pub fn isa(self) -> Isa {
        match self.0 {
            Chosen::Scalar => Isa::Scalar,
            #[cfg(target_arch = "x86_64")]
            Chosen::Avx2(_) => Isa::Avx2,
            #[cfg(target_arch = "x86_64")]
            Chosen::AvxVnni(_) => Isa::AvxVnni,
            #[cfg(target_arch = "x86_64")]
            Chosen::Avx512(_) => Isa::Avx512,
            #[cfg(target_arch = "x86_64")]
            Chosen::Amx(_) => Isa::Amx,
            #[cfg(target_arch = "aarch64")]
            Chosen::Neon(_) => Isa::Neon,
        }
    }

    /// This table's activation quantiser (the scalar one's codes in every
    /// table: tested).
    #[inline]
    pub fn quantize_fn(self) -> super::QuantizeFn {
        match self.0 {
            Chosen::Scalar => act::quantize_act,
            #[cfg(target_arch = "x86_64")]
            Chosen::Avx2(t) => t.quantize_fn(),
            #[cfg(target_arch = "x86_64")]
            Chosen::AvxVnni(t) => t.quantize_fn(),
            #[cfg(target_arch = "x86_64")]
            Chosen::Avx512(t) => t.quantize_fn(),
            #[cfg(target_arch = "x86_64")]
            Chosen::Amx(t) => t.quantize_fn(),
            #[cfg(target_arch = "aarch64")]
            Chosen::Neon(_) => act::quantize_act,
        }
    }

    /// This table's step of the gated delta rule (see [`super::DeltaFn`]).
    #[inline]
    pub fn delta_fn(self) -> super::DeltaFn {
        match self.0 {
            Chosen::Scalar => scalar::delta_step,
            #[cfg(target_arch = "x86_64")]
            Chosen::Avx2(t) => t.delta_fn(),
            #[cfg(target_arch = "x86_64")]
            Chosen::AvxVnni(t) => t.delta_fn(),
            #[cfg(target_arch = "x86_64")]
            Chosen::Avx512(t) => t.delta_fn(),
            #[cfg(target_arch = "x86_64")]
            Chosen::Amx(t) => t.delta_fn(),
            #[cfg(target_arch = "aarch64")]
            Chosen::Neon(t) => t.delta_fn(),
        }
    }

    /// This table's Mamba2 step (see [`super::SsmFn`]).
    #[inline]
    pub fn ssm_fn(self) -> super::SsmFn {
        match self.0 {
            Chosen::Scalar => scalar::ssm_step,
            #[cfg(target_arch = "x86_64")]
            Chosen::Avx2(t) => t.ssm_fn(),
            #[cfg(target_arch = "x86_64")]
            Chosen::AvxVnni(t) => t.ssm_fn(),
            #[cfg(target_arch = "x86_64")]
            Chosen::Avx512(t) => t.ssm_fn(),
            #[cfg(target_arch = "x86_64")]
            Chosen::Amx(t) => t.ssm_fn(),
            #[cfg(target_arch = "aarch64")]
            Chosen::Neon(t) => t.ssm_fn(),
        }
    }

    /// The kernels of `dtype` in this table.
    #[inline]
    pub fn kernels(self, dtype: DType) -> TypeKernels {
        match self.0 {
            Chosen::Scalar => scalar::kernels(dtype),
            #[cfg(target_arch = "x86_64")]
            Chosen::Avx2(t) => t.kernels(dtype),
            #[cfg(target_arch = "x86_64")]
            Chosen::AvxVnni(t) => t.kernels(dtype),
            #[cfg(target_arch = "x86_64")]
            Chosen::Avx512(t) => t.kernels(dtype),
            #[cfg(target_arch = "x86_64")]
            Chosen::Amx(t) => t.kernels(dtype),
            #[cfg(target_arch = "aarch64")]
            Chosen::Neon(t) => t.kernels(dtype),
        }
    }
}

/// The table the process uses, chosen on first use: the one `COLIBRI_ISA`
/// names when this CPU runs it, else the best one (with a note on stderr
/// saying why the request was not followed; never an illegal instruction).
/// On x86_64 the prefetch distance of the one-token weight streams is set
/// for this CPU at the same time (`x86_64::tune_streams`,
/// `COLIBRI_PREFETCH`).
pub fn active() -> Table {
    static ACTIVE: OnceLock<Table> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let (table, note) = choose(std::env::var("COLIBRI_ISA").ok().as_deref());
        if let Some(note) = note {
            eprintln!("colibri: {note}");
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(note) = super::x86_64::tune_streams() {
            eprintln!("colibri: {note}");
        }
        table
    })
}

/// The table for a `COLIBRI_ISA` value (`None`: unset), and a note when the
/// value could not be followed.
fn choose(request: Option<&str>) -> (Table, Option<String>) {
    let best = Table::best();
    let name = request.map(|s| s.trim().to_ascii_lowercase()).unwrap_or_default();
    if name.is_empty() || name == "auto" {
        return (best, None);
    }
    let why = if let Some(isa) = Isa::ALL.into_iter().find(|i| i.name() == name) {
        match Table::new(isa) {
            Some(t) => return (t, None),
            None => match isa.arch() {
                Some(arch) if arch != std::env::consts::ARCH => {
                    format!(
                        "COLIBRI_ISA={name}: the {isa} kernels are for {arch}, this build is {}",
                        std::env::consts::ARCH
                    )
                }
                _ => format!("COLIBRI_ISA={name}: this CPU cannot run the {isa} kernels"),
            },
        }
    } else {
        let known: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
        format!("COLIBRI_ISA={name} is not one of auto, {}", known.join(", "))
    };
    (best, Some(format!("{why}; using {}", best.isa())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colibri_isa_is_followed_or_refused_with_a_note() {
        let best = Table::best().isa();
        assert_eq!(choose(None).0.isa(), best);
        assert!(choose(Some("")).1.is_none());
        let (t, note) = choose(Some(" Scalar "));
        assert_eq!((t.isa(), note), (Isa::Scalar, None));
        for name in ["sse9", "avx1024"] {
            let (t, note) = choose(Some(name));
            assert_eq!(t.isa(), best, "{name}");
            assert!(note.unwrap().ends_with(&format!("; using {best}")), "{name}");
        }
        for isa in Isa::ALL {
            let (t, note) = choose(Some(isa.name()));
            match Table::new(isa) {
                Some(_) => assert_eq!((t.isa(), note), (isa, None)),
                None => assert!(t.isa() == best && note.unwrap().contains(&format!("; using {best}")), "{isa}"),
            }
        }
    }
}
