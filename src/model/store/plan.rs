//! What a RAM budget means for a model before it is opened: what stays
//! resident, what streams, and roughly how many bytes a decoded token reads
//! (`colibri plan MODEL --ram X`).

use serde::Serialize;

use super::heat::{Heat, heat_path_for, load_heat};
use crate::canonical::config::FfnSpec;
use crate::error::{Error, Result};
use crate::format::reader::ColibriFile;
use crate::io::round_up;

/// Sizes of a model's parts that placement decisions need.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    /// Layers with a MoE block.
    pub(crate) moe_layers: usize,
    /// E.
    pub(crate) experts_per_layer: usize,
    /// K.
    pub(crate) top_k: usize,
    /// Routed experts in the model.
    pub(crate) total_experts: usize,
    /// Largest expert slab.
    pub(crate) slab_bytes: u64,
    /// A slot: the largest slab rounded up to a page.
    pub(crate) slot_bytes: u64,
    /// All slabs together.
    pub(crate) expert_bytes: u64,
    /// Every other tensor.
    pub(crate) dense_bytes: u64,
}

impl Geometry {
    pub(crate) fn of(file: &ColibriFile) -> Geometry {
        let cfg = &file.meta().config;
        let moe_layers =
            (0..cfg.layers.len()).filter(|&l| matches!(cfg.layers[l].ffn, FfnSpec::Moe) && file.holds_layer(l)).count();
        let (experts_per_layer, top_k) = cfg.moe.as_ref().map_or((0, 0), |m| (m.num_experts, m.router.top_k));
        let slabs = &file.meta().experts;
        let slab_bytes = slabs.iter().map(|s| s.nbytes).max().unwrap_or(0);
        Geometry {
            moe_layers,
            experts_per_layer,
            top_k,
            total_experts: slabs.len(),
            slab_bytes,
            slot_bytes: round_up(slab_bytes),
            expert_bytes: slabs.iter().map(|s| s.nbytes).sum(),
            dense_bytes: super::dense::dense_bytes(file),
        }
    }

    /// The smallest budget that can run the model: K + 1 slots.
    pub(crate) fn min_budget(&self) -> u64 {
        (self.top_k as u64 + 1) * self.slot_bytes
    }

    /// Slots a budget pays for; `None` when it holds every expert (no
    /// streaming needed); an error below K + 1 slots.
    pub(crate) fn slots_for(&self, budget: u64) -> Result<Option<usize>> {
        if self.total_experts == 0 || self.slot_bytes == 0 {
            return Ok(None);
        }
        let slots = budget / self.slot_bytes;
        if slots >= self.total_experts as u64 || budget >= self.expert_bytes {
            return Ok(None);
        }
        if slots < self.top_k as u64 + 1 {
            return Err(Error::InvalidInput(format!(
                "ram_budget of {} holds {slots} expert(s) of {} each, but this model needs room for at least top_k + 1 = {} \
                 experts ({}) to stream; the whole set of routed experts is {}",
                human(budget),
                human(self.slot_bytes),
                self.top_k + 1,
                human(self.min_budget()),
                human(self.expert_bytes),
            )));
        }
        Ok(Some(slots as usize))
    }

    /// How many of `slots` the hot set may take: half, leaving at least
    /// K + 1 for the LRU part.
    pub(crate) fn pin_capacity(&self, slots: usize) -> usize {
        (slots / 2).min(slots.saturating_sub(self.top_k + 1))
    }
}

/// `n` bytes in the largest binary unit that keeps it ≥ 1 (e.g. "1.50 GiB").
pub fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

/// What a budget does to a model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// The budget asked for (bytes), if any.
    pub budget: Option<u64>,
    /// Whether routed experts stream (false: everything resident via the mapping).
    pub streams: bool,
    /// Model file size.
    pub file_bytes: u64,
    /// The dense part: embeddings, attention, norms, routers, shared
    /// experts, lm_head. Always resident, on top of the budget.
    pub dense_bytes: u64,
    /// All routed experts together.
    pub expert_bytes: u64,
    /// Routed experts in the model.
    pub experts: usize,
    /// Layers with routed experts.
    pub moe_layers: usize,
    /// Experts chosen per token per layer (K).
    pub top_k: usize,
    /// Bytes of one expert slab.
    pub slab_bytes: u64,
    /// Bytes of one cache slot (a slab rounded up to a page).
    pub slot_bytes: u64,
    /// Smallest budget that can run this model (K + 1 slots).
    pub min_budget: u64,
    /// Cache slots the budget pays for (0 when not streaming).
    pub slots: usize,
    /// Slots the hot set may take (when a heat file is available).
    pub pinned_slots: usize,
    /// Memory for weights while running: the dense part plus the slots
    /// (or plus every expert when resident).
    pub resident_bytes: u64,
    /// Expert bytes that live only in the file at any moment.
    pub streamed_bytes: u64,
    /// Expected fraction of expert lookups served from RAM when decoding.
    pub expected_hit_rate: f64,
    /// Expected bytes read from the file per decoded token.
    pub expected_bytes_per_token: f64,
    /// What the estimate assumes: "resident", "uniform routing" or "heat file".
    pub estimate: String,
    /// Notes (e.g. an ignored heat file).
    pub warnings: Vec<String>,
    /// Sequence state every token adds (KV caches, with the default cache
    /// type: f16 for block-quantised weights, else f32), over all layers.
    pub state_bytes_per_token: u64,
    /// Sequence state fixed per sequence whatever its length (the
    /// linear-attention layers' recurrent states; 0 for attention-only models).
    pub state_bytes_per_sequence: u64,
}

/// The plan for `file` under `budget` (bytes of RAM for routed experts).
/// With `heat`, the hit rate assumes the cache holds each layer's hottest
/// experts (what pinning plus LRU converge to); without, that routing is
/// uniform. Errors exactly as opening with that budget would.
pub fn plan(file: &ColibriFile, budget: Option<u64>, heat: Option<&Heat>) -> Result<Plan> {
    let g = Geometry::of(file);
    let slots = match budget {
        Some(b) => g.slots_for(b)?,
        None => None,
    };
    let cfg = &file.meta().config;
    let kv_bytes = if file.meta().tensors.iter().any(|t| t.dtype.is_quantized()) { 2 } else { 4 };
    let state = crate::canonical::state::StateLayout::new(cfg, kv_bytes, crate::canonical::state::DEFAULT_CHUNK);
    let mut p = Plan {
        state_bytes_per_token: state.bytes_per_token as u64,
        state_bytes_per_sequence: state.bytes_per_sequence as u64,
        budget,
        streams: slots.is_some(),
        file_bytes: file.file_len(),
        dense_bytes: g.dense_bytes,
        expert_bytes: g.expert_bytes,
        experts: g.total_experts,
        moe_layers: g.moe_layers,
        top_k: g.top_k,
        slab_bytes: g.slab_bytes,
        slot_bytes: g.slot_bytes,
        min_budget: g.min_budget(),
        slots: 0,
        pinned_slots: 0,
        resident_bytes: g.dense_bytes + g.expert_bytes,
        streamed_bytes: 0,
        expected_hit_rate: 1.0,
        expected_bytes_per_token: 0.0,
        estimate: "resident".into(),
        warnings: Vec::new(),
    };
    let Some(slots) = slots else { return Ok(p) };
    p.slots = slots;
    p.resident_bytes = g.dense_bytes + slots as u64 * g.slot_bytes;
    p.streamed_bytes = g.expert_bytes.saturating_sub(slots as u64 * g.slab_bytes);
    // Each MoE layer gets an even share of the slots.
    let e = g.experts_per_layer as f64;
    let share = (slots as f64 / g.moe_layers.max(1) as f64).min(e);
    if share < g.top_k as f64 {
        // A layer's share cannot hold one token's experts: each token's later
        // experts evict its earlier ones, so almost nothing survives to the
        // next token, whatever the policy (measured: LRU hit 0.02 at 6 slots
        // per layer for top-8, where the estimate below says 0.10).
        p.warnings.push(format!(
            "this budget gives each MoE layer {share:.1} slots, fewer than the {} experts a token uses; \
             expect almost no cache hits (the estimate below is optimistic): at least {} bytes \
             would keep one token's experts of every layer",
            g.top_k,
            g.top_k as u64 * g.moe_layers as u64 * g.slot_bytes
        ));
    }
    let mut hit_sum = 0.0;
    let mut bytes = 0.0;
    let heat = heat.filter(|h| h.layers == cfg.num_layers() && h.experts == g.experts_per_layer);
    for (l, spec) in cfg.layers.iter().enumerate() {
        if !matches!(spec.ffn, FfnSpec::Moe) || !file.holds_layer(l) {
            continue;
        }
        let hit = match heat {
            Some(h) => {
                let mut counts: Vec<u64> = (0..g.experts_per_layer).map(|x| h.get(l, x)).collect();
                let total: u64 = counts.iter().sum();
                if total == 0 {
                    share / e
                } else {
                    counts.sort_unstable_by(|a, b| b.cmp(a));
                    let whole = share.floor() as usize;
                    let mut mass: f64 = counts[..whole].iter().sum::<u64>() as f64;
                    if whole < counts.len() {
                        mass += (share - whole as f64) * counts[whole] as f64;
                    }
                    mass / total as f64
                }
            }
            None => share / e,
        };
        hit_sum += hit;
        bytes += g.top_k as f64 * (1.0 - hit) * g.slab_bytes as f64;
    }
    p.expected_hit_rate = hit_sum / g.moe_layers.max(1) as f64;
    p.expected_bytes_per_token = bytes;
    p.estimate = if heat.is_some() { "heat file" } else { "uniform routing" }.into();
    if heat.is_some() {
        p.pinned_slots = g.pin_capacity(slots);
    }
    Ok(p)
}

/// Opens `path` and plans `budget`, using the heat file beside the model if
/// there is a valid one (an invalid one becomes a warning in the plan).
pub fn plan_path(path: &std::path::Path, budget: Option<u64>) -> Result<Plan> {
    let file = ColibriFile::open(path)?;
    let id = super::heat::ModelIdentity::of(&file).map_err(|e| Error::io(path, e))?;
    let (heat, warning) = match load_heat(&heat_path_for(path), &file, id) {
        Ok(h) => (h, None),
        Err(w) => (None, Some(w)),
    };
    let mut p = plan(&file, budget, heat.as_ref())?;
    p.warnings.extend(warning);
    Ok(p)
}
