#!/usr/bin/env python3
"""A NumPy f32 forward of transformers' GPT-OSS (``modeling_gpt_oss.py``), for
the random checkpoint ``make_models.py`` writes, to tell which engine moves
when colibri and llama.cpp disagree (``docs/benchmarks.md``).

It follows transformers: YaRN inverse frequencies and attention factor as
``_compute_yarn_parameters`` (``truncate`` from config.json, or forced with
``--truncate true|false``), rotate-half RoPE, a learned sink logit per head
joining the softmax, the window on ``sliding_attention`` layers
(``query - key < sliding_window``), the router's top-k then a softmax over
those k, the clamped SwiGLU over the interleaved ``gate_up_proj``
(``(up + 1) * gate * sigmoid(1.702 * gate)``, gate <= limit, |up| <= limit).

Usage::

    python benches/reference_gpt_oss.py --tokens 200            # writes logits-ref-200.npy
    python benches/reference_gpt_oss.py --tokens 200 \
        --compare benches/.cache/gpt_oss_20b-l4/logits-{colibri,llama}-f16.npy

The token ids are ``bench.py``'s verification ids (``prompt_ids(n, vocab, 7)``),
so ``--compare`` takes the ``logits-*.npy`` files ``bench.py --verify`` leaves.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402
import make_models as mm  # noqa: E402


def yarn(cfg: dict, truncate: bool | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [n, head_dim], attention factor included."""
    hd, base = cfg["head_dim"], cfg["rope_theta"]
    rs = cfg["rope_scaling"]
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]
    if truncate is None:
        truncate = rs.get("truncate", True)

    def corr_dim(rot: float) -> float:
        return (hd * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(rs.get("beta_fast", 32.0)), corr_dim(rs.get("beta_slow", 1.0))
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - np.clip((np.arange(hd // 2) - low) / (high - low), 0, 1)
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    ang = np.arange(n, dtype=np.float64)[:, None] * inv[None]
    emb = np.concatenate([ang, ang], -1)
    return (np.cos(emb) * attention_factor).astype(np.float32), (np.sin(emb) * attention_factor).astype(
        np.float32
    )


def forward(hf: Path, ids: list[int], truncate: bool | None) -> np.ndarray:
    cfg = json.loads((hf / "config.json").read_text())
    st = mm.SafetensorsFile(hf / "model.safetensors")

    def w(name: str) -> np.ndarray:
        return np.asarray(st.get(name), dtype=np.float32)

    n = len(ids)
    h_, kv_, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    cos, sin = yarn(cfg, truncate, n)

    def rope(x: np.ndarray) -> np.ndarray:
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg["rms_norm_eps"]) * g

    alpha, limit = cfg.get("swiglu_alpha", 1.702), cfg["swiglu_limit"]
    i, j = np.arange(n)[:, None], np.arange(n)[None]
    x = w("model.embed_tokens.weight")[ids]
    for layer in range(cfg["num_hidden_layers"]):
        p, a = f"model.layers.{layer}", f"model.layers.{layer}.self_attn"
        h = rms(x, w(f"{p}.input_layernorm.weight"))
        q = (h @ w(f"{a}.q_proj.weight").T + w(f"{a}.q_proj.bias")).reshape(n, h_, hd)
        k = (h @ w(f"{a}.k_proj.weight").T + w(f"{a}.k_proj.bias")).reshape(n, kv_, hd)
        v = (h @ w(f"{a}.v_proj.weight").T + w(f"{a}.v_proj.bias")).reshape(n, kv_, hd)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, h_ // kv_, 1), np.repeat(v, h_ // kv_, 1)
        s = np.einsum("ihd,jhd->hij", q, k) * hd**-0.5
        mask = j <= i
        if cfg["layer_types"][layer] == "sliding_attention":
            mask &= (i - j) < cfg["sliding_window"]
        s = np.where(mask[None], s, -np.inf)
        s = np.concatenate([s, np.broadcast_to(w(f"{a}.sinks")[:, None, None], (h_, n, 1))], -1)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr = (pr / pr.sum(-1, keepdims=True))[..., :-1]
        o = np.einsum("hij,jhd->ihd", pr, v).reshape(n, h_ * hd)
        x = x + o @ w(f"{a}.o_proj.weight").T + w(f"{a}.o_proj.bias")
        h = rms(x, w(f"{p}.post_attention_layernorm.weight"))
        logits = h @ w(f"{p}.mlp.router.weight").T + w(f"{p}.mlp.router.bias")
        top = np.argsort(-logits, 1, kind="stable")[:, : cfg["num_experts_per_tok"]]
        tv = np.take_along_axis(logits, top, 1)
        tw = np.exp(tv - tv.max(1, keepdims=True))
        tw /= tw.sum(1, keepdims=True)
        gu_all, gub = st.get(f"{p}.mlp.experts.gate_up_proj"), w(f"{p}.mlp.experts.gate_up_proj_bias")
        dn_all, dnb = st.get(f"{p}.mlp.experts.down_proj"), w(f"{p}.mlp.experts.down_proj_bias")
        out = np.zeros_like(x)
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            gu = h[rows] @ np.asarray(gu_all[e], np.float32) + gub[e]
            g, u = np.minimum(gu[:, 0::2], limit), np.clip(gu[:, 1::2], -limit, limit)
            y = ((u + 1) * (g / (1 + np.exp(-alpha * g)))) @ np.asarray(dn_all[e], np.float32) + dnb[e]
            out[rows] += tw[rows, slot][:, None] * y
        x = x + out
    return rms(x, w("model.norm.weight")) @ w("lm_head.weight").T


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--truncate", choices=["config", "true", "false"], default="config")
    ap.add_argument("--compare", type=Path, nargs="*", default=[], help="logits .npy files to compare with")
    args = ap.parse_args(argv)
    shape = mm.SHAPES["gpt_oss_20b"]
    hf = mm.hf_dir(shape, args.layers)
    ids = bench.prompt_ids(args.tokens, shape.vocab, 7)
    truncate = None if args.truncate == "config" else args.truncate == "true"
    ref = forward(hf, ids, truncate)
    tag = "" if args.truncate == "config" else f"-truncate-{args.truncate}"
    out = mm.model_dir(shape, args.layers) / f"logits-ref-{args.tokens}{tag}.npy"
    np.save(out, ref)
    print(f"reference logits {ref.shape} -> {out}")
    for path in args.compare:
        c = np.load(path)[: len(ids)]
        d = np.abs(c - ref)
        print(
            f"{path.name}: max abs diff {d.max():.3g}, / range {d.max() / (ref.max() - ref.min()):.2g}, "
            f"median row max {np.median(d.max(1)):.3g}, "
            f"argmax {(c.argmax(1) == ref.argmax(1)).sum()}/{len(ids)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
