//! Writing a `.colibri` file: lay out offsets first, then stream tensors in order.
//!
//! The layout is computed up front from names, dtypes and shapes alone, so the
//! metadata (which holds every offset) can be written before any tensor data
//! and the converter never holds more than one tensor chunk in memory.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::{ExpertSlab, FLAG_PART, FileMeta, HEADER_LEN, MAGIC, PAGE, TENSOR_ALIGN, TensorEntry, VERSION, align_up};
use crate::error::{Error, Result};
use crate::quant::DType;

/// A tensor to place: name, dtype, shape and, for routed experts, (layer, expert).
pub struct ToPlace {
    /// Canonical name.
    pub name: String,
    /// Storage type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// `Some((layer, expert))` for the matrices of a routed expert.
    pub expert: Option<(usize, usize)>,
}

/// Assigns offsets: 64-byte aligned tensors, a fresh page for each expert slab.
/// Tensors of one expert must be consecutive in `items`.
pub fn layout(items: &[ToPlace]) -> Result<(Vec<TensorEntry>, Vec<ExpertSlab>)> {
    let overflow = || Error::InvalidInput("model too large: tensor offsets overflow u64".into());
    let mut pos = 0u64;
    let mut tensors = Vec::with_capacity(items.len());
    let mut slabs: Vec<ExpertSlab> = Vec::new();
    let mut current: Option<(usize, usize)> = None;
    for it in items {
        let nbytes = it.dtype.tensor_bytes(&it.shape).ok_or_else(|| {
            Error::InvalidInput(format!("{}: shape {:?} is not storable as {}", it.name, it.shape, it.dtype))
        })? as u64;
        if it.expert.is_some() && it.expert != current {
            pos = align_up(pos, PAGE).ok_or_else(overflow)?;
            let (layer, expert) = it.expert.unwrap_or_default();
            slabs.push(ExpertSlab { layer, expert, offset: pos, nbytes: 0 });
        } else {
            pos = align_up(pos, TENSOR_ALIGN).ok_or_else(overflow)?;
        }
        current = it.expert;
        tensors.push(TensorEntry {
            name: it.name.clone(),
            dtype: it.dtype,
            shape: it.shape.clone(),
            offset: pos,
            nbytes,
        });
        pos = pos.checked_add(nbytes).ok_or_else(overflow)?;
        if it.expert.is_some() {
            let slab = slabs.last_mut().expect("slab opened above");
            slab.nbytes = pos - slab.offset;
        }
    }
    Ok((tensors, slabs))
}

/// Streams a `.colibri` file to disk. Tensors must be written in the order of
/// `meta.tensors`; [`Writer::finish`] checks that all of them were.
pub struct Writer {
    out: BufWriter<File>,
    path: PathBuf,
    /// Absolute file position of the next byte written.
    pos: u64,
    data_off: u64,
    tensors: Vec<TensorEntry>,
    /// Index of the tensor being written (or next to be written).
    next: usize,
    /// Bytes still owed to the tensor in progress; `None` between tensors.
    remaining: Option<u64>,
}

impl Writer {
    /// Creates `path` (which must not exist: the caller writes to a temporary
    /// name and renames) and writes the header and metadata.
    pub fn create(path: &Path, meta: &FileMeta) -> Result<Writer> {
        let json = serde_json::to_vec(meta).map_err(|e| Error::InvalidInput(format!("cannot encode metadata: {e}")))?;
        let data_off = align_up((HEADER_LEN + json.len()) as u64, PAGE).expect("metadata size fits");
        let file = File::options().write(true).create_new(true).open(path).map_err(|e| Error::io(path, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        let flags = if meta.part.is_some() { FLAG_PART } else { 0 };
        header.extend_from_slice(&flags.to_le_bytes());
        header.extend_from_slice(&(json.len() as u64).to_le_bytes());
        header.extend_from_slice(&data_off.to_le_bytes());
        let io = |e| Error::io(path, e);
        out.write_all(&header).map_err(io)?;
        out.write_all(&json).map_err(io)?;
        let mut w = Writer {
            out,
            path: path.to_path_buf(),
            pos: (HEADER_LEN + json.len()) as u64,
            data_off,
            tensors: meta.tensors.clone(),
            next: 0,
            remaining: None,
        };
        w.pad_to(data_off)?;
        Ok(w)
    }

    fn pad_to(&mut self, target: u64) -> Result<()> {
        debug_assert!(target >= self.pos);
        const ZEROS: [u8; 4096] = [0; 4096];
        while self.pos < target {
            let n = ((target - self.pos) as usize).min(ZEROS.len());
            self.out.write_all(&ZEROS[..n]).map_err(|e| Error::io(&self.path, e))?;
            self.pos += n as u64;
        }
        Ok(())
    }

    /// Starts the next tensor, which must be called `name`; returns its byte length.
    pub fn begin(&mut self, name: &str) -> Result<u64> {
        assert!(self.remaining.is_none(), "begin() while a tensor is still open");
        let entry = self.tensors.get(self.next).unwrap_or_else(|| panic!("no tensor left to write, got {name}"));
        assert_eq!(entry.name, name, "tensors written out of order");
        let (off, n) = (self.data_off + entry.offset, entry.nbytes);
        self.pad_to(off)?;
        self.remaining = Some(n);
        Ok(n)
    }

    /// Appends bytes to the open tensor.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let rem = self.remaining.as_mut().expect("write() with no open tensor");
        assert!(bytes.len() as u64 <= *rem, "tensor overrun");
        *rem -= bytes.len() as u64;
        self.out.write_all(bytes).map_err(|e| Error::io(&self.path, e))?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Closes the open tensor; it must have received exactly its byte length.
    pub fn end(&mut self) {
        assert_eq!(self.remaining.take(), Some(0), "tensor underrun");
        self.next += 1;
    }

    /// Flushes and syncs the file. Panics if a tensor was never written
    /// (a bug in the caller, not a property of the input).
    pub fn finish(mut self) -> Result<()> {
        assert_eq!(self.next, self.tensors.len(), "not every tensor was written");
        let io = |p: &Path, e| Error::io(p, e);
        self.out.flush().map_err(|e| io(&self.path, e))?;
        let mut file = self.out.into_inner().map_err(|e| io(&self.path, e.into_error()))?;
        // The file ends exactly after the last tensor; check the OS agrees.
        let end = file.seek(SeekFrom::End(0)).map_err(|e| io(&self.path, e))?;
        debug_assert_eq!(end, self.pos);
        file.sync_all().map_err(|e| io(&self.path, e))?;
        Ok(())
    }
}
