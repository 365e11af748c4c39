#!/usr/bin/env python3
"""llama.cpp's own quantisers on the model colibri runs: bits per weight, KL, top-1.

The llama.cpp side of the comparison of colibri's 4/5/6-bit super-block types
with llama.cpp's (scripts/accuracy.py --quality is colibri's side): a model is
quantised by llama.cpp itself (``llama_model_quantize`` through
llama-cpp-python) into Q4_0, Q4_K_M, Q5_K_M, Q6_K, IQ4_XS and Q8_0,
once without and once with an importance matrix computed by llama.cpp's own
``llama-imatrix`` tool, and every file is run by llama.cpp on held-out tokens.
Each is compared with the unquantised model as colibri's engine runs it
(``colibri.Engine(...).logits``, f32 compute and KV cache, on the bf16/f16
weights):

- bits per weight: file size * 8 / parameters, where parameters are all the
  values of all tensors of the GGUF (matrices, norms, routers), which is the
  checkpoint's own parameter count (a tied embedding counted once). Two more
  columns count the tensor data only (no GGUF header / vocabulary), and the
  routed experts' matrices only (what dominates a full-depth MoE model);
- mean KL(p_ref || p_llama) in nats over all positions and top-1 agreement,
  computed by ``scripts/_common.py``'s ``compare`` (log-softmax in float64),
  as scripts/accuracy.py computes them, and the largest KL of any position;
- the llama.cpp type every tensor actually got, read back from the quantised
  file with ``gguf.GGUFReader``: the "_M" mixes promote some tensors, and
  rows that are not a whole number of 256-value super-blocks fall back to
  32-block types (all of the demo model's 192-wide rows).

The unquantised GGUF (F16, or BF16 for the bf16 demo model, both bit-exact
copies of the reference's weights) is measured the same way, as a check that
both engines run the same model: its KL is not exactly 0 because llama.cpp
rounds the activations to the weights' 16-bit type inside its F16/BF16 dot
products; the demo model's F32 GGUF shows how much of that is rounding.

Models
------
``demo``: the bundled ``python/colibri/data/demo.colibri`` (bf16). Its tensors
are read from the .colibri file and written as a GGUF with
``benches/make_models.py``'s qwen3moe layout and metadata (the tied embedding
is written once, as ``token_embd``, with no ``output.weight``, as llama.cpp's
converter does for tied models). Held out: ``scripts/_common.py``'s
``PROSE`` (128-token windows) and, with ``--austen``, the Austen held-out
split (two 256-token windows per novel), exactly as accuracy.py uses them.
imatrix calibration: the Austen *training* split (512 tokens from the
middle of each novel's training paragraphs, 3072 tokens), so no calibration
token is an evaluation token.

``qwen3moe``: Qwen3-30B-A3B widths (``make_models.SHAPES["qwen3moe"]``: hidden
2048, 128 experts of width 768, top-8, 32 query / 4 KV heads of 128, vocabulary
151936) with ``--layers`` layers, random weights with heavy tails. Each tensor
is first drawn by ``make_models.draw`` (N(0, 1/fan_in) matrices, N(0, 1)
embedding, norms 1 + N(0, 0.1^2), router at twice the matrix scale). Then, in
every matrix llama.cpp quantises (attention q/k/v/o, each expert's gate / up /
down, the embedding, lm_head), ``--outlier-columns`` input columns (4 by
default; column j of a [out, in] matrix holds the weights that multiply input
feature j, i.e. one value in every row and so in every quantisation block)
are multiplied by factors drawn uniformly from [``--outlier-low``,
``--outlier-high``] (8 and 16). Columns and factors come from
``numpy.random.default_rng(crc32("outliers/qwen3moe/<tensor name>"))``:
``choice(in_features, k, replace=False)`` then ``uniform(low, high, k)``, so
each matrix (each expert separately) has its own columns, and a model of
fewer layers is the first layers of a deeper one. Norms and the router (kept
f32 by both engines) are left as drawn. The values are written as an f16
Hugging Face checkpoint, which ``colibri.convert`` turns into the f16
reference .colibri file; the F16 GGUF is written from that .colibri file.
Held out: four sequences of 256 uniformly random token ids (seed 0);
calibration: eight chunks of 256 uniformly random ids (seed 1).

imatrix
-------
``llama-imatrix`` (chunks of ``--imatrix-ctx`` = 256 tokens, ``--no-ppl``,
the output tensor not collected, as by default) reads text, not ids, so
every GGUF written here carries a synthetic vocabulary of llama.cpp's RWKV
type, whose tokenizer is a greedy longest match over the token strings: token 0 is a newline and
token i > 0 the four lowercase letters spelling i in base 26. No string is a
prefix of another, so the calibration file (the ids' strings, concatenated)
tokenises back to exactly those ids (checked before every run). The
resulting ``imatrix.gguf`` is normalised as ``llama-quantize`` does (sum of
squared activations / count, per expert; 1 for an expert that saw no token)
and handed to ``llama_model_quantize`` through ``params.imatrix``
(llama-cpp-python exposes the ``llama_model_imatrix_data`` array);
``--check-tool`` quantises one type with the built ``llama-quantize
--imatrix`` too and checks the tensor data are identical.

llama-imatrix / llama-quantize are not in the llama-cpp-python wheel; build
them from the llama.cpp the wheel vendors (its sdist), as ``--build`` does::

    pip download --no-binary llama-cpp-python --no-deps llama-cpp-python==0.3.36 -d .cache/llamaq/src
    cmake -S .cache/llamaq/src/llama_cpp_python-0.3.36/vendor/llama.cpp -B .cache/llamaq/build \\
        -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \\
        -DGGML_AVX2=ON -DGGML_AVX512=ON ... -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    ninja -C .cache/llamaq/build llama-imatrix llama-quantize

Usage (repository root, colibri, gguf and llama-cpp-python installed)::

    python scripts/llamacpp_quants.py --build                  # the two llama.cpp tools, once
    python scripts/llamacpp_quants.py --models demo --austen download
    python scripts/llamacpp_quants.py --models qwen3moe --layers 1 --scratch /dev/shm/llamaq

prints the markdown tables of docs/llamacpp_quants.md (``--json FILE`` also
writes the raw sums and the time of every step); progress goes to stderr.
Small files (the imatrix and its calibration text and log, the unpacked
Austen package) are kept under ``.cache/llamaq/`` (``--work``); the big
transient ones (the qwen3moe model's Hugging Face checkpoint and reference
.colibri file, the GGUFs, one quantised file at a time) go under ``--scratch``
(default ``<work>/scratch``; ``/dev/shm/...`` keeps them off a full disk) and
are deleted as soon as they have been used, unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import re
import shutil
import subprocess
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
from _common import (
    DEMO,
    PROSE,
    ROOT,
    austen_heldout,
    austen_novels,
    compare,
    log_softmax,
    pool,
    random_sequences,
    windows,
)

# benches/ is a folder of scripts, not a package: its model shapes, tensor
# lists and GGUF plan (make_models.py) are imported from there by path.
sys.path.insert(0, str(ROOT / "benches"))
import make_models as mm  # noqa: E402
from colibri_gguf import build_gguf, token_text  # noqa: E402

import colibri  # noqa: E402

WORK = ROOT / ".cache" / "llamaq"
LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python whose vendored llama.cpp --build compiles
TYPES = ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q8_0"]
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    *(
        f"-DGGML_{f}=ON"
        for f in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI", "AVX512", "AVX512_VBMI")
        + ("AVX512_VNNI", "AVX512_BF16")
    ),
    *(f"-DGGML_AMX_{f}=OFF" for f in ("TILE", "INT8", "BF16")),
    *(f"-DLLAMA_BUILD_{f}=OFF" for f in ("TESTS", "EXAMPLES", "SERVER", "APP", "HTML")),
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(what: str, times: dict | None = None):
    t0 = time.time()
    log(f"{what} ...")
    yield
    dt = time.time() - t0
    log(f"{what}: {dt:.1f} s")
    if times is not None:
        times[what] = round(dt, 1)


# --------------------------------------------------------------------------- llama.cpp tools


def build_tools(work: Path = WORK, version: str = LLAMA_CPP_VERSION, jobs: int = 2) -> Path:
    """Builds llama-imatrix and llama-quantize from the llama.cpp vendored in
    llama-cpp-python's sdist (the same source as the wheel's libllama), CPU
    only, no AMX. Returns the directory of the binaries."""
    src = work / "src"
    tree = src / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not tree.exists():
        src.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps"]
        subprocess.run([*pip, f"llama-cpp-python=={version}", "-d", str(src)], check=True)
        subprocess.run(["tar", "xzf", f"llama_cpp_python-{version}.tar.gz"], cwd=src, check=True)
    build = work / "build"
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS], check=True)
    subprocess.run(
        ["ninja", "-C", str(build), "-j", str(jobs), "llama-imatrix", "llama-quantize"], check=True
    )
    return build / "bin"


def tool(name: str, work: Path = WORK) -> Path:
    path = work / "build" / "bin" / name
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `python scripts/llamacpp_quants.py --build` first")
    return path


# --------------------------------------------------------------------------- synthetic vocabulary


def ids_to_text(ids: list[int]) -> str:
    return "".join(token_text(i) for i in ids)


def text_to_ids(text: str) -> list[int]:
    """Inverse of ids_to_text (what llama.cpp's greedy longest-match finds)."""
    out, pos = [], 0
    while pos < len(text):
        if text[pos] == "\n":
            out.append(0)
            pos += 1
            continue
        code = text[pos : pos + 4]
        out.append(sum((ord(c) - 97) * 26 ** (3 - k) for k, c in enumerate(code)))
        pos += 4
    return out


# --------------------------------------------------------------------------- models


def heavy_tail_draw(
    shape_name: str, t: mm.Tensor, columns: int = 4, low: float = 8.0, high: float = 16.0
) -> np.ndarray:
    """make_models.draw, then `columns` seeded input columns of every matrix
    (and of the embedding) scaled by factors uniform in [low, high]."""
    x = mm.draw(shape_name, t)
    if t.kind not in ("matrix", "embed") or columns == 0:
        return x
    rng = np.random.default_rng(zlib.crc32(f"outliers/{shape_name}/{t.name}".encode()))
    cols = rng.choice(t.shape[-1], size=columns, replace=False)
    x[..., cols] *= rng.uniform(low, high, size=columns).astype(np.float32)
    return x


def write_hf_checkpoint(s: mm.Shape, layers: int, out: Path, draw) -> Path:
    """An f16 Hugging Face checkpoint folder (config.json, model.safetensors)
    of `s` with `layers` layers, every tensor from ``draw(s.name, tensor)``."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = s.hf_config(layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = mm.hf_tensors(s, layers)
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        n = int(np.prod(t.shape)) * 2
        header[t.name] = {"dtype": "F16", "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors:
            f.write(draw(s.name, t).astype(np.float16).tobytes())
    return out


# --------------------------------------------------------------------------- quantising


def load_imatrix(path: Path) -> dict[str, np.ndarray]:
    """llama-imatrix's GGUF output, normalised as llama-quantize's
    load_imatrix does: per expert, the sum of squared activations divided by
    the number of tokens it saw (1.0 for an expert that saw none)."""
    import gguf

    r = gguf.GGUFReader(path)
    sums = {t.name[: -len(".in_sum2")]: t for t in r.tensors if t.name.endswith(".in_sum2")}
    counts = {t.name[: -len(".counts")]: t for t in r.tensors if t.name.endswith(".counts")}
    out = {}
    for name, t in sums.items():
        c = np.rint(np.asarray(counts[name].data, dtype=np.float32).reshape(-1)).astype(np.float32)
        x = np.asarray(t.data, dtype=np.float32).reshape(len(c), -1)
        e = np.ones_like(x)
        seen = c > 0
        e[seen] = x[seen] / c[seen, None]
        out[name] = np.ascontiguousarray(e.reshape(-1), dtype=np.float32)
    return out


def quantize(
    src: Path, dst: Path, qtype: str, imatrix: dict[str, np.ndarray] | None = None, threads: int = 2
):
    """llama.cpp's quantiser (llama_model_quantize, default parameters) from
    `src` to `dst` in the llama_ftype MOSTLY_<qtype>, with an importance
    matrix when given one (as load_imatrix returns)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = threads
    keep = []
    if imatrix:
        arr = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(sorted(imatrix.items())):
            bname = name.encode()
            keep += [bname, values]
            arr[i].name = bname
            arr[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = values.size
        arr[len(imatrix)].name = None  # the terminator
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(arr)
    dst.parent.mkdir(parents=True, exist_ok=True)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    del keep
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {qtype}) returned {rc}")
    return dst


def quantize_with_tool(src: Path, dst: Path, qtype: str, imatrix_file: Path, threads: int = 2) -> Path:
    cmd = [
        str(tool("llama-quantize")),
        "--imatrix",
        str(imatrix_file),
        str(src),
        str(dst),
        qtype,
        str(threads),
    ]
    subprocess.run(
        ["nice", "-n", "10", *cmd], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return dst


def make_imatrix(gguf_path: Path, calib_ids: list[int], out: Path, ctx: int = 256, threads: int = 2) -> Path:
    """llama-imatrix over `calib_ids` (whole chunks of `ctx` tokens), written to
    `out` (GGUF imatrix). The ids go in as the synthetic vocabulary's text."""
    n = len(calib_ids) // ctx * ctx
    if n < 2 * ctx:
        raise ValueError(f"llama-imatrix needs at least {2 * ctx} tokens, got {len(calib_ids)}")
    ids = list(calib_ids[:n])
    text = ids_to_text(ids)
    if text_to_ids(text) != ids:
        raise AssertionError("the synthetic vocabulary does not round-trip these ids")
    out.parent.mkdir(parents=True, exist_ok=True)
    txt = out.with_suffix(".txt")
    txt.write_text(text + "\n")  # llama.cpp drops one trailing newline of a prompt file
    cmd = [str(tool("llama-imatrix")), "-m", str(gguf_path), "-f", str(txt), "-o", str(out)]
    cmd += ["-c", str(ctx), "-b", str(ctx), "-t", str(threads), "--no-ppl"]
    res = subprocess.run(["nice", "-n", "10", *cmd], capture_output=True, text=True)
    (out.with_suffix(".log")).write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"llama-imatrix failed (log: {out.with_suffix('.log')})")
    m = re.search(r"tokenizing the input[\s\S]*?computing over (\d+) chunks", res.stdout + res.stderr)
    if m and int(m.group(1)) != n // ctx:
        raise AssertionError(f"llama-imatrix ran {m.group(1)} chunks, expected {n // ctx}")
    return out


# --------------------------------------------------------------------------- reading files


CLASSES = [
    "token_embd",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
    "output",
]


def tensor_class(name: str) -> str:
    return re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")


def gguf_summary(path: Path) -> dict:
    """Of a GGUF file: parameter count, tensor bytes, file size, bits per
    weight of the file, of its tensor data and of the routed experts'
    matrices (ffn_*_exps) alone, and the llama.cpp types per tensor class (a
    Counter over layers)."""
    import gguf

    r = gguf.GGUFReader(path)
    types: dict[str, Counter] = {}
    params = nbytes = exp_params = exp_bytes = 0
    for t in r.tensors:
        params += int(t.n_elements)
        nbytes += int(t.n_bytes)
        if "_exps." in t.name:
            exp_params += int(t.n_elements)
            exp_bytes += int(t.n_bytes)
        types.setdefault(tensor_class(t.name), Counter())[t.tensor_type.name] += 1
    size = path.stat().st_size
    return {
        "params": params,
        "tensor_bytes": nbytes,
        "file_bytes": size,
        "expert_params": exp_params,
        "bpw": 8 * size / params,
        "bpw_tensors": 8 * nbytes / params,
        "bpw_experts": 8 * exp_bytes / exp_params,
        "types": {k: dict(v) for k, v in types.items()},
    }


def types_text(types: dict[str, dict[str, int]]) -> str:
    """'class TYPE' for each quantised class ('TYPE×n' where layers differ)."""
    out = []
    for c in CLASSES:
        if c not in types:
            continue
        v = types[c]
        if len(v) == 1:
            out.append(f"{c} {next(iter(v))}")
        else:
            out.append(f"{c} " + "/".join(f"{k}×{n}" for k, n in sorted(v.items())))
    return ", ".join(out)


def same_tensor_data(a: Path, b: Path) -> bool:
    import gguf

    ra, rb = gguf.GGUFReader(a), gguf.GGUFReader(b)
    ta = {t.name: t for t in ra.tensors}
    for t in rb.tensors:
        u = ta.get(t.name)
        if u is None or u.tensor_type != t.tensor_type or not np.array_equal(u.data, t.data):
            return False
    return len(ta) == len(rb.tensors)


# --------------------------------------------------------------------------- logits


def reference_logits(colibri_path: Path, seqs: list[list[int]], threads: int = 2) -> list[np.ndarray]:
    eng = colibri.Engine(colibri_path, threads=threads)
    return [eng.logits(ids) for ids in seqs]


def iter_llama_logits(gguf_path: Path, seqs: list[list[int]], threads: int = 2, kv: str = "f32"):
    """llama.cpp's logits (T, V) of every position of each sequence in turn,
    each from an empty KV cache, via llama-cpp-python. `kv`: the KV cache
    type, f32 (default, as colibri's reference) or f16 (llama.cpp's default)."""
    import llama_cpp

    kv_type = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[kv]
    n = max(len(s) for s in seqs)
    llm = llama_cpp.Llama(
        model_path=str(gguf_path),
        n_ctx=n,
        n_batch=n,
        n_ubatch=n,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        type_k=kv_type,
        type_v=kv_type,
        verbose=False,
    )
    try:
        for ids in seqs:
            llm.reset()
            llm.eval(ids)
            yield np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def llama_logits(
    gguf_path: Path, seqs: list[list[int]], threads: int = 2, kv: str = "f32"
) -> list[np.ndarray]:
    """iter_llama_logits as a list."""
    return list(iter_llama_logits(gguf_path, seqs, threads, kv))


def measure(ref: list[np.ndarray], other) -> dict[str, float]:
    """Pooled compare over sequences: positions, agree, kl (sums) and
    kl_max. `other`: logits in the same order, a list or an iterator."""
    return pool([compare(a, b) for a, b in zip(ref, other)])


def top1_median(ref: list[np.ndarray]) -> float:
    return float(np.median(np.concatenate([np.exp(log_softmax(x)).max(axis=-1) for x in ref])))


# --------------------------------------------------------------------------- inputs


def austen_training_calibration(source: str, work: Path, per_novel: int = 512) -> list[int]:
    """`per_novel` demo-tokenizer ids of each novel's training split, from its
    middle paragraph on (the split of scripts/demo/train_demo.py)."""
    tok = colibri.Engine(DEMO, threads=1)
    ids: list[int] = []
    for key, _title, train, _held in austen_novels(source, work):
        text = "\n".join(train[len(train) // 2 :]) + "\n"
        got = tok.tokenize(text[: 20 * per_novel])[:per_novel]  # ~4.2 characters a token
        if len(got) < per_novel:
            raise ValueError(f"{key}: only {len(got)} training tokens")
        ids += got
    return ids


def demo_inputs(austen: str | None, work: Path) -> tuple[dict[str, list[list[int]]], list[int] | None]:
    """Held-out sequences per text (as scripts/accuracy.py uses them) and the
    imatrix calibration ids (None without the Austen corpus)."""
    tok = colibri.Engine(DEMO, threads=1)
    texts = {"own prose": windows(tok.tokenize("\n".join(PROSE) + "\n"), 128)}
    calib = None
    if austen:
        held = austen_heldout(austen, work)
        texts["Austen held-out"] = [w for _t, text in held for w in windows(tok.tokenize(text), 256)[:2]]
        calib = austen_training_calibration(austen, work)
    return texts, calib


# --------------------------------------------------------------------------- runs


def run_model(
    label: str,
    reference: Path,
    ref_gguf_type: str,
    texts: dict[str, list[list[int]]],
    calib: list[int] | None,
    args,
    extra_checks: tuple[str, ...] = (),
    drop_reference: bool = False,
) -> dict:
    """Everything for one model whose reference .colibri file exists: the
    unquantised GGUF(s), the imatrix, each llama.cpp type with / without it.
    With `drop_reference`, the .colibri file is deleted once its logits are
    computed and the GGUF is written from it (to save space)."""
    times: dict[str, float] = {}
    scratch = Path(args.scratch) / label
    work = Path(args.work) / label
    scratch.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"model": label, "reference": str(reference), "rows": [], "times": times}
    with step(f"{label}: colibri reference logits", times):
        ref = {k: reference_logits(reference, v, args.threads) for k, v in texts.items()}
    res["positions"] = {k: int(sum(len(s) for s in v)) for k, v in texts.items()}
    res["ref_top1_median"] = {k: top1_median(v) for k, v in ref.items()}

    def row(name: str, imatrix: bool, path: Path) -> dict:
        r = {"type": name, "imatrix": imatrix, **gguf_summary(path)}
        with step(f"{label}: llama.cpp logits of {path.name}", times):
            for k, seqs in texts.items():
                r[k] = measure(ref[k], iter_llama_logits(path, seqs, args.threads, args.kv))
        res["rows"].append(r)
        print(_row_text(label, r, list(texts)), file=sys.stderr, flush=True)
        return r

    src = scratch / f"model-{ref_gguf_type}.gguf"
    with step(f"{label}: {ref_gguf_type} GGUF", times):
        build_gguf(reference, src, ref_gguf_type, name=label)
    if drop_reference and not extra_checks:
        reference.unlink()
    row(ref_gguf_type, False, src)
    for gt in extra_checks:
        p = scratch / f"model-{gt}.gguf"
        with step(f"{label}: {gt} GGUF", times):
            build_gguf(reference, p, gt, name=label)
        row(gt, False, p)
        if not args.keep:
            p.unlink()

    imat = None
    if args.imatrix != "no":
        if calib is None:
            raise SystemExit(f"{label}: no calibration text for the imatrix (the demo needs --austen)")
        imat_file = work / "imatrix.gguf"
        with step(f"{label}: llama-imatrix over {len(calib)} tokens", times):
            make_imatrix(src, calib, imat_file, ctx=args.imatrix_ctx, threads=args.threads)
        imat = load_imatrix(imat_file)
        res["imatrix_entries"] = len(imat)
    variants = {"no": [False], "yes": [True], "both": [False, True]}[args.imatrix]
    for qt in args.types:
        for use in variants:
            dst = scratch / f"model-{qt}{'-imat' if use else ''}.gguf"
            with step(f"{label}: quantize {qt}{' + imatrix' if use else ''}", times):
                quantize(src, dst, qt, imat if use else None, args.threads)
            row(qt, use, dst)
            if use and args.check_tool and qt == args.check_tool:
                other = scratch / f"model-{qt}-imat-tool.gguf"
                with step(f"{label}: llama-quantize --imatrix {qt}", times):
                    quantize_with_tool(src, other, qt, work / "imatrix.gguf", args.threads)
                res["tool_check"] = {"type": qt, "identical": same_tensor_data(dst, other)}
                log(f"{label}: llama-quantize tool vs API, {qt} + imatrix: {res['tool_check']}")
                other.unlink()
            if not args.keep:
                dst.unlink()
    if not args.keep:
        src.unlink()
    return res


def _row_text(label: str, r: dict, texts: list[str]) -> str:
    cells = [
        label,
        f"`{r['type']}`",
        "yes" if r["imatrix"] else "no",
        f"{r['bpw']:.3f}",
        f"{r['bpw_tensors']:.3f}",
        f"{r['bpw_experts']:.3f}",
    ]
    for k in texts:
        m = r[k]
        n = m["positions"]
        cells += [f"{m['kl'] / n:.2e}", f"{m['kl_max']:.3f}", f"{m['agree'] / n:.4f}"]
    return "| " + " | ".join(cells) + " |"


def print_tables(results: list[dict]) -> None:
    for res in results:
        texts = list(res["positions"])
        head = ["model", "llama.cpp type", "imatrix", "bpw (file)", "bpw (tensors)", "bpw (experts)"]
        for k in texts:
            head += [f"mean KL, {k}", f"max KL, {k}", f"top-1, {k}"]
        print(
            f"**{res['model']}**: {res['rows'][0]['params']:,} parameters; positions: "
            + ", ".join(f"{k} {n}" for k, n in res["positions"].items())
            + "; reference median top-1 probability: "
            + ", ".join(f"{k} {p:.3g}" for k, p in res["ref_top1_median"].items())
        )
        print()
        print("| " + " | ".join(head) + " |")
        print("| " + " | ".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + " |")
        for r in res["rows"]:
            print(_row_text(res["model"], r, texts))
        print()
        print("| llama.cpp type | imatrix | types used (per tensor class; norms and routers F32) |")
        print("| --- | --- | --- |")
        for r in res["rows"]:
            print(f"| `{r['type']}` | {'yes' if r['imatrix'] else 'no'} | {types_text(r['types'])} |")
        print()


def bench_reference(args, times: dict) -> Path:
    """The heavy-tailed Qwen3-30B-A3B-width model as an f16 .colibri file under
    --scratch (made from a transient Hugging Face checkpoint, unless it exists)."""
    s = mm.SHAPES["qwen3moe"]
    name = f"qwen3moe-l{args.layers}-ht{args.outlier_columns}"
    path = Path(args.scratch) / name / "model-f16.colibri"
    if path.exists():
        return path
    hf = Path(args.scratch) / name / "hf"

    def draw(shape_name, t):
        return heavy_tail_draw(shape_name, t, args.outlier_columns, args.outlier_low, args.outlier_high)

    with step(f"{name}: f16 checkpoint ({mm.param_count(s, args.layers):,} parameters)", times):
        write_hf_checkpoint(s, args.layers, hf, draw)
    path.parent.mkdir(parents=True, exist_ok=True)
    with step(f"{name}: colibri.convert to f16", times):
        colibri.convert(hf, path, dtype="f16", progress=False)
    shutil.rmtree(hf)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="store_true", help="build llama-imatrix and llama-quantize, then exit")
    ap.add_argument("--models", default="demo,qwen3moe", help="comma list of demo, qwen3moe")
    ap.add_argument("--types", default=",".join(TYPES), help=f"llama.cpp types (default {','.join(TYPES)})")
    ap.add_argument("--imatrix", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--imatrix-ctx", type=int, default=256, help="llama-imatrix chunk length (default 256)")
    ap.add_argument("--layers", type=int, default=1, help="layers of the qwen3moe model (default 1)")
    ap.add_argument("--outlier-columns", type=int, default=4, help="outlier input columns per matrix")
    ap.add_argument("--outlier-low", type=float, default=8.0)
    ap.add_argument("--outlier-high", type=float, default=16.0)
    ap.add_argument("--austen", metavar="SOURCE", help="demo: 'download', a .deb or an unpacked package")
    ap.add_argument(
        "--kv", choices=["f32", "f16"], default="f32", help="llama.cpp KV cache type (default f32)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=str(WORK), help=f"small and kept files (default {WORK})")
    ap.add_argument("--scratch", help="big transient files (default <work>/scratch)")
    ap.add_argument("--keep", action="store_true", help="keep the GGUF files and the qwen3moe .colibri file")
    ap.add_argument("--check-tool", metavar="TYPE", default="IQ4_XS", help="cross-check one type (or '')")
    ap.add_argument("--json", metavar="FILE", help="also write the raw results as JSON")
    args = ap.parse_args(argv)
    if args.build:
        print(build_tools(Path(args.work)))
        return 0
    args.scratch = args.scratch or str(Path(args.work) / "scratch")
    args.types = [t.upper() for t in args.types.split(",") if t]
    results = []
    for model in [m for m in args.models.split(",") if m]:
        if model == "demo":
            texts, calib = demo_inputs(args.austen, Path(args.work) / "austen")
            res = run_model("demo", DEMO, "BF16", texts, calib, args, extra_checks=("F32",))
        elif model == "qwen3moe":
            times: dict = {}
            ref = bench_reference(args, times)
            vocab = mm.SHAPES["qwen3moe"].vocab
            texts = {"random ids": random_sequences(vocab, 4, 256, seed=0)}
            calib = [i for s in random_sequences(vocab, 8, 256, seed=1) for i in s]
            res = run_model(ref.parent.name, ref, "F16", texts, calib, args, drop_reference=not args.keep)
            res["times"] = {**times, **res["times"]}
        else:
            ap.error(f"unknown model {model}")
        results.append(res)
    print_tables(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
