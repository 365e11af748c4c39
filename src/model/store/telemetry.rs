//! What the router and the expert store did, counted while running and
//! reported as plain serialisable structs ([`RoutingStats`], [`StoreStats`]).
//!
//! Counting is lock-free: relaxed atomics per layer and expert, bumped by the
//! thread that routes a chunk (K increments per token and layer). Totals are
//! exact; a snapshot taken while another thread runs may mix before and after.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

use super::Policy;
use crate::error::{Error, Result};
use crate::io::IoMode;

/// Buckets of the top-1/top-2 margin histogram, evenly spaced over [0, 1].
pub const MARGIN_BUCKETS: usize = 10;
/// Fixed-point scale of summed margins.
const MARGIN_SCALE: f64 = 1e9;

/// Routing counters of one layer.
pub(crate) struct LayerTelemetry {
    /// Times each expert was chosen.
    pub(crate) counts: Vec<AtomicU64>,
    /// Tokens routed.
    tokens: AtomicU64,
    /// Σ (p_top1 − p_top2) in units of 1/MARGIN_SCALE.
    margin_sum: AtomicU64,
    margin_hist: [AtomicU64; MARGIN_BUCKETS],
}

impl LayerTelemetry {
    fn new(experts: usize) -> LayerTelemetry {
        LayerTelemetry {
            counts: (0..experts).map(|_| AtomicU64::new(0)).collect(),
            tokens: AtomicU64::new(0),
            margin_sum: AtomicU64::new(0),
            margin_hist: Default::default(),
        }
    }

    /// One token's routing: its chosen experts and the probability margin
    /// between its first and second choice.
    #[inline]
    pub(crate) fn record(&self, ids: &[u32], margin: f32) {
        for &e in ids {
            self.counts[e as usize].fetch_add(1, Relaxed);
        }
        self.tokens.fetch_add(1, Relaxed);
        let m = margin.clamp(0.0, 1.0) as f64;
        self.margin_sum.fetch_add((m * MARGIN_SCALE) as u64, Relaxed);
        let b = ((m * MARGIN_BUCKETS as f64) as usize).min(MARGIN_BUCKETS - 1);
        self.margin_hist[b].fetch_add(1, Relaxed);
    }
}

/// Routing counters of a model, always on (resident or streaming).
pub(crate) struct Telemetry {
    /// Tokens that went through the forward pass.
    pub(crate) tokens: AtomicU64,
    /// One per decoder layer; dense layers have no experts.
    pub(crate) layers: Vec<LayerTelemetry>,
}

impl Telemetry {
    /// Counters for `experts_per_layer[l]` experts in layer l.
    pub(crate) fn new(experts_per_layer: impl Iterator<Item = usize>) -> Telemetry {
        Telemetry { tokens: AtomicU64::new(0), layers: experts_per_layer.map(LayerTelemetry::new).collect() }
    }

    /// This run's count of expert e of layer l.
    pub(crate) fn count(&self, l: usize, e: usize) -> u64 {
        self.layers[l].counts[e].load(Relaxed)
    }

    pub(crate) fn snapshot(&self) -> RoutingStats {
        let layers = self
            .layers
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.counts.is_empty())
            .map(|(layer, t)| {
                LayerRouting::from_counts(
                    layer,
                    t.tokens.load(Relaxed),
                    t.counts.iter().map(|c| c.load(Relaxed)).collect(),
                    t.margin_sum.load(Relaxed) as f64 / MARGIN_SCALE,
                    t.margin_hist.iter().map(|h| h.load(Relaxed)).collect(),
                )
            })
            .collect();
        RoutingStats { tokens: self.tokens.load(Relaxed), layers }
    }
}

/// An expert is overloaded when chosen more than this many times its
/// uniform share of a layer's choices.
pub const OVERLOAD_FACTOR: f64 = 3.0;

/// Routing telemetry of a model (`Engine.routing_stats()`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoutingStats {
    /// Tokens that went through the forward pass since the model was opened.
    pub tokens: u64,
    /// One entry per MoE layer.
    pub layers: Vec<LayerRouting>,
}

impl RoutingStats {
    /// The routing of the tokens run between `earlier` (a snapshot of the
    /// same model) and this snapshot: counts subtracted, the derived figures
    /// (entropy, margins, dead and overloaded experts) computed again over
    /// that window. An `earlier` that does not fit (other layers or experts,
    /// or counts above these) is an [`Error::InvalidInput`].
    pub fn since(&self, earlier: &RoutingStats) -> Result<RoutingStats> {
        let bad = |what: &str| Error::InvalidInput(format!("routing stats to diff against {what}"));
        if earlier.tokens > self.tokens || earlier.layers.len() != self.layers.len() {
            return Err(bad("are not an earlier snapshot of this model"));
        }
        let sub = |a: &[u64], b: &[u64]| -> Result<Vec<u64>> {
            if a.len() != b.len() {
                return Err(bad("have other experts"));
            }
            a.iter().zip(b).map(|(&x, &y)| x.checked_sub(y).ok_or_else(|| bad("count more than now"))).collect()
        };
        let layers = self
            .layers
            .iter()
            .zip(&earlier.layers)
            .map(|(now, then)| {
                if now.layer != then.layer || then.tokens > now.tokens {
                    return Err(bad("are not an earlier snapshot of this model"));
                }
                let mut l = LayerRouting::from_counts(
                    now.layer,
                    now.tokens - then.tokens,
                    sub(&now.heat, &then.heat)?,
                    (now.margin_sum - then.margin_sum).max(0.0),
                    sub(&now.margin_histogram, &then.margin_histogram)?,
                );
                l.residency.clone_from(&now.residency);
                Ok(l)
            })
            .collect::<Result<_>>()?;
        Ok(RoutingStats { tokens: self.tokens - earlier.tokens, layers })
    }
}

/// Routing telemetry of one MoE layer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerRouting {
    /// Decoder layer index.
    pub layer: usize,
    /// Tokens routed through this layer.
    pub tokens: u64,
    /// Times each expert was chosen (its heat), indexed by expert.
    pub heat: Vec<u64>,
    /// Shannon entropy of the experts' share of choices, in bits.
    #[serde(default)]
    pub entropy_bits: f64,
    /// The same divided by log2(E): 1 = every expert used equally, 0 = one
    /// expert takes everything (or nothing routed yet).
    #[serde(default)]
    pub entropy: f64,
    /// Σ over tokens of p(first choice) − p(second choice), router softmax
    /// probabilities before any renormalisation.
    pub margin_sum: f64,
    /// `margin_sum / tokens`. Small margins mean routing decisions that a
    /// tiny numerical change could flip.
    #[serde(default)]
    pub mean_margin: f64,
    /// Tokens per margin bucket: bucket i holds margins in [i/10, (i+1)/10).
    pub margin_histogram: Vec<u64>,
    /// Experts never chosen (empty until a token has been routed).
    #[serde(default)]
    pub dead: Vec<usize>,
    /// Experts chosen more than [`OVERLOAD_FACTOR`] times their uniform share.
    #[serde(default)]
    pub overloaded: Vec<usize>,
    /// The busiest expert's count over its uniform share (1 = perfectly
    /// balanced; 0 before any token).
    #[serde(default)]
    pub max_load: f64,
    /// Where each expert's weights are now, one character per expert:
    /// `R` resident (the whole model is mapped), `P` pinned in the cache,
    /// `C` in the cache, `.` on disk (read when chosen).
    #[serde(default)]
    pub residency: String,
}

impl LayerRouting {
    /// A layer's figures from its raw counts.
    pub fn from_counts(layer: usize, tokens: u64, heat: Vec<u64>, margin_sum: f64, hist: Vec<u64>) -> LayerRouting {
        let total: u64 = heat.iter().sum();
        let experts = heat.len();
        let entropy_bits: f64 = if total == 0 {
            0.0
        } else {
            heat.iter()
                .filter(|&&c| c > 0)
                .map(|&c| {
                    let p = c as f64 / total as f64;
                    -p * crate::math::log2(p)
                })
                .sum()
        };
        let max_bits = crate::math::log2(experts as f64);
        let uniform = total as f64 / experts.max(1) as f64;
        let (dead, overloaded, max_load) = if total == 0 {
            (Vec::new(), Vec::new(), 0.0)
        } else {
            let pick =
                |f: &dyn Fn(u64) -> bool| heat.iter().enumerate().filter(|&(_, &c)| f(c)).map(|(e, _)| e).collect();
            let max = heat.iter().copied().max().unwrap_or(0);
            (pick(&|c| c == 0), pick(&|c| c as f64 > OVERLOAD_FACTOR * uniform), max as f64 / uniform)
        };
        LayerRouting {
            layer,
            tokens,
            entropy_bits,
            entropy: if max_bits > 0.0 { entropy_bits / max_bits } else { 0.0 },
            margin_sum,
            mean_margin: if tokens > 0 { margin_sum / tokens as f64 } else { 0.0 },
            margin_histogram: hist,
            dead,
            overloaded,
            max_load,
            residency: String::new(),
            heat,
        }
    }
}

/// Counters of one layer of a streaming store.
#[derive(Default)]
pub(crate) struct LayerCounters {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
}

/// Counters of a streaming store.
#[derive(Default)]
pub(crate) struct StoreCounters {
    pub(crate) reads: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) read_ns: AtomicU64,
    pub(crate) io_wait_ns: AtomicU64,
    pub(crate) slot_wait_ns: AtomicU64,
    pub(crate) slot_waits: AtomicU64,
    pub(crate) overflow_reads: AtomicU64,
    pub(crate) read_errors: AtomicU64,
    pub(crate) reopens: AtomicU64,
    pub(crate) predicted: AtomicU64,
    pub(crate) predicted_used: AtomicU64,
    pub(crate) prefetch_reads: AtomicU64,
    pub(crate) prefetch_reads_used: AtomicU64,
    pub(crate) prefetch_reads_wasted: AtomicU64,
    pub(crate) prefetch_dropped: AtomicU64,
    pub(crate) prefetch_errors: AtomicU64,
    pub(crate) hits_in_flight: AtomicU64,
    pub(crate) layers: Vec<LayerCounters>,
}

impl StoreCounters {
    pub(crate) fn new(layers: usize) -> StoreCounters {
        StoreCounters { layers: (0..layers).map(|_| LayerCounters::default()).collect(), ..Default::default() }
    }

    /// The counters as a report (store geometry filled in by the caller).
    pub(crate) fn fill(&self, s: &mut StoreStats) {
        let g = |a: &AtomicU64| a.load(Relaxed);
        let secs = |a: &AtomicU64| a.load(Relaxed) as f64 * 1e-9;
        s.layers = self
            .layers
            .iter()
            .enumerate()
            .filter(|(_, c)| g(&c.hits) + g(&c.misses) > 0)
            .map(|(layer, c)| LayerStoreStats {
                layer,
                hits: g(&c.hits),
                misses: g(&c.misses),
                bytes_read: g(&c.bytes_read),
            })
            .collect();
        s.hits = s.layers.iter().map(|l| l.hits).sum();
        s.misses = s.layers.iter().map(|l| l.misses).sum();
        s.lookups = s.hits + s.misses;
        s.hits_in_flight = g(&self.hits_in_flight);
        s.hit_rate = ratio(s.hits, s.lookups);
        s.reads = g(&self.reads);
        s.bytes_read = g(&self.bytes_read);
        s.read_seconds = secs(&self.read_ns);
        s.io_wait_seconds = secs(&self.io_wait_ns);
        s.slot_wait_seconds = secs(&self.slot_wait_ns);
        s.slot_waits = g(&self.slot_waits);
        s.overflow_reads = g(&self.overflow_reads);
        s.read_errors = g(&self.read_errors);
        s.reopens = g(&self.reopens);
        s.prefetch_predicted = g(&self.predicted);
        s.prefetch_predicted_used = g(&self.predicted_used);
        s.prefetch_accuracy = ratio(s.prefetch_predicted_used, s.prefetch_predicted);
        s.prefetch_reads = g(&self.prefetch_reads);
        s.prefetch_reads_used = g(&self.prefetch_reads_used);
        s.prefetch_reads_wasted = g(&self.prefetch_reads_wasted);
        s.prefetch_dropped = g(&self.prefetch_dropped);
        s.prefetch_errors = g(&self.prefetch_errors);
    }
}

pub(crate) fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// What the expert store did (`colibri stats`). Counters start at zero when
/// the model is opened; diff two snapshots to measure a stretch of work.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StoreStats {
    /// Routed experts are read from the file into a RAM budget (false: all
    /// resident through the mapping, and every lookup is a hit).
    pub streaming: bool,
    /// Buffered or unbuffered reads.
    pub io: IoMode,
    /// The policies in force.
    pub policy: Policy,
    /// The RAM budget for routed experts, in bytes (0 when resident).
    pub budget_bytes: u64,
    /// Bytes of one slot (an expert slab rounded up to a page).
    pub slot_bytes: u64,
    /// Slots in the cache (allocated once at open).
    pub slots: usize,
    /// Slots reserved for the hot set chosen from the heat file.
    pub pinned: usize,
    /// Expert lookups by the MoE block (one per unique expert per chunk).
    pub lookups: u64,
    /// Lookups that found the expert in a slot, loaded or being loaded.
    pub hits: u64,
    /// Of the hits, those whose read (a prefetch or a warm-up) was still in
    /// flight: no bytes were read for them, but the compute waited.
    pub hits_in_flight: u64,
    /// Lookups that had to read the expert.
    pub misses: u64,
    /// hits / lookups.
    pub hit_rate: f64,
    /// Forward-pass tokens since open.
    pub tokens: u64,
    /// Positioned reads of expert slabs (on any thread, prefetch included).
    pub reads: u64,
    /// Bytes those reads fetched.
    pub bytes_read: u64,
    /// bytes_read / tokens.
    pub bytes_read_per_token: f64,
    /// Time spent inside reads, summed over all threads.
    pub read_seconds: f64,
    /// Time compute threads were blocked on expert bytes: their own reads
    /// and waits for reads in flight on the I/O threads.
    pub io_wait_seconds: f64,
    /// Time spent waiting for a free slot (only when every slot is in use).
    pub slot_wait_seconds: f64,
    /// How many times a free slot had to be waited for.
    pub slot_waits: u64,
    /// Reads into a temporary buffer beyond the budget, taken instead of
    /// waiting when waiting could deadlock (nested work on a busy thread).
    pub overflow_reads: u64,
    /// Reads that failed (the error went to the caller).
    pub read_errors: u64,
    /// Times the model file was reopened after a failed read (and found to
    /// be the same model).
    pub reopens: u64,
    /// Experts predicted by the one-layer-ahead router.
    pub prefetch_predicted: u64,
    /// Predicted experts that the layer then used.
    pub prefetch_predicted_used: u64,
    /// prefetch_predicted_used / prefetch_predicted.
    pub prefetch_accuracy: f64,
    /// Reads issued by the prefetcher.
    pub prefetch_reads: u64,
    /// Prefetched experts that were used before being evicted.
    pub prefetch_reads_used: u64,
    /// Prefetched experts evicted without being used.
    pub prefetch_reads_wasted: u64,
    /// Predictions not read: no slot could be spared, or the layer had
    /// already started.
    pub prefetch_dropped: u64,
    /// Prefetch reads that failed (the later lookup reads again and reports).
    pub prefetch_errors: u64,
    /// Per MoE layer.
    pub layers: Vec<LayerStoreStats>,
    /// Things the user should know (an ignored heat file, …).
    pub warnings: Vec<String>,
    /// Where the weights live: mapped, copied or streamed.
    pub weights: super::WeightsBacking,
}

/// Store counters of one MoE layer.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LayerStoreStats {
    /// Decoder layer index.
    pub layer: usize,
    /// Lookups served from a slot.
    pub hits: u64,
    /// Lookups that read.
    pub misses: u64,
    /// Bytes read for this layer.
    pub bytes_read: u64,
}
