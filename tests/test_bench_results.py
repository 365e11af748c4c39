"""docs/benchmarks.md shows what benches/results/*.json hold: the tables are rendered from the
files by benches/render_results.py, and this test fails when either changes without the other."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benches" / "render_results.py"
DOC = ROOT / "docs" / "benchmarks.md"


def check(doc: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--doc", str(doc)], capture_output=True, text=True
    )


def test_doc_matches_the_results_files() -> None:
    r = check(DOC)
    assert r.returncode == 0, r.stderr


def test_the_readme_speed_table_matches_the_results_files() -> None:
    # Without --doc the script renders docs/benchmarks.md and README.md together.
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "<!-- render: xeon-2026-12-01-bench.json readme -->" in (ROOT / "README.md").read_text()


def test_a_changed_figure_is_caught(tmp_path: Path) -> None:
    text = DOC.read_text()
    assert "857.5 / 257.7" in text
    stale = tmp_path / "benchmarks.md"
    stale.write_text(text.replace("857.5 / 257.7", "858.5 / 257.7", 1))
    r = check(stale)
    assert r.returncode == 1
    assert "xeon-2026-12-01-bench.json" in r.stderr


def test_every_results_file_says_where_when_and_what() -> None:
    files = sorted((ROOT / "benches" / "results").glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        for key in ("machine", "date", "commit", "commands", "rows"):
            assert data.get(key), f"{path.name}: no {key}"
        assert data["machine"].get("cpu"), path.name


# ---------------------------------------------------------------- the bench scripts' --results
#
# Each bench script turns its raw run (what its --json writes) into a results file with a pure
# function; these feed each one a small hand-made raw run of that shape, since the peers and the
# bench models are too big for a test.

sys.path.insert(0, str(ROOT / "benches"))

import bench  # noqa: E402
import render_results  # noqa: E402
import serve_bench  # noqa: E402
import store_bench  # noqa: E402

MACHINE_INFO = {
    "cpu_model": "Intel(R) Xeon(R) Platinum 8488C",
    "logical_cores": 2,
    "isa": "avx2 fma f16c avx512f avx512_bf16",
    "ram_gib": "23",
    "kernel": "6.18.0",
    "versions": ["Python 3.11.9", "NumPy 2.2.0", "llama-cpp-python 0.3.36"],
    "colibri": {
        "commit": "abc1234",
        "dirty": False,
        "root": "/src",
        "extension": "0123abcd",
        "table": "avx512",
    },
}


def renders(data: dict, name: str) -> list[str]:
    """Every view of a results dict, rendered after the doc's own validation."""
    render_results.validate(data, name)
    json.dumps(data, allow_nan=False)  # strict JSON: no NaN left in
    return [render_results.render_data(name, data, view) for view in data["views"]]


def engine_summary(scale: float, n: int = 3) -> dict:
    return {
        "load_s": 0.2 * scale,
        "open_s": 0.01,
        "peak_rss_mb": 900.0 * scale,
        "decode_tps": 60.0 / scale,
        "n": n,
        "prefill64_tps": 400.0 / scale,
        "ttft64_s": 0.16 * scale,
        "prefill512_tps": 850.0 / scale,
        "ttft512_s": 0.6 * scale,
    }


def bytes_per_token(total_mb: float) -> dict:
    parts = {
        "attention+norms": 20e6,
        "router": 1e6,
        "experts": total_mb * 1e6 - 31e6,
        "embedding row": 0.004e6,
    }
    parts["lm_head"] = 10e6 - 0.004e6
    parts["total"] = sum(parts.values())
    return parts


def bench_raw() -> dict:
    """bench.py's raw run (--json), two thread counts, llama.cpp beside colibri."""
    cells = []
    for threads in (1, 2):
        cells.append(
            {
                "model": "olmoe",
                "layers": 4,
                "ctype": "q8_0",
                "gtype": "Q8_0",
                "threads": threads,
                "bytes_per_token": {"colibri": bytes_per_token(330), "llama.cpp": bytes_per_token(340)},
                "load": "0.50 0.40 0.30 1/200 1234",
                "runs": {"colibri": [], "llama.cpp": []},
                "summary": {
                    "colibri": engine_summary(1 / threads),
                    "llama.cpp": engine_summary(1.5 / threads),
                },
            }
        )
    bandwidth = {
        str(t): {
            "best": 13.0 * t,
            "median": 12.0 * t,
            "method": "C/AVX2 OR-reduction, 2 MiB pages",
            "roofline": 14.0 * t,
        }
        for t in (1, 2)
    }
    return {
        "started": "2026-12-01T10:00:00",
        "load_before": "0.5 0.4 0.3",
        "bandwidth": bandwidth,
        "cells": cells,
        "load_after": "0.6 0.5 0.4",
        "finished": "2026-12-01T11:00:00",
        "command": "python benches/bench.py --models olmoe --pairs q8_0:Q8_0 --threads 1,2",
        "args": {"reps": 3, "decode_tokens": 64, "prompts": "64,512"},
        "machine_info": MACHINE_INFO,
        "machine": bench.machine_facts(MACHINE_INFO),
    }


def test_bench_run_becomes_a_results_file() -> None:
    data = bench.bench_results([bench_raw()])
    tables = dict(zip(data["views"], renders(data, "x-bench.json")))
    assert data["axis"] == ["decode", "prefill"]
    assert data["machine"]["family"] == "xeon-avx512"
    assert data["commit"] == "abc1234"
    assert data["commands"] == ["python benches/bench.py --models olmoe --pairs q8_0:Q8_0 --threads 1,2"]
    # The doc's layout: the most threads only; colibri / llama.cpp (ratio) per cell.
    assert data["views"]["bench"]["where"] == {"threads": [2]}
    assert "| olmoe | q8_0 | avx512 | 120.00 / 80.00 (1.50x) | 800.0 / 533.3 (1.50x) |" in tables["bench"]
    assert "| prefill 64 | prefill 512 |" in tables["bench"]
    assert tables["all"].count("| olmoe |") == 2


def test_an_old_bench_run_without_machine_info_still_converts() -> None:
    raw = bench_raw()
    del raw["machine_info"], raw["command"], raw["args"]
    raw["machine"] = bench.machine_facts(
        {**MACHINE_INFO, "colibri": {**MACHINE_INFO["colibri"], "dirty": True}}
    )
    data = bench.bench_results([raw])
    renders(data, "x-bench.json")
    assert data["commit"] == "abc1234 with uncommitted changes"
    assert "did not record" in data["commands"][0]
    assert data["machine"]["cpu"].startswith("Intel Xeon Platinum 8488C, 2 logical cores")


def test_bench_report_writes_a_results_file(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(render_results, "RESULTS", tmp_path / "results")
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(bench_raw()))
    assert bench.main(["--report", str(raw), "--results", "xeon-test"]) == 0
    out = capsys.readouterr().out
    assert "<!-- render: xeon-test.json bench -->\n<!-- /render -->" in out
    assert "python benches/render_results.py" in out
    assert render_results.render("xeon-test.json", "bench").startswith(
        "*Decode and prefill against llama.cpp"
    )
    # Nothing the user has is replaced without --force.
    with pytest.raises(SystemExit, match="--force"):
        bench.main(["--report", str(raw), "--results", "xeon-test"])
    assert bench.main(["--report", str(raw), "--results", "xeon-test.json", "--force"]) == 0


def store_summary(**kw: float) -> dict:
    s = {
        "n": 3,
        "decode_tps": 10.0,
        "prefill_s": 2.5,
        "open_s": 0.1,
        "hit_rate": 0.5,
        "mb_per_token": 200.0,
        "disk_mb_per_token": 150.0,
        "prefetch_acc": float("nan"),
        "prefetch_wasted": 0.0,
        "io_wait_ms_per_token": 3.0,
        "read_ms_per_token": 4.0,
        "overflow_reads": 0,
        "peak_rss_mb": 1200.0,
        "max_peak_rss_mb": 1210.0,
        "slots": 64,
        "pinned": 0,
        "cg_peak_mb": 1500.0,
        "cg_failcnt": 0,
    }
    s.update(kw)
    return s


def store_raw() -> dict:
    """store_bench.py's raw run (--json) with all three parts."""
    run = {"budget": 1_711_000_000, "rss_limit_mb": 2109.4, "rss_ok": True, "load": "0.9 0.8 0.7"}
    cells = {
        "100|resident|mmap": {
            "summary": store_summary(hit_rate=float("nan"), mb_per_token=0.0, slots=0),
            "runs": [{"budget": None, "rss_limit_mb": 3741.0, "rss_ok": True, "load": "0.5 0.5 0.5"}],
        },
        "50|lru|buffered": {"summary": store_summary(), "runs": [run]},
        "50|lru|direct": {"summary": store_summary(decode_tps=8.0), "runs": [run]},
        "50|no-cache|direct": {"summary": store_summary(hit_rate=0.0), "runs": [run]},
    }
    limit_cells = {
        "100|llama": {"summary": store_summary(), "errors": [], "limit": None, "runs": []},
        "100|colibri-direct": {"summary": store_summary(), "errors": [], "limit": None, "runs": []},
        "50|llama": {"summary": None, "errors": ["killed"], "limit": 2_480_000_000, "runs": []},
        "50|colibri-direct": {"summary": store_summary(), "errors": [], "limit": 2_480_000_000, "runs": []},
    }
    demo_cells = {
        f"{per}|{pol}": {
            "summary": store_summary(hit_rate=0.4 + per / 10, mb_per_token=1.2, pinned=4),
            "runs": [],
        }
        for per in (2, 3)
        for pol in ("no-cache", "lru", "lru+pin")
    }
    when = {"start": "10:00", "end": "11:00 UTC", "load_before": "0.5 0.4 0.3", "load_after": "1.0 0.9 0.8"}
    return {
        "date": "2026-11-29 12:00 UTC",
        "machine": bench.machine_facts(MACHINE_INFO).replace("\n", " "),
        "machine_info": MACHINE_INFO,
        "args": {
            "shape": "olmoe",
            "layers": 8,
            "dtype": "q8_0",
            "threads": 2,
            "prompt": 32,
            "decode": 32,
            "reps": 3,
            "limit_policy": "lru",
            "limit_decode": 16,
        },
        "disk": "1073741824 bytes (1.1 GB, 1.0 GiB) copied, 1.66 s, 647 MB/s",
        "plan": {
            "file_bytes": 3_790_000_000,
            "dense_bytes": 366_000_000,
            "expert_bytes": 3_420_000_000,
            "moe_layers": 8,
            "experts": 512,
            "slot_bytes": 6_680_000,
            "top_k": 8,
        },
        "cells": cells,
        "all_same_tokens": True,
        "all_rss_ok": True,
        "random_when": {
            **when,
            "date": "2026-11-29",
            "command": "python benches/store_bench.py --parts random",
        },
        "limit_cells": limit_cells,
        "llama_version": "0.3.36",
        "limit_when": when,
        "demo_plan": {"moe_layers": 4, "experts": 32, "top_k": 2, "slot_bytes": 294912},
        "demo_text": {"learn_tokens": 16384, "test_prompts": 24, "prompt_tokens": 32, "decode_tokens": 48},
        "demo_same_tokens": True,
        "demo_cells": demo_cells,
        "demo_pin_by_slots": {"2": [1, 1, 1, 1], "3": [1, 1, 1, 1]},
        "demo_when": when,
    }


def test_store_run_becomes_one_results_file_per_part() -> None:
    files = store_bench.store_results(store_raw())
    assert sorted(files) == ["budgets", "demo", "limit"]
    budgets, limit, demo = (renders(files[p], f"x-{p}.json") for p in ("budgets", "limit", "demo"))
    assert "| 50% (1711 MB) | lru | direct | 8.00 | 0.500 | 200.0 | 1200 / 2109 |" in budgets[0]
    assert "| 100% (resident) | resident | mmap | 10.00 |  | 0.0 | 1200 / 3741 |" in budgets[0]
    assert "no-cache" not in budgets[0]
    # Under a limit the doc shows the limited rows, and how many runs failed when one did.
    assert "none" not in limit[0] and "| 50% (2480 MB) | llama.cpp (mmap) |  |  |  |  | 1 |" in limit[0]
    assert "| 3 | lru+pin | 0.700 | 1172 |" in demo[0]
    assert files["demo"]["rows"][-1]["pinned_per_layer"] == "1/1/1/1"
    assert "647 MB/s" in files["budgets"]["machine"]["cpu"]
    assert files["budgets"]["commands"] == ["python benches/store_bench.py --parts random"]
    assert files["limit"]["date"] == "2026-11-29" and "did not record" in files["limit"]["commands"][0]


def test_store_report_writes_results_files(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(render_results, "RESULTS", tmp_path / "results")
    raw = tmp_path / "store-run.json"
    raw.write_text(json.dumps(store_raw()))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "epyc-test-limit.json").write_text("{}")
    with pytest.raises(SystemExit, match="epyc-test-limit.json"):
        store_bench.main(["--report", str(raw), "--results", "epyc-test"])
    assert not (tmp_path / "results" / "epyc-test-budgets.json").exists()  # nothing half-written
    assert store_bench.main(["--report", str(raw), "--results", "epyc-test", "--force"]) == 0
    out = capsys.readouterr().out
    for part in ("budgets", "limit", "demo"):
        assert f"<!-- render: epyc-test-{part}.json streaming -->" in out
        render_results.render(f"epyc-test-{part}.json", "streaming")


def serve_cell(tok_s: float, clients: int) -> dict:
    """One server's medians for one cell, as serve_bench.py's run() and main() leave them."""
    roofline, bound = 160.0 * clients**0.5, 150.0 * clients**0.4
    return {
        "tok_s": tok_s,
        "p50": 0.55,
        "p99": 0.61,
        "tokens": 128 * clients,
        "tpot": clients / (tok_s * 1.1),
        "decode_tok_s": tok_s * 1.1,
        "bandwidth": 30e9,
        "roofline_tok_s": roofline,
        "of_roofline": tok_s / roofline,
        "decode_of_roofline": tok_s * 1.1 / roofline,
        "bound_tok_s": bound,
        "of_bound": tok_s / bound,
        "decode_of_bound": tok_s * 1.1 / bound,
    }


def serve_raw(label: str, llama: bool = True) -> dict:
    """serve_bench.py's raw run (--json): one model, two client counts."""
    rows = []
    for clients, tok_s in ((1, 100.0), (8, 180.0)):
        row = {"clients": clients, "step_bytes": 3e8, "colibri": serve_cell(tok_s, clients)}
        if llama:
            row["llama-server"] = serve_cell(tok_s / 2, clients)
            row["ratio_pairs"] = [2.0, 1.9, 2.1]
        rows.append(row)
    return {
        "started": "2026-12-05T09:00:00",
        "date": "2026-12-05",
        "label": label,
        "args": {
            "model": "m.colibri",
            "threads": 2,
            "clients": [1, 8],
            "requests": 2,
            "max_tokens": 64,
            "reps": 3,
            "llama_server": "/opt/llama-server" if llama else None,
            "gguf": "/m/model-Q4_0.gguf" if llama else None,
        },
        "machine_info": MACHINE_INFO,
        "bandwidth_probe": {"method": "C/AVX2", "median": 30.0, "best": 33.0},
        "mac_rate": 1.2e11,
        "rows": rows,
        "command": f"python benches/serve_bench.py {label}.colibri --clients 1,8",
    }


def test_serve_runs_become_a_results_file() -> None:
    data = serve_bench.serve_results([serve_raw("OLMoE"), serve_raw("Qwen3")])
    serving, latency = renders(data, "x-serve.json")
    assert "| OLMoE | 8 | 180.0 (198.0) | 1.80x | 90.0 | 2.00x | 453 / 345 | 40% | 52% (57%) |" in serving
    assert serving.count("| Qwen3 |") == 2 and len(data["commands"]) == 2
    assert "llama-server (/opt/llama-server)" in data["peer"]
    assert "read probe 30.0 GB/s on 2 thread(s)" in data["machine"]["cpu"]
    alone = serve_bench.serve_results([serve_raw("OLMoE", llama=False)])
    assert alone["peer"] is None and "llama" not in alone["views"]["serving"]["columns"]
    renders(alone, "x-serve.json")


def test_serve_report_writes_a_results_file(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(render_results, "RESULTS", tmp_path / "results")
    raw = tmp_path / "serve.json"
    raw.write_text(json.dumps(serve_raw("OLMoE")))
    assert serve_bench.main(["--report", str(raw), "--results", "zen-test"]) == 0
    assert "<!-- render: zen-test.json serving -->" in capsys.readouterr().out
    assert render_results.render("zen-test.json", "serving").startswith(
        "*Serving many clients against llama-server"
    )


import context_bench  # noqa: E402


def context_raw() -> dict:
    """context_bench.py's raw run: DSA and its dense twin at two contexts, plus a real prefill."""
    runs = []
    for ctx, fill, dsa, dense in ((2048, 256, 10.0, 10.5), (32768, 256, 8.0, 2.0), (2048, 2048, 9.8, 10.4)):
        for rep in range(1 if fill == ctx else 3):
            for variant, tok_s in (("dsa", dsa + rep * 0.1), ("dense", dense)):
                runs.append(
                    {
                        "model": "deepseek_v32",
                        "variant": variant,
                        "rep": rep,
                        "ctx": ctx,
                        "fill": fill,
                        "prefill_s": 1.0,
                        "decode_tokens": 16,
                        "decode_s": 16 / tok_s,
                        "median_step_s": 1 / tok_s,
                        "tok_s": tok_s,
                        "threads": 2,
                        "load_avg": "2.0 2.0 2.0",
                    }
                )
    return {
        "started": "2026-12-06T17:00:00",
        "runs": runs,
        "command": "python benches/context_bench.py --contexts 2048,32768 --check 2048",
        "machine_info": MACHINE_INFO,
    }


def test_context_run_becomes_a_results_file() -> None:
    args = argparse.Namespace(layers=4, type="q8_0", threads=2, fill=256, tokens=16)
    data = context_bench.results(context_raw(), args)
    (table,) = renders(data, "x-context.json")
    # Medians of three; DSA at 32k against its own 2k speed and against dense MLA there.
    dsa_32k = "| deepseek_v32 | dsa | 32768 | copied | 8.10 | 123.5 | 80% | 8.20 | 80% | 4.05x | met | 3 |"
    assert dsa_32k in table
    assert "| deepseek_v32 | dense | 32768 | copied | 2.00 | 500.0 | 19% | 2.00 | 19% |  |  | 3 |" in table
    assert "| deepseek_v32 | dsa | 2048 | prefilled | 9.80 |" in table


def test_best_runs_and_the_targets_they_mark() -> None:
    raw = bench_raw()
    cell = raw["cells"][1]
    cell["model"] = "glm4_7_flash"
    run = {"decode_n": 64, "prefill64_s": 0.16, "prefill512_s": 0.6}
    # Three runs each; one llama.cpp run disturbed by other work (its decode collapses).
    cell["runs"] = {
        "colibri": [{**run, "decode_s": 64 / v} for v in (50.0, 60.0, 55.0)],
        "llama.cpp": [{**run, "decode_s": 64 / v} for v in (40.0, 4.0, 44.0)],
    }
    data = bench.bench_results([raw])
    row = next(r for r in data["rows"] if r["shape"] == "glm4_7_flash")
    assert row["decode_best"] == {"colibri": 60.0, "llama": 44.0, "ratio": 1.36}
    assert row["targets"]["decode_ratio"] == "met"  # on the best runs: 60 / 44
    tables = dict(zip(data["views"], renders(data, "x-bench.json")))
    assert "| glm4_7_flash | q8_0 | 60.00 / 44.00 (1.36x) |" in tables["best"]
    assert "decode ≥ 1.3x llama.cpp, best runs" in tables["targets"]


import spec_bench  # noqa: E402


def spec_raw() -> dict:
    """spec_bench.py's raw run: colibri's modes and llama.cpp's, two rounds, one client count."""
    speed = {"none": 100.0, "ngram:4": 150.0, "mtp:2": 130.0, "llama:none": 80.0, "llama:ngram:4": 60.0}
    plain = [1, 2, 3, 4]
    runs: dict = {}
    for mode, tps in speed.items():
        runs[mode] = []
        for rnd in range(2):
            figures: dict = {}
            for p in ("edit", "fresh"):
                figures[f"{p}_one"] = tps + rnd
                figures[f"{p}_per_pass"] = 1.0 if mode.endswith("none") else 2.5
                figures[f"{p}_drafted"] = 0 if mode.endswith("none") else 6
                figures[f"{p}_accepted"] = 0 if mode.endswith("none") else 3
                if not mode.startswith("llama:"):
                    figures[f"{p}_x8"] = 4 * tps
            # llama.cpp parts from colibri at the third token of the edit prompt, and its
            # prompt lookup from its own plain run at the fourth.
            edit = {"llama:none": [1, 2, 9, 9], "llama:ngram:4": [1, 2, 9, 8]}.get(mode, plain)
            runs[mode].append({"figures": figures, "tokens": {"edit": edit, "fresh": plain}})
    return {
        "args": {"tokens": 4, "threads": 2, "clients": [8], "gguf": "/c/demo-bf16.gguf", "llama_kv": "f32"},
        "command": "python benches/spec_bench.py --gguf auto --rounds 2",
        "model": "the demo model",
        "prompts": {"edit": 131, "fresh": 15},
        "modes": list(speed),
        "runs": runs,
        "llama_version": "0.3.36",
        "machine_info": MACHINE_INFO,
        "cpu": "AMD EPYC, CPU family 25 model 1, 2 logical cores (avx2 fma f16c)",
        "date": "2026-12-06",
    }


def test_spec_run_becomes_a_results_file() -> None:
    data = spec_bench.spec_results(spec_raw())
    (table,) = renders(data, "x-spec.json")
    assert data["commit"] == "abc1234" and "llama-cpp-python 0.3.36" in data["peer"]
    # colibri rows against colibri's none (and llama.cpp's none); llama.cpp rows against llama.cpp's none.
    assert "| edit | ngram:4 | 150 | 1.50x | 2.50 | 3/6 | yes | 4/4 | 1.87x | 600 (1.50x) |" in table
    assert "| edit | llama:ngram:4 | 60 | 0.75x | 2.50 | 3/6 | no | 2/4 |  |  |" in table
    assert "| fresh | llama:none | 80 | 1.00x | 1.00 | 0/0 | yes | 4/4 |  |  |" in table
    lines = spec_bench.report_lines(spec_raw(), spec_bench.summarize(spec_raw()))
    ratios = "edit 1.25x (100 / 80 tok/s), fresh 1.25x (100 / 80 tok/s)"
    assert lines[-1] == f"\ncolibri none vs llama:none, one sequence: {ratios}"


def test_spec_report_writes_a_results_file(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(render_results, "RESULTS", tmp_path / "results")
    raw = tmp_path / "spec.json"
    raw.write_text(json.dumps(spec_raw()))
    spec_bench.main(["--report", str(raw), "--save", "zen3-test-spec"])
    assert "<!-- render: zen3-test-spec.json speculative -->" in capsys.readouterr().out
    assert render_results.render("zen3-test-spec.json", "speculative").startswith("*Speculative decoding")
    with pytest.raises(SystemExit, match="--force"):
        spec_bench.main(["--report", str(raw), "--results", "zen3-test-spec"])
