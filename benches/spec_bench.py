"""Speculative decoding with n-gram and MTP drafts against plain decoding, and
llama.cpp's prompt lookup decoding on the same model as the peer.

Greedy decode tokens/s of one sequence (``--tokens`` new tokens; the time
after the first token, so prefill is apart), and aggregate tokens/s of several
sequences at once (``--clients``), with drafts of up to K tokens and without. Prompts:

- ``edit``: a passage given twice and begun a third time, as a code edit
  gives the file it changes: output that repeats its input, where drafts pay;
- ``fresh``: a passage's opening with nothing repeated, where drafts rarely
  come or hold, to show what trying costs.

colibri's modes: ``none``; ``ngram:K`` (n-gram drafts of up to K tokens);
``predict:K``, the same with the plain run's own output given as the
prediction (OpenAI's predicted outputs at their best: every draft right);
``mtp:K`` (drafts of up to K tokens from the model's multi-token-prediction
layer, ``--mtp``; only for a model file that has one, else skipped with a note).

llama.cpp's modes (with ``--gguf``, the same model as a GGUF): ``llama:none``
and ``llama:ngram:K``, llama-cpp-python's ``Llama.generate`` without and with
``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=K)`` (its own n-gram
drafting: the last 2 or 1 tokens looked up in the context, up to K tokens
after the first match drafted), greedy, one sequence, ``--threads`` threads,
timed as colibri is: from the first token to the last. Both engines get the
same prompt token ids (colibri's tokenizer's, or random ids for a model
without one), never text. ``--gguf auto`` writes the colibri model (16-bit
Qwen3-MoE files, such as the demo model) as a bf16 GGUF once, to
``benches/.cache/<name>-bf16.gguf``, with scripts/colibri_gguf.py (the
writer scripts/llamacpp_quants.py uses). The llama.cpp side runs under
``--llama-python`` (an interpreter with llama-cpp-python and gguf; default
this one), colibri's under this one.

Each mode runs in a fresh process, the modes interleaved ``--rounds`` times
(reversed every other round); the table gives medians. llama rows are
compared with ``llama:none``, colibri rows with ``none``; every row says
whether its tokens are the same as its engine's plain run and how many of
its first tokens agree with colibri's plain run (llama.cpp rounds the
activations to bf16 inside its bf16 dot products, so its greedy output may
part from colibri's after a while). On the demo model by default (``--model
FILE`` for another). The raw runs are kept in ``benches/.cache/spec-*.json``;
``--results NAME`` writes the table as benches/results/NAME.json for
docs/benchmarks.md (benches/render_results.py); ``--report RAW`` prints (and
with ``--results`` writes) a saved raw run.

    python benches/spec_bench.py [--model FILE] [--rounds 5] [--tokens 160] [--drafts 4,8] [--mtp 2,3]
        [--gguf auto --llama-python PYTHON] [--results NAME]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
GGUF_WRITER = HERE.parent / "scripts" / "colibri_gguf.py"

PASSAGE = (
    "Mr. Bennet was among the earliest of those who waited on Mr. Bingley. He had always intended to "
    "visit him, though to the last always assuring his wife that he should not go; and till the evening "
    "after the visit was paid she had no knowledge of it."
)


def prompts(engine) -> dict[str, list[int]]:
    """The prompts as token ids (what every worker of both engines is given)."""
    if engine.has_tokenizer:
        texts = {"edit": f"{PASSAGE}\n\n{PASSAGE}\n\n{PASSAGE[:60]}", "fresh": PASSAGE[:60]}
        return {k: engine.tokenize(v) for k, v in texts.items()}
    import random

    rnd = random.Random(3)
    edge = min(100, engine.vocab_size // 4)  # away from the vocabulary's ends (a test model's too)
    ids = [rnd.randrange(edge, engine.vocab_size - edge) for _ in range(48)]
    return {"edit": ids + ids + ids[:12], "fresh": ids[:12]}


def parse_mode(mode: str) -> tuple[str, str, int]:
    """(engine, kind, K): "ngram:4" -> ("colibri", "ngram", 4), "llama:none" -> ("llama", "none", 0)."""
    engine = "llama" if mode.startswith("llama:") else "colibri"
    parts = mode.split(":")[1:] if engine == "llama" else mode.split(":")
    return engine, parts[0], int(parts[1]) if len(parts) > 1 else 0


def open_colibri(args: argparse.Namespace):
    import colibri

    if args.model:
        return colibri.Engine(args.model, threads=args.threads, max_batch=8)
    return colibri.Engine.demo(threads=args.threads, max_batch=8)


def describe(args: argparse.Namespace) -> dict[str, object]:
    """The prompts' ids, and what the modes need to know of the model."""
    engine = open_colibri(args)
    return {"prompts": prompts(engine), "has_mtp": engine.has_mtp, "path": engine.path}


def colibri_worker(args: argparse.Namespace) -> dict[str, object]:
    engine = open_colibri(args)
    _, kind, k = parse_mode(args.mode)
    base: dict[str, object] = {"max_new_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
    figures: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    for name, prompt in json.loads(Path(args.prompts).read_text()).items():
        opts = dict(base)
        if kind in ("ngram", "predict"):
            opts.update(speculative="ngram", draft_tokens=k)
        elif kind == "mtp":
            opts.update(speculative="mtp", draft_tokens=k)
        if kind == "predict":
            # The output itself as the prediction: the best case of a
            # client that knows most of the answer (an edit's unchanged lines).
            opts["prediction"] = list(engine.generate(prompt, **base))
        engine.generate(prompt, max_new_tokens=4)  # warm-up
        r = engine.generate(prompt, **opts)
        figures[f"{name}_one"] = r.timings.decode_tokens_per_second
        figures[f"{name}_per_pass"] = r.timings.tokens_per_pass
        figures[f"{name}_drafted"] = r.timings.drafted_tokens
        figures[f"{name}_accepted"] = r.timings.accepted_tokens
        tokens[name] = list(r)  # a token-id prompt gives a list of ids
        for n in map(int, args.clients.split(",")):
            t0 = time.perf_counter()
            gen = engine.generate
            threads = [threading.Thread(target=gen, args=(prompt,), kwargs=opts) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            figures[f"{name}_x{n}"] = n * args.tokens / (time.perf_counter() - t0)
    return {"figures": figures, "tokens": tokens}


def llama_generate(llm, ids: list[int], n: int) -> tuple[list[int], float, int, int]:
    """`n` greedy tokens after `ids` from an empty cache: the tokens, the
    seconds from the first token to the last, the forward passes
    (``Llama.eval`` calls) after the first token, and the tokens drafted."""
    passes = drafted = 0
    plain_eval, plain_draft = llm.eval, llm.draft_model

    def counting_eval(batch):  # one llama_decode of the new tokens and any drafts
        nonlocal passes
        passes += 1
        plain_eval(batch)

    def counting_draft(input_ids, **kw):
        nonlocal drafted
        guess = plain_draft(input_ids, **kw)
        drafted += len(guess)
        return guess

    llm.eval = counting_eval
    if plain_draft is not None:
        llm.draft_model = counting_draft
    llm.reset()
    out: list[int] = []
    t0 = time.perf_counter()
    gen = llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True)
    try:
        for tok in gen:
            out.append(int(tok))
            if len(out) == 1:
                t0, passes, drafted = time.perf_counter(), 0, 0
            if len(out) == n:
                break
    finally:
        gen.close()
        llm.eval, llm.draft_model = plain_eval, plain_draft
    return out, time.perf_counter() - t0, passes, drafted


def llama_worker(args: argparse.Namespace) -> dict[str, object]:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    _, kind, k = parse_mode(args.mode)
    ids_of = json.loads(Path(args.prompts).read_text())
    # llama.cpp pads the context to a multiple of 256 and llama-cpp-python
    # sizes its drafts by the padded length but its logit rows by the asked
    # one, which overflows near the end: ask for a padded length.
    n_ctx = -(-(max(map(len, ids_of.values())) + args.tokens + k + 16) // 256) * 256
    kv = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[args.llama_kv]
    llm = llama_cpp.Llama(
        model_path=args.gguf,
        n_ctx=n_ctx,
        n_batch=512,
        n_ubatch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        type_k=kv,
        type_v=kv,
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if kind == "ngram" else None,
        verbose=False,
    )
    figures: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    for name, ids in ids_of.items():
        llama_generate(llm, ids, 4)  # warm-up
        out, seconds, passes, drafted = llama_generate(llm, ids, args.tokens)
        figures[f"{name}_one"] = (len(out) - 1) / seconds
        figures[f"{name}_per_pass"] = (len(out) - 1) / passes if passes else 0.0
        # Each pass gives one token of its own and those of its drafts that held.
        figures[f"{name}_drafted"] = drafted
        figures[f"{name}_accepted"] = len(out) - 1 - passes
        tokens[name] = out
    llm.close()
    return {"figures": figures, "tokens": tokens, "version": llama_cpp.__version__}


# ---------------------------------------------------------------- the report


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(raw: dict) -> list[dict]:
    """The table's rows from a raw run: medians of the figures over the rounds,
    each compared with its engine's plain mode, and the tokens' agreement."""
    runs, modes, clients = raw["runs"], raw["modes"], raw["args"]["clients"]
    med = {
        m: {k: statistics.median(r["figures"][k] for r in rs) for k in rs[0]["figures"]}
        for m, rs in runs.items()
    }
    rows = []
    for p in raw["prompts"]:
        for m in modes:
            llama = m.startswith("llama:")
            plain = "llama:none" if llama else "none"
            x, b = med[m], med[plain]
            ref = runs[plain][0]["tokens"][p]
            row: dict = {
                "prompt": p,
                "mode": m,
                "engine": "llama.cpp" if llama else "colibri",
                "one_tps": round(x[f"{p}_one"], 1),
                "vs_none": round(x[f"{p}_one"] / b[f"{p}_one"], 2),
                "per_pass": round(x[f"{p}_per_pass"], 2),
                "accepted": round(x[f"{p}_accepted"]),
                "drafted": round(x[f"{p}_drafted"]),
                "same_as_none": "yes" if all(r["tokens"][p] == ref for r in runs[m]) else "no",
                "colibri_prefix": min(
                    common_prefix(r["tokens"][p], runs["none"][0]["tokens"][p]) for r in runs[m]
                ),
                "tokens": raw["args"]["tokens"],
            }
            if not llama:
                if "llama:none" in med:
                    row["vs_llama"] = round(x[f"{p}_one"] / med["llama:none"][f"{p}_one"], 2)
                row["clients"] = {
                    str(n): {
                        "tps": round(x[f"{p}_x{n}"], 1),
                        "vs": round(x[f"{p}_x{n}"] / b[f"{p}_x{n}"], 2),
                    }
                    for n in clients
                }
            rows.append(row)
    return rows


COLUMNS = {
    "prompt": {"label": "prompt", "cell": "{prompt}"},
    "mode": {"label": "mode", "cell": "{mode}"},
    "one": {"label": "one sequence tok/s", "cell": "{one_tps:.0f}"},
    "vs": {"label": "vs its engine's none", "cell": "{vs_none:x}"},
    "per_pass": {"label": "tokens per pass", "cell": "{per_pass:.2f}"},
    "drafts": {"label": "drafts confirmed", "cell": "{accepted}/{drafted}"},
    "same": {"label": "same tokens as its none", "cell": "{same_as_none}"},
    "prefix": {"label": "first tokens as colibri none", "cell": "{colibri_prefix}/{tokens}"},
    "vs_llama": {"label": "colibri vs llama:none", "cell": "{vs_llama:x}"},
}


def report_lines(raw: dict, rows: list[dict]) -> list[str]:
    """The printed table (and the cross-engine line under it)."""
    a = raw["args"]
    llama = "llama:none" in raw["modes"]
    cols = ["prompt", "mode", "one", "vs", "per_pass", "drafts", "same", "prefix"] + (
        ["vs_llama"] if llama else []
    )
    head = [COLUMNS[c]["label"] for c in cols] + [f"{n} sequences tok/s (vs none)" for n in a["clients"]]
    lines = [
        f"medians of {len(raw['runs']['none'])} rounds, {a['tokens']} new tokens, {a['threads']} threads",
        "| " + " | ".join(head) + " |",
        "|---" * len(head) + "|",
    ]
    for r in rows:
        cells = [
            r["prompt"],
            r["mode"],
            f"{r['one_tps']:.0f}",
            f"{r['vs_none']:.2f}x",
            f"{r['per_pass']:.2f}",
            f"{r['accepted']}/{r['drafted']}",
            r["same_as_none"],
            f"{r['colibri_prefix']}/{r['tokens']}",
        ]
        if llama:
            cells.append(f"{r['vs_llama']:.2f}x" if "vs_llama" in r else "")
        for n in a["clients"]:
            c = r.get("clients", {}).get(str(n))
            cells.append(f"{c['tps']:.0f} ({c['vs']:.2f}x)" if c else "")
        lines.append("| " + " | ".join(cells) + " |")
    if llama:
        plain = {r["prompt"]: r["one_tps"] for r in rows if r["mode"] == "llama:none"}
        ratio = ", ".join(
            f"{r['prompt']} {r['vs_llama']:.2f}x ({r['one_tps']:.0f} / {plain[r['prompt']]:.0f} tok/s)"
            for r in rows
            if r["mode"] == "none"
        )
        lines.append(f"\ncolibri none vs llama:none, one sequence: {ratio}")
    return lines


def spec_results(raw: dict) -> dict:
    """The results file (benches/render_results.py's format) of a raw run."""
    sys.path.insert(0, str(HERE))
    import bench

    rows = summarize(raw)
    a, info = raw["args"], raw["machine_info"]
    llama = "llama:none" in raw["modes"]
    build = info["colibri"]
    columns = dict(COLUMNS)
    for n in a["clients"]:
        columns[f"x{n}"] = {
            "label": f"{n} sequences tok/s (vs none)",
            "cell": f"{{clients.{n}.tps:.0f}} ({{clients.{n}.vs:x}})",
        }
    shown = ["prompt", "mode", "one", "vs", "per_pass", "drafts", "same", "prefix"] + (
        ["vs_llama"] if llama else []
    )
    shown += [f"x{n}" for n in a["clients"]]
    peer = None
    if llama:
        peer = (
            f"llama.cpp through llama-cpp-python {raw['llama_version']}, {Path(a['gguf']).name}, "
            f"{a['llama_kv']} KV cache, LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=K)"
        )
    method = (
        f"spec_bench.py on {raw['model']}: greedy decode of {a['tokens']} new tokens after each prompt "
        f"(edit: a passage twice and begun a third time; fresh: the passage's opening), tokens/s from the "
        f"first token to the last; colibri's modes with n-gram drafts (ngram:K), with the plain run's "
        f"output as the prediction (predict:K) and with MTP drafts (mtp:K, when the model has an MTP layer); "
        f"{', '.join(map(str, a['clients']))} sequences at once for the aggregate columns (colibri only)"
    )
    if llama:
        method += (
            "; llama.cpp's Llama.generate without and with its prompt lookup decoding (llama:ngram:K), "
            "one sequence, fed the same prompt token ids"
        )
    method += (
        f"; each mode in a fresh process, {a['threads']} threads, modes interleaved (reversed every other "
        f"round), medians of {len(raw['runs']['none'])} rounds; 'same tokens' compares every round's output "
        f"with the first round of its engine's plain mode, 'first tokens as colibri none' is the shortest "
        f"common prefix with colibri's plain output over the rounds"
    )
    return {
        "title": f"Speculative decoding, {raw['model']}",
        "axis": ["speculative"],
        "machine": {"cpu": raw.get("cpu") or bench.machine_facts(info).splitlines()[0][len("- CPU: ") :]},
        "date": raw["date"],
        "commit": build["commit"] + (" with uncommitted changes" if build.get("dirty") else ""),
        "method": method,
        "commands": [raw["command"]],
        "peer": peer,
        "columns": columns,
        "views": {"speculative": {"columns": shown}},
        "rows": rows,
    }


def report(raw: dict, results: str | None, force: bool = False) -> None:
    rows = summarize(raw)
    print()
    print("\n".join(report_lines(raw, rows)))
    if results:
        sys.path.insert(0, str(HERE))
        import render_results

        render_results.write({render_results.results_path(results): spec_results(raw)}, force)


# ---------------------------------------------------------------- the run


def gguf_for(model_path: str, gguf: str, llama_python: str) -> str:
    """The GGUF the llama modes run: `gguf`, or with "auto" the model written
    as a bf16 GGUF under benches/.cache (once)."""
    if gguf != "auto":
        return gguf
    out = CACHE / f"{Path(model_path).stem}-bf16.gguf"
    if not out.exists():
        print(f"writing {out} (scripts/colibri_gguf.py)", file=sys.stderr, flush=True)
        cmd = [llama_python, str(GGUF_WRITER), model_path, str(out), "--type", "BF16"]
        subprocess.run([*cmd, "--name", Path(model_path).stem], check=True, stdout=subprocess.DEVNULL)
    return str(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafts", default="4,8", help="n-gram draft lengths to try")
    ap.add_argument("--mtp", help="MTP draft lengths to try (default 2,3 when the model has an MTP layer)")
    ap.add_argument("--clients", default="8", help="sequences at once for the aggregate figures")
    ap.add_argument("--gguf", help="the same model as a GGUF for the llama.cpp modes ('auto': write it)")
    ap.add_argument("--llama-drafts", help="prompt lookup draft lengths (default --drafts)")
    ap.add_argument("--llama-python", default=sys.executable, help="Python with llama-cpp-python and gguf")
    ap.add_argument("--llama-kv", choices=["f32", "f16"], default="f32", help="llama.cpp's KV cache type")
    ap.add_argument("--results", "--save", dest="results", help="also write benches/results/NAME.json")
    ap.add_argument("--force", action="store_true", help="replace an existing results file")
    ap.add_argument("--report", metavar="RAW", help="print (and with --results write) a saved raw run")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mode == "describe":
        print(json.dumps(describe(args)))
        return
    if args.mode:
        worker = llama_worker if parse_mode(args.mode)[0] == "llama" else colibri_worker
        print(json.dumps(worker(args)))
        return
    if args.report:
        report(json.loads(Path(args.report).read_text()), args.results, args.force)
        return

    sys.path.insert(0, str(HERE))
    import agent_bench
    import bench

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    info = bench.machine_info()
    common = ["--tokens", str(args.tokens), "--threads", str(args.threads)]
    if args.model:
        common += ["--model", args.model]
    found = subprocess.run(
        [sys.executable, __file__, "--mode", "describe", *common], check=True, capture_output=True, text=True
    )
    model = json.loads(found.stdout.strip().splitlines()[-1])
    drafts = args.drafts.split(",")
    modes = ["none"] + [f"ngram:{k}" for k in drafts] + [f"predict:{drafts[-1]}"]
    if model["has_mtp"]:
        modes += [f"mtp:{k}" for k in (args.mtp or "2,3").split(",")]
    else:
        log(f"{model['path']} has no MTP layer: the mtp modes are skipped")
    gguf = llama_version = None
    if args.gguf:
        probe = [args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"]
        got = subprocess.run(probe, capture_output=True, text=True)
        if got.returncode != 0:
            sys.exit(f"{args.llama_python} cannot import llama_cpp: give --llama-python a Python that can")
        llama_version = got.stdout.strip()
        gguf = gguf_for(model["path"], args.gguf, args.llama_python)
        modes += ["llama:none"] + [f"llama:ngram:{k}" for k in (args.llama_drafts or args.drafts).split(",")]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        ids = Path(tmp) / "prompts.json"
        ids.write_text(json.dumps(model["prompts"]))
        for r in range(args.rounds):
            for m in modes if r % 2 == 0 else modes[::-1]:
                cmd = [sys.executable, __file__, "--mode", m, "--prompts", str(ids), *common]
                if m.startswith("llama:"):
                    cmd = [args.llama_python, __file__, "--mode", m, "--prompts", str(ids), *common[:4]]
                    cmd += ["--gguf", str(gguf), "--llama-kv", args.llama_kv]
                else:
                    cmd += ["--clients", args.clients]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"{shlex.join(cmd)} failed:\n{done.stderr}")
                runs[m].append(json.loads(done.stdout.strip().splitlines()[-1]))
                log(f"round {r + 1} {m}: {runs[m][-1]['figures']}")
    raw = {
        "args": {**vars(args), "clients": [int(n) for n in args.clients.split(",")], "gguf": gguf},
        "command": "python benches/spec_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "model": Path(args.model).name if args.model else "the demo model",
        "prompts": {k: len(v) for k, v in model["prompts"].items()},
        "prompt_ids": model["prompts"],
        "modes": modes,
        "runs": runs,
        "llama_version": llama_version,
        "machine_info": info,
        "cpu": agent_bench.cpu_text(bench.machine_facts(info).splitlines()[0][len("- CPU: ") :]),
        "date": dt.date.today().isoformat(),
    }
    CACHE.mkdir(exist_ok=True)
    saved = CACHE / f"spec-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    saved.write_text(json.dumps(raw) + "\n")
    log(f"raw runs: {saved}")
    report(raw, args.results, args.force)


if __name__ == "__main__":
    main()
