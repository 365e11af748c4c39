#!/usr/bin/env python3
"""Replicas behind Ray Serve against one `colibri serve`, on the demo model
(or --model FILE).

Two setups on the same machine, taking turns run by run, each run on a
server started for it (never both up at once, so neither pays for the
other's idle processes):

* direct: `colibri serve --demo --threads T` (one engine, T threads);
* ray: `colibri serve --demo --ray --replicas N --threads-per-replica T/N`
  (a local Ray cluster on 127.0.0.1, N engines of T/N threads behind the
  Serve proxy and colibri.ray's front).

For each: C client threads send /v1/completions requests one after another
(`--requests` each, `--max-tokens` tokens, ignore_eos, greedy), streamed and
then not. Aggregate tokens/s = all completion tokens / wall time of the run;
decode tokens/s (streamed runs) = C / the median time per output token after
the first. Then `--latency` requests for 1 token, one at a time: the median
latency, whose difference between the setups is what the proxy and front
add to a request. `--reps` runs of each; medians are printed.

    python benches/ray_serve_bench.py --clients 8 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx

PROMPTS = ["Emma was", "The house", "Her sister", "The letter", "Mr. Knightley", "The ball", "It was", "She"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running(model: list[str], flags: list[str]) -> Iterator[str]:
    """`colibri serve MODEL FLAGS` on a free loopback port until /health is ok; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "colibri", "serve", *model, "--port", str(port), *flags]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {server.returncode}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(cmd)} did not come up")
            time.sleep(0.2)
        yield url
    finally:
        server.send_signal(2)  # SIGINT: the Ray setup takes its cluster down
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


def prompt(i: int, ids: bool) -> Any:
    """The i-th prompt: text for the demo, 16 token ids for a model without a tokenizer."""
    return [(i * 97 + j * 13 + 5) % 50000 for j in range(16)] if ids else PROMPTS[i % len(PROMPTS)]


def load(url: str, clients: int, requests: int, max_tokens: int, stream: bool, ids: bool) -> dict[str, float]:
    def one(k: int) -> list[tuple[int, float]]:
        """(completion tokens, time per token after the first) of client k's requests."""
        out = []
        with httpx.Client(timeout=600) as http:
            for r in range(requests):
                body = {
                    "prompt": prompt(k * requests + r, ids),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": stream,
                }
                if ids:
                    body["return_token_ids"] = True  # no tokenizer: no text to return
                if not stream:
                    resp = http.post(url + "/v1/completions", json=body)
                    resp.raise_for_status()
                    out.append((resp.json()["usage"]["completion_tokens"], 0.0))
                    continue
                first = last = None
                tokens = 0
                with http.stream("POST", url + "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        now, chunk = time.perf_counter(), json.loads(line[6:])
                        if any(ch.get("finish_reason") is None for ch in chunk["choices"]):
                            tokens += 1
                            first = first or now
                            last = now
                if first is None or last is None or tokens < 2:
                    raise RuntimeError("a stream too short to time")
                out.append((tokens, (last - first) / (tokens - 1)))
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for xs in pool.map(one, range(clients)) for x in xs]
    wall = time.perf_counter() - t0
    row = {"tok_s": sum(x[0] for x in results) / wall}
    if stream:
        row["decode_tok_s"] = clients / statistics.median(x[1] for x in results)
    return row


def latency(url: str, n: int, ids: bool) -> float:
    """Median seconds of a 1-token request, one at a time."""
    times = []
    with httpx.Client(timeout=60) as http:
        for i in range(n + 3):
            body = {"prompt": prompt(i, ids), "max_tokens": 1, "temperature": 0, "return_token_ids": ids}
            t = time.perf_counter()
            http.post(url + "/v1/completions", json=body).raise_for_status()
            if i >= 3:  # the first few warm the connection and the caches
                times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_once(flags: list[str], args: argparse.Namespace) -> dict[str, float]:
    """One run of a setup on a server of its own: streamed, whole, latency."""
    ids = args.model is not None
    with running(["--demo"] if args.model is None else [args.model], flags) as url:
        load(url, args.clients, 1, 16, stream=False, ids=ids)  # warm-up
        s = load(url, args.clients, args.requests, args.max_tokens, stream=True, ids=ids)
        whole = load(url, args.clients, args.requests, args.max_tokens, stream=False, ids=ids)
        return {
            "stream_tok_s": s["tok_s"],
            "decode_tok_s": s["decode_tok_s"],
            "whole_tok_s": whole["tok_s"],
            "latency_1_token_ms": latency(url, args.latency, ids) * 1000,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .colibri file, prompted with token ids (default: the demo)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2, help="requests per client per run")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2, help="threads of the direct server, shared by replicas")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--latency", type=int, default=30, help="1-token requests per run")
    ap.add_argument("--json", help="write the medians and every run here")
    args = ap.parse_args()
    per = max(1, args.threads // args.replicas)
    setups = {
        f"direct, {args.threads} threads": ["--threads", str(args.threads)],
        f"ray, {args.replicas} x {per} thread(s)": [
            "--ray",
            "--replicas",
            str(args.replicas),
            "--threads-per-replica",
            str(per),
        ],
    }
    report: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "args": vars(args),
        "setups": {},
    }
    # The setups take turns run by run, so a machine that drifts drifts under both.
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
    for _ in range(args.reps):
        for name, flags in setups.items():
            runs[name].append(measure_once(flags, args))
    for name, rows in runs.items():
        medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        report["setups"][name] = {**medians, "runs": rows}
    each = f"{args.requests} x {args.max_tokens} tokens each"
    print(f"{args.clients} clients, {each}, medians of {args.reps} runs")
    print("| setup | streamed tok/s | decode tok/s | whole tok/s | 1-token latency |")
    print("|---|---|---|---|---|")
    for name, r in report["setups"].items():
        print(
            f"| {name} | {r['stream_tok_s']:.0f} | {r['decode_tok_s']:.0f} | {r['whole_tok_s']:.0f} | "
            f"{r['latency_1_token_ms']:.1f} ms |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
