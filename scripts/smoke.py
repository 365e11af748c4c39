"""Smoke test of an installed colibri-moe, the same on every platform.

Runs what a new user would in the first minute: import, open the demo model,
greedy and seeded generation, logits, a run under a RAM budget (experts
streamed from the file), converting small Hugging Face checkpoints, and the
typed errors for a missing and a corrupt file. It checks what must hold on any
platform (streamed tokens equal resident ones, the errors' types) and writes a
JSON report of everything that must be the same bits on every platform of one
ISA: token ids, hashes of the logits and of the converted files.

    python scripts/smoke.py [--golden tests/fixtures/golden] [--out report.json]

CI runs it on Linux and under Wine with the Windows wheel and compares the two
reports byte for byte (`.ci/windows`); the release workflow runs it against
every wheel it builds. Exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

import colibri

HERE = Path(__file__).resolve().parent
# Converted by the smoke test: a routed-expert model to q8_0, and one shipped
# as MXFP4 (read and re-encoded at convert time).
CHECKPOINTS = {"qwen3_moe": "q8_0", "deepseek_v3": "q8_0", "gpt_oss_mxfp4": None}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def logits_digest(logits: np.ndarray) -> dict:
    """The logits' exact bits: a hash of all of them and the last row's first few in hex."""
    a = np.ascontiguousarray(logits, dtype="<f4")
    return {"sha256": sha256(a.tobytes()), "last_row_head": [float(x).hex() for x in a[-1, :6]]}


def check(ok: bool, what: str) -> None:
    if not ok:
        sys.exit(f"smoke: FAILED: {what}")


def demo_section() -> dict:
    engine = colibri.Engine.demo(threads=2)
    prompt = "Once upon a time, a small bird"
    ids = engine.tokenize(prompt)
    greedy = engine.generate(ids, max_new_tokens=24, temperature=0, ignore_eos=True)
    sampled = engine.generate(ids, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    again = engine.generate(ids, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    check(list(sampled) == list(again), "the same seed gave different tokens")
    text = engine.generate(prompt, max_new_tokens=16, temperature=0)
    check(isinstance(text, str) and len(text) > 0, "a text prompt gave no text")
    batch = engine.generate([ids, ids[:4]], max_new_tokens=8, temperature=0, ignore_eos=True)
    check(list(batch[0]) == list(greedy)[:8], "a batched greedy run differs from a solo one")

    # Under a RAM budget the routed experts are streamed from the file into a
    # bounded cache; placement may change speed, never a token.
    streaming = colibri.Engine(engine.path, threads=2, ram_budget=_small_budget(engine))
    streamed = streaming.generate(ids, max_new_tokens=24, temperature=0, ignore_eos=True)
    check(list(streamed) == list(greedy), "streamed experts changed the greedy tokens")
    stats = streaming.store_stats()
    check(stats.get("misses", 1) > 0, f"nothing was streamed under the budget: {stats}")
    return {
        "prompt_ids": list(ids),
        "logits": logits_digest(engine.logits(ids)),
        "greedy": list(greedy),
        "sampled": list(sampled),
        "text": str(text),
        "streamed_logits": logits_digest(streaming.logits(ids)),
    }


def _small_budget(engine: colibri.Engine) -> int:
    """A budget that holds the dense part and about a quarter of the experts."""
    plan = colibri.plan(engine.path)
    return int(plan["dense_bytes"] + plan["expert_bytes"] // 4)


def convert_section(golden: Path, work: Path) -> dict:
    out = {}
    for case, dtype in CHECKPOINTS.items():
        src = golden / case
        check(src.is_dir(), f"no checkpoint at {src}")
        dst = work / f"{case}.colibri"
        colibri.convert(src, dst, dtype=dtype, progress=False)
        engine = colibri.Engine(dst, threads=2)
        ids = list(range(1, 9))
        out[case] = {
            "dtype": engine.dtype,
            "file_sha256": sha256(dst.read_bytes()),
            "logits": logits_digest(engine.logits(ids)),
            "greedy": list(engine.generate(ids, max_new_tokens=8, temperature=0, ignore_eos=True)),
        }
    return out


def errors_section(work: Path) -> dict:
    found = {}
    try:
        colibri.Engine(work / "no-such-model.colibri")
    except colibri.ModelNotFoundError as e:
        found["missing"] = type(e).__name__
    check("missing" in found, "a missing file did not raise ModelNotFoundError")

    corrupt = work / "corrupt.colibri"
    good = (work / "qwen3_moe.colibri").read_bytes()
    corrupt.write_bytes(good[:64] + bytes(len(good) // 3))
    try:
        colibri.Engine(corrupt)
    except colibri.FormatError as e:
        found["corrupt"] = type(e).__name__
    check("corrupt" in found, "a corrupt file did not raise FormatError")

    try:
        colibri.Engine.demo().generate([10**6], max_new_tokens=1)
    except colibri.InvalidInputError as e:
        found["bad_token"] = type(e).__name__
    check("bad_token" in found, "an out-of-vocabulary id did not raise InvalidInputError")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--golden", type=Path, default=HERE.parent / "tests" / "fixtures" / "golden")
    ap.add_argument("--out", type=Path, help="write the report here (default: stdout)")
    args = ap.parse_args()

    report = {"version": colibri.__version__, "kernels": colibri.kernels()["active"], "demo": demo_section()}
    with tempfile.TemporaryDirectory() as d:
        report["convert"] = convert_section(args.golden, Path(d))
        report["errors"] = errors_section(Path(d))
    text = json.dumps(report, indent=1, sort_keys=True) + "\n"
    if args.out:
        args.out.write_text(text, encoding="utf-8", newline="\n")
    else:
        sys.stdout.write(text)
    threads = colibri.Engine.demo().threads  # the default: physical cores
    kernels = colibri.kernels()["active"]
    print(f"smoke: ok ({sys.platform}, {kernels} kernels, {threads} default threads)", file=sys.stderr)


if __name__ == "__main__":
    main()
