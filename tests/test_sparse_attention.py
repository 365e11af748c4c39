"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): bad checkpoints are
refused naming the key or tensor, and the indexer's key cache is counted in
the state memory."""

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
