"""Mixed conversion recipes and importance matrices: what `convert --dtype`
accepts besides single types, what `colibri calibrate` writes, and the typed
errors for recipes and importance matrices that do not fit."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import colibri
from conftest import load_script

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
CLI = [sys.executable, "-m", "colibri"]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """wide(case): the fixture with every width a multiple of 32
    (scripts/accuracy.py's widen_fixture), so block types apply; the
    fixtures' own widths (36, 44) make the converter keep bf16."""
    acc = load_script("accuracy")
    root = tmp_path_factory.mktemp("wide")
    cache: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in cache:
            cache[case] = acc.widen_fixture(GOLDEN / case, root / case, seed=1)
        return cache[case]

    return get


def classes_of(engine):
    return {r["class"]: r for r in engine.weight_types()}


def test_a_preset_gives_each_class_its_type(tmp_path, wide):
    out = tmp_path / "m.colibri"
    report = colibri.convert(wide("qwen2_moe"), out, dtype="q4_1-mix-down8", progress=False)
    assert report["recipe"] == "q4_1-mix-down8" and report["dtype"] == "q4_1"
    e = colibri.Engine(out)
    assert e.recipe == "q4_1-mix-down8" and e.dtype == "q4_1"
    c = classes_of(e)
    assert c["experts"]["dtypes"] == ["q4_1"]
    assert c["experts_down"]["dtypes"] == ["q8_0"]
    for cls in ("attn", "attn_kv", "shared", "embed", "lm_head"):
        assert c[cls]["dtypes"] == ["q8_0"], cls
    assert c["other"]["dtypes"] == ["f32"]
    # Bits per weight are the file's bytes over the parameters, per class and in all.
    assert c["experts"]["bits_per_weight"] == pytest.approx(5.0)
    assert c["experts_down"]["bits_per_weight"] == pytest.approx(8.5)
    total = c["all"]
    assert total["parameters"] == sum(r["parameters"] for k, r in c.items() if k != "all")
    assert total["bits_per_weight"] == pytest.approx(8 * total["bytes"] / total["parameters"])


def test_a_class_spec_and_a_uniform_type(tmp_path, wide):
    out = tmp_path / "m.colibri"
    colibri.convert(wide("mixtral"), out, dtype="experts=q4_0, default=bf16", progress=False)
    e = colibri.Engine(out)
    c = classes_of(e)
    assert c["experts"]["dtypes"] == ["q4_0"]
    assert c["experts_down"]["dtypes"] == ["bf16"], "experts names gate and up; down takes the default"
    assert c["attn"]["dtypes"] == ["bf16"] and c["lm_head"]["dtypes"] == ["bf16"]
    assert c["attn_kv"]["dtypes"] == ["bf16"]
    assert e.recipe == "experts=q4_0, default=bf16"
    uni = tmp_path / "u.colibri"
    colibri.convert(wide("mixtral"), uni, dtype="q8_0", progress=False)
    assert colibri.Engine(uni).recipe is None  # a single type is not a recipe


def test_attention_k_and_v_take_their_own_type_or_attentions(tmp_path, wide):
    out = tmp_path / "m.colibri"
    colibri.convert(wide("qwen2_moe"), out, dtype="attn=q4k,attn_kv=q8_0,default=q6k", progress=False)
    c = classes_of(colibri.Engine(out))
    assert c["attn"]["dtypes"] == ["q4k"] and c["attn_kv"]["dtypes"] == ["q8_0"]
    names = dict(colibri.Engine(out)._native.tensor_classes())
    assert names["layers.0.attn.wk"] == names["layers.0.attn.wv"] == "attn_kv"
    assert names["layers.0.attn.wq"] == names["layers.0.attn.wo"] == "attn"
    plain = tmp_path / "p.colibri"
    colibri.convert(wide("qwen2_moe"), plain, dtype="attn=q4k,default=q6k", progress=False)
    assert classes_of(colibri.Engine(plain))["attn_kv"]["dtypes"] == ["q4k"], "attn names k and v too"


def test_classes_left_out_keep_the_source_type_and_recode_takes_recipes(tmp_path, wide):
    out = tmp_path / "m.colibri"
    colibri.convert(wide("mixtral"), out, dtype="experts=q8_0", progress=False)
    c = classes_of(colibri.Engine(out))
    assert c["experts"]["dtypes"] == ["q8_0"]
    assert c["attn"]["dtypes"] == ["f32"], "the checkpoint is f32; attn was not named"
    # A .colibri file re-encoded with a recipe.
    again = tmp_path / "r.colibri"
    colibri.convert(out, again, dtype="q4_1-mix", progress=False)
    e = colibri.Engine(again)
    assert e.recipe == "q4_1-mix"
    assert classes_of(e)["attn"]["dtypes"] == ["q8_0"]
    assert classes_of(e)["experts_down"]["dtypes"] == ["q4_1"]


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("q3_k", "q4_1-mix"),  # the error lists the recipes
        ("experts=q9", 'unknown type "q9"'),
        ("expert=q4_0", 'unknown class "expert"'),
        ("attn=q8_0,attn=q4_0", "twice"),
    ],
)
def test_bad_recipes_are_invalid_input(tmp_path, spec, needle):
    with pytest.raises(colibri.InvalidInputError, match=needle):
        colibri.convert(GOLDEN / "mixtral", tmp_path / "m.colibri", dtype=spec, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_recipes_are_listed():
    r = colibri.recipes()
    assert "q4_1-mix" in r and "experts=q4_1" in r["q4_1-mix"]["spec"]


# ------------------------------------------------------------------ imatrix


@pytest.fixture(scope="module")
def demo_imatrix(tmp_path_factory):
    path = tmp_path_factory.mktemp("imatrix") / "demo.imatrix"
    colibri.Engine.demo(threads=2).calibrate(path, max_tokens=3000, progress=False)
    return path


def read_imatrix(path):
    raw = path.read_bytes()
    assert raw[:8] == b"CLBIMTX\0"
    (n,) = struct.unpack("<Q", raw[16:24])
    return json.loads(raw[24 : 24 + n]), raw


def test_calibrate_records_every_matrix_it_ran(demo_imatrix):
    header, raw = read_imatrix(demo_imatrix)
    names = {e["name"]: e for e in header["entries"]}
    assert header["architecture"] == "Qwen3MoeForCausalLM"
    assert header["tokens"] >= 3000
    # Attention sees every token; an expert only the tokens routed to it.
    assert names["layers.0.attn.wq"]["tokens"] == header["tokens"]

    def routed(layer: int) -> list[int]:
        pre = f"layers.{layer}.moe.experts."
        return [e["tokens"] for n, e in names.items() if n.startswith(pre) and n.endswith(".gate")]

    assert [len(routed(layer)) for layer in range(5)] == [8] * 5
    for layer in range(4):
        assert sum(routed(layer)) == 2 * header["tokens"], "top-2 routing: two experts per token"
    # The multi-token-prediction layer (layer 4) runs too, one row per
    # position whose next token the window holds.
    mtp_rows = names["layers.4.attn.wq"]["tokens"]
    assert 0 < mtp_rows < header["tokens"] and sum(routed(4)) == 2 * mtp_rows
    assert names["mtp.proj"]["tokens"] == mtp_rows
    assert names["embed"]["tokens"] == header["tokens"], "the tied output head reads the embedding"


def test_an_imatrix_changes_the_quantisation_and_is_reported(tmp_path, demo_imatrix):
    plain, weighted = tmp_path / "p.colibri", tmp_path / "w.colibri"
    demo = Path(colibri.__file__).parent / "data" / "demo.colibri"
    colibri.convert(demo, plain, dtype="q4_1", progress=False)
    report = colibri.convert(demo, weighted, dtype="q4_1", imatrix=demo_imatrix, progress=False)
    done, missed = report["weighted"]
    # Five layers' experts and attention (the fifth the multi-token-prediction
    # layer), the embedding and the MTP projection.
    assert done > 100 and done + missed == 5 * 8 * 3 + 5 * 4 + 1 + 1
    assert plain.read_bytes() != weighted.read_bytes()
    assert colibri.convert(demo, tmp_path / "x.colibri", dtype="q4_1", progress=False)["weighted"] is None


def test_an_imatrix_of_another_model_is_refused(tmp_path, demo_imatrix, wide):
    with pytest.raises(colibri.InvalidInputError, match=r"demo\.imatrix.*made for a Qwen3MoeForCausalLM"):
        colibri.convert(wide("mixtral"), tmp_path / "m.colibri", dtype="q4_0", imatrix=demo_imatrix)
    assert list(tmp_path.iterdir()) == []


def test_an_imatrix_of_the_same_family_but_other_widths_is_refused(tmp_path, wide):
    # The widened Qwen3-MoE fixture and the demo model share the architecture, not the shapes.
    fixture = tmp_path / "fixture.colibri"
    colibri.convert(wide("qwen3_moe"), fixture, progress=False)
    ids = [(7 * i) % 100 for i in range(200)]  # the fixture has no tokenizer
    path = colibri.Engine(fixture).calibrate(tmp_path / "f.imatrix", token_ids=ids, window=64, progress=False)
    demo = Path(colibri.__file__).parent / "data" / "demo.colibri"
    with pytest.raises(colibri.InvalidInputError, match="made for another model"):
        colibri.convert(demo, tmp_path / "m.colibri", dtype="q4_0", imatrix=path)


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"GGUF\x03\x00\x00\x00" + b"\x00" * 32, "llama.cpp"),
        (b"hello, world", "not a colibri importance matrix"),
        (b"CLBIMTX\x00" + struct.pack("<IIQ", 1, 0, 1 << 40), "runs past the end"),
        (b"CLBIMTX\x00" + struct.pack("<IIQ", 9, 0, 2) + b"{}", "version 9"),
        (b"CLBIMTX\x00" + struct.pack("<IIQ", 1, 0, 4) + b"[1,2", "not valid importance-matrix JSON"),
    ],
)
def test_corrupt_and_foreign_imatrix_files_are_format_errors(tmp_path, content, needle):
    bad = tmp_path / "bad.imatrix"
    bad.write_bytes(content)
    with pytest.raises(colibri.FormatError, match=needle) as e:
        colibri.convert(GOLDEN / "mixtral", tmp_path / "m.colibri", dtype="q4_0", imatrix=bad)
    assert "bad.imatrix" in str(e.value)
    missing = tmp_path / "nope.imatrix"
    with pytest.raises(colibri.ModelNotFoundError):
        colibri.convert(GOLDEN / "mixtral", tmp_path / "m.colibri", dtype="q4_0", imatrix=missing)


def test_calibrate_refuses_what_it_cannot_use(tmp_path):
    e = colibri.Engine.demo(threads=1)
    out = tmp_path / "x.imatrix"
    with pytest.raises(colibri.InvalidInputError, match="empty"):
        e.calibrate(out, text="   ")
    with pytest.raises(colibri.InvalidInputError, match="window"):
        e.calibrate(out, text="hello", window=0)
    out.write_bytes(b"keep me")
    with pytest.raises(colibri.OutputExistsError):
        e.calibrate(out, text="hello")
    assert out.read_bytes() == b"keep me"
    streaming = colibri.Engine.demo(threads=1, ram_budget="2MB", heat_file="off")
    with pytest.raises(colibri.InvalidInputError, match="whole model in memory"):
        streaming.calibrate(tmp_path / "y.imatrix", text="hello")


def test_the_command_line(tmp_path):
    demo = Path(colibri.__file__).parent / "data" / "demo.colibri"
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged. " * 50, encoding="utf-8")
    im = tmp_path / "d.imatrix"
    r = subprocess.run(
        [*CLI, "calibrate", str(demo), "--text", str(text), "-o", str(im)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert f"--imatrix {im}" in r.stdout
    out = tmp_path / "m.colibri"
    r = subprocess.run(
        [*CLI, "convert", str(demo), "-o", str(out), "--dtype", "q4_1-mix", "--imatrix", str(im)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "q4_1-mix" in r.stdout and "importance matrix:" in r.stdout
    r = subprocess.run([*CLI, "info", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "q4_1-mix (recipe)" in r.stdout and "experts_down" in r.stdout and "bits/weight" in r.stdout
    info = json.loads(
        subprocess.run([*CLI, "info", str(out), "--json"], capture_output=True, text=True).stdout
    )
    assert info["recipe"] == "q4_1-mix" and info["weight_types"][-1]["class"] == "all"
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    r = subprocess.run(
        [*CLI, "calibrate", str(demo), "--text", str(bad), "-o", str(tmp_path / "z.imatrix")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "not UTF-8" in r.stderr
