#!/usr/bin/env python3
"""Where colibri's time goes: a `perf` profile of one decode or prefill, by part of the model.

The model is opened and warmed first; `perf record` (DWARF call graphs, so the
part a kernel works for is known from its callers) attaches only for the timed
generation. Each sample is charged to the innermost frame that names a part:

    python benches/perf_profile.py benches/.cache/qwen3_6-l4/colibri/model-q8_0.colibri decode 64
    python benches/perf_profile.py MODEL.colibri prefill 512 --freq 499

Needs Linux `perf` with permission to attach to a child process.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (part, substrings of a sample's whole call stack), tried in order; the first hit wins.
# Rayon frames carry the closure they run in their type parameters, so work a
# second thread took over is still named by the block that split it; a
# matrix product split by `matmul_many_in` names no block when it was taken
# over, and is counted apart (its other half, on the calling thread, is
# counted where it belongs).
PARTS = [
    ("delta rule (recurrence)", ("Delta::rule", "rule (inlined)", "delta_fn", "delta_step")),
    ("short convolution", ("Delta::conv", "conv (inlined)")),
    ("output head", ("lm_head",)),
    ("attention scores (q·k, softmax, ·v)", ("attend", "kv::")),
    ("router", ("router_logits", "route_rows")),
    ("routed experts", ("moe_forward", "run_experts")),
    ("shared expert", ("gated_mlp",)),
    # Delta::project is inlined under a name gqa's projection shares, so the
    # linear layers' projections count here with their gated norm and out_proj.
    ("linear-attention projections, gated norm, out_proj", ("linear_attention",)),
    ("attention projections, rope, o_proj", ("forward::attention", "attention (inlined)", "gqa")),
    ("norms, embedding, residual", ("forward::norm", "norm (inlined)", "embed", "residual")),
    ("a split matrix product taken over by the other thread", ("matmul_many_in", "kernels::")),
]

WORK = r"""
import os, sys, time
import numpy as np
import colibri
path, mode, n, ready, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
e = colibri.Engine(path, threads=int(sys.argv[6]))
rng = np.random.default_rng(2)
ids = [int(x) for x in rng.integers(1000, e.vocab_size, 8)]
e.generate(ids, max_new_tokens=2, ignore_eos=True)
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.02)
if mode == "decode":
    out = e.generate(ids, max_new_tokens=n, ignore_eos=True)
    print(f"decode {out.timings.decode_tokens_per_second:.2f} tok/s")
else:
    p = [int(x) for x in rng.integers(1000, e.vocab_size, n)]
    out = e.generate(p, max_new_tokens=1, ignore_eos=True)
    print(f"prefill {out.timings.prefill_tokens_per_second:.1f} tok/s")
"""


def part_of(stack: list[str]) -> str:
    text = "\n".join(stack)
    for part, keys in PARTS:
        if any(k in text for k in keys):
            return part
    return "other"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("mode", choices=["decode", "prefill"])
    ap.add_argument("n", type=int, help="tokens to decode, or the prompt length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--freq", type=int, default=999, help="samples per second per thread")
    ap.add_argument("--top", type=int, default=12, help="also list this many hottest leaf symbols")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ready, go, data = f"{tmp}/ready", f"{tmp}/go", f"{tmp}/perf.data"
        cmd = [
            sys.executable,
            "-c",
            WORK,
            str(args.model),
            args.mode,
            str(args.n),
            ready,
            go,
            str(args.threads),
        ]
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        while not os.path.exists(ready):
            if child.poll() is not None:
                raise SystemExit("the engine process ended before it was ready")
            time.sleep(0.05)
        perf = subprocess.Popen(
            [
                "perf",
                "record",
                "-F",
                str(args.freq),
                "--call-graph",
                "dwarf,16384",
                "-p",
                str(child.pid),
                "-o",
                data,
            ],
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)
        Path(go).touch()
        speed = child.communicate()[0].strip()
        perf.send_signal(2)
        perf.wait()
        script = subprocess.run(
            ["perf", "script", "-i", data, "-F", "comm,ip,sym"], capture_output=True, text=True
        ).stdout
    parts: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for block in script.split("\n\n"):
        lines = [ln.strip() for ln in block.strip().splitlines()]
        if len(lines) < 2:
            continue
        stack = [ln.split(" ", 1)[1] if " " in ln else ln for ln in lines[1:]]
        parts[part_of(stack)] += 1
        # The leaf's real function: the first frame perf did not mark as inlined into it.
        leaf = next((f for f in stack if not f.endswith("(inlined)")), stack[0])
        leaves[leaf] += 1
    total = sum(parts.values()) or 1
    print(f"{args.model.name} {args.mode} {args.n}: {speed}; {total} samples")
    for part, k in parts.most_common():
        print(f"  {100 * k / total:5.1f}%  {part}")
    print("hottest leaf symbols:")
    for sym, k in leaves.most_common(args.top):
        print(f"  {100 * k / total:5.1f}%  {sym[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
