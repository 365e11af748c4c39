"""Time to first token of an agent's tenth turn, with the prefix cache and
without (issue 42's target: at least 10x faster with it).

The conversation is an agent's token stream, as a chat template lays it out
turn after turn: a system prompt and task of ``--opening`` tokens, then per
turn the model's own reply (``--reply`` tokens, generated greedily) and a
tool result of ``--tool`` tokens. Its ids are random within the vocabulary
(the bench model has random weights and no tokenizer); what matters to the
cache is that each turn's prompt begins with the last one's prompt and
reply, which a template that re-renders history the same way gives.

- ``cache``: one engine with ``prefix_cache`` runs turns 1 to 10, each a
  generation of ``--reply`` tokens, and times every turn's first token.
- ``none``: a fresh engine without a cache, after a short warm-up request
  (so both have touched the weights), times the first token of the same
  turn-10 prompt; its first token must equal the cached run's (the cache is
  exact).

Each mode runs in a fresh process, ``--reps`` times, alternating; the table
gives medians. The raw runs are kept in ``benches/.cache/agent-*.json``;
``--results NAME`` writes the table's results file (``--report RAW`` makes
it from saved runs). The model is made by ``benches/make_models.py`` (random
weights at real widths, default Qwen3-30B-A3B's with 4 layers), converted
once into ``benches/.cache``.

    python benches/agent_bench.py [--shape qwen3moe] [--layers 4] [--dtype q8_0] [--reps 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def conversation(vocab: int, opening: int, tool: int, seed: int = 7) -> tuple[list[int], list[list[int]]]:
    """The opening and the ten tool results (ids away from the vocabulary's ends)."""
    import random

    rnd = random.Random(seed)
    draw = lambda n: [rnd.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    return draw(opening), [draw(tool) for _ in range(10)]


def worker(args: argparse.Namespace) -> dict[str, object]:
    import colibri

    cache = args.mode == "cache"
    engine = colibri.Engine(
        args.model, threads=args.threads, prefix_cache="8GiB" if cache else None, max_batch=1
    )
    opening, tools = conversation(engine.vocab_size, args.opening, args.tool)
    greedy = {"temperature": 0, "ignore_eos": True}
    if cache:
        prompt, turns = list(opening), []
        for k in range(10):
            if k:
                prompt += tools[k - 1]
            t0 = time.perf_counter()
            n = args.reply if k < 9 else 1
            out = engine.generate(prompt, max_new_tokens=n, **greedy)
            first = time.perf_counter() - t0 if n == 1 else out.timings.prefill_seconds
            turns.append({"prompt": len(prompt), "cached": out.timings.cached_tokens, "ttft": first})
            prompt += list(out)
        return {"turns": turns, "prompt": prompt[:-1], "first": prompt[-1]}
    convo = json.loads(Path(args.conversation).read_text())
    engine.generate(opening[:16], max_new_tokens=1, **greedy)  # warm-up
    t0 = time.perf_counter()
    out = engine.generate(convo["prompt"], max_new_tokens=1, **greedy)
    ttft = time.perf_counter() - t0
    first = list(out)[0]
    return {"ttft": ttft, "prompt": len(convo["prompt"]), "first": first, "cached": out.timings.cached_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3moe")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--opening", type=int, default=1200, help="tokens of system prompt and task")
    ap.add_argument("--tool", type=int, default=300, help="tokens of each tool result")
    ap.add_argument("--reply", type=int, default=24, help="tokens the model writes each turn")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--results", help="also write benches/results/NAME.json")
    ap.add_argument("--report", metavar="RAW", help="print (and with --results write) a saved raw run")
    ap.add_argument("--mode", choices=["cache", "none"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--conversation", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(worker(args)))
        return
    if args.report:
        report(json.loads(Path(args.report).read_text()), args.results)
        return

    sys.path.insert(0, str(HERE))
    import bench
    import make_models as mm

    shape = mm.SHAPES[args.shape]
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    bench.ensure_models(shape, args.layers, [], log)
    model = bench.colibri_file(shape, args.layers, args.dtype, log)

    def run(mode: str, convo: str | None = None) -> dict:
        cmd = [sys.executable, __file__, "--mode", mode, "--model", str(model)]
        for flag in ("threads", "opening", "tool", "reply"):
            cmd += [f"--{flag}", str(getattr(args, flag))]
        if convo:
            cmd += ["--conversation", convo]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    cached, fresh = [], []
    with tempfile.TemporaryDirectory() as tmp:
        convo = os.path.join(tmp, "conversation.json")
        for rep in range(args.reps):
            c = run("cache")
            Path(convo).write_text(json.dumps({"prompt": c["prompt"]}))
            n = run("none", convo)
            assert n["first"] == c["first"], "the cached run's first token differs from a fresh one"
            cached.append(c)
            fresh.append(n)
            t10 = c["turns"][-1]
            log(
                f"rep {rep + 1}: turn 10 of {t10['prompt']} tokens: {t10['ttft']:.3f} s with the cache "
                f"({t10['cached']} cached), {n['ttft']:.3f} s without"
            )
    raw = {"args": vars(args), "model": f"{shape.name} l{args.layers} {args.dtype}", "cached": cached}
    raw["fresh"], raw["commit"], raw["date"] = fresh, commit(), dt.date.today().isoformat()
    saved = mm.CACHE / f"agent-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    saved.write_text(json.dumps(raw) + "\n")
    log(f"raw runs: {saved}")
    report(raw, args.results)


def cpu_text(facts: str) -> str:
    """``facts`` with the CPU's family and model numbers after its name (which
    says no generation on some virtual machines)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return facts
    fields = dict(line.split(":", 1) for line in info.splitlines()[:30] if ":" in line)
    fam, model = fields.get("cpu family\t", "").strip(), fields.get("model\t\t", "").strip()
    if not fam:
        return facts
    name, rest = facts.split(", ", 1)
    return f"{name}, CPU family {fam} model {model}, {rest}"


def commit() -> str:
    git = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True, cwd=HERE).stdout.strip()


def report(raw: dict, results: str | None) -> None:
    """Prints the table of a raw run and, with ``results``, writes it as a
    results file docs/benchmarks.md renders (benches/render_results.py)."""
    cached, fresh, a = raw["cached"], raw["fresh"], raw["args"]
    reps = len(cached)
    rows = []
    for k, t in enumerate(cached[0]["turns"]):
        row = {"turn": k + 1, "prompt": t["prompt"], "cached": t["cached"]}
        row["with_cache_s"] = round(statistics.median(c["turns"][k]["ttft"] for c in cached), 3)
        rows.append(row)
    without = statistics.median(n["ttft"] for n in fresh)
    rows[-1]["without_s"] = round(without, 3)
    rows[-1]["speedup"] = round(without / rows[-1]["with_cache_s"], 2)
    print(f"\nmodel {raw['model']}, {a['threads']} threads, medians of {reps}")
    print("| turn | prompt tokens | from the cache | TTFT with the cache (s) | without (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [r["turn"], r["prompt"], r["cached"], r["with_cache_s"], r.get("without_s", "")]
        print("| " + " | ".join(map(str, cells)) + " |")
    print(f"\nturn 10: {rows[-1]['speedup']}x faster with the cache (target >= 10x)")
    if not results:
        return
    sys.path.insert(0, str(HERE))
    import bench

    info = bench.machine_info()
    out = {
        "title": f"An agent's turns with and without the prefix cache, {raw['model']}",
        "axis": ["agents"],
        "machine": {"cpu": cpu_text(bench.machine_facts(info).splitlines()[0][len("- CPU: ") :])},
        "date": raw["date"],
        "commit": raw["commit"],
        "recorded_in": raw["commit"],
        "method": (
            f"agent_bench.py: an agent's token stream on a random-weight model at real widths "
            f"({raw['model']}): an opening of {a['opening']} tokens, then per turn the model's greedy "
            f"reply of {a['reply']} tokens and a tool result of {a['tool']} tokens; time to first token "
            f"(prefill and the first choice) of each turn on one engine with a prefix cache, and of turn "
            f"10's prompt on a fresh engine without one (after a 16-token warm-up request); each mode in "
            f"a fresh process, {a['threads']} threads, alternating, medians of {reps}; the fresh engine's "
            f"first token equals the cached one's in every run"
        ),
        "commands": [
            f"python benches/agent_bench.py --shape {a['shape']} --layers {a['layers']} --dtype {a['dtype']} "
            f"--reps {a['reps']} --results NAME"
        ],
        "columns": {
            "turn": {"label": "turn", "cell": "{turn}"},
            "prompt": {"label": "prompt tokens", "cell": "{prompt}"},
            "cached": {"label": "from the cache", "cell": "{cached}"},
            "with": {"label": "TTFT with the cache (s)", "cell": "{with_cache_s:.2f}"},
            "without": {"label": "without (s)", "cell": "{without_s:.2f}"},
            "speedup": {"label": "faster with it", "cell": "{speedup:.1f}x"},
        },
        "views": {"agents": {"columns": ["turn", "prompt", "cached", "with", "without", "speedup"]}},
        "rows": rows,
    }
    path = HERE / "results" / f"{results}.json"
    if path.exists():
        sys.exit(f"{path} exists: remove it first")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}; show it with <!-- render: {results}.json agents -->", file=sys.stderr)


if __name__ == "__main__":
    main()
