"""Stage files (colibri.split, `colibri split`): each holds its layers' bytes
of the whole file, stages over them chain to the whole model's logits bit
for bit (also streaming their experts under a RAM budget), and everything a
user can get wrong is refused with a typed error. No Ray here: the stages
are chained by hand; tests/test_ray_pipeline.py runs them on a cluster.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import colibri
from colibri import _colibri
from colibri.cli import main
from colibri.ray._pipeline import choose_split

PROMPT = [3, 17, 5, 9, 22, 31, 8, 2, 14]


def chain(paths, ids, **options):
    """The logits of ``ids`` through stage files in order, as one process."""
    h = None
    for p in paths:
        st = _colibri.NativeStage(p, threads=1, **options)
        h = bytes(st.run(ids, h))
    return np.frombuffer(h, dtype=np.float32)


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_stage_files_chain_to_the_whole_models_logits(tmp_path, converted, case):
    path = converted(case)
    whole = colibri.Engine(path, threads=1)
    want = whole.logits(PROMPT).reshape(-1)
    files = colibri.split(path, 3, out=tmp_path, progress=False)
    assert [f["layers"] for f in files] == [tuple(x) for x in _colibri.stage_plan(path, [1.0, 1.0, 1.0])]
    assert sum(f["bytes"] for f in files) < 1.1 * os.path.getsize(path)
    got = chain([f["path"] for f in files], PROMPT)
    assert np.array_equal(got, want), case
    # Each stage streaming its experts through the fewest slots it can run with.
    budget = max(colibri.plan(f["path"])["min_budget"] for f in files)
    assert any(colibri.plan(f["path"], budget)["streams"] for f in files)
    got = chain([f["path"] for f in files], PROMPT, ram_budget=budget)
    assert np.array_equal(got, want), f"{case}, streaming"


def test_refusals(tmp_path, converted):
    path = converted("qwen3_moe")
    files = colibri.split(path, 2, out=tmp_path, progress=False)
    with pytest.raises(colibri.InvalidInputError, match="is a stage file"):
        colibri.Engine(files[0]["path"])
    with pytest.raises(colibri.InvalidInputError, match="already a stage file"):
        colibri.split(files[0]["path"], 2, out=tmp_path / "x", progress=False)
    with pytest.raises(colibri.OutputExistsError):
        colibri.split(path, 2, out=tmp_path, progress=False)
    assert colibri.split(path, 2, out=tmp_path, force=True, progress=False)[1]["path"] == files[1]["path"]
    with pytest.raises(colibri.InvalidInputError, match="shares"):
        colibri.split(path, 2, shares=[1.0], progress=False)
    with pytest.raises(colibri.InvalidInputError):
        colibri.split(path, 0, progress=False)
    with pytest.raises(colibri.InvalidInputError, match="between 1 and"):
        colibri.split(path, 99, dry_run=True)
    # A whole file's stage needs its layers; a stage file's are outside another range.
    with pytest.raises(colibri.InvalidInputError, match="give start and end"):
        _colibri.NativeStage(path)
    with pytest.raises(colibri.InvalidInputError, match="holding layers"):
        _colibri.NativeStage(files[1]["path"], start=0, end=1)
    # The pipeline engine wants the folder, and stage files for a RAM budget.
    from colibri.ray import Engine as PipelineEngine

    pytest.importorskip("ray")
    with pytest.raises(colibri.InvalidInputError, match="give the folder"):
        PipelineEngine(files[0]["path"])
    with pytest.raises(colibri.InvalidInputError, match="colibri split"):
        PipelineEngine(path, ram_budget="1GB")


def test_the_cli_splits_and_describes_stage_files(tmp_path, converted, capsys):
    path = str(converted("qwen3_moe"))
    assert main(["split", path, "--stages", "2", "-o", str(tmp_path), "--dry-run"]) == 0
    planned = capsys.readouterr().out
    assert "would write stage 1 of 2: layers 0.." in planned and not list(tmp_path.iterdir())
    assert main(["split", path, "--stages", "2", "--shares", "3,1", "-o", str(tmp_path), "-q"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    stem = os.path.splitext(os.path.basename(path))[0]
    assert names == [f"{stem}.stage-1-of-2.colibri", f"{stem}.stage-2-of-2.colibri"]
    capsys.readouterr()
    # A second split is refused (nothing is overwritten), a bad --shares too.
    assert main(["split", path, "--stages", "2", "-o", str(tmp_path), "-q"]) == 1
    assert "exists" in capsys.readouterr().err
    assert main(["split", path, "--stages", "2", "--shares", "3,x", "-o", str(tmp_path)]) == 2
    assert "--shares" in capsys.readouterr().err
    second = str(tmp_path / names[1])
    assert main(["info", second]) == 0
    assert "stage 2 of 2: layers" in capsys.readouterr().out
    assert main(["info", second, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["stage_file"]
    assert info["stage"] == 1 and info["stages"] == 2 and info["layers"][1] == info["of"]


def test_choose_split_places_each_stage_on_a_node_holding_its_file():
    def f(stage, stages=3, origin="o1"):
        return (
            f"/m/x.stage-{stage + 1}-of-{stages}.colibri",
            {
                "stage": stage,
                "stages": stages,
                "layers": [stage, stage + 1],
                "origin": origin,
                "bytes": 10,
            },
            "",
        )

    # Node c holds stage 0 only, a holds 0 and 1, b holds 1 and 2: c gets 0
    # (its only choice), a gets 1, b gets 2.
    found = {"a": [f(0), f(1)], "b": [f(1), f(2)], "c": [f(0)]}
    nodes, paths, infos = choose_split(found, "/m", None)
    assert nodes == ["c", "a", "b"] and paths[2].endswith("stage-3-of-3.colibri")
    assert [i["stage"] for i in infos] == [0, 1, 2]
    # Two stages only on one node share it.
    nodes, _, _ = choose_split({"a": [f(0), f(1), f(2)], "b": []}, "/m", 3)
    assert nodes == ["a", "a", "a"]
    from colibri import StageError

    with pytest.raises(StageError, match=r"stage\(s\) 3 of 3 are on no node"):
        choose_split({"a": [f(0)], "b": [f(1)]}, "/m", None)
    with pytest.raises(StageError, match="2 different splits"):
        choose_split({"a": [f(0), f(1), f(2)], "b": [f(0, origin="o2")]}, "/m", None)
    with pytest.raises(StageError, match=r"found files of a split into \[3\] stages"):
        choose_split({"a": [f(0)]}, "/m", 2)
    with pytest.raises(colibri.ModelNotFoundError, match="no stage files in /m on any of the 1 node"):
        choose_split({"a": []}, "/m", None)
    with pytest.raises(StageError, match="unreadable: /m/bad.colibri"):
        choose_split({"a": [("/m/bad.colibri", None, "bad magic")]}, "/m", None)
