//! The thread pool: one rayon pool per engine, sized by the user's `threads=`
//! setting (default: physical cores). Work is split by output rows, by
//! (token, head) pairs or by experts, never one dot product across threads,
//! so results do not depend on the pool size.
//!
//! Pinning workers to cores is opt-in (`COLIBRI_PIN=1`): on a quiet machine
//! it keeps each expert's weights streaming through one core's caches, but
//! with another process busy on a core a pinned worker cannot move away from
//! it, and the MoE block's even split then waits on the slowed worker. Rayon
//! workers park after a short spin, so an unpinned pool shares the machine
//! gracefully (docs/guide/tuning.md gives the noisy-neighbour figure).

use crate::error::{Error, Result};

/// Physical cores of this machine (hyper-threads share a core's FMA units and
/// memory port, so more threads than cores only adds contention). Falls back
/// to the logical count where the topology is not readable.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    #[cfg(target_os = "linux")]
    {
        let mut cores = std::collections::HashSet::new();
        for cpu in 0..logical.max(1) * 2 {
            let p = format!("/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list");
            if let Ok(s) = std::fs::read_to_string(&p) {
                cores.insert(s.trim().to_string());
            }
        }
        if !cores.is_empty() {
            return cores.len().min(logical);
        }
    }
    #[cfg(any(windows, target_os = "macos"))]
    {
        // GetLogicalProcessorInformation's cores on Windows, hw.physicalcpu on macOS.
        let n = num_cpus::get_physical();
        if n > 0 {
            return n.min(logical);
        }
    }
    logical
}

/// Builds the pool for an engine.
pub fn pool(threads: Option<usize>) -> Result<rayon::ThreadPool> {
    let n = match threads {
        Some(0) => return Err(Error::InvalidInput("threads must be at least 1".into())),
        Some(n) if n > 1024 => {
            return Err(Error::InvalidInput(format!("threads = {n} is more than this engine supports (1024)")));
        }
        Some(n) => n,
        None => physical_cores(),
    };
    let pin = std::env::var("COLIBRI_PIN").is_ok_and(|v| v == "1");
    let cores = if pin { core_affinity::get_core_ids().unwrap_or_default() } else { Vec::new() };
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("colibri-{i}"))
        .start_handler(move |i| {
            if !cores.is_empty() {
                // Best effort: a refused affinity request leaves the thread unpinned.
                let _ = core_affinity::set_for_current(cores[i % cores.len()]);
            }
        })
        .build()
        .map_err(|e| Error::InvalidInput(format!("cannot start {n} threads: {e}")))
}
