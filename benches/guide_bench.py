"""Aggregate decode speed with every sequence constrained by a JSON Schema
against none (issue 42's target: at most 5% slower).

Eight generations run at once on one engine (``max_batch=8``), each of
``--tokens`` new tokens; the figure is generated tokens over the wall time of
the batch, its prompts' prefill included (short prompts; the same in every
mode). Modes, each in a fresh process (the mask worker's switch is read once
per process):

- ``free``: no constraint;
- ``json``: a JSON Schema on every sequence, masks computed inline, on the
  scheduler's thread after the pass (the default);
- ``json-overlap``: the same with ``COLIBRI_GUIDE_OVERLAP=1`` (masks computed
  on a worker thread per sequence while the forward pass runs).

The schema lets the output run as long as asked (a string of any length
inside an object), so every mode generates the same number of tokens. The
modes run interleaved ``--rounds`` times and the medians are reported, since
a shared machine is noisy.

    python benches/guide_bench.py [--model FILE] [--rounds 5] [--tokens 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
    "required": ["title", "story"],
}
PROMPTS = [
    "Once upon a time",
    "The weather today",
    "My dear sister",
    "It was late",
    "The carriage",
    "Her brother said",
    "At the ball",
    "A letter came",
]


def worker(model: str | None, mode: str, tokens: int, threads: int | None) -> dict[str, float]:
    import colibri

    engine = (
        colibri.Engine(model, threads=threads, max_batch=8)
        if model
        else colibri.Engine.demo(threads=threads, max_batch=8)
    )
    opts: dict[str, object] = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}
    if mode != "free":
        opts["json_schema"] = SCHEMA
    # Warm up: the vocabulary index (first constrained request) and the pages.
    engine.generate(PROMPTS[0], **{**opts, "max_new_tokens": 8})
    out: list[int] = [0] * len(PROMPTS)

    def run(i: int) -> None:
        out[i] = len(engine.generate(PROMPTS[i], **opts).token_ids)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    return {"tokens": sum(out), "seconds": wall, "tokens_per_second": sum(out) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .colibri file (default: the demo model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.tokens, args.threads)))
        return
    modes = ["free", "json", "json-overlap"]
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            env = dict(os.environ, COLIBRI_GUIDE_OVERLAP="1" if m == "json-overlap" else "0")
            cmd = [sys.executable, __file__, "--worker", m, "--tokens", str(args.tokens)]
            if args.model:
                cmd += ["--model", args.model]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            runs[m].append(res["tokens_per_second"])
            print(
                f"round {r + 1} {m:12s} {res['tokens_per_second']:8.1f} tok/s ({res['tokens']} tokens)",
                flush=True,
            )
    free = statistics.median(runs["free"])
    print()
    for m in modes:
        med = statistics.median(runs[m])
        print(f"{m:12s} median {med:8.1f} tok/s  {100 * (med / free - 1):+6.1f}% vs free  runs {runs[m]}")


if __name__ == "__main__":
    main()
