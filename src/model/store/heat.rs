//! Routing heat persisted next to the model: how often each expert was
//! chosen, accumulated over runs, so the store can pin the experts this
//! workload uses most from the first token of the next run.
//!
//! File layout (little-endian), `model.colibri.heat` by default:
//!
//! ```text
//! 0   8  magic        b"COLHEAT\0"
//! 8   4  version      1
//! 12  4  layers       L (decoder layers of the model, dense ones included)
//! 16  4  experts      E
//! 20  4  reserved     0
//! 24  8  file_len     length of the model file it was recorded on
//! 32  8  head_hash    FNV-1a of the model's header and metadata
//! 40  8  sample_hash  FNV-1a of sampled pages of its tensor data
//! 48  8  tokens       tokens recorded
//! 56  8·L·E counts    times expert e of layer l was chosen, layer-major
//! end 8  checksum     FNV-1a of every byte before it
//! ```
//!
//! A file that fails any check (size, magic, version, checksum, a different
//! model, a different shape) is ignored with a warning and overwritten on
//! the next save; it is never trusted.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::reader::ColibriFile;
use crate::io::{fnv1a, fnv1a_more, read_full};

const MAGIC: [u8; 8] = *b"COLHEAT\0";
const VERSION: u32 = 1;
const HEAD: usize = 56;
/// Pages of tensor data sampled into a model's identity.
const SAMPLES: u64 = 64;

/// Which model a file holds: its length, the hash of everything before its
/// tensor data (header, metadata with every offset, padding), and the hash
/// of 64 pages spread evenly over the tensor data, so two models with the
/// same architecture and layout but different weights differ too. Used to
/// refuse a heat file recorded on another model, and to check that a model
/// file reopened after a read error is still the same model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// Model file length in bytes.
    pub file_len: u64,
    /// FNV-1a of the model's header and metadata.
    pub head_hash: u64,
    /// FNV-1a of the sampled pages.
    pub sample_hash: u64,
}

impl ModelIdentity {
    /// Reads the identity of the model in `f`, whose tensor data starts at
    /// `data_off`, with positioned reads (a truncated file is an error).
    pub fn read(f: &File, data_off: u64) -> std::io::Result<ModelIdentity> {
        let file_len = f.metadata()?.len();
        if data_off > file_len {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "file shorter than its header"));
        }
        let n = data_off as usize;
        let mut head = vec![0u8; n];
        read_full(f, &mut head, 0, n)?;
        let data = file_len - data_off;
        let mut sample_hash = fnv1a(&[]);
        let mut page = [0u8; 4096];
        for i in 0..SAMPLES {
            let off = data_off + (data / SAMPLES * i) / 4096 * 4096;
            let n = (file_len - off).min(4096) as usize;
            read_full(f, &mut page[..n], off, n)?;
            sample_hash = fnv1a_more(sample_hash, &page[..n]);
        }
        Ok(ModelIdentity { file_len, head_hash: fnv1a(&head), sample_hash })
    }

    /// The identity of an open model file, read from `path` (which must be it).
    pub fn of(file: &ColibriFile) -> std::io::Result<ModelIdentity> {
        ModelIdentity::read(&File::open(file.path())?, file.data_offset())
    }
}

/// Routing counts per (layer, expert).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heat {
    /// Decoder layers (dense layers have all-zero rows).
    pub layers: usize,
    /// Experts per MoE layer.
    pub experts: usize,
    /// Tokens recorded.
    pub tokens: u64,
    /// `counts[l * experts + e]`: times expert e of layer l was chosen.
    pub counts: Vec<u64>,
}

impl Heat {
    /// All-zero heat of the given shape.
    pub fn zeros(layers: usize, experts: usize) -> Heat {
        Heat { layers, experts, tokens: 0, counts: vec![0; layers * experts] }
    }

    /// Count of expert `e` of layer `l`.
    pub fn get(&self, l: usize, e: usize) -> u64 {
        self.counts[l * self.experts + e]
    }

    pub(crate) fn encode(&self, id: ModelIdentity) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEAD + 8 * self.counts.len() + 8);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.layers as u32).to_le_bytes());
        b.extend_from_slice(&(self.experts as u32).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&id.file_len.to_le_bytes());
        b.extend_from_slice(&id.head_hash.to_le_bytes());
        b.extend_from_slice(&id.sample_hash.to_le_bytes());
        b.extend_from_slice(&self.tokens.to_le_bytes());
        for c in &self.counts {
            b.extend_from_slice(&c.to_le_bytes());
        }
        let sum = fnv1a(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b
    }

    /// Parses heat for a model of `layers` × `experts` with identity `id`;
    /// the error says why the bytes cannot be trusted.
    pub(crate) fn decode(
        b: &[u8],
        id: ModelIdentity,
        layers: usize,
        experts: usize,
    ) -> std::result::Result<Heat, String> {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        if b.len() < HEAD + 8 || b[..8] != MAGIC {
            return Err("not a colibri heat file".into());
        }
        let version = u32_at(8);
        if version != VERSION {
            return Err(format!("heat file version {version} is not supported (this build reads {VERSION})"));
        }
        let (l, e) = (u32_at(12) as usize, u32_at(16) as usize);
        let want = l.checked_mul(e).and_then(|n| n.checked_mul(8)).and_then(|n| n.checked_add(HEAD + 8));
        if want != Some(b.len()) {
            return Err(format!("size {} does not match its {l}×{e} table (truncated?)", b.len()));
        }
        let body = b.len() - 8;
        if fnv1a(&b[..body]) != u64_at(body) {
            return Err("checksum mismatch (corrupt file)".into());
        }
        let theirs = ModelIdentity { file_len: u64_at(24), head_hash: u64_at(32), sample_hash: u64_at(40) };
        if theirs != id {
            return Err("recorded on a different model file".into());
        }
        if (l, e) != (layers, experts) {
            return Err(format!("shape {l}×{e} does not match the model's {layers}×{experts}"));
        }
        let counts = (0..l * e).map(|i| u64_at(HEAD + 8 * i)).collect();
        Ok(Heat { layers: l, experts: e, tokens: u64_at(48), counts })
    }
}

/// The default heat file of a model: its path with `.heat` appended.
pub fn heat_path_for(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_os_string();
    s.push(".heat");
    PathBuf::from(s)
}

/// Loads the heat at `path` for the model `file` with identity `id`.
/// `Ok(None)` when there is no heat file yet; `Err(warning)` when there is
/// one that cannot be trusted.
pub fn load_heat(path: &Path, file: &ColibriFile, id: ModelIdentity) -> std::result::Result<Option<Heat>, String> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("heat file {} ignored: {e}", path.display())),
    };
    let cfg = &file.meta().config;
    let experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    Heat::decode(&bytes, id, cfg.num_layers(), experts)
        .map(Some)
        .map_err(|why| format!("heat file {} ignored: {why}", path.display()))
}

/// Writes `heat` for the model with identity `id` to `path` atomically: a
/// temporary file beside it, synced, then renamed over it, so a crash leaves
/// the old file or the new one, never half of one.
pub fn save_heat(path: &Path, id: ModelIdentity, heat: &Heat) -> Result<()> {
    let bytes = heat.encode(id);
    let mut tmp = path.as_os_str().to_os_string();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: ModelIdentity = ModelIdentity { file_len: 12345, head_hash: 0xfeed, sample_hash: 0xbeef };

    fn sample() -> Heat {
        let mut h = Heat::zeros(3, 4);
        h.tokens = 9;
        for (i, c) in h.counts.iter_mut().enumerate() {
            *c = (i as u64 * 7) % 5;
        }
        h
    }

    #[test]
    fn heat_round_trips() {
        let h = sample();
        assert_eq!(Heat::decode(&h.encode(ID), ID, 3, 4).unwrap(), h);
    }

    #[test]
    fn any_damage_or_a_foreign_model_is_refused() {
        let b = sample().encode(ID);
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(Heat::decode(&bad, ID, 3, 4).is_err(), "flipped byte {i} was accepted");
        }
        assert!(Heat::decode(&b[..b.len() - 1], ID, 3, 4).unwrap_err().contains("size"));
        assert!(Heat::decode(&[], ID, 3, 4).is_err());
        for other in [ModelIdentity { head_hash: 1, ..ID }, ModelIdentity { sample_hash: 1, ..ID }] {
            assert!(Heat::decode(&b, other, 3, 4).unwrap_err().contains("different model"));
        }
        assert!(Heat::decode(&b, ID, 3, 5).unwrap_err().contains("shape"));
    }
}
