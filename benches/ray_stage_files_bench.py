"""Pipeline stages over stage files (``colibri split``) on a local Ray
cluster: what each stage holds in memory and how fast a token goes, for two
stages over the whole model file, over stage files, and over stage files
whose stages stream their experts under a RAM budget.

Per setup and stage: the size of the file the stage needs on its disk, the
stage process's RSS after the run, and (streaming) the expert cache's hit
rate and bytes read per token; per setup, the median ms per decoded token of
one greedy sequence over ``--rounds`` runs.

    python benches/ray_stage_files_bench.py --model FILE [--budget-share 0.25] [--results NAME]

The stage files are written into benches/.cache/stage-files/ (ignored by git).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the cluster binds 127.0.0.1

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import render_results  # noqa: E402
from ray_bench import per_token_ms, warm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a whole-model .colibri file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument(
        "--budget-share",
        type=float,
        default=0.25,
        help="each streaming stage's RAM budget as a share of its routed experts' bytes",
    )
    ap.add_argument("--results", metavar="NAME", help="write benches/results/NAME.json")
    ap.add_argument("--force", action="store_true", help="replace an existing results file")
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    import colibri
    import colibri.ray as cray

    folder = HERE / ".cache" / "stage-files" / Path(args.model).stem
    files = colibri.split(args.model, 2, out=folder, force=True, progress=sys.stderr.isatty())
    plans = [colibri.plan(f["path"]) for f in files]
    budget = int(max(max(p["min_budget"], args.budget_share * p["expert_bytes"]) for p in plans))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, logging_level="error")
    # (setup, what the engine opens, its options, whether a node needs only its stage file)
    setups: list[tuple[str, Any, dict[str, Any], bool]] = [
        ("whole file on every node", args.model, {"stages": 2}, False),
        ("stage files", folder, {}, True),
        (f"stage files, {budget / 2**20:.0f} MiB expert budget each", folder, {"ram_budget": budget}, True),
    ]
    rows: list[dict[str, Any]] = []
    try:
        for name, where, options, split in setups:
            with cray.Engine(where, transport="actor", timeout=300, **options) as e:
                warm(e)
                ms = statistics.median(per_token_ms(e, args.tokens) for _ in range(args.rounds))
                store = e.store_stats()
                for i, s in enumerate(e.stages()):
                    disk = s["weight_bytes"] if split else os.path.getsize(args.model)
                    rows.append(
                        {
                            "setup": name,
                            "stage": f"{i + 1} (layers {s['layers'][0]}..{s['layers'][1]})",
                            "ms": ms,
                            "disk_mib": disk / 2**20,
                            "rss_mib": s["memory"]["rss"] / 2**20,
                            "hit_rate": store.get("hit_rate", 1.0),
                            "read_per_token_mib": store.get("bytes_read_per_token", 0.0) / 2**20,
                        }
                    )
                    print(rows[-1], flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    data = {
        "title": f"Two pipeline stages over stage files ({Path(args.model).name}, one-CPU Ray nodes)",
        "axis": "ray",
        "machine": {"cpu": f"{cpu}, {os.cpu_count()} cores"},
        "date": dt.date.today().isoformat(),
        "commit": commit,
        "method": (
            f"two stages of one thread each, one per node, on a Ray cluster of three one-CPU nodes on "
            f"127.0.0.1, actor transport; greedy decode of {args.tokens} tokens, median of {args.rounds} "
            "runs after a 256-token warm-up; disk = the file the stage needs on its node; RSS of the "
            "stage process after the runs; hit rate and bytes read per token from the expert store "
            "(summed over the stages)"
        ),
        "commands": [
            f"python benches/ray_stage_files_bench.py --model {args.model} --rounds {args.rounds} "
            f"--tokens {args.tokens} --budget-share {args.budget_share}"
        ],
        "peer": "two stages over the whole file",
        "columns": {
            "setup": {"label": "setup", "cell": "{setup}"},
            "stage": {"label": "stage", "cell": "{stage}"},
            "disk": {"label": "on its disk (MiB)", "cell": "{disk_mib:.0f}"},
            "rss": {"label": "RSS (MiB)", "cell": "{rss_mib:.0f}"},
            "hit": {"label": "expert hit rate", "cell": "{hit_rate:.2f}"},
            "read": {"label": "read per token (MiB)", "cell": "{read_per_token_mib:.1f}"},
            "ms": {"label": "ms per token", "cell": "{ms:.1f}"},
        },
        "views": {"memory": {"columns": ["setup", "stage", "disk", "rss", "hit", "read", "ms"]}},
        "rows": rows,
    }
    print(json.dumps(data, indent=1))
    if args.results:
        render_results.write({render_results.results_path(args.results): data}, args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
