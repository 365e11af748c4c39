//! Entry points for the fuzz targets (`fuzz/`): each takes arbitrary bytes,
//! feeds them to one reader the way a user's file would reach it, and
//! returns what the reader said. Every outcome but a panic, a hang or an
//! oversized allocation is acceptable: an `Err` is the reader doing its
//! job. The same functions replay the regression inputs in `cargo test`
//! (`tests` below), so a crash a fuzzer found stays fixed without nightly.
//!
//! Not part of the API (hidden from the docs); the names may change.
#![doc(hidden)]

use std::path::Path;
use std::sync::Arc;

use crate::arch::{self, HfConfig};
use crate::engine::sampling::{Sampler, SamplingParams};
use crate::format::reader::ColibriFile;
use crate::model::Model;
use crate::model::store::heat::{Heat, ModelIdentity};

/// Bytes as a `.colibri` file: parse and validate, then build the model
/// over it; when that succeeds, run one token through the forward pass
/// (tiny models only, so a run stays fast). `Ok` when the file was accepted.
pub fn colibri_file(bytes: &[u8]) -> Result<(), String> {
    let file = ColibriFile::from_bytes(Path::new("fuzz.colibri"), bytes).map_err(|e| e.to_string())?;
    let file = Arc::new(file);
    let cfg = file.meta().config.clone();
    let model = Model::from_file(file).map_err(|e| e.to_string())?;
    // A forward pass allocates a session sized by the config: only for
    // models small enough that it cannot be large.
    let small = cfg.hidden_size <= 512 && cfg.vocab_size <= 4096 && cfg.num_layers() <= 4;
    if small {
        use crate::model::session::{DEFAULT_CHUNK, Session};
        let mut s = Session::with_kv(&model, 2, DEFAULT_CHUNK, crate::quant::DType::F32);
        let never = || false;
        crate::model::forward::forward(&model, &mut s, &[0], Default::default(), None, &never)
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Bytes as a Hugging Face `config.json`: find its adapter and map it to
/// the canonical config (and validate that), and also try every registered
/// adapter on it, as a checkpoint with a mislabelled class would.
pub fn hf_config(bytes: &[u8]) -> Result<(), String> {
    let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
    let cfg = HfConfig::parse(Path::new("config.json"), text).map_err(|e| e.to_string())?;
    for a in arch::REGISTRY {
        if let Ok(c) = (a.config)(&cfg) {
            let _ = c.validate();
        }
    }
    let a = arch::lookup(&cfg).map_err(|e| e.to_string())?;
    let c = (a.config)(&cfg).map_err(|e| e.to_string())?;
    c.validate().map_err(|e| e.to_string())
}

/// Bytes as a heat file for a model of 4 layers and 8 experts (the first
/// byte picks another shape: 0..16 layers, 0..64 experts).
pub fn heat(bytes: &[u8]) -> Result<(), String> {
    let (layers, experts) = match bytes.first() {
        Some(&b) => ((b & 0x0F) as usize, (b >> 4) as usize * 4),
        None => (4, 8),
    };
    let body = bytes.get(1..).unwrap_or(&[]);
    Heat::decode(body, HEAT_ID, layers, experts).map(|_| ())
}

/// A [`safetensors`] input in the int4 mode: one compressed-tensors
/// `pack-quantized` tensor of 8 × 64 (codes, bf16 scales, shape) beside a
/// plain one.
fn int4_seed() -> Vec<u8> {
    let (rows, cols) = (8usize, 64usize);
    let codes: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 37 % 256) as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .flat_map(|g| half::bf16::from_f32(0.01 * (g as f32 + 1.0)).to_bits().to_le_bytes())
        .collect();
    let shape: Vec<u8> = [rows as i64, cols as i64].iter().flat_map(|v| v.to_le_bytes()).collect();
    let norm: Vec<u8> = (0..cols).flat_map(|i| (1.0f32 + i as f32).to_le_bytes()).collect();
    let parts = [
        ("m.norm.weight", "F32", vec![cols], norm),
        ("m.proj.weight_packed", "I32", vec![rows, cols / 8], codes),
        ("m.proj.weight_scale", "BF16", vec![rows, cols / 32], scales),
        ("m.proj.weight_shape", "I64", vec![2], shape),
    ];
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in parts {
        let at = [data.len(), data.len() + bytes.len()];
        header.insert(name.into(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": at}));
        data.extend_from_slice(&bytes);
    }
    let h = serde_json::to_vec(&header).expect("a JSON object");
    let mut out = vec![0x14];
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend(h);
    out.extend(data);
    out
}

/// The model identity [`heat`] checks files against.
const HEAT_ID: ModelIdentity = ModelIdentity { file_len: 1 << 20, head_hash: 0x1234_5678, sample_hash: 0x9abc };

/// Writes seed inputs for every target under `dir/<target>/`: tiny
/// `.colibri` files of several weight types, the parity fixtures'
/// config.json and model.safetensors (`fixtures`: `tests/fixtures/golden`),
/// a heat file, sampling options. Returns how many files it wrote.
pub fn write_seeds(dir: &Path, fixtures: &Path) -> std::io::Result<usize> {
    use crate::quant::DType;
    let mut n = 0;
    let mut put = |target: &str, name: &str, bytes: &[u8]| -> std::io::Result<()> {
        let d = dir.join(target);
        std::fs::create_dir_all(&d)?;
        n += 1;
        std::fs::write(d.join(name), bytes)
    };
    let scratch = Scratch::new()?;
    for (i, dtype) in [DType::F32, DType::Q8_0, DType::Q4_0, DType::Mxfp4].into_iter().enumerate() {
        let path = scratch.0.join(format!("tiny-{dtype}.colibri"));
        crate::synth::write_random_model(&path, &crate::synth::tiny_config(), dtype, i as u64);
        put("colibri_file", &format!("tiny-{dtype}.colibri"), &std::fs::read(&path)?)?;
    }
    let mut families: Vec<_> = std::fs::read_dir(fixtures)?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    families.sort();
    for f in families {
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if let Ok(c) = std::fs::read(f.join("config.json")) {
            put("hf_config", &format!("{name}.json"), &c)?;
        }
        if let Ok(st) = std::fs::read(f.join("model.safetensors")) {
            let mut b = vec![if name.contains("mxfp4") { 0x4F } else { 0 }];
            b.extend_from_slice(&st);
            put("safetensors", &format!("{name}.safetensors"), &b)?;
            if name == "mixtral" {
                // The same tensors as shard a of an index; shard b holds nothing.
                let index = br#"{"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}"#;
                let empty = [&8u64.to_le_bytes()[..], b"{}      "].concat();
                let mut b = vec![SHARDED];
                b.extend_from_slice(&(index.len() as u16).to_le_bytes());
                b.extend_from_slice(index);
                b.extend_from_slice(&(st.len() as u32).to_le_bytes());
                b.extend_from_slice(&st);
                b.extend_from_slice(&empty);
                put("safetensors", "mixtral-sharded.safetensors", &b)?;
            }
        }
    }
    put("safetensors", "int4-packed.safetensors", &int4_seed())?;
    let mut heat = Heat::zeros(4, 8);
    heat.tokens = 5;
    heat.counts.iter_mut().enumerate().for_each(|(i, c)| *c = i as u64 * 3);
    let mut b = vec![0x24];
    b.extend_from_slice(&heat.encode(HEAT_ID));
    put("heat", "l4-e8.heat", &b)?;
    for (name, opts) in [
        ("greedy", [0.0f32, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]),
        ("top-k-p", [0.8, 40.0, 0.9, 0.05, 1.1, 0.2, 0.1]),
        ("hot", [2.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]),
    ] {
        let mut b = Vec::new();
        for (i, v) in opts.iter().enumerate() {
            // Field 1 (top-k) is an integer.
            let w = if i == 1 { (*v as u32).to_le_bytes() } else { v.to_le_bytes() };
            b.extend_from_slice(&w);
        }
        b.extend_from_slice(&7u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&50u32.to_le_bytes());
        for i in 0..50 {
            b.extend_from_slice(&(crate::math::sin(i as f64 * 0.37) as f32 * 4.0).to_le_bytes());
        }
        put("sampler", &format!("{name}.bin"), &b)?;
    }
    Ok(n)
}

/// Bytes as sampling options and logits: the first 40 bytes are the
/// options (temperature, top-k, top-p, min-p, three penalties, seed), the
/// next 4 a vocabulary size below 4096, the rest f32 logits (repeated or
/// cut to the vocabulary) and a prompt. A token must come out in the
/// vocabulary whenever the options are accepted.
pub fn sampler(bytes: &[u8]) -> Result<(), String> {
    let f = |i: usize| bytes.get(4 * i..4 * i + 4).map_or(0.0, |b| f32::from_le_bytes(b.try_into().expect("4")));
    let u = |i: usize| bytes.get(4 * i..4 * i + 4).map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4")));
    let params = SamplingParams {
        temperature: f(0),
        top_k: u(1) as usize,
        top_p: f(2),
        min_p: f(3),
        repetition_penalty: f(4),
        presence_penalty: f(5),
        frequency_penalty: f(6),
        seed: u(7) as u64 | ((u(8) as u64) << 32),
    };
    let vocab = (u(9) as usize % 4096).max(1);
    let rest: Vec<f32> =
        bytes.get(40..).unwrap_or(&[]).chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4"))).collect();
    let logits: Vec<f32> = (0..vocab).map(|i| if rest.is_empty() { 0.0 } else { rest[i % rest.len()] }).collect();
    let prompt: Vec<u32> = rest.iter().take(16).map(|x| x.to_bits() % (vocab as u32 + 2)).collect();
    let mut s = Sampler::new(params, vocab, &prompt).map_err(|e| e.to_string())?;
    for _ in 0..3 {
        let t = s.sample(&logits);
        assert!((t as usize) < vocab, "sampled token {t} outside a vocabulary of {vocab}");
        s.accept(t);
    }
    Ok(())
}

/// Bytes as a safetensors checkpoint after a first byte that picks its
/// form: 0xF8 FP8 blocks, 0x4F MXFP4, 0x14 compressed-tensors int4 (one
/// file, with that quantisation config), 0x1D sharded (an index and two
/// shards: [`SHARDED`]), anything else one plain file. Opens it, then decodes
/// every tensor of at most a million values (an int4 one also into q4_0).
pub fn safetensors(bytes: &[u8]) -> Result<(), String> {
    let (mode, body) = bytes.split_first().map_or((0, &[][..]), |(m, b)| (*m, b));
    let quant = match mode {
        0xF8 => Some(serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]})),
        0x4F => Some(serde_json::json!({"quant_method": "mxfp4"})),
        0x14 => Some(serde_json::json!({
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"g": {"weights": {
                "num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32
            }}}
        })),
        _ => None,
    };
    let dir = Scratch::new().map_err(|e| e.to_string())?;
    if mode == SHARDED {
        // [u16 index length][index JSON][u32 first shard length][a.safetensors][b.safetensors]
        let take = |b: &[u8], n: usize| (b.get(..n).unwrap_or(b).to_vec(), b.get(n..).unwrap_or(&[]).to_vec());
        let (len, rest) = take(body, 2);
        let (index, rest) = take(&rest, len.iter().rev().fold(0, |a, &x| a << 8 | x as usize));
        let (len, rest) = take(&rest, 4);
        let (a, b) = take(&rest, len.iter().rev().fold(0, |a, &x| a << 8 | x as usize));
        for (name, data) in [("model.safetensors.index.json", index), ("a.safetensors", a), ("b.safetensors", b)] {
            std::fs::write(dir.0.join(name), data).map_err(|e| e.to_string())?;
        }
    } else {
        std::fs::write(dir.0.join("model.safetensors"), body).map_err(|e| e.to_string())?;
    }
    let ck = crate::convert::safetensors::Checkpoint::open(&dir.0, quant.as_ref()).map_err(|e| e.to_string())?;
    let names: Vec<String> = ck.names().map(String::from).collect();
    for name in names {
        let t = ck.get(&name).expect("listed");
        if t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).is_some_and(|n| n <= 1 << 20) {
            let _ = ck.decode_f32(&name, t, None);
            if matches!(t.enc, crate::convert::safetensors::Encoding::PackedInt4 { .. })
                && ck.int4_scales(&name, t).is_ok_and(|c| c.overflow == 0)
            {
                let _ = ck.int4_as_q4_0(t, crate::quant::DType::Q4_0, None);
            }
        }
    }
    Ok(())
}

/// The [`safetensors`] mode byte of a sharded checkpoint.
pub const SHARDED: u8 = 0x1D;

/// A fresh directory for one call, in memory where the OS has it, removed
/// when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> std::io::Result<Scratch> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = base.join(format!("colibri-fuzz-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Target = fn(&[u8]) -> Result<(), String>;
    const TARGETS: [(&str, Target); 5] = [
        ("colibri_file", colibri_file),
        ("hf_config", hf_config),
        ("heat", heat),
        ("sampler", sampler),
        ("safetensors", safetensors),
    ];

    /// The seeds are real inputs: each target accepts its own (so a short
    /// fuzz run starts from files that reach deep into the readers).
    #[test]
    fn every_target_accepts_its_seeds() {
        let dir = Scratch::new().unwrap();
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden");
        let n = write_seeds(&dir.0, &fixtures).unwrap();
        assert!(n >= 20, "{n} seeds");
        for (name, f) in TARGETS {
            let mut seeds: Vec<_> = std::fs::read_dir(dir.0.join(name)).unwrap().map(|e| e.unwrap().path()).collect();
            seeds.sort();
            assert!(!seeds.is_empty(), "{name}: no seeds");
            for p in seeds {
                let r = f(&std::fs::read(&p).unwrap());
                assert!(r.is_ok(), "{name} {}: {r:?}", p.display());
            }
        }
    }

    /// Every input a fuzzer found a problem with (`fuzz/regressions/<target>/`)
    /// is handled without a panic now.
    #[test]
    fn fuzz_regressions_are_handled() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions");
        let mut ran = 0;
        for (name, f) in TARGETS {
            let Ok(rd) = std::fs::read_dir(root.join(name)) else { continue };
            for e in rd {
                let p = e.unwrap().path();
                let _ = f(&std::fs::read(&p).unwrap());
                ran += 1;
            }
        }
        eprintln!("{ran} regression inputs replayed");
    }
}
