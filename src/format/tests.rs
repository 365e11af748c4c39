//! Round trip and rejection of malformed files.

use std::path::{Path, PathBuf};

use super::reader::ColibriFile;
use super::*;
use crate::error::Error;
use crate::synth::{config_for, tiny_config, write_random_model};

fn fresh(dir: &tempfile::TempDir, dtype: DType) -> (PathBuf, FileMeta) {
    let p = dir.path().join("m.colibri");
    let _ = std::fs::remove_file(&p);
    let meta = write_random_model(&p, &config_for(dtype), dtype, 1);
    (p, meta)
}

fn header_fields(p: &Path) -> (u64, u64) {
    let b = std::fs::read(p).unwrap();
    (u64::from_le_bytes(b[16..24].try_into().unwrap()), u64::from_le_bytes(b[24..32].try_into().unwrap()))
}

/// Rewrites the JSON metadata in place (keeping its length by padding with spaces).
fn edit_meta(p: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut b = std::fs::read(p).unwrap();
    let (meta_len, data_off) = header_fields(p);
    let mut v: serde_json::Value = serde_json::from_slice(&b[32..32 + meta_len as usize]).unwrap();
    f(&mut v);
    let text = serde_json::to_vec(&v).unwrap();
    assert!(32 + text.len() <= data_off as usize, "edited metadata must still fit");
    b[32..32 + text.len()].copy_from_slice(&text);
    b[16..24].copy_from_slice(&(text.len() as u64).to_le_bytes());
    std::fs::write(p, b).unwrap();
}

fn expect_format_error(p: &Path, needle: &str) {
    match ColibriFile::open(p) {
        Err(Error::Format { msg, .. }) => assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}"),
        Err(other) => panic!("expected a format error containing {needle:?}, got {other}"),
        Ok(_) => panic!("expected a format error containing {needle:?}, but the file opened"),
    }
}

#[test]
fn round_trip_keeps_metadata_and_bytes() {
    let dir = tempfile::tempdir().unwrap();
    for dt in DType::ALL {
        let (p, meta) = fresh(&dir, dt);
        let f = ColibriFile::open(&p).unwrap();
        assert_eq!(f.meta().config, meta.config);
        assert_eq!(f.meta().tensors, meta.tensors);
        for t in &meta.tensors {
            let v = f.tensor(&t.name).unwrap();
            assert_eq!(v.bytes.len() as u64, t.nbytes);
            assert_eq!((v.bytes.as_ptr() as usize) % 64, 0, "{} not 64-byte aligned in memory", t.name);
        }
        for s in &meta.experts {
            let (off, _) = f.expert_slab(s.layer, s.expert).unwrap();
            assert_eq!(off % PAGE, 0);
        }
    }
}

#[test]
fn expert_slabs_hold_gate_up_down_adjacent() {
    let dir = tempfile::tempdir().unwrap();
    let (_, meta) = fresh(&dir, DType::Bf16);
    let moe_layers = tiny_config().layers.iter().filter(|l| l.ffn == crate::canonical::config::FfnSpec::Moe).count();
    assert_eq!(meta.experts.len(), moe_layers * 5);
    for s in &meta.experts {
        let names = ["gate", "up", "down"].map(|w| format!("layers.{}.moe.experts.{}.{w}", s.layer, s.expert));
        let ts: Vec<_> = names.iter().map(|n| meta.tensors.iter().find(|t| &t.name == n).unwrap()).collect();
        assert_eq!(ts[0].offset, s.offset, "slab starts with the gate matrix");
        assert!(
            ts[1].offset >= ts[0].offset + ts[0].nbytes && ts[1].offset - (ts[0].offset + ts[0].nbytes) < TENSOR_ALIGN
        );
        assert!(
            ts[2].offset >= ts[1].offset + ts[1].nbytes && ts[2].offset - (ts[1].offset + ts[1].nbytes) < TENSOR_ALIGN
        );
        assert_eq!(ts[2].offset + ts[2].nbytes, s.offset + s.nbytes);
    }
}

#[test]
fn rejects_empty_short_and_foreign_files() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.colibri");
    std::fs::write(&p, b"").unwrap();
    expect_format_error(&p, "too short");
    std::fs::write(&p, b"COLIBRI\0\x01").unwrap();
    expect_format_error(&p, "too short");
    std::fs::write(&p, [b'G'; 64]).unwrap();
    expect_format_error(&p, "bad magic");
    assert!(matches!(ColibriFile::open(&dir.path().join("nope.colibri")), Err(Error::NotFound(_))));
    expect_format_error(dir.path(), "directory");
}

#[test]
fn rejects_bad_header_fields() {
    let dir = tempfile::tempdir().unwrap();
    let patch = |at: usize, bytes: &[u8], needle: &str| {
        let (p, _) = fresh(&dir, DType::F32);
        let mut b = std::fs::read(&p).unwrap();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        std::fs::write(&p, b).unwrap();
        expect_format_error(&p, needle);
    };
    patch(8, &2u32.to_le_bytes(), "version 2");
    patch(12, &2u32.to_le_bytes(), "unknown header flags");
    patch(12, &1u32.to_le_bytes(), "stage-file flag and the metadata disagree");
    patch(16, &u64::MAX.to_le_bytes(), "metadata length");
    patch(24, &4095u64.to_le_bytes(), "data offset");
    patch(24, &(1u64 << 40).to_le_bytes(), "data offset");
    patch(32, b"[", "metadata is not valid");
}

#[test]
fn rejects_truncation_anywhere_in_the_data() {
    let dir = tempfile::tempdir().unwrap();
    let (p, _) = fresh(&dir, DType::F16);
    let full = std::fs::read(&p).unwrap();
    let (_, data_off) = header_fields(&p);
    for cut in [full.len() - 1, full.len() - 100, data_off as usize + 10, data_off as usize, 40, 31] {
        std::fs::write(&p, &full[..cut]).unwrap();
        assert!(matches!(ColibriFile::open(&p), Err(Error::Format { .. })), "truncation at {cut} was accepted");
    }
}

#[test]
fn rejects_inconsistent_tensor_tables() {
    let dir = tempfile::tempdir().unwrap();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|v| v["tensors"][3]["offset"] = (1u64 << 50).into()), "outside"),
        (Box::new(|v| v["tensors"][3]["offset"] = 65.into()), "aligned"),
        (Box::new(|v| v["tensors"][3]["nbytes"] = 4.into()), "needs"),
        (Box::new(|v| v["tensors"][3]["shape"] = serde_json::json!([2, 2])), "needs"),
        (
            Box::new(|v| {
                let t = v["tensors"][2].clone();
                v["tensors"][3]["offset"] = t["offset"].clone();
            }),
            "overlap",
        ),
        (
            Box::new(|v| {
                v["tensors"].as_array_mut().unwrap().pop();
            }),
            "tensors",
        ),
        (Box::new(|v| v["tensors"][1]["dtype"] = "bf16".into()), "bytes"),
        (Box::new(|v| v["tensors"][1]["name"] = "layers.0.nonsense".into()), "missing"),
        (Box::new(|v| v["tensors"][1]["dtype"] = "q9".into()), "not valid"),
        (Box::new(|v| v["config"]["num_heads"] = 3.into()), "multiple"),
        (Box::new(|v| v["config"]["moe"]["router"]["top_k"] = 9.into()), "top_k"),
        (Box::new(|v| v["config"]["hidden_size"] = 23.into()), "shape"),
        (Box::new(|v| v["experts"][0]["offset"] = 64.into()), "slab"),
        (
            Box::new(|v| {
                v["experts"].as_array_mut().unwrap().pop();
            }),
            "slabs",
        ),
    ];
    for (edit, needle) in cases {
        let (p, _) = fresh(&dir, DType::F32);
        edit_meta(&p, |v| edit(v));
        expect_format_error(&p, needle);
    }
}

#[test]
fn a_small_tensor_stored_in_bf16_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (p, meta) = fresh(&dir, DType::F32);
    let i = meta.tensors.iter().position(|t| t.name == "layers.0.attn_norm").unwrap();
    edit_meta(&p, |v| {
        v["tensors"][i]["dtype"] = "bf16".into();
        let n = v["tensors"][i]["nbytes"].as_u64().unwrap();
        v["tensors"][i]["nbytes"] = (n / 2).into();
    });
    expect_format_error(&p, "small tensors must be f32");
}

#[test]
fn a_q6k_tensor_of_the_first_layout_asks_for_a_new_conversion() {
    let dir = tempfile::tempdir().unwrap();
    let (p, meta) = fresh(&dir, DType::Q6K);
    let (i, t) = meta.tensors.iter().enumerate().find(|(_, t)| t.dtype.base() == DType::Q6K).unwrap();
    let (&cols, lead) = t.shape.split_last().unwrap();
    let old = lead.iter().product::<usize>() * crate::quant::kquant::row_bytes_q6k_v1(cols).unwrap();
    assert!((old as u64) < t.nbytes, "the first layout was smaller");
    edit_meta(&p, |v| v["tensors"][i]["nbytes"] = old.into());
    expect_format_error(&p, "first q6k layout");
}

#[test]
fn a_copy_in_memory_holds_the_same_bytes_and_refuses_a_file_that_changed_length() {
    let dir = tempfile::tempdir().unwrap();
    let (p, meta) = fresh(&dir, DType::Q4_0);
    let mapped = ColibriFile::open(&p).unwrap();
    let mut copied = ColibriFile::open(&p).unwrap();
    // Small chunks, so every thread of the copy gets some and a chunk ends
    // mid-file.
    let mut seen = Vec::new();
    let copy = copied.read_copy_in(4096 + 64, &mut |done| seen.push(done)).unwrap();
    assert_eq!(copy.bytes(), mapped.bytes());
    assert_eq!(copy.bytes().as_ptr() as usize % crate::io::HUGE_PAGE, 0, "the copy starts on a 2 MiB boundary");
    assert_eq!(seen.last().copied(), Some(copied.file_len()), "progress ends at the file's length");
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "progress never goes back: {seen:?}");
    copied.use_copy(copy);
    assert!(copied.is_copied() && !mapped.is_copied());
    assert_eq!(copied.bytes(), mapped.bytes());
    assert_eq!(copied.file_len(), mapped.file_len());
    assert_eq!(copied.head_bytes(), mapped.head_bytes());
    for t in &meta.tensors {
        let v = copied.tensor(&t.name).unwrap();
        assert_eq!(v.bytes, mapped.tensor(&t.name).unwrap().bytes);
        assert_ne!(v.bytes.as_ptr(), mapped.tensor(&t.name).unwrap().bytes.as_ptr(), "read from the copy");
    }
    // Grown since it was opened: refused before anything is read.
    let later = ColibriFile::open(&p).unwrap();
    std::fs::OpenOptions::new().append(true).open(&p).unwrap().set_len(mapped.file_len() + 4096).unwrap();
    match later.read_copy(&mut |_| {}) {
        Err(Error::Format { msg, .. }) => assert!(msg.contains("changed length"), "{msg}"),
        Err(other) => panic!("expected a format error, got {other}"),
        Ok(_) => panic!("a file that grew was copied"),
    }
}

#[test]
fn bytes_validated_in_memory_copy_from_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (p, _) = fresh(&dir, DType::Q8_0);
    let bytes = std::fs::read(&p).unwrap();
    let mut f = ColibriFile::from_bytes(&p, &bytes).unwrap();
    let copy = f.read_copy_in(1000, &mut |_| {}).unwrap();
    f.use_copy(copy);
    assert_eq!(f.bytes(), &bytes[..]);
}
