"""Shared fixtures: the golden cases and converted models, made once per session."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import struct
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import colibri

# Ray's local test clusters bind 127.0.0.1: with clusters "disabled" (the
# switch Ray reads for Windows and macOS, read once at import) Ray takes the
# loopback address for its node, where it would take the host's own.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# A run started in the background by a shell without job control inherits
# SIGINT ignored, and every child would too: the Ctrl-C tests' processes
# would never see it. With a handler here, children start with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.npz").exists())
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module. The scripts import their shared helpers
    (scripts/_common.py) as running one from the repository root does, with
    scripts/ on the import path, so a test puts it there too."""
    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))
    return importlib.import_module(name)


def read_safetensors(path: Path) -> tuple[dict[str, dict], bytes]:
    """Header entries and the raw data section of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n :]


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Writes {name: (dtype, shape, bytes)} as a safetensors file."""
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def load_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a (possibly sharded) checkpoint folder."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        header, data = read_safetensors(f)
        for name, e in header.items():
            s, t = e["data_offsets"]
            out[name] = (e["dtype"], e["shape"], data[s:t])
    return out


def copy_case_single_file(case: str, dst: Path) -> Path:
    """A golden case re-saved as one model.safetensors, for tests that edit it."""
    src = GOLDEN / case
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    write_safetensors(dst / "model.safetensors", load_tensors(src))
    return dst


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(case, dtype) -> path of the .colibri file, converting once.

    `dtype=None` keeps the source's type; for a quantised source (MXFP4),
    whose default is q8_0, it means bf16, which holds MXFP4 values exactly, so
    parity checks the reading of the codes and nothing else."""
    root = tmp_path_factory.mktemp("converted")
    cache: dict[tuple[str, str | None], Path] = {}

    def get(case: str, dtype: str | None = None) -> Path:
        key = (case, dtype)
        if key not in cache:
            out = root / f"{case}-{dtype or 'auto'}.colibri"
            quantised = "quantization_config" in json.loads((GOLDEN / case / "config.json").read_text())
            colibri.convert(
                GOLDEN / case, out, dtype=dtype or ("bf16" if quantised else None), progress=False
            )
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session")
def golden():
    """golden(case) -> the case's golden arrays."""
    cache: dict[str, dict[str, np.ndarray]] = {}

    def get(case: str) -> dict[str, np.ndarray]:
        if case not in cache:
            with np.load(GOLDEN / case / "golden.npz") as z:
                cache[case] = {k: z[k] for k in z.files}
        return cache[case]

    return get


@pytest.fixture(scope="session")
def mixtral(converted):
    """An engine on the small Mixtral fixture."""
    return colibri.Engine(converted("mixtral"), threads=2)


# ---------------------------------------------------------------------------
# Text-capable models: the golden checkpoints have no tokenizer, so tests give
# them one built here with the `tokenizers` package (no network): a small BPE
# with byte fallback over a fixed alphabet, filled up to the model's
# vocabulary with merges learned from a short text, in one of two styles.

# Characters outside the alphabet become UTF-8 byte tokens, so these span tokens.
NON_ASCII = "éüïç€🙂"
ALPHABET = (
    ["▁"]
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    + list("0123456789.,!?'-:")
)
CORPUS = (
    "Once upon a time there was a little bird that sang in the garden every morning. "
    "The bird liked the sun, the rain and the wind; it sang to the trees and the flowers. "
    "One day the bird met a cat in the garden, and the cat said hello to the bird. "
    "They became friends and sang together until the end of time."
)
STYLES = {
    # Llama/Mistral-like: <s> added in front, </s> ends, [INST] chat template.
    "llama": {
        "specials": ["<unk>", "<s>", "</s>"],
        "tokenizer_config": {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "chat_template": (
                "{{ bos_token }}{% for m in messages %}"
                "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
                "{% else %}{{ raise_exception('only user and assistant roles') }}{% endif %}"
                "{% endfor %}"
            ),
        },
        "generation_config": {"bos_token_id": 1, "eos_token_id": 2},
        "post_processor": ("<s>", 1),
    },
    # Qwen-like: no beginning-of-sequence token, ChatML template, two eos ids.
    "chatml": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "tokenizer_config": {
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "add_bos_token": False,
            "chat_template": (
                "{% for m in messages %}"
                "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
                "{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
            ),
        },
        "generation_config": {"eos_token_id": [2, 0], "do_sample": False},
        "post_processor": None,
    },
}


def learn_merges(text: str, alphabet: list[str], n: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair)."""
    words = [["▁", *w] for w in text.replace(".", " .").replace(",", " ,").split()]
    merges: list[tuple[str, str]] = []
    known = set(alphabet)
    while len(merges) < n:
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        candidates = [p for p in counts if p[0] + p[1] not in known]
        if not candidates:
            break
        best = min(candidates, key=lambda p: (-counts[p], p))
        merges.append(best)
        known.add(best[0] + best[1])
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i : i + 2] = [best[0] + best[1]]
                i += 1
    return merges


def build_tokenizer(vocab_size: int, style: str) -> str:
    """tokenizer.json text of a tokenizer with exactly `vocab_size` tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    spec = STYLES[style]
    byte_tokens = sorted({f"<0x{b:02X}>" for b in (NON_ASCII + "\n").encode()})
    base = spec["specials"] + byte_tokens + ALPHABET
    merges = learn_merges(CORPUS, ALPHABET, vocab_size - len(base))
    tokens = base + [a + b for a, b in merges]
    assert len(tokens) == vocab_size, f"the corpus gives only {len(tokens)} tokens"
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            unk_token=spec["specials"][0] if style == "llama" else None,
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["specials"]])
    if spec["post_processor"]:
        bos, bos_id = spec["post_processor"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
        )
    return tok.to_str()


def make_text_checkpoint(case: str, dst: Path, style: str, **overrides: dict) -> Path:
    """A copy of a golden case with tokenizer files of the given style.
    `overrides` replace whole files: tokenizer_config=..., generation_config=..."""
    shutil.copytree(GOLDEN / case, dst, ignore=shutil.ignore_patterns("golden.npz", "meta.json"))
    vocab = json.loads((dst / "config.json").read_text())["vocab_size"]
    spec = STYLES[style]
    (dst / "tokenizer.json").write_text(build_tokenizer(vocab, style), encoding="utf-8")
    files = {"tokenizer_config": spec["tokenizer_config"], "generation_config": spec["generation_config"]}
    files.update(overrides)
    for name, content in files.items():
        path = dst / f"{name}.json"
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    return dst


@pytest.fixture(scope="session")
def text_model(tmp_path_factory):
    """text_model(case, style) -> a converted .colibri file with a tokenizer."""
    root = tmp_path_factory.mktemp("text")
    cache: dict[tuple[str, str], Path] = {}

    def get(case: str = "mixtral", style: str = "llama") -> Path:
        if (case, style) not in cache:
            src = make_text_checkpoint(case, root / f"{case}-{style}", style)
            out = root / f"{case}-{style}.colibri"
            colibri.convert(src, out, progress=False)
            cache[case, style] = out
        return cache[case, style]

    return get


@pytest.fixture(scope="session")
def llama(text_model):
    """An engine on the Mixtral fixture with a Llama-style tokenizer."""
    return colibri.Engine(text_model("mixtral", "llama"), threads=2)


@pytest.fixture(scope="session")
def chatml(text_model):
    """An engine on the Qwen3-MoE fixture with a ChatML-style tokenizer."""
    return colibri.Engine(text_model("qwen3_moe", "chatml"), threads=2)
