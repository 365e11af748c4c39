#!/usr/bin/env python3
"""Bigger than RAM: colibri's expert store under a RAM budget.

Three measurements, each run in fresh subprocesses (one at a time):

1. **Random-weight model of real widths** (``benches/make_models.py``, OLMoE
   widths by default, ``--layers`` layers, ``--dtype`` weights): greedy decode
   after a short prompt at budgets of 100/50/25/10 % of the routed-expert
   bytes, for each cache policy and both I/O modes. Per run: decode tok/s,
   decode hit rate, bytes read from the file per decoded token, prefetch
   accuracy, I/O wait, and the worker's peak RSS (VmHWM) checked against
   budget + dense part + ``OVERHEAD_MB``. Random weights route almost
   uniformly, so this part says nothing about locality.
2. **Against llama.cpp under the same memory limit**: a memory cgroup (v1,
   a child of this process's own group) caps each worker at
   dense + fraction x experts + ``LIMIT_SLACK_MB``; llama.cpp runs the GGUF of
   the same model through its mmap (the kernel must evict and re-read its
   pages), colibri runs the .colibri file with ``ram_budget`` = fraction x
   experts. The file's pages are dropped from the page cache (fadvise
   DONTNEED) before each run, so every run starts cold.
3. **Routing locality on the trained demo model** (``demo.colibri``, 8 experts
   top-2, trained on Austen): heat learned on one half of held-out Austen
   text (teacher forced), then sampled continuations of prompts from the other
   half at budgets of a few experts per layer, LRU against a hot set pinned
   from the learned heat file, with and without prefetch.

The raw run goes to ``--json`` (``benches/.cache/store-run.json`` by default;
``--update`` merges the parts measured now into it). ``--results NAME`` also
writes each part the run holds as ``benches/results/NAME-budgets.json``,
``NAME-limit.json`` and ``NAME-demo.json``, the files the streaming tables of
docs/benchmarks.md are rendered from, and prints the
``<!-- render: NAME-PART.json streaming -->`` lines that show them; it refuses
to replace an existing file unless ``--force`` is given. ``--report RAW``
prints the tables of a saved raw run, and with ``--results`` writes its
results files.

Usage::

    python benches/store_bench.py                       # everything, results in benches/.cache/store-run.json
    python benches/store_bench.py --results epyc-2026-12-24-store
    python benches/store_bench.py --report benches/.cache/store-run.json --results epyc-2026-12-24-store
    python benches/store_bench.py --quick               # smoke test: fewer cells, 1 rep
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench as B  # noqa: E402
import make_models as mm  # noqa: E402
import render_results as R  # noqa: E402

MB = 1e6
MIB = 1 << 20

# What a streaming worker may hold on top of budget + dense part: the Python
# interpreter with NumPy and the extension (~40 MB), KV cache and workspace
# (a few MB at these lengths), mapped metadata pages, and the rare temporary
# overflow read (one slot). Asserted per run (PASS/FAIL in the tables).
OVERHEAD_MB = 128
# Room given to either engine above dense + fraction x experts in the cgroup
# comparison (interpreter, KV cache, compute buffers).
LIMIT_SLACK_MB = 384

POLICIES = {
    "no-cache": dict(lru=False, pin_hot=False, prefetch=False),
    "lru": dict(lru=True, pin_hot=False, prefetch=False),
    "lru+pin": dict(lru=True, pin_hot=True, prefetch=False),
    "lru+prefetch": dict(lru=True, pin_hot=False, prefetch=True),
    "lru+pin+prefetch": dict(lru=True, pin_hot=True, prefetch=True),
}

DELTA_KEYS = (
    "lookups",
    "hits",
    "misses",
    "tokens",
    "reads",
    "bytes_read",
    "read_seconds",
    "io_wait_seconds",
    "slot_wait_seconds",
    "slot_waits",
    "overflow_reads",
    "prefetch_predicted",
    "prefetch_predicted_used",
    "prefetch_reads",
    "prefetch_reads_used",
    "prefetch_reads_wasted",
    "prefetch_dropped",
    "read_errors",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- worker side


def proc_io_read_bytes() -> int:
    """Bytes this process (all threads) made the kernel fetch from storage."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in DELTA_KEYS}


def colibri_worker(spec: dict) -> dict:
    """One greedy (or seeded) decode in a fresh process, store figures split
    into prefill (prompt + first token) and decode (every later token)."""
    import colibri

    res: dict = {}
    t0 = time.perf_counter()
    eng = colibri.Engine(
        spec["path"],
        threads=spec["threads"],
        ram_budget=spec["budget"],
        io=spec["io"],
        heat_file=spec["heat"],
        **POLICIES[spec["policy"]],
    )
    res["open_s"] = time.perf_counter() - t0
    res["rss_after_open_mb"] = B.rss_mb()
    s_open = eng.store_stats()
    res["slots"], res["pinned"] = s_open.get("slots", 0), s_open.get("pinned", 0)
    res["warnings"] = s_open.get("warnings", [])
    prompts = spec["prompts"]
    dec = {k: 0 for k in DELTA_KEYS}
    pre = {k: 0 for k in DELTA_KEYS}
    res["tokens"], res["decode_s"], res["prefill_s"], res["decode_n"] = [], 0.0, 0.0, 0
    io0 = proc_io_read_bytes()
    io_dec = 0
    for ids in prompts:
        s0 = eng.store_stats()
        io_a = proc_io_read_bytes()
        t1 = time.perf_counter()
        it = iter(
            eng.stream(
                ids,
                max_new_tokens=spec["decode"] + 1,
                temperature=spec.get("temperature", 0.0),
                seed=spec.get("seed", 0),
                ignore_eos=True,
            )
        )
        toks = [int(next(it))]
        t2 = time.perf_counter()
        s1 = eng.store_stats()
        io_b = proc_io_read_bytes()
        toks += [int(t) for t in it]
        t3 = time.perf_counter()
        s2 = eng.store_stats()
        io_dec += proc_io_read_bytes() - io_b
        del io_a
        for k, v in delta(s0, s1).items():
            pre[k] += v
        for k, v in delta(s1, s2).items():
            dec[k] += v
        res["tokens"].append(toks)
        res["prefill_s"] += t2 - t1
        res["decode_s"] += t3 - t2
        res["decode_n"] += len(toks) - 1
    res["prefill"], res["decode"] = pre, dec
    res["disk_read_bytes"] = proc_io_read_bytes() - io0
    res["disk_read_decode_bytes"] = io_dec
    res["peak_rss_mb"] = B.peak_rss_mb()
    final = eng.store_stats()
    res["streaming"] = final.get("streaming", False)
    res["pin_per_layer"] = None
    if spec.get("routing"):
        res["routing"] = eng.routing_stats()
    if spec.get("teacher_text_ids"):
        # Teacher-forced passes over real text (heat learning); after the above.
        for chunk in spec["teacher_text_ids"]:
            eng.logits(chunk)
        res["routing_teacher"] = eng.routing_stats()
    return res


def llama_worker(spec: dict) -> dict:
    """llama.cpp (llama-cpp-python) greedy decode of the same token ids."""
    import numpy as np

    res: dict = {}
    t0 = time.perf_counter()
    llm = B.Llama(spec["path"], spec["threads"], n_ctx=spec.get("n_ctx", 256))
    res["open_s"] = time.perf_counter() - t0
    io0 = proc_io_read_bytes()
    res["tokens"], res["decode_s"], res["prefill_s"], res["decode_n"] = [], 0.0, 0.0, 0
    io_dec = 0
    for ids in spec["prompts"]:
        t1 = time.perf_counter()
        tok = llm.first_token(ids)
        t2 = time.perf_counter()
        io_b = proc_io_read_bytes()
        toks = [tok]
        for _ in range(spec["decode"]):
            llm.llm.eval([tok])
            tok = llm._last_argmax()
            toks.append(tok)
        t3 = time.perf_counter()
        io_dec += proc_io_read_bytes() - io_b
        res["tokens"].append([int(t) for t in toks])
        res["prefill_s"] += t2 - t1
        res["decode_s"] += t3 - t2
        res["decode_n"] += len(toks) - 1
    res["disk_read_bytes"] = proc_io_read_bytes() - io0
    res["disk_read_decode_bytes"] = io_dec
    res["peak_rss_mb"] = B.peak_rss_mb()
    del np
    return res


def baseline_worker(spec: dict) -> dict:
    """What the interpreter with NumPy and colibri imported holds, no model."""
    import numpy as np  # noqa: F401

    import colibri  # noqa: F401

    return {"peak_rss_mb": B.peak_rss_mb()}


WORKERS = {"colibri": colibri_worker, "llama": llama_worker, "baseline": baseline_worker}


# ---------------------------------------------------------------- parent side


class Cgroup:
    """A child of this process's own v1 memory cgroup with a hard limit."""

    def __init__(self, name: str):
        rel = ""
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrl, path = line.split(":", 2)
            if "memory" in ctrl.split(","):
                rel = path
        base = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
        if not (base / "memory.limit_in_bytes").exists():
            raise RuntimeError(f"no v1 memory cgroup at {base}")
        self.path = base / name
        self.path.mkdir(exist_ok=True)

    def limit(self, nbytes: int) -> None:
        (self.path / "memory.limit_in_bytes").write_text(str(int(nbytes)))

    def enter(self) -> None:  # runs in the child, before exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def stat(self) -> dict:
        out = {}
        for line in (self.path / "memory.stat").read_text().splitlines():
            k, v = line.split()
            out[k] = int(v)
        out["max_usage_in_bytes"] = int((self.path / "memory.max_usage_in_bytes").read_text())
        out["failcnt"] = int((self.path / "memory.failcnt").read_text())
        return out

    def reset_peak(self) -> None:
        # Uncharge what earlier runs left (their page cache), so each run
        # starts with an empty group and its peak is its own.
        with contextlib.suppress(OSError):
            (self.path / "memory.force_empty").write_text("0")
        for f in ("memory.max_usage_in_bytes", "memory.failcnt"):
            with contextlib.suppress(OSError):
                (self.path / f).write_text("0")

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def drop_cache(path: Path) -> None:
    """Evicts `path`'s clean pages from the page cache (a cold start)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_worker(
    spec: dict, python: str = sys.executable, cgroup: Cgroup | None = None, timeout: float = 1800
) -> dict:
    p = subprocess.run(
        [python, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=cgroup.enter if cgroup else None,
    )
    if p.returncode != 0:
        raise RuntimeError(f"worker failed (rc {p.returncode}) {spec.get('kind')}:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["stderr_tail"] = p.stderr[-500:]
    return out


def colibri_plan(path: Path, budget: int | None = None) -> dict:
    code = (
        "import sys, json, colibri; "
        "print(json.dumps(colibri.plan(sys.argv[1], None if sys.argv[2] == '-' else int(sys.argv[2]))))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(path), "-" if budget is None else str(budget)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(p.stdout)


def summarise(runs: list[dict]) -> dict:
    """Medians over repetitions of one cell."""

    def m(f):
        vals = [f(r) for r in runs]
        vals = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
        return statistics.median(vals) if vals else float("nan")

    def ratio(a, b):
        return a / b if b else float("nan")

    return {
        "n": len(runs),
        "decode_tps": m(lambda r: r["decode_n"] / r["decode_s"]),
        "prefill_s": m(lambda r: r["prefill_s"]),
        "open_s": m(lambda r: r["open_s"]),
        "hit_rate": m(
            lambda r: ratio(r["decode"]["hits"], r["decode"]["lookups"]) if "decode" in r else None
        ),
        "mb_per_token": m(
            lambda r: r["decode"]["bytes_read"] / r["decode_n"] / MB if "decode" in r else None
        ),
        "disk_mb_per_token": m(lambda r: r["disk_read_decode_bytes"] / r["decode_n"] / MB),
        "prefetch_acc": m(
            lambda r: (
                ratio(r["decode"]["prefetch_predicted_used"], r["decode"]["prefetch_predicted"])
                if "decode" in r and r["decode"]["prefetch_predicted"]
                else None
            )
        ),
        "prefetch_wasted": m(
            lambda r: r["decode"]["prefetch_reads_wasted"] / r["decode_n"] if "decode" in r else None
        ),
        "io_wait_ms_per_token": m(
            lambda r: 1e3 * r["decode"]["io_wait_seconds"] / r["decode_n"] if "decode" in r else None
        ),
        "read_ms_per_token": m(
            lambda r: 1e3 * r["decode"]["read_seconds"] / r["decode_n"] if "decode" in r else None
        ),
        "overflow_reads": m(
            lambda r: (
                r["decode"]["overflow_reads"] + r["prefill"]["overflow_reads"] if "decode" in r else None
            )
        ),
        "peak_rss_mb": m(lambda r: r["peak_rss_mb"]),
        "max_peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "slots": runs[0].get("slots"),
        "pinned": runs[0].get("pinned"),
        "cg_peak_mb": m(lambda r: r.get("cg", {}).get("max_usage_in_bytes", float("nan")) / MB),
        "cg_failcnt": m(lambda r: r.get("cg", {}).get("failcnt")),
    }


# ---------------------------------------------------------------- part 1: random model


def model_files(args) -> tuple[Path, Path]:
    shape = mm.SHAPES[args.shape]
    gg = {"q8_0": "Q8_0", "q4_0": "Q4_0", "f16": "F16"}[args.dtype]
    B.ensure_models(shape, args.layers, [gg] if args.llama else [], log)
    cpath = B.colibri_file(shape, args.layers, args.dtype, log)
    return cpath, mm.gguf_path(shape, args.layers, gg)


def part_random(args, res: dict) -> None:
    cpath, _ = model_files(args)
    shape = mm.SHAPES[args.shape]
    plan = colibri_plan(cpath)
    res["plan"] = plan
    expert = plan["expert_bytes"]
    dense = plan["dense_bytes"]
    # What `colibri plan` expects at each budget (uniform routing), next to what happens.
    res["plans"] = {str(fr): colibri_plan(cpath, int(expert * fr / 100)) for fr in args.budgets if fr < 100}
    log(
        f"{cpath.name}: file {plan['file_bytes'] / MB:.0f} MB, dense {dense / MB:.0f} MB, experts "
        f"{expert / MB:.0f} MB"
    )
    prompt = B.prompt_ids(args.prompt, shape.vocab, 2)
    # Buffered runs read from a warm page cache (the file fits in RAM here).
    with open(cpath, "rb") as fh:
        while fh.read(64 << 20):
            pass
    res["baseline"] = run_worker({"kind": "baseline"})
    log(f"baseline (python + numpy + colibri, no model): {res['baseline']['peak_rss_mb']:.0f} MB")

    heat_dir = Path(tempfile.mkdtemp(prefix="store-heat-"))
    master = heat_dir / "learned.heat"
    # The heat that `pin` uses: a previous run on another prompt (seed 7).
    log("learning heat for the pinned runs (10% budget, another prompt)")
    learn = run_worker(
        {
            "kind": "colibri",
            "path": str(cpath),
            "threads": args.threads,
            "budget": int(expert * 0.10),
            "io": "buffered",
            "heat": str(master),
            "policy": "lru",
            "prompts": [B.prompt_ids(args.prompt, shape.vocab, 7)],
            "decode": 2 * args.decode,
        }
    )
    res["heat_learn"] = {"peak_rss_mb": learn["peak_rss_mb"], "exists": master.exists()}

    cells = []
    for frac in args.budgets:
        if frac >= 100:
            cells.append((frac, "resident", "mmap"))
            continue
        for pol in args.policies:
            for io in args.io:
                cells.append((frac, pol, io))
    runs: dict[str, list] = {}
    ref_tokens = None
    for rep in range(args.reps):
        for frac, pol, io in cells:
            key = f"{frac}|{pol}|{io}"
            budget = None if frac >= 100 else int(expert * frac / 100)
            heat = "off"
            if POLICIES.get(pol, {}).get("pin_hot"):
                heat = str(heat_dir / f"run-{rep}.heat")
                shutil.copyfile(master, heat)
            spec = {
                "kind": "colibri",
                "path": str(cpath),
                "threads": args.threads,
                "budget": budget,
                "io": "buffered" if io == "mmap" else io,
                "heat": heat,
                "policy": "lru" if pol == "resident" else pol,
                "prompts": [prompt],
                "decode": args.decode,
            }
            r = run_worker(spec)
            r["budget"] = budget
            r["load"] = B.loadavg()
            # VmHWM is in KiB, so peak_rss_mb is MiB here, as is the bound.
            allowed = (plan["file_bytes"] if budget is None else budget + dense) / MIB + OVERHEAD_MB
            r["rss_limit_mb"] = allowed
            r["rss_ok"] = r["peak_rss_mb"] <= allowed
            if ref_tokens is None:
                ref_tokens = r["tokens"]
            r["same_tokens"] = r["tokens"] == ref_tokens
            runs.setdefault(key, []).append(r)
            d = r.get("decode", {})
            log(
                f"rep {rep} {frac}% {pol:17s} {io:8s} {r['decode_n'] / r['decode_s']:6.2f} tok/s "
                f"hit {d.get('hits', 0) / max(1, d.get('lookups', 0)):.3f} "
                f"{d.get('bytes_read', 0) / max(1, r['decode_n']) / MB:7.1f} MB/tok "
                f"rss {r['peak_rss_mb']:.0f} MB (<= {allowed:.0f} {'PASS' if r['rss_ok'] else 'FAIL'}) "
                f"tokens {'same' if r['same_tokens'] else 'DIFFERENT'}"
            )
            for k in ("tokens",):
                if rep > 0:
                    r.pop(k, None)
    shutil.rmtree(heat_dir, ignore_errors=True)
    res["cells"] = {k: {"summary": summarise(v), "runs": v} for k, v in runs.items()}
    res["all_same_tokens"] = all(r.get("same_tokens", True) for v in runs.values() for r in v)
    res["all_rss_ok"] = all(r["rss_ok"] for v in runs.values() for r in v)


# ---------------------------------------------------------------- part 2: llama.cpp under a memory limit


def part_limit(args, res: dict) -> None:
    cpath, gpath = model_files(args)
    shape = mm.SHAPES[args.shape]
    plan = res.get("plan") or colibri_plan(cpath)
    res["plan"] = plan
    expert, dense = plan["expert_bytes"], plan["dense_bytes"]
    prompt = B.prompt_ids(args.prompt, shape.vocab, 2)
    try:
        cg = Cgroup(f"store-bench-{os.getpid()}")
    except (OSError, RuntimeError) as e:
        res["limit_error"] = f"no memory cgroup: {e}"
        log(res["limit_error"])
        return
    version = "import importlib.metadata as m; print(m.version('llama-cpp-python'))"
    with contextlib.suppress(OSError):
        got = subprocess.run([args.llama_python, "-c", version], capture_output=True, text=True)
        res["llama_version"] = got.stdout.strip() or None
    runs: dict[str, list] = {}
    try:
        for rep in range(args.reps):
            for frac in args.limits:
                unlimited = frac >= 100
                limit = None if unlimited else int(dense + expert * frac / 100 + LIMIT_SLACK_MB * MIB)
                for eng in ("llama", *(f"colibri-{io}" for io in args.limit_io)):
                    if eng.startswith("colibri"):
                        spec = {
                            "kind": "colibri",
                            "path": str(cpath),
                            "threads": args.threads,
                            "budget": None if unlimited else int(expert * frac / 100),
                            "io": eng.split("-", 1)[1],
                            "heat": "off",
                            "policy": args.limit_policy,
                            "prompts": [prompt],
                            "decode": args.limit_decode,
                        }
                        py = sys.executable
                    else:
                        spec = {
                            "kind": "llama",
                            "path": str(gpath),
                            "threads": args.threads,
                            "prompts": [prompt],
                            "decode": args.limit_decode,
                        }
                        py = args.llama_python
                    drop_cache(cpath)
                    drop_cache(gpath)
                    cg.reset_peak()
                    cg.limit(limit if limit else 1 << 62)
                    t0 = time.perf_counter()
                    try:
                        r = run_worker(spec, python=py, cgroup=cg, timeout=args.limit_timeout)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        r = {"error": str(e)[-600:]}
                    r["wall_s"] = time.perf_counter() - t0
                    r["cg"] = cg.stat()
                    r["limit"] = limit
                    r["load"] = B.loadavg()
                    runs.setdefault(f"{frac}|{eng}", []).append(r)
                    if "error" in r:
                        log(f"rep {rep} limit {frac}% {eng}: FAILED {r['error'][-200:]}")
                        continue
                    log(
                        f"rep {rep} limit {frac}% ({(limit or 0) / MB:.0f} MB) {eng:8s} "
                        f"{r['decode_n'] / r['decode_s']:6.2f} tok/s, disk "
                        f"{r['disk_read_decode_bytes'] / r['decode_n'] / MB:7.1f} MB/tok, "
                        f"prefill {r['prefill_s']:.1f}s, rss {r['peak_rss_mb']:.0f} MB, cgroup peak "
                        f"{r['cg']['max_usage_in_bytes'] / MB:.0f} MB"
                    )
    finally:
        cg.remove()
    res["limit_cells"] = {}
    for k, v in runs.items():
        ok = [r for r in v if "error" not in r]
        res["limit_cells"][k] = {
            "summary": summarise(ok) if ok else None,
            "errors": [r["error"] for r in v if "error" in r],
            "limit": v[0]["limit"],
            "runs": v,
        }
    # Same model, same ids: how many greedy tokens agree before the first difference?
    agree = {}
    for frac in args.limits:
        a = [r for r in runs.get(f"{frac}|llama", []) if "tokens" in r]
        b = [r for k, v in runs.items() if k.startswith(f"{frac}|colibri") for r in v if "tokens" in r]
        if a and b:
            ta, tb = a[0]["tokens"][0], b[0]["tokens"][0]
            n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            agree[str(frac)] = [n, len(ta)]
    res["limit_token_agreement"] = agree
    # Within one engine, does the limit (or the I/O mode) change any token?
    by_engine: dict[str, set] = {}
    for k, v in runs.items():
        eng = k.split("|")[1].split("-")[0]
        by_engine.setdefault(eng, set()).update(tuple(r["tokens"][0]) for r in v if "tokens" in r)
    res["limit_tokens_consistent"] = {e: len(t) == 1 for e, t in by_engine.items()}


# ---------------------------------------------------------------- part 3: trained demo model


def austen_text(args) -> str:
    for p in [
        args.text,
        ROOT / ".cache/demo/corpus/valid.txt",
        Path("/work/main/.cache/demo/corpus/valid.txt"),
    ]:
        if p and Path(p).is_file():
            return Path(p).read_text(encoding="utf-8")
    raise SystemExit(
        "no Austen text: pass --text FILE, or run `python scripts/demo/train_demo.py corpus` first"
    )


def part_demo(args, res: dict) -> None:
    import colibri

    demo = Path(colibri.__file__).resolve().parent / "data" / "demo.colibri"
    plan = colibri_plan(demo)
    res["demo_plan"] = plan
    text = austen_text(args)
    paras = [p.strip() for p in text.split("\n") if len(p.strip()) > 200]
    half = len(paras) // 2
    learn_paras, test_paras = paras[:half], paras[half:]
    code = (
        "import sys, json, colibri; e = colibri.Engine(sys.argv[1]); "
        "print(json.dumps([e.tokenize(t) for t in json.loads(sys.stdin.read())]))"
    )
    tok = subprocess.run(
        [sys.executable, "-c", code, str(demo)],
        input=json.dumps(learn_paras + test_paras),
        capture_output=True,
        text=True,
        check=True,
    )
    ids = json.loads(tok.stdout)
    learn_ids, test_ids = ids[:half], ids[half:]
    # Teacher-forced heat: 256-token windows of the learning half.
    flat = [t for p in learn_ids for t in p]
    windows = [flat[i : i + 256] for i in range(0, min(len(flat), args.demo_learn_tokens), 256)]
    windows = [w for w in windows if len(w) >= 16]
    prompts = [p[: args.demo_prompt] for p in test_ids if len(p) >= args.demo_prompt][: args.demo_prompts]
    slot = plan["slot_bytes"]
    layers = plan["moe_layers"]
    res["demo_text"] = {
        "paragraphs": len(paras),
        "learn_tokens": sum(len(w) for w in windows),
        "test_prompts": len(prompts),
        "prompt_tokens": args.demo_prompt,
        "decode_tokens": args.demo_decode,
    }
    heat_dir = Path(tempfile.mkdtemp(prefix="store-demo-"))
    master = heat_dir / "learned.heat"
    log(
        f"demo: learning heat on {res['demo_text']['learn_tokens']} tokens of held-out Austen (teacher "
        "forced)"
    )
    learn = run_worker(
        {
            "kind": "colibri",
            "path": str(demo),
            "threads": args.threads,
            "budget": 3 * layers * slot,
            "io": "buffered",
            "heat": str(master),
            "policy": "lru",
            "prompts": [],
            "decode": 0,
            "teacher_text_ids": windows,
        }
    )
    res["demo_learn_routing"] = learn["routing_teacher"]
    res["demo_heat_saved"] = master.exists()
    cells: dict[str, list] = {}
    for per_layer in args.demo_slots:
        for pol in args.policies:
            for rep in range(args.demo_reps):
                heat = "off"
                if POLICIES[pol]["pin_hot"]:
                    heat = str(heat_dir / f"{per_layer}-{pol}-{rep}.heat")
                    shutil.copyfile(master, heat)
                r = run_worker(
                    {
                        "kind": "colibri",
                        "path": str(demo),
                        "threads": args.threads,
                        "budget": per_layer * layers * slot,
                        "io": "buffered",
                        "heat": heat,
                        "policy": pol,
                        "prompts": prompts,
                        "decode": args.demo_decode,
                        "temperature": 0.8,
                        "seed": 1234,
                        "routing": True,
                    }
                )
                cells.setdefault(f"{per_layer}|{pol}", []).append(r)
            s = summarise(cells[f"{per_layer}|{pol}"])
            log(
                f"demo {per_layer} slots/layer {pol:17s} hit {s['hit_rate']:.3f} prefetch acc "
                f"{s['prefetch_acc']:.3f} pinned {s['pinned']}"
            )
    ref = None
    same = True
    for v in cells.values():
        for r in v:
            ref = ref or r["tokens"]
            same &= r["tokens"] == ref
    res["demo_same_tokens"] = same
    res["demo_gen_routing"] = next(iter(cells.values()))[0]["routing"]
    for v in cells.values():
        for r in v:
            r.pop("tokens", None)
            r.pop("routing", None)
    res["demo_cells"] = {k: {"summary": summarise(v), "runs": v} for k, v in cells.items()}
    # The hot set the heat file gives, per layer: an equal share of the pinned
    # capacity for each MoE layer, its hottest experts first (as the store does).
    heat = [lay["heat"] for lay in res["demo_learn_routing"]["layers"]]
    res["demo_pin_by_slots"] = {}
    for per_layer in args.demo_slots:
        slots = per_layer * layers
        cap = min(slots // 2, max(0, slots - (plan["top_k"] + 1)))
        share = cap // max(1, len(heat))
        res["demo_pin_by_slots"][str(per_layer)] = [min(share, sum(1 for h in hs if h > 0)) for hs in heat]
    shutil.rmtree(heat_dir, ignore_errors=True)


# ---------------------------------------------------------------- report


def f(x, nd=1, pct=False):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if pct:
        return f"{100 * x:.{nd}f}%"
    return f"{x:.{nd}f}"


def report(res: dict) -> str:
    out = []
    a = res.get("args", {})
    out.append(res.get("machine", "").replace(" - colibri", "\n- colibri"))
    when = []
    for name, what in (("random", "budgets"), ("limit", "memory limit"), ("demo", "demo model")):
        w = res.get(f"{name}_when")
        if w:
            when.append(
                f"{what}: {res.get('date', '')[:10]} {w['start']}-{w['end']}, load average "
                f"{w['load_before'].split()[0]} before, {w['load_after'].split()[0]} after"
            )
    if when:
        out.append("- when: " + "; ".join(when))
    out.append("")
    if res.get("disk"):
        out.append(f"Drive (O_DIRECT sequential read, 8 MiB blocks, 1 GiB): {res['disk']}.")
        out.append("")
    plan = res.get("plan")
    if plan:
        out.append(
            f"**Random-weight model**: `{a.get('shape')}` widths, {a.get('layers')} layers, {a.get('dtype')} "
            f"(`benches/.cache/{a.get('shape')}-l{a.get('layers')}/colibri/"
            f"model-{a.get('dtype')}.colibri`): file "
            f"{plan['file_bytes'] / MB:.0f} MB, dense part {plan['dense_bytes'] / MB:.0f} MB, routed experts "
            f"{plan['expert_bytes'] / MB:.0f} MB ({plan['moe_layers']} layers x "
            f"{plan['experts'] // max(1, plan['moe_layers'])} experts, "
            f"slot {plan['slot_bytes'] / MB:.2f} MB, top-{plan['top_k']}). Prompt {a.get('prompt')} random "
            "token ids, "
            f"then {a.get('decode')} greedy tokens; {a.get('threads')} threads; medians of {a.get('reps')} "
            "runs, each in a fresh process."
        )
        out.append("")
        if res.get("baseline"):
            out.append(
                f"Resident-memory check: peak RSS (VmHWM) <= budget + dense part + {OVERHEAD_MB} MiB "
                "overhead "
                "(the interpreter with NumPy and colibri imported and no model is "
                f"{res['baseline']['peak_rss_mb']:.0f} MB; "
                "the rest covers KV cache, workspace, mapped metadata and a rare overflow read); at 100% "
                "(resident, mmap) "
                "the bound is file size + overhead. All runs: "
                f"**{'PASS' if res.get('all_rss_ok') else 'FAIL'}**. "
                "Tokens identical to the first (100%) run in every run: "
                f"**{'yes' if res.get('all_same_tokens') else 'NO'}**."
            )
            out.append("")
        out.append(
            "| budget | policy | io | slots (pinned) | decode tok/s | hit rate | MB read / token | prefetch "
            "acc. | prefetch reads wasted / token | I/O wait ms / token | peak RSS MiB (max) | RSS bound "
            "MiB | check | load |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for key, cell in res.get("cells", {}).items():
            frac, pol, io = key.split("|")
            s = cell["summary"]
            bound = cell["runs"][0]["rss_limit_mb"]
            ok = all(r["rss_ok"] for r in cell["runs"])
            budget = cell["runs"][0]["budget"]
            bud = f"{frac}%" + (f" ({budget / MB:.0f} MB)" if budget else "")
            slots = "–" if not s["slots"] else f"{s['slots']} ({s['pinned']})"
            pl = res.get("plans", {}).get(frac)
            if pl and pol == "lru":
                exp_mb = pl["expected_bytes_per_token"] / MB
                slots += f"; plan: hit {pl['expected_hit_rate']:.2f}, {exp_mb:.0f} MB/token"
            load = f"{statistics.median(float(r['load'].split()[0]) for r in cell['runs']):.1f}"
            out.append(
                f"| {bud} | {pol} | {io} | {slots} | {f(s['decode_tps'], 2)} | {f(s['hit_rate'], 3)} | "
                f"{f(s['mb_per_token'])} | "
                f"{f(s['prefetch_acc'], 2)} | {f(s['prefetch_wasted'], 1)} | "
                f"{f(s['io_wait_ms_per_token'], 1)} | "
                f"{f(s['peak_rss_mb'], 0)} ({f(s['max_peak_rss_mb'], 0)}) | {bound:.0f} | "
                f"{'PASS' if ok else 'FAIL'} | {load} |"
            )
        out.append("")
        out.append(
            '(MB = 10^6 bytes; "MB read / token" is what the store read from the file '
            "per decoded token, prefill excluded; "
            "I/O wait is summed over the threads that waited; prefetch accuracy = predicted experts that "
            "the next layer then used / predicted.)"
        )
        out.append("")
    lc = res.get("limit_cells")
    if lc:
        out.append(
            "**Under a memory limit** (v1 memory cgroup, a child of the session's own; limit = dense part "
            "+ fraction x experts + "
            f"{LIMIT_SLACK_MB} MiB; the model file's pages dropped from the page cache before each run). "
            "llama.cpp: "
            f"`{Path(res.get('gguf', '')).name}` through its mmap; colibri: the same weights as `.colibri`, "
            f"`ram_budget` = fraction x experts, policy `{a.get('limit_policy')}`. Prompt {a.get('prompt')} "
            "ids, then "
            f"{a.get('limit_decode')} greedy tokens; medians of {a.get('reps')}. "
            '"disk MB / token" is `read_bytes` '
            f"of `/proc/self/io` during decode (what the kernel fetched from the drive)."
        )
        out.append("")
        out.append(
            "| limit | engine | decode tok/s | disk MB / token | prefill s (cold) | peak RSS MiB | cgroup "
            "peak MB | failed runs |"
        )
        out.append("|---|---|---|---|---|---|---|---|")
        for key, cell in lc.items():
            frac, eng = key.split("|")
            s = cell["summary"]
            lim = "none" if not cell["limit"] else f"{frac}% ({cell['limit'] / MB:.0f} MB)"
            name = "llama.cpp (mmap)" if eng == "llama" else f"colibri, io={eng.split('-', 1)[1]}"
            if not cell["limit"] and eng != "llama":
                name = f"colibri resident (mmap; run {eng.split('-', 1)[1]})"
            if s is None:
                out.append(f"| {lim} | {name} | – | – | – | – | – | {len(cell['errors'])} |")
                continue
            out.append(
                f"| {lim} | {name} | {f(s['decode_tps'], 2)} | {f(s['disk_mb_per_token'])} | "
                f"{f(s['prefill_s'], 1)} | "
                f"{f(s['peak_rss_mb'], 0)} | {f(s['cg_peak_mb'], 0)} | {len(cell['errors'])} |"
            )
        out.append("")
        agree = res.get("limit_token_agreement", {})
        if agree:
            same = {tuple(v) for v in agree.values()}
            txt = (
                f"the first {next(iter(same))[0]} of {next(iter(same))[1]} at every limit"
                if len(same) == 1
                else ", ".join(f"{k}%: first {v[0]} of {v[1]}" for k, v in agree.items())
            )
            out.append(
                f"Greedy tokens, llama.cpp vs colibri, same ids: {txt} agree, then the two free-running "
                "sequences part at a near-tie (both engines quantise activations to 8 bits, each its "
                'own way; see "Same model in both engines" above). Same tokens at every limit within '
                "each engine: "
                + ", ".join(
                    f"{e}: {'yes' if ok else 'NO'}"
                    for e, ok in res.get("limit_tokens_consistent", {}).items()
                )
                + "."
            )
            out.append("")
    dl = res.get("demo_learn_routing")
    if dl:
        t = res["demo_text"]
        dp = res["demo_plan"]
        out.append(
            f"**Trained demo model** (`demo.colibri`: {dp['moe_layers']} MoE layers x 8 experts, "
            f"top-{dp['top_k']}, "
            f"slot {dp['slot_bytes'] / 1024:.0f} KiB). Heat learned teacher-forced on {t['learn_tokens']} "
            "tokens of the first half of "
            f"the held-out Austen split; tested on {t['test_prompts']} prompts of {t['prompt_tokens']} "
            "tokens from the second half, "
            f"each continued by {t['decode_tokens']} sampled tokens (temperature 0.8, seed 1234: the same "
            "tokens under every policy: "
            f"**{'yes' if res.get('demo_same_tokens') else 'NO'}**). Hit rate and prefetch accuracy are "
            "over decoded tokens only."
        )
        out.append("")
        out.append("Routing heat on real text (teacher forced, learning half):")
        out.append("")
        out.append(
            "| layer | heat share per expert 0-7 (%) | entropy (bits, of 3) | normalised | mean top-1/top-2 "
            "margin |"
        )
        out.append("|---|---|---|---|---|")
        for lay in dl["layers"]:
            tot = sum(lay["heat"]) or 1
            shares = " ".join(f"{100 * h / tot:.0f}" for h in lay["heat"])
            out.append(
                f"| {lay['layer']} | {shares} | {lay['entropy_bits']:.2f} | {lay['entropy']:.2f} | "
                f"{lay['mean_margin']:.2f} |"
            )
        out.append("")
        gr = res.get("demo_gen_routing")
        if gr:
            ent = ", ".join(f"{lay['entropy']:.2f}" for lay in gr["layers"])
            out.append(
                f"On the test prompts plus generated text the normalised entropies per layer are {ent}."
            )
            out.append("")
        if gr:
            learned = [lay["heat"] for lay in dl["layers"]]
            test = [lay["heat"] for lay in gr["layers"]]
            parts = []
            for per in res["demo_cells"] and sorted({int(k.split("|")[0]) for k in res["demo_cells"]}):
                hits = []
                for lh, th in zip(learned, test):
                    top = sorted(range(len(lh)), key=lambda e: -lh[e])[:per]
                    hits.append(sum(th[e] for e in top) / max(1, sum(th)))
                parts.append(f"{per} per layer: {statistics.mean(hits):.3f}")
            out.append(
                "For scale: a static per-layer hot set, the n experts of each layer that the learned heat "
                "ranks highest, would serve this fraction of the test run's expert choices (prompts "
                "included): " + "; ".join(parts) + "."
            )
            out.append("")
        out.append(
            "| slots per layer (budget) | policy | pinned (per layer) | decode hit rate | KiB read / token "
            "| prefetch acc. | prefetch reads wasted / token |"
        )
        out.append("|---|---|---|---|---|---|---|")
        for key, cell in res["demo_cells"].items():
            per, pol = key.split("|")
            s = cell["summary"]
            pins = res["demo_pin_by_slots"].get(per)
            pin = "–" if not POLICIES[pol]["pin_hot"] else f"{s['pinned']} ({'/'.join(map(str, pins))})"
            budget = cell["runs"][0].get("slots")
            out.append(
                f"| {per} ({budget} slots, {int(per) * dp['moe_layers'] * dp['slot_bytes'] / 1024:.0f} KiB) "
                f"| {pol} | {pin} | {f(s['hit_rate'], 3)} | "
                f"{f(s['mb_per_token'] * 1000 / 1.024, 0)} | {f(s['prefetch_acc'], 2)} | "
                f"{f(s['prefetch_wasted'], 2)} |"
            )
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- results files


def _r(x: float | None, nd: int) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


def _part_meta(res: dict, name: str) -> tuple[dict, str, list[str]]:
    """The machine, date and commands of one part of a raw run (each part may come
    from another run when --update merged them)."""
    when = res.get(f"{name}_when", {})
    info = when.get("machine_info") or B.run_machine(res)
    date = when.get("date") or res.get("date", "")[:10]
    command = when.get("command") or "python benches/store_bench.py (the raw run did not record its command)"
    return info, date, [command]


def _machine(res: dict, info: dict) -> dict:
    extra = []
    rate = re.search(r"([0-9.]+ [kMG]B/s)\s*$", res.get("disk", ""))
    if rate:
        extra.append(f"drive {rate.group(1)} O_DIRECT sequential read (8 MiB blocks)")
    return B.describe_machine(info, extra)


def _where(rows: list[dict], key: str, wanted: list[str]) -> dict:
    """A view filter on `key` keeping the wanted values the rows have (none: no filter)."""
    have = [w for w in wanted if any(r.get(key) == w for r in rows)]
    return {key: have} if have else {}


def store_results(res: dict) -> dict[str, dict]:
    """The results files (benches/render_results.py's schema) of a raw store_bench.py run,
    one per part it holds: ``budgets``, ``limit`` and ``demo``, in the layout of the
    streaming tables."""
    a = res.get("args", {})
    out: dict[str, dict] = {}
    if res.get("cells"):
        info, date, commands = _part_meta(res, "random")
        plan = res["plan"]
        rows = []
        for key, cell in res["cells"].items():
            frac, pol, io = key.split("|")
            s, budget = cell["summary"], cell["runs"][0]["budget"]
            row = {
                "budget": "100% (resident)" if pol == "resident" else f"{frac}% ({budget / MB:.0f} MB)",
                "policy": pol,
                "io": io,
                "decode_tok_s": _r(s["decode_tps"], 2),
                "hit_rate": _r(s["hit_rate"], 3),
                "mb_read_per_token": _r(s["mb_per_token"], 1),
                "prefetch_accuracy": _r(s["prefetch_acc"], 2),
                "io_wait_ms_per_token": _r(s["io_wait_ms_per_token"], 1),
                "peak_rss_mib": _r(s["peak_rss_mb"], 0),
                "rss_bound_mib": _r(cell["runs"][0]["rss_limit_mb"], 0),
                "rss_ok": all(r["rss_ok"] for r in cell["runs"]),
                "slots": s["slots"],
                "pinned": s["pinned"],
            }
            rows.append({k: v for k, v in row.items() if v is not None})
        out["budgets"] = {
            "title": (
                f"Expert streaming under a RAM budget, {a.get('shape')} width, {a.get('layers')} layers, "
                f"{a.get('dtype')}"
            ),
            "axis": ["streaming"],
            "machine": _machine(res, info),
            "date": date,
            "commit": B.commit_of([info]),
            "peer": None,
            "method": (
                "store_bench.py part 1: random weights (near-uniform routing), a "
                f"{plan['file_bytes'] / 1e9:.2f} GB file whose routed experts are "
                f"{plan['expert_bytes'] / 1e9:.2f} GB; {a.get('prompt')}-token prompt then {a.get('decode')} "
                f"greedy tokens, {a.get('threads')} threads, medians of {a.get('reps')} runs in fresh "
                "processes; hit rate and bytes read cover decode only; buffered reads come from the page "
                "cache, direct reads (O_DIRECT) from the drive; peak RSS within budget + "
                f"dense part ({plan['dense_bytes'] / MB:.0f} MB) + {OVERHEAD_MB} MiB in every run: "
                f"{'yes' if res.get('all_rss_ok') else 'NO'}; the resident run's tokens in every run: "
                f"{'yes' if res.get('all_same_tokens') else 'NO'}"
            ),
            "commands": commands,
            "columns": {
                "budget": {"label": "budget", "cell": "{budget}"},
                "policy": {"label": "policy", "cell": "{policy}"},
                "io": {"label": "io", "cell": "{io}"},
                "tok": {"label": "decode tok/s", "cell": "{decode_tok_s:.2f}"},
                "hit": {"label": "hit rate", "cell": "{hit_rate:.3f}"},
                "mb": {"label": "MB read / token", "cell": "{mb_read_per_token:.1f}"},
                "rss": {"label": "peak RSS / bound MiB", "cell": "{peak_rss_mib:.0f} / {rss_bound_mib:.0f}"},
            },
            "views": {
                "streaming": {
                    "columns": ["budget", "policy", "io", "tok", "hit", "mb", "rss"],
                    **({"where": w} if (w := _where(rows, "policy", ["resident", "lru"])) else {}),
                }
            },
            "rows": rows,
        }
    if res.get("limit_cells"):
        info, date, commands = _part_meta(res, "limit")
        rows = []
        for key, cell in res["limit_cells"].items():
            frac, eng = key.split("|")
            s = cell["summary"]
            name = "llama.cpp (mmap)" if eng == "llama" else f"colibri, io={eng.split('-', 1)[1]}"
            if not cell["limit"] and eng != "llama":
                name = "colibri resident (mmap)"
            row = {
                "limit": "none" if not cell["limit"] else f"{frac}% ({cell['limit'] / MB:.0f} MB)",
                "engine": name,
                "failed_runs": len(cell["errors"]),
            }
            if s is not None:
                row |= {
                    "decode_tok_s": _r(s["decode_tps"], 2),
                    "disk_mb_per_token": _r(s["disk_mb_per_token"], 1),
                    "prefill_cold_s": _r(s["prefill_s"], 1),
                    "peak_rss_mib": _r(s["peak_rss_mb"], 0),
                    "cgroup_peak_mb": _r(s["cg_peak_mb"], 0),
                }
            rows.append({k: v for k, v in row.items() if v is not None})
        limited = [r["limit"] for r in rows if r["limit"] != "none"]
        where = _where(rows, "engine", [r["engine"] for r in rows if "resident" not in r["engine"]])
        where |= _where(rows, "limit", list(dict.fromkeys(limited)))
        out["limit"] = {
            "title": (
                f"Under a memory limit against llama.cpp's mmap, {a.get('shape')} width, {a.get('layers')} "
                f"layers, {a.get('dtype')}"
            ),
            "axis": ["streaming"],
            "machine": _machine(res, info),
            "date": date,
            "commit": B.commit_of([info]),
            "peer": "llama.cpp through llama-cpp-python "
            f"{res.get('llama_version') or '(version not recorded)'} with its default mmap",
            "method": (
                "store_bench.py part 2: both engines in a v1 memory cgroup capped at dense part + fraction "
                f"x experts + {LIMIT_SLACK_MB} MiB, the model files dropped from the page cache before each "
                "run; "
                f"colibri with ram_budget = fraction x experts, policy {a.get('limit_policy')}; "
                f"{a.get('prompt')}-token prompt then {a.get('limit_decode')} greedy tokens, medians of "
                f"{a.get('reps')}; disk MB / token is read_bytes of /proc/self/io during decode"
            ),
            "commands": commands,
            "columns": {
                "limit": {"label": "limit", "cell": "{limit}"},
                "engine": {"label": "engine", "cell": "{engine}"},
                "tok": {"label": "decode tok/s", "cell": "{decode_tok_s:.2f}"},
                "disk": {"label": "disk MB / token", "cell": "{disk_mb_per_token:.1f}"},
                "prefill": {"label": "cold prefill s", "cell": "{prefill_cold_s:.1f}"},
                "rss": {"label": "peak RSS MiB", "cell": "{peak_rss_mib:.0f}"},
                "failed": {"label": "failed runs", "cell": "{failed_runs}"},
            },
            "views": {
                "streaming": {
                    # A failed run is news: its column shows whenever there is one.
                    "columns": ["limit", "engine", "tok", "disk", "prefill", "rss"]
                    + (["failed"] if any(r["failed_runs"] for r in rows) else []),
                    **({"where": where} if where else {}),
                },
                "all": {"columns": ["limit", "engine", "tok", "disk", "prefill", "rss", "failed"]},
            },
            "rows": rows,
        }
    if res.get("demo_cells"):
        info, date, commands = _part_meta(res, "demo")
        dp, t = res["demo_plan"], res["demo_text"]
        rows = []
        for key, cell in res["demo_cells"].items():
            per, pol = key.split("|")
            s = cell["summary"]
            row: dict = {
                "slots_per_layer": int(per),
                "policy": pol,
                "decode_hit_rate": _r(s["hit_rate"], 3),
                "kib_read_per_token": _r(s["mb_per_token"] * 1000 / 1.024, 0),
                "prefetch_accuracy": _r(s["prefetch_acc"], 2),
            }
            pins = res.get("demo_pin_by_slots", {}).get(per)
            if POLICIES[pol]["pin_hot"] and pins:
                row["pinned_per_layer"] = "/".join(map(str, pins))
            rows.append({k: v for k, v in row.items() if v is not None})
        experts = dp["experts"] // max(1, dp["moe_layers"])
        out["demo"] = {
            "title": (
                f"Routing locality on the trained demo model ({dp['moe_layers']} MoE layers x {experts} "
                "experts, "
                f"top-{dp['top_k']}, slot {dp['slot_bytes'] / 1024:.0f} KiB)"
            ),
            "axis": ["streaming"],
            "machine": _machine(res, info),
            "date": date,
            "commit": B.commit_of([info]),
            "peer": None,
            "method": (
                f"store_bench.py part 3: heat learned teacher-forced on {t['learn_tokens']} tokens of the "
                f"first half of the held-out text; tested on {t['test_prompts']} prompts of "
                f"{t['prompt_tokens']} tokens from the second half, each continued by {t['decode_tokens']} "
                "sampled tokens (the same tokens under every policy: "
                f"{'yes' if res.get('demo_same_tokens') else 'NO'}); the pinned hot set chosen per layer in "
                "equal shares"
            ),
            "commands": commands,
            "columns": {
                "slots": {"label": "slots per layer", "cell": "{slots_per_layer}"},
                "policy": {"label": "policy", "cell": "{policy}"},
                "hit": {"label": "decode hit rate", "cell": "{decode_hit_rate:.3f}"},
                "kib": {"label": "KiB read / token", "cell": "{kib_read_per_token:.0f}"},
                "acc": {"label": "prefetch acc.", "cell": "{prefetch_accuracy:.2f}"},
            },
            "views": {
                "streaming": {
                    "columns": ["slots", "policy", "hit", "kib"],
                    **({"where": w} if (w := _where(rows, "policy", ["lru", "lru+pin"])) else {}),
                },
                "all": {"columns": ["slots", "policy", "hit", "kib", "acc"]},
            },
            "rows": rows,
        }
    return out


def results_files(name: str, res: dict) -> dict[Path, dict]:
    """benches/results/NAME-PART.json for each part of the run."""
    return {
        R.results_path(f"{name.removesuffix('.json')}-{part}"): data
        for part, data in store_results(res).items()
    }


def disk_probe(path: Path) -> str:
    p = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=8M", "count=128", "iflag=direct"],
        capture_output=True,
        text=True,
    )
    return (p.stderr.strip().splitlines() or ["n/a"])[-1]


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="olmoe", choices=list(mm.SHAPES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (random ids)")
    ap.add_argument("--decode", type=int, default=32, help="greedy tokens timed after the first")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budgets", default="100,50,25,10", help="percent of the expert bytes")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list of " + ", ".join(POLICIES))
    ap.add_argument("--io", default="buffered,direct")
    ap.add_argument("--parts", default="random,limit,demo", help="which measurements: random, limit, demo")
    ap.add_argument(
        "--limits", default="100,50,25", help="memory limits, percent of experts (+ dense + slack)"
    )
    ap.add_argument("--limit-io", default="direct,buffered", help="colibri I/O modes under the limit")
    ap.add_argument(
        "--limit-policy", default="lru", choices=list(POLICIES), help="colibri policy under the limit"
    )
    ap.add_argument("--limit-decode", type=int, default=16)
    ap.add_argument("--limit-timeout", type=float, default=600)
    ap.add_argument(
        "--llama-python", default="/root/venv-bench/bin/python", help="interpreter with llama-cpp-python"
    )
    ap.add_argument("--text", help="English text for the demo part (default: the held-out Austen split)")
    ap.add_argument("--demo-slots", default="2,3,4", help="expert slots per layer for the demo part")
    ap.add_argument("--demo-prompts", type=int, default=24)
    ap.add_argument("--demo-prompt", type=int, default=32)
    ap.add_argument("--demo-decode", type=int, default=48)
    ap.add_argument("--demo-learn-tokens", type=int, default=16384)
    ap.add_argument("--demo-reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=mm.CACHE / "store-run.json")
    ap.add_argument("--report", type=Path, help="re-render a saved run instead of measuring")
    ap.add_argument("--update", action="store_true", help="merge into --json, keeping parts not run now")
    ap.add_argument(
        "--results",
        metavar="NAME",
        help="write each part of the run as benches/results/NAME-PART.json (PART: budgets, limit, demo)",
    )
    ap.add_argument("--force", action="store_true", help="with --results: replace existing results files")
    ap.add_argument(
        "--quick", action="store_true", help="smoke test: 100%% and 10%%, two policies, 1 rep, few tokens"
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(WORKERS[spec["kind"]](spec)))
        return 0
    if args.report:
        res = json.loads(args.report.read_text())
        print(report(res))
        if args.results:
            R.write(results_files(args.results, res), args.force)
        return 0
    if args.results:
        # Before measuring: a run takes hours, and its results files must not replace others silently.
        parts = {"random": "budgets", "limit": "limit", "demo": "demo"}
        stem = args.results.removesuffix(".json")
        R.refuse_overwrite(
            [R.results_path(f"{stem}-{parts[p]}") for p in args.parts.split(",") if p in parts], args.force
        )
    if args.quick:
        args.reps, args.budgets, args.policies = 1, "100,10", "lru,lru+pin+prefetch"
        args.limits, args.decode, args.limit_decode, args.demo_slots, args.demo_reps, args.demo_prompts = (
            "25",
            8,
            4,
            "3",
            1,
            4,
        )
    args.budgets = [int(x) for x in args.budgets.split(",")]
    args.policies = [p for p in args.policies.split(",") if p]
    args.io = [x for x in args.io.split(",") if x]
    args.limits = [int(x) for x in args.limits.split(",")]
    args.limit_io = [x for x in args.limit_io.split(",") if x]
    args.demo_slots = [int(x) for x in args.demo_slots.split(",")]
    args.llama = "limit" in args.parts
    parts = args.parts.split(",")

    res: dict = {}
    if args.update and args.json.exists():
        res = json.loads(args.json.read_text())  # keep the parts not measured now
    info = B.machine_info()
    command = B.command_line("store_bench.py", sys.argv[1:] if argv is None else argv)
    res.update(
        {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": B.machine_facts(info).replace("\n", " "),
            "machine_info": info,
            "args": {
                k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, type(None)))
            },
        }
    )
    res["args"]["text"] = str(args.text) if args.text else None
    if "random" in parts or "limit" in parts:
        cpath, gpath = model_files(args)
        res["gguf"] = str(gpath)
        res["disk"] = disk_probe(cpath)
    for name, fn in (("random", part_random), ("limit", part_limit), ("demo", part_demo)):
        if name in parts:
            t0 = time.time()
            load0 = B.loadavg()
            fn(args, res)
            res[f"{name}_when"] = {
                "start": time.strftime("%H:%M", time.gmtime(t0)),
                "end": time.strftime("%H:%M UTC", time.gmtime()),
                "load_before": load0,
                "load_after": B.loadavg(),
                "date": time.strftime("%Y-%m-%d", time.gmtime(t0)),
                "command": command,
                "machine_info": info,
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=1))
    args.json.write_text(json.dumps(res, indent=1))
    print(report(res))
    if args.results:
        R.write(results_files(args.results, res), args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
