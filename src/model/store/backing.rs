//! Where a resident model's weights live: the file's mapping (the page
//! cache's pages, shared with other processes, nothing to do at open) or a
//! copy in the process's own memory on 2 MiB pages.
//!
//! The pages matter. Decode streams every weight once a token, and on 4 KiB
//! pages each 4 KiB of a stream costs a TLB miss and a page walk. On the
//! Zen 2 EPYC of docs/benchmarks.md the same OLMoE-width file decoded one
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
use crate::format::reader::{ColibriFile, HUGE_PAGE};

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
pub(crate) const AUTO_MIN_BYTES: usize = 64 << 20;

/// Windows of the mapping touched to estimate its page sizes.
const SAMPLES: usize = 64;

/// The mapping counts as on 2 MiB pages from this measured share up.
const HUGE_ENOUGH: f64 = 0.9;

/// Settles `file`'s backing as `want` asks (the model keeps every weight
/// resident). May replace the mapping by a copy.
pub(crate) fn settle(file: &mut ColibriFile, want: Backing) -> Result<WeightsBacking> {
    file.advise_huge_pages();
    let len = file.file_len() as usize;
    let mapped = |huge_pages, note: String| Ok(WeightsBacking { backing: "mapped", huge_pages, note });
    match want {
        Backing::Map => mapped(sample_huge_share(file), "mapped, as asked".into()),
        Backing::Copy => {
            let sys = Sys::read();
            if let (Some(avail), Some(swap)) = (sys.mem_available, sys.swap_free)
                && len as u64 > avail.saturating_add(swap)
            {
                return Err(Error::InvalidInput(format!(
                    "copying the weights into memory needs {} but the system reports {} available (swap included); \
                     map the file instead (mmap=True, or --mmap on) or give a ram_budget",
                    super::human(len as u64),
                    super::human(avail.saturating_add(swap)),
                )));
            }
            copy(file, "copied, as asked".into())
        }
        Backing::Auto => {
            if !cfg!(target_os = "linux") {
                return mapped(None, "mapped (copies are made on Linux only)".into());
            }
            if len < AUTO_MIN_BYTES {
                return mapped(
                    None,
                    format!("mapped (files under {} stay mapped)", super::human(AUTO_MIN_BYTES as u64)),
                );
            }
            let Some(share) = sample_huge_share(file) else {
                return mapped(None, "mapped (its page sizes could not be read from /proc/self/smaps)".into());
            };
            let sys = Sys::read();
            match decide(len as u64, share, &sys) {
                Decision::Map(why) => mapped(Some(share), why),
                Decision::Copy(why) => copy(file, why),
            }
        }
    }
}

/// What [`Backing::Auto`] does with a file of `len` bytes whose mapping
/// measured `share` on 2 MiB pages.
#[derive(Debug, PartialEq)]
enum Decision {
    Map(String),
    Copy(String),
}

fn decide(len: u64, share: f64, sys: &Sys) -> Decision {
    let pct = (share * 100.0).round();
    if share >= HUGE_ENOUGH {
        return Decision::Map(format!("mapped ({pct}% of a sample on 2 MiB pages)"));
    }
    if !sys.anon_huge_pages {
        return Decision::Map(format!(
            "mapped ({pct}% of a sample on 2 MiB pages; transparent huge pages are off, so a copy would not be either)"
        ));
    }
    // Room for the copy beside what else runs; the file's own cached pages
    // count as available and give way as the copy grows.
    let need = len + (512 << 20) + len / 16;
    match sys.mem_available {
        Some(avail) if avail >= need => Decision::Copy(format!(
            "copied into 2 MiB pages (the mapping had {pct}% of a sample on them: the page cache holds the file in \
             smaller pages)"
        )),
        Some(avail) => Decision::Map(format!(
            "mapped ({pct}% of a sample on 2 MiB pages; a copy would need {} and {} is available)",
            super::human(need),
            super::human(avail)
        )),
        None => Decision::Map(format!("mapped ({pct}% of a sample on 2 MiB pages; available memory unknown)")),
    }
}

/// Copies `file` into memory, printing progress to stderr when it is slow.
fn copy(file: &mut ColibriFile, note: String) -> Result<WeightsBacking> {
    let len = file.file_len();
    let start = Instant::now();
    let mut last = start;
    let mut progress = |done: u64| {
        let now = Instant::now();
        if now - last >= Duration::from_secs(5) {
            last = now;
            eprintln!("colibri: copying the weights into memory: {} of {}", super::human(done), super::human(len));
        }
    };
    file.copy_into_memory(&mut progress)?;
    let huge_pages = vma_pages(file.bytes().as_ptr() as usize)
        .map(|p| (p.anon_huge_kb as f64 * 1024.0 / len.next_multiple_of(HUGE_PAGE as u64) as f64).min(1.0));
    Ok(WeightsBacking { backing: "copied", huge_pages, note })
}

/// Estimates the share of `file`'s mapping on 2 MiB pages: touches one byte
/// in each of up to [`SAMPLES`] 2 MiB windows of the tensor data (the
/// fault maps a 2 MiB folio whole, or reads one in if the page cache lacks
/// the window and the file system makes them) and reads how much of the
/// mapping /proc/self/smaps then counts as PMD-mapped. Linux only.
fn sample_huge_share(file: &ColibriFile) -> Option<f64> {
    if !cfg!(target_os = "linux") {
        return None;
    }
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
    rss_kb: u64,
    /// File pages mapped by 2 MiB page-table entries.
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
        let kb = || rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok();
        match key {
            "Rss" => out.rss_kb = kb()?,
            "FilePmdMapped" => out.file_pmd_kb = kb()?,
            "AnonHugePages" => out.anon_huge_kb = kb()?,
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
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        Sys {
            mem_available: meminfo_bytes(&meminfo, "MemAvailable"),
            swap_free: meminfo_bytes(&meminfo, "SwapFree"),
            anon_huge_pages: thp.contains("[always]") || thp.contains("[madvise]"),
        }
    }
}

/// A "Key:   N kB" line of /proc/meminfo, in bytes.
fn meminfo_bytes(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.split(':').next() == Some(key))?;
    let kb: u64 = line.split(':').nth(1)?.trim().trim_end_matches("kB").trim().parse().ok()?;
    kb.checked_mul(1024)
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
";

    #[test]
    fn smaps_counts_come_from_the_mapping_holding_the_address() {
        let m = parse_smaps(SMAPS, 0x7f0000200000).expect("inside the model's mapping");
        assert_eq!(m, VmaPages { rss_kb: 995028, file_pmd_kb: 616448, anon_huge_kb: 0 });
        let a = parse_smaps(SMAPS, 0x7f0040000000).expect("the anonymous one after it");
        assert_eq!(a, VmaPages { rss_kb: 2048, file_pmd_kb: 0, anon_huge_kb: 2048 });
        assert_eq!(parse_smaps(SMAPS, 0x1000), None);
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
        assert!(matches!(decide(19 * gb, 0.2, &sys), Decision::Map(w) if w.contains("would need")));
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
