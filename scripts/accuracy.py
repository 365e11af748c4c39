"""How far each weight type moves a model's predictions: top-1 agreement and KL.

For every parity fixture (``tests/fixtures/golden/*``) and for the bundled demo
model, this converts the model into each weight type and compares the
next-token distributions of every position with those of the reference
model, all through ``Engine.logits``:

- top-1 agreement: the fraction of positions whose argmax is the same;
- mean KL(p_ref || p_type) in nats over all positions (computed in float64);
- for the demo model on real text, also the cross-entropy of the actual next
  token under each model.

The reference is the model in the type it was trained or saved in, computed in
f32: the f32 file for the f32 fixtures, the bf16 / f16 file for the two
fixtures saved in those types, and the shipped bf16 file for the demo model
(its quantised versions are re-encoded from that file with ``colibri.convert``).

Inputs. Fixtures: four seeded sequences of 96 uniformly random token ids (fewer
where the context is shorter, as Phi-MoE's 64; the
fixtures are random models, so there is no meaningful text). Demo: the English
paragraphs in ``PROSE`` of scripts/_common.py (written for these scripts, so not part of the
training text), cut into windows of 128 tokens; with ``--austen`` also the
held-out split of the training corpus (the last 5% of each of the six novels,
which the model never trained on; see docs/demo_model.md), two 256-token
windows per novel. ``--austen download`` fetches the Debian package
``r-cran-janeaustenr`` with ``apt-get download``; a path to its .deb or to a
directory the package is unpacked or installed under works too.

Usage (from the repository root, with colibri installed)::

    python scripts/accuracy.py --austen download

prints the markdown tables of docs/accuracy.md. Everything is deterministic:
the same build gives the same numbers on any thread count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import DEMO, PROSE, ROOT, austen_heldout, compare, log_softmax, pool, random_sequences, windows

import colibri

GOLDEN = ROOT / "tests" / "fixtures" / "golden"

# Weight types compared with the reference; the 16-bit ones only for f32 references.
BLOCK_TYPES = ["q8_0", "q4_0", "q4_1", "mxfp4"]
# Fixtures whose dimensions widen_fixture can rescale to block-friendly widths.
WIDENABLE = {"mixtral", "mixtral_tied_swa", "olmoe", "qwen2_moe", "qwen3_moe"}
HALF_TYPES = ["bf16", "f16"]
# KV cache of the compared files (--kv-cache); "auto" is what users get: f16
# for the block types, f32 otherwise. References always use their default (f32).
KV_CACHE = ["auto"]

# --------------------------------------------------------------------------- measures


def measure(ref: colibri.Engine, other: colibri.Engine, seqs: list[list[int]], score_next: bool = False):
    """Pooled comparison over `seqs`; with `score_next`, each position's actual
    next token (inside the sequence) is scored too."""
    parts = []
    for ids in seqs:
        targets = np.array(ids[1:] + [-1]) if score_next else None
        parts.append(compare(ref.logits(ids), other.logits(ids), targets))
    return pool(parts)


def reference_margins(ref: colibri.Engine, seqs: list[list[int]]) -> dict[str, float]:
    """Medians over all positions of the reference's top-1 probability and of
    the gap between its two most likely tokens: how easily a small
    perturbation flips the argmax."""
    top1, gap = [], []
    for ids in seqs:
        p = np.exp(log_softmax(ref.logits(ids)))
        two = np.sort(p, axis=-1)[:, -2:]
        top1.extend(two[:, 1])
        gap.extend(two[:, 1] - two[:, 0])
    return {"p1": float(np.median(top1)), "gap": float(np.median(gap)), "n": len(top1)}


def residual_errors(ref: colibri.Engine, other: colibri.Engine, ids: list[int]) -> list[float]:
    """Relative RMS difference of the residual stream (embeddings, the output
    of each layer, the final-normed state) and then of the logits, over the
    positions of one sequence: where the error comes from and how it grows."""
    hr, ho = ref.hidden_states(ids), other.hidden_states(ids)
    stages = [*zip(hr, ho), (ref.logits(ids), other.logits(ids))]
    return [float(np.sqrt(((a - b) ** 2).mean() / (a**2).mean())) for a, b in stages]


def block_share(engine: colibri.Engine) -> float:
    """Fraction of the file's weight values (all tensors) stored in a block type."""
    total = block = 0
    for _name, dtype, shape, _nbytes in engine.tensors():
        n = int(np.prod(shape))
        total += n
        block += n if dtype.startswith("q") else 0
    return block / total


# --------------------------------------------------------------------------- inputs


def _round_up(x: float, m: int = 32) -> int:
    return int(-(-x // m) * m)


def _read_safetensors_header(path: Path) -> dict:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return header


def widen_fixture(case: Path, out: Path, seed: int) -> Path:
    """A random f32 checkpoint of the fixture's architecture and options with
    every width a multiple of 32, so the block types apply.

    The fixtures themselves have hidden sizes of 36 and 44: no matrix row is
    a whole number of 32-value blocks, so the converter keeps every matrix in
    bf16 when asked for q8_0/q4_0/q4_1. Here the config keeps everything but
    the widths (head dim 16 or 32, hidden size and every FFN width rounded up
    to a multiple of 32), the tensor names are the fixture's, and the weights
    are drawn with the fixtures' recipe (tests/fixtures/README.md): embeddings
    N(0, 1) (0.5 when tied), matrices N(0, g^2 / fan_in) with g = 3 for the
    router and 2 for lm_head, norm weights 1 + 0.3 N(0, 1), biases 0.3 N(0, 1).
    """
    cfg = json.loads((case / "config.json").read_text())
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    hd_new = 16 if hd <= 8 else 32
    h_new = nh * hd_new if h == nh * hd else _round_up(1.5 * h)
    dims: dict[int, int] = {}

    def put(old: int, new: int) -> None:
        if dims.setdefault(old, new) != new:
            raise ValueError(f"{case.name}: width {old} would need two new values")

    put(h, h_new)
    put(nh * hd, nh * hd_new)
    put(nkv * hd, nkv * hd_new)
    put(hd, hd_new)
    new_cfg = dict(cfg, hidden_size=h_new)
    if cfg.get("head_dim"):
        new_cfg["head_dim"] = hd_new
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if cfg.get(key):
            new_cfg[key] = _round_up(3 * cfg[key])
            put(cfg[key], new_cfg[key])
    new_cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] = "float32"

    rng = np.random.default_rng(seed)
    tensors = {}
    for f in sorted(case.glob("*.safetensors")):
        for name, e in _read_safetensors_header(f).items():
            shape = e["shape"]
            router = name.endswith(".gate.weight") and "proj" not in name
            vocab = "embed_tokens" in name or name.startswith("lm_head")
            keep_first = router or vocab
            new = [d if (i == 0 and keep_first) or d == 1 else dims[d] for i, d in enumerate(shape)]
            if "norm" in name:
                w = 1 + 0.3 * rng.standard_normal(new)
            elif name.endswith(".bias"):
                w = 0.3 * rng.standard_normal(new)
            elif "embed_tokens" in name:
                w = (0.5 if cfg.get("tie_word_embeddings") else 1.0) * rng.standard_normal(new)
            else:
                g = 3.0 if router else 2.0 if name.startswith("lm_head") else 1.0
                w = g / np.sqrt(new[-1]) * rng.standard_normal(new)
            tensors[name] = w.astype("<f4")
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(new_cfg, indent=1))
    header, blobs, off = {}, [], 0
    for name, w in tensors.items():
        data = w.tobytes()
        header[name] = {"dtype": "F32", "shape": list(w.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (out / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))
    return out


# --------------------------------------------------------------------------- runs


def convert_all(src: Path, work: Path, types: list[str]) -> dict[str, Path]:
    paths = {}
    for t in types:
        paths[t] = work / f"{src.stem}-{t}.colibri"
        colibri.convert(src, paths[t], dtype=t, progress=False)
    return paths


def run_fixtures(threads: int, widened: bool, margins: dict, growth: dict) -> list[dict]:
    rows = []
    cases = sorted(p for p in GOLDEN.iterdir() if (p / "config.json").exists())
    for i, case in enumerate(cases):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            src = case
            if widened:
                if case.name.endswith("_f16"):
                    continue  # the same architecture and options as qwen3_moe
                if case.name not in WIDENABLE:
                    continue  # widen_fixture knows the dimensions of these families only
                src = widen_fixture(case, work / case.name, seed=1000 + i)
            ref_path = work / f"{case.name}-ref.colibri"
            colibri.convert(src, ref_path, progress=False)  # the checkpoint's own type
            ref = colibri.Engine(ref_path, threads=threads)
            types = (HALF_TYPES if ref.dtype == "f32" else []) + BLOCK_TYPES
            seqs = random_sequences(ref.vocab_size, 4, min(96, ref.context_length), seed=0)
            margins[case.name + (" (widened)" if widened else "")] = reference_margins(ref, seqs)
            for t, path in convert_all(src, work, types).items():
                eng = colibri.Engine(path, threads=threads, kv_cache_dtype=KV_CACHE[0])
                m = measure(ref, eng, seqs)
                rows.append({"model": case.name, "ref": ref.dtype, "type": t, "block": block_share(eng), **m})
                if widened and t in BLOCK_TYPES:
                    growth[(f"{case.name} (widened)", t)] = residual_errors(ref, eng, seqs[0])
    return rows


def run_demo(threads: int, austen: str | None, margins: dict, growth: dict) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ref = colibri.Engine(DEMO, threads=threads)
        texts = {"own prose": [windows(ref.tokenize("\n".join(PROSE) + "\n"), 128)]}
        if austen:
            held = austen_heldout(austen, work)
            texts["Austen held-out"] = [windows(ref.tokenize(text), 256)[:2] for _title, text in held]
        for label, groups in texts.items():
            margins[f"demo, {label}"] = reference_margins(ref, [w for g in groups for w in g])
        paths = convert_all(DEMO, work, ["f16", *BLOCK_TYPES])
        # Re-encoding an already quantised file: the second rounding on top of the first.
        for first, second in (("q8_0", "q4_0"), ("q4_0", "q8_0")):
            chained = f"{first} → {second}"
            paths[chained] = work / f"demo-{first}-{second}.colibri"
            colibri.convert(paths[first], paths[chained], dtype=second, progress=False)
        for t, path in paths.items():
            eng = colibri.Engine(path, threads=threads, kv_cache_dtype=KV_CACHE[0])
            if t in BLOCK_TYPES:
                growth[("demo, own prose", t)] = residual_errors(ref, eng, texts["own prose"][0][0])
            for label, groups in texts.items():
                seqs = [w for g in groups for w in g]
                m = measure(ref, eng, seqs, score_next=True)
                rows.append({"model": "demo", "text": label, "ref": ref.dtype, "type": t, **m})
    return rows


def fmt_kl(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def print_tables(
    fixtures: list[dict], widened: list[dict], demo: list[dict], margins: dict, growth: dict
) -> None:
    if demo:
        print(
            "| text | type | positions | top-1 agreement | mean KL (nats) | max KL "
            "| cross-entropy (ref → type) |"
        )
        print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
        for r in demo:
            n = r["positions"]
            ce = f"{r['nll_ref'] / r['scored']:.4f} → {r['nll_other'] / r['scored']:.4f}"
            print(
                f"| {r['text']} | `{r['type']}` | {int(n)} | {r['agree'] / n:.4f} | {fmt_kl(r['kl'] / n)} "
                f"| {fmt_kl(r['kl_max'])} | {ce} |"
            )
        print()
    for rows in (fixtures, widened):
        if not rows:
            continue
        print(
            "| fixture | reference | type | weights in blocks | top-1 agreement | mean KL (nats) | max KL |"
        )
        print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
        for r in rows:
            n = r["positions"]
            share = f"{100 * r['block']:.0f}%" if r["type"].startswith("q") else "–"
            print(
                f"| `{r['model']}` | {r['ref']} | `{r['type']}` | {share} | "
                f"{r['agree'] / n:.4f} | {fmt_kl(r['kl'] / n)} | {fmt_kl(r['kl_max'])} |"
            )
        print()
    if margins:
        print("| reference model, inputs | positions | median top-1 probability | median gap to the 2nd |")
        print("| --- | ---: | ---: | ---: |")
        for name, m in margins.items():
            print(f"| {name} | {m['n']} | {m['p1']:.3f} | {m['gap']:.3f} |")
        print()
    if growth:
        print("| model (first sequence) | type | embeddings → each layer → final norm | logits |")
        print("| --- | --- | --- | ---: |")
        for (name, t), errs in sorted(growth.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            stream = " → ".join(f"{e:.3f}" for e in errs[:-1])
            print(f"| {name} | `{t}` | {stream} | {errs[-1]:.3f} |")


# ---------------------------------------------------------------- quality per bit

QUALITY_TYPES = ["q8_0", "q6k", "q5k", "q4k", "q4_1", "q4_0"]
QUALITY_RECIPES = ["q5k-mix", "q4k-mix", "q4_1-mix"]


def _expert_bpw(engine: colibri.Engine) -> float:
    rows = [r for r in engine.weight_types() if r["class"] in ("experts", "experts_down")]
    return 8 * sum(r["bytes"] for r in rows) / max(1, sum(r["parameters"] for r in rows))


def quality_rows(
    reference: Path,
    texts: dict[str, list[list[int]]],
    calib,
    work: Path,
    threads: int,
    types: list[str] | None = None,
) -> list[dict]:
    """Each type of QUALITY_TYPES and recipe of QUALITY_RECIPES (or of `types`:
    single types, recipe names or ``class=type,...`` specs), without and
    with an importance matrix calibrated on `calib` (text, or token ids run
    in windows of 256), against `reference`'s logits on `texts`. KV caches
    in f32, so only the weights differ (as scripts/llamacpp_quants.py runs
    llama.cpp)."""
    ref = colibri.Engine(reference, threads=threads, kv_cache_dtype="f32")
    ref_logits = {k: [ref.logits(s) for s in v] for k, v in texts.items()}
    imatrix = work / "model.imatrix"
    if isinstance(calib, str):
        ref.calibrate(imatrix, text=calib, force=True, progress=False)
    else:
        ref.calibrate(imatrix, token_ids=calib, window=256, force=True, progress=False)
    del ref
    rows = []
    for dtype in types or QUALITY_TYPES + QUALITY_RECIPES:
        for im in (None, imatrix):
            out = work / "quality.colibri"
            colibri.convert(reference, out, dtype=dtype, imatrix=im, force=True, progress=False)
            e = colibri.Engine(out, threads=threads, kv_cache_dtype="f32")
            row = {
                "type": dtype,
                "imatrix": im is not None,
                "bpw": e.weight_types()[-1]["bits_per_weight"],
                "bpw_experts": _expert_bpw(e),
            }
            for k, seqs in texts.items():
                row[k] = pool([compare(r, e.logits(s)) for r, s in zip(ref_logits[k], seqs)])
            print(f"{dtype} {'imatrix' if im else 'plain'}: {row}", file=sys.stderr, flush=True)
            rows.append(row)
            del e
            out.unlink()
    return rows


def run_quality(
    threads: int,
    austen: str | None,
    bench: bool,
    scratch: Path,
    types: list[str] | None = None,
    demo: bool = True,
) -> dict[str, list[dict]]:
    """The demo model (own prose, Austen held-out with --austen; calibrated
    on colibri's default calibration text) and, with `bench`, the 1-layer
    heavy-tailed Qwen3-30B-A3B-width model of scripts/llamacpp_quants.py
    (the same seeds: 4 x 256 random ids measured, 8 x 256 calibrated on)."""
    import llamacpp_quants as lq  # only --bench needs it, and it brings in benches/make_models.py

    out = {}
    work = scratch / "quality"
    work.mkdir(parents=True, exist_ok=True)
    if demo:
        ref = colibri.Engine(DEMO, threads=threads)
        texts = {"own prose": windows(ref.tokenize("\n".join(PROSE) + "\n"), 128)}
        if austen:
            held = austen_heldout(austen, work / "austen")
            texts["Austen held-out"] = [w for _, t in held for w in windows(ref.tokenize(t), 256)[:2]]
        del ref
        out["demo"] = quality_rows(DEMO, texts, None, work, threads, types)
    if bench:
        args = argparse.Namespace(
            layers=1, outlier_columns=4, outlier_low=8.0, outlier_high=16.0, scratch=scratch
        )
        path = lq.bench_reference(args, {})
        vocab = colibri.Engine(path, threads=1).vocab_size
        texts = {"random ids": random_sequences(vocab, 4, 256, seed=0)}
        calib = [i for s in random_sequences(vocab, 8, 256, seed=1) for i in s]
        out[path.parent.name] = quality_rows(path, texts, calib, work, threads, types)
    return out


def print_quality(results: dict[str, list[dict]]) -> None:
    for model, rows in results.items():
        texts = [k for k in rows[0] if isinstance(rows[0][k], dict)]
        head = " | ".join(f"KL / top-1, {t}" for t in texts)
        print(f"\n**{model}**\n\n| colibri | imatrix | bpw | bpw (experts) | {head} |")
        print("| --- | --- | ---: | ---: |" + " --- |" * len(texts))
        for r in rows:
            cells = " | ".join(
                f"{r[t]['kl'] / r[t]['positions']:.2e} / {r[t]['agree'] / r[t]['positions']:.3f}"
                for t in texts
            )
            im = "yes" if r["imatrix"] else "no"
            print(f"| {r['type']} | {im} | {r['bpw']:.2f} | {r['bpw_experts']:.2f} | {cells} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--austen",
        metavar="SOURCE",
        help="also score the demo model on the held-out Austen text: 'download' (apt-get download "
        "r-cran-janeaustenr), a path to that .deb, or a directory it is unpacked/installed under",
    )
    ap.add_argument(
        "--kv-cache",
        choices=["auto", "f32", "f16"],
        default="auto",
        help="KV cache of the compared files (default auto: f16 for the block types, as users get)",
    )
    ap.add_argument("--only", choices=["demo", "fixtures", "widened"], help="run one part")
    ap.add_argument(
        "--quality",
        action="store_true",
        help="instead: the super-block types and recipes with and without an importance matrix "
        "on the demo model (docs/accuracy.md); with --bench also on the heavy-tailed "
        "Qwen3-30B-A3B-width model of scripts/llamacpp_quants.py",
    )
    ap.add_argument("--bench", action="store_true", help="with --quality: the bench model too")
    ap.add_argument("--no-demo", action="store_true", help="with --quality --bench: the bench model only")
    ap.add_argument(
        "--types",
        help="with --quality: ';'-separated types, recipe names or class=type,... specs "
        "instead of the default list",
    )
    ap.add_argument("--scratch", default=str(ROOT / ".cache" / "accuracy"), help="big transient files")
    ap.add_argument("--json", metavar="FILE", help="also write the raw sums as JSON")
    args = ap.parse_args()
    if args.quality:
        types = [t for t in args.types.split(";") if t] if args.types else None
        res = run_quality(args.threads, args.austen, args.bench, Path(args.scratch), types, not args.no_demo)
        print_quality(res)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return
    KV_CACHE[0] = args.kv_cache
    part = {"demo": False, "fixtures": False, "widened": False}
    if args.only:
        part[args.only] = True
    else:
        part = dict.fromkeys(part, True)
    margins: dict = {}
    growth: dict = {}
    fixtures = run_fixtures(args.threads, False, margins, growth) if part["fixtures"] else []
    widened = run_fixtures(args.threads, True, margins, growth) if part["widened"] else []
    demo = run_demo(args.threads, args.austen, margins, growth) if part["demo"] else []
    print_tables(fixtures, widened, demo, margins, growth)
    if args.json:
        raw = {"fixtures": fixtures, "widened": widened, "demo": demo, "margins": margins}
        raw["growth"] = [{"model": m, "type": t, "errors": e} for (m, t), e in growth.items()]
        Path(args.json).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
