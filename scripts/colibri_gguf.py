"""A .colibri file of a Qwen3-MoE model as a GGUF that llama.cpp runs: the
same weights bit for bit (16-bit files) in benches/make_models.py's qwen3moe
tensor layout and metadata, with a synthetic vocabulary.

Used by scripts/llamacpp_quants.py (llama.cpp's quantisers against colibri)
and benches/spec_bench.py (llama.cpp as the speculative-decoding peer). It
needs numpy and gguf, not colibri, so it runs in an environment that has
llama-cpp-python alone::

    python scripts/colibri_gguf.py python/colibri/data/demo.colibri demo-bf16.gguf --type BF16

The vocabulary is of llama.cpp's RWKV type, whose tokenizer is a greedy
longest match over the token strings: token 0 is a newline and token i > 0
the four lowercase letters spelling i in base 26, so no string is a prefix
of another and the ids' text tokenises back to the ids. The model's own
tokenizer is not carried over: llama.cpp is given token ids, never text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

# benches/ is a folder of scripts, not a package: its model shapes, tensor
# lists and GGUF plan (make_models.py) are imported from there by path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
import make_models as mm  # noqa: E402


def token_text(i: int) -> str:
    """The string of token `i` in the synthetic RWKV-type vocabulary: a newline
    for 0 (llama.cpp wants a newline token), else i in base 26 as four letters."""
    if i == 0:
        return "\n"
    if not 0 < i < 26**4:
        raise ValueError(f"token id {i} has no 4-letter code")
    return "".join(chr(97 + (i // 26**k) % 26) for k in (3, 2, 1, 0))


def _add_vocab(w, vocab: int) -> None:
    w.add_tokenizer_model("rwkv")
    w.add_token_list([token_text(i) for i in range(vocab)])
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)


class ColibriTensors:
    """The tensors of a .colibri file (docs/FORMAT.md), memory-mapped, under
    their Hugging Face names, with the ``header`` / ``get`` interface of
    make_models.SafetensorsFile. Qwen3-MoE files only. A multi-token-prediction
    layer (``convert --keep-mtp``: the last layer and the ``mtp.*`` tensors) is
    left out, since llama.cpp's qwen3moe has none: the GGUF is the main model."""

    # colibri name (docs/FORMAT.md) -> Hugging Face name
    _NAMES = [
        (r"embed", "model.embed_tokens.weight"),
        (r"final_norm", "model.norm.weight"),
        (r"lm_head", "lm_head.weight"),
        (r"layers\.(\d+)\.attn_norm", r"model.layers.\1.input_layernorm.weight"),
        (r"layers\.(\d+)\.ffn_norm", r"model.layers.\1.post_attention_layernorm.weight"),
        (r"layers\.(\d+)\.attn\.w([qkvo])", r"model.layers.\1.self_attn.\2_proj.weight"),
        (r"layers\.(\d+)\.attn\.([qk])_norm", r"model.layers.\1.self_attn.\2_norm.weight"),
        (r"layers\.(\d+)\.moe\.router", r"model.layers.\1.mlp.gate.weight"),
        (
            r"layers\.(\d+)\.moe\.experts\.(\d+)\.(gate|up|down)",
            r"model.layers.\1.mlp.experts.\2.\3_proj.weight",
        ),
    ]

    def __init__(self, path: Path):
        self.path = Path(path)
        raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        if raw[:8].tobytes() != b"COLIBRI\0":
            raise ValueError(f"{path} is not a .colibri file")
        meta_len = int.from_bytes(raw[16:24].tobytes(), "little")
        data_off = int.from_bytes(raw[24:32].tobytes(), "little")
        self.meta = json.loads(raw[32 : 32 + meta_len].tobytes())
        if self.meta["architecture"] != "Qwen3MoeForCausalLM":
            raise ValueError(f"{path}: only Qwen3MoeForCausalLM is handled, not {self.meta['architecture']}")
        self.raw, self.base = raw, data_off
        self.config = c = self.meta["config"]
        self.layers = len(c["layers"]) - int(c.get("mtp") is not None)
        plain = (
            c["rope"]["scaling"]["type"] == "none"
            and c["rope"]["rotary_dim"] == c["head_dim"]
            and c["attention"]["qk_norm"] == "per_head"
            and c["moe"]["shared_expert"] is None
            and all(
                x["sliding_window"] is None and x["ffn"]["kind"] == "moe" for x in c["layers"][: self.layers]
            )
        )
        if not plain:
            raise ValueError(f"{path}: rope scaling, partial rotary, dense or sliding layers are not handled")
        self.tied = bool(self.config["tie_embeddings"])
        mtp = (r"mtp\..*", rf"layers\.{self.layers}\..*")  # the MTP layer's own tensors and its decoder layer
        main = [t for t in self.meta["tensors"] if not any(re.fullmatch(m, t["name"]) for m in mtp)]
        self.entries = {self.hf_name(t["name"]): t for t in main}
        self.header = {k: {"shape": e["shape"]} for k, e in self.entries.items()}

    @classmethod
    def hf_name(cls, colibri_name: str) -> str:
        for pattern, hf in cls._NAMES:
            m = re.fullmatch(pattern, colibri_name)
            if m:
                return m.expand(hf)
        raise KeyError(f"no Hugging Face name for colibri tensor {colibri_name}")

    def get(self, hf_name: str) -> np.ndarray:
        """The tensor in its stored 16/32-bit type: float16, float32, or the raw
        uint16 of bf16."""
        e = self.entries[hf_name]
        dt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}.get(e["dtype"])
        if dt is None:
            raise ValueError(f"{self.path}: {hf_name} is {e['dtype']}; only 16/32-bit files can be read")
        a = self.base + e["offset"]
        return self.raw[a : a + e["nbytes"]].view(dt).reshape(e["shape"])

    def shape(self, name: str) -> tuple[mm.Shape, dict]:
        """make_models.Shape of the model (layer count apart) and the source
        config.json (for make_models._add_metadata)."""
        c, src = self.config, self.meta["source"]["config"] or {}
        moe, att = c["moe"], c["attention"]
        return mm.Shape(
            name=name,
            hf_class=self.meta["architecture"],
            model_type="qwen3_moe",
            gguf_arch="qwen3moe",
            hidden=c["hidden_size"],
            experts=moe["num_experts"],
            top_k=moe["router"]["top_k"],
            expert_ffn=moe["expert_ffn_dim"],
            heads=c["num_heads"],
            kv_heads=c["num_kv_heads"],
            head_dim=c["head_dim"],
            vocab=c["vocab_size"],
            qk_norm=att["qk_norm"],
            norm_topk_prob=moe["router"]["renormalize"],
            rope_theta=c["rope"]["theta"],
            rms_eps=c["norm"]["eps"],
            max_pos=c["max_seq_len"],
        ), dict(src, intermediate_size=src.get("intermediate_size", 6144))


def _f32(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.uint16:  # bf16 bits
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def build_gguf(colibri_path: Path, out: Path, gtype: str = "F16", name: str = "model") -> Path:
    """A GGUF of the .colibri model with make_models' qwen3moe tensor plan and
    metadata, matrices in `gtype` (F16, BF16 or F32; F16 / BF16 only from a
    file of that type, so the values are copied bit for bit), norms and
    routers f32, and the synthetic vocabulary. A tied embedding is written
    once (token_embd, no output.weight)."""
    import gguf

    src = ColibriTensors(colibri_path)
    s, cfg = src.shape(name)
    layers = src.layers
    stored = {e["dtype"] for e in src.entries.values() if e["dtype"] != "f32"}
    if gtype in ("F16", "BF16") and stored != {gtype.lower()}:
        raise ValueError(f"{colibri_path} stores {sorted(stored)}: a {gtype} GGUF would round the weights")
    ftype = {"F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "F32": "ALL_F32"}[gtype]
    w = gguf.GGUFWriter(None, s.gguf_arch)
    w.add_name(f"{name} ({gtype}, from {colibri_path.name})")
    mm._add_metadata(w, s, layers, cfg)
    w.add_file_type(gguf.LlamaFileType[ftype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(w, s.vocab)
    plan = [e for e in mm.gguf_plan(s, layers) if not (src.tied and e.name == "output.weight")]
    npdt = {"F16": np.float16, "BF16": np.uint16, "F32": np.float32}[gtype]
    for ent in plan:
        first = src.header[ent.hf[0]]["shape"]
        shape = ([len(ent.hf)] if len(ent.hf) > 1 else []) + list(first)
        if ent.kind == "norm":
            w.add_tensor_info(ent.name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            nbytes = int(np.prod(shape)) * np.dtype(npdt).itemsize
            w.add_tensor_info(ent.name, shape, np.dtype(npdt), nbytes, raw_dtype=mm._qtype(gtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for ent in plan:
        parts = [src.get(n) for n in ent.hf]
        if ent.kind == "norm" or gtype == "F32":
            parts = [_f32(p) for p in parts]
        x = np.stack(parts) if len(parts) > 1 else np.ascontiguousarray(parts[0])
        w.write_tensor_data(x)
    w.close()
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="a .colibri file of a Qwen3-MoE model (16 or 32-bit weights)")
    ap.add_argument("out", type=Path, help="the GGUF to write")
    ap.add_argument(
        "--type", default="BF16", choices=["F16", "BF16", "F32"], help="matrix type (default BF16)"
    )
    ap.add_argument("--name", default="model", help="the model's name in the GGUF metadata")
    args = ap.parse_args(argv)
    build_gguf(args.model, args.out, args.type, name=args.name)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
