//! Opening a `.colibri` file: mmap, then validate every field before use.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{FLAG_PART, FileMeta, HEADER_LEN, MAGIC, PAGE, Part, TENSOR_ALIGN, VERSION};
use crate::canonical::tensors::{Role, TensorId};
use crate::error::{Error, Result};
use crate::io::{HUGE_PAGE, read_full};
use crate::quant::DType;

/// A borrowed view of one tensor's bytes inside the mapped file.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    /// Storage type.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: &'a [usize],
    /// The raw little-endian bytes (`dtype.tensor_bytes(shape)` of them).
    pub bytes: &'a [u8],
}

/// An open, validated `.colibri` file.
pub struct ColibriFile {
    path: PathBuf,
    /// The file's bytes from `start` on: its mapping (`start` 0), or after
    /// [`ColibriFile::use_copy`] an anonymous copy, which may be longer.
    map: Mmap,
    /// Where the file's bytes begin in `map`.
    start: usize,
    /// The file's length in bytes.
    len: usize,
    /// Whether `map` is a copy rather than the file's mapping.
    copied: bool,
    /// The file as opened (`None` for bytes validated in memory): copies
    /// read from it, so they hold the bytes of the file that was mapped.
    handle: Option<File>,
    meta: FileMeta,
    data_off: usize,
    by_name: HashMap<String, usize>,
    /// (layer, expert) → index into `meta.experts`.
    slabs: HashMap<(usize, usize), usize>,
}

impl std::fmt::Debug for ColibriFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ColibriFile").field("path", &self.path).finish_non_exhaustive()
    }
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A copy of a file's bytes in memory of the process's own (see
/// [`ColibriFile::read_copy`]).
pub struct FileCopy {
    map: Mmap,
    start: usize,
    len: usize,
}

impl FileCopy {
    /// The copied bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
}

/// A file of `len` bytes must hold at least the fixed header (checked before
/// it is mapped: the validation reads the header's fields in place).
fn check_header_room(path: &Path, len: u64) -> Result<()> {
    if len < HEADER_LEN as u64 {
        return Err(Error::format(path, format!("file is {len} bytes, too short for a .colibri header")));
    }
    Ok(())
}

impl ColibriFile {
    /// Maps `path` and validates header, metadata and tensor table.
    pub fn open(path: &Path) -> Result<ColibriFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let md = file.metadata().map_err(|e| Error::io(path, e))?;
        if md.is_dir() {
            return Err(Error::format(
                path,
                "is a directory, not a .colibri file (convert a Hugging Face folder with `colibri convert` first)",
            ));
        }
        check_header_room(path, md.len())?;
        // SAFETY: the map is read-only and lives as long as `self`. The usual
        // mmap caveat applies: if another process truncates or rewrites the
        // file while it is mapped, reads may fault or see new bytes. colibri
        // never writes to a file it has open, and `convert` writes to a
        // temporary name and renames, which leaves existing maps intact.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let mut opened = Self::from_map(path, map)?;
        opened.handle = Some(file);
        Ok(opened)
    }

    /// Asks the OS to back the mapping with 2 MiB pages where it can (Linux;
    /// elsewhere nothing): pages the kernel reads in from now on come as
    /// 2 MiB folios where the file system allows, and the kernels stream
    /// those faster than 4 KiB ones (the bench probe, one thread: about 18
    /// against 28 GB/s on a Zen 4 EPYC). Pages already cached keep their
    /// size (see `model::store::backing`, which copies the file when they
    /// are small). For a model whose weights are all read through the map;
    /// a streamed one reads its experts with positioned reads instead.
    pub fn advise_huge_pages(&self) {
        // A copy was advised when it was made.
        #[cfg(target_os = "linux")]
        if !self.copied {
            // Advice only: refused or ignored, the map works the same.
            let _ = self.map.advise(memmap2::Advice::HugePage);
        }
    }

    /// Validates `bytes` as the contents of a `.colibri` file named `path`
    /// (copied into an anonymous mapping): what [`ColibriFile::open`] does
    /// after mapping the file, for inputs already in memory (the fuzz targets).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<ColibriFile> {
        check_header_room(path, bytes.len() as u64)?;
        let mut anon = memmap2::MmapMut::map_anon(bytes.len()).map_err(|e| Error::io(path, e))?;
        anon.copy_from_slice(bytes);
        let map = anon.make_read_only().map_err(|e| Error::io(path, e))?;
        Self::from_map(path, map)
    }

    fn from_map(path: &Path, map: Mmap) -> Result<ColibriFile> {
        let bad = |m: String| Error::format(path, m);
        let b: &[u8] = &map;
        let len = b.len() as u64;
        if b[..8] != MAGIC {
            return Err(bad("not a .colibri file (bad magic bytes)".into()));
        }
        let version = read_u32(b, 8);
        if version != VERSION {
            return Err(bad(format!(
                "format version {version} is not supported by this build (it reads version {VERSION})"
            )));
        }
        let flags = read_u32(b, 12);
        if flags & !FLAG_PART != 0 {
            return Err(bad(format!("unknown header flags {flags:#x}")));
        }
        let meta_len = read_u64(b, 16);
        let data_off = read_u64(b, 24);
        let meta_end = (HEADER_LEN as u64).checked_add(meta_len).filter(|&e| e <= len).ok_or_else(|| {
            bad(format!("metadata length {meta_len} runs past the end of the file ({len} bytes); truncated?"))
        })?;
        if !data_off.is_multiple_of(PAGE) || data_off < meta_end || data_off > len {
            return Err(bad(format!(
                "data offset {data_off} is invalid (must be a multiple of {PAGE}, after the metadata at {meta_end}, within the {len}-byte file)"
            )));
        }
        let meta: FileMeta = serde_json::from_slice(&b[HEADER_LEN..meta_end as usize])
            .map_err(|e| bad(format!("metadata is not valid: {e}")))?;
        meta.config.validate().map_err(|e| bad(e.to_string()))?;
        match (&meta.part, flags & FLAG_PART != 0) {
            (Some(part), true) => part.check(&meta.config).map_err(&bad)?,
            (None, false) => {}
            _ => return Err(bad("the header's stage-file flag and the metadata disagree".into())),
        }
        let data_len = len - data_off;

        // Every tensor: known size for its dtype and shape, aligned, inside the file.
        let mut by_name = HashMap::with_capacity(meta.tensors.len());
        for (i, t) in meta.tensors.iter().enumerate() {
            let want = t.dtype.tensor_bytes(&t.shape).map(|n| n as u64);
            if want != Some(t.nbytes) {
                if first_q6k_layout(t.dtype, &t.shape) == Some(t.nbytes) {
                    return Err(bad(format!(
                        "tensor {}: its {} bytes are the first q6k layout (one scale per 32 values), which \
                         this build no longer reads; convert the checkpoint again (q6k now has a scale per 16 \
                         values)",
                        t.name, t.nbytes
                    )));
                }
                return Err(bad(format!(
                    "tensor {}: {} bytes recorded, but a {} tensor of shape {:?} needs {:?}",
                    t.name, t.nbytes, t.dtype, t.shape, want
                )));
            }
            if t.offset % TENSOR_ALIGN != 0 {
                return Err(bad(format!("tensor {}: offset {} is not {TENSOR_ALIGN}-byte aligned", t.name, t.offset)));
            }
            if t.offset.checked_add(t.nbytes).is_none_or(|e| e > data_len) {
                return Err(bad(format!(
                    "tensor {}: bytes {}..{} lie outside the {data_len} bytes of tensor data; truncated file?",
                    t.name,
                    t.offset,
                    t.offset.saturating_add(t.nbytes)
                )));
            }
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(bad(format!("tensor {} is listed twice", t.name)));
            }
        }
        // No two tensors share bytes.
        let mut spans: Vec<(u64, u64, &str)> =
            meta.tensors.iter().map(|t| (t.offset, t.offset + t.nbytes, t.name.as_str())).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(bad(format!("tensors {} and {} overlap", w[0].2, w[1].2)));
            }
        }

        // The tensor table matches what the config implies, name by name.
        let plan = meta.plan();
        if plan.len() != meta.tensors.len() {
            return Err(bad(format!(
                "the config implies {} tensors but the file lists {}",
                plan.len(),
                meta.tensors.len()
            )));
        }
        for p in &plan {
            let name = p.id.to_string();
            let t = by_name
                .get(&name)
                .map(|&i| &meta.tensors[i])
                .ok_or_else(|| bad(format!("tensor {name} is missing")))?;
            if t.shape != p.shape {
                return Err(bad(format!("tensor {name}: shape {:?}, but the config implies {:?}", t.shape, p.shape)));
            }
            if p.role == Role::Small && t.dtype != DType::F32 {
                return Err(bad(format!("tensor {name}: stored as {}, but small tensors must be f32", t.dtype)));
            }
        }

        // Expert slabs: one per (layer, expert) of every MoE layer, page aligned,
        // inside the data, holding exactly that expert's three matrices.
        let mut slabs = HashMap::with_capacity(meta.experts.len());
        for (i, s) in meta.experts.iter().enumerate() {
            let end = s.offset.checked_add(s.nbytes).filter(|&e| e <= data_len);
            if s.offset % PAGE != 0 || end.is_none() {
                return Err(bad(format!(
                    "expert slab ({}, {}) has a bad range {}+{}",
                    s.layer, s.expert, s.offset, s.nbytes
                )));
            }
            if slabs.insert((s.layer, s.expert), i).is_some() {
                return Err(bad(format!("expert slab ({}, {}) is listed twice", s.layer, s.expert)));
            }
            use crate::canonical::tensors::ExpertTensor as X;
            for which in X::ALL.into_iter().chain(X::BIASES) {
                let name = TensorId::Expert(s.layer, s.expert, which).to_string();
                let t = match by_name.get(&name) {
                    Some(&i) => &meta.tensors[i],
                    // Biases are optional (the plan check above decides whether they belong).
                    None if X::BIASES.contains(&which) => continue,
                    None => return Err(bad(format!("expert slab ({}, {}) has no tensor {name}", s.layer, s.expert))),
                };
                if t.offset < s.offset || t.offset + t.nbytes > s.offset + s.nbytes {
                    return Err(bad(format!("tensor {name} lies outside its expert slab")));
                }
            }
        }
        let want_slabs = plan
            .iter()
            .filter(|p| matches!(p.id, TensorId::Expert(_, _, crate::canonical::tensors::ExpertTensor::Gate)))
            .count();
        if slabs.len() != want_slabs {
            return Err(bad(format!("the file has {} expert slabs, the config implies {want_slabs}", slabs.len())));
        }

        let len = map.len();
        Ok(ColibriFile {
            start: 0,
            handle: None,
            path: path.to_path_buf(),
            data_off: data_off as usize,
            meta,
            map,
            len,
            copied: false,
            by_name,
            slabs,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated metadata.
    pub fn meta(&self) -> &FileMeta {
        &self.meta
    }

    /// What part of its model a stage file holds; `None` for a whole model.
    pub fn part(&self) -> Option<&Part> {
        self.meta.part.as_ref()
    }

    /// True when this file holds decoder layer `l`'s weights (every layer
    /// of a whole model, the multi-token-prediction one included).
    pub fn holds_layer(&self, l: usize) -> bool {
        self.meta.part.as_ref().is_none_or(|p| p.range().contains(&l))
    }

    /// Byte offset of the tensor data (a multiple of [`PAGE`]).
    pub fn data_offset(&self) -> u64 {
        self.data_off as u64
    }

    /// Everything before the tensor data (header, metadata, padding), as
    /// mapped at open.
    pub fn head_bytes(&self) -> &[u8] {
        &self.bytes()[..self.data_off]
    }

    /// Total file size in bytes.
    pub fn file_len(&self) -> u64 {
        self.len as u64
    }

    /// The file's bytes as the tensors are read: the mapping or the copy.
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    /// True once [`ColibriFile::use_copy`] has replaced the mapping.
    pub fn is_copied(&self) -> bool {
        self.copied
    }

    /// A copy of the file in anonymous memory, asked for in 2 MiB pages on
    /// Linux and starting on a 2 MiB boundary. It is read from the file as
    /// opened (the one mapped), with positioned reads, 64 MiB at a time on up
    /// to eight threads; `progress(bytes done)` is called now and then from
    /// this thread, and last with the file's length. A file that changed
    /// length since it was opened is refused (a rewrite in place is the
    /// usual caveat of a mapping: it shows in both). [`Self::use_copy`]
    /// puts the copy in place of the mapping.
    pub fn read_copy(&self, progress: &mut dyn FnMut(u64)) -> Result<FileCopy> {
        self.read_copy_in(64 << 20, progress)
    }

    /// [`Self::read_copy`] in chunks of `chunk` bytes.
    pub(super) fn read_copy_in(&self, chunk: usize, progress: &mut dyn FnMut(u64)) -> Result<FileCopy> {
        let path = &self.path;
        let len = self.len;
        if let Some(f) = &self.handle {
            let now = f.metadata().map_err(|e| Error::io(path, e))?.len();
            if now != len as u64 {
                return Err(Error::format(
                    path,
                    format!("the file changed length while open ({len} bytes, now {now}); open it again"),
                ));
            }
        }
        let too_big = || Error::InvalidInput(format!("{}: {len} bytes are too many to copy", path.display()));
        let room =
            len.checked_next_multiple_of(HUGE_PAGE).and_then(|n| n.checked_add(HUGE_PAGE)).ok_or_else(too_big)?;
        let mut anon = memmap2::MmapMut::map_anon(room).map_err(|e| {
            Error::InvalidInput(format!("cannot reserve {room} bytes of memory to copy {}: {e}", path.display()))
        })?;
        #[cfg(target_os = "linux")]
        {
            // Advice only: without transparent huge pages the copy works the
            // same on 4 KiB pages.
            let _ = anon.advise(memmap2::Advice::HugePage);
        }
        // The copy starts on a 2 MiB boundary, so its pages can be whole
        // huge pages however the kernel placed the mapping.
        let start = (anon.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - anon.as_ptr() as usize;
        // Chunks dealt round-robin to up to eight threads (the page faults
        // that zero the new pages and the copies out of the page cache both
        // scale with cores); this thread is one of them and reports progress.
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8);
        let mut shares: Vec<Vec<(usize, &mut [u8])>> = (0..workers).map(|_| Vec::new()).collect();
        for (i, piece) in anon[start..start + len].chunks_mut(chunk).enumerate() {
            shares[i % workers].push((i * chunk, piece));
        }
        let done = std::sync::atomic::AtomicU64::new(0);
        let source = self.handle.as_ref();
        let mapped = self.bytes();
        let read = |share: Vec<(usize, &mut [u8])>, progress: &mut dyn FnMut(u64)| -> std::io::Result<()> {
            for (at, piece) in share {
                let n = piece.len();
                match source {
                    Some(f) => read_full(f, piece, at as u64, n)?,
                    None => piece.copy_from_slice(&mapped[at..at + n]),
                }
                let total = done.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed) + n as u64;
                progress(total);
            }
            Ok(())
        };
        let mut shares = shares.into_iter();
        let mine = shares.next().unwrap_or_default();
        let result = std::thread::scope(|scope| {
            let others: Vec<_> = shares.map(|share| scope.spawn(|| read(share, &mut |_| {}))).collect();
            let first = read(mine, progress);
            others.into_iter().fold(first, |r, h| r.and(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))))
        });
        result.map_err(|e| Error::io(path, e))?;
        progress(len as u64);
        let map = anon.make_read_only().map_err(|e| Error::io(path, e))?;
        Ok(FileCopy { map, start, len })
    }

    /// Reads tensors from `copy` (of this file, from [`Self::read_copy`])
    /// instead of the mapping, which is dropped. Tensors keep their offsets.
    pub fn use_copy(&mut self, copy: FileCopy) {
        assert_eq!(copy.len, self.len, "a copy of this file");
        self.map = copy.map;
        self.start = copy.start;
        self.copied = true;
    }

    /// The bytes of tensor `name`, or a format error naming it if absent.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let &i =
            self.by_name.get(name).ok_or_else(|| Error::format(&self.path, format!("tensor {name} is missing")))?;
        Ok(self.tensor_at(i))
    }

    /// Index of tensor `name` in the metadata's tensor table.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The bytes of the `i`-th tensor of the table. Panics if `i` is out of range.
    pub fn tensor_at(&self, i: usize) -> TensorView<'_> {
        let t = &self.meta.tensors[i];
        let start = self.data_off + t.offset as usize;
        // In range: checked against the file length in `from_map`.
        let bytes = &self.bytes()[start..start + t.nbytes as usize];
        TensorView { dtype: t.dtype, shape: &t.shape, bytes }
    }

    /// Absolute byte range of expert (layer, e)'s slab in the file.
    pub fn expert_slab(&self, layer: usize, expert: usize) -> Option<(u64, u64)> {
        let s = &self.meta.experts[*self.slabs.get(&(layer, expert))?];
        Some((self.data_off as u64 + s.offset, s.nbytes))
    }
}

/// The size a `dtype` (q6k or q6kx8) tensor of `shape` had in the first
/// q6k layout (`None` for other types).
fn first_q6k_layout(dtype: DType, shape: &[usize]) -> Option<u64> {
    if dtype.base() != DType::Q6K {
        return None;
    }
    let (&cols, lead) = shape.split_last()?;
    let rows = lead.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    let row = crate::quant::kquant::row_bytes_q6k_v1(cols)?;
    rows.checked_mul(row).map(|n| n as u64)
}
