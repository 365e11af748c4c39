"""Router health, routing windows and the server's live dashboard: the JSON
it reads, the router-health metrics, and the page itself loaded in headless
Chromium against a live server with generations running."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading

import httpx
import pytest
from test_server import client, live

import colibri
from colibri.server import ROUTING_WINDOW, create_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def check_health(layer: dict) -> None:
    """Dead, overloaded and max_load follow from the counts."""
    heat = layer["heat"]
    total = sum(heat)
    uniform = total / len(heat)
    assert layer["dead"] == ([e for e, c in enumerate(heat) if c == 0] if total else [])
    assert layer["overloaded"] == [e for e, c in enumerate(heat) if c > 3 * uniform]
    assert layer["max_load"] == pytest.approx(max(heat) / uniform if total else 0.0)
    assert sum(layer["margin_histogram"]) == layer["tokens"]
    assert layer["mean_margin"] == pytest.approx(layer["margin_sum"] / max(1, layer["tokens"]))


def test_routing_stats_over_a_window():
    e = colibri.Engine.demo(threads=2)
    top_k = e.config["moe"]["router"]["top_k"]
    e.generate("Emma was", max_new_tokens=10, temperature=0)
    a = e.routing_stats()
    out = e.generate("The house", max_new_tokens=20, temperature=0)
    b = e.routing_stats()
    w = e.routing_stats(since=a)
    ran = len(e.tokenize("The house")) + len(out.token_ids) - 1  # the last token is never fed back
    assert w["tokens"] == b["tokens"] - a["tokens"] == ran
    main = e.num_layers  # the multi-token-prediction layer after them runs only when drafting
    assert len(w["layers"]) == main + int(e.has_mtp)
    assert all(layer["tokens"] == 0 for layer in w["layers"][main:])
    for la, lb, lw in zip(a["layers"][:main], b["layers"][:main], w["layers"][:main]):
        assert lw["tokens"] == ran
        assert lw["heat"] == [y - x for x, y in zip(la["heat"], lb["heat"])]
        assert sum(lw["heat"]) == top_k * ran
        assert lw["residency"] == "R" * len(lw["heat"])
        check_health(lw)
        check_health(lb)
    # The same window ended at the snapshot in hand, after more tokens ran.
    e.generate("Her sister", max_new_tokens=5, temperature=0)
    assert e.routing_stats(since=a, until=b) == w
    assert e.routing_stats(until=b) == b
    with pytest.raises(ValueError, match="earlier"):
        e.routing_stats(since=b, until=a)
    with pytest.raises(ValueError, match="until"):
        e.routing_stats(since=a, until={"tokens": "many"})
    b = e.routing_stats()
    # Nothing ran since b: an empty window, nobody called dead.
    assert all(lay["dead"] == [] and lay["tokens"] == 0 for lay in e.routing_stats(since=b)["layers"])
    with pytest.raises(ValueError, match="earlier"):
        e.routing_stats(since={**b, "tokens": b["tokens"] + 1})
    with pytest.raises(ValueError, match="since"):
        e.routing_stats(since={"tokens": "many"})


def test_a_streaming_engine_reports_where_each_expert_is():
    demo = colibri.Engine.demo()
    budget = colibri.plan(demo.path)["min_budget"]
    e = colibri.Engine.demo(threads=2, ram_budget=budget, heat_file="off")
    e.generate("Emma was", max_new_tokens=8, temperature=0)
    layers = e.routing_stats()["layers"]
    for layer in layers:
        assert len(layer["residency"]) == len(layer["heat"])
        assert set(layer["residency"]) <= {"P", "C", "."}
    assert any("." in layer["residency"] for layer in layers), "a minimum budget leaves experts on disk"


def busy(url: str, n: int, tokens: int) -> threading.Thread:
    """Runs ``n`` sampled completions of ``tokens`` tokens in the background."""

    def run() -> None:
        c = client(url)
        for i in range(n):
            c.completions.create(model="demo", prompt=f"Emma {i}", max_tokens=tokens, temperature=0.8, seed=i)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_dashboard_data_and_router_metrics():
    e = colibri.Engine.demo(threads=2)
    with live(create_app(e, api_key="sesame")) as url:
        # The page itself holds no data and needs no key; its data does.
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert 'id="heatmap"' in page.text and "dashboard/data" in page.text
        assert "http" not in re.sub(r"<!--.*?-->", "", page.text, flags=re.S), "no external resources"
        assert httpx.get(url + "/dashboard/data").status_code == 401
        auth = {"Authorization": "Bearer sesame"}
        c = client(url, "sesame")
        for i in range(6):
            c.completions.create(model="demo", prompt=f"Emma {i}", max_tokens=40, temperature=0.8, seed=i)
            d = httpx.get(url + "/dashboard/data", headers=auth).json()
        assert d["model"] == "demo" and d["top_k"] == 2 and d["routing_window"] == ROUTING_WINDOW
        assert d["generated_tokens"] == 240 and d["queue"] == 0 and d["running"] == 0
        assert d["tokens_per_second_out"] > 0 and d["ttft_p50"] > 0
        layers = d["routing"]["layers"]
        assert len(layers) == e.num_layers + int(e.has_mtp)  # the MTP layer last
        total = e.routing_stats()["tokens"]
        assert total < ROUTING_WINDOW
        for layer in layers[: e.num_layers]:
            # The window, or everything when less has run.
            assert layer["tokens"] == total
            assert sum(layer["heat"]) == 2 * layer["tokens"]
            check_health(layer)
        text = httpx.get(url + "/metrics", headers=auth).text
        for name in ("dead_experts", "overloaded_experts", "max_load", "top1_margin"):
            assert re.search(rf'^colibri_router_{name}{{layer="3"}} [0-9.e+-]+$', text, re.M), name


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_the_dashboard_in_headless_chromium(tmp_path):
    e = colibri.Engine.demo(threads=2, max_batch=8)
    with live(create_app(e)) as url:
        # Routing to show before the page opens, and more while it polls.
        for i in range(3):
            client(url).completions.create(model="demo", prompt=f"Emma {i}", max_tokens=64, temperature=0)
        load = [busy(url, 3, 96) for _ in range(3)]

        def chromium(*args: str) -> str:
            cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,1000"]
            # Virtual time runs the page's timers (one poll a second) for 5 s.
            cmd += ["--virtual-time-budget=5000", *args, url + "/"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr[-2000:]
            return r.stdout

        dom = chromium("--dump-dom")
        png = tmp_path / "dashboard.png"
        chromium(f"--screenshot={png}")
        for t in load:
            t.join(120)
    updates = int(re.search(r'<body data-updates="(\d+)"', dom).group(1))
    assert updates >= 2, "the page polled its data more than once"
    canvas = re.search(r'<canvas id="heatmap"([^>]*)>', dom).group(1)
    attrs = dict(re.findall(r'data-(\w+)="([^"]*)"', canvas))
    assert (int(attrs["layers"]), int(attrs["experts"])) == (e.num_layers + int(e.has_mtp), 8)
    assert 0 < int(attrs["nonzero"]) <= (e.num_layers + int(e.has_mtp)) * 8, "the heat map filled"
    rows = re.findall(r'<tr data-layer="(\d+)">', dom)
    assert [int(r) for r in rows] == list(range(e.num_layers + int(e.has_mtp))), (
        "one router-health row per MoE layer"
    )
    assert re.search(r'id="model">demo<', dom)
    tok_out = re.search(r'id="tok-out">([^<]*)<', dom).group(1)
    assert re.fullmatch(r"[0-9,]+\.[0-9]", tok_out), tok_out
    assert re.search(r'id="running">\d+ / 8<', dom)
    assert 'class="bad"' not in dom, "the page reported an error"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, "a screenshot with something drawn"


def test_colibri_stats_plots_the_heat_map(tmp_path):
    budget = colibri.plan(colibri.Engine.demo().path)["min_budget"]
    out = tmp_path / "heat.png"
    cmd = [sys.executable, "-m", "colibri", "stats", "--demo", "Emma was", "--max-new-tokens", "12"]
    r = subprocess.run(
        [*cmd, "--ram", str(budget), "--plot", str(out)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "max load" in r.stdout and "dead" in r.stdout and "overloaded" in r.stdout
    assert "weights: streamed" in r.stdout
    assert f"wrote the routing heat map to {out}" in r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # Somewhere it cannot write: a clean error, no traceback.
    r = subprocess.run(
        [*cmd, "--plot", str(tmp_path / "no" / "such" / "dir" / "heat.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "heat.png" in r.stderr and "Traceback" not in r.stderr
