"""Engine.from_pretrained with a Hub repository id, offline, against a
Hugging Face cache laid out here as huggingface_hub lays it out
(models--ORG--NAME/refs/REVISION -> snapshots/COMMIT/...)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri
from conftest import GOLDEN

pytest.importorskip("huggingface_hub")

CASE = "qwen3_moe"
COMMITS = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hub cache holding testorg/tiny-moe at two revisions (v1 has another config name)."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    repo = root / "models--testorg--tiny-moe"
    for ref, commit in COMMITS.items():
        snap = repo / "snapshots" / commit
        shutil.copytree(GOLDEN / CASE, snap, ignore=shutil.ignore_patterns("golden.npz", "*.py"))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    cfg = repo / "snapshots" / COMMITS["v1"] / "config.json"
    c = json.loads(cfg.read_text())
    c["rms_norm_eps"] = 1e-3  # a different model at v1
    cfg.write_text(json.dumps(c))
    return root


def _run(code: str, hub: Path, cache: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", COLIBRI_CACHE=str(cache))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_a_repo_id_opens_from_the_hf_cache_offline(hub_cache, tmp_path):
    code = """
import numpy as np, colibri
a = colibri.Engine.from_pretrained("testorg/tiny-moe", progress=False)
b = colibri.Engine.from_pretrained("testorg/tiny-moe", revision="v1", progress=False)
np.save("main.npy", a.logits([1, 2, 3])); np.save("v1.npy", b.logits([1, 2, 3]))
print(a.path); print(b.path)
"""
    run = _run(code, hub_cache, tmp_path / "c", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    main_path, v1_path = run.stdout.split()
    assert main_path != v1_path and Path(main_path).parent == tmp_path / "c"
    # The same as converting the snapshot folder by hand.
    direct = colibri.Engine.from_pretrained(
        hub_cache / "models--testorg--tiny-moe" / "snapshots" / COMMITS["main"], cache_dir=tmp_path / "d"
    )
    assert np.array_equal(np.load(tmp_path / "main.npy"), direct.logits([1, 2, 3]))
    assert not np.array_equal(np.load(tmp_path / "main.npy"), np.load(tmp_path / "v1.npy"))


def test_missing_repo_or_revision_offline_is_a_clear_error(hub_cache, tmp_path):
    for call, needle in [
        ('"testorg/nothing-here"', "testorg/nothing-here"),
        ('"testorg/tiny-moe", revision="v9"', "revision 'v9'"),
    ]:
        run = _run(
            f"import colibri\ntry:\n    colibri.Engine.from_pretrained({call})\n"
            "except colibri.ModelNotFoundError as e:\n    print('NotFound:', e)\n",
            hub_cache,
            tmp_path,
        )
        assert run.returncode == 0 and run.stdout.startswith("NotFound:"), run.stdout + run.stderr
        assert needle in run.stdout and "HF_HUB_OFFLINE='1'" in run.stdout, run.stdout


def test_without_huggingface_hub_the_error_says_what_to_install(tmp_path):
    run = _run(
        "import sys; sys.modules['huggingface_hub'] = None\nimport colibri\n"
        "try:\n    colibri.Engine.from_pretrained('testorg/tiny-moe')\n"
        "except colibri.ModelNotFoundError as e:\n    print(e)\n",
        tmp_path,
        tmp_path,
    )
    assert "pip install 'colibri-moe[hub]'" in run.stdout, run.stdout + run.stderr


def test_revision_for_a_local_folder_is_refused(tmp_path):
    with pytest.raises(colibri.InvalidInputError, match="revision"):
        colibri.Engine.from_pretrained(GOLDEN / CASE, revision="main", cache_dir=tmp_path)
