"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) and MiniMax Sparse
Attention (MiniMax-M3): bad checkpoints are refused naming the key or tensor,
and the indexer's key cache is counted in the state memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import colibri
from conftest import GOLDEN, copy_case_single_file, load_tensors, write_safetensors


def edited(tmp_path: Path, case: str, **changes: object) -> Path:
    """The golden case `case` with config.json keys changed."""
    folder = copy_case_single_file(case, tmp_path / case)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    ("case", "changes", "named"),
    [
        ("deepseek_v32", {"index_topk": 0}, "index_topk"),
        ("deepseek_v32", {"index_n_heads": 0}, "index_n_heads"),
        ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank"),
        # The tensors hold 16 heads of 10: other counts or widths disagree with them.
        ("deepseek_v32", {"index_n_heads": 8}, "indexer.wq_b"),
        ("deepseek_v32", {"index_head_dim": 12}, "indexer.wq_b"),
        ("glm_moe_dsa", {"indexer_types": ["shared", "full", "full", "shared"]}, "indexer_types"),
        ("glm_moe_dsa", {"indexer_types": ["full", "shared"]}, "indexer_types"),
    ],
)
def test_bad_sparse_attention_checkpoints_name_the_key_or_tensor(tmp_path, case, changes, named):
    src = edited(tmp_path, case, **changes)
    with pytest.raises(colibri.CheckpointError, match=named.replace(".", r"\.")):
        colibri.convert(src, tmp_path / "out.colibri", progress=False)


def test_a_shared_layer_with_indexer_tensors_is_refused(tmp_path):
    """GLM-5: a layer marked "full" whose indexer tensors are missing is refused naming them."""
    folder = copy_case_single_file("glm_moe_dsa", tmp_path / "glm")
    tensors = load_tensors(GOLDEN / "glm_moe_dsa")
    kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.2.self_attn.indexer.")}
    write_safetensors(folder / "model.safetensors", kept)
    with pytest.raises(colibri.CheckpointError, match=r"model\.layers\.2\.self_attn\.indexer"):
        colibri.convert(folder, tmp_path / "out.colibri", progress=False)


def test_state_bytes_count_the_index_keys(converted):
    """Per token and layer: the latent (kv_lora_rank + qk_rope_head_dim) and, on a
    layer with an indexer of its own, one index key of index_head_dim values."""
    for case in ("deepseek_v32", "glm_moe_dsa"):
        cfg = json.loads((GOLDEN / case / "config.json").read_text())
        latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        kinds = cfg.get("indexer_types", ["full"] * cfg["num_hidden_layers"])
        values = sum(latent + (cfg["index_head_dim"] if k == "full" else 0) for k in kinds)
        engine = colibri.Engine(converted(case))
        assert engine.state_bytes() == {"per_token": values * 4, "per_sequence": 0}, case


def test_info_tells_the_indexer_and_counts_its_keys(converted):
    """`colibri info`: the attention line names the sparse layers and the indexer,
    and the cache bytes per token include the index keys."""
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "info", str(converted("glm_moe_dsa")), "--json"],
        capture_output=True,
        encoding="utf-8",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert "sparse on 4 of 4 layers (indexer 16 heads x 12, top 6 keys; 2 reuse" in info["attention"]
    # Layers 0 and 2: latent 16 + index key 12; layers 1 and 3: latent only; f32.
    assert info["kv_cache"]["bytes_per_token"] == (2 * 28 + 2 * 16) * 4


# ---------------------------------------------------------------------------
# MiniMax-M3: block-sparse GQA, and the vision tower it skips


def edited_text(tmp_path: Path, **changes: object) -> Path:
    """The minimax_m3_vl case with keys of its text_config changed (None drops one)."""
    folder = copy_case_single_file("minimax_m3_vl", tmp_path / "m3")
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg["text_config"].pop(k, None)
        else:
            cfg["text_config"][k] = v
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_minimax_m3_state_counts_keys_values_and_index_keys(converted):
    """Per token: every layer's keys and values (2 kv heads of 12), and on the two
    block-sparse layers one index key of index_head_dim values; f32."""
    cfg = json.loads((GOLDEN / "minimax_m3_vl" / "config.json").read_text())["text_config"]
    kv = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
    sparse = sum(cfg["sparse_attention_config"]["sparse_attention_freq"])
    values = cfg["num_hidden_layers"] * kv + sparse * cfg["sparse_attention_config"]["sparse_index_dim"]
    engine = colibri.Engine(converted("minimax_m3_vl"))
    assert engine.state_bytes() == {"per_token": values * 4, "per_sequence": 0}


def test_minimax_m3_info_tells_the_block_indexer_and_the_skipped_tower(converted):
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "info", str(converted("minimax_m3_vl")), "--json"],
        capture_output=True,
        encoding="utf-8",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (
        "block-sparse on 2 of 4 layers (index 4 heads x 8, top 4 blocks of 4 keys, 2 local)"
        in info["attention"]
    )
    # 4 layers of keys and values (2 · 2 · 12) and 2 index keys of 8, f32.
    assert info["kv_cache"]["bytes_per_token"] == (4 * 48 + 2 * 8) * 4
    parts = info["not_converted"]
    for prefix in ("vision_tower.vision_model.* (", "multi_modal_projector.linear_1.* (", "patch_merge_mlp."):
        assert any(p.startswith(prefix) for p in parts), parts
    assert not any(p.startswith("language_model.") for p in parts), parts


def test_minimax_m3_without_its_vision_tower_converts_the_same(tmp_path, converted):
    """The vision tensors are skipped, not needed: a checkpoint without them gives the same logits."""
    folder = copy_case_single_file("minimax_m3_vl", tmp_path / "m3")
    tensors = load_tensors(folder)
    text_only = {k: v for k, v in tensors.items() if k.startswith("language_model.")}
    assert len(text_only) < len(tensors)
    write_safetensors(folder / "model.safetensors", text_only)
    colibri.convert(folder, tmp_path / "o.colibri", progress=False)
    out = colibri.Engine(tmp_path / "o.colibri")
    assert out.skipped_parts == []
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    assert (out.logits(ids) == colibri.Engine(converted("minimax_m3_vl")).logits(ids)).all()


@pytest.mark.parametrize(
    ("changes", "error", "named"),
    [
        (
            {"sparse_attention_config": {"sparse_num_index_heads": 3, "sparse_attention_freq": [0, 1, 1, 0]}},
            colibri.CheckpointError,
            "index_n_heads",
        ),
        ({"moe_layer_freq": [0, 1, 1]}, colibri.CheckpointError, "moe_layer_freq"),
        (
            {"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]},
            colibri.CheckpointError,
            "layer_types[1]",
        ),
        # The tensors hold 4 index heads of 8: another width disagrees with them.
        ({"index_head_dim": 16, "sparse_attention_config": None}, colibri.CheckpointError, "index_q_proj"),
    ],
)
def test_bad_minimax_m3_checkpoints_name_the_key_or_tensor(tmp_path, changes, error, named):
    if changes.get("index_head_dim"):
        # The flat keys then say what the legacy block said, but a width of 16.
        changes = {
            **changes,
            "index_n_heads": 4,
            "index_block_size": 4,
            "index_topk_blocks": 4,
            "index_local_blocks": 2,
            "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "full_attention"],
        }
    src = edited_text(tmp_path, **changes)
    with pytest.raises(error, match=named.replace(".", r"\.").replace("[", r"\[")):
        colibri.convert(src, tmp_path / "out.colibri", progress=False)
