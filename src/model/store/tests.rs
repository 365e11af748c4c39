//! The store's promise: placement never changes output. Every dtype, budgets
//! from K + 1 slots to all-but-resident, every policy combination, buffered
//! and direct reads, several threads and sessions at once: the same logits
//! and greedy tokens, bit for bit, as the resident model. Plus the budget
//! rules, heat files, telemetry and faults.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::model::Model;
use crate::model::forward::{Capture, forward};
use crate::model::session::Session;
use crate::quant::DType;
use crate::synth::{many_experts_config, write_random_model};

impl Policy {
    /// All eight combinations.
    fn all() -> impl Iterator<Item = Policy> {
        (0..8u8).map(|b| Policy { lru: b & 1 != 0, pin_hot: b & 2 != 0, prefetch: b & 4 != 0 })
    }
}

/// One expert held for as long as the guard lives.
struct ExpertGuard<'a> {
    store: &'a dyn ExpertStore,
    lease: Lease,
}

impl ExpertGuard<'_> {
    /// The expert's matrices (loaded when the guard was made, so this only
    /// fails if the store breaks its contract).
    fn view(&self) -> Result<ExpertView<'_>> {
        self.store.view(&self.lease)
    }
}

impl dyn ExpertStore + '_ {
    /// Leases expert `e` of `layer`, waiting for a slot if needed, and loads
    /// it: one expert at a time, where the MoE block leases a whole wave.
    fn expert(&self, layer: usize, e: usize) -> Result<ExpertGuard<'_>> {
        let lease = self.lease(layer, e, LeaseMode::Wait)?.ok_or_else(|| {
            Error::Internal(format!("expert store returned no lease for expert {e} of layer {layer}"))
        })?;
        self.view(&lease)?;
        Ok(ExpertGuard { store: self, lease })
    }
}

fn never() -> bool {
    false
}

/// The prompt's logits `[T, V]`, then `steps` greedy tokens and the logits
/// after each.
#[derive(Debug, PartialEq)]
struct Run {
    logits: Vec<u32>,
    tokens: Vec<u32>,
    decode: Vec<Vec<u32>>,
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11 + seed * 13) % 61).collect()
}

fn run(model: &Model, pool: &rayon::ThreadPool, prompt: &[u32], steps: usize, chunk: usize) -> crate::Result<Run> {
    let v = model.config.vocab_size;
    let mut s = Session::new(model, prompt.len() + steps, chunk);
    let mut all = vec![0.0; prompt.len() * v];
    forward(model, &mut s, prompt, Capture { logits: Some(&mut all), ..Capture::default() }, Some(pool), &never)?;
    let (mut tokens, mut decode) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let next = argmax(&s.seq.logits);
        tokens.push(next);
        forward(model, &mut s, &[next], Capture::default(), Some(pool), &never)?;
        decode.push(bits(&s.seq.logits));
    }
    Ok(Run { logits: bits(&all), tokens, decode })
}

fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap()
}

fn model_file(dir: &Path, name: &str, dtype: DType, seed: u64) -> PathBuf {
    let p = dir.join(name);
    write_random_model(&p, &many_experts_config(), dtype, seed);
    p
}

fn geometry(path: &Path) -> plan::Geometry {
    plan::Geometry::of(&ColibriFile::open(path).unwrap())
}

/// A budget of `slots` slots.
fn slots(path: &Path, n: usize) -> u64 {
    n as u64 * geometry(path).slot_bytes
}

fn opts(budget: Option<u64>, policy: Policy) -> StoreOptions {
    StoreOptions { ram_budget: budget, policy, ..Default::default() }
}

#[test]
fn placement_never_changes_output() {
    let dir = tempfile::tempdir().unwrap();
    let p2 = pool(2);
    for dtype in DType::ALL {
        let path = model_file(dir.path(), &format!("{dtype}.colibri"), dtype, 5);
        let g = geometry(&path);
        assert_eq!(g.total_experts, 48);
        let toks = prompt(19, 0);
        let want = run(&Model::open(&path).unwrap(), &p2, &toks, 6, 7).unwrap();
        // Learn some heat first, so pinning has something to pin.
        drop(run(
            &Model::open_with(&path, &opts(Some(slots(&path, 14)), Policy::default())).unwrap(),
            &p2,
            &toks,
            6,
            7,
        ));
        assert!(heat_path_for(&path).exists(), "{dtype}: no heat file was saved");
        // 10% (exactly K + 1 slots), 30% and 90% of the expert bytes.
        let of_experts = |f: f64| ((f * g.expert_bytes as f64) as u64 / g.slot_bytes).max(4) as usize;
        for n in [of_experts(0.1), of_experts(0.3), of_experts(0.9)] {
            for policy in Policy::all() {
                let m = Model::open_with(&path, &opts(Some(slots(&path, n)), policy)).unwrap();
                assert!(m.streams_experts());
                let got = run(&m, &p2, &toks, 6, 7).unwrap();
                assert!(got == want, "{dtype}, {n} slots, {policy:?}: output differs from the resident model");
                let st = m.store_stats();
                assert!(st.misses > 0 && st.bytes_read > 0, "{dtype}, {n} slots, {policy:?}: nothing streamed");
                // K + 1 slots leave no room for a hot set.
                assert_eq!(st.pinned > 0, policy.pin_hot && n > 4, "{dtype}, {n} slots, {policy:?}: pinning");
                if !policy.prefetch {
                    assert_eq!(st.prefetch_reads, 0);
                }
            }
        }
        // A budget that holds every expert is the resident path.
        let m = Model::open_with(&path, &opts(Some(g.expert_bytes), Policy::default())).unwrap();
        assert!(!m.streams_experts());
        assert!(run(&m, &p2, &toks, 6, 7).unwrap() == want);
    }
}

#[test]
fn thread_count_and_chunking_do_not_matter_under_a_budget() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), "m.colibri", DType::Q4_0, 8);
    let toks = prompt(23, 1);
    let want = run(&Model::open(&path).unwrap(), &pool(1), &toks, 5, 128).unwrap();
    for threads in [1, 3] {
        for chunk in [1, 4, 128] {
            let m = Model::open_with(&path, &opts(Some(slots(&path, 4)), Policy::default())).unwrap();
            assert!(run(&m, &pool(threads), &toks, 5, chunk).unwrap() == want, "{threads} threads, chunk {chunk}");
        }
    }
}

#[test]
fn many_sessions_share_a_minimal_cache_without_deadlock() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), "m.colibri", DType::Bf16, 3);
    let shared_pool = Arc::new(pool(3));
    let resident = Model::open(&path).unwrap();
    let wants: Vec<Run> =
        (0..4).map(|i| run(&resident, &shared_pool, &prompt(9 + i, i as u32), 4, 5).unwrap()).collect();
    for policy in [Policy::default(), Policy { lru: false, pin_hot: false, prefetch: true }] {
        let m = Arc::new(Model::open_with(&path, &opts(Some(slots(&path, 4)), policy)).unwrap());
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let (m, p) = (m.clone(), shared_pool.clone());
                std::thread::spawn(move || {
                    (0..3).map(|_| run(&m, &p, &prompt(9 + i, i as u32), 4, 5).unwrap()).collect::<Vec<_>>()
                })
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            for got in h.join().unwrap() {
                assert!(got == wants[i], "session {i} under {policy:?}");
            }
        }
    }
}

#[test]
fn direct_io_reads_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), "m.colibri", DType::Q8_0, 4);
    let p = pool(2);
    let toks = prompt(12, 2);
    let want = run(&Model::open(&path).unwrap(), &p, &toks, 4, 5).unwrap();
    let o = StoreOptions { io: IoMode::Direct, ..opts(Some(slots(&path, 5)), Policy::default()) };
    match Model::open_with(&path, &o) {
        Ok(m) => {
            assert!(run(&m, &p, &toks, 4, 5).unwrap() == want);
            let st = m.store_stats();
            assert_eq!(st.io, IoMode::Direct);
            assert_eq!(st.bytes_read % crate::io::IO_ALIGN as u64, 0, "direct reads are whole pages");
        }
        // Some filesystems refuse unbuffered reads; the error must say so.
        Err(e) => assert!(e.to_string().contains("io=direct"), "{e}"),
    }
}

#[test]
fn leased_experts_hold_the_file_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), "m.colibri", DType::Q4_1, 6);
    let resident = Model::open(&path).unwrap();
    let streamed = Model::open_with(&path, &opts(Some(slots(&path, 4)), Policy::default())).unwrap();
    for l in [0, 1, 3] {
        for e in 0..16 {
            let a = resident.experts.expert(l, e).unwrap();
            let b = streamed.experts.expert(l, e).unwrap();
            let (a, b) = (a.view().unwrap(), b.view().unwrap());
            for (x, y) in [(a.gate, b.gate), (a.up, b.up), (a.down, b.down)] {
                assert_eq!((x.dtype, x.rows, x.cols), (y.dtype, y.rows, y.cols));
                assert!(x.bytes == y.bytes, "expert {e} of layer {l}");
            }
        }
    }
    // A lease is only good with the store that issued it.
    let lease = resident.experts.lease(0, 0, LeaseMode::Wait).unwrap().unwrap();
    assert!(streamed.experts.view(&lease).is_err());
}

#[test]
fn a_full_cache_makes_the_first_lease_wait_and_a_busy_thread_read_aside() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), "m.colibri", DType::Bf16, 14);
    let o = StoreOptions {
        heat_file: HeatFile::Off,
        ..opts(Some(slots(&path, 4)), Policy { lru: true, pin_hot: false, prefetch: false })
    };
    let m = Model::open_with(&path, &o).unwrap();
    let resident = Model::open(&path).unwrap();
    let store = m.experts.as_ref();
    let held: Vec<Lease> = (0..4).map(|e| store.lease(0, e, LeaseMode::Wait).unwrap().unwrap()).collect();
    // Every slot leased: a caller that may not wait gets nothing...
    assert!(store.lease(0, 9, LeaseMode::IfFree).unwrap().is_none());
    // ...a thread inside expert work reads into a buffer of its own...
    {
        let _busy = Busy::enter();
        let own = store.lease(3, 9, LeaseMode::Wait).unwrap().unwrap();
        let want = resident.experts.expert(3, 9).unwrap();
        assert!(store.view(&own).unwrap().down.bytes == want.view().unwrap().down.bytes);
    }
    assert_eq!(m.store_stats().overflow_reads, 1);
    // ...and anyone else waits until a lease is dropped.
    std::thread::scope(|sc| {
        let waiter = sc.spawn(|| {
            let l = store.lease(1, 5, LeaseMode::Wait).unwrap().unwrap();
            store.view(&l).unwrap().gate.bytes.to_vec()
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!waiter.is_finished(), "the lease did not wait for a free slot");
        for l in &held {
            store.view(l).unwrap();
        }
        drop(held);
        let got = waiter.join().unwrap();
        assert_eq!(got, resident.experts.expert(1, 5).unwrap().view().unwrap().gate.bytes);
    });
    let s = m.store_stats();
    assert_eq!(s.slot_waits, 1);
    assert!(s.slot_wait_seconds > 0.0);
}

#[test]
fn budgets_below_k_plus_one_experts_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), "m.colibri", DType::F32, 1);
    let g = geometry(&path);
    let min = 4 * g.slot_bytes;
    let err = Model::open_with(&path, &opts(Some(min - 1), Policy::default())).unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("top_k + 1 = 4") && msg.contains("holds 3 expert"), "{msg}");
    assert!(Model::open_with(&path, &opts(Some(min), Policy::default())).unwrap().streams_experts());
    assert!(!Model::open_with(&path, &opts(Some(g.expert_bytes), Policy::default())).unwrap().streams_experts());
    assert!(!Model::open_with(&path, &opts(None, Policy::default())).unwrap().streams_experts());
    // plan refuses the same budgets with the same words.
    let file = ColibriFile::open(&path).unwrap();
    assert_eq!(plan(&file, Some(min - 1), None).unwrap_err().to_string(), msg);
}

#[test]
fn the_plan_adds_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), "m.colibri", DType::Q8_0, 2);
    let file = ColibriFile::open(&path).unwrap();
    let g = geometry(&path);
    let all: u64 = file.meta().tensors.iter().map(|t| t.nbytes).sum();
    let p = plan(&file, None, None).unwrap();
    assert!(!p.streams);
    assert_eq!(p.dense_bytes + p.expert_bytes, all);
    assert_eq!(p.resident_bytes, all);
    assert_eq!(p.expected_bytes_per_token, 0.0);

    let p = plan(&file, Some(slots(&path, 14)), None).unwrap();
    assert!(p.streams);
    assert_eq!((p.slots, p.top_k, p.moe_layers, p.experts), (14, 3, 3, 48));
    assert_eq!(p.resident_bytes, p.dense_bytes + 14 * g.slot_bytes);
    assert_eq!(p.min_budget, 4 * g.slot_bytes);
    // Uniform routing: each layer caches 14/3 of its 16 experts.
    let hit = 14.0 / 3.0 / 16.0;
    assert!((p.expected_hit_rate - hit).abs() < 1e-12);
    let want = 3.0 * 3.0 * (1.0 - hit) * g.slab_bytes as f64;
    assert!((p.expected_bytes_per_token - want).abs() < 1e-6, "{} vs {want}", p.expected_bytes_per_token);
    assert_eq!(p.estimate, "uniform routing");
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    // 8 slots over 3 layers: fewer per layer than top-3, which the plan says.
    let p = plan(&file, Some(slots(&path, 8)), None).unwrap();
    assert!(p.warnings.iter().any(|w| w.contains("fewer than the 3 experts")), "{:?}", p.warnings);

    // All the heat on four experts per layer: they fit, so nothing is read.
    let mut h = Heat::zeros(4, 16);
    for l in [0, 1, 3] {
        for e in 0..4 {
            h.counts[l * 16 + e] = 10;
        }
    }
    let p = plan(&file, Some(slots(&path, 14)), Some(&h)).unwrap();
    assert_eq!((p.estimate.as_str(), p.expected_hit_rate, p.expected_bytes_per_token), ("heat file", 1.0, 0.0));
    assert_eq!(p.pinned_slots, 7);
    // plan_path reads the heat file beside the model (none yet).
    assert_eq!(plan_path(&path, Some(slots(&path, 14))).unwrap().estimate, "uniform routing");
}

#[test]
fn telemetry_counts_what_happened() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), "m.colibri", DType::F16, 7);
    let o = StoreOptions {
        heat_file: HeatFile::Off,
        ..opts(Some(slots(&path, 14)), Policy { prefetch: true, ..Policy::default() })
    };
    let m = Model::open_with(&path, &o).unwrap();
    let toks = prompt(17, 3);
    run(&m, &pool(2), &toks, 5, 6).unwrap();
    let tokens = (toks.len() + 5) as u64;

    let r = m.routing_stats();
    assert_eq!(r.tokens, tokens);
    assert_eq!(r.layers.iter().map(|l| l.layer).collect::<Vec<_>>(), [0, 1, 3]);
    for l in &r.layers {
        assert_eq!(l.tokens, tokens);
        assert_eq!(l.heat.iter().sum::<u64>(), 3 * tokens, "K choices per token");
        assert!(l.entropy > 0.0 && l.entropy <= 1.0 + 1e-12, "{}", l.entropy);
        assert!(l.mean_margin >= 0.0 && l.mean_margin <= 1.0);
        assert_eq!(l.margin_histogram.iter().sum::<u64>(), tokens);
        // Router health follows from the counts.
        let uniform = l.heat.iter().sum::<u64>() as f64 / l.heat.len() as f64;
        for (e, &c) in l.heat.iter().enumerate() {
            assert_eq!(l.dead.contains(&e), c == 0);
            assert_eq!(l.overloaded.contains(&e), c as f64 > 3.0 * uniform);
        }
        let max = *l.heat.iter().max().unwrap() as f64;
        assert!((l.max_load - max / uniform).abs() < 1e-12 && l.max_load >= 1.0);
        // 14 slots: some experts cached, none pinned (no heat file), the rest on disk.
        assert_eq!(l.residency.len(), l.heat.len());
        assert!(l.residency.chars().all(|c| c == 'C' || c == '.'), "{}", l.residency);
    }
    assert!(r.layers.iter().any(|l| l.residency.contains('C')));

    let s = m.store_stats();
    assert!(s.streaming && s.slots == 14 && s.pinned == 0);
    assert_eq!(s.tokens, tokens);
    assert_eq!(s.lookups, s.hits + s.misses);
    assert!(s.lookups > 0 && s.hits > 0 && s.misses > 0);
    assert!(s.hits_in_flight <= s.hits.min(s.prefetch_reads));
    assert!(s.hit_rate > 0.0 && s.hit_rate < 1.0);
    assert!(s.bytes_read >= s.misses.min(s.reads) * geometry(&path).slab_bytes);
    assert!((s.bytes_read_per_token - s.bytes_read as f64 / tokens as f64).abs() < 1e-9);
    assert!(s.prefetch_predicted > 0);
    assert!((0.0..=1.0).contains(&s.prefetch_accuracy));
    assert_eq!(s.layers.iter().map(|l| l.hits + l.misses).sum::<u64>(), s.lookups);
    assert_eq!(s.read_errors, 0);
    assert!(s.warnings.is_empty());
    // Plain structs that serialise (what `colibri stats` prints).
    let json = serde_json::to_string(&s).unwrap();
    assert!(json.contains("\"hit_rate\"") && json.contains("\"io\":\"buffered\""), "{json}");
    assert!(serde_json::to_string(&r).unwrap().contains("\"heat\""));
    // A window: the routing of the tokens between two snapshots.
    let more = prompt(9, 4);
    run(&m, &pool(2), &more, 0, 9).unwrap();
    let r2 = m.routing_stats();
    let w = r2.since(&r).unwrap();
    assert_eq!(w.tokens, more.len() as u64);
    for ((a, b), d) in r2.layers.iter().zip(&r.layers).zip(&w.layers) {
        assert_eq!(d.tokens, more.len() as u64);
        assert!(d.heat.iter().zip(&a.heat).zip(&b.heat).all(|((&d, &a), &b)| d == a - b));
        assert_eq!(d.margin_histogram.iter().sum::<u64>(), d.tokens);
        assert!((d.mean_margin * d.tokens as f64 - (a.margin_sum - b.margin_sum)).abs() < 1e-6);
        assert_eq!(d.residency, a.residency);
    }
    assert_eq!(r2.since(&r2).unwrap().layers[0].dead.len(), 0, "nothing routed: no expert called dead");
    assert!(r.since(&r2).is_err(), "a later snapshot is not an earlier one");
    let mut foreign = r.clone();
    foreign.layers[0].heat.pop();
    assert!(r2.since(&foreign).is_err());
    // Snapshots survive a trip through JSON (Python hands them back).
    let back: RoutingStats = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(r2.since(&back).unwrap(), w);

    drop(m);
    assert!(!heat_path_for(&path).exists(), "heat files were off");

    // Without LRU, unpinned experts are not kept: with one token per call
    // and no prefetch, every lookup reads.
    let o = StoreOptions {
        heat_file: HeatFile::Off,
        ..opts(Some(slots(&path, 14)), Policy { lru: false, pin_hot: false, prefetch: false })
    };
    let m = Model::open_with(&path, &o).unwrap();
    run(&m, &pool(2), &toks, 5, 1).unwrap();
    let s = m.store_stats();
    assert_eq!((s.hits, s.misses), (0, s.lookups));

    // Resident models count routing too, and every lookup hits.
    let m = Model::open(&path).unwrap();
    run(&m, &pool(2), &toks, 5, 6).unwrap();
    assert_eq!(m.routing_stats().tokens, tokens);
    assert!(m.routing_stats().layers.iter().all(|l| l.residency.chars().all(|c| c == 'R')));
    let s = m.store_stats();
    assert!(!s.streaming && s.hit_rate == 1.0 && s.bytes_read == 0 && s.lookups > 0);
}

#[test]
fn heat_is_saved_beside_the_model_and_never_trusted_blindly() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), "m.colibri", DType::Bf16, 9);
    let heat = heat_path_for(&path);
    let budget = Some(slots(&path, 14));
    let p = pool(2);
    let toks = prompt(15, 4);
    {
        let m = Model::open_with(&path, &opts(budget, Policy::default())).unwrap();
        assert_eq!(m.store_stats().pinned, 0, "no heat yet");
        run(&m, &p, &toks, 4, 8).unwrap();
    }
    let file = ColibriFile::open(&path).unwrap();
    let id = heat::ModelIdentity::of(&file).unwrap();
    let h = heat::load_heat(&heat, &file, id).unwrap().expect("saved on drop");
    assert_eq!(h.tokens, 19);
    assert_eq!(h.counts.iter().sum::<u64>(), 19 * 3 * 3);

    // Trusted: the hot set is pinned (up to half the slots, 7, in equal
    // shares of the 3 MoE layers: 2 each), and heat accumulates.
    {
        let m = Model::open_with(&path, &opts(budget, Policy::default())).unwrap();
        let s = m.store_stats();
        assert_eq!((s.pinned, s.warnings.len()), (6, 0));
        run(&m, &p, &toks, 4, 8).unwrap();
        assert_eq!(m.save_heat().unwrap(), Some(heat.clone()));
    }
    assert_eq!(heat::load_heat(&heat, &file, id).unwrap().unwrap().tokens, 38);

    // Corrupt: ignored with a warning, then replaced by a valid one.
    let mut bytes = std::fs::read(&heat).unwrap();
    bytes[60] ^= 1;
    std::fs::write(&heat, &bytes).unwrap();
    {
        let m = Model::open_with(&path, &opts(budget, Policy::default())).unwrap();
        let s = m.store_stats();
        assert_eq!(s.pinned, 0);
        assert!(s.warnings.len() == 1 && s.warnings[0].contains("checksum"), "{:?}", s.warnings);
        run(&m, &p, &toks, 2, 8).unwrap();
    }
    assert_eq!(heat::load_heat(&heat, &file, id).unwrap().unwrap().tokens, 17);

    // Foreign: heat of another model is refused.
    let other = model_file(dir.path(), "other.colibri", DType::Bf16, 10);
    std::fs::copy(&heat, heat_path_for(&other)).unwrap();
    let m = Model::open_with(&other, &StoreOptions { heat_file: HeatFile::Beside, ..opts(budget, Policy::default()) })
        .unwrap();
    let s = m.store_stats();
    assert!(s.pinned == 0 && s.warnings[0].contains("different model"), "{:?}", s.warnings);
}

// Unix only: Windows refuses to truncate a mapped file or to unlink or
// replace an open one, so these faults cannot happen there the same way.
#[cfg(unix)]
#[test]
fn file_faults_are_errors_for_that_call_and_the_engine_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), "m.colibri", DType::Q8_0, 12);
    let original = std::fs::read(&path).unwrap();
    let p = pool(2);
    let toks = prompt(11, 5);
    let want = run(&Model::open(&path).unwrap(), &p, &toks, 3, 4).unwrap();
    // No LRU: every call reads its experts again, so every call sees the file.
    let policy = Policy { lru: false, pin_hot: false, prefetch: true };
    let o = StoreOptions { heat_file: HeatFile::Off, ..opts(Some(slots(&path, 5)), policy) };
    let m = Model::open_with(&path, &o).unwrap();
    assert!(run(&m, &p, &toks, 3, 4).unwrap() == want);

    let truncate =
        || std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(original.len() as u64 / 2).unwrap();
    let expect_read_error = |what: &str| {
        let err = run(&m, &p, &toks, 3, 4).unwrap_err();
        match &err {
            Error::ExpertRead { path: at, .. } => assert_eq!(at, &path, "{what}"),
            other => panic!("{what}: expected an expert read error, got {other:?}"),
        }
        assert!(err.to_string().contains("m.colibri"), "{what}: {err}");
        err
    };

    // Truncated in place: a clear error (the dense part is in memory, so no SIGBUS).
    truncate();
    let err = expect_read_error("truncated");
    assert!(err.to_string().contains("short read"), "{err}");
    // Restored in place: the next call works.
    std::fs::write(&path, &original).unwrap();
    assert!(run(&m, &p, &toks, 3, 4).unwrap() == want);

    // Truncated, then an identical copy renamed over it: the store reopens
    // the path, checks it is the same model, and carries on.
    truncate();
    let tmp = dir.path().join("copy");
    std::fs::write(&tmp, &original).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    assert!(run(&m, &p, &toks, 3, 4).unwrap() == want);
    assert!(m.store_stats().reopens >= 1);

    // Truncated, then a different model renamed over it: refused, not used.
    truncate();
    let other = model_file(dir.path(), "other.colibri", DType::Q8_0, 13);
    std::fs::rename(&other, &path).unwrap();
    expect_read_error("replaced by another model");
    // The right file back: works again.
    std::fs::write(&tmp, &original).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    assert!(run(&m, &p, &toks, 3, 4).unwrap() == want);

    // Removed: the open handle still reads the old file, so calls go on
    // with the right numbers.
    std::fs::remove_file(&path).unwrap();
    assert!(run(&m, &p, &toks, 3, 4).unwrap() == want);
    let s = m.store_stats();
    assert!(s.read_errors >= 2, "{s:?}");
}

#[test]
fn byte_sizes_parse_in_decimal_and_binary_units() {
    let ok = [
        ("4GB", 4_000_000_000),
        ("4 gb", 4_000_000_000),
        ("4GiB", 4 << 30),
        ("1.5GiB", 3 << 29),
        ("512MiB", 512 << 20),
        ("0.5 MB", 500_000),
        ("100", 100),
        ("100B", 100),
        ("3KiB", 3072),
        ("2TB", 2_000_000_000_000),
        ("1TiB", 1 << 40),
        (" 7 kb ", 7000),
        (".5KB", 500),
    ];
    for (s, want) in ok {
        assert_eq!(parse_bytes(s).unwrap(), want, "{s}");
    }
    for (s, why) in [
        ("", "no number"),
        ("GB", "no number"),
        ("4G", "ambiguous"),
        ("4 parsecs", "unknown unit"),
        ("-4GB", "no number"),
        ("1.2.3GB", "malformed"),
        ("99999999999TB", "too large"),
        ("1.5", "fraction of a byte"),
    ] {
        let e = parse_bytes(s).unwrap_err().to_string();
        assert!(e.contains(why) && e.contains("4GB"), "{s:?}: {e}");
    }
}

#[test]
fn streamed_experts_with_biases_and_the_new_paths_match_resident() {
    // Expert biases live in the slab; MLA, sinks, grouped sigmoid routing and
    // the clamped SwiGLU all run through the store's views.
    let dir = tempfile::tempdir().unwrap();
    let p2 = pool(2);
    // Gemma 4's router reads its own norm of the residual, which the
    // prefetch's prediction reads too.
    let cases = [("frontier", crate::synth::frontier_config()), ("gemma4", crate::synth::gemma4_config())];
    for ((name, cfg), dtype) in cases.iter().flat_map(|c| [DType::F32, DType::Q8_0].map(|d| (c, d))) {
        let path = dir.path().join(format!("{name}-{dtype}.colibri"));
        write_random_model(&path, cfg, dtype, 3);
        let toks = prompt(17, 1);
        let want = run(&Model::open(&path).unwrap(), &p2, &toks, 5, 6).unwrap();
        assert!(want.logits.iter().all(|b| f32::from_bits(*b).is_finite()), "{dtype}: non-finite logits");
        for policy in Policy::all() {
            let m = Model::open_with(&path, &opts(Some(slots(&path, 4)), policy)).unwrap();
            assert!(m.streams_experts());
            assert!(run(&m, &p2, &toks, 5, 6).unwrap() == want, "{dtype} {policy:?}: streamed output differs");
        }
    }
}
