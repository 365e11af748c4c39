"""The README's promises: the architecture table matches what the code and the parity tests cover."""

from __future__ import annotations

import json
import re
from pathlib import Path

import colibri
from conftest import CASES, GOLDEN

README = Path(__file__).parent.parent / "README.md"


def table_rows() -> list[tuple[str, list[str]]]:
    text = README.read_text()
    block = text.split("<!-- architectures:start -->")[1].split("<!-- architectures:end -->")[0]
    rows = []
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((cells[0].strip("`"), re.findall(r"`([^`]+)`", cells[2])))
    return rows


def test_architecture_table_matches_the_registry_and_the_fixtures():
    rows = table_rows()
    assert sorted(name for name, _ in rows) == sorted(colibri.supported_architectures())
    for name, fixtures in rows:
        assert fixtures, f"{name} has no parity fixture in the README"
        for case in fixtures:
            assert case in CASES, f"README names fixture {case} which does not exist"
            arch = json.loads((GOLDEN / case / "config.json").read_text())["architectures"][0]
            assert arch == name, f"fixture {case} is {arch}, not {name}"
    listed = {c for _, fx in rows for c in fx}
    assert listed == set(CASES), f"fixtures missing from the README: {set(CASES) - listed}"


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    cmd = "pip install -e '.[test]' && pytest -q"
    assert cmd in README.read_text() and cmd in ci
