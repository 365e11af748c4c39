#!/usr/bin/env python3
"""colibri vs llama.cpp on random-weight models of real MoE widths.

The models come from ``benches/make_models.py`` (made on demand): one
Hugging Face checkpoint per shape, converted by ``colibri convert`` for
colibri and written as GGUF with the same values for llama.cpp (through
``llama-cpp-python``). Every measurement runs in a fresh subprocess, colibri
and llama.cpp alternating run by run; the tables give medians.

Per model x weight type x thread count:

- prefill tok/s for a 64- and a 512-token prompt (prompt in, first token out,
  weights already in memory);
- decode tok/s over N greedy tokens after a 64-token prompt (``--context``:
  after a real prefill of that many tokens, e.g. 32768);
- TTFT: the 64-token prefill's wall time; load: open-to-first-token in a
  fresh process for a 1-token prompt (page cache warm, nothing else
  loaded), i.e. the cost of opening and first touching the weights;
- peak RSS of the process (VmHWM; mapped weight pages count);
- the memory-bandwidth roofline: this machine's read bandwidth (a small C
  probe, or NumPy when no C compiler is found) over the weight bytes one
  decoded token reads (see ``bytes_per_token``), and the fraction of it each
  engine reaches.

``--noisy`` adds a noisy-neighbour run: a CPU-bound process pinned to one core
while 2-thread decode runs, against the same decode without it.
``--verify`` checks that both engines compute the same model (F16 logits of a
small variant, side by side).

Every timed run saves its raw figures (``--json FILE``, by default
``benches/.cache/results-DATE.json``) and prints its tables. ``--results NAME``
also writes the run as ``benches/results/NAME.json``, the file a table of
docs/benchmarks.md is rendered from (machine, date, commit, command, rows), and
prints the ``<!-- render: NAME.json VIEW -->`` lines that show it; it refuses to
replace an existing file unless ``--force`` is given. ``--report RAW [RAW ...]``
prints the tables of saved raw runs instead of measuring, and with
``--results`` turns them (one machine's runs) into one results file.

Examples::

    python benches/bench.py --quick                  # smoke test: 1 layer, 1 rep
    python benches/bench.py --models olmoe --types f16 --threads 2
    python benches/bench.py --verify --layers 2
    python benches/bench.py --models olmoe --pairs q8_0:Q8_0 --threads 2 --results xeon-2026-12-24-bench
    python benches/bench.py --report benches/.cache/results-A.json results-B.json --results NAME
    python benches/bench.py --models deepseek_v2_lite,gpt_oss_20b --pairs q8_0:Q8_0,q4_0:Q4_0 --threads 2
    python benches/bench.py --models deepseek_v2_lite --kv   # KV-cache bytes per token at 4k, both engines
    python benches/bench.py --models qwen3moe --pairs q4k-mix:Q4_K_M --threads 2  # llama.cpp quantises Q4_K_M
    python benches/bench.py --models nemotron3_nano --layers 7 --pairs q8_0:Q8_0 --threads 2 --prompts 64,512
    python benches/bench.py --models deepseek_v4_flash --pairs q8_0:Q8_0 --threads 2 --prompts 64 \
        --context 32768 --decode-tokens 16 --reps 3   # decode after a real 32k-token prefill, both engines
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_models as mm  # noqa: E402
import render_results as R  # noqa: E402

REPO = HERE.parent

# colibri weight type -> GGUF type holding the same kind of numbers.
GGUF_TWIN = {"f32": "F32", "bf16": "BF16", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


# ---------------------------------------------------------------- helpers


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """Deterministic token ids, avoiding the low ids where special tokens live."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(1000, vocab, n)]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    """High-water RSS of this process image (VmHWM). Not ru_maxrss: Linux
    carries that across fork + exec, so a child would inherit the parent's."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


# ---------------------------------------------------------------- engines (worker side)


class Colibri:
    name = "colibri"

    def __init__(self, path: str, threads: int):
        import colibri

        self.engine = colibri.Engine(path, threads=threads)
        self.kw = {}
        import inspect

        if "ignore_eos" in inspect.signature(self.engine.generate).parameters:
            self.kw["ignore_eos"] = True

    def first_token(self, ids: list[int]) -> int:
        out = self.engine.generate(ids, max_new_tokens=1, **self.kw)
        return int(out[0])

    def decode(self, ids: list[int], n: int) -> tuple[float, int]:
        """Seconds for the n-1 tokens after the first, and how many came out."""
        t0 = time.perf_counter()
        out = self.engine.generate(ids, max_new_tokens=n, **self.kw)
        total = time.perf_counter() - t0
        timings = getattr(out, "timings", None)
        if timings is not None:
            return timings.decode_seconds, len(out)
        return total - self._prefill_estimate(ids), len(out)

    def _prefill_estimate(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.first_token(ids)
        return time.perf_counter() - t0

    def logits(self, ids: list[int]) -> np.ndarray:
        return np.asarray(self.engine.logits(ids), dtype=np.float32)

    def batch_decode(self, prompts: list[list[int]], n: int) -> tuple[float, int]:
        """Seconds and tokens of decoding `prompts` together: a batch of n new tokens
        each less the same batch of one (the prefills and first tokens)."""
        t0 = time.perf_counter()
        self.engine.generate(prompts, max_new_tokens=1, **self.kw)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = self.engine.generate(prompts, max_new_tokens=n, **self.kw)
        return time.perf_counter() - t0 - first, sum(len(o) - 1 for o in outs)

    def state_bytes(self) -> dict[str, int]:
        return dict(self.engine.state_bytes())


class Llama:
    name = "llama.cpp"

    def __init__(self, path: str, threads: int, n_ctx: int = 1024, logits_all: bool = False):
        import llama_cpp

        self.lc = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=n_ctx,
            n_batch=512,
            n_ubatch=512,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=logits_all,
            use_mmap=True,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()

    def _last_argmax(self) -> int:
        ptr = self.lc.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def first_token(self, ids: list[int]) -> int:
        self.llm.reset()
        self.llm.eval(ids)
        return self._last_argmax()

    def decode(self, ids: list[int], n: int) -> tuple[float, int]:
        tok = self.first_token(ids)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            self.llm.eval([tok])
            tok = self._last_argmax()
        return time.perf_counter() - t0, n

    def logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)


def open_engine(spec: dict):
    if spec["engine"] == "colibri":
        return Colibri(spec["path"], spec["threads"])
    # Room for the longest prompt (and the decode after the 64-token one), or
    # for the ids whose logits are asked for.
    n_ctx = max(
        1024,
        max(spec.get("prompts") or [0]) + 16,
        len(spec.get("ids") or []) + 16,
        spec.get("context", 64) + spec.get("decode_tokens", 0) + 16,
    )
    return Llama(spec["path"], spec["threads"], n_ctx=n_ctx, logits_all=spec.get("logits_all", False))


def read_through(path: str) -> float:
    """Reads a file once, so that its pages are in the page cache; seconds taken."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def drop_cached(path: Path) -> None:
    """Asks the kernel to drop a file's pages from the page cache (Linux; elsewhere nothing)."""
    if hasattr(os, "posix_fadvise") and path.exists():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def worker(spec: dict) -> dict:
    """One measurement in this (fresh) process; returns a JSON-able dict."""
    vocab, res = spec["vocab"], {}
    # Every weight page in the page cache before the clock starts: a model of
    # 256 experts touches new experts for many tokens, and a page read from
    # disk then would be timed as decode.
    res["read_through_s"] = read_through(spec["path"])
    t0 = time.perf_counter()
    eng = open_engine(spec)
    res["open_s"] = time.perf_counter() - t0
    res["rss_after_open_mb"] = rss_mb()
    if spec["mode"] == "logits":
        np.save(spec["out"], eng.logits(spec["ids"]))
        return res
    # Open-to-first-token: the first forward pass after opening (a 1-token
    # prompt, so it is the weights' first touch rather than prefill work).
    eng.first_token(prompt_ids(1, vocab, 1))
    res["load_s"] = time.perf_counter() - t0
    eng.first_token(prompt_ids(64, vocab, 1))  # warm-up at the prompt length used below
    if spec["mode"] == "full":
        for n in spec["prompts"]:
            p = prompt_ids(n, vocab, 100 + n)
            t = time.perf_counter()
            eng.first_token(p)
            res[f"prefill{n}_s"] = time.perf_counter() - t
    # Decode after a real prefill of `context` tokens (64 unless --context).
    context = spec.get("context", 64)
    c0, t0 = cpu_s(), time.perf_counter()
    sec, got = eng.decode(prompt_ids(context, vocab, 2), spec["decode_tokens"] + 1)
    res["decode_cpu_s"] = cpu_s() - c0
    # The prompt's prefill and first token (colibri times its decode itself;
    # for llama.cpp it is the call less the timed loop).
    res["context"], res["context_prefill_s"] = context, time.perf_counter() - t0 - sec
    res["decode_s"], res["decode_n"] = sec, got - 1
    if spec.get("batch") and spec["engine"] == "colibri":
        prompts = [prompt_ids(64, vocab, 300 + i) for i in range(spec["batch"])]
        res["batch_s"], res["batch_n"] = eng.batch_decode(prompts, spec["decode_tokens"] + 1)
    if spec["engine"] == "colibri":
        res["state_bytes"] = eng.state_bytes()
    res["peak_rss_mb"] = peak_rss_mb()
    res["load_avg"] = loadavg()
    if spec["engine"] == "colibri":
        res["extension"] = extension_digest()
    return res


def extension_digest() -> str:
    """The imported colibri extension's hash (it can be rebuilt under a long run)."""
    import hashlib

    import colibri

    so = next(iter(sorted(Path(colibri.__file__).resolve().parent.glob("_colibri*"))), None)
    return hashlib.sha256(so.read_bytes()).hexdigest()[:12] if so else "?"


# ---------------------------------------------------------------- parent side


def run_worker(spec: dict, noisy: bool = False, timeout: float = 3600) -> dict:
    hog = None
    if noisy:
        hog = start_hog()
    try:
        p = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if p.returncode != 0:
        raise RuntimeError(f"worker failed ({spec['engine']} {spec['path']}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def start_hog() -> subprocess.Popen:
    """A CPU-bound process pinned to the last core."""
    cpu = max(os.sched_getaffinity(0))
    return subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )


BW_C = r"""
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/mman.h>
#endif
/* Streaming read bandwidth: each thread ORs its share of a large buffer
   into four AVX2 registers. Prints, per repetition, GB/s over wall-clock
   time and over the slowest thread's CPU time (the second ignores time the
   threads spent descheduled on a busy machine). The buffer asks for 2 MiB
   pages, as the engines' weights get them: a file mapped from the page
   cache is mapped by 2 MiB folios where the kernel and file system make
   them (Linux 6.18 on ext4 mapped the whole q4_0 bench model so), and 4 KiB
   pages read slower (one thread: about 18 against 28 GB/s on a Zen 4 EPYC).
   The kB it got are printed to stderr. */
static char *buf; static size_t bytes; static int nthr; static pthread_barrier_t bar;
static volatile int sink; static double cpu[64];
static double clk(clockid_t c) {
  struct timespec t; clock_gettime(c, &t); return t.tv_sec + t.tv_nsec * 1e-9;
}
static void *run(void *arg) {
  long id = (long)arg; size_t n = bytes / nthr; const __m256i *p = (const __m256i *)(buf + id * n);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  pthread_barrier_wait(&bar);
  double c0 = clk(CLOCK_THREAD_CPUTIME_ID);
  for (size_t i = 0; i < n / 32; i += 4) {
    a0 = _mm256_or_si256(a0, _mm256_load_si256(p + i));
    a1 = _mm256_or_si256(a1, _mm256_load_si256(p + i + 1));
    a2 = _mm256_or_si256(a2, _mm256_load_si256(p + i + 2));
    a3 = _mm256_or_si256(a3, _mm256_load_si256(p + i + 3));
  }
  a0 = _mm256_or_si256(_mm256_or_si256(a0, a1), _mm256_or_si256(a2, a3));
  sink += _mm256_extract_epi32(a0, 0);
  cpu[id] = clk(CLOCK_THREAD_CPUTIME_ID) - c0;
  pthread_barrier_wait(&bar);
  return 0;
}
int main(int argc, char **argv) {
  size_t mb = atol(argv[1]); nthr = atoi(argv[2]); int reps = atoi(argv[3]);
  bytes = mb << 20; buf = aligned_alloc(2 << 20, bytes);
#ifdef MADV_HUGEPAGE
  madvise(buf, bytes, MADV_HUGEPAGE);
#endif
  memset(buf, 1, bytes);
  FILE *sm = fopen("/proc/self/smaps_rollup", "r"); char line[256];
  while (sm && fgets(line, sizeof line, sm))
    if (!strncmp(line, "AnonHugePages:", 14)) fprintf(stderr, "huge %ld %zu\n", atol(line + 14), bytes >> 10);
  if (sm) fclose(sm);
  for (int r = 0; r < reps; r++) {
    pthread_t th[64]; pthread_barrier_init(&bar, 0, nthr + 1);
    for (long i = 0; i < nthr; i++) pthread_create(&th[i], 0, run, (void *)i);
    pthread_barrier_wait(&bar); double t0 = clk(CLOCK_MONOTONIC);
    pthread_barrier_wait(&bar); double t1 = clk(CLOCK_MONOTONIC);
    for (int i = 0; i < nthr; i++) pthread_join(th[i], 0);
    pthread_barrier_destroy(&bar);
    double c = 0; for (int i = 0; i < nthr; i++) c = cpu[i] > c ? cpu[i] : c;
    printf("%.3f %.3f\n", bytes / (t1 - t0) / 1e9, bytes / c / 1e9);
  }
  return 0;
}
"""


def bandwidth(threads: int, reps: int = 15, mb: int = 1024) -> dict:
    """Read bandwidth in GB/s: best and median of `reps` passes over `mb` MiB."""
    cc = shutil.which("cc") or shutil.which("gcc")
    samples: list[float] = []
    cpu_samples: list[float] = []
    method = "numpy"
    if cc and platform.machine() in ("x86_64", "AMD64"):
        exe = mm.CACHE / f"bwprobe-{hashlib.sha256(BW_C.encode()).hexdigest()[:12]}"
        if not exe.exists():
            mm.CACHE.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
                f.write(BW_C)
            subprocess.run([cc, "-O2", "-mavx2", "-pthread", f.name, "-o", str(exe)], capture_output=True)
            os.unlink(f.name)
        if exe.exists():
            out = subprocess.run([str(exe), str(mb), str(threads), str(reps)], capture_output=True, text=True)
            vals = [float(x) for x in out.stdout.split()]
            samples, cpu_samples = vals[0::2], vals[1::2]
            huge = [line.split() for line in out.stderr.splitlines() if line.startswith("huge ")]
            share = int(huge[0][1]) / int(huge[0][2]) if huge else 0.0
            pages = "2 MiB pages" if share >= 0.9 else f"4 KiB pages ({share:.0%} in 2 MiB ones)"
            method = f"C/AVX2 OR-reduction, {pages}"
    if not samples:
        import threading

        a = np.ones(mb << 18, dtype=np.float32).view(np.float64)
        parts = np.array_split(a, threads)
        for _ in range(reps):
            ts = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
            t0 = time.perf_counter()
            [t.start() for t in ts]
            [t.join() for t in ts]
            samples.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
    res = {"best": max(samples), "median": statistics.median(samples), "method": method, "samples": samples}
    if cpu_samples:
        res["cpu_best"] = max(cpu_samples)
        res["cpu_samples"] = cpu_samples
    # The roofline is the best pass over CPU time when there is one: on a
    # shared, busy machine the wall-clock passes mostly measure time slicing.
    res["roofline"] = res.get("cpu_best", res["best"])
    return res


# ---------------------------------------------------------------- bytes per token


def colibri_tensors(path: Path) -> list[dict]:
    with open(path, "rb") as f:
        head = f.read(32)
        meta_len = int.from_bytes(head[16:24], "little")
        meta = json.loads(f.read(meta_len))
    return meta["tensors"]


def gguf_tensors(path: Path) -> list[dict]:
    import gguf

    r = gguf.GGUFReader(path)
    return [
        {
            "name": t.name,
            "dtype": t.tensor_type.name,
            "shape": [int(x) for x in t.shape],
            "nbytes": int(t.n_bytes),
        }
        for t in r.tensors
    ]


def bytes_per_token(tensors: list[dict], shape: mm.Shape, fmt: str) -> dict:
    """Weight bytes one decoded token reads, by part.

    per layer: attention (q, k, v, o and their norms) + router + the two
    norms + top_k / num_experts of the layer's expert bytes; plus one
    embedding row (embedding bytes / vocab) + the whole lm_head + final norm.
    A linear-attention or Mamba2 mixer's tensors and shared experts are read
    whole, so they count with "attention+norms"; a hash-routed layer's token ->
    experts table (DeepSeek-V4) counts one row (table bytes / vocab) under the
    router. KV-cache and recurrent-state reads (small at these lengths) and
    activations are left out.
    """
    k, e, v = shape.top_k, shape.experts, shape.vocab
    parts = {"attention+norms": 0.0, "router": 0.0, "experts": 0.0, "embedding row": 0.0, "lm_head": 0.0}
    for t in tensors:
        n, b = t["name"], float(t["nbytes"])
        if fmt == "colibri":
            is_expert = ".moe.experts." in n
            is_router = n.endswith(".moe.router")
            is_table = n.endswith(".moe.hash_table")
            is_embed, is_head = n == "embed", n == "lm_head"
        else:
            is_expert = "_exps" in n
            is_router = n.endswith("ffn_gate_inp.weight")
            is_table = n.endswith("ffn_gate_tid2eid.weight")
            is_embed, is_head = n == "token_embd.weight", n == "output.weight"
        if is_expert:
            parts["experts"] += b * k / e
        elif is_table:
            parts["router"] += b / v
        elif is_router:
            parts["router"] += b
        elif is_embed:
            parts["embedding row"] += b / v
        elif is_head:
            parts["lm_head"] += b
        else:
            parts["attention+norms"] += b
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------- the run


def llama_quantize(src: Path, dst: Path, qtype: str, threads: int = 2) -> None:
    """llama.cpp's own quantiser (``llama_model_quantize``, default
    parameters, no importance matrix) from `src` into LLAMA_FTYPE_MOSTLY_<qtype>,
    in a child process (its buffers would otherwise count in this one)."""
    code = (
        "import ctypes, sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = getattr(llama_cpp, 'LLAMA_FTYPE_MOSTLY_' + sys.argv[3])\n"
        "p.nthread = int(sys.argv[4])\n"
        "src, dst = sys.argv[1].encode(), sys.argv[2].encode()\n"
        "sys.exit(llama_cpp.llama_model_quantize(src, dst, ctypes.byref(p)))\n"
    )
    tmp = dst.with_name(dst.name + ".partial")
    subprocess.run(
        [sys.executable, "-c", code, str(src), str(tmp), qtype, str(threads)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tmp.rename(dst)


def ensure_models(shape: mm.Shape, layers: int, gguf_types: list[str], log) -> None:
    """The checkpoint and every GGUF in `gguf_types`: the types make_models.py
    writes itself (mm.GGUF_TYPES) from the checkpoint, any other (Q4_K_M,
    Q5_K_M, Q6_K, IQ4_XS, ...) by llama.cpp's quantiser from the F16 file."""
    direct = [g for g in gguf_types if g in mm.GGUF_TYPES]
    quantised = [g for g in gguf_types if g not in mm.GGUF_TYPES]
    if quantised and "F16" not in direct:
        direct.append("F16")
    need = [g for g in direct if not mm.gguf_path(shape, layers, g).exists()]
    # The checkpoint is written only when a file is missing (a big shape's may
    # be deleted once its GGUF and colibri files exist).
    if need:
        mm.make(shape, layers, need, mm.CACHE, False, log)
    for g in quantised:
        dst = mm.gguf_path(shape, layers, g)
        if not dst.exists():
            log(f"llama.cpp quantising {shape.name} l{layers} F16 -> {g}")
            llama_quantize(mm.gguf_path(shape, layers, "F16"), dst, g)


def colibri_file(shape: mm.Shape, layers: int, dtype: str, log) -> Path:
    path = mm.model_dir(shape, layers) / "colibri" / f"model-{dtype}.colibri"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"converting {shape.name} l{layers} -> {dtype}")
        # In a child process, so that this one stays small (its pages would
        # otherwise show up in the workers' numbers).
        code = "import sys, colibri; colibri.convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3])"
        subprocess.run(
            [sys.executable, "-c", code, str(mm.hf_dir(shape, layers)), str(path), dtype], check=True
        )
    return path


def med(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r and r[key] is not None]
    return statistics.median(vals) if vals else float("nan")


def summarise(runs: list[dict], prompts: list[int]) -> dict:
    s = {
        "load_s": med(runs, "load_s"),
        "open_s": med(runs, "open_s"),
        "peak_rss_mb": med(runs, "peak_rss_mb"),
        "decode_tps": statistics.median(r["decode_n"] / r["decode_s"] for r in runs),
        "n": len(runs),
    }
    for n in prompts:
        s[f"prefill{n}_tps"] = statistics.median(n / r[f"prefill{n}_s"] for r in runs)
        s[f"ttft{n}_s"] = med(runs, f"prefill{n}_s")
    if any("batch_s" in r for r in runs):
        s["batch_tps"] = statistics.median(r["batch_n"] / r["batch_s"] for r in runs if "batch_s" in r)
    return s


def bench(args, log) -> dict:
    import colibri

    # Single types and the named recipes (a mixed recipe is compared with
    # whichever GGUF type --pairs names).
    supported = colibri.supported_dtypes() + list(colibri.recipes())
    types = [t for t in (args.types.split(",") if args.types != "auto" else colibri.supported_dtypes()) if t]
    for t in types:
        if t not in supported:
            raise SystemExit(f"colibri does not support {t} (supported: {', '.join(supported)})")
    threads = [int(x) for x in args.threads.split(",")]
    prompts = [int(x) for x in args.prompts.split(",")]
    shapes = [mm.SHAPES[m] for m in args.models.split(",")]
    result: dict = {"started": dt.datetime.now().isoformat(timespec="seconds"), "load_before": loadavg()}
    result["bandwidth"] = {t: bandwidth(t) for t in sorted(set(threads) | {1, 2})}
    log(f"bandwidth: { {t: round(b['best'], 1) for t, b in result['bandwidth'].items()} } GB/s")
    result["cells"] = []
    for shape in shapes:
        pairs = []
        for t in types:
            twin = GGUF_TWIN.get(t, "F16")
            if twin not in args.gguf_types.split(","):
                twin = "F16"
            pairs.append((t, twin))
        if args.pairs:
            # Explicit colibri:GGUF pairs, e.g. q4_0:MXFP4 (different types, labelled as such).
            pairs = [tuple(x.split(":")) for x in args.pairs.split(",") if x]
            for t, _ in pairs:
                if t not in supported:
                    raise SystemExit(f"colibri does not support {t} (supported: {', '.join(supported)})")
        ensure_models(shape, args.layers, sorted({g for _, g in pairs}), log)
        for ctype, _ in pairs:
            colibri_file(shape, args.layers, ctype, log)
        # The sources are not read while timing; their pages would otherwise
        # crowd the two files each cell reads out of the page cache.
        drop_cached(mm.hf_dir(shape, args.layers) / "model.safetensors")
        if "F16" not in {g for _, g in pairs}:
            drop_cached(mm.gguf_path(shape, args.layers, "F16"))
        for ctype, gtype in pairs:
            if f"{shape.name}:{ctype}" in args.skip.split(","):
                continue
            cpath = colibri_file(shape, args.layers, ctype, log)
            gpath = mm.gguf_path(shape, args.layers, gtype)
            bpt = {
                "colibri": bytes_per_token(colibri_tensors(cpath), shape, "colibri"),
                "llama.cpp": bytes_per_token(gguf_tensors(gpath), shape, "gguf"),
            }
            for th in threads:
                cell = {
                    "model": shape.name,
                    "layers": args.layers,
                    "ctype": ctype,
                    "gtype": gtype,
                    "threads": th,
                }
                cell["bytes_per_token"] = bpt
                cell["load"] = loadavg()
                runs: dict[str, list[dict]] = {"colibri": [], "llama.cpp": []}
                for rep in range(args.reps):
                    order = ["colibri", "llama.cpp"] if rep % 2 == 0 else ["llama.cpp", "colibri"]
                    for eng in order:
                        if eng == "llama.cpp" and args.no_llama:
                            continue
                        spec = {
                            "engine": "colibri" if eng == "colibri" else "llama",
                            "path": str(cpath if eng == "colibri" else gpath),
                            "threads": th,
                            "vocab": shape.vocab,
                            "mode": "full",
                            "context": args.context,
                            "prompts": prompts,
                            "decode_tokens": args.decode_tokens,
                            "batch": args.batch,
                        }
                        # (a long --context prefill runs at a few tokens a second)
                        r = run_worker(spec, timeout=3600 + 0.25 * args.context)
                        runs[eng].append(r)
                        if "extension" in r:
                            result.setdefault("extensions", [])
                            if r["extension"] not in result["extensions"]:
                                result["extensions"].append(r["extension"])
                        log(
                            f"{shape.name} {ctype}/{gtype} t{th} rep{rep} {eng}: "
                            + ", ".join(f"{n}={r[f'prefill{n}_s']:.3f}s" for n in prompts)
                            + f", decode {r['decode_n'] / r['decode_s']:.1f} tok/s, load {r['load_s']:.2f}s"
                        )
                cell["runs"] = runs
                cell["summary"] = {e: summarise(rs, prompts) for e, rs in runs.items() if rs}
                if args.batch:
                    cell["batch"] = args.batch
                state = next((r["state_bytes"] for r in runs["colibri"] if "state_bytes" in r), None)
                if state is not None:
                    cell["state"] = state_memory(shape, args.layers, state)
                result["cells"].append(cell)
            if args.evict and not (args.noisy and ctype == noisy_type(args, types)):
                cpath.unlink()
    if args.noisy:
        result["noisy"] = noisy_run(args, shapes, types, log)
    result["load_after"] = loadavg()
    result["finished"] = dt.datetime.now().isoformat(timespec="seconds")
    return result


def state_memory(shape: mm.Shape, layers: int, state: dict, context: int = 32768) -> dict:
    """One sequence's state at `context` tokens (colibri's Engine.state_bytes():
    per_sequence + context · per_token) against a model of the same widths whose
    every mixer layer is full attention, whose bytes per token are this model's
    per full-attention layer times the mixer count (Nemotron-H's MoE blocks hold
    no state, so "layers" counts its Mamba2 and attention blocks). The same at the
    released depth (``hub_layers``, in the released pattern) when the shape has one."""
    kinds = shape.mixers(layers)
    full = kinds.count("full_attention")
    linear = len(kinds) - full
    per_full = state["per_token"] / full if full else 0.0
    per_linear = state["per_sequence"] / linear if linear else 0.0
    mib = 2.0**20

    def at(n_full: int, n_linear: int) -> dict:
        hybrid = n_linear * per_linear + context * n_full * per_full
        dense = (n_full + n_linear) * per_full * context
        return {
            "layers": n_full + n_linear,
            "hybrid_mib": round(hybrid / mib, 1),
            "attention_only_mib": round(dense / mib, 1),
            "fraction": round(hybrid / dense, 3) if dense else None,
        }

    out = {
        "context": context,
        "per_token": state["per_token"],
        "per_sequence": state["per_sequence"],
        "per_full_layer_per_token": per_full,
        "per_linear_layer": per_linear,
        "bench": at(full, linear),
    }
    if shape.hub_layers and (shape.full_every or shape.pattern):
        hub = shape.mixers(shape.hub_layers)
        hub_full = hub.count("full_attention")
        out["hub"] = at(hub_full, len(hub) - hub_full)
    return out


# The issue's targets for the newer shapes, checked against each row of a results file.
SPEED_TARGETS = {
    "decode_ratio": 1.3,  # decode tok/s >= 1.3x llama.cpp's
    "decode_roofline": 0.85,  # >= 85% of the bandwidth roofline
    "prefill_ratio": 2.0,  # prefill at 512 tokens >= 2x llama.cpp's
}
TARGETS = {
    "qwen3_6": {
        **SPEED_TARGETS,
        "prefill_kept": 0.5,  # per-token prefill speed at 8192 >= half of that at 512
    },
    "glm4_7_flash": SPEED_TARGETS,
    "minimax_m2": SPEED_TARGETS,
    "nemotron3_nano": {**SPEED_TARGETS, "prefill_kept": 0.5},
    "deepseek_v4_flash": SPEED_TARGETS,
}


def target_marks(row: dict, goal: dict) -> dict:
    """Each target of `goal` as "met" or "not met" (absent when not measured), on each
    engine's best run when the row has them (on a shared machine the medians carry
    whatever else ran), else on the medians."""
    b = "_best" if "decode_best" in row else ""
    got = {
        "decode_ratio": row.get(f"decode{b}", {}).get("ratio"),
        "decode_roofline": row.get(f"roofline{b}", {}).get("colibri"),
        "prefill_ratio": row.get(f"prefill_512{b}", {}).get("ratio"),
        "prefill_kept": row.get("prefill_kept", {}).get("colibri"),
    }
    return {k: ("met" if got[k] >= v else "not met") for k, v in goal.items() if got.get(k) is not None}


def noisy_type(args, types: list[str]) -> str:
    return args.noisy_type if args.noisy_type else types[0]


def noisy_run(args, shapes, types, log) -> list[dict]:
    """2-thread decode, quiet vs with a CPU hog pinned to one core."""
    out = []
    ctype = noisy_type(args, types)
    for shape in shapes:
        twin = GGUF_TWIN.get(ctype, "F16")
        if twin not in args.gguf_types.split(","):
            twin = "F16"
        ensure_models(shape, args.layers, [twin], log)
        paths = {
            "colibri": colibri_file(shape, args.layers, ctype, log),
            "llama.cpp": mm.gguf_path(shape, args.layers, twin),
        }
        cell = {
            "model": shape.name,
            "ctype": ctype,
            "gtype": twin,
            "load": loadavg(),
            "quiet": {},
            "noisy": {},
        }
        for eng in paths:
            cell["quiet"][eng], cell["noisy"][eng] = [], []
        for rep in range(args.reps):
            for eng in ("colibri", "llama.cpp"):
                if eng == "llama.cpp" and args.no_llama:
                    continue
                spec = {
                    "engine": "colibri" if eng == "colibri" else "llama",
                    "path": str(paths[eng]),
                    "threads": 2,
                    "vocab": shape.vocab,
                    "mode": "decode",
                    "decode_tokens": args.decode_tokens,
                }
                for mode in ("quiet", "noisy") if rep % 2 == 0 else ("noisy", "quiet"):
                    r = run_worker(spec, noisy=mode == "noisy")
                    cell[mode][eng].append(r["decode_n"] / r["decode_s"])
                    log(f"noisy-neighbour {shape.name} {eng} {mode}: {cell[mode][eng][-1]:.1f} tok/s")
        out.append(cell)
        if args.evict:
            paths["colibri"].unlink()
    return out


# ---------------------------------------------------------------- verification


def verify(args, log) -> list[dict]:
    """Logits of both engines on the same ids, same weights: max differences."""
    import colibri

    out = []
    for name in args.models.split(","):
        shape = mm.SHAPES[name]
        types = [t for t in args.verify_types.split(",") if t in colibri.supported_dtypes()]
        ensure_models(shape, args.layers, sorted({GGUF_TWIN[t] for t in types}), log)
        ids = prompt_ids(args.verify_tokens, shape.vocab, 7)
        for ctype in types:
            gtype = GGUF_TWIN[ctype]
            got = {}
            for eng, path in (
                ("colibri", colibri_file(shape, args.layers, ctype, log)),
                ("llama", mm.gguf_path(shape, args.layers, gtype)),
            ):
                npy = mm.model_dir(shape, args.layers) / f"logits-{eng}-{ctype}.npy"
                spec = {
                    "engine": eng,
                    "path": str(path),
                    "threads": 2,
                    "vocab": shape.vocab,
                    "mode": "logits",
                    "ids": ids,
                    "out": str(npy),
                    "logits_all": True,
                }
                run_worker(spec)
                got[eng] = np.load(npy)
            c, g = got["colibri"], got["llama"]
            diff = np.abs(c - g)
            row = {
                "model": name,
                "layers": args.layers,
                "colibri": ctype,
                "gguf": gtype,
                "tokens": len(ids),
                "max_abs_diff": float(diff.max()),
                "max_abs_logit": float(np.abs(c).max()),
                "rel_to_range": float(diff.max() / (c.max() - c.min())),
                "rms_diff": float(np.sqrt((diff**2).mean())),
                "argmax_agree": f"{int((c.argmax(1) == g.argmax(1)).sum())}/{len(ids)}",
            }
            log(json.dumps(row))
            out.append(row)
    return out


# ---------------------------------------------------------------- KV cache


LLAMA_KV_CODE = r"""
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_batch=512, n_ubatch=512,
                      n_threads=2, n_threads_batch=2, use_mmap=True, verbose=True)
"""


def kv_cache(args, log) -> list[dict]:
    """KV-cache bytes per token: colibri's (`colibri info --json`, the cache it
    allocates per token) and llama.cpp's own `llama_kv_cache: size = ...`
    lines for a context of --kv-ctx tokens (SWA caches included)."""
    out = []
    for name in args.models.split(","):
        shape = mm.SHAPES[name]
        ctype, gtype = args.kv_type, GGUF_TWIN[args.kv_type]
        ensure_models(shape, args.layers, [gtype], log)
        cpath = colibri_file(shape, args.layers, ctype, log)
        info = json.loads(
            subprocess.run(
                [sys.executable, "-m", "colibri", "info", str(cpath), "--json"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        gpath = mm.gguf_path(shape, args.layers, gtype)
        p = subprocess.run(
            [sys.executable, "-c", LLAMA_KV_CODE, str(gpath), str(args.kv_ctx)],
            capture_output=True,
            text=True,
        )
        # One "llama_kv_cache: size = X MiB (...)" line per cache (two for SWA models).
        lines = [
            ln.strip() for ln in p.stderr.splitlines() if re.match(r"llama_kv_cache: size = +[0-9.]+ MiB", ln)
        ]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"llama.cpp KV size not found (rc {p.returncode}):\n{p.stderr[-3000:]}")
        mib = sum(float(re.search(r"size = +([0-9.]+) MiB", ln).group(1)) for ln in lines)  # type: ignore[union-attr]
        row = {
            "model": name,
            "colibri_dtype": info["kv_cache"]["dtype"],
            "colibri_bytes_per_token": int(info["kv_cache"]["bytes_per_token"]),
            "llama_lines": lines,
            "llama_desc": "; ".join(re.sub(r"^.*?size = ", "", ln) for ln in lines),
            "llama_mib": mib,
            "llama_bytes_per_token": mib * 2**20 / args.kv_ctx,
        }
        log(json.dumps(row))
        out.append(row)
    return out


# ---------------------------------------------------------------- report


def fmt(x: float, nd: int = 1) -> str:
    if x != x:
        return "–"
    return f"{x:.{nd}f}"


def pair(a: float, b: float, nd: int) -> str:
    return f"{fmt(a, nd)} / {fmt(b, nd)}"


nan = float("nan")


def ratio(a: float, b: float) -> str:
    return "–" if not (a == a and b == b and b > 0) else f"{a / b:.2f}x"


def markdown(res: dict) -> str:
    bw = res["bandwidth"]
    lines = []
    lines.append(
        "Read bandwidth (15 passes over 1 GiB, "
        + bw[min(bw)]["method"]
        + "): "
        + ", ".join(
            f"{t} thread{'s' if t > 1 else ''} **{b['roofline']:.1f} GB/s** (best pass over CPU time; "
            f"wall clock: best {b['best']:.1f}, median {b['median']:.1f})"
            for t, b in bw.items()
        )
        + ". The roofline below uses the bold figures."
    )
    lines.append("")
    lines.append(f"Load average before: {res['load_before']}; after: {res['load_after']}.")
    cells = res["cells"]
    prompts = sorted(
        {int(k[7:-4]) for c in cells for s in c["summary"].values() for k in s if k.startswith("prefill")}
    )
    for model in dict.fromkeys(c["model"] for c in cells):
        mc = [c for c in cells if c["model"] == model]
        lines += ["", f"### {model} ({mc[0]['layers']} layers)", ""]
        head = ["colibri type", "llama.cpp type", "threads"]
        for n in prompts:
            head += [f"prefill {n} C", f"prefill {n} L", "ratio"]
        head += ["decode C", "decode L", "ratio"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for c in mc:
            sc, sl = c["summary"].get("colibri", {}), c["summary"].get("llama.cpp", {})
            row = [c["ctype"], c["gtype"], str(c["threads"])]
            for n in prompts:
                a, b = sc.get(f"prefill{n}_tps", float("nan")), sl.get(f"prefill{n}_tps", float("nan"))
                row += [fmt(a), fmt(b), ratio(a, b)]
            a, b = sc.get("decode_tps", float("nan")), sl.get("decode_tps", float("nan"))
            row += [fmt(a, 2), fmt(b, 2), ratio(a, b)]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        head = [
            "colibri / llama.cpp type",
            "threads",
            "TTFT 64 C / L (ms)",
            "open→1st token C / L (ms)",
            "peak RSS C / L (MB)",
            "MB read per token C / L",
            "roofline tok/s C / L",
            "roofline reached C / L",
            "runs",
            "load avg at start",
        ]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for c in mc:
            sc, sl = c["summary"].get("colibri", {}), c["summary"].get("llama.cpp", {})
            b = bw[c["threads"]]["roofline"] * 1e9
            bc, bl = c["bytes_per_token"]["colibri"]["total"], c["bytes_per_token"]["llama.cpp"]["total"]
            rc, rl = b / bc, b / bl
            dc, dl = sc.get("decode_tps", nan), sl.get("decode_tps", nan)
            row = [
                f"{c['ctype']} / {c['gtype']}",
                str(c["threads"]),
                pair(sc.get("ttft64_s", nan) * 1e3, sl.get("ttft64_s", nan) * 1e3, 0),
                pair(sc.get("load_s", nan) * 1e3, sl.get("load_s", nan) * 1e3, 0),
                pair(sc.get("peak_rss_mb", nan), sl.get("peak_rss_mb", nan), 0),
                pair(bc / 1e6, bl / 1e6, 0),
                pair(rc, rl, 1),
                f"{100 * dc / rc:.0f}% / {100 * dl / rl:.0f}%",
                f"{sc.get('n', 0)} / {sl.get('n', 0)}",
                c.get("load", "").split(" ")[0],
            ]
            lines.append("| " + " | ".join(row) + " |")
    extra = [c for c in cells if "batch" in c or "state" in c]
    if extra:
        lines += ["", "### Batched decode and state memory (colibri)", ""]
        lines.append(
            "| model | type | threads | decode 1 seq | decode B seqs (total) | B | state at 32k MiB "
            "| all-attention MiB | released depth: state / all-attention MiB |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for c in extra:
            sc = c["summary"].get("colibri", {})
            st = c.get("state", {})
            hub, here = st.get("hub", {}), st.get("bench", {})
            lines.append(
                f"| {c['model']} | {c['ctype']} | {c['threads']} | {fmt(sc.get('decode_tps', nan), 2)} "
                f"| {fmt(sc.get('batch_tps', nan), 1)} | {c.get('batch', '–')} "
                f"| {here.get('hybrid_mib', '–')} | {here.get('attention_only_mib', '–')} "
                f"| {hub.get('hybrid_mib', '–')} / {hub.get('attention_only_mib', '–')} |"
            )
    if res.get("noisy"):
        lines += ["", "### Noisy neighbour (2-thread decode, a CPU hog pinned to one core)", ""]
        lines.append("| model | type C / L | engine | quiet tok/s | noisy tok/s | kept | load avg at start |")
        lines.append("|---|---|---|---|---|---|---|")
        for c in res["noisy"]:
            for eng in c["quiet"]:
                q, n = c["quiet"][eng], c["noisy"][eng]
                if not q:
                    continue
                mq, mn = statistics.median(q), statistics.median(n)
                kept, la = f"{100 * mn / mq:.0f}%", c.get("load", "").split(" ")[0]
                lines.append(
                    f"| {c['model']} | {c['ctype']} / {c['gtype']} | {eng} "
                    f"| {mq:.2f} | {mn:.2f} | {kept} | {la} |"
                )
    return "\n".join(lines)


def bytes_table(res: dict) -> str:
    lines = [
        "| model | type | engine | attention+norms | router | experts (top-k) | embedding row | lm_head "
        "| total |"
    ]
    lines.append("|---|---|---|---|---|---|---|---|---|")
    seen = set()
    for c in res["cells"]:
        for eng, t in (("colibri", c["ctype"]), ("llama.cpp", c["gtype"])):
            key = (c["model"], eng, t)
            if key in seen:
                continue
            seen.add(key)
            p = c["bytes_per_token"][eng]
            lines.append(
                f"| {c['model']} | {t} | {eng} | "
                + " | ".join(
                    f"{p[k] / 1e6:.1f}"
                    for k in ("attention+norms", "router", "experts", "embedding row", "lm_head", "total")
                )
                + " |"
            )
    return "\n".join(lines) + "\n\n(MB = 10^6 bytes per decoded token.)"


def colibri_facts() -> dict:
    """Where the imported colibri comes from: its source tree's commit (and whether
    that tree had uncommitted changes), the extension's hash and the kernel table."""
    import colibri

    pkg = Path(colibri.__file__).resolve().parent
    root = pkg.parent.parent
    so = next(iter(sorted(pkg.glob("_colibri*"))), None)
    digest = hashlib.sha256(so.read_bytes()).hexdigest()[:12] if so else "?"
    git = ["git", "-C", str(root)]
    try:
        rev = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        rev, dirty = "", ""
    if not rev and (root / ".commit").exists():
        rev = (root / ".commit").read_text().strip() + " (source export)"
    # Workers inherit COLIBRI_ISA, so they run the table this process does.
    table = colibri.kernels()["active"]
    return {
        "commit": rev or "unknown commit",
        "dirty": bool(dirty),
        "root": str(root),
        "extension": digest,
        "table": table,
    }


def colibri_build(facts: dict | None = None) -> str:
    c = facts or colibri_facts()
    dirty_note = " with uncommitted changes" if c["dirty"] else ""
    return f"{c['commit']}{dirty_note} ({c['root']}, extension {c['extension']}, kernels {c['table']})"


def machine_info() -> dict:
    """This machine and build as data: what a results file's ``machine`` and ``commit`` come from."""

    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
        except OSError:
            return "n/a"

    flags = sh("grep -m1 '^flags' /proc/cpuinfo")
    versions = [f"Python {platform.python_version()}", f"NumPy {np.__version__}"]
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("llama-cpp-python", "gguf"):
        try:
            versions.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            pass
    return {
        "cpu_model": sh("lscpu | sed -n 's/^Model name: *//p'"),
        "logical_cores": os.cpu_count(),
        "isa": " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16") if f" {f}" in flags),
        "ram_gib": sh("free -g | awk '/Mem:/ {print $2}'"),
        "kernel": platform.release(),
        "versions": versions,
        "colibri": colibri_facts(),
    }


def machine_facts(info: dict | None = None) -> str:
    """The machine and build as the two lines the printed report starts with."""
    m = info or machine_info()
    return (
        f"- CPU: {m['cpu_model']}, {m['logical_cores']} logical cores ({m['isa']}); {m['ram_gib']} GiB RAM; "
        f"Linux {m['kernel']}\n- colibri at {colibri_build(m['colibri'])}; {', '.join(m['versions'])}"
    )


# ---------------------------------------------------------------- results files


MACHINE_TEXT = re.compile(
    r"CPU: (?P<cpu_model>.*?), (?P<logical_cores>\d+) logical cores \((?P<isa>[^)]*)\); "
    r"(?P<ram_gib>\S+) GiB RAM; Linux (?P<kernel>\S+)"
)
BUILD_TEXT = re.compile(
    r"colibri at (?P<commit>\S+)(?P<dirty> with uncommitted changes)?.*?kernels (?P<table>\w+)\)"
)


def run_machine(run: dict) -> dict:
    """A raw run's machine_info; for a run saved before it was recorded, what its
    ``machine`` text says (fields it does not say are "?")."""
    if "machine_info" in run:
        return run["machine_info"]
    text = run.get("machine", "")
    m, b = MACHINE_TEXT.search(text), BUILD_TEXT.search(text)
    info: dict = {k: "?" for k in ("cpu_model", "logical_cores", "isa", "ram_gib", "kernel")}
    if m:
        info.update(m.groupdict())
    info["versions"] = []
    info["colibri"] = {"commit": "?", "dirty": False, "table": "?"}
    if b:
        info["colibri"] = {"commit": b["commit"], "dirty": bool(b["dirty"]), "table": b["table"]}
    return info


def describe_machine(info: dict, extra: list[str]) -> dict:
    """A results file's ``machine``: the CPU in one line, and a short family name."""
    model = re.sub(r"\((R|TM|tm)\)|\bCPU\b|\s+Processor\b", "", info["cpu_model"])
    model = re.sub(r"\s+", " ", model).strip()
    cpu = (
        f"{model}, {info['logical_cores']} logical cores ({info['isa']}), {info['ram_gib']} GiB RAM, "
        f"Linux {info['kernel']}; kernel table {info['colibri']['table']}"
    )
    words = re.findall(r"[a-z0-9]+", model.lower())
    vendor = next((w for w in words if w in ("xeon", "epyc", "ryzen", "threadripper", "core")), None)
    vendor = vendor or next((w for w in words if w not in ("intel", "amd")), "cpu")
    return {"cpu": "; ".join([cpu, *extra]), "family": f"{vendor}-{info['colibri']['table']}"}


def commit_of(infos: list[dict]) -> str:
    """The commits a results file's runs measured, in order, marked when a tree had uncommitted changes."""
    out = []
    for info in infos:
        c = info["colibri"]
        text = c["commit"] + (" with uncommitted changes" if c.get("dirty") else "")
        if text not in out:
            out.append(text)
    return ", ".join(out)


def command_line(script: str, argv: list[str]) -> str:
    """The command as run, with the environment variables that change what colibri measures."""
    env = [f"{k}={os.environ[k]}" for k in ("COLIBRI_ISA", "COLIBRI_PREFETCH") if k in os.environ]
    return " ".join([*env, "python", f"benches/{script}", shlex.join(argv)]).strip()


def clean(value: object) -> object:
    """A value for a results file: NaN (a cell with nothing measured) becomes absent (None)."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: v for k, v in ((k, clean(v)) for k, v in value.items()) if v is not None}
    return value


def quotient(a: float, b: float) -> float:
    return a / b if b == b and b > 0 else nan


def rounded(x: float, nd: int) -> float | None:
    return None if x != x else round(x, nd)


def bench_results(runs: list[dict]) -> dict:
    """The results file (benches/render_results.py's schema) of one or more raw runs of
    bench.py on one machine, in the layout of the decode-and-prefill tables."""
    infos = [run_machine(r) for r in runs]
    if len({i["cpu_model"] for i in infos}) > 1:
        raise ValueError(
            "runs from different machines: " + ", ".join(sorted({i["cpu_model"] for i in infos}))
        )
    rows: list[dict] = []
    bandwidth: dict[str, list[float]] = {}
    prompts: set[int] = set()
    for run, info in zip(runs, infos):
        bw = {int(k): v for k, v in run["bandwidth"].items()}
        for t, b in sorted(bw.items()):
            bandwidth.setdefault(f"threads_{t}", []).append(round(b["roofline"], 1))
        for c in run["cells"]:
            sc, sl = c["summary"].get("colibri", {}), c["summary"].get("llama.cpp", {})
            row: dict = {
                "shape": c["model"],
                "layers": c["layers"],
                "colibri_type": c["ctype"],
                "llama_type": c["gtype"],
                "threads": c["threads"],
                "table": info["colibri"]["table"],
            }
            for key in sorted(k for k in sc if k.startswith("prefill") and k.endswith("_tps")):
                n = int(key[7:-4])
                prompts.add(n)
                a, b = sc[key], sl.get(key, nan)
                row[f"prefill_{n}"] = {
                    "colibri": rounded(a, 1),
                    "llama": rounded(b, 1),
                    "ratio": rounded(quotient(a, b), 2),
                }
            a, b = sc.get("decode_tps", nan), sl.get("decode_tps", nan)
            row["decode"] = {
                "colibri": rounded(a, 2),
                "llama": rounded(b, 2),
                "ratio": rounded(quotient(a, b), 2),
            }
            roof = bw[c["threads"]]["roofline"] * 1e9
            bpt = c["bytes_per_token"]
            row["roofline"] = {
                "colibri": rounded(quotient(a * bpt["colibri"]["total"], roof), 2),
                "llama": rounded(quotient(b * bpt["llama.cpp"]["total"], roof), 2),
            }
            best_of(row, c.get("runs", {}), bpt, roof)
            row["mb_per_token"] = {
                "colibri": round(bpt["colibri"]["total"] / 1e6, 1),
                "llama": round(bpt["llama.cpp"]["total"] / 1e6, 1),
            }
            for key, out, scale in (
                ("ttft64_s", "ttft_64_ms", 1e3),
                ("load_s", "load_ms", 1e3),
                ("peak_rss_mb", "peak_rss_mb", 1),
            ):
                row[out] = {
                    "colibri": rounded(sc.get(key, nan) * scale, 0),
                    "llama": rounded(sl.get(key, nan) * scale, 0),
                }
            row["runs"] = {"colibri": sc.get("n", 0), "llama": sl.get("n", 0)}
            if "batch_tps" in sc:
                row["batch"] = {
                    "n": c.get("batch"),
                    "colibri": rounded(sc["batch_tps"], 1),
                    "scaling": rounded(quotient(sc["batch_tps"], sc.get("decode_tps", nan)), 2),
                }
            measured = sorted(int(k[7:-4]) for k in sc if k.startswith("prefill") and k.endswith("_tps"))
            if len(measured) > 1 and min(measured) >= 512:
                # Per-token prefill speed at the longest prompt over that at the shortest.
                lo, hi = measured[0], measured[-1]
                row["prefill_kept"] = {
                    "short": lo,
                    "long": hi,
                    "colibri": rounded(quotient(sc[f"prefill{hi}_tps"], sc[f"prefill{lo}_tps"]), 2),
                    "llama": rounded(
                        quotient(sl.get(f"prefill{hi}_tps", nan), sl.get(f"prefill{lo}_tps", nan)), 2
                    ),
                }
            # The comparison with an all-attention twin is for hybrids of
            # recurrent and attention layers only.
            hybrid = c["model"] in mm.SHAPES and (
                mm.SHAPES[c["model"]].full_every or mm.SHAPES[c["model"]].pattern
            )
            if "state" in c and hybrid:
                row["state"] = c["state"]
            if c["model"] in TARGETS:
                row["targets"] = target_marks(clean(row), TARGETS[c["model"]])  # type: ignore[arg-type]
            rows.append(clean(row))  # type: ignore[arg-type]
    peer = any("llama" in r["decode"] for r in rows)
    columns = {
        "shape": {"label": "shape", "cell": "{shape}"},
        "type": {"label": "type", "cell": "{colibri_type}"},
        "table": {"label": "table", "cell": "{table}"},
        "threads": {"label": "threads", "cell": "{threads}"},
    }
    for n in sorted(prompts):
        columns[f"p{n}"] = {
            "label": f"prefill {n}",
            "cell": f"{{prefill_{n}.colibri:.1f}} / {{prefill_{n}.llama:.1f}} ({{prefill_{n}.ratio:x}})",
        }
    columns["decode"] = {
        "label": "decode",
        "cell": "{decode.colibri:.2f} / {decode.llama:.2f} ({decode.ratio:x})",
    }
    columns["roof"] = {"label": "of roofline C / L", "cell": "{roofline.colibri:pct} / {roofline.llama:pct}"}
    columns["ttft"] = {
        "label": "TTFT 64 ms C / L",
        "cell": "{ttft_64_ms.colibri:.0f} / {ttft_64_ms.llama:.0f}",
    }
    columns["load"] = {
        "label": "open→1st token ms C / L",
        "cell": "{load_ms.colibri:.0f} / {load_ms.llama:.0f}",
    }
    columns["rss"] = {
        "label": "peak RSS MB C / L",
        "cell": "{peak_rss_mb.colibri:.0f} / {peak_rss_mb.llama:.0f}",
    }
    columns["mb"] = {
        "label": "MB read / token C / L",
        "cell": "{mb_per_token.colibri} / {mb_per_token.llama}",
    }
    main_cols = ["shape", "type", "table", "decode", *(f"p{n}" for n in sorted(prompts))]
    most = max(r["threads"] for r in rows)
    views: dict = {"bench": {"columns": main_cols}}
    if any(r["threads"] != most for r in rows):
        # The doc's table shows the most threads; the "all" view has every thread count.
        views["bench"]["where"] = {"threads": [most]}
        views["all"] = {"columns": ["shape", "type", "table", "threads", *main_cols[3:]]}
    views["details"] = {"columns": ["shape", "type", "threads", "ttft", "load", "rss", "mb", "roof"]}
    if any("llama" in r.get("decode_best", {}) for r in rows):
        # Each engine's fastest run beside the medians (a shared machine disturbs some runs).
        columns["decode_best"] = {
            "label": "decode, best run",
            "cell": "{decode_best.colibri:.2f} / {decode_best.llama:.2f} ({decode_best.ratio:x})",
        }
        for n in sorted(prompts):
            columns[f"p{n}_best"] = {
                "label": f"prefill {n}, best run",
                "cell": f"{{prefill_{n}_best.colibri:.1f}} / {{prefill_{n}_best.llama:.1f}} "
                f"({{prefill_{n}_best.ratio:x}})",
            }
        columns["roof_best"] = {
            "label": "of roofline C / L, best run",
            "cell": "{roofline_best.colibri:pct} / {roofline_best.llama:pct}",
        }
        best_cols = ["decode_best", *(f"p{n}_best" for n in sorted(prompts)), "roof_best"]
        views["best"] = {"columns": ["shape", "type", *best_cols], "where": {"threads": [most]}}
    hybrid_views(rows, columns, views, most)
    reached = {e: [r["roofline"][e] for r in rows if e in r["roofline"]] for e in ("colibri", "llama")}
    versions = [v for i in infos for v in i.get("versions", []) if v.startswith("llama-cpp-python")]
    tables = sorted({r["table"] for r in rows})
    context = "/".join(sorted({str(r.get("args", {}).get("context", 64)) for r in runs}))
    n_runs = sorted({n for r in rows for n in r["runs"].values() if n})
    reps = "?" if not n_runs else f"{n_runs[0]}" if n_runs[0] == n_runs[-1] else f"{n_runs[0]}-{n_runs[-1]}"
    decode = sorted({str(r.get("args", {}).get("decode_tokens", "the")) for r in runs})
    first = infos[0]
    probe = [
        (f"{min(v):.1f}-{max(v):.1f}" if min(v) != max(v) else f"{v[0]:.1f}")
        + f" GB/s on {k.split('_')[1]} thread{'s' if k != 'threads_1' else ''}"
        for k, v in bandwidth.items()
    ]
    extra = ["read probe " + ", ".join(probe)] if probe else []
    machine = describe_machine(first, extra)
    where = machine["cpu"].split(",")[0]
    return {
        "title": f"Decode and prefill against llama.cpp, {where}" if peer else f"Decode and prefill, {where}",
        "axis": ["decode", "prefill"],
        "machine": machine,
        "date": runs[0].get("started", "")[:10],
        "commit": commit_of(infos),
        "peer": (f"llama.cpp through {versions[0]}" if versions else "llama.cpp through llama-cpp-python")
        if peer
        else None,
        "method": (
            f"bench.py: {', '.join(sorted({str(r['layers']) for r in rows}))}-layer random-weight models of "
            "real widths, identical weights in both engines, engines alternating run by run in fresh "
            f"processes, medians of {reps} runs per engine and cell; prefill N is an N-token prompt in "
            f"and the first token out, decode {'/'.join(decode)} greedy tokens after a {context}-token "
            f"prompt; kernel table {', '.join(tables)}; the roofline is the read "
            "probe's best pass over CPU time over the weight bytes one decoded token reads"
        ),
        "bandwidth_gbs": bandwidth,
        "roofline_reached": {e: [min(v), max(v)] for e, v in reached.items() if v},
        "noisy": noisy_rows(runs),
        "commands": [
            r.get("command") or "python benches/bench.py (the raw run did not record its command)"
            for r in runs
        ],
        "columns": columns,
        "views": views,
        "rows": rows,
    }


def best_of(row: dict, runs: dict, bpt: dict, roof: float) -> None:
    """Each engine's fastest run of a cell (decode, every prefill length) and their
    ratio: on a machine shared with other work, the run least disturbed by it."""
    rc, rl = runs.get("colibri", []), runs.get("llama.cpp", [])
    if not rc:
        return

    def best(rs: list[dict], speed) -> float:  # type: ignore[no-untyped-def]
        return max((speed(r) for r in rs), default=nan)

    a, b = (
        best(rc, lambda r: r["decode_n"] / r["decode_s"]),
        best(rl, lambda r: r["decode_n"] / r["decode_s"]),
    )
    row["decode_best"] = {
        "colibri": rounded(a, 2),
        "llama": rounded(b, 2),
        "ratio": rounded(quotient(a, b), 2),
    }
    row["roofline_best"] = {
        "colibri": rounded(quotient(a * bpt["colibri"]["total"], roof), 2),
        "llama": rounded(quotient(b * bpt["llama.cpp"]["total"], roof), 2),
    }
    for key in sorted(k for k in rc[0] if k.startswith("prefill") and k.endswith("_s")):
        n = int(key[7:-2])
        a, b = best(rc, lambda r, n=n, key=key: n / r[key]), best(rl, lambda r, n=n, key=key: n / r[key])
        row[f"prefill_{n}_best"] = {
            "colibri": rounded(a, 1),
            "llama": rounded(b, 1),
            "ratio": rounded(quotient(a, b), 2),
        }


def hybrid_views(rows: list[dict], columns: dict, views: dict, threads: int) -> None:
    """The views of the hybrid shapes' extra figures, when a run has them: the long
    prompt against the short one, batched decode, the targets, the state memory."""
    if any("prefill_kept" in r for r in rows):
        columns["kept"] = {
            "label": "prefill per token, long / short C / L",
            "cell": "{prefill_kept.colibri:.2f} / {prefill_kept.llama:.2f}",
        }
    if any("batch" in r for r in rows):
        n = next(r["batch"]["n"] for r in rows if "batch" in r)
        columns["batch"] = {
            "label": f"decode, {n} sequences (total tok/s, vs 1)",
            "cell": "{batch.colibri:.1f} ({batch.scaling:x})",
        }
    if any("targets" in r for r in rows):
        # Marked on the best runs when the rows have them (target_marks).
        b, on = ("_best", ", best runs") if any("decode_best" in r for r in rows) else ("", "")
        marks = {
            "t_decode": (f"decode ≥ 1.3x llama.cpp{on}", f"{{decode{b}.ratio:x}}: {{targets.decode_ratio}}"),
            "t_roof": (
                f"decode ≥ 85% of roofline{on}",
                f"{{roofline{b}.colibri:pct}}: {{targets.decode_roofline}}",
            ),
            "t_prefill": (
                f"prefill 512 ≥ 2x llama.cpp{on}",
                f"{{prefill_512{b}.ratio:x}}: {{targets.prefill_ratio}}",
            ),
            "t_kept": (
                "prefill 8192 per token ≥ ½ of 512",
                "{prefill_kept.colibri:.2f}: {targets.prefill_kept}",
            ),
        }
        # Only the targets some row is held to.
        held = {k for r in rows for k in r.get("targets", {})}
        named = {
            "t_decode": "decode_ratio",
            "t_roof": "decode_roofline",
            "t_prefill": "prefill_ratio",
            "t_kept": "prefill_kept",
        }
        marks = {k: v for k, v in marks.items() if named[k] in held}
        for key, (label, cell) in marks.items():
            columns[key] = {"label": label, "cell": cell}
        where = {"threads": [threads], "shape": sorted({r["shape"] for r in rows if "targets" in r})}
        views["targets"] = {"columns": ["shape", "type", *marks], "where": where}
        extra = [c for c in ("kept", "batch") if c in columns]
        views["hybrid"] = {"columns": ["shape", "type", "decode", "roof", *extra], "where": where}
    stated = [r for r in rows if "state" in r]
    if stated:
        columns["state_per_token"] = {"label": "bytes / token", "cell": "{state.per_token}"}
        columns["state_fixed"] = {"label": "fixed bytes / sequence", "cell": "{state.per_sequence}"}
        for part, label in (("bench", "bench model"), ("hub", "released depth")):
            columns[f"state_{part}"] = {
                "label": f"{label}: layers, at 32k tokens MiB (all-attention MiB, fraction)",
                "cell": f"{{state.{part}.layers}}: {{state.{part}.hybrid_mib:.1f}} "
                f"({{state.{part}.attention_only_mib:.1f}}, {{state.{part}.fraction:pct}})",
            }
        views["state"] = {
            "columns": ["shape", "state_per_token", "state_fixed", "state_bench", "state_hub"],
            "where": {"threads": [threads], "colibri_type": [stated[0]["colibri_type"]]},
        }


def noisy_rows(runs: list[dict]) -> list[dict]:
    """The noisy-neighbour runs: median decode tok/s quiet and beside a CPU hog."""
    out = []
    for run in runs:
        for c in run.get("noisy") or []:
            for eng, quiet in c["quiet"].items():
                if quiet:
                    q, n = statistics.median(quiet), statistics.median(c["noisy"][eng])
                    out.append(
                        {
                            "shape": c["model"],
                            "colibri_type": c["ctype"],
                            "llama_type": c["gtype"],
                            "engine": eng,
                            "quiet_tok_s": round(q, 2),
                            "noisy_tok_s": round(n, 2),
                            "kept": round(n / q, 2),
                        }
                    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="colibri vs llama.cpp on random-weight MoE models of real widths.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Models are written by make_models.py into benches/.cache on first use (several GB each).",
    )
    ap.add_argument("--models", default="olmoe,qwen3moe", help="comma list of " + ", ".join(mm.SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--types",
        default="auto",
        help="colibri weight types (default: colibri.supported_dtypes() at run time)",
    )
    ap.add_argument(
        "--gguf-types",
        default="F16,Q8_0,Q4_0",
        help="GGUF types that may be used; a colibri type without its twin here is compared with F16",
    )
    ap.add_argument(
        "--pairs",
        default="",
        help="explicit colibri:GGUF type pairs instead of --types, e.g. q8_0:Q8_0,q4_0:MXFP4,q4k-mix:Q4_K_M "
        "(GGUF types make_models.py does not write are quantised by llama.cpp from F16)",
    )
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompts", default="64,512", help="prefill prompt lengths")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument(
        "--context",
        type=int,
        default=64,
        help="decode after a real prefill of this many prompt tokens (e.g. 32768; default 64)",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=0,
        help="also time colibri decoding this many 64-token prompts together (total tokens/s)",
    )
    ap.add_argument("--reps", type=int, default=5, help="runs per engine and cell (medians are reported)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 layer, 1 rep, short prompts")
    ap.add_argument("--noisy", action="store_true", help="also run the noisy-neighbour decode test")
    ap.add_argument(
        "--noisy-type", default="", help="colibri type for --noisy (default: the first of --types)"
    )
    ap.add_argument("--no-llama", action="store_true", help="run colibri only")
    ap.add_argument(
        "--evict", action="store_true", help="delete each converted .colibri file after use (disk)"
    )
    ap.add_argument(
        "--skip", default="", help="comma list of model:type cells to leave out, e.g. qwen3moe:f32"
    )
    ap.add_argument("--verify", action="store_true", help="compare both engines' logits instead of timing")
    ap.add_argument(
        "--kv",
        action="store_true",
        help="KV-cache bytes per token at --kv-ctx tokens in both engines (colibri info; llama.cpp's log)",
    )
    ap.add_argument("--kv-ctx", type=int, default=4096)
    ap.add_argument("--kv-type", default="q8_0", help="colibri / GGUF weight type of the files --kv opens")
    ap.add_argument("--verify-types", default="f16,q8_0,q4_0")
    ap.add_argument("--verify-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="RAW",
        help="print the tables of saved raw runs (--json files) instead of measuring",
    )
    ap.add_argument(
        "--results",
        metavar="NAME",
        help="write the run (or the --report runs) as benches/results/NAME.json for docs/benchmarks.md",
    )
    ap.add_argument("--force", action="store_true", help="with --results: replace an existing results file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.quick:
        args.layers, args.reps, args.prompts, args.decode_tokens = 1, 1, "64,128", 16
    if args.kv:
        rows = kv_cache(args, log)
        print(
            f"| model | colibri KV type | colibri bytes / token | colibri at {args.kv_ctx} (MiB) "
            f"| llama.cpp KV | llama.cpp bytes / token | llama.cpp at {args.kv_ctx} (MiB) "
            "| colibri / llama.cpp |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['colibri_dtype']} | {r['colibri_bytes_per_token']} "
                f"| {r['colibri_bytes_per_token'] * args.kv_ctx / 2**20:.1f} | {r['llama_desc']} "
                f"| {r['llama_bytes_per_token']:.0f} | {r['llama_mib']:.1f} "
                f"| {r['colibri_bytes_per_token'] / r['llama_bytes_per_token']:.2f} |"
            )
        return 0
    if args.verify:
        rows = verify(args, log)
        print(
            "| model | layers | colibri | GGUF | tokens | max abs diff | max abs logit | diff / logit range "
            "| argmax agree |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['layers']} | {r['colibri']} | {r['gguf']} | {r['tokens']} "
                f"| {r['max_abs_diff']:.2e} "
                f"| {r['max_abs_logit']:.2f} | {r['rel_to_range']:.1e} | {r['argmax_agree']} |"
            )
        return 0
    target = R.results_path(args.results) if args.results else None
    if target:
        # Before measuring: a run takes hours, and its results file must not replace one silently.
        R.refuse_overwrite([target], args.force)
    if args.report:
        runs = [load_raw(p) for p in args.report]
    else:
        res = bench(args, log)
        res["command"] = command_line("bench.py", sys.argv[1:] if argv is None else argv)
        res["args"] = {
            "reps": args.reps,
            "decode_tokens": args.decode_tokens,
            "prompts": args.prompts,
            "context": args.context,
        }
        res["machine_info"] = machine_info()
        res["machine"] = machine_facts(res["machine_info"])
        path = args.json or mm.CACHE / f"results-{res['started'].replace(':', '')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))
        log(f"raw results: {path}")
        runs = [res]
    for res in runs:
        print("\n\n".join([res["machine"], markdown(res), bytes_table(res)]))
    if target:
        R.write({target: bench_results(runs)}, args.force)
    return 0


def load_raw(path: Path) -> dict:
    """A raw run saved by --json, its bandwidth keyed by thread count again."""
    res = json.loads(path.read_text())
    res["bandwidth"] = {int(k): v for k, v in res["bandwidth"].items()}
    for b in res["bandwidth"].values():
        if b.get("cpu_samples"):
            b["roofline"] = max(b["cpu_samples"])
    return res


if __name__ == "__main__":
    sys.exit(main())
