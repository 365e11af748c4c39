"""Speculative decoding with n-gram drafts against plain decoding.

Greedy decode tokens/s of one sequence (``--tokens`` new tokens; the time
after the first token, so prefill is apart), and aggregate tokens/s of several
sequences at once (``--clients``), with drafts of up to K tokens and without. Prompts:

- ``edit``: a passage given twice and begun a third time, as a code edit
  gives the file it changes: output that repeats its input, where drafts pay;
- ``fresh``: a passage's opening with nothing repeated, where drafts rarely
  come or hold, to show what trying costs.

Modes: ``none``; ``ngram:K`` (n-gram drafts of up to K tokens); and
``predict:K``, the same with the plain run's own output given as the
prediction (OpenAI's predicted outputs at their best: every draft right).

Each mode runs in a fresh process, the modes interleaved ``--rounds`` times;
the table gives medians. On the demo model by default (``--model FILE`` for
another; a model without a tokenizer gets its prompts as ids: a random
passage of the same length, repeated the same way).

    python benches/spec_bench.py [--model FILE] [--rounds 5] [--tokens 160] [--drafts 4,8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

PASSAGE = (
    "Mr. Bennet was among the earliest of those who waited on Mr. Bingley. He had always intended to "
    "visit him, though to the last always assuring his wife that he should not go; and till the evening "
    "after the visit was paid she had no knowledge of it."
)


def prompts(engine) -> dict[str, object]:
    if engine.has_tokenizer:
        return {"edit": f"{PASSAGE}\n\n{PASSAGE}\n\n{PASSAGE[:60]}", "fresh": PASSAGE[:60]}
    import random

    rnd = random.Random(3)
    ids = [rnd.randrange(100, engine.vocab_size - 100) for _ in range(48)]
    return {"edit": ids + ids + ids[:12], "fresh": ids[:12]}


def worker(args: argparse.Namespace) -> dict[str, float]:
    import colibri

    engine = (
        colibri.Engine(args.model, threads=args.threads, max_batch=8)
        if args.model
        else colibri.Engine.demo(threads=args.threads, max_batch=8)
    )
    k = int(args.mode.split(":")[1]) if ":" in args.mode else 0
    base: dict[str, object] = {"max_new_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
    out: dict[str, float] = {}
    for name, prompt in prompts(engine).items():
        opts = dict(base)
        if k:
            opts.update(speculative="ngram", draft_tokens=k)
        if args.mode.startswith("predict"):
            # The output itself as the prediction: the best case of a
            # client that knows most of the answer (an edit's unchanged lines).
            opts["prediction"] = engine.generate(prompt, **base).token_ids
        engine.generate(prompt, max_new_tokens=4)  # warm-up
        r = engine.generate(prompt, **opts)
        out[f"{name}_one"] = r.timings.decode_tokens_per_second
        out[f"{name}_per_pass"] = r.timings.tokens_per_pass
        for n in map(int, args.clients.split(",")):
            t0 = time.perf_counter()
            gen = engine.generate
            threads = [threading.Thread(target=gen, args=(prompt,), kwargs=opts) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out[f"{name}_x{n}"] = n * args.tokens / (time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafts", default="4,8", help="draft lengths to try")
    ap.add_argument("--clients", default="8", help="sequences at once for the aggregate figures")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(worker(args)))
        return
    drafts = args.drafts.split(",")
    modes = ["none"] + [f"ngram:{k}" for k in drafts] + [f"predict:{drafts[-1]}"]
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            cmd = [
                sys.executable,
                __file__,
                "--mode",
                m,
                "--tokens",
                str(args.tokens),
                "--threads",
                str(args.threads),
                "--clients",
                args.clients,
            ]
            if args.model:
                cmd += ["--model", args.model]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            runs[m].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {m}: {runs[m][-1]}", file=sys.stderr, flush=True)
    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in runs.items()}
    clients = [int(n) for n in args.clients.split(",")]
    print(f"\nmedians of {args.rounds} rounds, {args.tokens} new tokens, {args.threads} threads")
    head = " | ".join(f"{n} sequences tok/s (vs none)" for n in clients)
    print(f"| prompt | mode | one sequence tok/s | vs none | tokens per pass | {head} |")
    print("|---" * (5 + len(clients)) + "|")
    for p in ("edit", "fresh"):
        base = med["none"]
        for m in modes:
            x = med[m]
            one = x[p + "_one"]
            cells = [f"{x[f'{p}_x{n}']:.0f} ({x[f'{p}_x{n}'] / base[f'{p}_x{n}']:.2f}x)" for n in clients]
            print(
                f"| {p} | {m} | {one:.0f} | {one / base[p + '_one']:.2f}x | {x[p + '_per_pass']:.2f} | "
                + " | ".join(cells)
                + " |"
            )
    print(json.dumps({"runs": runs, "medians": med}), file=sys.stderr)


if __name__ == "__main__":
    main()
