"""The converter: what it accepts, what it refuses, and that it never loses data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri
from conftest import GOLDEN, copy_case_single_file, load_tensors, write_safetensors


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".partial" in p.name)


def test_converts_sharded_checkpoint_and_reports(tmp_path):
    out = tmp_path / "q.colibri"
    report = colibri.convert(GOLDEN / "qwen3_moe", out, progress=False)
    assert report["architecture"] == "Qwen3MoeForCausalLM"
    assert report["dtype"] == "f32"
    assert report["bytes"] == out.stat().st_size
    engine = colibri.Engine(out)
    assert engine.architecture == "Qwen3MoeForCausalLM"
    assert engine.source_config["model_type"] == "qwen3_moe"
    assert engine.config["rope"]["scaling"]["type"] == "yarn"


def test_refuses_to_overwrite_unless_forced(tmp_path):
    out = tmp_path / "m.colibri"
    out.write_bytes(b"precious")
    with pytest.raises(colibri.OutputExistsError, match="already exists") as e:
        colibri.convert(GOLDEN / "mixtral", out, progress=False)
    assert isinstance(e.value, FileExistsError)
    assert out.read_bytes() == b"precious"
    colibri.convert(GOLDEN / "mixtral", out, force=True, progress=False)
    assert colibri.Engine(out).architecture == "MixtralForCausalLM"
    assert leftovers(tmp_path) == []


def test_unknown_architecture_is_named_with_the_supported_list(tmp_path):
    src = copy_case_single_file("mixtral", tmp_path / "llama")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(colibri.UnsupportedModelError) as e:
        colibri.convert(src, tmp_path / "x.colibri", progress=False)
    msg = str(e.value)
    assert "LlamaForCausalLM" in msg
    for name in colibri.supported_architectures():
        assert name in msg
    assert not (tmp_path / "x.colibri").exists()


def test_missing_tensor_is_named_and_nothing_is_left_behind(tmp_path):
    src = copy_case_single_file("olmoe", tmp_path / "src")
    tensors = load_tensors(src)
    gone = "model.layers.1.mlp.experts.3.down_proj.weight"
    del tensors[gone]
    write_safetensors(src / "model.safetensors", tensors)
    out = tmp_path / "o.colibri"
    with pytest.raises(colibri.CheckpointError, match=gone.replace(".", r"\.")):
        colibri.convert(src, out, progress=False)
    assert not out.exists() and leftovers(tmp_path) == []


def test_wrong_shape_is_reported_with_both_shapes(tmp_path):
    src = copy_case_single_file("qwen2_moe", tmp_path / "src")
    tensors = load_tensors(src)
    name = "model.layers.0.self_attn.k_proj.weight"
    dtype, shape, data = tensors[name]
    assert shape[0] != shape[1]
    tensors[name] = (dtype, [shape[1], shape[0]], data)
    write_safetensors(src / "model.safetensors", tensors)
    with pytest.raises(colibri.CheckpointError) as e:
        colibri.convert(src, tmp_path / "o.colibri", progress=False)
    assert name in str(e.value) and str(shape) in str(e.value).replace(" ", "").replace(",", ", ")


def test_unconsumed_tensor_is_an_error(tmp_path):
    src = copy_case_single_file("mixtral", tmp_path / "src")
    tensors = load_tensors(src)
    tensors["model.layers.0.block_sparse_moe.experts.99.w1.weight"] = tensors[
        "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    ]
    write_safetensors(src / "model.safetensors", tensors)
    with pytest.raises(colibri.CheckpointError, match="not consumed"):
        colibri.convert(src, tmp_path / "o.colibri", progress=False)


def test_truncated_safetensors_is_a_checkpoint_error(tmp_path):
    src = copy_case_single_file("mixtral", tmp_path / "src")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(colibri.CheckpointError, match="truncated"):
        colibri.convert(src, tmp_path / "o.colibri", progress=False)


def test_integer_tensor_dtype_is_refused(tmp_path):
    src = copy_case_single_file("mixtral", tmp_path / "src")
    tensors = load_tensors(src)
    name = "model.norm.weight"
    _, shape, data = tensors[name]
    tensors[name] = ("I32", shape, data)
    write_safetensors(src / "model.safetensors", tensors)
    with pytest.raises(colibri.UnsupportedModelError, match="I32"):
        colibri.convert(src, tmp_path / "o.colibri", progress=False)


@pytest.mark.parametrize(
    "edit, error, needle",
    [
        (lambda c: c.pop("hidden_size"), colibri.CheckpointError, "hidden_size"),
        (lambda c: c.update(num_experts_per_tok=99), colibri.CheckpointError, "top_k"),
        (lambda c: c.update(hidden_act="gelu"), colibri.UnsupportedModelError, "gelu"),
        (
            lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            colibri.UnsupportedModelError,
            "dynamic",
        ),
        (lambda c: c.update(num_attention_heads="four"), colibri.CheckpointError, "num_attention_heads"),
    ],
)
def test_bad_config_values_are_explained(tmp_path, edit, error, needle):
    src = tmp_path / "src"
    shutil.copytree(GOLDEN / "mixtral", src)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error, match=needle):
        colibri.convert(src, tmp_path / "o.colibri", progress=False)


def test_missing_folder_and_missing_config(tmp_path):
    with pytest.raises(colibri.ModelNotFoundError) as e:
        colibri.convert(tmp_path / "nope", tmp_path / "o.colibri")
    assert isinstance(e.value, FileNotFoundError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(colibri.CheckpointError, match="config.json"):
        colibri.convert(tmp_path / "empty", tmp_path / "o.colibri")
    with pytest.raises(colibri.CheckpointError, match="not valid JSON"):
        (tmp_path / "empty" / "config.json").write_text("{")
        colibri.convert(tmp_path / "empty", tmp_path / "o.colibri")


def test_bad_dtype_name(tmp_path):
    with pytest.raises(colibri.InvalidInputError, match="q9"):
        colibri.convert(GOLDEN / "mixtral", tmp_path / "o.colibri", dtype="q9")


def test_embeds_tokenizer_files_when_present(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(GOLDEN / "mixtral", src)
    tok = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}
    (src / "tokenizer.json").write_text(json.dumps(tok))
    (src / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages }}", "bos_token": "<s>"})
    )
    out = tmp_path / "o.colibri"
    colibri.convert(src, out, progress=False)
    raw = out.read_bytes()
    meta = json.loads(raw[32 : 32 + int.from_bytes(raw[16:24], "little")])
    assert meta["source"]["tokenizer"] == tok
    assert meta["source"]["chat_template"] == "{{ messages }}"
    assert meta["source"]["generation_config"] is not None


# ---------------------------------------------------------------------------
# Re-encoding a .colibri file

DEMO = Path(colibri.__file__).parent / "data" / "demo.colibri"
needs_demo = pytest.mark.skipif(not DEMO.is_file(), reason="the demo model is not in this checkout")


def header_meta(path):
    raw = path.read_bytes()
    return json.loads(raw[32 : 32 + int.from_bytes(raw[16:24], "little")])


@needs_demo
def test_recode_keeps_everything_but_the_weights(tmp_path):
    out = tmp_path / "demo-q4_1.colibri"
    report = colibri.convert(DEMO, out, dtype="q4_1", progress=False)
    assert report["dtype"] == "q4_1" and report["bytes"] == out.stat().st_size
    assert report["architecture"] == "Qwen3MoeForCausalLM"
    old, new = header_meta(DEMO), header_meta(out)
    assert new["weight_dtype"] == "q4_1"
    for key in ("architecture", "config", "source"):
        assert new[key] == old[key], key
    kinds = {t["dtype"] for t in new["tensors"]}
    assert kinds == {"f32", "q4_1x8"}  # every demo matrix has rows of whole blocks, in groups of 8
    a, b = colibri.Engine(DEMO), colibri.Engine(out)
    assert b.tokenize("Mr. Darcy") == a.tokenize("Mr. Darcy")
    assert b.chat_template == a.chat_template and b.generation_defaults == a.generation_defaults
    assert leftovers(tmp_path) == []


@needs_demo
def test_recode_through_f32_is_lossless_and_matches_direct(tmp_path):
    # bf16 -> f32 is exact, so quantising the f32 copy gives the same file as
    # quantising the bf16 original, byte for byte.
    f32 = tmp_path / "demo-f32.colibri"
    colibri.convert(DEMO, f32, dtype="f32", progress=False)
    ids = colibri.Engine(DEMO).tokenize("It is a truth universally acknowledged")
    assert np.array_equal(colibri.Engine(f32).logits(ids), colibri.Engine(DEMO).logits(ids))
    via, direct = tmp_path / "via.colibri", tmp_path / "direct.colibri"
    colibri.convert(f32, via, dtype="q8_0", progress=False)
    colibri.convert(DEMO, direct, dtype="q8_0", progress=False)
    assert via.read_bytes() == direct.read_bytes()
    # No dtype: the source's own type, the same tensors.
    same = tmp_path / "same.colibri"
    assert colibri.convert(direct, same, progress=False)["dtype"] == "q8_0"
    assert same.read_bytes() == direct.read_bytes()


def test_recode_errors(tmp_path):
    src = tmp_path / "m.colibri"
    colibri.convert(GOLDEN / "olmoe", src, progress=False)
    with pytest.raises(colibri.ModelNotFoundError) as e:
        colibri.convert(tmp_path / "nope.colibri", tmp_path / "o.colibri")
    assert isinstance(e.value, FileNotFoundError)
    out = tmp_path / "o.colibri"
    out.write_bytes(b"precious")
    with pytest.raises(colibri.OutputExistsError):
        colibri.convert(src, out, dtype="q8_0", progress=False)
    assert out.read_bytes() == b"precious"
    with pytest.raises(colibri.InvalidInputError, match="q9"):
        colibri.convert(src, tmp_path / "p.colibri", dtype="q9")
    # A truncated .colibri file and a file that is no .colibri at all.
    cut = tmp_path / "cut.colibri"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(colibri.FormatError, match="cut.colibri"):
        colibri.convert(cut, tmp_path / "p.colibri", dtype="q4_0", progress=False)
    with pytest.raises(colibri.FormatError, match="folder"):
        colibri.convert(GOLDEN / "olmoe" / "config.json", tmp_path / "p.colibri", progress=False)
    assert not (tmp_path / "p.colibri").exists() and leftovers(tmp_path) == []


@needs_demo
def test_recode_from_the_command_line(tmp_path):
    out = tmp_path / "d.colibri"
    cmd = [sys.executable, "-m", "colibri", "convert", str(DEMO), "--dtype", "q4_0", "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "q4_0" in r.stdout and colibri.Engine(out).dtype == "q4_0"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "already exists" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------
# Hybrid linear-attention checkpoints: bad configs and tensors name what is wrong


def _hybrid_copy(tmp_path, case, edit=None, drop=None):
    from conftest import copy_case_single_file, load_tensors, write_safetensors

    src = copy_case_single_file(case, tmp_path / "src")
    if edit is not None:
        cfg = json.loads((src / "config.json").read_text())
        edit(cfg)
        (src / "config.json").write_text(json.dumps(cfg))
    if drop is not None:
        tensors = {n: t for n, t in load_tensors(src).items() if n != drop}
        write_safetensors(src / "model.safetensors", tensors)
    return src


@pytest.mark.parametrize(
    "case, edit, drop, needle",
    [
        ("qwen3_5_moe", lambda c: c.update(layer_types=c["layer_types"][:3]), None, "layer_types"),
        ("qwen3_5_moe", lambda c: c["layer_types"].__setitem__(1, "mamba"), None, r"layer_types\[1\]"),
        ("qwen3_next", lambda c: c.update(linear_conv_kernel_dim=0), None, "linear_conv_kernel_dim"),
        ("qwen3_next", lambda c: c.update(linear_num_value_heads=5), None, "linear_num_value_heads"),
        ("qwen3_next", lambda c: c.update(full_attention_interval=0), None, "full_attention_interval"),
        ("qwen3_next", None, "model.layers.0.linear_attn.A_log", "linear_attn.A_log"),
        ("qwen3_5_moe", None, "model.layers.1.linear_attn.dt_bias", "linear_attn.dt_bias"),
        ("qwen3_5_moe", lambda c: c.update(linear_value_head_dim=16), None, "in_proj_qkv.*config.json"),
        ("kimi_linear", lambda c: c["linear_attn_config"].update(kda_layers=[1, 5]), None, "kda_layers"),
        ("kimi_linear", lambda c: c["linear_attn_config"].update(kda_layers=[1]), None, "layer 3"),
        (
            "kimi_linear",
            lambda c: c["linear_attn_config"].update(short_conv_kernel_size=0),
            None,
            "short_conv",
        ),
        ("kimi_linear", None, "model.layers.0.self_attn.A_log", "self_attn.A_log"),
        ("nemotron_h", lambda c: c.update(hybrid_override_pattern="MXE"), None, "hybrid_override_pattern"),
        ("nemotron_h", lambda c: c.update(mamba_num_heads=4), None, "in_proj"),
        ("nemotron_h", None, "backbone.layers.4.mixer.A_log", "layers.4.mixer.A_log"),
        ("nemotron_h", None, "backbone.layers.1.mixer.experts.3.up_proj.weight", "experts.3.up_proj"),
        ("granitemoehybrid", lambda c: c.update(time_step_limit="fast"), None, "time_step_limit"),
        ("granitemoehybrid", lambda c: c.update(layer_types=["mamba"] * 3), None, "layer_types"),
        ("granitemoehybrid", lambda c: c.update(mamba_d_head=7), None, "mamba_d_head"),
        ("granitemoehybrid", None, "model.layers.2.mamba.conv1d.bias", "mamba.conv1d.bias"),
    ],
)
def test_bad_hybrid_checkpoints_are_checkpoint_errors_naming_the_key(tmp_path, case, edit, drop, needle):
    src = _hybrid_copy(tmp_path, case, edit, drop)
    with pytest.raises(colibri.CheckpointError, match=needle):
        colibri.convert(src, tmp_path / "o.colibri", progress=False)
    assert not (tmp_path / "o.colibri").exists()


def test_the_vision_tower_and_mtp_layer_are_skipped_and_named(tmp_path):
    out = tmp_path / "vl.colibri"
    colibri.convert(GOLDEN / "qwen3_5_moe_vl", out, progress=False)
    parts = colibri.Engine(out).skipped_parts
    assert any(p.startswith("model.visual.* (") for p in parts), parts
    assert any(p.startswith("mtp.") for p in parts), parts
    assert colibri.Engine(tmp_path / "vl.colibri").state_bytes()["per_sequence"] > 0


def test_mistral_small_4_as_shipped_skips_the_vision_tower_and_projector(tmp_path):
    out = tmp_path / "m3.colibri"
    colibri.convert(GOLDEN / "mistral4_vl", out, progress=False)
    parts = colibri.Engine(out).skipped_parts
    assert any(p.startswith("vision_tower.") for p in parts), parts
    assert any(p.startswith("multi_modal_projector.") for p in parts), parts


@pytest.mark.parametrize("key", ["llama_4_scaling_beta", "original_max_position_embeddings"])
def test_mistral4_without_its_attention_temperature_is_refused_by_name(tmp_path, key):
    src = _hybrid_copy(tmp_path, "mistral4", lambda c: c["rope_parameters"].pop(key))
    with pytest.raises(colibri.CheckpointError, match=key):
        colibri.convert(src, tmp_path / "o.colibri", progress=False)
    assert not (tmp_path / "o.colibri").exists()


# ---------------------------------------------------------------------------
# MiniMax-M2 and ERNIE-4.5 MoE: Hub keys the engine cannot honour, missing tensors, MTP tensors


@pytest.mark.parametrize(
    "case, edit, drop, error, needle",
    [
        (
            "minimax_m2",
            lambda c: c.update(qk_norm_type="per_head"),
            None,
            colibri.UnsupportedModelError,
            "qk_norm_type",
        ),
        (
            "minimax_m2",
            lambda c: c.update(scoring_func="softmax"),
            None,
            colibri.UnsupportedModelError,
            "scoring_func",
        ),
        (
            "minimax_m2",
            None,
            "model.layers.1.block_sparse_moe.e_score_correction_bias",
            colibri.CheckpointError,
            "block_sparse_moe.e_score_correction_bias",
        ),
        (
            "minimax_m2",
            None,
            "model.layers.2.self_attn.k_norm.weight",
            colibri.CheckpointError,
            "self_attn.k_norm",
        ),
        ("ernie4_5_moe", lambda c: c.update(use_bias=True), None, colibri.UnsupportedModelError, "use_bias"),
        (
            "ernie4_5_moe",
            lambda c: c.update(moe_layer_interval=0),
            None,
            colibri.CheckpointError,
            "moe_layer_interval",
        ),
        (
            "ernie4_5_moe",
            None,
            "model.layers.5.mlp.moe_statics.e_score_correction_bias",
            colibri.CheckpointError,
            "moe_statics.e_score_correction_bias",
        ),
        # One more MoE layer than the checkpoint has.
        (
            "ernie4_5_moe",
            lambda c: c.update(moe_layer_end_index=7),
            None,
            colibri.CheckpointError,
            "layers.7.mlp",
        ),
    ],
)
def test_bad_minimax_and_ernie_checkpoints_name_the_key(tmp_path, case, edit, drop, error, needle):
    src = _hybrid_copy(tmp_path, case, edit, drop)
    with pytest.raises(error, match=needle):
        colibri.convert(src, tmp_path / "o.colibri", progress=False)
    assert not (tmp_path / "o.colibri").exists()


@pytest.mark.parametrize(
    "case, extra",
    [
        ("minimax_m2", "model.layers.3.block_sparse_moe.gate.weight"),  # an MTP layer past the last
        ("ernie4_5_moe", "mtp_emb_norm.0.weight"),  # transformers drops every key containing "mtp"
    ],
)
def test_mtp_tensors_are_skipped_and_named(tmp_path, case, extra):
    from conftest import load_tensors, write_safetensors

    src = _hybrid_copy(tmp_path, case)
    tensors = load_tensors(src)
    tensors[extra] = ("F32", [4], bytes(16))
    write_safetensors(src / "model.safetensors", tensors)
    out = tmp_path / "o.colibri"
    colibri.convert(src, out, progress=False)
    prefix = ".".join(extra.split(".")[:2])
    assert any(p.startswith(prefix + ".* (") for p in colibri.Engine(out).skipped_parts)


def test_gemma4_towers_are_skipped_and_named(tmp_path):
    out = tmp_path / "g4.colibri"
    colibri.convert(GOLDEN / "gemma4", out, progress=False)
    parts = colibri.Engine(out).skipped_parts
    assert any(p.startswith("model.vision_tower.* (") for p in parts), parts
    assert any(p.startswith("model.embed_vision.* (") for p in parts), parts


@pytest.mark.parametrize(
    "edit, drop, needle",
    [
        (lambda t: t.update(layer_types=t["layer_types"][:4]), None, "layer_types"),
        (lambda t: t.update(hidden_size_per_layer_input=256), None, "hidden_size_per_layer_input"),
        (lambda t: t.pop("hidden_size_per_layer_input"), None, "hidden_size_per_layer_input"),
        (lambda t: t.update(num_kv_shared_layers=2), None, "num_kv_shared_layers"),
        (None, "model.language_model.layers.3.router.per_expert_scale", "per_expert_scale"),
        (None, "model.language_model.layers.0.self_attn.v_proj.weight", "v_proj"),
    ],
)
def test_bad_gemma4_checkpoints_are_checkpoint_errors_naming_the_key(tmp_path, edit, drop, needle):
    src = _hybrid_copy(tmp_path, "gemma4", edit and (lambda c: edit(c["text_config"])), drop)
    with pytest.raises(colibri.CheckpointError, match=needle):
        colibri.convert(src, tmp_path / "o.colibri", progress=False)
    assert not (tmp_path / "o.colibri").exists()
