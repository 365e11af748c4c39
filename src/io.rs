//! Plain file I/O shared by the format reader and the expert store:
//! page-aligned buffers, opening the model file for positioned reads
//! (buffered or unbuffered), and reading a byte range fully or failing with a
//! clear error.
//!
//! Positioned reads (`pread` on Unix, `seek_read` on Windows) share one file
//! handle between threads without a seek position, so the background I/O
//! threads and the compute workers read at the same time.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fs::File;
use std::io;
use std::path::Path;
use std::ptr::NonNull;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The size of a transparent huge page on x86_64 and (with 4 KiB base
/// pages) aarch64 Linux.
pub const HUGE_PAGE: usize = 2 << 20;

/// How expert slabs are read from the file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoMode {
    /// Through the OS page cache (repeated reads may come from RAM the budget
    /// does not count; the cache is reclaimable).
    #[default]
    Buffered,
    /// Bypassing the page cache (O_DIRECT on Linux, F_NOCACHE on macOS,
    /// FILE_FLAG_NO_BUFFERING on Windows): the budget is the whole story.
    /// Whether it is faster depends on the drive; opening fails with a clear
    /// error where the OS or filesystem refuses it.
    Direct,
}

impl IoMode {
    /// Parses "buffered" or "direct".
    pub fn parse(s: &str) -> Result<IoMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "buffered" => Ok(IoMode::Buffered),
            "direct" | "unbuffered" => Ok(IoMode::Direct),
            _ => Err(Error::InvalidInput(format!("io mode {s:?} is not known: use \"buffered\" or \"direct\""))),
        }
    }
}

/// Alignment and length granule of unbuffered reads (covers 512-byte and
/// 4096-byte logical blocks).
pub(crate) const IO_ALIGN: usize = 4096;

/// Rounds `x` up to a multiple of [`IO_ALIGN`].
pub(crate) fn round_up(x: u64) -> u64 {
    x.div_ceil(IO_ALIGN as u64) * IO_ALIGN as u64
}

/// A zero-initialised buffer aligned to [`IO_ALIGN`], allocated once. A
/// buffer of 2 MiB or more is an anonymous mapping of whole 2 MiB units
/// (which the kernel places on a 2 MiB boundary) and, on Linux, asks for 2
/// MiB pages: the kernels stream the expert slots and the dense copy, and a
/// stream over 4 KiB pages is slower (the one-token q4_0 kernel over a
/// matrix far past the caches, one thread of a Zen 4 EPYC: about 19.5-25.5
/// GB/s on 4 KiB pages, 25.5-31 on 2 MiB ones). A smaller one comes from the
/// allocator (where AddressSanitizer tracks it in the tests). Either way
/// untouched parts of a big budget cost no resident memory until first use.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// The mapping `ptr` points into (unmapped on drop), or `None` for an
    /// allocation of `len` bytes aligned to [`IO_ALIGN`].
    map: Option<memmap2::MmapMut>,
}

// SAFETY: the buffer is plain memory owned by this value; who may write to
// which part of it, and when, is governed by the callers (the slot state
// machine in `stream.rs`), which synchronise through a mutex.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; `&AlignedBuf` only hands out raw pointers.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zero bytes (rounded up to a whole number of [`IO_ALIGN`] pages);
    /// `None` if the allocation fails or the size overflows.
    pub(crate) fn zeroed(len: usize) -> Option<AlignedBuf> {
        let len = len.max(1).checked_next_multiple_of(IO_ALIGN)?;
        if len < HUGE_PAGE {
            let layout = Layout::from_size_align(len, IO_ALIGN).ok()?;
            // SAFETY: the layout has a non-zero size.
            let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
            return Some(AlignedBuf { ptr, len, map: None });
        }
        let mut map = memmap2::MmapMut::map_anon(len.checked_next_multiple_of(HUGE_PAGE)?).ok()?;
        #[cfg(target_os = "linux")]
        {
            // Advice only: without transparent huge pages it fails or does
            // nothing, and the buffer works the same on 4 KiB pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        let ptr = NonNull::new(map.as_mut_ptr())?;
        Some(AlignedBuf { ptr, len, map: Some(map) })
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Start of the buffer.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The whole buffer, for exclusive use.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes and `&mut self`
        // guarantees no other reference into the buffer.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The whole buffer, shared.
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: valid for `len` initialised bytes; writers only exist
        // through `as_mut_slice` (exclusive) or raw pointers whose users
        // guarantee no overlap with live shared slices.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.map.is_none() {
            let layout = Layout::from_size_align(self.len, IO_ALIGN).expect("valid at allocation");
            // SAFETY: allocated in `zeroed` with this exact layout.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
        // A mapping is unmapped when `map` drops.
    }
}

/// Opens `path` for positioned reads; `Direct` asks the OS to bypass its page
/// cache (O_DIRECT on Linux, F_NOCACHE on macOS, FILE_FLAG_NO_BUFFERING on
/// Windows). Unbuffered reads need aligned offsets, lengths and buffers: the
/// store only issues page-aligned reads of whole pages into aligned slots.
pub(crate) fn open(path: &Path, mode: IoMode) -> io::Result<File> {
    match mode {
        IoMode::Buffered => File::open(path),
        IoMode::Direct => open_direct(path),
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn open_direct(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)
}

#[cfg(target_vendor = "apple")]
fn open_direct(path: &Path) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    let f = File::open(path)?;
    // SAFETY: a plain fcntl on a descriptor this function owns.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(f)
}

#[cfg(windows)]
fn open_direct(path: &Path) -> io::Result<File> {
    use std::os::windows::fs::OpenOptionsExt;
    const FILE_FLAG_NO_BUFFERING: u32 = 0x2000_0000;
    std::fs::OpenOptions::new().read(true).custom_flags(FILE_FLAG_NO_BUFFERING).open(path)
}

#[cfg(not(any(target_os = "linux", target_os = "android", target_vendor = "apple", windows)))]
fn open_direct(_path: &Path) -> io::Result<File> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "unbuffered reads are not implemented on this operating system"))
}

#[cfg(unix)]
fn read_at(f: &File, buf: &mut [u8], off: u64) -> io::Result<usize> {
    std::os::unix::fs::FileExt::read_at(f, buf, off)
}

#[cfg(windows)]
fn read_at(f: &File, buf: &mut [u8], off: u64) -> io::Result<usize> {
    std::os::windows::fs::FileExt::seek_read(f, buf, off)
}

#[cfg(not(any(unix, windows)))]
fn read_at(_f: &File, _buf: &mut [u8], _off: u64) -> io::Result<usize> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "positioned reads are not implemented on this operating system"))
}

/// Reads into `buf` from `off` until `buf` is full or the file ends; fails
/// unless at least `need` bytes arrived. (`buf` may be longer than `need`
/// because unbuffered reads are rounded up to whole pages, which can run past
/// the end of the file.)
pub(crate) fn read_full(f: &File, buf: &mut [u8], off: u64, need: usize) -> io::Result<()> {
    debug_assert!(need <= buf.len());
    let mut got = 0;
    while got < buf.len() {
        match read_at(f, &mut buf[got..], off + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if got < need {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "short read: got {got} of {need} bytes at offset {off}; the file ends early (truncated or being rewritten?)"
            ),
        ));
    }
    Ok(())
}

/// 64-bit FNV-1a: a small, dependency-free hash for identities and
/// checksums (it detects corruption, it is not meant to resist tampering).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_more(0xcbf2_9ce4_8422_2325, bytes)
}

/// Continues an FNV-1a hash `h` over more bytes.
pub(crate) fn fnv1a_more(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_are_aligned_and_zeroed() {
        for n in [1, 4095, 4096, 4097, 1 << 20, (4 << 20) + 1] {
            let mut b = AlignedBuf::zeroed(n).unwrap();
            assert_eq!(b.as_ptr() as usize % IO_ALIGN, 0);
            assert!(b.len() >= n && b.len().is_multiple_of(IO_ALIGN));
            assert!(b.as_mut_slice().iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn short_reads_are_errors_and_reads_past_the_end_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![7u8; 5000]).unwrap();
        let f = open(&p, IoMode::Buffered).unwrap();
        let mut buf = vec![0u8; 8192];
        // A page-rounded read past the end is fine when the needed bytes are there.
        read_full(&f, &mut buf, 0, 5000).unwrap();
        assert!(buf[..5000].iter().all(|&x| x == 7));
        let e = read_full(&f, &mut buf, 4096, 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(e.to_string().contains("short read"), "{e}");
    }
}
