//! Where a resident model's weights live: the file's mapping (the page
//! cache's pages, shared with other processes, nothing to do at open) or a
//! copy in the process's own memory on 2 MiB pages.
//!
//! The pages matter. Decode streams every weight once a token, and on 4 KiB
//! pages each 4 KiB of a stream costs a TLB miss and a page walk. On the
//! Zen 2 EPYC (docs/design/store.md) the same OLMoE-width file decoded one
//! sequence at 116 tok/s mapped on 4 KiB pages and 131 on 2 MiB ones (eight
//! sequences: 210 and 223). A mapping gets 2 MiB pages only where the page
//! cache holds the file in 2 MiB folios: on Linux with a file system that
//! makes large folios (ext4 from 6.16, XFS), for pages read in after the
//! mapping was advised, never for a file just written (a fresh `convert`)
//! or cached by plain reads. Kernels cannot re-fold a regular file's cached
//! pages on request (`MADV_COLLAPSE` wants `CONFIG_READ_ONLY_THP_FOR_FS`).
//! So by default ([`Backing::Auto`]) the mapping is sampled at open and,
//! when most of it is on small pages and a copy fits in the memory the
//! kernel reports available, the weights are copied; the copy's bytes are
//! the file's, so no output changes.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::format::reader::{ColibriFile, FileCopy};
use crate::io::HUGE_PAGE;

/// Where the weights of a model that fits in RAM should live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backing {
    /// Keep the mapping when it is on 2 MiB pages (or cannot be improved);
    /// copy otherwise (Linux; elsewhere the mapping).
    #[default]
    Auto,
    /// Always the mapping.
    Map,
    /// Always a copy (an error when the memory the kernel reports available,
    /// swap included, cannot hold it).
    Copy,
}

impl Backing {
    /// "auto", "map" or "copy".
    pub fn parse(s: &str) -> Result<Backing> {
        match s {
            "auto" => Ok(Backing::Auto),
            "map" => Ok(Backing::Map),
            "copy" => Ok(Backing::Copy),
            _ => Err(Error::InvalidInput(format!("weights backing must be \"auto\", \"map\" or \"copy\", got {s:?}"))),
        }
    }
}

/// Where the weights ended up, for `store_stats()`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WeightsBacking {
    /// "mapped", "copied" or "streamed" (a RAM budget: the dense part is
    /// copied, the experts read into slots, both on 2 MiB pages where the
    /// OS allows).
    pub backing: &'static str,
    /// Share of the weights' bytes on 2 MiB pages as measured at open (a
    /// sample of the mapping, or the whole copy); `None` when not measured
    /// (not Linux, a small file, or /proc unreadable).
    pub huge_pages: Option<f64>,
    /// Why this backing, in a sentence.
    pub note: String,
}

/// Files smaller than this stay mapped under [`Backing::Auto`]: too little
/// to stream for the pages to matter, and the tests' models stay zero-copy.
pub(crate) const AUTO_MIN_BYTES: u64 = 64 << 20;

/// Windows of the mapping touched to estimate its page sizes.
const SAMPLES: usize = 64;

/// The mapping counts as on 2 MiB pages from this measured share up.
const HUGE_ENOUGH: f64 = 0.9;

/// Settles `file`'s backing as `want` asks (the model keeps every weight
/// resident). May replace the mapping by a copy.
pub(crate) fn settle(file: &mut ColibriFile, want: Backing) -> Result<WeightsBacking> {
    file.advise_huge_pages();
    let len = file.file_len();
    let mapped = |huge_pages, note: String| Ok(WeightsBacking { backing: "mapped", huge_pages, note });
    match want {
        Backing::Map => mapped(None, "mapped, as asked".into()),
        Backing::Copy => {
            let sys = Sys::read();
            if let (Some(avail), Some(swap)) = (sys.mem_available, sys.swap_free)
                && len > avail.saturating_add(swap)
            {
                return Err(Error::InvalidInput(format!(
                    "copying the weights into memory needs {} but {} is available (swap included, within this \
                     process's memory limit); map the file instead (mmap=True, or --mmap on) or give a ram_budget",
                    super::human(len),
                    super::human(avail.saturating_add(swap)),
                )));
            }
            let copy = read_copy(file)?;
            let huge_pages = huge_share_of_copy(&copy);
            file.use_copy(copy);
            Ok(WeightsBacking { backing: "copied", huge_pages, note: "copied, as asked".into() })
        }
        Backing::Auto => {
            if !cfg!(target_os = "linux") {
                return mapped(None, "mapped (copies are made on Linux only)".into());
            }
            if len < AUTO_MIN_BYTES {
                return mapped(None, format!("mapped (files under {} stay mapped)", super::human(AUTO_MIN_BYTES)));
            }
            let Some(share) = sample_huge_share(file) else {
                return mapped(None, "mapped (its page sizes could not be read from /proc/self/smaps)".into());
            };
            let pct = percent(share);
            let why = match decide(len, share, &Sys::read()) {
                Decision::Map(why) => return mapped(Some(share), why),
                Decision::Copy(why) => why,
            };
            // A failed copy leaves the mapping as it was, and it works.
            let copy = match read_copy(file) {
                Ok(c) => c,
                Err(e) => {
                    return mapped(
                        Some(share),
                        format!("mapped ({pct}% of a sample on 2 MiB pages; a copy failed: {e})"),
                    );
                }
            };
            match huge_share_of_copy(&copy) {
                // Fragmented memory: the copy would stream no faster.
                Some(c) if c < HUGE_ENOUGH && c <= share => mapped(
                    Some(share),
                    format!("mapped ({pct}% of a sample on 2 MiB pages; a copy came out {}% on them)", percent(c)),
                ),
                got => {
                    file.use_copy(copy);
                    Ok(WeightsBacking { backing: "copied", huge_pages: got, note: why })
                }
            }
        }
    }
}

fn percent(share: f64) -> f64 {
    (share * 100.0).round()
}

/// What [`Backing::Auto`] does with a file of `len` bytes whose mapping
/// measured `share` on 2 MiB pages.
#[derive(Debug, PartialEq)]
enum Decision {
    Map(String),
    Copy(String),
}

fn decide(len: u64, share: f64, sys: &Sys) -> Decision {
    let pct = percent(share);
    if share >= HUGE_ENOUGH {
        return Decision::Map(format!("mapped ({pct}% of a sample on 2 MiB pages)"));
    }
    if !sys.anon_huge_pages {
        return Decision::Map(format!(
            "mapped ({pct}% of a sample on 2 MiB pages; transparent huge pages are off, so a copy would not be either)"
        ));
    }
    // Room for the copy and what the engine allocates after it (KV caches,
    // scratch): the copy cannot give way under pressure as cached file
    // pages do. The file's own cached pages count as available.
    let need = len + len / 8 + (1 << 30);
    match sys.mem_available {
        Some(avail) if avail >= need => Decision::Copy(format!(
            "copied into 2 MiB pages (the mapping had {pct}% of a sample on them: the page cache holds the file in \
             smaller pages)"
        )),
        Some(avail) => Decision::Map(format!(
            "mapped ({pct}% of a sample on 2 MiB pages; a copy would want {} and {} is available)",
            super::human(need),
            super::human(avail)
        )),
        None => Decision::Map(format!("mapped ({pct}% of a sample on 2 MiB pages; available memory unknown)")),
    }
}

/// Reads a copy of `file`, printing progress to stderr when it is slow.
fn read_copy(file: &ColibriFile) -> Result<FileCopy> {
    let len = file.file_len();
    let mut last = Instant::now();
    let mut progress = |done: u64| {
        let now = Instant::now();
        if now - last >= Duration::from_secs(5) && done < len {
            last = now;
            eprintln!("colibri: copying the weights into memory: {} of {}", super::human(done), super::human(len));
        }
    };
    file.read_copy(&mut progress)
}

/// The share of `copy` on transparent huge pages (Linux).
fn huge_share_of_copy(copy: &FileCopy) -> Option<f64> {
    let bytes = copy.bytes();
    let pages = vma_pages(bytes.as_ptr() as usize)?;
    Some((pages.anon_huge_kb as f64 * 1024.0 / bytes.len().next_multiple_of(HUGE_PAGE) as f64).min(1.0))
}

/// Estimates the share of `file`'s mapping on 2 MiB pages: touches one byte
/// in each of up to [`SAMPLES`] 2 MiB windows of the tensor data (the
/// fault maps a 2 MiB folio whole, or reads one in if the page cache lacks
/// the window and the file system makes them) and reads how much of the
/// mapping /proc/self/smaps then counts as PMD-mapped (`None` where there
/// is no such file: not Linux).
fn sample_huge_share(file: &ColibriFile) -> Option<f64> {
    let bytes = file.bytes();
    let base = bytes.as_ptr() as usize;
    // Windows aligned in the address space, wholly inside the tensor data.
    let first = (base + file.data_offset() as usize).next_multiple_of(HUGE_PAGE) - base;
    let windows = bytes.len().saturating_sub(first) / HUGE_PAGE;
    if windows == 0 {
        return None;
    }
    let k = windows.min(SAMPLES);
    let before = vma_pages(base)?.file_pmd_kb;
    for i in 0..k {
        std::hint::black_box(bytes[first + i * windows / k * HUGE_PAGE]);
    }
    let after = vma_pages(base)?.file_pmd_kb;
    Some((after.saturating_sub(before) as f64 * 1024.0 / (k * HUGE_PAGE) as f64).min(1.0))
}

/// Page counts of one mapping, from /proc/self/smaps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct VmaPages {
    /// File pages mapped by 2 MiB page-table entries (tmpfs ones included).
    file_pmd_kb: u64,
    /// Anonymous memory in transparent huge pages.
    anon_huge_kb: u64,
}

/// The page counts of the mapping that contains `addr`.
fn vma_pages(addr: usize) -> Option<VmaPages> {
    parse_smaps(&std::fs::read_to_string("/proc/self/smaps").ok()?, addr)
}

/// Finds the mapping containing `addr` in smaps text and reads its counts.
fn parse_smaps(text: &str, addr: usize) -> Option<VmaPages> {
    let mut inside = false;
    let mut out = VmaPages::default();
    for line in text.lines() {
        // A mapping's header: "start-end perms offset dev inode [path]".
        let range = line.split_once(' ').and_then(|(r, _)| r.split_once('-'));
        if let Some((a, b)) = range
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            if inside {
                return Some(out);
            }
            inside = (a..b).contains(&addr);
            continue;
        }
        if !inside {
            continue;
        }
        let Some((key, rest)) = line.split_once(':') else { continue };
        match key {
            "FilePmdMapped" | "ShmemPmdMapped" => out.file_pmd_kb += kb(rest)?,
            "AnonHugePages" => out.anon_huge_kb = kb(rest)?,
            _ => {}
        }
    }
    inside.then_some(out)
}

/// What the system says about memory and huge pages.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Sys {
    mem_available: Option<u64>,
    swap_free: Option<u64>,
    /// Anonymous memory can get transparent huge pages ("always" or "madvise").
    anon_huge_pages: bool,
}

impl Sys {
    fn read() -> Sys {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let meminfo = read("/proc/meminfo");
        let thp = read("/sys/kernel/mm/transparent_hugepage/enabled");
        let host = meminfo_bytes(&meminfo, "MemAvailable");
        let cgroup = cgroup_room(&read("/proc/self/cgroup"), &|p| std::fs::read_to_string(p).ok());
        Sys {
            mem_available: match (host, cgroup) {
                (Some(h), Some(c)) => Some(h.min(c)),
                (h, c) => h.or(c),
            },
            swap_free: meminfo_bytes(&meminfo, "SwapFree"),
            anon_huge_pages: thp.contains("[always]") || thp.contains("[madvise]"),
        }
    }
}

/// Room left under this process's cgroup memory limit, if it has one: the
/// limit less the usage, plus the file pages the group holds (the kernel
/// reclaims those before it kills). `self_cgroup` is /proc/self/cgroup;
/// `read` reads a file under /sys/fs/cgroup. Version 2 (`0::/path`, files
/// `memory.max`, `memory.current`, `memory.stat` "file") or version 1 (the
/// `memory` controller's `memory.limit_in_bytes`, `memory.usage_in_bytes`,
/// `memory.stat` "total_cache").
fn cgroup_room(self_cgroup: &str, read: &dyn Fn(&str) -> Option<String>) -> Option<u64> {
    let num = |text: Option<String>| text?.trim().parse::<u64>().ok();
    let stat = |text: Option<String>, key: &str| {
        text?.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse::<u64>().ok())
    };
    for line in self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let path = path.trim_end_matches('/');
        let room = if controllers.is_empty() {
            let dir = format!("/sys/fs/cgroup{path}");
            // "max" (no limit) does not parse, and gives no room figure.
            let limit = num(read(&format!("{dir}/memory.max")))?;
            let used = num(read(&format!("{dir}/memory.current")))?;
            let cache = stat(read(&format!("{dir}/memory.stat")), "file").unwrap_or(0);
            limit.saturating_sub(used).saturating_add(cache)
        } else if controllers.split(',').any(|c| c == "memory") {
            let dir = format!("/sys/fs/cgroup/memory{path}");
            let limit = num(read(&format!("{dir}/memory.limit_in_bytes")))?;
            if limit >= 1 << 60 {
                return None; // "no limit" is written as a huge number
            }
            let used = num(read(&format!("{dir}/memory.usage_in_bytes")))?;
            let cache = stat(read(&format!("{dir}/memory.stat")), "total_cache").unwrap_or(0);
            limit.saturating_sub(used).saturating_add(cache)
        } else {
            continue;
        };
        return Some(room);
    }
    None
}

/// The number of a "   N kB" field (after its key's colon) of
/// /proc/meminfo or /proc/self/smaps.
fn kb(field: &str) -> Option<u64> {
    field.trim().trim_end_matches("kB").trim().parse().ok()
}

/// A "Key:   N kB" line of /proc/meminfo, in bytes.
fn meminfo_bytes(text: &str, key: &str) -> Option<u64> {
    let (_, field) = text.lines().filter_map(|l| l.split_once(':')).find(|(k, _)| *k == key)?;
    kb(field)?.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0000000-55d0c0021000 r--p 00000000 fd:00 12 /usr/bin/python3
Rss:                 132 kB
FilePmdMapped:         0 kB
AnonHugePages:         0 kB
7f0000000000-7f0040000000 r--s 00000000 fd:00 99 /models/m.colibri
Size:            1048576 kB
Rss:              995028 kB
Pss:              995028 kB
FilePmdMapped:    616448 kB
AnonHugePages:         0 kB
VmFlags: rd mr mw me hg
7f0040000000-7f0040200000 rw-p 00000000 00:00 0
Rss:                2048 kB
AnonHugePages:      2048 kB
7f0050000000-7f0054000000 r--s 00000000 00:1a 7 /dev/shm/m.colibri
Rss:               65536 kB
FilePmdMapped:         0 kB
ShmemPmdMapped:    65536 kB
THPeligible:    1
";

    #[test]
    fn smaps_counts_come_from_the_mapping_holding_the_address() {
        let m = parse_smaps(SMAPS, 0x7f0000200000).expect("inside the model's mapping");
        assert_eq!(m, VmaPages { file_pmd_kb: 616448, anon_huge_kb: 0 });
        let a = parse_smaps(SMAPS, 0x7f0040000000).expect("the anonymous one after it");
        assert_eq!(a, VmaPages { file_pmd_kb: 0, anon_huge_kb: 2048 });
        let shm = parse_smaps(SMAPS, 0x7f0053ffffff).expect("the tmpfs one, last");
        assert_eq!(shm, VmaPages { file_pmd_kb: 65536, anon_huge_kb: 0 }, "tmpfs huge pages count");
        assert_eq!(parse_smaps(SMAPS, 0x1000), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_smaps_describe_a_mapping_of_its_own() {
        let mut map = memmap2::MmapMut::map_anon(4 * HUGE_PAGE).unwrap();
        let _ = map.advise(memmap2::Advice::HugePage);
        map.iter_mut().step_by(4096).for_each(|b| *b = 1);
        let p = vma_pages(map.as_ptr() as usize).expect("/proc/self/smaps lists the mapping");
        assert!(p.anon_huge_kb <= 4 * 2048 && p.file_pmd_kb == 0, "{p:?}");
    }

    #[test]
    fn cgroup_limits_bound_the_room_for_a_copy() {
        let files = |entries: &'static [(&'static str, &'static str)]| {
            move |p: &str| entries.iter().find(|(k, _)| *k == p).map(|(_, v)| v.to_string())
        };
        let gb = 1u64 << 30;
        let v2 = files(&[
            ("/sys/fs/cgroup/app/memory.max", "8589934592\n"),
            ("/sys/fs/cgroup/app/memory.current", "3221225472\n"),
            ("/sys/fs/cgroup/app/memory.stat", "anon 2147483648\nfile 1073741824\nfile_mapped 0\n"),
        ]);
        assert_eq!(cgroup_room("0::/app\n", &v2), Some(8 * gb - 3 * gb + gb));
        let unlimited = files(&[("/sys/fs/cgroup/app/memory.max", "max\n")]);
        assert_eq!(cgroup_room("0::/app\n", &unlimited), None);
        let v1 = files(&[
            ("/sys/fs/cgroup/memory/job/memory.limit_in_bytes", "4294967296"),
            ("/sys/fs/cgroup/memory/job/memory.usage_in_bytes", "1073741824"),
            ("/sys/fs/cgroup/memory/job/memory.stat", "cache 5\ntotal_cache 0\n"),
        ]);
        assert_eq!(cgroup_room("12:cpu,cpuacct:/job\n11:memory:/job\n", &v1), Some(3 * gb));
        let v1_unlimited = files(&[("/sys/fs/cgroup/memory/job/memory.limit_in_bytes", "9223372036854771712")]);
        assert_eq!(cgroup_room("11:memory:/job\n", &v1_unlimited), None);
        assert_eq!(cgroup_room("", &v2), None);
    }

    #[test]
    fn meminfo_lines_read_as_bytes() {
        let t = "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\nSwapFree:              0 kB\n";
        assert_eq!(meminfo_bytes(t, "MemAvailable"), Some(20_000_000 * 1024));
        assert_eq!(meminfo_bytes(t, "SwapFree"), Some(0));
        assert_eq!(meminfo_bytes(t, "Mem"), None);
    }

    #[test]
    fn auto_copies_only_small_paged_files_that_fit_with_huge_pages_on() {
        let gb = 1u64 << 30;
        let sys = Sys { mem_available: Some(20 * gb), swap_free: Some(0), anon_huge_pages: true };
        assert!(matches!(decide(gb, 0.95, &sys), Decision::Map(_)));
        assert!(matches!(decide(gb, 0.2, &sys), Decision::Copy(_)));
        assert!(matches!(decide(17 * gb, 0.2, &sys), Decision::Map(w) if w.contains("would want")));
        let off = Sys { anon_huge_pages: false, ..sys };
        assert!(matches!(decide(gb, 0.2, &off), Decision::Map(w) if w.contains("off")));
        let unknown = Sys { mem_available: None, ..sys };
        assert!(matches!(decide(gb, 0.2, &unknown), Decision::Map(_)));
    }

    #[test]
    fn backing_names_parse() {
        assert_eq!(Backing::parse("auto").unwrap(), Backing::Auto);
        assert_eq!(Backing::parse("map").unwrap(), Backing::Map);
        assert_eq!(Backing::parse("copy").unwrap(), Backing::Copy);
        assert!(Backing::parse("mmap").unwrap_err().to_string().contains("\"auto\", \"map\" or \"copy\""));
    }
}
