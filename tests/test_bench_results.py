"""docs/benchmarks.md shows what benches/results/*.json hold: the tables are rendered from the
files by benches/render_results.py, and this test fails when either changes without the other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benches" / "render_results.py"
DOC = ROOT / "docs" / "benchmarks.md"


def check(doc: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--doc", str(doc)], capture_output=True, text=True
    )


def test_doc_matches_the_results_files() -> None:
    r = check(DOC)
    assert r.returncode == 0, r.stderr


def test_a_changed_figure_is_caught(tmp_path: Path) -> None:
    text = DOC.read_text()
    assert "857.5 / 257.7" in text
    stale = tmp_path / "benchmarks.md"
    stale.write_text(text.replace("857.5 / 257.7", "858.5 / 257.7", 1))
    r = check(stale)
    assert r.returncode == 1
    assert "xeon-2026-12-01-bench.json" in r.stderr


def test_every_results_file_says_where_when_and_what() -> None:
    files = sorted((ROOT / "benches" / "results").glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        for key in ("machine", "date", "commit", "commands", "rows"):
            assert data.get(key), f"{path.name}: no {key}"
        assert data["machine"].get("cpu"), path.name
