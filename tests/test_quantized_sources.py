"""Quantised Hub checkpoints as sources: FP8 with block scales (DeepSeek-V3/R1,
Qwen3-*-FP8), compressed-tensors int4 (Kimi-K2 / K2-Thinking / K2.5 experts),
and the errors of FP8, MXFP4 and int4 sources.

The FP8 checkpoint is made here from a golden fixture: every 2-D weight but the
embedding is rounded to E4M3 codes with one float32 scale per block (a block
size that leaves partial blocks at both edges), and its dequantised float32
twin holds exactly code × scale. Converting either must give the same model, bit
for bit: the reader's dequantisation is the only step that differs.

The int4 checkpoint is made the same way from the kimi_k2 / kimi_k25 fixtures:
every routed expert matrix becomes compressed-tensors `pack-quantized` int4
(`weight_packed` int32 words of eight codes, bf16 `weight_scale` per 32 values,
`weight_shape`), its twin holds code × scale in float32. Converted as it comes,
the int4 checkpoint's experts are q4_0 blocks holding the very same values; the
twin, converted with its experts quantised to q4_0, must give the same file
bits. (Each group holds a code -8, the value q4_0's quantiser maps to the
scale, so quantising the twin finds the source's scales: a group whose largest
value is positive gets a negative scale; a few groups have a bf16 scale that is
not an f16 value, which the reader quantises again from its exact values, as
the twin's conversion does.) With ordinary positive scales, whose groups end
at code 7 as often as at -8, the q4_0 file read back in f32 must equal the twin.

DeepSeek-V4 comes from its fixture renamed to DeepSeek's root-level names (which
must give the fixture's logits bit for bit) and with its gate and up experts as
FP4 (int8 bytes of two E2M1 codes, an E8M0 `.scale` per 32 values): read as
MXFP4, and in bf16 (which holds every such value) the same model as its twin.
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


@pytest.mark.parametrize(
    "case",
    ["qwen3_moe", "olmoe", "qwen3_next", "qwen3_5_moe", "kimi_linear", "nemotron_h", "granitemoehybrid"],
)
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


# ---------------------------------------------------------------------------
# compressed-tensors pack-quantized int4

INT4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
        }
    },
}
# Groups (tensor, row, group) given a bf16 scale that is no f16 value: 1e-6 is below f16's
# normal range and has more significant bits than its subnormals keep.
INEXACT_SCALE = np.float32(9.98377799987793e-07)  # bf16(1e-6)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even), still as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """compressed-tensors' packing: value i of a row into int32 word i // 8 at bit 4 * (i % 8), as q + 8."""
    rows, cols = q.shape
    n = (q.astype(np.int64) + 8).reshape(rows, cols // 8, 8)
    words = sum(n[..., i] << (4 * i) for i in range(8))
    return words.astype(np.uint32).view(np.int32)


def int4_quantise(
    w: np.ndarray, inexact: list[tuple[int, int]], twin_exact: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, bf16 scales, float32 twin) of a [rows, cols] matrix in groups of 32, scale
    amax / 8 and codes -8..7; the groups `inexact` get INEXACT_SCALE. With `twin_exact`, a group
    whose value of largest magnitude is positive gets the negated scale, so that value is code -8
    in every group (what q4_0's quantiser maps to the scale when it quantises the twin)."""
    rows, cols = w.shape
    g = w.astype(np.float64).reshape(rows, cols // 32, 32)
    idx = np.abs(g).argmax(-1)[..., None]
    peak = np.take_along_axis(g, idx, axis=-1)[..., 0]
    sign = np.where(peak > 0, -1.0, 1.0) if twin_exact else 1.0
    scales = bf16_round((sign * np.abs(peak) / 8).astype(np.float32))
    for r, c in inexact:
        scales[r, c] = INEXACT_SCALE
    q = np.clip(np.rint(g / scales[..., None]), -8, 7).astype(np.int8)
    if twin_exact:
        at_peak = np.take_along_axis(q, idx, axis=-1)[..., 0]
        planted = np.zeros(at_peak.shape, dtype=bool)
        for r, c in inexact:
            planted[r, c] = True
        assert (at_peak[~planted] == -8).all()
    twin = (q.astype(np.float32) * scales[..., None]).reshape(rows, cols)  # exact in float32
    return q.reshape(rows, cols), scales, twin


def make_int4_pair(case: str, root, inexact_groups: int = 3, twin_exact: bool = True):
    """A compressed-tensors int4 checkpoint of `case` (kimi_k2, or kimi_k25 in the K2.5 layout)
    and its dequantised float32 twin; returns (int4 folder, twin folder, inexact groups)."""
    src = copy_case_single_file(case, root / "src")
    tensors = load_tensors(src)
    packed, twin = dict(tensors), dict(tensors)
    planted = 0
    for name, (dtype, shape, data) in tensors.items():
        if ".mlp.experts." not in name:
            continue
        assert dtype == "F32" and shape[-1] % 32 == 0, (name, dtype, shape)
        w = np.frombuffer(data, dtype=np.float32).reshape(shape)
        inexact = [(planted % shape[0], 0)] if planted < inexact_groups else []
        planted += len(inexact)
        q, scales, deq = int4_quantise(w, inexact, twin_exact)
        base = name.removesuffix(".weight")
        del packed[name]
        packed[base + ".weight_packed"] = ("I32", [shape[0], shape[1] // 8], pack_int4(q).tobytes())
        scale_bits = (scales.view(np.uint32) >> 16).astype(np.uint16)
        packed[base + ".weight_scale"] = ("BF16", list(scales.shape), scale_bits.tobytes())
        packed[base + ".weight_shape"] = ("I64", [2], np.array(shape, dtype=np.int64).tobytes())
        twin[name] = ("F32", shape, deq.tobytes())
    assert planted == inexact_groups
    cfg = json.loads((src / "config.json").read_text())
    out = {}
    for kind, t in (("int4", packed), ("twin", twin)):
        d = root / kind
        d.mkdir()
        c = json.loads(json.dumps(cfg))
        if "text_config" not in c:  # Kimi-K2 as on the Hub
            c["model_type"] = "kimi_k2"
        if kind == "int4":
            # K2.5 declares it in text_config, K2 at the top.
            (c["text_config"] if "text_config" in c else c)["quantization_config"] = INT4_CONFIG
        (d / "config.json").write_text(json.dumps(c))
        write_safetensors(d / "model.safetensors", t)
        out[kind] = d
    return out["int4"], out["twin"], planted


@pytest.mark.parametrize("case", ["kimi_k2", "kimi_k25"])
def test_int4_checkpoint_converts_exactly_like_its_dequantised_twin(case, tmp_path, golden):
    int4, twin, inexact = make_int4_pair(case, tmp_path)
    a, b = tmp_path / "int4.colibri", tmp_path / "twin.colibri"
    report = colibri.convert(int4, a, progress=False)  # the source's own types
    colibri.convert(twin, b, dtype="experts=q4_0,experts_down=q4_0", progress=False)
    assert report["dtype"] == "q4_0"
    assert report["int4"]["requantised"] == inexact and report["int4"]["widened"] == []
    assert report["int4"]["tensors"] == 2 * 8 * 3  # two MoE layers of 8 experts
    ea, eb = colibri.Engine(a), colibri.Engine(b)
    ta = {n: (d, s, nb) for n, d, s, nb in ea.tensors()}
    assert ta == {n: (d, s, nb) for n, d, s, nb in eb.tensors()}
    for n, (d, _, _) in ta.items():
        assert d == ("q4_0x8" if ".experts." in n else "f32"), (n, d)
    ids = golden(case)["ids_33"]
    got, want = ea.logits(ids), eb.logits(ids)
    assert np.array_equal(got, want)
    # The int4 rounding is real: the model moved, but stayed the same model.
    ref = golden(case)["logits_33"]
    assert not np.array_equal(got, ref)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.5
    # q4_0 takes what the Hub's int4 takes: 16 bytes of codes and 2 of scale per 32 values.
    hub = load_tensors(int4)
    hub_bytes = sum(len(b) for n, (_, _, b) in hub.items() if n.endswith(("weight_packed", "weight_scale")))
    assert sum(nb for n, (_, _, nb) in ta.items() if ".experts." in n) == hub_bytes


def test_int4_groups_move_into_q4_0_without_rounding(tmp_path, golden):
    # Positive scales, codes -8..7 as a minmax observer makes them: the q4_0 file, decoded
    # to f32, is the twin exactly (no group's scale or codes were rounded again).
    int4, twin, _ = make_int4_pair("kimi_k2", tmp_path, inexact_groups=0, twin_exact=False)
    a, a32, b = tmp_path / "a.colibri", tmp_path / "a32.colibri", tmp_path / "b.colibri"
    colibri.convert(int4, a, progress=False)
    colibri.convert(a, a32, dtype="f32", progress=False)
    colibri.convert(twin, b, dtype="f32", progress=False)
    ids = golden("kimi_k2")["ids_33"]
    assert np.array_equal(colibri.Engine(a32).logits(ids), colibri.Engine(b).logits(ids))
    # ... and the f32 conversion of the int4 checkpoint decodes to the same values.
    c = tmp_path / "c.colibri"
    colibri.convert(int4, c, dtype="f32", progress=False)
    assert np.array_equal(colibri.Engine(c).logits(ids), colibri.Engine(b).logits(ids))


def test_int4_scale_beyond_f16_widens_that_tensor(tmp_path):
    int4, _, _ = make_int4_pair("kimi_k2", tmp_path, inexact_groups=0, twin_exact=False)
    tensors = load_tensors(int4)
    name = "model.layers.2.mlp.experts.5.down_proj"
    dtype, shape, data = tensors[name + ".weight_scale"]
    bits = np.frombuffer(data, dtype=np.uint16).copy()
    bits[3] = 0x47C3  # bf16 99840: no f16 holds it
    write_safetensors(
        int4 / "model.safetensors", {**tensors, name + ".weight_scale": (dtype, shape, bits.tobytes())}
    )
    out = tmp_path / "o.colibri"
    report = colibri.convert(int4, out, progress=False)
    assert report["int4"]["widened"] == [name + ".weight"]
    kinds = {n: d for n, d, _, _ in colibri.Engine(out).tensors()}
    assert kinds["layers.2.moe.experts.5.down"] == "f32"
    assert kinds["layers.2.moe.experts.5.gate"] == "q4_0x8"


def int4_case(tmp_path):
    int4, _, _ = make_int4_pair("kimi_k2", tmp_path, inexact_groups=0, twin_exact=False)
    return int4, load_tensors(int4), json.loads((int4 / "config.json").read_text())


def with_weights(qc: dict, **changes) -> dict:
    qc = json.loads(json.dumps(qc))
    qc["config_groups"]["group_0"]["weights"].update(changes)
    return qc


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"format": "float-quantized"}, r"quantization_config\.format.*float-quantized"),
        ({"format": "nvfp4-pack-quantized"}, r"quantization_config\.format"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, r"kv_cache_scheme"),
        ({"config_groups": {}}, r"config_groups"),
        ({"format": "mixed-precision"}, r"config_groups\.group_0\.format is missing"),
        (with_weights(INT4_CONFIG, num_bits=8), r"config_groups\.group_0\.weights\.num_bits is 8"),
        (with_weights(INT4_CONFIG, type="float"), r"weights\.type"),
        (with_weights(INT4_CONFIG, symmetric=False), r"weights\.symmetric is false"),
        (with_weights(INT4_CONFIG, strategy="channel"), r"weights\.strategy"),
        (with_weights(INT4_CONFIG, group_size=128), r"weights\.group_size is 128"),
        (with_weights(INT4_CONFIG, actorder="group"), r"weights\.actorder"),
        (with_weights(INT4_CONFIG, dynamic=True), r"weights\.dynamic"),
    ],
)
def test_unknown_compressed_tensors_schemes_name_the_key(edit, needle, tmp_path):
    int4, _, cfg = int4_case(tmp_path)
    qc = {**INT4_CONFIG, **edit} if "config_groups" not in edit or edit["config_groups"] == {} else edit
    rewrite(int4, config={**cfg, "quantization_config": qc})
    out = tmp_path / "o.colibri"
    with pytest.raises(colibri.CheckpointError, match=needle):
        colibri.convert(int4, out, progress=False)
    assert not out.exists()


def test_int4_mixed_precision_format_with_pack_quantized_groups_is_read(tmp_path):
    int4, _, cfg = int4_case(tmp_path)
    qc = json.loads(json.dumps(INT4_CONFIG))
    qc["format"] = "mixed-precision"
    qc["config_groups"]["group_0"]["format"] = "pack-quantized"
    rewrite(int4, config={**cfg, "quantization_config": qc})
    assert colibri.convert(int4, tmp_path / "o.colibri", progress=False)["dtype"] == "q4_0"


def test_int4_activation_quantisation_is_refused(tmp_path):
    int4, _, cfg = int4_case(tmp_path)
    qc = json.loads(json.dumps(INT4_CONFIG))
    qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token"}
    rewrite(int4, config={**cfg, "quantization_config": qc})
    with pytest.raises(colibri.CheckpointError, match=r"group_0\.input_activations"):
        colibri.convert(int4, tmp_path / "o.colibri", progress=False)


def test_int4_errors_name_the_tensor(tmp_path):
    int4, tensors, cfg = int4_case(tmp_path)
    base = "model.layers.1.mlp.experts.3.up_proj.weight"
    out = tmp_path / "o.colibri"
    esc = re.escape(base)

    # Packed codes but no quantization_config: never a silent reinterpretation.
    rewrite(int4, config={k: v for k, v in cfg.items() if k != "quantization_config"})
    with pytest.raises(
        colibri.CheckpointError, match=r"weight_packed looks like packed int4.*compressed-tensors"
    ):
        colibri.convert(int4, out, progress=False)
    rewrite(int4, config=cfg)

    # A missing companion.
    for gone in ("_scale", "_shape"):
        t = {k: v for k, v in tensors.items() if k != base + gone}
        rewrite(int4, tensors=t)
        with pytest.raises(colibri.CheckpointError, match=esc + "_packed.*" + esc + gone):
            colibri.convert(int4, out, progress=False)

    # Scales, codes or the logical shape that disagree.
    dtype, shape, data = tensors[base + "_scale"]
    for bad in (
        {base + "_scale": (dtype, [shape[0], shape[1] + 1], data + bytes(2 * shape[0]))},
        {base + "_scale": ("I32", shape, data + data)},
        {base + "_shape": ("I64", [2], np.array([32, 96], dtype=np.int64).tobytes())},
        {base + "_shape": ("F32", [2], np.array([32, 64], dtype=np.float32).tobytes())},
    ):
        rewrite(int4, tensors={**tensors, **bad})
        with pytest.raises(colibri.CheckpointError, match="packed int4 tensor " + esc):
            colibri.convert(int4, out, progress=False)

    # A NaN scale.
    bits = np.frombuffer(data, dtype=np.uint16).copy()
    bits[5] = 0x7FC0
    rewrite(int4, tensors={**tensors, base + "_scale": (dtype, shape, bits.tobytes())})
    with pytest.raises(colibri.CheckpointError, match="packed int4 tensor " + esc + ": scale 5 is NaN"):
        colibri.convert(int4, out, progress=False)
    assert not out.exists()


def test_kimi_k25_skips_the_vision_tower_and_reads_transformers_names_too(tmp_path, golden):
    out = tmp_path / "hub.colibri"
    colibri.convert(GOLDEN / "kimi_k25", out, progress=False)
    parts = colibri.Engine(out).skipped_parts
    assert any(p.startswith("vision_tower.encoder.* (") for p in parts), parts
    assert any(p.startswith("mm_projector.") for p in parts), parts
    want = colibri.Engine(out).logits(golden("kimi_k25")["ids_33"])
    # transformers' own names: model.language_model.*, lm_head.weight, model.vision_tower.*.
    src = copy_case_single_file("kimi_k25", tmp_path / "native")
    native = {}
    for name, t in load_tensors(src).items():
        if name == "language_model.lm_head.weight":
            name = "lm_head.weight"
        elif name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        else:
            name = "model." + name
        native[name] = t
    write_safetensors(src / "model.safetensors", native)
    colibri.convert(src, tmp_path / "native.colibri", progress=False)
    assert np.array_equal(
        colibri.Engine(tmp_path / "native.colibri").logits(golden("kimi_k25")["ids_33"]), want
    )
    # Without a head of its own, the embedding is the head (as transformers ties it).
    del native["lm_head.weight"]
    write_safetensors(src / "model.safetensors", native)
    colibri.convert(src, tmp_path / "headless.colibri", progress=False)
    assert not np.array_equal(
        colibri.Engine(tmp_path / "headless.colibri").logits(golden("kimi_k25")["ids_33"]), want
    )


# ---------------------------------------------------------------------------
# DeepSeek-V4 as DeepSeek ships it: root-level names (no `model.` prefix) and
# FP4 experts (E2M1 pairs in int8 bytes, one E8M0 exponent per 32 values along
# each row, `.scale` beside `.weight`).

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_fp4(w: np.ndarray) -> tuple[bytes, bytes, np.ndarray]:
    """[R, C] float32 -> (codes, E8M0 scales, the values they hold)."""
    r, c = w.shape
    g = w.astype(np.float64).reshape(r, c // 32, 32)
    amax = np.abs(g).max(-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int64)
    x = g / np.ldexp(1.0, exp)[..., None]
    code = np.abs(np.abs(x)[..., None] - E2M1[:8]).argmin(-1) | np.where(x < 0, 8, 0)
    code = code.reshape(r, c).astype(np.uint8)
    held = (E2M1[code].reshape(r, c // 32, 32) * np.ldexp(1.0, exp)[..., None]).reshape(r, c)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return packed.tobytes(), (exp + 127).astype(np.uint8).tobytes(), held.astype(np.float32)


def test_deepseek_v4_root_names_and_fp4_experts(tmp_path):
    src = GOLDEN / "deepseek_v4"
    tensors = load_tensors(src)
    cfg = json.loads((src / "config.json").read_text())
    # DeepSeek's own spelling: root-level names.
    root = tmp_path / "root"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg))
    renamed = {re.sub(r"^model\.", "", k): v for k, v in tensors.items()}
    renamed["embed.weight"] = renamed.pop("embed_tokens.weight")
    for part in ("fn", "base", "scale"):
        renamed[f"hc_head_{part}"] = renamed.pop(f"hc_head.hc_{part}")
    renamed = {re.sub(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight", k): v for k, v in renamed.items()}
    write_safetensors(root / "model.safetensors", renamed)
    plain = colibri.Engine(colibri.convert(src, tmp_path / "plain.colibri", progress=False)["path"])
    ids = np.arange(33) * 7 % cfg["vocab_size"]
    want = plain.logits(ids)
    got = colibri.Engine(colibri.convert(root, tmp_path / "root.colibri", progress=False)["path"]).logits(ids)
    assert np.array_equal(got, want)
    # FP4 experts beside their float32 twin holding the same values.
    fp4, twin = tmp_path / "fp4", tmp_path / "twin"
    for d in (fp4, twin):
        d.mkdir()
    quantised, exact = dict(renamed), dict(renamed)
    # (gate and up: rows of 32 values, one E8M0 exponent each; the fixture's down rows are 20 wide)
    experts = [k for k in renamed if re.search(r"\.experts\.\d+\.w[13]\.weight$", k)]
    for k in experts:
        dtype, shape, data = renamed[k]
        w = np.frombuffer(data, dtype=np.float32).reshape(shape)
        codes, scales, held = to_fp4(w)
        quantised[k] = ("I8", [shape[0], shape[1] // 2], codes)
        quantised[k.replace(".weight", ".scale")] = ("F8_E8M0", [shape[0], shape[1] // 32], scales)
        exact[k] = ("F32", shape, held.tobytes())
    q = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    (fp4 / "config.json").write_text(json.dumps({**cfg, "quantization_config": {**q, "expert_dtype": "fp4"}}))
    (twin / "config.json").write_text(json.dumps(cfg))
    write_safetensors(fp4 / "model.safetensors", quantised)
    write_safetensors(twin / "model.safetensors", exact)
    # Read natively, the experts stay MXFP4, the same format (their matmuls then take q8
    # activations, as every block type's do, so those logits are not the twin's bits).
    engine = colibri.Engine(colibri.convert(fp4, tmp_path / "fp4.colibri", progress=False)["path"])
    experts_row = next(r for r in engine.weight_types() if r["class"] == "experts")
    assert experts_row["dtypes"] == ["mxfp4"], experts_row
    # In bf16, which holds every FP4 value exactly, both give the same model bit for bit.
    a = colibri.convert(fp4, tmp_path / "fp4_bf16.colibri", dtype="bf16", progress=False)["path"]
    b = colibri.convert(twin, tmp_path / "twin_bf16.colibri", dtype="bf16", progress=False)["path"]
    assert np.array_equal(colibri.Engine(a).logits(ids), colibri.Engine(b).logits(ids))
