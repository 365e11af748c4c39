"""The ``colibri`` command line.

Subcommands: ``convert`` (Hugging Face folder or .colibri -> .colibri), ``calibrate``
(an importance matrix for ``convert --imatrix``), ``generate`` (one prompt,
streamed to stdout), ``stats`` (routing and expert-store statistics of a run),
``plan`` (what fits a RAM budget), ``chat`` (an interactive conversation),
``serve`` (the OpenAI-compatible HTTP server) and ``info`` (what a .colibri
file holds); docs/guide/cli.md describes each. Every error is one line on stderr with
a non-zero exit status (2 for bad arguments, 1 for everything else); Ctrl-C
exits with status 130, or in ``chat`` cuts the reply short; SIGTERM exits with
status 143. Either way a conversion stops between tensors and removes its
partial output.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from . import __version__, kernels
from ._colibri import recipes as _recipe_table
from ._colibri import stage_file_info, supported_dtypes
from ._convert import convert, split
from ._engine import Engine, plan
from ._errors import ColibriError
from ._sampling import SamplingParams


class _Terminated(BaseException):
    """Raised by the SIGTERM handler; unwinds like Ctrl-C (the native code
    polls for it between tokens and tensors) but is not caught where Ctrl-C
    only cuts a chat reply short."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the message and where to find help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _UsageError(Exception):
    """A bad combination of arguments found after parsing (exit status 2)."""


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


# ---------------------------------------------------------------------------
# convert


def _cmd_convert(args: argparse.Namespace) -> int:
    report = convert(
        args.src,
        args.output,
        dtype=args.dtype,
        imatrix=args.imatrix,
        force=args.force,
        progress=not args.quiet,
        keep_mtp=args.keep_mtp,
    )
    if not args.quiet:
        kind = report["recipe"] or report["dtype"]
        print(
            f"wrote {report['path']} ({report['architecture']}, {kind}, "
            f"{report['tensors']} tensors, {_human(report['bytes'])})"
        )
        if report.get("weighted") is not None:
            done, missed = report["weighted"]
            note = f"; {missed} had no calibration data and were quantised unweighted" if missed else ""
            print(f"importance matrix: {done} quantised matrices weighted by it{note}")
        if report.get("int4") is not None:
            i = report["int4"]
            exact = i["groups"] - i["requantised"]
            print(
                f"int4 source: {i['tensors']} tensors, {exact} of {i['groups']} groups of 32 kept exactly; "
                f"{i['requantised']} requantised (scale not an f16 value)"
                + (f"; in f32 (scale beyond f16): {', '.join(i['widened'])}" if i["widened"] else "")
            )
    return 0


def _cmd_split(args: argparse.Namespace) -> int:
    shares = None
    if args.shares:
        try:
            shares = [float(x) for x in args.shares.split(",")]
        except ValueError:
            raise _UsageError(f"--shares: give numbers separated by commas, got {args.shares!r}") from None
    files = split(
        args.model,
        args.stages,
        out=args.output,
        shares=shares,
        force=args.force,
        progress=not args.quiet,
        dry_run=args.dry_run,
    )
    if not args.quiet:
        verb = "would write" if args.dry_run else "wrote"
        for i, f in enumerate(files):
            a, b = f["layers"]
            print(f"{verb} stage {i + 1} of {len(files)}: layers {a}..{b}, {_human(f['bytes'])}  {f['path']}")
    return 0


def _stage_file_info(path: str, info: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps({"stage_file": info}, indent=2))
        return 0
    a, b = info["layers"]
    rows = [
        ("file", f"{path} ({_human(info['bytes'])})"),
        ("stage file", f"stage {info['stage'] + 1} of {info['stages']}: layers {a}..{b} of {info['of']}"),
        ("cut from", f"a model file of {info['origin'].split('-')[0]} bytes (origin {info['origin']})"),
        ("runs with", "colibri.ray.Engine(<folder of stage files>) or colibri serve <folder> --ray"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    text = None
    if args.text is not None:
        try:
            with open(args.text, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise _UsageError(
                f"--text {args.text} is not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
    engine = Engine(args.model, threads=args.threads)
    out = engine.calibrate(
        args.output,
        text=text,
        window=args.window,
        max_tokens=args.max_tokens,
        force=args.force,
        progress=not args.quiet,
    )
    if not args.quiet:
        print(f"wrote {out} (use it with: colibri convert ... --imatrix {out})")
    return 0


# ---------------------------------------------------------------------------
# info


def _params(cfg: dict[str, Any], tensors: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[int, int]:
    """Total and active-per-token parameter counts, from the tensor table:
    everything but the routed experts is active, plus top-k experts per MoE layer."""
    count = {name: math.prod(shape) for name, _, shape, _ in tensors}
    total = sum(count.values())
    experts: dict[str, int] = {}  # "layers.L" -> parameters of all its routed experts
    for name, n in count.items():
        if ".moe.experts." in name:
            layer = name.split(".moe.experts.")[0]
            experts[layer] = experts.get(layer, 0) + n
    moe: dict[str, Any] = cfg.get("moe") or {}
    active = total - sum(experts.values())
    if moe:
        active += sum(n * moe["router"]["top_k"] // moe["num_experts"] for n in experts.values())
    return total, active


def _weights_line(engine: Engine) -> str:
    """The weight type, or the recipe and the average bits per weight of the matrices."""
    total = engine.weight_types()[-1]
    bpw = f"{total['bits_per_weight']:.2f} bits per weight overall"
    return f"{engine.recipe} (recipe), {bpw}" if engine.recipe else f"{engine.dtype}, {bpw}"


def _attention(cfg: dict[str, Any]) -> str:
    """One line on the attention: kind, heads, widths, windows, sinks."""
    att = cfg["attention"]
    kind = att.get("kind", {"type": "gqa"})
    if kind.get("type") == "mla":
        text = (
            f"MLA, {cfg['num_heads']} heads, latent {kind['kv_lora_rank']} + rope {kind['qk_rope_dim']}, "
            f"q/k {kind['qk_nope_dim']}+{kind['qk_rope_dim']}, v {kind['v_head_dim']}"
        )
        if kind.get("q_lora_rank"):
            text += f", q rank {kind['q_lora_rank']}"
    elif kind.get("type") == "pooled":
        pools = [layer.get("pool", "window") for layer in cfg["layers"] if layer.get("mixer") == "pooled"]
        ix = kind["indexer"]
        text = (
            f"pooled, {cfg['num_heads']} heads x {cfg['head_dim']} over one K=V head, "
            f"rope {kind['rope_dim']}, window {kind['window']}; {pools.count('heavy')} heavy layers "
            f"(1 entry per {kind['heavy_rate']} tokens), {pools.count('light')} light "
            f"(1 per {kind['light_rate']}, indexer {ix['heads']} heads x {ix['head_dim']}, "
            f"top {ix['top_k']}), {pools.count('window')} window-only"
        )
    else:
        text = f"GQA, heads {cfg['num_heads']}/{cfg['num_kv_heads']} x {cfg['head_dim']}"
    windows = sorted({layer["sliding_window"] for layer in cfg["layers"] if layer.get("sliding_window")})
    if windows:
        sliding = sum(1 for layer in cfg["layers"] if layer.get("sliding_window"))
        text += f", sliding window {'/'.join(map(str, windows))} on {sliding} of {len(cfg['layers'])} layers"
    n_sparse = sum(1 for layer in cfg["layers"] if layer.get("mixer") == "sparse")
    indexer = kind.get("indexer")
    if indexer and n_sparse:
        shared = sum(1 for layer in cfg["layers"] if layer.get("shares_selection"))
        text += (
            f", sparse on {n_sparse} of {len(cfg['layers'])} layers (indexer {indexer['heads']} heads "
            f"x {indexer['head_dim']}, top {indexer['top_k']} keys"
        )
        text += f"; {shared} reuse the selection before them)" if shared else ")"
    blocks = att.get("block_index")
    if blocks and n_sparse:
        text += (
            f", block-sparse on {n_sparse} of {len(cfg['layers'])} layers (index {blocks['heads']} heads "
            f"x {blocks['head_dim']}, top {blocks['top_blocks']} blocks of {blocks['block']} keys, "
            f"{blocks['local_blocks']} local)"
        )
    glob = cfg.get("global_attention")
    if glob:
        keys = ", values = keys" if glob.get("values_from_keys") else ""
        text += f"; full layers {cfg['num_heads']}/{glob['num_kv_heads']} x {glob['head_dim']}{keys}"
    if att.get("sinks"):
        text += ", sinks"
    if att.get("output_gate"):
        text += ", gated output"
    linear = cfg.get("linear")
    n_linear = sum(1 for layer in cfg["layers"] if layer.get("mixer") == "linear")
    if linear and n_linear:
        kind = _linear_kind(linear["kind"])
        if kind == "Mamba2":  # keys are B and C (a group each), values the heads' x
            shape = (
                f"{linear['v_heads']} heads x {linear['v_head_dim']}, {linear['k_heads']} groups, "
                f"state {linear['k_head_dim']}"
            )
        else:
            shape = (
                f"{linear['k_heads']} key heads x {linear['k_head_dim']}, {linear['v_heads']} value heads "
                f"x {linear['v_head_dim']}"
            )
        text = (
            f"{kind} on {n_linear} of {len(cfg['layers'])} layers ({shape}, conv {linear['conv_kernel']}); "
            f"the others {text}"
        )
    return text


def _linear_kind(kind: str | dict[str, object]) -> str:
    """The rule's name; kinds with parameters are stored as {name: {...}}."""
    name = kind if isinstance(kind, str) else next(iter(kind), "")
    return {"gated_delta_net": "Gated DeltaNet", "kda": "Kimi delta attention", "mamba2": "Mamba2"}.get(
        name, name
    )


def _source_format(engine: Engine) -> str:
    """What the checkpoint was stored as, when the file recorded it."""
    src = engine.source_config or {}
    text = src.get("text_config") or {}  # a conditional-generation checkpoint's language model
    quant = (src.get("quantization_config") or text.get("quantization_config") or {}).get("quant_method")
    dtype = src.get("torch_dtype") or src.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    parts = [p for p in (quant, dtype) if p]
    return " / ".join(str(p) for p in parts) if parts else "unknown"


def _kernels_line() -> str:
    k = kernels()
    return f"{k['active']} (this CPU: {', '.join(k['available'])}; COLIBRI_ISA picks another)"


def _cmd_info(args: argparse.Namespace) -> int:
    if os.path.isfile(args.model) and (part := stage_file_info(args.model)) is not None:
        return _stage_file_info(args.model, json.loads(part), args.json)
    engine = Engine(args.model, threads=1)
    cfg = engine.config
    all_tensors = engine.tensors()
    total, active = _params(cfg, all_tensors)
    kv_dtype = engine.kv_cache_dtype
    state = engine.state_bytes()
    kv_bytes = state["per_token"]
    pieces = engine.state_pieces()
    if args.json:
        out: dict[str, Any] = {
            "architecture": engine.architecture,
            "dtype": engine.dtype,
            "file_bytes": engine.file_size,
            "context_length": engine.context_length,
            "parameters": {"total": total, "active_per_token": active},
            "attention": _attention(cfg),
            "kv_cache": {
                "dtype": kv_dtype,
                "bytes_per_token": kv_bytes,
                "bytes_per_sequence": state["per_sequence"],
                **(
                    {
                        "pooled_pieces": {
                            k: {"per_token": t, "per_sequence": q} for k, (t, q) in pieces.items()
                        }
                    }
                    if pieces
                    else {}
                ),
            },
            "source_format": _source_format(engine),
            "not_converted": engine.skipped_parts,
            "mtp_layer": engine.has_mtp,
            "tokenizer": engine.has_tokenizer,
            "chat_template": engine.chat_template is not None,
            "kernels": kernels(),
            "config": cfg,
        }
        out["recipe"] = engine.recipe
        out["weight_types"] = engine.weight_types()
        if args.tensors:
            out["tensors"] = [
                {"name": n, "dtype": d, "shape": list(s), "bytes": b} for n, d, s, b in engine.tensors()
            ]
        print(json.dumps(out, indent=2))
        return 0
    moe = cfg.get("moe") or {}
    main_layers = cfg["layers"][: engine.num_layers]
    n_moe = sum(1 for layer in main_layers if layer["ffn"]["kind"] == "moe")
    mtp_note = '; and 1 multi-token-prediction layer (speculative="mtp")' if engine.has_mtp else ""
    rows = [
        ("file", f"{engine.path} ({_human(engine.file_size)})"),
        ("architecture", engine.architecture),
        ("weights", _weights_line(engine)),
        ("parameters", f"{total / 1e6:.2f}M total, {active / 1e6:.2f}M active per token"),
        ("layers", f"{engine.num_layers} ({n_moe} MoE){mtp_note}"),
        (
            "experts",
            f"{moe.get('num_experts', 0)} routed, top-{moe.get('router', {}).get('top_k', 0)}"
            + (", 1 shared" if moe.get("shared_expert") else ""),
        ),
        ("hidden", str(cfg["hidden_size"])),
        ("attention", _attention(cfg)),
        (
            "KV cache",
            f"{kv_dtype}, {_human(kv_bytes)} per token + {_human(state['per_sequence'])} per sequence "
            f"({_human(state['per_sequence'] + kv_bytes * 4096)} at 4k context)",
        ),
        *(
            [
                (
                    "pooled state",
                    ", ".join(f"{k} {_human(t)}/token + {_human(q)}" for k, (t, q) in pieces.items()),
                )
            ]
            if pieces
            else []
        ),
        ("source", _source_format(engine)),
        *([("not converted", ", ".join(engine.skipped_parts))] if engine.skipped_parts else []),
        ("context", str(engine.context_length)),
        ("vocabulary", str(engine.vocab_size)),
        ("tokenizer", "yes" if engine.has_tokenizer else "no (token ids only)"),
        ("chat template", "yes" if engine.chat_template is not None else "no"),
        ("kernels", _kernels_line()),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print()
    types = engine.weight_types()
    cw = max(len(r["class"]) for r in types)
    print(f"{'matrices':<{cw}}  {'type':<14}  {'parameters':>12}  {'bytes':>10}  bits/weight")
    for r in types:
        print(
            f"{r['class']:<{cw}}  {'+'.join(r['dtypes']):<14}  {r['parameters']:>12,}  "
            f"{_human(r['bytes']):>10}  {r['bits_per_weight']:.3f}"
        )
    if args.tensors:
        tensors = all_tensors
        name_w = max(len(n) for n, _, _, _ in tensors)
        print(f"\n{'tensor':<{name_w}}  {'dtype':<6}  {'shape':<16}  bytes")
        for name, dtype, shape, nbytes in tensors:
            dims = " x ".join(str(s) for s in shape)
            print(f"{name:<{name_w}}  {dtype:<6}  {dims:<16}  {nbytes}")
    return 0


# ---------------------------------------------------------------------------
# generate and chat


def _open_model(args: argparse.Namespace, positional: list[str]) -> tuple[Engine, list[str]]:
    """The engine named by ``--demo`` or the first positional (a .colibri file
    or a Hugging Face folder, converted once into the cache); returns the
    positionals left over."""
    store = {"ram_budget": args.ram, "io": args.io, "prefetch": args.prefetch}
    store["kv_cache_dtype"] = args.kv_cache_dtype
    store["mmap"] = {"auto": None, "on": True, "off": False}[args.mmap]
    for name in ("max_batch", "max_queue", "max_state_memory", "prefix_cache"):
        if getattr(args, name, None) is not None:
            store[name] = getattr(args, name)
    if args.demo:
        return Engine.demo(threads=args.threads, **store), positional
    if not positional:
        raise _UsageError("give a model (a .colibri file or a Hugging Face folder), or --demo")
    model, rest = positional[0], positional[1:]
    if os.path.isdir(model):
        return Engine.from_pretrained(model, threads=args.threads, **store), rest
    return Engine(model, threads=args.threads, **store), rest


def _sampling(args: argparse.Namespace) -> SamplingParams:
    names = (
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
    )
    constraint: dict[str, Any] = {}
    for flag, name in (("json_schema", "json_schema"), ("grammar", "grammar")):
        path = getattr(args, flag, None)
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    constraint[name] = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise _UsageError(f"--{flag.replace('_', '-')}: cannot read {path}: {e}") from e
    if getattr(args, "regex", None) is not None:
        constraint["regex"] = args.regex
    return SamplingParams(
        **{n: getattr(args, n) for n in names},
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
        speculative=args.speculative,
        draft_tokens=args.draft_tokens,
        **constraint,
    )


def _report(args: argparse.Namespace, stream: Any) -> None:
    if args.verbose:
        reason = stream.finish_reason
        if isinstance(stream.stop_reason, str):
            reason += f" (stop string {stream.stop_reason!r})"
        print(f"[{stream.timings}; finish: {reason}]", file=sys.stderr, flush=True)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _cmd_serve(args: argparse.Namespace) -> int:
    if len(args.args) > (0 if args.demo else 1):
        raise _UsageError("give one model (a .colibri file or a Hugging Face folder), or --demo")
    if not args.demo and not args.args:
        raise _UsageError("give a model (a .colibri file or a Hugging Face folder), or --demo")
    if not 0 < args.port < 65536:
        raise _UsageError(f"--port must be in 1..65535, got {args.port}")
    scale = _ray_scale(args)
    if args.ray:
        return _serve_on_ray(args, scale)
    try:
        from .server import serve
    except ImportError as e:
        raise _UsageError(str(e)) from e
    print(f"colibri: serving on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr)
    serve(
        lambda: _open_model(args, list(args.args))[0],
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        model_name=args.served_model_name or ("demo" if args.demo else None),
        log_level="info" if args.verbose else "warning",
        speculative=args.speculative,
        draft_tokens=args.draft_tokens,
    )
    return 0


def _ray_scale(args: argparse.Namespace) -> tuple[int, int] | None:
    """--autoscale MIN:MAX as numbers, after checking the Ray flags go together."""
    for flag, value in (
        ("--replicas", args.replicas),
        ("--autoscale", args.autoscale),
        ("--threads-per-replica", args.threads_per_replica),
        ("--stages", args.stages),
    ):
        if value is not None and not args.ray:
            raise _UsageError(f"{flag} needs --ray")
    if args.replicas is not None and args.autoscale is not None:
        raise _UsageError("give --replicas or --autoscale, not both")
    if args.replicas is not None and args.replicas < 1:
        raise _UsageError(f"--replicas must be at least 1, got {args.replicas}")
    if args.threads_per_replica is not None and args.threads_per_replica < 1:
        raise _UsageError(f"--threads-per-replica must be at least 1, got {args.threads_per_replica}")
    if args.stages is not None and args.stages < 1:
        raise _UsageError(f"--stages must be at least 1, got {args.stages}")
    whole = args.demo or (bool(args.args) and os.path.isfile(args.args[0]))
    if args.stages is not None and args.ram is not None and whole:
        raise _UsageError(
            "stages of a whole model file keep their experts resident: give no --ram, or serve a folder "
            "of stage files (colibri split)"
        )
    if args.ray and args.threads is not None:
        raise _UsageError("with --ray, give --threads-per-replica instead of --threads")
    if args.autoscale is None:
        return None
    low, sep, high = args.autoscale.partition(":")
    if not sep or not low.isdigit() or not high.isdigit():
        raise _UsageError(f"--autoscale must be MIN:MAX (e.g. 1:4), got {args.autoscale!r}")
    if int(high) < 1 or int(low) > int(high):
        raise _UsageError(f"--autoscale needs MIN <= MAX and MAX >= 1, got {args.autoscale}")
    return int(low), int(high)


def _serve_on_ray(args: argparse.Namespace, scale: tuple[int, int] | None) -> int:
    """``colibri serve --ray``: the replicas of colibri.ray on a Ray cluster."""
    try:
        from .ray import require, serve

        require()
    except ImportError as e:
        raise _UsageError(str(e)) from e
    options: dict[str, Any] = {"ram_budget": args.ram, "io": args.io, "prefetch": args.prefetch}
    options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.mmap != "auto":  # auto: the mapping, which replicas on one node share
        options["mmap"] = args.mmap == "on"
    if args.stages is not None:
        options["stages"] = args.stages
    for name in ("max_batch", "max_queue", "max_state_memory", "prefix_cache"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    serve(
        "demo" if args.demo else args.args[0],
        host=args.host,
        port=args.port,
        replicas=args.replicas,
        autoscale=scale,
        threads_per_replica=args.threads_per_replica,
        api_key=args.api_key,
        model_name=args.served_model_name,
        speculative=args.speculative,
        draft_tokens=args.draft_tokens,
        log_level="info" if args.verbose else "warning",
        log=lambda line: print(f"colibri: {line}", file=sys.stderr),
        **options,
    )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if len(args.args) > (1 if args.demo else 2):
        raise _UsageError("too many arguments; quote a prompt that has spaces")
    engine, rest = _open_model(args, list(args.args))
    if rest and rest[0] != "-":
        prompt = rest[0]
    elif sys.stdin is None or sys.stdin.isatty():
        raise _UsageError("give a prompt as an argument, or pipe one to stdin")
    else:
        prompt = sys.stdin.read()
        if prompt.endswith("\n"):
            prompt = prompt[:-1]  # the newline `echo` adds is not part of the prompt
    if not prompt:
        raise _UsageError("the prompt is empty")
    stream = engine.stream(prompt, _sampling(args), add_special_tokens=not args.no_special_tokens)
    if args.echo:
        _write(prompt)
    for piece in stream:
        _write(piece)
    _write("\n")
    _report(args, stream)
    if getattr(args, "stats", False):
        _print_stats(engine, file=sys.stdout if args.command == "stats" else sys.stderr)
    if getattr(args, "plot", None):
        from ._plot import plot_heat

        try:
            plot_heat(
                engine.routing_stats(), args.plot, title=f"routing heat: {os.path.basename(engine.path)}"
            )
        except (ImportError, ValueError, OSError) as e:
            raise _UsageError(str(e)) from e
        print(f"colibri: wrote the routing heat map to {args.plot}", file=sys.stderr)
    return 0


def _print_stats(engine: Engine, file: Any) -> None:
    """Routing and expert-store figures, one line per MoE layer."""
    routing, store = engine.routing_stats(), engine.store_stats()
    print("routing (since the model was opened)", file=file)
    for layer in routing.get("layers", []):
        heat = layer.get("heat", [])
        hottest = sorted(range(len(heat)), key=lambda e: -heat[e])[:4]
        print(
            f"  layer {layer.get('layer')}: tokens {layer.get('tokens', 0)}, "
            f"entropy {layer.get('entropy', 0.0):.3f} (normalised), "
            f"top1-top2 margin {layer.get('mean_margin', 0.0):.3f}, hottest experts {hottest}, "
            f"max load {layer.get('max_load', 0.0):.2f}x uniform, "
            f"dead {layer.get('dead', [])}, overloaded {layer.get('overloaded', [])}",
            file=file,
        )
    figures: dict[str, float] = {
        "hit_rate": store["hit_rate"],
        "bytes_read_per_token": store["bytes_read_per_token"],
        "prefetch_accuracy": store["prefetch_accuracy"],
        "io_wait_seconds": store["io_wait_seconds"],
        "hits": store["hits"],
        "misses": store["misses"],
    }
    parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()]
    print(f"expert store: {', '.join(parts)}", file=file)
    weights = store["weights"]
    print(f"weights: {weights['note'] or weights['backing']}", file=file)
    for w in store.get("warnings", []) or []:
        print(f"warning: {w}", file=file)


def _cmd_plan(args: argparse.Namespace) -> int:
    p = plan(args.model, args.ram)
    if args.json:
        print(json.dumps(p, indent=2))
        return 0
    h = _human
    rows = [
        ("model", f"{args.model} ({h(p['file_bytes'])})"),
        ("dense part", f"{h(p['dense_bytes'])}, always resident"),
        (
            "routed experts",
            f"{p['experts']} in {p['moe_layers']} layers, {h(p['expert_bytes'])} "
            f"({h(p['slab_bytes'])} each), top-{p['top_k']}",
        ),
        ("smallest budget", h(p["min_budget"])),
    ]
    if p["streams"]:
        rows += [
            (
                "budget",
                f"{h(p['budget'] or 0)}: {p['slots']} expert slots ({p['pinned_slots']} for the hot set)",
            ),
            ("resident", f"{h(p['resident_bytes'])} (dense part + slots)"),
            ("streamed", f"{h(p['streamed_bytes'])} stay in the file"),
            (
                "expected",
                f"hit rate {p['expected_hit_rate']:.2f}, "
                f"{h(p['expected_bytes_per_token'])} read per token ({p['estimate']})",
            ),
        ]
    else:
        rows += [("resident", f"everything ({h(p['resident_bytes'])}); nothing streams")]
    per_tok, per_seq = p["state_bytes_per_token"], p["state_bytes_per_sequence"]
    rows.append(
        (
            "sequence state",
            f"{h(per_tok)} per token + {h(per_seq)} per sequence, on top "
            f"({h(per_seq + 4096 * per_tok)} for one sequence of 4k tokens)",
        )
    )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for w in p.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    if len(args.args) > (0 if args.demo else 1):
        raise _UsageError("chat takes only a model; type the messages once it starts")
    engine, _ = _open_model(args, list(args.args))
    if engine.chat_template is None:
        raise ColibriError(f"{engine.path} has no chat template; use colibri generate instead")
    interactive = sys.stdin is not None and sys.stdin.isatty()
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    if interactive:
        print(
            "colibri chat: Ctrl-D or /exit quits, /reset forgets the conversation, Ctrl-C cuts a reply short"
        )
    sampling = _sampling(args)
    while True:
        if interactive:
            try:
                line = input(">>> ")
            except EOFError:  # Ctrl-D
                print()
                break
        else:
            line = sys.stdin.readline()
            if line == "":
                break  # end of piped input
        message = line.rstrip("\n")
        if not message.strip():
            continue
        if message.strip() == "/exit":
            break
        if message.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": message})
        prompt = engine.apply_chat_template(history)
        stream = engine.stream(prompt, sampling, add_special_tokens=False)
        try:
            for piece in stream:
                _write(piece)
        except KeyboardInterrupt:
            stream.close()
            history.pop()  # the turn never happened
            _write("\n")
            print("[reply interrupted]", file=sys.stderr, flush=True)
            continue
        _write("\n")
        _report(args, stream)
        history.append({"role": "assistant", "content": stream.text})
    return 0


# ---------------------------------------------------------------------------
# the parser


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults: the model's generation_config.json, else greedy)")
    g.add_argument(
        "-n", "--max-new-tokens", type=int, metavar="N", help="most tokens to generate (default 256)"
    )
    g.add_argument("-t", "--temperature", type=float, metavar="T", help="0 = greedy")
    g.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (0 = off)")
    g.add_argument(
        "--top-p", type=float, metavar="P", help="keep the most likely tokens up to mass P (1 = off)"
    )
    g.add_argument("--min-p", type=float, metavar="P", help="drop tokens below P x the most likely (0 = off)")
    g.add_argument("--repetition-penalty", type=float, metavar="R", help="transformers' penalty (1 = off)")
    g.add_argument("--presence-penalty", type=float, metavar="X", help="OpenAI presence penalty (0 = off)")
    g.add_argument("--frequency-penalty", type=float, metavar="X", help="OpenAI frequency penalty (0 = off)")
    g.add_argument("--seed", type=int, help="seed of the sampler, for reproducible output")
    g.add_argument(
        "--stop", action="append", metavar="TEXT", help="stop at this text (not printed); repeatable"
    )
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    c = p.add_argument_group("constrained output (at most one)")
    c.add_argument("--json-schema", metavar="FILE", help="write JSON valid against the JSON Schema in FILE")
    c.add_argument("--regex", metavar="RX", help="write text matching the regular expression RX")
    c.add_argument(
        "--grammar", metavar="FILE", help="write text of the Lark grammar in FILE (llguidance syntax)"
    )
    _add_speculation_flags(p)


def _add_speculation_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("speculative decoding (the same output, faster where the drafts hold)")
    s.add_argument(
        "--speculative",
        choices=["ngram", "mtp"],
        help="draft tokens from earlier occurrences of the text's last few tokens (ngram) or with the "
        "model's multi-token-prediction layer (mtp: a file converted with --keep-mtp), and verify "
        "them in one pass",
    )
    s.add_argument(
        "--draft-tokens", type=int, default=4, metavar="K", help="most tokens drafted per step (default 4)"
    )


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--demo", action="store_true", help="use the small demo model that ships with colibri")
    p.add_argument("--threads", type=int, metavar="N", help="worker threads (default: physical cores)")
    p.add_argument(
        "--ram",
        metavar="SIZE",
        help="RAM for routed experts, e.g. 4GB: experts stream from the file into a cache of this size "
        "(default: everything resident)",
    )
    p.add_argument("--io", choices=["buffered", "direct"], default="buffered", help="how experts are read")
    p.add_argument(
        "--mmap",
        choices=["auto", "on", "off"],
        default="auto",
        help="weights of a model held whole in RAM: on = the file's memory mapping, off = a copy on 2 MiB "
        "pages, auto (default) = the mapping unless it sits on small pages and a copy fits",
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="read the next layer's predicted experts ahead (off by default)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        "--kv-cache",  # its old name
        dest="kv_cache_dtype",
        choices=["auto", "f32", "f16"],
        default="auto",
        help="KV cache element type (default auto: f16 for quantised weights, else f32)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="timings and finish reason on stderr")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="colibri", description="Fast, exact CPU inference for MoE language models.")
    p.add_argument("--version", action="version", version=f"colibri-moe {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint folder (or re-encode a .colibri file)",
        description="Convert a Hugging Face checkpoint folder (config.json, *.safetensors, "
        "tokenizer files) into one .colibri file, or re-encode a .colibri file into another "
        "weight type (re-encoding an already quantised file adds a second rounding to the first).",
    )
    c.add_argument("src", help="folder with config.json and *.safetensors, or a .colibri file to re-encode")
    c.add_argument("-o", "--output", required=True, help="the .colibri file to write")
    c.add_argument(
        "--dtype",
        default="auto",
        metavar="TYPE|RECIPE",
        help=f"storage type of the weight matrices: {', '.join(supported_dtypes())}; a recipe "
        f"({', '.join(r[0] for r in _recipe_table())}: see docs/FORMAT.md); or class=type pairs such as "
        "experts=q4_1,experts_down=q8_0,default=q8_0 (default: keep the source's; q8_0 for "
        "FP8 sources, mxfp4 for MXFP4, q4_0 for compressed-tensors int4)",
    )
    c.add_argument(
        "--imatrix",
        metavar="FILE",
        help="an importance matrix from `colibri calibrate` of the same model: quantise to "
        "minimise the error weighted by each column's activations",
    )
    c.add_argument(
        "--keep-mtp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep (or drop) the checkpoint's multi-token-prediction layer, which drafts tokens for "
        "--speculative mtp (default: keep it when it adds at most 5%% to the file)",
    )
    c.add_argument("--force", action="store_true", help="overwrite the output if it exists")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    c.set_defaults(func=_cmd_convert)

    spl = sub.add_parser(
        "split",
        help="cut a .colibri file into stage files for a pipeline across machines",
        description="Cut a .colibri file into one file per pipeline stage, each holding a contiguous "
        "range of layers (the first also the embedding, the last also the head), for "
        "colibri.ray.Engine and `colibri serve --ray` on machines that cannot each hold the whole "
        "model. Copy each file to the machine that runs its stage, in the same folder everywhere.",
    )
    spl.add_argument("model", help="a whole-model .colibri file")
    spl.add_argument("--stages", type=int, required=True, help="how many stage files to write")
    spl.add_argument(
        "--shares",
        metavar="A,B,...",
        help="relative stage sizes, one per stage (e.g. each machine's memory in GB; default: equal)",
    )
    spl.add_argument("-o", "--output", metavar="DIR", help="folder to write into (default: the model's)")
    spl.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    spl.add_argument("--force", action="store_true", help="replace stage files that exist")
    spl.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    spl.set_defaults(func=_cmd_split)

    cal = sub.add_parser(
        "calibrate",
        help="record an importance matrix for quantising a model",
        description="Run text through an unquantised .colibri model and record, for every "
        "weight matrix, the mean square of each input column (per routed expert, over the "
        "tokens routed to it). `colibri convert --imatrix` then quantises with those weights.",
    )
    cal.add_argument("model", help="a .colibri file (bf16/f16/f32: calibrate before quantising)")
    cal.add_argument(
        "--text",
        metavar="FILE",
        help="UTF-8 calibration text (default: the text shipped with colibri, ~18k words of prose)",
    )
    cal.add_argument("-o", "--output", help="the importance matrix to write (default: MODEL.imatrix)")
    cal.add_argument("--window", type=int, default=512, metavar="N", help="tokens per window (default 512)")
    cal.add_argument("--max-tokens", type=int, metavar="N", help="use at most N tokens of the text")
    cal.add_argument("--threads", type=int, metavar="N", help="worker threads (default: physical cores)")
    cal.add_argument("--force", action="store_true", help="overwrite the output if it exists")
    cal.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    cal.set_defaults(func=_cmd_calibrate)

    g = sub.add_parser(
        "generate",
        help="continue a prompt, streaming the text to stdout",
        usage="colibri generate (MODEL | --demo) [PROMPT] [options]",
        description="Continue PROMPT (or stdin when PROMPT is missing or '-') and stream the "
        "text to stdout. MODEL is a .colibri file or a Hugging Face folder (converted once "
        "and cached).",
    )
    g.add_argument("args", nargs="*", metavar="MODEL PROMPT", help=argparse.SUPPRESS)
    _add_model_flags(g)
    g.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    g.add_argument(
        "--no-special-tokens", action="store_true", help="do not add the beginning-of-sequence token"
    )
    g.add_argument("--stats", action="store_true", help="routing and expert-cache figures on stderr")
    _add_sampling_flags(g)
    g.set_defaults(func=_cmd_generate)

    st = sub.add_parser(
        "stats",
        help="generate, then report routing heat, entropy, margins and expert-cache figures",
        usage="colibri stats (MODEL | --demo) [PROMPT] [options]",
        description="Runs a generation like `colibri generate` and prints, per MoE layer, how often "
        "each expert was chosen, the utilisation entropy and the top-1/top-2 router margin, and for "
        "the expert store the hit rate, bytes read per token, prefetch accuracy and I/O wait.",
    )
    st.add_argument("args", nargs="*", metavar="MODEL PROMPT", help=argparse.SUPPRESS)
    _add_model_flags(st)
    st.add_argument("--echo", action="store_true", help=argparse.SUPPRESS)
    st.add_argument("--no-special-tokens", action="store_true", help=argparse.SUPPRESS)
    st.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the routing heat map (layers x experts) to FILE, e.g. heat.png (needs matplotlib)",
    )
    _add_sampling_flags(st)
    st.set_defaults(func=_cmd_generate, stats=True)

    pl = sub.add_parser(
        "plan",
        help="what a RAM budget keeps resident, what streams, and the bytes read per token",
        description="Prints the resident dense part, the expert slots a budget pays for, what stays "
        "in the file and the expected bytes read per decoded token (from the routing heat file "
        "beside the model when there is one, else assuming uniform routing).",
    )
    pl.add_argument("model", help="a .colibri file")
    pl.add_argument("--ram", metavar="SIZE", help="RAM for routed experts, e.g. 4GB (default: all resident)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=_cmd_plan)

    ch = sub.add_parser(
        "chat",
        help="talk to a model through its chat template",
        usage="colibri chat (MODEL | --demo) [options]",
        description="An interactive conversation using the model's chat template; the "
        "history is kept. One message per line; piped stdin works too. Ctrl-D or /exit "
        "quits, /reset forgets the history, Ctrl-C cuts a reply short.",
    )
    ch.add_argument("args", nargs="*", metavar="MODEL", help=argparse.SUPPRESS)
    _add_model_flags(ch)
    ch.add_argument("--system", metavar="TEXT", help="a system message to start the conversation")
    _add_sampling_flags(ch)
    ch.set_defaults(func=_cmd_chat)

    sv = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        usage="colibri serve (MODEL | --demo) [--host H] [--port P] [options]",
        description="Serves /v1/chat/completions, /v1/completions (streaming or not), /v1/models, "
        "/health and /metrics (Prometheus). Concurrent requests are batched: every step advances "
        "all running generations by one token. Needs the serve extra: "
        "pip install 'colibri-moe[serve]'.",
    )
    sv.add_argument("args", nargs="*", metavar="MODEL", help=argparse.SUPPRESS)
    _add_model_flags(sv)
    sv.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sv.add_argument("--max-batch", type=int, default=16, metavar="N", help="most generations running at once")
    sv.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="most generations waiting; beyond it requests get 429 (default 64, 0 = no limit)",
    )
    sv.add_argument(
        "--max-state-memory",
        metavar="SIZE",
        help="most memory the running generations' KV caches and recurrent states take together "
        "(e.g. 8GB); requests wait for room, and one that alone needs more is refused (default: no limit)",
    )
    _add_speculation_flags(sv)
    sv.add_argument(
        "--prefix-cache",
        metavar="SIZE",
        default="1GiB",
        help="most memory the prefix cache holds (default 1GiB; 0 turns it off): a request that begins "
        "with tokens an earlier one processed (an agent's next turn, a shared system prompt) starts from "
        "their state instead of computing it again, with the same output",
    )
    sv.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("COLIBRI_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $COLIBRI_API_KEY)",
    )
    sv.add_argument(
        "--served-model-name", metavar="NAME", help="the model id clients use (default: file stem)"
    )
    sv.add_argument(
        "--ray",
        action="store_true",
        help="run engine replicas behind Ray Serve (on the cluster at $RAY_ADDRESS, else a new one on this "
        "machine); needs the ray extra: pip install 'colibri-moe[ray]'",
    )
    sv.add_argument("--replicas", type=int, metavar="N", help="with --ray: N engine replicas (default 1)")
    sv.add_argument(
        "--autoscale",
        metavar="MIN:MAX",
        help="with --ray: between MIN and MAX replicas, more when requests queue beyond full batches",
    )
    sv.add_argument(
        "--threads-per-replica",
        type=int,
        metavar="T",
        help="with --ray: CPUs each replica reserves and engine threads it runs (default: the cluster's "
        "CPUs shared among the replicas)",
    )
    sv.add_argument(
        "--stages",
        type=int,
        metavar="K",
        help="with --ray: each replica a model split into K pipeline stages, one per node, of "
        "--threads-per-replica CPUs each (docs/guide/multi-machine.md)",
    )
    sv.set_defaults(func=_cmd_serve)

    i = sub.add_parser(
        "info",
        help="describe a .colibri file",
        description="Architecture, parameters (total and active per token), weight type, file "
        "size, context length; --tensors lists every tensor.",
    )
    i.add_argument("model", help="a .colibri file")
    i.add_argument("--tensors", action="store_true", help="list every tensor with its type, shape and size")
    i.add_argument("--json", action="store_true", help="print as JSON (with the canonical config)")
    i.set_defaults(func=_cmd_info)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # A console that cannot show some character prints a replacement, not a traceback.
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="replace")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    prog = f"colibri {args.command}"
    if extra:
        # `colibri generate MODEL -n 8 PROMPT`: positionals after options.
        if args.command not in ("generate", "chat", "stats") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.args += extra
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: signals are not ours to handle
        previous = None
    try:
        return int(args.func(args))
    except _UsageError as e:
        print(f"{prog}: error: {e} (see {prog} --help)", file=sys.stderr)
        return 2
    except ColibriError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, as Unix tools do.
        try:
            sys.stdout = open(os.devnull, "w")  # silences the flush at exit
        except OSError:
            pass
        return 0
    except OSError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"\n{prog}: terminated", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
