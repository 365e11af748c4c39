#!/usr/bin/env python3
"""Random-weight MoE checkpoints of real model widths, for benchmarking.

For each shape this writes, under ``benches/.cache/<shape>-l<layers>/``:

- ``hf/``: a Hugging Face checkpoint folder (``config.json`` spelled as on the
  Hub, ``model.safetensors`` with the Hub's tensor names) in f16, which
  ``colibri convert`` reads;
- ``gguf/model-<TYPE>.gguf``: the same values as GGUF files for llama.cpp
  (F16 is bit-identical to the checkpoint; Q8_0 / Q4_0 are quantised from it by
  the ``gguf`` package's own quantiser).

Nothing here needs torch or transformers: tensors are generated with NumPy one
at a time and streamed to disk, so memory stays at a few hundred MB whatever
the model size. Every tensor is seeded by its name alone, so a 1-layer model
is exactly the first layer of the 4-layer one.

Weights are scaled like a fresh initialisation so activations stay in a sane
range: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 +
N(0, 0.1^2), the router at twice the matrix scale so routing decisions are not
near-ties.

Usage::

    python benches/make_models.py                      # both shapes, 4 layers, F16 + Q8_0 + Q4_0
    python benches/make_models.py --shapes olmoe --layers 1 --gguf-types F16
    python benches/make_models.py --sizes               # print sizes, write nothing
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CACHE = Path(__file__).resolve().parent / ".cache"


@dataclass(frozen=True)
class Shape:
    """Widths of one real model family (everything but the layer count)."""

    name: str
    hf_class: str
    model_type: str
    gguf_arch: str
    hidden: int
    experts: int
    top_k: int
    expert_ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: str  # "full" (OLMoE: over the whole projection) or "per_head" (Qwen3)
    norm_topk_prob: bool
    rope_theta: float
    rms_eps: float
    max_pos: int

    def hf_config(self, layers: int) -> dict:
        """config.json as the Hub's checkpoint spells it, with `layers` layers."""
        common = {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_hidden_layers": layers,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": self.norm_topk_prob,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_pos,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
            "use_cache": True,
            "output_router_logits": False,
            "initializer_range": 0.02,
        }
        if self.model_type == "olmoe":
            # OLMoE-1B-7B-0924: the expert width is `intermediate_size`.
            return {
                **common,
                "intermediate_size": self.expert_ffn,
                "clip_qkv": None,
                "router_aux_loss_coef": 0.01,
                "pad_token_id": 1,
                "eos_token_id": 50279,
                "bos_token_id": None,
            }
        # Qwen3-30B-A3B: `intermediate_size` is the (unused) dense width.
        return {
            **common,
            "head_dim": self.head_dim,
            "intermediate_size": 6144,
            "moe_intermediate_size": self.expert_ffn,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": 48,
            "router_aux_loss_coef": 0.001,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        }


SHAPES = {
    "olmoe": Shape(
        name="olmoe",
        hf_class="OlmoeForCausalLM",
        model_type="olmoe",
        gguf_arch="olmoe",
        hidden=2048,
        experts=64,
        top_k=8,
        expert_ffn=1024,
        heads=16,
        kv_heads=16,
        head_dim=128,
        vocab=50304,
        qk_norm="full",
        norm_topk_prob=False,
        rope_theta=10000.0,
        rms_eps=1e-5,
        max_pos=4096,
    ),
    "qwen3moe": Shape(
        name="qwen3moe",
        hf_class="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        gguf_arch="qwen3moe",
        hidden=2048,
        experts=128,
        top_k=8,
        expert_ffn=768,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        qk_norm="per_head",
        norm_topk_prob=True,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        max_pos=40960,
    ),
}

GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


@dataclass(frozen=True)
class Tensor:
    """One Hub tensor: name, shape ([out, in] for matrices) and how to draw it."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "matrix", "embed", "router" or "norm"


def hf_tensors(s: Shape, layers: int) -> list[Tensor]:
    """Every tensor of the Hub checkpoint, in file order."""
    d, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    qn, kn = (q, kv) if s.qk_norm == "full" else (s.head_dim, s.head_dim)
    out = [Tensor("model.embed_tokens.weight", (s.vocab, d), "embed")]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        out += [
            Tensor(f"{p}.input_layernorm.weight", (d,), "norm"),
            Tensor(f"{p}.self_attn.q_proj.weight", (q, d), "matrix"),
            Tensor(f"{p}.self_attn.k_proj.weight", (kv, d), "matrix"),
            Tensor(f"{p}.self_attn.v_proj.weight", (kv, d), "matrix"),
            Tensor(f"{p}.self_attn.o_proj.weight", (d, q), "matrix"),
            Tensor(f"{p}.self_attn.q_norm.weight", (qn,), "norm"),
            Tensor(f"{p}.self_attn.k_norm.weight", (kn,), "norm"),
            Tensor(f"{p}.post_attention_layernorm.weight", (d,), "norm"),
            Tensor(f"{p}.mlp.gate.weight", (s.experts, d), "router"),
        ]
        for e in range(s.experts):
            f = s.expert_ffn
            out += [
                Tensor(f"{p}.mlp.experts.{e}.gate_proj.weight", (f, d), "matrix"),
                Tensor(f"{p}.mlp.experts.{e}.up_proj.weight", (f, d), "matrix"),
                Tensor(f"{p}.mlp.experts.{e}.down_proj.weight", (d, f), "matrix"),
            ]
    out += [Tensor("model.norm.weight", (d,), "norm"), Tensor("lm_head.weight", (s.vocab, d), "matrix")]
    return out


def draw(shape_name: str, t: Tensor) -> np.ndarray:
    """Deterministic values of one tensor (f32), seeded by its name."""
    rng = np.random.default_rng(zlib.crc32(f"{shape_name}/{t.name}".encode()))
    x = rng.standard_normal(t.shape, dtype=np.float32)
    if t.kind == "norm":
        return 1.0 + np.float32(0.1) * x
    if t.kind == "embed":
        return x
    scale = 1.0 / np.sqrt(t.shape[-1])
    if t.kind == "router":
        scale *= 2.0
    x *= np.float32(scale)
    return x


def param_count(s: Shape, layers: int) -> int:
    return sum(int(np.prod(t.shape)) for t in hf_tensors(s, layers))


def model_dir(s: Shape, layers: int, root: Path = CACHE) -> Path:
    return root / f"{s.name}-l{layers}"


# ---------------------------------------------------------------- safetensors


def write_safetensors(s: Shape, layers: int, path: Path, log) -> None:
    """Streams every tensor, drawn and rounded to f16, into one safetensors file."""
    tensors = hf_tensors(s, layers)
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        n = int(np.prod(t.shape)) * 2
        header[t.name] = {"dtype": "F16", "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_suffix(".tmp")
    t0 = time.time()
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for i, t in enumerate(tensors):
            f.write(draw(s.name, t).astype(np.float16).tobytes())
            if i % 200 == 0:
                log(
                    f"  safetensors {i}/{len(tensors)} tensors, {f.tell() / 1e9:.2f} GB, "
                    f"{time.time() - t0:.0f}s"
                )
    os.replace(tmp, path)


class SafetensorsFile:
    """Read-only memory map of one safetensors file: name -> NumPy view."""

    def __init__(self, path: Path):
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        n = int.from_bytes(raw[:8].tobytes(), "little")
        self.header = json.loads(raw[8 : 8 + n].tobytes())
        self.raw = raw
        self.base = 8 + n

    def get(self, name: str) -> np.ndarray:
        h = self.header[name]
        dt = {"F16": np.float16, "F32": np.float32, "BF16": np.uint16}[h["dtype"]]
        a, b = h["data_offsets"]
        return self.raw[self.base + a : self.base + b].view(dt).reshape(h["shape"])


# ---------------------------------------------------------------- GGUF


def gguf_plan(s: Shape, layers: int) -> list[tuple[str, list[str], str]]:
    """(GGUF name, Hub names stacked into it, kind) in file order.

    Experts are stacked as llama.cpp's converter does: ``[E, F, D]`` for
    gate/up and ``[E, D, F]`` for down (GGUF reverses the dimensions, so
    llama.cpp sees ``{D, F, E}`` and ``{F, D, E}``).
    """
    plan = [("token_embd.weight", ["model.embed_tokens.weight"], "matrix")]
    for layer in range(layers):
        p, b = f"model.layers.{layer}", f"blk.{layer}"
        plan += [
            (f"{b}.attn_norm.weight", [f"{p}.input_layernorm.weight"], "norm"),
            (f"{b}.attn_q.weight", [f"{p}.self_attn.q_proj.weight"], "matrix"),
            (f"{b}.attn_k.weight", [f"{p}.self_attn.k_proj.weight"], "matrix"),
            (f"{b}.attn_v.weight", [f"{p}.self_attn.v_proj.weight"], "matrix"),
            (f"{b}.attn_output.weight", [f"{p}.self_attn.o_proj.weight"], "matrix"),
            (f"{b}.attn_q_norm.weight", [f"{p}.self_attn.q_norm.weight"], "norm"),
            (f"{b}.attn_k_norm.weight", [f"{p}.self_attn.k_norm.weight"], "norm"),
            (f"{b}.ffn_norm.weight", [f"{p}.post_attention_layernorm.weight"], "norm"),
            # The router stays f32, as llama.cpp's converter and colibri both keep it.
            (f"{b}.ffn_gate_inp.weight", [f"{p}.mlp.gate.weight"], "norm"),
        ]
        for gg, hf in (
            ("ffn_gate_exps", "gate_proj"),
            ("ffn_up_exps", "up_proj"),
            ("ffn_down_exps", "down_proj"),
        ):
            names = [f"{p}.mlp.experts.{e}.{hf}.weight" for e in range(s.experts)]
            plan.append((f"{b}.{gg}.weight", names, "matrix"))
    plan += [
        ("output_norm.weight", ["model.norm.weight"], "norm"),
        ("output.weight", ["lm_head.weight"], "matrix"),
    ]
    return plan


def _qtype(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name]


def _encode(x16: np.ndarray, gtype: str) -> np.ndarray:
    """f16 rows -> bytes of `gtype` (via the gguf package's quantiser)."""
    import gguf

    if gtype == "F16":
        return x16.view(np.uint8)
    x = x16.astype(np.float32)
    if gtype == "F32":
        return x.view(np.uint8)
    return gguf.quants.quantize(x, _qtype(gtype))


def _row_bytes(cols: int, gtype: str) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[_qtype(gtype)]
    return cols // block * size


def write_gguf(s: Shape, layers: int, st: SafetensorsFile, gtype: str, path: Path, log) -> None:
    import gguf

    cfg = s.hf_config(layers)
    w = gguf.GGUFWriter(None, s.gguf_arch)
    arch = s.gguf_arch
    w.add_name(f"random {s.name} {layers}-layer ({gtype})")
    w.add_context_length(s.max_pos)
    w.add_embedding_length(s.hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    if s.model_type == "qwen3_moe":
        w.add_expert_feed_forward_length(s.expert_ffn)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    w.add_vocab_size(s.vocab)
    ftype = {
        "F32": gguf.LlamaFileType.ALL_F32,
        "F16": gguf.LlamaFileType.MOSTLY_F16,
        "BF16": gguf.LlamaFileType.MOSTLY_BF16,
        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    }[gtype]
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # No tokenizer: llama.cpp then makes `vocab_size` placeholder tokens; the
    # bench feeds token ids directly.
    w.add_tokenizer_model("none")
    assert f"{arch}.vocab_size" in w.kv_data[0]

    plan = gguf_plan(s, layers)
    for gname, hf_names, kind in plan:
        first = st.header[hf_names[0]]["shape"]
        shape = ([len(hf_names)] if len(hf_names) > 1 else []) + list(first)
        if kind == "norm":
            w.add_tensor_info(gname, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            qt = _qtype(gtype)
            nbytes = int(np.prod(shape[:-1])) * _row_bytes(shape[-1], gtype)
            w.add_tensor_info(gname, shape, np.dtype(np.float16), nbytes, raw_dtype=qt)
    tmp = path.with_suffix(".tmp")
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    chunk_rows = 4096
    for i, (_gname, hf_names, kind) in enumerate(plan):
        if kind == "norm":
            w.write_tensor_data(st.get(hf_names[0]).astype(np.float32))
            continue
        parts = [st.get(n) for n in hf_names]
        rows, cols = parts[0].shape
        rb = _row_bytes(cols, gtype)
        out = np.empty((len(parts) * rows, rb), dtype=np.uint8)
        r = 0
        for part in parts:
            for a in range(0, rows, chunk_rows):
                blk = np.ascontiguousarray(part[a : a + chunk_rows])
                out[r : r + len(blk)] = _encode(blk, gtype).reshape(len(blk), rb)
                r += len(blk)
        w.write_tensor_data(out)
        if i % 10 == 0:
            log(f"  gguf {gtype} {i}/{len(plan)} tensors, {time.time() - t0:.0f}s")
    w.close()
    os.replace(tmp, path)


# ---------------------------------------------------------------- driver


def gguf_path(s: Shape, layers: int, gtype: str, root: Path = CACHE) -> Path:
    return model_dir(s, layers, root) / "gguf" / f"model-{gtype}.gguf"


def hf_dir(s: Shape, layers: int, root: Path = CACHE) -> Path:
    return model_dir(s, layers, root) / "hf"


def make(s: Shape, layers: int, gguf_types: list[str], root: Path, force: bool, log) -> None:
    hdir = hf_dir(s, layers, root)
    st_path = hdir / "model.safetensors"
    if force and hdir.exists():
        shutil.rmtree(hdir)
    if not st_path.exists():
        hdir.mkdir(parents=True, exist_ok=True)
        cfg = s.hf_config(layers)
        (hdir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {"eos_token_id": cfg["eos_token_id"], "do_sample": False}
        (hdir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        log(f"{s.name} l{layers}: writing {st_path}")
        t0 = time.time()
        write_safetensors(s, layers, st_path, log)
        log(f"{s.name} l{layers}: safetensors done in {time.time() - t0:.0f}s")
    st = SafetensorsFile(st_path)
    for gtype in gguf_types:
        path = gguf_path(s, layers, gtype, root)
        if path.exists() and not force:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"{s.name} l{layers}: writing {path}")
        t0 = time.time()
        write_gguf(s, layers, st, gtype, path, log)
        log(f"{s.name} l{layers}: {gtype} done in {time.time() - t0:.0f}s")


def sizes(shapes: list[Shape], layers: int, gguf_types: list[str]) -> str:
    lines = []
    for s in shapes:
        n = param_count(s, layers)
        parts = [
            f"{s.name} with {layers} layers: {n / 1e9:.2f} B parameters; f16 checkpoint {2 * n / 1e9:.1f} GB"
        ]
        for g in gguf_types:
            if g in ("F16", "BF16"):
                b = 2.0
            elif g == "F32":
                b = 4.0
            else:
                b = {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32}[g]
            parts.append(f"{g} ~{n * b / 1e9:.1f} GB")
        lines.append(", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Write random-weight MoE checkpoints of real widths (HF safetensors + GGUF).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=sizes(list(SHAPES.values()), 4, ["F16", "Q8_0", "Q4_0"]),
    )
    ap.add_argument("--shapes", default="olmoe,qwen3moe", help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--layers", type=int, default=4, help="number of layers (default 4)")
    ap.add_argument(
        "--gguf-types",
        default="F16,Q8_0,Q4_0",
        help=f"comma list of GGUF types to write, from {', '.join(GGUF_TYPES)} (empty: none)",
    )
    ap.add_argument("--cache", type=Path, default=CACHE, help=f"output root (default {CACHE})")
    ap.add_argument("--force", action="store_true", help="rewrite files that exist")
    ap.add_argument("--sizes", action="store_true", help="print the sizes and exit")
    args = ap.parse_args(argv)

    shapes = [SHAPES[n] for n in args.shapes.split(",") if n]
    types = [t.upper() for t in args.gguf_types.split(",") if t]
    for t in types:
        if t not in GGUF_TYPES:
            ap.error(f"unknown GGUF type {t}")
    if args.sizes:
        print(sizes(shapes, args.layers, types))
        return 0

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    for s in shapes:
        make(s, args.layers, types, args.cache, args.force, log)
    print(sizes(shapes, args.layers, types))
    return 0


if __name__ == "__main__":
    sys.exit(main())
