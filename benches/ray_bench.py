"""A model split into pipeline stages on Ray (colibri.ray.Engine) against the
single-process engine, on a local Ray cluster of one-CPU nodes on 127.0.0.1.

Measured, each the median of ``--rounds`` runs:

- decode latency per token of one greedy sequence through 1, 2 and 3 stages
  with each transport (a Ray Compiled Graph, chained actor calls): the step
  from K to K + 1 stages is what one more stage boundary adds, the compute
  being the same;
- aggregate decode tokens/s of 1 and 8 concurrent clients through 2 stages
  (one thread each) against one process with 1 and 2 threads (which batches
  the 8 clients into shared passes);
- each stage's resident memory: the mapped file's pages it touched (RssFile,
  over what the process had before it opened the model) against its share of
  the file's weight bytes.

    python benches/ray_bench.py [--model FILE] [--rounds 5] [--tokens 48] [--results NAME]

The demo model by default (where a step is mostly overhead: the boundary cost
stands out); ``--model`` a bigger one (benches/make_models.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the cluster binds 127.0.0.1

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import render_results  # noqa: E402

PROMPT = "The garden at night was quiet, and the old house"


def prompt(engine: Any, i: int = 0) -> Any:
    # Token ids for a model without a tokenizer (benches/make_models.py's).
    if engine.has_tokenizer:
        return f"{PROMPT} {i}" if i else PROMPT
    return [(7 * j + 3 * i + 11) % engine.vocab_size for j in range(12)]


def warm(engine: Any) -> None:
    # A long prompt routes to most experts, so a process's first touches of
    # the mapped weights (page faults) are over before the timing.
    ids = [(13 * j + 5) % engine.vocab_size for j in range(256)]
    engine.generate(ids, max_new_tokens=8, temperature=0)


def per_token_ms(engine: Any, tokens: int) -> float:
    r = engine.generate(prompt(engine), max_new_tokens=tokens, temperature=0, ignore_eos=True)
    t = r.timings
    return 1e3 * t.decode_seconds / max(1, t.generated_tokens - 1)


def clients_tps(engine: Any, clients: int, tokens: int) -> float:
    done = [0] * clients

    def run(i: int) -> None:
        r = engine.generate(prompt(engine, i + 1), max_new_tokens=tokens, temperature=0, ignore_eos=True)
        done[i] = r.timings.generated_tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return sum(done) / (time.perf_counter() - began)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .colibri file (default: the demo model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--results", metavar="NAME", help="write benches/results/NAME.json")
    ap.add_argument("--force", action="store_true", help="replace an existing results file")
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    import colibri
    import colibri.ray as cray

    model = args.model or str(colibri.Engine.demo(threads=1).path)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, logging_level="error")
    rows: list[dict[str, Any]] = []
    try:
        # One process, the baseline.
        for threads in (1, 2):
            with colibri.Engine(model, threads=threads) as e:
                warm(e)
                ms = statistics.median(per_token_ms(e, args.tokens) for _ in range(args.rounds))
                tps = {
                    c: statistics.median(clients_tps(e, c, args.tokens) for _ in range(args.rounds))
                    for c in (1, 8)
                }
            rows.append(
                {
                    "setup": f"one process, {threads} thread(s)",
                    "stages": 0,
                    "ms": ms,
                    "tps1": tps[1],
                    "tps8": tps[8],
                }
            )
            print(rows[-1], flush=True)
        for transport in ("compiled", "actor"):
            for stages in (1, 2, 3):
                with cray.Engine(model, stages=stages, transport=transport, timeout=120) as e:
                    warm(e)
                    ms = statistics.median(per_token_ms(e, args.tokens) for _ in range(args.rounds))
                    row: dict[str, Any] = {
                        "setup": f"{stages} stage(s), {transport}",
                        "stages": stages,
                        "ms": ms,
                    }
                    if stages == 2:
                        row["tps1"] = statistics.median(
                            clients_tps(e, 1, args.tokens) for _ in range(args.rounds)
                        )
                        row["tps8"] = statistics.median(
                            clients_tps(e, 8, args.tokens) for _ in range(args.rounds)
                        )
                    if stages == 2 and transport == "compiled":
                        row["memory"] = [
                            {
                                "layers": f"{s['layers'][0]}..{s['layers'][1]}",
                                "weights_mib": s["weight_bytes"] / 2**20,
                                "file_rss_mib": (s["memory"]["rss_file"] - s["memory_at_start"]["rss_file"])
                                / 2**20,
                                "rss_mib": s["memory"]["rss"] / 2**20,
                            }
                            for s in e.stages()
                        ]
                    rows.append(row)
                    print(row, flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    base = {r["setup"]: r for r in rows}
    one = base["one process, 1 thread(s)"]
    for transport in ("compiled", "actor"):
        k = {r["stages"]: r["ms"] for r in rows if r["setup"].endswith(transport)}
        for r in rows:
            if r["setup"].endswith(transport):
                r["over_one_process_ms"] = r["ms"] - one["ms"]
                if r["stages"] > 1:
                    r["boundary_ms"] = (r["ms"] - k[1]) / (r["stages"] - 1)
    for r in rows:
        for c in ("tps1", "tps8"):
            if c in r:
                r[f"{c}_vs_one"] = r[c] / one[c]
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    mem_rows = [
        {"setup": f"stage {i} of 2 (layers {m['layers']})", **m}
        for r in rows
        for i, m in enumerate(r.get("memory", []))
    ]
    data = {
        "title": f"Pipeline stages on Ray against one process ({Path(model).name}, one-CPU nodes)",
        "axis": "ray",
        "machine": {"cpu": f"{cpu}, {os.cpu_count()} cores"},
        "date": dt.date.today().isoformat(),
        "commit": commit,
        "method": (
            f"greedy decode of {args.tokens} tokens, medians of {args.rounds} runs; stages of one thread "
            "each on a Ray cluster of three one-CPU nodes on 127.0.0.1 (ray.cluster_utils.Cluster), one "
            "stage per node; boundary = (ms at K stages - ms at 1 stage) / (K - 1), same transport; "
            "8 clients = 8 threads generating at once, aggregate generated tokens/s over wall time; "
            "memory = RssFile growth of each stage process after its run against its share of the "
            "file's weight bytes"
        ),
        "commands": [
            f"python benches/ray_bench.py --rounds {args.rounds} --tokens {args.tokens}"
            + (f" --model {args.model}" if args.model else "")
        ],
        "peer": "colibri.Engine in one process",
        "columns": {
            "setup": {"label": "setup", "cell": "{setup}"},
            "ms": {"label": "ms per token (1 client)", "cell": "{ms:.2f}"},
            "over": {"label": "over one process (ms)", "cell": "{over_one_process_ms:+.2f}"},
            "boundary": {"label": "per boundary (ms)", "cell": "{boundary_ms:.2f}"},
            "tps1": {"label": "tok/s, 1 client", "cell": "{tps1:.1f} ({tps1_vs_one:x})"},
            "tps8": {"label": "tok/s, 8 clients", "cell": "{tps8:.1f} ({tps8_vs_one:x})"},
            "weights": {"label": "weights (MiB)", "cell": "{weights_mib:.1f}"},
            "file_rss": {"label": "file pages resident (MiB)", "cell": "{file_rss_mib:.1f}"},
            "rss": {"label": "process RSS (MiB)", "cell": "{rss_mib:.0f}"},
        },
        "views": {
            "latency": {"columns": ["setup", "ms", "over", "boundary"], "where": {"stages": [0, 1, 2, 3]}},
            "clients": {"columns": ["setup", "tps1", "tps8"], "where": {"stages": [0, 2]}},
            "memory": {"columns": ["setup", "weights", "file_rss", "rss"], "where": {"kind": ["memory"]}},
        },
        "rows": rows + [{**m, "kind": "memory"} for m in mem_rows],
    }
    for r in data["rows"]:
        r.pop("memory", None)
    out = json.dumps(data, indent=1)
    print(out)
    if args.results:
        render_results.write({render_results.results_path(args.results): data}, args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
