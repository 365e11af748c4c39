#!/usr/bin/env python3
"""Load on `colibri serve`: aggregate decode tokens/s and request latency at
several numbers of concurrent clients, beside the batched roofline.

The server runs in its own process (`colibri serve MODEL --threads T`);
each client is a thread sending streamed /v1/completions requests one
after another (short distinct prompts, `max_tokens` tokens each, ignore_eos
so every request makes exactly that many). Aggregate tokens/s = all
completion tokens / wall time of the run, prompts and HTTP included;
latency = each request's wall time. Decoding tokens/s leaves the prompts
out: each request's time per output token after its first (TPOT: from its
first token's chunk to its last, over tokens - 1), and B clients decode at
B / the median TPOT, the rate the roofline below bounds.

The roofline of a step: the bytes it must read, the dense part (every
tensor but the routed experts and the embedding table) once plus the
experts its B tokens choose (with uniform routing, which these random-weight
models have, E·(1 - (1 - k/E)^B) distinct experts per layer), against the
read bandwidth: by default measured by `bench.py`'s probe with the
server's thread count just before each run of each cell (the median of 7
passes over 1 GiB: on a shared machine the bandwidth moves by half within
minutes), or given by --bandwidth. Each run's tokens/s is divided by its own
roofline and the median of those fractions is reported.
B concurrent decoders can then run at most B · bandwidth / bytes(B)
tokens/s.

That bound assumes every byte is the only cost. At several tokens a step
the dense part's arithmetic can take longer than its bytes, so each cell
also gets a bound that counts it: the step's dense part takes at least
max(its bytes / bandwidth, B · its multiply-adds per token / R), its routed
experts at least max(their bytes / bandwidth, B · K · layers · one expert's
multiply-adds / R), and the two add up, since a layer's experts wait for
its attention and the next layer for its experts (a bound for an engine
that reads an expert only once the router has chosen it). R is the multiply-add
rate of the engine's own multi-token path on this host, measured once
before the servers start: the best of three forwards over a 128-token
prompt (every position's logits), all of that forward's multiply-adds over
its time. A prefill gives its kernels more tokens per weight than a decode
step does, so R, and this bound, err on the generous side.

    python benches/serve_bench.py benches/.cache/olmoe-l4/q4_0.colibri --clients 1,2,4,8,16

With --llama-server BIN --gguf FILE the same load also runs against
llama.cpp's own server on the same weights (`BIN -m FILE -t T -np 16 -cb`,
each of its 16 slots with room for a prompt and max_tokens). Both servers
stay up for the whole bench and their runs alternate (colibri, llama-server,
colibri, ... within each cell), so a drifting machine drifts under both; the
ratio of the medians is printed with the ratios run by run.

``--json FILE`` saves the raw run (the machine, build, command and each
cell's medians). ``--results NAME`` writes the run as
``benches/results/NAME.json``, the file a serving table of docs/benchmarks.md
is rendered from, saving the raw run under benches/.cache when --json is not
given, and prints the ``<!-- render: NAME.json serving -->`` lines that show
it; it refuses to replace an existing file unless ``--force`` is given.
``--report RAW [RAW ...]`` prints the table of saved raw runs (one model each,
named by --label) instead of measuring, and with ``--results`` turns them
into one results file:

    python benches/serve_bench.py benches/.cache/olmoe-l4/q4_0.colibri --label OLMoE --json olmoe.json
    python benches/serve_bench.py --report olmoe.json qwen3.json --results zen2-2026-12-24-serve
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import colibri


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class StepCost:
    """What one decode step must read and multiply, from the model's tensors."""

    dense: float  # bytes of every tensor but the routed experts and the embedding table
    expert: float  # bytes of one routed expert of one layer
    experts: int
    top_k: int
    layers: int  # MoE layers
    dense_macs: float  # multiply-adds per token outside the routed experts (the head included)
    expert_macs: float  # multiply-adds of one routed expert for one token

    @property
    def routed_macs(self) -> float:
        """Multiply-adds of one token in the routed experts: K experts in every MoE layer."""
        return self.layers * self.top_k * self.expert_macs

    def expert_bytes(self, b: int) -> float:
        """Bytes of the distinct experts b tokens choose under uniform routing
        (which these random-weight models have)."""
        distinct = self.experts * (1 - (1 - self.top_k / self.experts) ** b)
        return self.layers * distinct * self.expert

    def bytes(self, b: int) -> float:
        """Bytes a step of b tokens reads: the dense part once, plus its experts."""
        return self.dense + self.expert_bytes(b)

    def macs(self, tokens: int) -> float:
        """Multiply-adds of a forward over `tokens` tokens (every position's logits)."""
        return tokens * (self.dense_macs + self.routed_macs)

    def bound_seconds(self, b: int, bandwidth: float, rate: float) -> float:
        """Least time of a step of b tokens: each of its two phases (dense
        part, routed experts) takes at least its bytes over the bandwidth and
        at least its multiply-adds over `rate`; the phases run one after the
        other."""
        dense = max(self.dense / bandwidth, b * self.dense_macs / rate)
        routed = max(self.expert_bytes(b) / bandwidth, b * self.routed_macs / rate)
        return dense + routed


def step_cost(model: Path) -> StepCost:
    with colibri.Engine(model, threads=1, mmap=True) as e:  # only its config and tensor list are read
        cfg, tensors = e.config, e.tensors()
    moe = cfg["moe"]
    experts, top_k = int(moe["num_experts"]), int(moe["router"]["top_k"])
    layers = sum(1 for x in cfg["layers"] if x["ffn"]["kind"] == "moe")
    dense = expert = dense_macs = expert_macs = 0.0
    for name, _dtype, shape, nbytes in tensors:
        macs = shape[0] * shape[1] if len(shape) == 2 else 0  # a matrix [out, in]; vectors cost nothing here
        if ".moe.experts." in name:
            expert += nbytes
            expert_macs += macs
        elif name != "embed":  # one row per token is all the embedding reads
            dense += nbytes
            dense_macs += macs
    n = experts * layers
    return StepCost(dense, expert / n, experts, top_k, layers, dense_macs, expert_macs / n)


def mac_rate(model: Path, threads: int, cost: StepCost, tokens: int = 128, reps: int = 3) -> float:
    """Multiply-adds per second of the engine's multi-token path: the best of
    `reps` forwards over a `tokens`-token prompt (every position's logits)."""
    with colibri.Engine(model, threads=threads) as e:
        ids = [(i * 37) % min(1000, e.vocab_size - 1) + 1 for i in range(tokens)]
        e.logits(ids[:8])  # warm-up: page the weights in
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            e.logits(ids)
            best = min(best, time.perf_counter() - t)
    return cost.macs(tokens) / best


def run(url: str, clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    # Token-id prompts (the bench models have no tokenizer): 16 distinct ids each.
    prompts = [[(i * 97 + j * 13 + 5) % 50000 for j in range(16)] for i in range(clients * requests)]

    def one(k: int) -> list[tuple[float, int, float]]:
        """(latency, completion tokens, time per token after the first) of
        each of client k's requests, streamed so the tokens can be timed."""
        out = []
        # One client per thread, a connection per request: llama-server may
        # close a kept-alive connection after a stream just as the next
        # request goes out on it. (A client per request cost this machine a
        # tenth of a core at 8 clients, its TLS context built each time, taken
        # from the servers under test.)
        with httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            for r in range(requests):
                body = {
                    "prompt": prompts[k * requests + r],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                t = time.perf_counter()
                first = last = None
                tokens = 0
                with http.stream("POST", url + "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        now, chunk = time.perf_counter(), json.loads(line[6:])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        if any(ch.get("finish_reason") is None for ch in chunk.get("choices", ())):
                            first = first or now  # a chunk that carries tokens
                            last = now
                done = time.perf_counter()
                if first is None or last is None or tokens < 2:
                    raise RuntimeError(f"{url}: a stream of {tokens} tokens cannot be timed")
                out.append((done - t, tokens, (last - first) / (tokens - 1)))
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for xs in pool.map(one, range(clients)) for x in xs]
    wall = time.perf_counter() - t0
    lat = sorted(x[0] for x in results)
    tokens = sum(x[1] for x in results)
    tpot = statistics.median(x[2] for x in results)
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    return {
        "tok_s": tokens / wall,
        "p50": statistics.median(lat),
        "p99": p99,
        "tokens": tokens,
        "tpot": tpot,
        "decode_tok_s": clients / tpot,
    }


@contextmanager
def running(cmd: list[str], url: str) -> Iterator[None]:
    """Starts a server, waits until it answers /health, stops it after."""
    server = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {server.returncode}")
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not come up")
            time.sleep(0.1)
        yield
    finally:
        server.terminate()
        server.wait(30)


def _bench() -> Any:
    """bench.py, whose probe and machine facts this bench shares."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench

    return bench


def _r(x: float, nd: int) -> float:
    return round(x, nd)


def serve_results(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The results file (benches/render_results.py's schema) of one or more raw runs
    of this bench (--json files, one model each) on one machine, in the layout of the
    serving tables."""
    B = _bench()
    infos = [B.run_machine(r) for r in runs]
    if len({i["cpu_model"] for i in infos}) > 1:
        raise ValueError(
            "runs from different machines: " + ", ".join(sorted({i["cpu_model"] for i in infos}))
        )
    rows: list[dict[str, Any]] = []
    probes: list[float] = []
    for run in runs:
        base: dict[str, dict[str, float]] = {}
        for raw in run["rows"]:
            c = raw["colibri"]
            base.setdefault("colibri", c)
            row: dict[str, Any] = {
                "width": run.get("label") or "(model not recorded)",
                "clients": raw["clients"],
                "colibri": {"aggregate": _r(c["tok_s"], 1), "decoding": _r(c["decode_tok_s"], 1)},
                "vs_one_client": {
                    "aggregate": _r(c["tok_s"] / base["colibri"]["tok_s"], 2),
                    "decoding": _r(c["decode_tok_s"] / base["colibri"]["decode_tok_s"], 2),
                },
                "p50_s": _r(c["p50"], 2),
                "p99_s": _r(c["p99"], 2),
                "roofline_tok_s": round(c["roofline_tok_s"]),
                "bound_tok_s": round(c["bound_tok_s"]),
                "bound_of_roofline": _r(c["bound_tok_s"] / c["roofline_tok_s"], 2),
                "colibri_of_roofline": {
                    "aggregate": _r(c["of_roofline"], 2),
                    "decoding": _r(c["decode_of_roofline"], 2),
                },
                "colibri_of_bound": {
                    "aggregate": _r(c["of_bound"], 2),
                    "decoding": _r(c["decode_of_bound"], 2),
                },
            }
            probes.append(c["bandwidth"] / 1e9)
            if "llama-server" in raw:
                ls = raw["llama-server"]
                row["llama_server"] = {"aggregate": _r(ls["tok_s"], 1), "decoding": _r(ls["decode_tok_s"], 1)}
                row["ratio"] = _r(c["tok_s"] / ls["tok_s"], 2)
                row["ratio_runs"] = [_r(x, 2) for x in raw.get("ratio_pairs", [])]
            rows.append(row)
    peer = any("llama_server" in r for r in rows)
    a = runs[0].get("args", {})
    threads = a.get("threads", "?")
    rates = sorted(r["mac_rate"] / 1e9 for r in runs)
    spread = f"{min(probes):.1f}-{max(probes):.1f}" if probes and min(probes) != max(probes) else ""
    extra = [f"read probe {spread or f'{probes[0]:.1f}'} GB/s on {threads} thread(s)"] if probes else []
    machine = B.describe_machine(infos[0], extra)
    columns = {
        "width": {"label": "width", "cell": "{width}"},
        "clients": {"label": "clients", "cell": "{clients}"},
        "colibri": {
            "label": "colibri tok/s (decoding)",
            "cell": "{colibri.aggregate:.1f} ({colibri.decoding:.1f})",
        },
        "vs1": {"label": "vs 1 client", "cell": "{vs_one_client.aggregate:x}"},
        "llama": {"label": "llama-server tok/s", "cell": "{llama_server.aggregate:.1f}"},
        "ratio": {"label": "colibri / llama-server", "cell": "{ratio:x}"},
        "roof": {"label": "roofline / bound tok/s", "cell": "{roofline_tok_s} / {bound_tok_s}"},
        "ofroof": {"label": "of roofline", "cell": "{colibri_of_roofline.aggregate:pct}"},
        "ofbound": {
            "label": "of bound (decoding)",
            "cell": "{colibri_of_bound.aggregate:pct} ({colibri_of_bound.decoding:pct})",
        },
        "latency": {"label": "p50 / p99 s", "cell": "{p50_s:.2f} / {p99_s:.2f}"},
    }
    view = [
        "width",
        "clients",
        "colibri",
        "vs1",
        *(["llama", "ratio"] if peer else []),
        "roof",
        "ofroof",
        "ofbound",
    ]
    return {
        "title": ("Serving many clients against llama-server, " if peer else "Serving many clients, ")
        + machine["cpu"].split(",")[0],
        "axis": ["serving"],
        "machine": machine,
        "date": runs[0].get("date", ""),
        "commit": B.commit_of(infos),
        "peer": (
            f"llama-server ({a.get('llama_server')}), `-t {threads} -tb {threads} -np 16 -cb`, the same "
            "weights "
            f"as GGUF ({Path(str(a.get('gguf'))).name})"
        )
        if peer
        else None,
        "method": (
            f"serve_bench.py: the server in its own process with {threads} threads, N client threads on the "
            f"same machine, each sending {a.get('requests', '?')} {a.get('max_tokens', '?')}-token requests "
            "(16-token prompts) one after the other; aggregate = completion tokens / wall time (prompts and "
            "HTTP included); streamed requests; decoding rate = B / the median time per output token after "
            f"the first; {a.get('reps', '?')} runs per cell, servers alternating, medians; a read probe "
            "before each run; R (multi-token rate for the arithmetic bound) "
            f"{rates[0]:.0f}-{rates[-1]:.0f} GMAC/s"
        ),
        "commands": [
            r.get("command") or "python benches/serve_bench.py (the raw run did not record its command)"
            for r in runs
        ],
        "columns": columns,
        "views": {
            "serving": {"columns": view},
            "latency": {"columns": ["width", "clients", "colibri", "latency"]},
        },
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, nargs="?", help="the .colibri file to serve (not with --report)")
    ap.add_argument("--label", help="the model's name in the tables (default: its folder and file name)")
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="runs per cell (the median is reported)")
    ap.add_argument(
        "--bandwidth",
        type=float,
        help="read bandwidth, bytes/s, for the roofline (default: measured now with bench.py's probe)",
    )
    ap.add_argument("--json", type=Path, help="write the raw run here")
    ap.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary, to compare against")
    ap.add_argument("--gguf", type=Path, help="the same weights as GGUF, for --llama-server")
    ap.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="RAW",
        help="print the table of saved raw runs (--json files, one model each) instead of measuring",
    )
    ap.add_argument(
        "--results",
        metavar="NAME",
        help="write the run (or the --report runs) as benches/results/NAME.json for docs/benchmarks.md",
    )
    ap.add_argument("--force", action="store_true", help="with --results: replace an existing results file")
    args = ap.parse_args(argv)
    if (args.llama_server is None) != (args.gguf is None):
        ap.error("--llama-server and --gguf go together")
    if (args.model is None) == (args.report is None):
        ap.error("give a MODEL to measure or --report RAW files, not both")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import render_results as R

    target = R.results_path(args.results) if args.results else None
    if target:
        R.refuse_overwrite([target], args.force)  # before measuring, not after
    if args.report:
        runs = [json.loads(p.read_text()) for p in args.report]
    else:
        run = measure(args)
        run["command"] = _bench().command_line("serve_bench.py", sys.argv[1:] if argv is None else argv)
        path = args.json
        if path is None and target:
            path = (
                Path(__file__).resolve().parent / ".cache" / f"serve-{run['started'].replace(':', '')}.json"
            )
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(run, indent=1))
            print(f"raw run: {path}", file=sys.stderr)
        runs = [run]
    data = serve_results(runs)
    print(R.render_data(target.name if target else "(not written)", data, "serving"))
    if target:
        R.write({target: data}, args.force)
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One run of the bench on args.model: the raw run --json writes."""
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    cost = step_cost(args.model)
    rate = mac_rate(args.model, args.threads, cost)
    print(
        f"multiply-add rate of a 128-token forward, {args.threads} threads: {rate / 1e9:.0f} GMAC/s; "
        f"a decode token costs {cost.dense_macs / 1e6:.0f} M outside the routed experts",
        flush=True,
    )
    bench = _bench()  # the same probe bench.py reports

    def bandwidth() -> float:
        """Read bandwidth in bytes/s now: --bandwidth, or the probe's median
        of 7 passes (a shared machine's bandwidth moves by half within
        minutes, so each run gets its own)."""
        if args.bandwidth is not None:
            return args.bandwidth
        return bench.bandwidth(args.threads, reps=7)["median"] * 1e9

    probe: dict[str, Any] = {"given_bytes_per_s": args.bandwidth}
    if args.bandwidth is None:
        bw = bench.bandwidth(args.threads)
        probe = {k: bw[k] for k in ("method", "median", "best")}
        print(
            f"read bandwidth, {args.threads} threads ({bw['method']}): median {bw['median']:.1f} GB/s, "
            f"best {bw['best']:.1f} GB/s; each run's roofline uses a probe taken just before it",
            flush=True,
        )
    servers = {}
    port = free_port()
    cmd = [sys.executable, "-m", "colibri", "serve", str(args.model), "--threads", str(args.threads)]
    cmd += ["--port", str(port), "--max-batch", "16", "--max-queue", "0"]
    servers["colibri"] = (cmd, f"http://127.0.0.1:{port}")
    if args.llama_server:
        port = free_port()
        slots = 16
        ctx = slots * (16 + args.max_tokens + 16)
        cmd = [
            str(args.llama_server),
            "-m",
            str(args.gguf),
            "-t",
            str(args.threads),
            "-tb",
            str(args.threads),
        ]
        cmd += ["-np", str(slots), "-cb", "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port)]
        servers["llama-server"] = (cmd, f"http://127.0.0.1:{port}")
    rows = []
    # Every server runs for the whole bench (an idle one waits without using
    # the cores) and the runs alternate between them, server by server within
    # each repetition of a cell: a shared machine's speed drifts within
    # minutes, and alternating puts both engines in the same drift.
    clients = [int(x) for x in args.clients.split(",")]
    base: dict[str, float] = {}
    base_decode: dict[str, float] = {}
    with ExitStack() as stack:
        for cmd, url in servers.values():
            stack.enter_context(running(cmd, url))
            run(url, 1, 1, 8)  # warm-up: page the weights in
        for b in clients:
            step = cost.bytes(b)
            row: dict[str, Any] = {"clients": b, "step_bytes": step}
            reps: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
            for _ in range(args.reps):
                for name, (_cmd, url) in servers.items():
                    bw = bandwidth()
                    r = run(url, b, args.requests, args.max_tokens)
                    r["bandwidth"] = bw
                    r["roofline_tok_s"] = b * bw / step
                    r["of_roofline"] = r["tok_s"] / r["roofline_tok_s"]
                    r["decode_of_roofline"] = r["decode_tok_s"] / r["roofline_tok_s"]
                    r["bound_tok_s"] = b / cost.bound_seconds(b, bw, rate)
                    r["of_bound"] = r["tok_s"] / r["bound_tok_s"]
                    r["decode_of_bound"] = r["decode_tok_s"] / r["bound_tok_s"]
                    reps[name].append(r)
            for name, rs in reps.items():
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                base.setdefault(name, med["tok_s"])
                row[name] = med
                runs = ", ".join(f"{r['of_roofline']:.0%}" for r in rs)
                print(
                    f"{name:>12} {b:3d} clients: {med['tok_s']:7.1f} tok/s "
                    f"({med['tok_s'] / base[name]:4.2f}x one), "
                    f"p50 {med['p50']:.2f} s, p99 {med['p99']:.2f} s; step {step / 1e6:.0f} MB, "
                    f"roofline {med['roofline_tok_s']:.0f} tok/s at {med['bandwidth'] / 1e9:.1f} GB/s "
                    f"({med['of_roofline']:.0%}; runs {runs})",
                    flush=True,
                )
                druns = ", ".join(f"{r['decode_of_roofline']:.0%}" for r in rs)
                print(
                    f"{'':>12} {b:3d} clients: decoding {med['decode_tok_s']:7.1f} tok/s "
                    f"({med['decode_tok_s'] / base_decode.setdefault(name, med['decode_tok_s']):4.2f}x one), "
                    f"{med['tpot'] * 1e3:.1f} ms per token after the first "
                    f"({med['decode_of_roofline']:.0%} of the roofline; runs {druns})",
                    flush=True,
                )
                print(
                    f"{'':>12} {b:3d} clients: bound with the arithmetic {med['bound_tok_s']:.0f} tok/s "
                    f"({med['bound_tok_s'] / med['roofline_tok_s']:.0%} of the roofline); "
                    f"aggregate {med['of_bound']:.0%} of it, decoding {med['decode_of_bound']:.0%}",
                    flush=True,
                )
            if "llama-server" in row:
                pairs = [x["tok_s"] / y["tok_s"] for x, y in zip(reps["colibri"], reps["llama-server"])]
                row["ratio_pairs"] = pairs
                print(
                    f"{'':>12} {b:3d} clients: colibri / llama-server = "
                    f"{row['colibri']['tok_s'] / row['llama-server']['tok_s']:.2f}x "
                    f"(run by run: {', '.join(f'{x:.2f}' for x in pairs)})",
                    flush=True,
                )
            rows.append(row)
    return {
        "started": started,
        "date": started[:10],
        "label": args.label or f"{args.model.resolve().parent.name} {args.model.stem}",
        "args": {
            "model": str(args.model),
            "threads": args.threads,
            "clients": clients,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "llama_server": str(args.llama_server) if args.llama_server else None,
            "gguf": str(args.gguf) if args.gguf else None,
        },
        "machine_info": bench.machine_info(),
        "bandwidth_probe": probe,
        "mac_rate": rate,
        "rows": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
