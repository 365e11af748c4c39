"""The ``colibri`` command line.

Subcommands: ``convert`` (Hugging Face folder -> .colibri) and ``info``
(what a .colibri file holds). Errors are printed as one line on stderr with
a non-zero exit status; Ctrl-C exits with status 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import __version__
from ._colibri import supported_dtypes
from ._engine import Engine, convert
from ._errors import ColibriError


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _cmd_convert(args: argparse.Namespace) -> int:
    report = convert(args.src, args.output, dtype=args.dtype, force=args.force, progress=not args.quiet)
    if not args.quiet:
        print(
            f"wrote {report['path']} ({report['architecture']}, {report['dtype']}, "
            f"{report['tensors']} tensors, {_human(report['bytes'])})"
        )
    return 0


def _params(cfg: dict) -> tuple[int, int]:
    """Total and active-per-token parameter counts from the canonical config."""
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    q, kv = cfg["num_heads"] * cfg["head_dim"], cfg["num_kv_heads"] * cfg["head_dim"]
    attn = d * q * 2 + d * kv * 2
    total = active = v * d * (1 if cfg["tie_embeddings"] else 2)
    moe = cfg.get("moe")
    for layer in cfg["layers"]:
        total += attn
        active += attn
        ffn = layer["ffn"]
        if ffn["kind"] == "dense":
            total += 3 * d * ffn["ffn_dim"]
            active += 3 * d * ffn["ffn_dim"]
        else:
            expert = 3 * d * moe["expert_ffn_dim"]
            shared = 3 * d * moe["shared_expert"]["ffn_dim"] if moe.get("shared_expert") else 0
            router = moe["num_experts"] * d
            total += moe["num_experts"] * expert + shared + router
            active += moe["router"]["top_k"] * expert + shared + router
    return total, active


def _cmd_info(args: argparse.Namespace) -> int:
    engine = Engine(args.model, threads=1)
    cfg = engine.config
    if args.json:
        print(
            json.dumps({"architecture": engine.architecture, "dtype": engine.dtype, "config": cfg}, indent=2)
        )
        return 0
    total, active = _params(cfg)
    moe = cfg.get("moe") or {}
    n_moe = sum(1 for layer in cfg["layers"] if layer["ffn"]["kind"] == "moe")
    rows = [
        ("file", engine.path),
        ("architecture", engine.architecture),
        ("weights", engine.dtype),
        ("parameters", f"{total / 1e6:.2f}M total, {active / 1e6:.2f}M active per token"),
        ("layers", f"{len(cfg['layers'])} ({n_moe} MoE)"),
        (
            "experts",
            f"{moe.get('num_experts', 0)} routed, top-{moe.get('router', {}).get('top_k', 0)}"
            + (", 1 shared" if moe.get("shared_expert") else ""),
        ),
        (
            "hidden",
            f"{cfg['hidden_size']}, heads {cfg['num_heads']}/{cfg['num_kv_heads']} x {cfg['head_dim']}",
        ),
        ("context", str(engine.context_length)),
        ("vocabulary", str(engine.vocab_size)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri", description="Fast, exact CPU inference for MoE language models."
    )
    p.add_argument("--version", action="version", version=f"colibri-moe {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint folder to a .colibri file")
    c.add_argument("src", help="folder with config.json and *.safetensors")
    c.add_argument("-o", "--output", required=True, help="the .colibri file to write")
    c.add_argument(
        "--dtype",
        choices=["auto", *supported_dtypes()],
        default="auto",
        help="storage type of the weight matrices (default: keep the checkpoint's)",
    )
    c.add_argument("--force", action="store_true", help="overwrite the output if it exists")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    c.set_defaults(func=_cmd_convert)

    i = sub.add_parser("info", help="describe a .colibri file")
    i.add_argument("model", help="a .colibri file")
    i.add_argument("--json", action="store_true", help="print the canonical config as JSON")
    i.set_defaults(func=_cmd_info)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ColibriError as e:
        print(f"colibri {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"colibri {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
