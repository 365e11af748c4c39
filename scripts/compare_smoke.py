"""Compares smoke reports (scripts/smoke.py) from several platforms.

    python scripts/compare_smoke.py REPORT.json REPORT.json [...]

Reports from the same kernel table must be identical byte for byte (the
engine computes the same bits on every OS of one ISA); reports from
different tables must agree in everything but the logits' bits (tokens,
converted files, errors), since tables sum in different orders. Exits
non-zero naming the first difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BITS = ("logits", "streamed_logits", "kernels")


def without_bits(node: object) -> object:
    if isinstance(node, dict):
        return {k: without_bits(v) for k, v in node.items() if k not in BITS}
    return node


def first_difference(a: object, b: object, where: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{where}.{k}")
    return f"{where or 'report'}: {a!r:.120} != {b!r:.120}"


def main(paths: list[str]) -> int:
    if len(paths) < 2:
        sys.exit("give two or more reports")
    reports = [(p, Path(p).read_bytes()) for p in paths]
    base_path, base_raw = reports[0]
    base = json.loads(base_raw)
    bad = 0
    for path, raw in reports[1:]:
        other = json.loads(raw)
        if other["kernels"] == base["kernels"]:
            ok, how = raw == base_raw, "byte for byte"
            diff = "" if ok else first_difference(base, other)
        else:
            ok, how = without_bits(base) == without_bits(other), "in tokens, files and errors"
            diff = "" if ok else first_difference(without_bits(base), without_bits(other))
        label = f"{path} ({other['kernels']}) vs {base_path} ({base['kernels']})"
        print(f"{'same' if ok else 'DIFFERENT'} {how}: {label}" + (f"\n  {diff}" if diff else ""))
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
