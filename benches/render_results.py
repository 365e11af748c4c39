#!/usr/bin/env python3
"""Renders the tables of docs/benchmarks.md from the runs in benches/results/*.json.

Each results file is one run (or one set of runs of the same build on one
machine): where it ran (``machine``), when (``date``), what was measured
(``commit``), how (``method``, ``commands``, ``peer``) and the numbers
(``rows``). Its ``columns`` say how a table cell is written from a row, and
its ``views`` which columns (and which rows) a table shows, so the doc can
show one run's decode and prefill figures as two tables.

In the doc a table is a block between two markers::

    <!-- render: xeon-2026-12-01-bench.json decode -->
    (generated: a caption with machine, date, commit, then the table)
    <!-- /render -->

README.md's speed table is rendered the same way (its links start at the
repository root). ``python benches/render_results.py`` rewrites every block of
both docs from its file;
``--check`` changes nothing and fails when a block differs from what its
file renders, when a file is malformed, or when a file is rendered nowhere
(tests/test_bench_results.py runs it, so the doc and the files cannot drift).

A cell is a template of ``{path}`` or ``{path:spec}`` fields, ``path`` a
dotted key into the row. ``spec`` is ``x`` (a ratio: ``1.51x``), ``pct``
(a fraction: ``71%``) or any Python format spec. A field whose key the row
lacks is written ``–``; a cell whose fields are all missing is left empty.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "benchmarks.md"
# The README's speed table is rendered from the same files; links there start at the repository root.
README = HERE.parent / "README.md"

BLOCK = re.compile(r"<!-- render: (\S+) (\S+) -->\n(.*?)<!-- /render -->", re.S)
FIELD = re.compile(r"\{([A-Za-z0-9_.]+)(?::([^}]*))?\}")
REQUIRED = ("title", "axis", "machine", "date", "commit", "method", "commands", "columns", "views", "rows")
MISSING = object()


def lookup(row: dict[str, Any], path: str) -> Any:
    """The value at a dotted key of a row, or MISSING."""
    value: Any = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return MISSING
        value = value[key]
    return value


def fmt(value: Any, spec: str | None) -> str:
    if spec == "x":
        return f"{value:.2f}x"
    if spec == "pct":
        return f"{value * 100:.0f}%"
    if spec:
        return format(value, spec)
    return str(value)


def cell(template: str, row: dict[str, Any]) -> str:
    found = 0

    def one(m: re.Match[str]) -> str:
        nonlocal found
        value = lookup(row, m.group(1))
        if value is MISSING or value is None:
            return "–"
        found += 1
        return fmt(value, m.group(2))

    text = FIELD.sub(one, template)
    return text if found else ""


def validate(data: dict[str, Any], where: str) -> None:
    """Raises ValueError when a results dict lacks what a caption or a table needs."""
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{where}: missing keys {', '.join(missing)}")
    if "cpu" not in data["machine"]:
        raise ValueError(f"{where}: machine has no 'cpu'")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]):
        raise ValueError(f"{where}: date {data['date']!r} is not YYYY-MM-DD")


def load(name: str) -> dict[str, Any]:
    path = RESULTS / name
    data: dict[str, Any] = json.loads(path.read_text())
    validate(data, str(path))
    return data


def render(name: str, view_name: str, link: str = "../benches/results/") -> str:
    """The markdown one block shows: a caption, a blank line, the table."""
    return render_data(name, load(name), view_name, link)


def link_base(doc: Path) -> str:
    """How a doc links to the results files: from docs/, or from the repository root (README.md)."""
    return "benches/results/" if doc.name == "README.md" else "../benches/results/"


def render_data(name: str, data: dict[str, Any], view_name: str, link: str = "../benches/results/") -> str:
    """The markdown of one view of a results dict that is (or will be) the file `name`."""
    if view_name not in data["views"]:
        raise ValueError(f"{name}: no view {view_name!r} (has {', '.join(data['views'])})")
    view = data["views"][view_name]
    columns = [data["columns"][c] for c in view["columns"]]
    where: dict[str, list[Any]] = view.get("where", {})
    rows = [r for r in data["rows"] if all(lookup(r, k) in allowed for k, allowed in where.items())]
    if not rows:
        raise ValueError(f"{name}: view {view_name!r} selects no rows")
    lines = [
        f"*{data['title']}.* Machine: {data['machine']['cpu']}. Date: {data['date']}. "
        f"Commit: {data['commit']}. Data and method: [{name}]({link}{name}).",
        "",
        "| " + " | ".join(c["label"] for c in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for r in rows:
        lines.append("| " + " | ".join(cell(c["cell"], r) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def rendered(doc: str, link: str = "../benches/results/") -> tuple[str, set[str]]:
    """The doc with every block re-rendered, and the files it renders."""
    used: set[str] = set()

    def one(m: re.Match[str]) -> str:
        used.add(m.group(1))
        body = render(m.group(1), m.group(2), link)
        return f"<!-- render: {m.group(1)} {m.group(2)} -->\n{body}<!-- /render -->"

    return BLOCK.sub(one, doc), used


def results_path(name: str) -> Path:
    """benches/results/NAME.json for a name given with or without its .json."""
    stem = name.removesuffix(".json")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", stem):
        raise ValueError(f"results name {name!r}: use letters, digits, '.', '_' and '-' only")
    return RESULTS / f"{stem}.json"


def refuse_overwrite(paths: list[Path], force: bool) -> None:
    """Stops before anything is written when a results file exists and --force was not given."""
    taken = [str(p) for p in paths if p.exists()]
    if taken and not force:
        raise SystemExit(
            f"{', '.join(taken)} already exist(s); choose another name or pass --force to replace"
        )


def write(files: dict[Path, dict[str, Any]], force: bool) -> None:
    """Writes results files after checking that each renders every one of its views,
    then prints the markers that show them in the doc."""
    for path, data in files.items():
        validate(data, path.name)
        for view in data["views"]:
            render_data(path.name, data, view)
    refuse_overwrite(list(files), force)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    print(
        f"\nTo show it, put these lines in {DOC.relative_to(DOC.parent.parent)} (in the section of its axis,"
    )
    print("in place of the block of the run it supersedes, whose file you then delete):\n")
    for path, data in files.items():
        for view in data["views"]:
            print(f"<!-- render: {path.name} {view} -->\n<!-- /render -->")
    print("\nthen run: python benches/render_results.py")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if a doc differs from the results files")
    ap.add_argument(
        "--doc",
        type=Path,
        action="append",
        help=f"a doc to render (repeatable; default {DOC.name} and {README.name})",
    )
    args = ap.parse_args(argv)
    docs: list[Path] = args.doc or [DOC, README]
    used: set[str] = set()
    updates: dict[Path, str] = {}
    for path in docs:
        doc = path.read_text()
        try:
            new, seen = rendered(doc, link_base(path))
        except (ValueError, KeyError, json.JSONDecodeError, OSError) as e:
            print(f"render_results: {path}: {e}", file=sys.stderr)
            return 1
        used |= seen
        if new != doc:
            if args.check:
                stale = [m.group(1) + " " + m.group(2) for m in BLOCK.finditer(doc) if m.group(0) not in new]
                print(f"render_results: {path} is out of date: {', '.join(stale)}", file=sys.stderr)
                print("run: python benches/render_results.py", file=sys.stderr)
                return 1
            updates[path] = new
    unused = sorted(p.name for p in RESULTS.glob("*.json") if p.name not in used)
    if unused:
        print(
            f"render_results: rendered nowhere in {', '.join(map(str, docs))}: {', '.join(unused)}",
            file=sys.stderr,
        )
        return 1
    for path, new in updates.items():
        path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
