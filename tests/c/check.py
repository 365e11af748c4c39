"""Builds tests/c/capi_check.c against the C library and compares what it
prints with the Python API on the demo model: logits bit for bit, greedy,
seeded, streamed and stop-id-stopped tokens and the end-of-sequence ids exactly;
then the same on a linear-attention hybrid (the kimi_linear fixture).

    python tests/c/check.py LIBDIR    (LIBDIR holds libcolibri.so: target/debug)

Run by .ci/run after `cargo build --lib`. Prints "N passed, 0 failed" or
exits non-zero naming what differed.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import colibri

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def main() -> int:
    libdir = Path(sys.argv[1]).resolve()
    engine = colibri.Engine.demo(threads=2)
    failed = check(libdir, engine, engine.tokenize("Once upon a time, a small bird"))
    # A hybrid of linear and latent attention (Kimi-Linear's fixture): the
    # recurrent state kind behind the same C calls.
    with tempfile.TemporaryDirectory() as d:
        hybrid = Path(d) / "kimi_linear.colibri"
        colibri.convert(ROOT / "tests" / "fixtures" / "golden" / "kimi_linear", hybrid, progress=False)
        failed += check(libdir, colibri.Engine(hybrid, threads=2), [(7 * i + 3) % 120 for i in range(19)])
    return 1 if failed else 0


def check(libdir: Path, engine: colibri.Engine, ids: list[int]) -> int:
    """Runs the C program on `engine`'s model; the number of checks that failed."""
    name = Path(engine.path).name
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "capi_check"
        subprocess.run(
            [
                "gcc",
                "-std=c11",
                "-O1",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-pthread",
                f"-I{ROOT / 'include'}",
                str(HERE / "capi_check.c"),
                f"-L{libdir}",
                "-lcolibri",
                f"-Wl,-rpath,{libdir}",
                "-o",
                str(exe),
            ],
            check=True,
        )
        corrupt = Path(d) / "corrupt.colibri"
        good = Path(engine.path).read_bytes()
        corrupt.write_bytes(good[:100] + bytes(4096))
        run = subprocess.run(
            [str(exe), engine.path, str(corrupt), *map(str, ids)], capture_output=True, text=True
        )
    sys.stderr.write(run.stderr)
    if run.returncode != 0:
        print(f"capi: the C program failed on {name} (exit {run.returncode})")
        return 1
    lines = run.stdout.splitlines()
    t, v = map(int, lines[0].split()[1:])
    c_logits = np.array([float.fromhex(x) for x in lines[1 : 1 + t * v]], dtype=np.float32).reshape(t, v)
    got = {line.split()[0]: [int(x) for x in line.split()[1:]] for line in lines[1 + t * v :]}

    plain = dict(
        top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0
    )
    want = {
        "greedy": list(engine.generate(ids, max_new_tokens=24, temperature=0, ignore_eos=True)),
        "sampled": list(
            engine.generate(
                ids,
                max_new_tokens=24,
                temperature=0.8,
                **{**plain, "top_p": 0.95},
                seed=1234,
                ignore_eos=True,
            )
        ),
        "eos": engine.eos_token_ids,
        "default": list(engine.generate(ids, max_new_tokens=48, temperature=0, **plain)),
    }
    want["stream"] = want["greedy"][:5]
    want["stopped"] = list(
        engine.generate(
            ids, max_new_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[want["greedy"][10]]
        )
    )
    if engine.has_tokenizer:
        want["regex"] = list(
            engine.generate(ids, max_new_tokens=12, temperature=0, **plain, regex="[0-9]{3}")
        )
    checks = [("logits", np.array_equal(c_logits.view(np.uint32), engine.logits(ids).view(np.uint32)))]
    checks += [(k, got.get(k) == w) for k, w in want.items()]
    failed = [k for k, ok in checks if not ok]
    for k in failed:
        print(f"capi: {name}: {k} differs: C {got.get(k)!r:.200}, Python {want.get(k)!r:.200}")
    print(f"{name}: {len(checks) - len(failed)} passed, {len(failed)} failed")
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
