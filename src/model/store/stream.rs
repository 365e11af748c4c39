//! The RAM-budgeted expert store: a fixed pool of slots, allocated once,
//! filled by positioned reads of whole expert slabs.
//!
//! Each slot is in one of four states, changed only under the state mutex:
//!
//! ```text
//! Vacant ──assign──► Unloaded ──a reader claims it──► Reading ──ok──► Ready
//!    ▲                  ▲                                 │  error      │
//!    └──evict/vacate────┴─────────────────────────────────┘◄────────────┘ (evict when refs = 0)
//! ```
//!
//! A [`Lease`] holds a reference count on its slot; a slot with references
//! is never evicted or overwritten, so a view of it stays valid until the
//! lease drops. Exactly one thread at a time reads into a slot (the one that
//! moved it to `Reading`); everyone else who needs it waits on a condition
//! variable. A failed read puts the slot back to `Unloaded`, so the next
//! user retries and sees its own error; partial bytes are never served.
//!
//! Who reads: the compute worker that first views a leased expert (so the K
//! experts of a token are read in parallel, by the workers about to run
//! them), or a background I/O thread working through prefetch predictions.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;

use super::heat::ModelIdentity;
use super::telemetry::{StoreCounters, StoreStats};
use super::{ExpertStore, ExpertView, Lease, Place, Policy, busy};
use crate::canonical::tensors::{ExpertTensor, TensorId};
use crate::error::{Error, Result};
use crate::format::reader::ColibriFile;
use crate::io::{self, AlignedBuf, IoMode, read_full, round_up};
use crate::kernels::Matrix;
use crate::quant::DType;

const NONE: u32 = u32::MAX;

/// Where one matrix of an expert sits inside its slab.
#[derive(Clone, Copy, Debug)]
struct MatLoc {
    rel: usize,
    len: usize,
    dtype: DType,
    rows: usize,
    cols: usize,
}

/// Where one expert sits in the file.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExpertLoc {
    /// Absolute offset of the slab (page aligned).
    pub(crate) off: u64,
    /// Slab length.
    pub(crate) len: u64,
    /// Gate, up, down, then (when `biased`) their biases.
    mats: [MatLoc; 6],
    biased: bool,
}

/// Every routed expert's slab and matrices, `[layer][expert]` (empty rows
/// for dense layers), checked so that a slot holding the slab yields valid
/// matrix views.
pub(crate) fn expert_locs(file: &ColibriFile) -> Result<Vec<Vec<ExpertLoc>>> {
    let cfg = &file.meta().config;
    let bad = |m: String| Error::format(file.path(), m);
    let mut out = Vec::with_capacity(cfg.num_layers());
    for l in 0..cfg.num_layers() {
        let n = if file.holds_layer(l) { cfg.experts_in_layer(l) } else { 0 };
        let mut layer = Vec::with_capacity(n);
        for e in 0..n {
            let (off, len) = file.expert_slab(l, e).ok_or_else(|| bad(format!("expert slab ({l}, {e}) is missing")))?;
            let mut mats = [MatLoc { rel: 0, len: 0, dtype: DType::F32, rows: 0, cols: 0 }; 6];
            let biased = cfg.moe.as_ref().is_some_and(|m| m.expert_bias);
            let which_all = ExpertTensor::ALL.into_iter().chain(ExpertTensor::BIASES);
            for (m, which) in mats.iter_mut().zip(which_all).take(if biased { 6 } else { 3 }) {
                let name = TensorId::Expert(l, e, which).to_string();
                let i = file.index_of(&name).ok_or_else(|| bad(format!("tensor {name} is missing")))?;
                let t = &file.meta().tensors[i];
                let (rows, cols) = match t.shape.as_slice() {
                    [r, c] => (*r, *c),
                    [c] => (1, *c),
                    s => return Err(bad(format!("tensor {name}: expected 1 or 2 dimensions, got {s:?}"))),
                };
                let abs = file.data_offset() + t.offset;
                // The reader checked the tensor lies inside its slab.
                *m = MatLoc { rel: (abs - off) as usize, len: t.nbytes as usize, dtype: t.dtype, rows, cols };
                if !m.rel.is_multiple_of(t.dtype.align()) || m.rel + m.len > len as usize {
                    return Err(bad(format!("tensor {name}: misplaced inside its expert slab")));
                }
            }
            layer.push(ExpertLoc { off, len, mats, biased });
        }
        out.push(layer);
    }
    Ok(out)
}

/// What the store is built with (decided by `super::place`).
pub(crate) struct StreamSetup {
    /// The model's identity, read at open.
    pub(crate) identity: ModelIdentity,
    pub(crate) budget: u64,
    pub(crate) slots: usize,
    pub(crate) slot_bytes: usize,
    pub(crate) policy: Policy,
    pub(crate) io: IoMode,
    pub(crate) io_threads: usize,
    /// Experts to pin, hottest first.
    pub(crate) pinned: Vec<(usize, usize)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Vacant,
    Unloaded,
    Reading,
    Ready,
}

#[derive(Clone, Copy, Debug)]
struct SlotMeta {
    key: Option<(u32, u32)>,
    state: SlotState,
    refs: u32,
    last: u64,
    pinned: bool,
    /// Loaded by the prefetcher and not yet used.
    prefetched: bool,
}

struct State {
    slots: Vec<SlotMeta>,
    /// `[layer][expert]` → slot, or NONE.
    index: Vec<Vec<u32>>,
    /// Unpinned slots assigned to each layer.
    held: Vec<usize>,
    tick: u64,
    /// Prefetch requests, (layer, expert).
    queue: VecDeque<(u32, u32)>,
    queue_cap: usize,
    /// The latest prediction per layer, cleared as experts are used.
    predicted: Vec<Vec<bool>>,
    prefetched_unused: usize,
    /// Threads blocked on `changed`.
    waiters: usize,
    shutdown: bool,
}

impl State {
    fn assign(&mut self, s: usize, l: usize, e: usize, tick: u64) {
        let m = &mut self.slots[s];
        debug_assert!(m.key.is_none() && m.refs == 0);
        *m = SlotMeta { key: Some((l as u32, e as u32)), state: SlotState::Unloaded, last: tick, ..*m };
        self.index[l][e] = s as u32;
        if !m.pinned {
            self.held[l] += 1;
        }
    }

    fn vacate(&mut self, s: usize, c: &StoreCounters) {
        let m = &mut self.slots[s];
        debug_assert!(!m.pinned && m.refs == 0);
        if let Some((l, e)) = m.key.take() {
            self.index[l as usize][e as usize] = NONE;
            self.held[l as usize] -= 1;
        }
        m.state = SlotState::Vacant;
        if m.prefetched {
            m.prefetched = false;
            self.prefetched_unused -= 1;
            c.prefetch_reads_wasted.fetch_add(1, Relaxed);
        }
    }

    /// The slot to (re)use for an expert of layer `l`: a vacant one, else the
    /// least recently used evictable one, preferring layer `l`'s own when it
    /// already holds its share (`quota`) and otherwise layers above theirs,
    /// so every layer keeps a fair part of the cache (per-layer LRU). The
    /// prefetcher never evicts another prefetched expert, nor one the router
    /// predicted for its layer (it would evict what it is about to need).
    fn victim(&self, l: usize, for_prefetch: bool, quota: usize) -> Option<usize> {
        let mut best: Option<(u8, bool, u64, usize)> = None;
        for (s, m) in self.slots.iter().enumerate() {
            if m.pinned || m.refs > 0 {
                continue;
            }
            let Some((ml, me)) = m.key else { return Some(s) };
            if m.state == SlotState::Reading
                || (for_prefetch && (m.prefetched || self.predicted[ml as usize][me as usize]))
            {
                continue;
            }
            let ml = ml as usize;
            let class = if ml == l && self.held[l] >= quota {
                0
            } else if self.held[ml] > quota {
                1
            } else {
                2
            };
            let key = (class, m.prefetched, m.last, s);
            if best.is_none_or(|b| key < b) {
                best = Some(key);
            }
        }
        best.map(|b| b.3)
    }
}

/// State shared by the store, its leases and its I/O threads.
pub(crate) struct Shared {
    path: PathBuf,
    identity: ModelIdentity,
    data_off: u64,
    io: IoMode,
    file: RwLock<Arc<File>>,
    experts: Vec<Vec<ExpertLoc>>,
    slot_bytes: usize,
    mem: AlignedBuf,
    state: Mutex<State>,
    /// A slot changed state or lost its last reference.
    changed: Condvar,
    /// The prefetch queue has work, or shutdown.
    work: Condvar,
    counters: StoreCounters,
    policy: Policy,
    quota: usize,
    prefetch_cap: usize,
}

fn nanos(t: Instant) -> u64 {
    t.elapsed().as_nanos().min(u64::MAX as u128) as u64
}

/// Opens `path` with `mode` and checks it is the model `identity` describes.
fn open_checked(path: &Path, mode: IoMode, identity: ModelIdentity, data_off: u64) -> std::io::Result<File> {
    let f = io::open(path, mode)?;
    let plain = File::open(path)?;
    if plain.metadata()?.len() != identity.file_len || ModelIdentity::read(&plain, data_off)? != identity {
        return Err(std::io::Error::other(
            "the file at this path is no longer the model that was opened (different length, metadata or weights)",
        ));
    }
    Ok(f)
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; if one ever did, the state
        // is still consistent at every unlock point, so carry on.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, cv: &Condvar, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        cv.wait(g).unwrap_or_else(PoisonError::into_inner)
    }

    /// Slot `s`'s bytes, shared.
    ///
    /// # Safety
    /// The caller holds a lease on `s` and has seen it `Ready`: nobody
    /// writes to a slot with references, or to a `Ready` slot.
    unsafe fn slot(&self, s: usize) -> &[u8] {
        debug_assert!((s + 1) * self.slot_bytes <= self.mem.len());
        // SAFETY: in bounds (slots × slot_bytes bytes were allocated); no
        // concurrent writer by the caller's contract.
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr().add(s * self.slot_bytes), self.slot_bytes) }
    }

    /// Slot `s`'s bytes, for the one reader.
    ///
    /// # Safety
    /// The caller moved `s` to `Reading` under the lock: until it leaves
    /// that state, no other thread reads or writes the slot's bytes.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot_mut(&self, s: usize) -> &mut [u8] {
        debug_assert!((s + 1) * self.slot_bytes <= self.mem.len());
        // SAFETY: in bounds; exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.mem.as_ptr().add(s * self.slot_bytes), self.slot_bytes) }
    }

    /// Reads expert (l, e)'s slab into `dst` (a slot or an overflow buffer).
    /// On failure, reopens the path once (the file may have been replaced by
    /// an identical copy) and retries.
    fn read_slab(&self, l: usize, e: usize, dst: &mut [u8]) -> std::io::Result<()> {
        let loc = self.experts[l][e];
        let need = loc.len as usize;
        let want = match self.io {
            IoMode::Buffered => need,
            IoMode::Direct => round_up(loc.len) as usize,
        };
        let dst = &mut dst[..want];
        let t0 = Instant::now();
        let f = self.file.read().unwrap_or_else(PoisonError::into_inner).clone();
        let mut r = read_full(&f, dst, loc.off, need);
        if r.is_err() && self.reopen(&f) {
            let f = self.file.read().unwrap_or_else(PoisonError::into_inner).clone();
            r = read_full(&f, dst, loc.off, need);
        }
        let c = &self.counters;
        c.read_ns.fetch_add(nanos(t0), Relaxed);
        if r.is_ok() {
            c.reads.fetch_add(1, Relaxed);
            c.bytes_read.fetch_add(want as u64, Relaxed);
            c.layers[l].bytes_read.fetch_add(want as u64, Relaxed);
        }
        r
    }

    /// Replaces the file handle `failed` with a fresh open of the path if it
    /// is still the same model; true if the caller should retry.
    fn reopen(&self, failed: &Arc<File>) -> bool {
        let mut g = self.file.write().unwrap_or_else(PoisonError::into_inner);
        if !Arc::ptr_eq(&g, failed) {
            return true; // another thread already reopened it
        }
        match open_checked(&self.path, self.io, self.identity, self.data_off) {
            Ok(f) => {
                *g = Arc::new(f);
                self.counters.reopens.fetch_add(1, Relaxed);
                true
            }
            Err(_) => false,
        }
    }

    fn read_error(&self, l: usize, e: usize, source: std::io::Error) -> Error {
        self.counters.read_errors.fetch_add(1, Relaxed);
        Error::ExpertRead { path: self.path.clone(), layer: l, expert: e, source }
    }

    fn note_lookup(&self, st: &mut State, l: usize, e: usize, hit: bool) {
        let c = &self.counters.layers[l];
        if hit { &c.hits } else { &c.misses }.fetch_add(1, Relaxed);
        if std::mem::take(&mut st.predicted[l][e]) {
            self.counters.predicted_used.fetch_add(1, Relaxed);
        }
    }

    fn lease(self: &Arc<Self>, l: usize, e: usize, mode: super::LeaseMode) -> Result<Option<Lease>> {
        let mut st = self.lock();
        let mut waited = false;
        loop {
            st.tick += 1;
            let tick = st.tick;
            let at = st.index[l][e];
            if at != NONE {
                let s = at as usize;
                let m = &mut st.slots[s];
                let hit = m.state != SlotState::Unloaded;
                if m.state == SlotState::Reading {
                    self.counters.hits_in_flight.fetch_add(1, Relaxed);
                }
                m.refs += 1;
                m.last = tick;
                if std::mem::take(&mut m.prefetched) {
                    st.prefetched_unused -= 1;
                    self.counters.prefetch_reads_used.fetch_add(1, Relaxed);
                }
                self.note_lookup(&mut st, l, e, hit);
                return Ok(Some(Lease::new(l, e, Place::Slot { shared: self.clone(), slot: s as u32 })));
            }
            if let Some(s) = st.victim(l, false, self.quota) {
                if st.slots[s].key.is_some() {
                    st.vacate(s, &self.counters);
                }
                st.assign(s, l, e, tick);
                st.slots[s].refs = 1;
                self.note_lookup(&mut st, l, e, false);
                return Ok(Some(Lease::new(l, e, Place::Slot { shared: self.clone(), slot: s as u32 })));
            }
            if mode == super::LeaseMode::IfFree {
                return Ok(None);
            }
            if busy() || rayon::current_thread_index().is_some() {
                // A compute worker never blocks for a slot: while it waits in
                // a join it may run another session's job (rayon steals and
                // injects work), and the leases that job would wait for can
                // belong to the very session this worker is part-way through,
                // a deadlock seen with four sessions on one two-thread pool.
                // So a worker reads into a buffer of its own instead (counted
                // as an overflow read; freed when the lease drops). Threads
                // outside the pool still wait for a slot.
                self.note_lookup(&mut st, l, e, false);
                drop(st);
                self.counters.overflow_reads.fetch_add(1, Relaxed);
                let mut buf = AlignedBuf::zeroed(self.slot_bytes).ok_or_else(|| {
                    Error::InvalidInput(format!("cannot allocate {} bytes for an expert", self.slot_bytes))
                })?;
                let t0 = Instant::now();
                let r = self.read_slab(l, e, buf.as_mut_slice());
                self.counters.io_wait_ns.fetch_add(nanos(t0), Relaxed);
                r.map_err(|err| self.read_error(l, e, err))?;
                return Ok(Some(Lease::new(l, e, Place::Own(buf))));
            }
            if !waited {
                waited = true;
                self.counters.slot_waits.fetch_add(1, Relaxed);
            }
            st.waiters += 1;
            let t0 = Instant::now();
            st = self.wait(&self.changed, st);
            st.waiters -= 1;
            self.counters.slot_wait_ns.fetch_add(nanos(t0), Relaxed);
        }
    }

    /// Makes sure leased slot `s` holds expert (l, e): reads it if nobody
    /// has, waits if somebody is reading it.
    fn ensure_loaded(&self, s: usize, l: usize, e: usize) -> Result<()> {
        let mut st = self.lock();
        debug_assert_eq!(st.slots[s].key, Some((l as u32, e as u32)));
        loop {
            match st.slots[s].state {
                SlotState::Ready => return Ok(()),
                SlotState::Reading => {
                    st.waiters += 1;
                    let t0 = Instant::now();
                    st = self.wait(&self.changed, st);
                    st.waiters -= 1;
                    self.counters.io_wait_ns.fetch_add(nanos(t0), Relaxed);
                }
                SlotState::Unloaded => {
                    st.slots[s].state = SlotState::Reading;
                    drop(st);
                    // SAFETY: this thread moved `s` to Reading under the lock.
                    let dst = unsafe { self.slot_mut(s) };
                    let t0 = Instant::now();
                    let r = self.read_slab(l, e, dst);
                    self.counters.io_wait_ns.fetch_add(nanos(t0), Relaxed);
                    st = self.lock();
                    st.slots[s].state = if r.is_ok() { SlotState::Ready } else { SlotState::Unloaded };
                    if st.waiters > 0 {
                        self.changed.notify_all();
                    }
                    return r.map_err(|err| self.read_error(l, e, err));
                }
                SlotState::Vacant => {
                    return Err(Error::InvalidInput(format!(
                        "internal error: leased slot for expert {e} of layer {l} is vacant"
                    )));
                }
            }
        }
    }

    /// Drops one reference to slot `s` (called when a lease drops).
    pub(crate) fn release(&self, s: usize) {
        let mut st = self.lock();
        let m = &mut st.slots[s];
        m.refs -= 1;
        if m.refs == 0 && !m.pinned {
            // An expert nobody managed to read leaves nothing behind; without
            // the LRU policy, neither does one that was used.
            let stale = m.state == SlotState::Unloaded;
            let no_cache = !self.policy.lru && m.state == SlotState::Ready && !m.prefetched;
            if stale || no_cache {
                st.vacate(s, &self.counters);
            }
        }
        if st.waiters > 0 {
            self.changed.notify_all();
        }
    }

    fn views<'a>(&self, l: usize, e: usize, bytes: &'a [u8]) -> Result<ExpertView<'a>> {
        let loc = &self.experts[l][e];
        let m = |i: usize| {
            let ml = loc.mats[i];
            Matrix::new(ml.dtype, ml.rows, ml.cols, &bytes[ml.rel..ml.rel + ml.len]).ok_or_else(|| {
                Error::InvalidInput(format!("internal error: expert {e} of layer {l} is misaligned in its slot"))
            })
        };
        let bias = if loc.biased {
            let v = |i: usize| -> Result<&'a [f32]> {
                let b = m(i)?;
                bytemuck::try_cast_slice(b.bytes).map_err(|_| {
                    Error::InvalidInput(format!("internal error: a bias of expert {e} of layer {l} is misaligned"))
                })
            };
            Some([v(3)?, v(4)?, v(5)?])
        } else {
            None
        };
        Ok(ExpertView { gate: m(0)?, up: m(1)?, down: m(2)?, bias })
    }

    /// One step of an I/O thread: takes a request and reads it; false on shutdown.
    fn serve_one(&self) -> bool {
        let mut st = self.lock();
        let (l, e) = loop {
            if st.shutdown {
                return false;
            }
            if let Some((l, e)) = st.queue.pop_front() {
                break (l as usize, e as usize);
            }
            st = self.wait(&self.work, st);
        };
        let at = st.index[l][e];
        let (s, warm) = if at != NONE {
            // Present already; the one case to read is a pinned slot not yet
            // loaded (warm-up at open).
            let m = &mut st.slots[at as usize];
            if m.state != SlotState::Unloaded || m.refs > 0 {
                return true;
            }
            (at as usize, true)
        } else {
            let victim = if st.prefetched_unused < self.prefetch_cap { st.victim(l, true, self.quota) } else { None };
            let Some(s) = victim else {
                self.counters.prefetch_dropped.fetch_add(1, Relaxed);
                return true;
            };
            if st.slots[s].key.is_some() {
                st.vacate(s, &self.counters);
            }
            st.tick += 1;
            let tick = st.tick;
            st.assign(s, l, e, tick);
            st.slots[s].prefetched = true;
            st.prefetched_unused += 1;
            (s, false)
        };
        st.slots[s].refs += 1;
        st.slots[s].state = SlotState::Reading;
        drop(st);
        // SAFETY: this thread moved `s` to Reading under the lock.
        let r = self.read_slab(l, e, unsafe { self.slot_mut(s) });
        let c = &self.counters;
        match &r {
            Ok(()) if !warm => c.prefetch_reads.fetch_add(1, Relaxed),
            Ok(()) => 0,
            Err(_) => c.prefetch_errors.fetch_add(1, Relaxed),
        };
        let mut st = self.lock();
        let m = &mut st.slots[s];
        m.state = if r.is_ok() { SlotState::Ready } else { SlotState::Unloaded };
        m.refs -= 1;
        if r.is_err() && std::mem::take(&mut m.prefetched) {
            st.prefetched_unused -= 1;
        }
        let m = st.slots[s];
        if m.refs == 0 && !m.pinned && m.state == SlotState::Unloaded {
            st.vacate(s, c);
        }
        if st.waiters > 0 {
            self.changed.notify_all();
        }
        true
    }
}

/// Routed experts streamed from the file into a fixed pool of slots.
pub(crate) struct StreamStore {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    budget: u64,
    slots: usize,
    pinned: usize,
}

impl StreamStore {
    pub(crate) fn new(file: &ColibriFile, setup: StreamSetup) -> Result<StreamStore> {
        let path = file.path().to_path_buf();
        let experts = expert_locs(file)?;
        let (identity, data_off) = (setup.identity, file.data_offset());
        let handle = open_checked(&path, setup.io, identity, data_off).map_err(|e| match setup.io {
            IoMode::Direct => Error::InvalidInput(format!(
                "{}: unbuffered reads (io=direct) are not available for this file: {e}; use buffered reads",
                path.display()
            )),
            IoMode::Buffered => Error::io(&path, e),
        })?;
        let bytes = setup.slots.checked_mul(setup.slot_bytes).ok_or_else(|| {
            Error::InvalidInput(format!("{} slots of {} bytes overflow", setup.slots, setup.slot_bytes))
        })?;
        let mem = AlignedBuf::zeroed(bytes).ok_or_else(|| {
            Error::InvalidInput(format!("cannot allocate the expert cache of {bytes} bytes (ram_budget too large?)"))
        })?;
        let layers = experts.len();
        let moe_layers = experts.iter().filter(|l| !l.is_empty()).count().max(1);
        let total: usize = experts.iter().map(Vec::len).sum();
        let pinned = setup.pinned.len();
        let vacant =
            SlotMeta { key: None, state: SlotState::Vacant, refs: 0, last: 0, pinned: false, prefetched: false };
        let mut st = State {
            slots: vec![vacant; setup.slots],
            index: experts.iter().map(|l| vec![NONE; l.len()]).collect(),
            held: vec![0; layers],
            tick: 0,
            queue: VecDeque::with_capacity(total),
            queue_cap: total,
            predicted: experts.iter().map(|l| vec![false; l.len()]).collect(),
            prefetched_unused: 0,
            waiters: 0,
            shutdown: false,
        };
        for (s, &(l, e)) in setup.pinned.iter().enumerate() {
            st.slots[s].pinned = true;
            st.assign(s, l, e, 0);
        }
        let unpinned = setup.slots - pinned;
        let shared = Arc::new(Shared {
            path,
            identity,
            data_off,
            io: setup.io,
            file: RwLock::new(Arc::new(handle)),
            experts,
            slot_bytes: setup.slot_bytes,
            mem,
            state: Mutex::new(st),
            changed: Condvar::new(),
            work: Condvar::new(),
            counters: StoreCounters::new(layers),
            policy: setup.policy,
            quota: (unpinned / moe_layers).max(1),
            prefetch_cap: (unpinned / 2).max(1),
        });
        // Some filesystems accept O_DIRECT at open and refuse the reads: try one.
        let first_moe = shared.experts.iter().position(|x| !x.is_empty());
        if let (IoMode::Direct, Some(l)) = (setup.io, first_moe) {
            let mut probe = AlignedBuf::zeroed(setup.slot_bytes)
                .ok_or_else(|| Error::InvalidInput("cannot allocate a probe buffer".into()))?;
            shared.read_slab(l, 0, probe.as_mut_slice()).map_err(|err| {
                Error::InvalidInput(format!(
                    "{}: unbuffered reads (io=direct) fail on this file: {err}; use buffered reads",
                    shared.path.display()
                ))
            })?;
        }
        let mut store = StreamStore { shared, threads: Vec::new(), budget: setup.budget, slots: setup.slots, pinned };
        if setup.policy.prefetch || pinned > 0 {
            for i in 0..setup.io_threads.max(1) {
                let sh = store.shared.clone();
                let t = std::thread::Builder::new()
                    .name(format!("colibri-io-{i}"))
                    .spawn(move || while sh.serve_one() {})
                    .map_err(|e| Error::InvalidInput(format!("cannot start an I/O thread: {e}")))?;
                store.threads.push(t);
            }
            // Warm the hot set in the background.
            let mut st = store.shared.lock();
            for &(l, e) in &setup.pinned {
                st.queue.push_back((l as u32, e as u32));
            }
            drop(st);
            store.shared.work.notify_all();
        }
        Ok(store)
    }
}

impl Drop for StreamStore {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl ExpertStore for StreamStore {
    fn lease(&self, layer: usize, expert: usize, mode: super::LeaseMode) -> Result<Option<Lease>> {
        self.shared.lease(layer, expert, mode)
    }

    fn view<'a>(&'a self, lease: &'a Lease) -> Result<ExpertView<'a>> {
        let (l, e) = (lease.layer(), lease.expert());
        match &lease.place {
            Place::Own(buf) => self.shared.views(l, e, buf.as_slice()),
            Place::Slot { shared, slot } if Arc::ptr_eq(shared, &self.shared) => {
                let s = *slot as usize;
                self.shared.ensure_loaded(s, l, e)?;
                // SAFETY: the lease holds a reference on `s` and it is Ready.
                let bytes = unsafe { self.shared.slot(s) };
                self.shared.views(l, e, bytes)
            }
            _ => Err(Error::InvalidInput("an expert lease was used with a store that did not issue it".into())),
        }
    }

    fn residency(&self, layer: usize, out: &mut String, experts: usize) {
        let st = self.shared.lock();
        let Some(index) = st.index.get(layer) else {
            out.extend(std::iter::repeat_n('.', experts));
            return;
        };
        out.extend(index.iter().map(|&s| match st.slots.get(s as usize) {
            Some(m) if m.pinned => 'P',
            Some(m) if m.state == SlotState::Ready => 'C',
            _ => '.',
        }));
    }

    fn begin_layer(&self, layer: usize) {
        let mut st = self.shared.lock();
        let before = st.queue.len();
        if before > 0 {
            // Predictions for this layer are stale now; warm-up reads of its
            // pinned experts are not (dropping them would turn each into a
            // demand read later).
            let State { queue, index, slots, .. } = &mut *st;
            queue.retain(|&(l, e)| {
                let at = index[l as usize][e as usize];
                l as usize != layer || (at != NONE && slots[at as usize].pinned)
            });
            let dropped = (before - st.queue.len()) as u64;
            self.shared.counters.prefetch_dropped.fetch_add(dropped, Relaxed);
        }
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        if !self.shared.policy.prefetch {
            return;
        }
        let mut st = self.shared.lock();
        st.predicted[layer].fill(false);
        let mut queued = false;
        for &e in experts {
            st.predicted[layer][e as usize] = true;
            if st.index[layer][e as usize] == NONE {
                if st.queue.len() < st.queue_cap {
                    st.queue.push_back((layer as u32, e));
                    queued = true;
                } else {
                    self.shared.counters.prefetch_dropped.fetch_add(1, Relaxed);
                }
            }
        }
        drop(st);
        self.shared.counters.predicted.fetch_add(experts.len() as u64, Relaxed);
        if queued {
            self.shared.work.notify_all();
        }
    }

    fn wants_prefetch(&self) -> bool {
        self.shared.policy.prefetch
    }

    fn stats(&self) -> StoreStats {
        let sh = &self.shared;
        let mut s = StoreStats {
            streaming: true,
            io: sh.io,
            policy: sh.policy,
            budget_bytes: self.budget,
            slot_bytes: sh.slot_bytes as u64,
            slots: self.slots,
            pinned: self.pinned,
            ..Default::default()
        };
        sh.counters.fill(&mut s);
        s
    }
}
