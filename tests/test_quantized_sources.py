"""Quantised Hub checkpoints as sources: FP8 with block scales (DeepSeek-V3/R1,
Qwen3-*-FP8) and the errors of FP8 and MXFP4 sources.

The FP8 checkpoint is made here from a golden fixture: every 2-D weight but the
embedding is rounded to E4M3 codes with one float32 scale per block (a block
size that leaves partial blocks at both edges), and its dequantised float32
twin holds exactly code × scale. Converting either must give the same model, bit
for bit: the reader's dequantisation is the only step that differs.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import colibri
from conftest import GOLDEN, copy_case_single_file, load_tensors, write_safetensors


def e4m3_values() -> np.ndarray:
    """The value of every E4M3 code (OCP FP8, bias 7, no infinities; 0x7F/0xFF are NaN)."""
    out = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, man = (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            out[code] = np.nan
        elif exp == 0:
            out[code] = sign * man / 8 * 2.0**-6
        else:
            out[code] = sign * (1 + man / 8) * 2.0 ** (exp - 7)
    return out


E4M3 = e4m3_values()
FINITE = np.flatnonzero(~np.isnan(E4M3))
ORDER = FINITE[np.argsort(E4M3[FINITE], kind="stable")]


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """Nearest E4M3 code of each value (within ±448)."""
    vals = E4M3[ORDER]
    i = np.clip(np.searchsorted(vals, x), 1, len(vals) - 1)
    pick = np.where(np.abs(x - vals[i - 1]) <= np.abs(vals[i] - x), i - 1, i)
    return ORDER[pick].astype(np.uint8)


def fp8_quantise(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scale_inv, dequantised float32 twin) of a 2-D matrix."""
    rows, cols = w.shape
    b0, b1 = block
    gr, gc = -(-rows // b0), -(-cols // b1)
    scales = np.ones((gr, gc), dtype=np.float32)
    codes = np.zeros(w.shape, dtype=np.uint8)
    for i in range(gr):
        for j in range(gc):
            tile = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1].astype(np.float64)
            amax = float(np.abs(tile).max())
            s = np.float32(amax / 448.0) if amax > 0 else np.float32(1.0)
            scales[i, j] = s
            codes[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = to_e4m3(tile / float(s))
    full = np.repeat(np.repeat(scales, b0, axis=0), b1, axis=1)[:rows, :cols]
    twin = E4M3[codes].astype(np.float32) * full  # float32 product, as the reader computes it
    return codes, scales, twin


def make_fp8_pair(case: str, root, block=(16, 12)):
    """An FP8 checkpoint of `case` and its dequantised float32 twin."""
    src = copy_case_single_file(case, root / "src")
    tensors = load_tensors(src)
    fp8, twin = dict(tensors), dict(tensors)
    quantised = 0
    for name, (dtype, shape, data) in tensors.items():
        if len(shape) != 2 or "embed_tokens" in name:
            continue
        assert dtype == "F32", f"{case} is expected in float32, {name} is {dtype}"
        w = np.frombuffer(data, dtype=np.float32).reshape(shape)
        codes, scales, deq = fp8_quantise(w, block)
        fp8[name] = ("F8_E4M3", shape, codes.tobytes())
        fp8[name + "_scale_inv"] = ("F32", list(scales.shape), scales.tobytes())
        twin[name] = ("F32", shape, deq.tobytes())
        quantised += 1
    cfg = json.loads((src / "config.json").read_text())
    out = {}
    for kind, t in (("fp8", fp8), ("twin", twin)):
        d = root / kind
        d.mkdir()
        c = dict(cfg)
        if kind == "fp8":
            qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
            c["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(c))
        write_safetensors(d / "model.safetensors", t)
        out[kind] = d
    assert quantised > 5
    return out["fp8"], out["twin"]


@pytest.mark.parametrize("case", ["qwen3_moe", "olmoe", "qwen3_next", "qwen3_5_moe", "kimi_linear"])
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_fp8_checkpoint_converts_exactly_like_its_dequantised_twin(case, dtype, tmp_path, golden):
    fp8, twin = make_fp8_pair(case, tmp_path)
    a, b = tmp_path / "fp8.colibri", tmp_path / "twin.colibri"
    colibri.convert(fp8, a, dtype=dtype, progress=False)
    colibri.convert(twin, b, dtype=dtype, progress=False)
    ids = golden(case)["ids_33"]
    got, want = colibri.Engine(a).logits(ids), colibri.Engine(b).logits(ids)
    assert np.array_equal(got, want)
    # The rounding to FP8 is real: the model moved, but stayed the same model.
    ref = golden(case)["logits_33"]
    assert not np.array_equal(got, ref)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.5


def fp8_case(tmp_path):
    fp8, _ = make_fp8_pair("olmoe", tmp_path)
    return fp8, load_tensors(fp8), json.loads((fp8 / "config.json").read_text())


def rewrite(folder, tensors=None, config=None):
    if tensors is not None:
        write_safetensors(folder / "model.safetensors", tensors)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


def test_quantised_sources_keep_their_kind_by_default(tmp_path):
    # FP8 matrices become q8_0, MXFP4 experts stay mxfp4 (the file keeps the
    # checkpoint's size), everything else keeps its source type.
    fp8, _ = make_fp8_pair("olmoe", tmp_path)
    out = tmp_path / "o.colibri"
    assert colibri.convert(fp8, out, progress=False)["dtype"] == "q8_0"
    for name, d, shape, _ in colibri.Engine(out).tensors():
        if name == "embed" or len(shape) == 1 or "router" in name:
            assert d == "f32", name  # the f32 source embedding; small tensors
        else:  # FP8 matrices: q8_0 where rows are whole blocks, else the bf16 fallback
            assert d == ("q8_0" if shape[-1] % 32 == 0 else "bf16"), (name, d)
    g = tmp_path / "g.colibri"
    assert colibri.convert(GOLDEN / "gpt_oss_mxfp4", g, progress=False)["dtype"] == "mxfp4"
    kinds = {name: d for name, d, _, _ in colibri.Engine(g).tensors()}
    assert (
        kinds["layers.0.moe.experts.0.gate"] == "mxfp4x8"
        and kinds["layers.0.moe.experts.0.down"] == "mxfp4x8"
    )
    assert kinds["layers.0.attn.wq"] == "bf16" and kinds["embed"] == "bf16"
    # 17 bytes per 32 weights: the experts take exactly the Hub's bytes.
    hub = load_tensors(GOLDEN / "gpt_oss_mxfp4")
    src_bytes = sum(len(b) for n, (_, _, b) in hub.items() if n.endswith(("_blocks", "_scales")))
    got_bytes = sum(b for n, d, _, b in colibri.Engine(g).tensors() if d == "mxfp4x8")
    assert got_bytes == src_bytes


def test_mxfp4_storage_reads_the_same_values_as_bf16(tmp_path, golden):
    # The experts' values are exact in both; the difference is only that
    # mxfp4 multiplies against 8-bit activations, as every block type does.
    g = golden("gpt_oss_mxfp4")
    m, b = tmp_path / "m.colibri", tmp_path / "b.colibri"
    colibri.convert(GOLDEN / "gpt_oss_mxfp4", m, progress=False)
    colibri.convert(GOLDEN / "gpt_oss_mxfp4", b, dtype="bf16", progress=False)
    ids = g["ids_33"]
    lm, lb = colibri.Engine(m).logits(ids), colibri.Engine(b).logits(ids)
    scale = float(np.abs(lb).max())
    assert float(np.abs(lm - lb).max()) < 0.05 * scale
    assert (lm.argmax(-1) == lb.argmax(-1)).mean() >= 0.9


def test_fp8_errors_name_the_tensor(tmp_path):
    fp8, tensors, cfg = fp8_case(tmp_path)
    name = "model.layers.1.self_attn.q_proj.weight"
    out = tmp_path / "o.colibri"

    # A missing scale.
    t = dict(tensors)
    del t[name + "_scale_inv"]
    rewrite(fp8, tensors=t)
    with pytest.raises(colibri.CheckpointError, match=rf"{name}.*_scale_inv"):
        colibri.convert(fp8, out, progress=False)

    # A scale of the wrong shape.
    t = dict(tensors)
    _, shape, data = t[name + "_scale_inv"]
    t[name + "_scale_inv"] = ("F32", [shape[0] * shape[1]], data)
    rewrite(fp8, tensors=t)
    with pytest.raises(colibri.CheckpointError, match=name.replace(".", r"\.")):
        colibri.convert(fp8, out, progress=False)

    # F8 tensors but no quantization_config: never a silent cast.
    rewrite(fp8, tensors=tensors, config={k: v for k, v in cfg.items() if k != "quantization_config"})
    with pytest.raises(colibri.CheckpointError, match="F8_E4M3.*quantization_config"):
        colibri.convert(fp8, out, progress=False)

    # An unknown method, and FP8 without block sizes.
    for qc, needle in (
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [16, 12]}, "e5m2"),
    ):
        rewrite(fp8, config={**cfg, "quantization_config": qc})
        with pytest.raises(colibri.CheckpointError, match=needle):
            colibri.convert(fp8, out, progress=False)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_mxfp4_blocks_without_their_config_or_with_bad_scales_are_refused(tmp_path):
    src = copy_case_single_file("olmoe", tmp_path / "src")
    tensors = load_tensors(src)
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    _, (rows, _cols), _ = tensors.pop(name)
    base = name  # MXFP4 blocks stand for the tensor `name`
    blocks = np.zeros((rows, 2, 16), dtype=np.uint8)
    scales = np.full(blocks.shape[:-1], 127, dtype=np.uint8)
    tensors[base + "_blocks"] = ("U8", list(blocks.shape), blocks.tobytes())
    tensors[base + "_scales"] = ("U8", list(scales.shape), scales.tobytes())
    write_safetensors(src / "model.safetensors", tensors)
    out = tmp_path / "o.colibri"
    with pytest.raises(colibri.CheckpointError, match="mxfp4 quantization_config"):
        colibri.convert(src, out, progress=False)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (src / "config.json").write_text(json.dumps(cfg))
    # Scales that do not match the blocks.
    bad = dict(tensors)
    bad[base + "_scales"] = ("U8", [rows], bytes(rows))
    write_safetensors(src / "model.safetensors", bad)
    with pytest.raises(colibri.CheckpointError, match=f"MXFP4 tensor {base}"):
        colibri.convert(src, out, progress=False)


def test_golden_folder_is_untouched():
    # The tests above edit copies only.
    assert (GOLDEN / "olmoe" / "config.json").exists()
    assert "quantization_config" not in json.loads((GOLDEN / "olmoe" / "config.json").read_text())


def test_mxfp4_nan_scale_and_mismatched_blocks_name_the_tensor(tmp_path):
    src = copy_case_single_file("gpt_oss_mxfp4", tmp_path / "src")
    tensors = load_tensors(src)
    name = "model.layers.1.mlp.experts.down_proj"
    out = tmp_path / "o.colibri"
    # One E8M0 scale of 255 (NaN).
    dtype, shape, data = tensors[name + "_scales"]
    bad = bytearray(data)
    bad[7] = 255
    write_safetensors(src / "model.safetensors", {**tensors, name + "_scales": (dtype, shape, bytes(bad))})
    with pytest.raises(colibri.CheckpointError, match=re.escape(f"MXFP4 tensor {name}") + ".*255"):
        colibri.convert(src, out, progress=False)
    # Scales of a shape that does not match the blocks.
    short = (dtype, [shape[0], shape[1], shape[2] - 1], data[: len(data) // shape[2] * (shape[2] - 1)])
    write_safetensors(src / "model.safetensors", {**tensors, name + "_scales": short})
    with pytest.raises(colibri.CheckpointError, match=f"MXFP4 tensor {name}"):
        colibri.convert(src, out, progress=False)
    assert not out.exists()
