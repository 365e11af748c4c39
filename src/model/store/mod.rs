//! The expert store (DESIGN.md seam 5): the one place that decides where a
//! routed expert's bytes come from.
//!
//! The MoE block leases expert (layer, e) from the store, views its three
//! matrices, and drops the lease when the expert has run. Two stores exist:
//!
//! - [`ResidentStore`]: every expert is a view into the mapped file (no
//!   budget, or a budget that holds all experts).
//! - `StreamStore` (`stream.rs`): a RAM budget of fixed slots, allocated once
//!   at open, filled by positioned reads of whole expert slabs, with a
//!   per-layer LRU, a hot set pinned from persisted routing heat, and a
//!   one-layer-ahead prefetch on background I/O threads.
//!
//! A store may change speed, never the numbers: whatever it returns must be
//! the bytes in the file, so outputs are bit-identical under any budget and
//! policy (tested in `tests.rs`).
//!
//! Leases and deadlock freedom: a slot with a live lease is never evicted,
//! so a lease request can block until another lease drops. Requests are made
//! by the thread that runs a MoE block, before it fans the experts out, and
//! only the first request of a wave may block; a thread already inside
//! expert work (which rayon can nest through work stealing) never blocks but
//! reads into a temporary buffer instead (counted as `overflow_reads`).

mod backing;
mod dense;
pub mod heat;
pub mod plan;
mod stream;
pub mod telemetry;
#[cfg(test)]
mod tests;

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::canonical::config::{FfnSpec, ModelConfig};
use crate::canonical::tensors::{ExpertTensor, TensorId};
use crate::error::{Error, Result};
use crate::format::reader::ColibriFile;
use crate::io::{AlignedBuf, IoMode};
use crate::model::weights::{Mlp, TensorRef, matrix, tensor_ref};
pub use backing::{Backing, WeightsBacking};
pub(crate) use dense::DenseCopy;
pub use heat::{Heat, heat_path_for};
pub use plan::{Plan, human, plan, plan_path};
use stream::{StreamSetup, StreamStore};
pub use telemetry::{LayerRouting, LayerStoreStats, RoutingStats, StoreStats};

/// The three matrices of one routed expert.
pub type ExpertView<'a> = Mlp<'a>;

/// Which caching policies a streaming store uses. Each can be switched off
/// to measure what it buys; none changes a single output bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Keep used experts in their slots and evict the least recently used
    /// one of the layer (each layer keeps a fair share of the slots). Off:
    /// an unpinned expert is dropped as soon as its lease ends, so every
    /// lookup not covered by pinning or prefetch reads (the streaming
    /// baseline).
    pub lru: bool,
    /// Pin the hottest experts of the persisted heat file (up to half the
    /// slots) and never evict them.
    pub pin_hot: bool,
    /// Run the next layer's router on the current hidden state and read its
    /// predicted experts on background I/O threads while this layer computes.
    pub prefetch: bool,
}

impl Default for Policy {
    fn default() -> Self {
        // Prefetch is off by default: measured on random and trained routing
        // (docs/design/store.md), each prefetched expert evicts one that some
        // later lookup needed, and it read more bytes than it saved.
        Policy { lru: true, pin_hot: true, prefetch: false }
    }
}

/// Where routing heat is persisted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum HeatFile {
    /// Beside the model: `model.colibri.heat`.
    #[default]
    Beside,
    /// At this path.
    At(PathBuf),
    /// Neither read nor written.
    Off,
}

/// How a model's routed experts are placed (`Model::open_with`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// RAM for routed experts, in bytes. `None`, or a budget that holds every
    /// expert: all resident through the mapping. Below K + 1 experts: an error.
    pub ram_budget: Option<u64>,
    /// Caching policies (streaming only).
    pub policy: Policy,
    /// Buffered or unbuffered reads (streaming only).
    pub io: IoMode,
    /// Where heat is read from at open and saved to when the model is dropped
    /// (streaming only).
    pub heat_file: HeatFile,
    /// Background I/O threads for prefetch and warming the hot set; 0 = 2.
    pub io_threads: usize,
    /// Where the weights live when all of them are resident: the mapping or
    /// a copy (see [`Backing`]).
    pub backing: Backing,
}

/// The right to use one expert's bytes. While a lease lives, its slot is
/// neither evicted nor overwritten; dropping it gives the slot back. Only a
/// store makes leases, and views of a lease cannot outlive it.
pub struct Lease {
    layer: u32,
    expert: u32,
    place: Place,
}

enum Place {
    /// A view into the mapping.
    Resident,
    /// A slot of a streaming store.
    Slot { shared: Arc<stream::Shared>, slot: u32 },
    /// A buffer of its own (a read taken instead of a wait that could deadlock).
    Own(AlignedBuf),
}

impl Lease {
    fn new(layer: usize, expert: usize, place: Place) -> Lease {
        Lease { layer: layer as u32, expert: expert as u32, place }
    }

    /// Layer of the leased expert.
    pub fn layer(&self) -> usize {
        self.layer as usize
    }

    /// Index of the leased expert within its layer.
    pub fn expert(&self) -> usize {
        self.expert as usize
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Place::Slot { shared, slot } = &self.place {
            shared.release(*slot as usize);
        }
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("layer", &self.layer).field("expert", &self.expert).finish_non_exhaustive()
    }
}

/// What a lease request does when every slot is in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseMode {
    /// Blocks until a slot is free (or reads into a buffer of its own where
    /// blocking could deadlock): the store always returns a lease.
    Wait,
    /// Returns `None` at once, so a caller holding leases can run them first.
    IfFree,
}

/// Supplies routed experts' weights to the MoE block. Used concurrently from
/// rayon workers, hence `Send + Sync`.
pub trait ExpertStore: Send + Sync {
    /// Leases expert `expert` of `layer`; `mode` says what happens when every
    /// slot is in use ([`LeaseMode::Wait`] always gives a lease).
    fn lease(&self, layer: usize, expert: usize, mode: LeaseMode) -> Result<Option<Lease>>;

    /// The matrices of a leased expert, reading them first if needed (an I/O
    /// failure is an [`Error::ExpertRead`]). Cheap once loaded.
    fn view<'a>(&'a self, lease: &'a Lease) -> Result<ExpertView<'a>>;

    /// The MoE block of `layer` is about to lease its experts: predictions for
    /// this layer not yet read are stale now.
    fn begin_layer(&self, _layer: usize) {}

    /// A hint that these experts of `layer` are needed soon.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}

    /// True when [`ExpertStore::prefetch`] does anything (so the forward pass
    /// can skip computing predictions).
    fn wants_prefetch(&self) -> bool {
        false
    }

    /// Counters so far.
    fn stats(&self) -> StoreStats;

    /// Where the experts of `layer` are now, one byte per expert written to
    /// `out` (see [`telemetry::LayerRouting::residency`]): `R` when every
    /// expert is resident.
    fn residency(&self, _layer: usize, out: &mut String, experts: usize) {
        out.extend(std::iter::repeat_n('R', experts));
    }
}

thread_local! {
    /// Depth of expert work on this thread (waves being run, stolen halves
    /// of them). See the module docs.
    static BUSY: Cell<u32> = const { Cell::new(0) };
}

/// Marks the current thread as running expert work until dropped.
pub(crate) struct Busy(());

impl Busy {
    pub(crate) fn enter() -> Busy {
        BUSY.with(|b| b.set(b.get() + 1));
        Busy(())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.with(|b| b.set(b.get() - 1));
    }
}

/// Whether this thread is inside expert work, so must not block on a slot.
pub(crate) fn busy() -> bool {
    BUSY.with(|b| b.get() > 0)
}

/// One expert's tensors in the file.
#[derive(Clone, Copy, Debug)]
struct ExpertRefs {
    mats: [TensorRef; 3],
    bias: Option<[TensorRef; 3]>,
}

/// Every expert resident through the file mapping.
pub struct ResidentStore {
    file: Arc<ColibriFile>,
    /// refs[layer][expert] = ([gate, up, down], their biases); empty for dense layers.
    refs: Vec<Vec<ExpertRefs>>,
    lookups: Vec<std::sync::atomic::AtomicU64>,
}

impl ResidentStore {
    /// Resolves every expert of every MoE layer of `cfg` in `file`.
    pub fn new(file: Arc<ColibriFile>, cfg: &ModelConfig) -> Result<ResidentStore> {
        let mut refs = Vec::with_capacity(cfg.layers.len());
        for l in 0..cfg.layers.len() {
            let n = if file.holds_layer(l) { cfg.experts_in_layer(l) } else { 0 };
            let mut layer = Vec::with_capacity(n);
            let biased = cfg.moe.as_ref().is_some_and(|m| m.expert_bias);
            for e in 0..n {
                let r = |x| tensor_ref(&file, TensorId::Expert(l, e, x));
                let [g, u, d] = ExpertTensor::ALL;
                let [bg, bu, bd] = ExpertTensor::BIASES;
                let bias = if biased { Some([r(bg)?, r(bu)?, r(bd)?]) } else { None };
                layer.push(ExpertRefs { mats: [r(g)?, r(u)?, r(d)?], bias });
            }
            refs.push(layer);
        }
        let lookups = (0..refs.len()).map(|_| Default::default()).collect();
        Ok(ResidentStore { file, refs, lookups })
    }
}

impl ExpertStore for ResidentStore {
    fn lease(&self, layer: usize, expert: usize, _mode: LeaseMode) -> Result<Option<Lease>> {
        self.lookups[layer].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Some(Lease::new(layer, expert, Place::Resident)))
    }

    fn view<'a>(&'a self, lease: &'a Lease) -> Result<ExpertView<'a>> {
        if !matches!(lease.place, Place::Resident) {
            return Err(Error::InvalidInput("an expert lease was used with a store that did not issue it".into()));
        }
        let ExpertRefs { mats: [g, u, d], bias } = self.refs[lease.layer()][lease.expert()];
        let vec = |t: TensorRef| -> &[f32] { bytemuck::cast_slice(matrix(&self.file, t).bytes) };
        Ok(ExpertView {
            gate: matrix(&self.file, g),
            up: matrix(&self.file, u),
            down: matrix(&self.file, d),
            bias: bias.map(|b| b.map(vec)),
        })
    }

    fn stats(&self) -> StoreStats {
        let layers: Vec<LayerStoreStats> = self
            .lookups
            .iter()
            .enumerate()
            .map(|(layer, n)| (layer, n.load(std::sync::atomic::Ordering::Relaxed)))
            .filter(|&(_, n)| n > 0)
            .map(|(layer, hits)| LayerStoreStats { layer, hits, misses: 0, bytes_read: 0 })
            .collect();
        let hits = layers.iter().map(|l| l.hits).sum();
        StoreStats { lookups: hits, hits, hit_rate: if hits > 0 { 1.0 } else { 0.0 }, layers, ..Default::default() }
    }
}

/// Heat bookkeeping of a streaming model.
pub(crate) struct HeatState {
    /// Where to save.
    pub(crate) path: PathBuf,
    /// The model's identity, recorded in the file (read once at open, so
    /// saving never touches the model file).
    pub(crate) identity: heat::ModelIdentity,
    /// What the file held at open (added to this run's counts on save).
    pub(crate) base: Option<Heat>,
}

/// How an opened model's experts are placed.
pub(crate) struct Placement {
    pub(crate) experts: Box<dyn ExpertStore>,
    pub(crate) dense: Option<DenseCopy>,
    pub(crate) heat: Option<HeatState>,
    pub(crate) warnings: Vec<String>,
}

/// When `opts` keeps every weight resident, settles where they live (the
/// mapping or a copy, see [`Backing`]); `None` when experts stream.
pub(crate) fn settle_weights(file: &mut ColibriFile, opts: &StoreOptions) -> Result<Option<WeightsBacking>> {
    let resident = match opts.ram_budget {
        Some(b) => plan::Geometry::of(file).slots_for(b)?.is_none(),
        None => true,
    };
    if !resident {
        return Ok(None);
    }
    backing::settle(file, opts.backing).map(Some)
}

/// Decides and builds the placement of `file`'s experts under `opts`.
pub(crate) fn place(file: &Arc<ColibriFile>, opts: &StoreOptions) -> Result<Placement> {
    let geo = plan::Geometry::of(file);
    let slots = match opts.ram_budget {
        Some(b) => geo.slots_for(b)?,
        None => None,
    };
    let cfg = &file.meta().config;
    let Some(slots) = slots else {
        file.advise_huge_pages();
        return Ok(Placement {
            experts: Box::new(ResidentStore::new(file.clone(), cfg)?),
            dense: None,
            heat: None,
            warnings: Vec::new(),
        });
    };
    let mut warnings = Vec::new();
    let handle = std::fs::File::open(file.path()).map_err(|e| Error::io(file.path(), e))?;
    let identity = heat::ModelIdentity::read(&handle, file.data_offset()).map_err(|e| Error::io(file.path(), e))?;
    // Everything from here on reads through `handle`: it must be the file
    // that was mapped and validated, not one renamed over it since.
    if identity.file_len != file.file_len() || identity.head_hash != crate::io::fnv1a(file.head_bytes()) {
        return Err(Error::format(file.path(), "the file changed while it was being opened; try again"));
    }
    let heat_path = match &opts.heat_file {
        HeatFile::Beside => Some(heat_path_for(file.path())),
        HeatFile::At(p) => Some(p.clone()),
        HeatFile::Off => None,
    };
    let base = heat_path.as_ref().and_then(|p| match heat::load_heat(p, file, identity) {
        Ok(h) => h,
        Err(w) => {
            eprintln!("colibri: warning: {w}");
            warnings.push(w);
            None
        }
    });
    let mut pinned = Vec::new();
    if opts.policy.pin_hot
        && let Some(h) = &base
    {
        // The hottest experts of EACH layer, an equal share of the pinned
        // capacity per MoE layer: every layer computes every token, so a
        // layer left with no pins (or too few unpinned slots) misses on each.
        let moe: Vec<usize> = (0..cfg.layers.len())
            .filter(|&l| matches!(cfg.layers[l].ffn, FfnSpec::Moe) && file.holds_layer(l))
            .collect();
        let per_layer = geo.pin_capacity(slots) / moe.len().max(1);
        for &l in &moe {
            let mut ranked: Vec<(u64, usize)> =
                (0..geo.experts_per_layer).map(|e| (h.get(l, e), e)).filter(|x| x.0 > 0).collect();
            ranked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            pinned.extend(ranked.iter().take(per_layer).map(|&(_, e)| (l, e)));
        }
    }
    let dense = DenseCopy::read(file, &handle)?;
    let setup = StreamSetup {
        identity,
        budget: opts.ram_budget.unwrap_or(0),
        slots,
        slot_bytes: geo.slot_bytes as usize,
        policy: opts.policy,
        io: opts.io,
        io_threads: if opts.io_threads == 0 { 2 } else { opts.io_threads },
        pinned,
    };
    Ok(Placement {
        experts: Box::new(StreamStore::new(file, setup)?),
        dense: Some(dense),
        heat: heat_path.map(|path| HeatState { path, identity, base }),
        warnings,
    })
}

/// Parses a byte count: a plain integer of bytes, or a number (decimals
/// allowed) with a unit: B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB
/// (powers of 1024), case-insensitive, optionally separated by spaces
/// ("4GB", "1.5 GiB", "512MiB", "4000000000").
pub fn parse_bytes(s: &str) -> Result<u64> {
    let bad = |why: &str| {
        Error::InvalidInput(format!(
            "cannot read {s:?} as a size: {why} (write e.g. \"4GB\", \"1.5GiB\", \"512MiB\" or a number of bytes)"
        ))
    };
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    if num.is_empty() {
        return Err(bad("no number"));
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "k" | "m" | "g" | "t" => {
            return Err(bad(&format!(
                "unit {unit:?} is ambiguous; say {unit}B (powers of 1000) or {unit}iB (powers of 1024)"
            )));
        }
        _ => return Err(bad(&format!("unknown unit {unit:?}"))),
    };
    let (whole, frac) = match num.split_once('.') {
        Some((w, f)) => (w, f),
        None => (num, ""),
    };
    if frac.contains('.') || (whole.is_empty() && frac.is_empty()) {
        return Err(bad("malformed number"));
    }
    let too_big = || bad("too large");
    let w: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| too_big())? };
    let mut n = w.checked_mul(mult).ok_or_else(too_big)?;
    if !frac.is_empty() {
        // Exact for up to 18 fractional digits; the result is floored to whole bytes.
        let digits = &frac[..frac.len().min(18)];
        let f: u128 = digits.parse().map_err(|_| bad("malformed number"))?;
        let part = f * mult as u128 / 10u128.pow(digits.len() as u32);
        n = n.checked_add(part as u64).ok_or_else(too_big)?;
        if mult == 1 && f != 0 {
            return Err(bad("a fraction of a byte"));
        }
    }
    Ok(n)
}
