"""The Python face of the native engine: argument checking, NumPy arrays,
text (tokenizer, chat template) and the generation API.

No maths happens here; every forward pass and every sampling step runs in the
Rust core with the GIL released.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union, cast, overload

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Unpack

from . import _colibri
from ._cache import cached_conversion, hub_snapshot, looks_like_repo_id
from ._errors import (
    ChatTemplateError,
    InvalidInputError,
    ModelNotFoundError,
    OutputExistsError,
    TokenizerError,
)
from ._generation import Completion, Result, Stream, TokenCompletion
from ._sampling import SamplingOptions, SamplingParams, _as_ids, _is_int, _is_number, sampling_params
from ._stats import BatchStats, Plan, RoutingStats, StoreStats
from ._text import ChatTemplate, TextCodec, check_messages, template_from_metadata
from ._tools import (
    THINK_OPEN,
    OutputParser,
    call_grammar,
    check_tools,
    detect,
    new_call_id,
    parser_for,
    prepare_messages,
)

TokenIds = Union[Sequence[int], "np.ndarray"]
PathLike = Union[str, "os.PathLike[str]"]
Prompt = Union[str, TokenIds]

#: Used when the model's generation_config.json does not say.
DEFAULT_MAX_NEW_TOKENS = 256


def _ints(value: Any) -> list[int]:
    """Token ids as config files write them: one int, a list of ints, or null."""
    if _is_int(value):
        return [int(value)]
    if isinstance(value, list):
        return [int(v) for v in value if _is_int(v)]
    return []


def generation_defaults(generation_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Sampling defaults: neutral values (greedy, 256 new tokens) overridden by
    what the checkpoint's generation_config.json says. Its temperature counts
    only with ``do_sample: true`` (transformers' rule); out-of-range values are
    ignored rather than turned into errors the caller did not cause."""
    d: dict[str, Any] = {
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    gc = generation_config if isinstance(generation_config, Mapping) else {}
    t = gc.get("temperature", 1.0)
    if gc.get("do_sample") is True and _is_number(t) and t >= 0:
        d["temperature"] = float(t)
    if _is_int(gc.get("top_k")) and gc["top_k"] >= 0:
        d["top_k"] = int(gc["top_k"])
    if _is_number(gc.get("top_p")) and 0 < gc["top_p"] <= 1:
        d["top_p"] = float(gc["top_p"])
    if _is_number(gc.get("min_p")) and 0 <= gc["min_p"] <= 1:
        d["min_p"] = float(gc["min_p"])
    if _is_number(gc.get("repetition_penalty")) and gc["repetition_penalty"] > 0:
        d["repetition_penalty"] = float(gc["repetition_penalty"])
    if _is_int(gc.get("max_new_tokens")) and gc["max_new_tokens"] > 0:
        d["max_new_tokens"] = int(gc["max_new_tokens"])
    return d


def _demo_path() -> Path:
    from importlib.resources import files

    return Path(str(files("colibri") / "data" / "demo.colibri"))


def _budget_bytes(ram_budget: int | str | None, name: str = "ram_budget") -> int | None:
    """A memory budget as bytes: ints pass through, strings such as "4GB" are parsed."""
    if ram_budget is None:
        return None
    if isinstance(ram_budget, str):
        try:
            return int(_colibri.parse_bytes(ram_budget))
        except InvalidInputError as e:
            raise InvalidInputError(f"{name}: {e}") from None
    if isinstance(ram_budget, bool) or not isinstance(ram_budget, int) or ram_budget <= 0:
        raise InvalidInputError(
            f"{name} must be a positive number of bytes or a size string, got {ram_budget!r}"
        )
    return ram_budget


def plan(path: PathLike, ram_budget: int | str | None = None) -> Plan:
    """What opening ``path`` with ``ram_budget`` keeps resident and what it streams.

    Returns a dict: ``dense_bytes`` (always resident), ``expert_bytes``,
    ``slots`` and ``resident_bytes`` under the budget, ``streamed_bytes``,
    ``min_budget`` (the smallest budget that runs: top_k + 1 experts),
    ``expected_hit_rate`` and ``expected_bytes_per_token`` when decoding
    (from the routing heat file beside the model when there is one, else
    assuming uniform routing), ``state_bytes_per_token`` and
    ``state_bytes_per_sequence`` (what each sequence adds on top, with the
    default KV cache type), and ``warnings``.
    """
    result: Plan = json.loads(_colibri.plan_json(os.fspath(path), _budget_bytes(ram_budget)))
    return result


class _Closed:
    """Stands in for the native engine once :meth:`Engine.close` ran."""

    def __getattr__(self, name: str) -> Any:
        raise InvalidInputError("this Engine is closed")


_CLOSED = _Closed()


def _is_batch(prompt: Any) -> bool:
    """A list or tuple of prompts (strings or token-id sequences), not one token-id list."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    return all(isinstance(p, (str, list, tuple, np.ndarray)) for p in prompt)


class Engine:
    """A `.colibri` model opened for inference.

    Opening maps the file (nothing is copied) and validates it. One engine can
    be shared by several Python threads. Generations (``generate``,
    ``stream``, ``chat``, from any thread, and the prompts of one
    ``generate([...])``) run together, batched: each step advances every
    running one by a token, reading the weights once for all of them, and
    each gives the same tokens it would alone.

    Args:
        path: a ``.colibri`` file made by :func:`colibri.convert`.
        threads: worker threads for compute (default: the number of physical cores).
        ram_budget: RAM for routed experts, in bytes or as a string such as
            ``"4GB"``. The dense part (embeddings, attention, routers, shared
            experts, lm_head) stays resident on top of it; routed experts are
            read from the file into a cache of that size as the router asks for
            them. ``None`` (default), or a budget that holds every expert, keeps
            the whole model resident. Placement never changes the output.
        lru, pin_hot, prefetch: expert-cache policies when streaming: keep
            recently used experts, pin each layer's experts that routing heat
            (recorded beside the model file across runs) says are hot, and
            read the next layer's likely experts while the current layer
            computes (off by default: measured, it reads more than it saves).
        io: ``"buffered"`` (through the OS page cache) or ``"direct"``
            (unbuffered, where the OS supports it).
        heat_file: where routing heat is kept (default: beside the model file,
            ``MODEL.colibri.heat``), or ``"off"``.
        kv_cache_dtype: element type of the attention KV cache: ``"f16"`` (half the
            memory and the attention reads), ``"f32"``, or ``"auto"`` (default:
            f16 for block-quantised weights, whose own rounding is far larger,
            f32 otherwise, so f32/bf16/f16 models stay exact against
            transformers). (``kv_cache=`` is its old name, still accepted.)
        max_batch: most generations running at once (default 16); more wait
            for a place, first come first served.
        max_queue: most generations waiting for a place; beyond it starting
            one raises :class:`BusyError` (default 0: no limit).
        max_state_memory: most memory the running generations' state (KV
            caches and recurrent states) may take together, bytes or a size
            string such as ``"8GB"``; each counts at its whole length (prompt
            plus ``max_new_tokens``, see :meth:`state_bytes`). A generation
            that would pass it waits for others to finish; one that alone
            needs more raises :class:`ContextLengthError`. Default ``None``:
            no limit.
        prefix_cache: most memory the prefix cache may hold, bytes or a size
            string such as ``"2GiB"`` (default ``None``: no prefix cache).
            With one, the state each generation computes (KV caches, MLA
            latents, recurrent states at block ends) is kept in blocks of 16
            tokens, least recently used dropped first, and a prompt that
            begins with tokens already processed starts from them instead of
            computing them again: the same tokens and logits, bit for bit,
            with its prefill cut to the new part (``Timings.cached_tokens``
            says how much was served, ``batch_stats()["prefix_cache"]`` the
            cache's size and hit counts).
        mmap: where the weights of a model held whole in RAM live. ``True``:
            the file's memory mapping (the OS page cache, shared with other
            processes, nothing to do at open). ``False``: a copy in this
            process's own memory, on 2 MiB pages where the OS has transparent
            huge pages. ``None`` (default): the mapping, unless on Linux it
            turns out to sit on small pages (a file just converted, or cached
            by plain reads) and a copy fits in the available memory; then a
            copy. Weights on 2 MiB pages stream faster (one sequence's decode
            about 12% on the Zen 2 of the benchmarks); the output is the same
            either way. ``store_stats()["weights"]`` says what was done and
            why. With a ``ram_budget`` that streams experts this does not
            apply (the dense part is always copied).
    """

    def __init__(
        self,
        path: PathLike,
        *,
        threads: int | None = None,
        ram_budget: int | str | None = None,
        lru: bool = True,
        pin_hot: bool = True,
        prefetch: bool = False,
        io: str = "buffered",
        heat_file: PathLike | None = None,
        kv_cache_dtype: str = "auto",
        max_batch: int = 16,
        max_queue: int = 0,
        kv_cache: str | None = None,
        mmap: bool | None = None,
        max_state_memory: int | str | None = None,
        prefix_cache: int | str | None = None,
    ) -> None:
        if kv_cache is not None:
            warnings.warn("Engine(kv_cache=...) is now kv_cache_dtype=...", DeprecationWarning, stacklevel=2)
            kv_cache_dtype = kv_cache
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0)):
            if not _is_int(value) or not low <= value <= 2**16:
                raise InvalidInputError(f"{name} must be an integer in [{low}, 65536], got {value!r}")
        if mmap is not None and not isinstance(mmap, bool):
            raise InvalidInputError(f"mmap must be True, False or None, got {mmap!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
            raise InvalidInputError(f"threads must be a positive integer or None, got {threads!r}")
        if threads is not None and threads < 1:
            raise InvalidInputError(f"threads must be at least 1, got {threads}")
        self._path = os.fspath(path)
        budget = _budget_bytes(ram_budget)
        self._ram_budget = budget
        heat = None if heat_file is None else os.fspath(heat_file)
        self._native = _colibri.NativeEngine(
            self._path,
            threads=threads,
            ram_budget=budget,
            lru=bool(lru),
            pin_hot=bool(pin_hot),
            prefetch=bool(prefetch),
            io=str(io),
            heat_file=heat,
            kv_cache_dtype=str(kv_cache_dtype),
            max_batch=int(max_batch),
            max_queue=int(max_queue),
            weights="auto" if mmap is None else "map" if mmap else "copy",
            max_state_bytes=_budget_bytes(max_state_memory, "max_state_memory") or 0,
            prefix_cache_bytes=_budget_bytes(prefix_cache, "prefix_cache") or 0
            if prefix_cache not in (None, 0, "0")
            else 0,
        )
        self._attach()

    def _attach(self) -> None:
        # What every engine keeps beside its native side, once that is open.
        self._meta = json.loads(self._native.metadata_json())
        self._lock = threading.Lock()
        self._codec: TextCodec | None = None
        self._template: ChatTemplate | None = None
        self._defaults = generation_defaults(self._meta.get("generation_config"))

    @classmethod
    def from_pretrained(
        cls,
        model: PathLike,
        *,
        revision: str | None = None,
        dtype: str | None = None,
        cache_dir: PathLike | None = None,
        threads: int | None = None,
        progress: bool | None = None,
        **options: Any,
    ) -> Engine:
        """Opens a Hugging Face checkpoint, converting it once.

        ``model`` is a checkpoint folder, a ``.colibri`` file (opened as is),
        or a Hub repository id such as ``"Qwen/Qwen3-30B-A3B"``: that is fetched
        through the optional ``huggingface_hub`` package (``pip install
        'colibri-moe[hub]'``) at ``revision`` (a branch, tag or commit; default
        the main branch) into the Hugging Face cache with its conventions
        (``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1`` to use only what is
        cached, ``HF_TOKEN``), only the files a conversion reads.

        The converted file is kept under ``cache_dir`` (default:
        ``$COLIBRI_CACHE``, else ``~/.cache/colibri``) and reused while the
        folder's files (names, sizes, modification times), the ``dtype`` and
        the colibri version stay the same; a stale conversion of the same
        folder and dtype is removed.
        """
        name = os.fspath(model)
        src = Path(name)
        if src.is_file():
            return cls(src, threads=threads, **options)
        hub = looks_like_repo_id(name)  # and not a path here
        if revision is not None and not hub:
            raise InvalidInputError(f"revision= is for Hub repository ids, and {name!r} is a local path")
        if hub:
            src = hub_snapshot(name, revision, progress)
        path = cached_conversion(src, dtype=dtype, cache_dir=cache_dir, progress=progress)
        return cls(path, threads=threads, **options)

    @classmethod
    def demo(cls, *, threads: int | None = None, **options: Any) -> Engine:
        """The small demo model that ships inside the package (``options`` as for ``Engine``)."""
        path = _demo_path()
        if not path.is_file():
            raise ModelNotFoundError(
                f"the demo model is not part of this installation (expected {path}); "
                "reinstall colibri-moe from a wheel or a full checkout"
            )
        return cls(path, threads=threads, **options)

    def __repr__(self) -> str:
        if self.closed:
            return f"Engine({self._path!r}, closed)"
        return (
            f"Engine({self._path!r}, architecture={self.architecture!r}, "
            f"dtype={self._meta['weight_dtype']!r}, threads={self.threads})"
        )

    def close(self) -> None:
        """Stops the engine: generations still waiting or running end with an
        error, routing heat is saved now (when experts stream), and every
        later call raises :class:`InvalidInputError`. The weights are unmapped
        once nothing refers to them. Calling it again does nothing; ``with
        Engine(...) as engine:`` closes on leaving the block."""
        native, self._native = self._native, cast(_colibri.NativeEngine, _CLOSED)
        if not isinstance(native, _Closed):
            native.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return isinstance(self._native, _Closed)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------
    # What the model is

    @property
    def path(self) -> str:
        """The file this engine reads."""
        return self._path

    @property
    def config(self) -> dict[str, Any]:
        """The canonical model config (a fresh copy; editing it changes nothing)."""
        config: dict[str, Any] = json.loads(json.dumps(self._meta["config"]))
        return config

    @property
    def source_config(self) -> dict[str, Any] | None:
        """The checkpoint's original config.json, as embedded at conversion."""
        source: dict[str, Any] | None = self._meta.get("source_config")
        return source

    @property
    def skipped_parts(self) -> list[str]:
        """Parts of the source checkpoint the engine does not run and the
        converter left out, e.g. ``["model.visual.* (24 tensors)"]`` for a
        vision tower or a multi-token-prediction layer (empty for most models)."""
        return [str(p) for p in self._meta.get("skipped") or []]

    @property
    def architecture(self) -> str:
        """The Hugging Face class the model was converted from, e.g. ``MixtralForCausalLM``."""
        return str(self._meta["architecture"])

    @property
    def dtype(self) -> str:
        """Storage type of the weight matrices (one of :func:`colibri.supported_dtypes`)."""
        return str(self._meta["weight_dtype"])

    @property
    def kv_cache_dtype(self) -> str:
        """Element type of the KV cache this engine's sessions use (``"f32"`` or ``"f16"``)."""
        return self._native.kv_dtype()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes the KV cache takes per token of context, over all layers: keys
        and values of every kv head, or for latent attention (DeepSeek) the
        compressed latent and the rotated key."""
        return self._native.kv_bytes_per_token()

    def state_pieces(self) -> dict[str, tuple[int, int]]:
        """The state by piece, over all layers, for models whose layers keep
        more than one kind (DeepSeek-V4's pooled attention: ``window``,
        ``pool_block``, ``pool_entries``, ``index_block``, ``index_keys``):
        ``{piece: (bytes per token, bytes per sequence)}``, float32, summing to
        :meth:`state_bytes`. Empty for other models."""
        cfg = self.config
        kind = cfg["attention"].get("kind", {})
        if kind.get("type") != "pooled":
            return {}
        dh, di, w = cfg["head_dim"], kind["indexer"]["head_dim"], kind["window"]
        names = ("window", "pool_block", "pool_entries", "index_block", "index_keys")
        out = {k: [0, 0] for k in names}
        for layer in cfg["layers"][: self.num_layers]:
            pool = layer.get("pool")
            if layer.get("mixer") != "pooled":
                continue
            out["window"][1] += 4 * w * dh
            if pool in ("heavy", "light"):
                rate = kind["heavy_rate"] if pool == "heavy" else kind["light_rate"]
                m = 2 if pool == "light" else 1
                out["pool_block"][1] += 4 * (2 * rate * m * dh + (2 * rate * dh if pool == "light" else 0))
                out["pool_entries"][0] += -(-4 * dh // rate)
            if pool == "light":
                rate = kind["light_rate"]
                out["index_block"][1] += 4 * 6 * rate * di
                out["index_keys"][0] += -(-4 * di // rate)
        return {k: (v[0], v[1]) for k, v in out.items() if v != [0, 0]}

    def state_bytes(self) -> dict[str, int]:
        """State memory of one sequence over all layers, in two parts:
        ``per_token`` grows with every token (the KV caches, the same number as
        :attr:`kv_bytes_per_token`), ``per_sequence`` is fixed whatever the
        length (0 for models whose every layer is attention). A sequence of
        ``n`` tokens takes ``per_sequence + n * per_token`` bytes."""
        per_token, per_sequence = self._native.state_bytes()
        return {"per_token": per_token, "per_sequence": per_sequence}

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model knows."""
        return int(self._meta["config"]["vocab_size"])

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt plus generated tokens) the model accepts."""
        return int(self._meta["config"]["max_seq_len"])

    @property
    def num_layers(self) -> int:
        """Number of decoder layers (without a multi-token-prediction layer)."""
        return len(self._meta["config"]["layers"]) - int(self.has_mtp)

    @property
    def has_mtp(self) -> bool:
        """Whether the file keeps a multi-token-prediction layer, which drafts
        tokens for ``speculative="mtp"``."""
        return self._meta["config"].get("mtp") is not None

    @property
    def threads(self) -> int:
        """Worker threads used for compute."""
        return int(self._native.threads)

    @property
    def file_size(self) -> int:
        """Size of the .colibri file in bytes."""
        return int(self._meta["file_bytes"])

    def tensors(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        """Every stored tensor as ``(name, dtype, shape, bytes)``, in file order."""
        return [(n, d, tuple(s), b) for n, d, s, b in self._native.tensors()]

    @property
    def recipe(self) -> str | None:
        """The conversion recipe, when the weight matrices are not all of one
        type (``"q4_1-mix"``, or a ``class=type,...`` spec); else ``None``."""
        r = self._native.recipe()
        return None if r is None else str(r)

    def weight_types(self) -> list[dict[str, Any]]:
        """How each class of weight matrix is stored: one dict per class
        present (``embed``, ``lm_head``, ``tied``: an embedding that is also
        the output head, ``attn``: q and o, ``attn_kv``: k and v, ``ffn``,
        ``shared``, ``experts``, ``experts_down``) with ``dtypes`` (storage types, the
        interleaved forms named by their row type), ``parameters``, ``bytes``
        and ``bits_per_weight``, then ``other`` (norms, biases, the router:
        f32) and ``all``."""
        classes = dict(self._native.tensor_classes())
        order = [*_colibri.weight_classes(), "other"]
        rows: dict[str, dict[str, Any]] = {}
        for name, dtype, shape, nbytes in self.tensors():
            cls = classes.get(name, "other")
            row = rows.setdefault(cls, {"class": cls, "dtypes": [], "parameters": 0, "bytes": 0})
            base = dtype[:-2] if dtype.endswith("x8") else dtype
            if base not in row["dtypes"]:
                row["dtypes"].append(base)
            n = 1
            for d in shape:
                n *= d
            row["parameters"] += n
            row["bytes"] += nbytes
        out = [rows[c] for c in order if c in rows]
        total = {
            "class": "all",
            "dtypes": sorted({d for r in out for d in r["dtypes"]}),
            "parameters": sum(r["parameters"] for r in out),
            "bytes": sum(r["bytes"] for r in out),
        }
        for r in [*out, total]:
            r["bits_per_weight"] = 8 * r["bytes"] / max(r["parameters"], 1)
        return [*out, total]

    def calibrate(
        self,
        output: PathLike | None = None,
        *,
        text: str | None = None,
        token_ids: TokenIds | None = None,
        window: int = 512,
        max_tokens: int | None = None,
        force: bool = False,
        progress: bool | None = None,
    ) -> Path:
        """Records an importance matrix for quantising this model: runs
        ``text`` (default: the calibration text shipped with colibri, about
        18,000 words of Jane Austen's prose) through the model in windows of
        ``window`` tokens and writes, for every weight matrix, the mean square
        of each input column (for a routed expert, over the tokens routed to
        it) to ``output`` (default: beside the model, ``.imatrix``).
        ``token_ids`` instead of text serves a model without a tokenizer.
        :func:`colibri.convert` with ``imatrix=`` then quantises to minimise
        the error those activations see. Calibrate the unquantised model
        (bf16/f16/f32): the statistics are of its activations.
        Returns the output path."""
        if self._ram_budget is not None:
            raise InvalidInputError("calibration needs the whole model in memory: open it without ram_budget")
        out = Path(os.fspath(output)) if output is not None else Path(self._path).with_suffix(".imatrix")
        if out.exists() and not force:
            raise OutputExistsError(f"{out} exists; pass force=True (--force) to replace it")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidInputError(f"window must be a positive integer, got {window!r}")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise InvalidInputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if token_ids is not None:
            if text is not None:
                raise InvalidInputError("give text or token_ids, not both")
            ids, lead, source = _as_ids(token_ids), [], "token ids"
            if not ids:
                raise InvalidInputError("calibration token_ids are empty")
        else:
            source = "text" if text is not None else "colibri's default calibration text"
            if text is None:
                text = _calibration_text()
            if not isinstance(text, str) or not text.strip():
                raise InvalidInputError("calibration text is empty")
            ids = self.tokenize(text, add_special_tokens=False)
            lead = self.tokenize("", add_special_tokens=True)  # e.g. a beginning-of-sequence token
        step = max(1, min(window, self.context_length) - len(lead))
        if max_tokens is not None:
            ids = ids[:max_tokens]
        windows = [lead + ids[i : i + step] for i in range(0, len(ids), step)]
        if progress is None:
            progress = sys.stderr.isatty()
        self._native.calibrate(windows, os.fspath(out), source, progress=bool(progress))
        return out

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The sampling values used for options a call leaves out (a copy)."""
        return dict(self._defaults)

    # ------------------------------------------------------------------
    # Text

    @property
    def has_tokenizer(self) -> bool:
        """Whether the file embeds a tokenizer (text in and out needs one)."""
        return bool(self._meta.get("has_tokenizer"))

    def _text(self) -> TextCodec:
        if self._codec is None:
            with self._lock:
                if self._codec is None:
                    text = self._native.tokenizer_json()
                    if text is None:
                        raise TokenizerError(
                            f"{self._path} has no tokenizer, so it takes and returns token ids only; "
                            "convert a checkpoint folder that has tokenizer.json to use text"
                        )
                    self._codec = TextCodec(text, self._meta.get("tokenizer_config"))
        return self._codec

    @property
    def tokenizer(self) -> Any:
        """The model's ``tokenizers.Tokenizer`` (raises :class:`TokenizerError` if it has none)."""
        return self._text().tokenizer

    @property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence id (tokenizer_config.json, else generation_config/config.json)."""
        if self.has_tokenizer:
            tid = self._text().token_id("bos_token")
            if tid is not None:
                return tid
        for source in (self._meta.get("generation_config"), self.source_config):
            ids = _ints((source or {}).get("bos_token_id"))
            if ids:
                return ids[0]
        return None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every end-of-sequence id: generation_config.json's, config.json's and the
        tokenizer's ``eos_token``. Generation stops on any of them."""
        found = _ints((self._meta.get("generation_config") or {}).get("eos_token_id"))
        found += _ints((self.source_config or {}).get("eos_token_id"))
        if self.has_tokenizer:
            tid = self._text().token_id("eos_token")
            if tid is not None:
                found.append(tid)
        out: list[int] = []
        for t in found:
            if 0 <= t < self.vocab_size and t not in out:
                out.append(t)
        return out

    @property
    def pad_token_id(self) -> int | None:
        """Padding id, if the checkpoint names one."""
        if self.has_tokenizer:
            tid = self._text().token_id("pad_token")
            if tid is not None:
                return tid
        for source in (self._meta.get("generation_config"), self.source_config):
            ids = _ints((source or {}).get("pad_token_id"))
            if ids:
                return ids[0]
        return None

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens`` the tokenizer adds
        what the checkpoint asks for (typically a beginning-of-sequence token)."""
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a str, got {type(text).__name__}")
        return self._text().encode(text, add_special_tokens=bool(add_special_tokens))

    def detokenize(self, token_ids: TokenIds, *, skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``."""
        ids = _as_ids(token_ids)
        bad = [t for t in ids if not 0 <= t < 2**32]
        if bad:
            raise InvalidInputError(f"token id {bad[0]} is out of range")
        return self._text().decode(ids, skip_special_tokens=bool(skip_special_tokens))

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template (Jinja source), if it has one."""
        return template_from_metadata(self._meta.get("chat_template"), self._meta.get("tokenizer_config"))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Renders a conversation with the model's chat template, as
        transformers does: sandboxed Jinja, the special tokens as variables,
        and ``chat_template_kwargs`` as extra variables (``enable_thinking``,
        ``tools`` ...)."""
        if self._template is None:
            source = self.chat_template
            if source is None:
                raise ChatTemplateError(
                    f"{self._path} has no chat template; use generate() with a prompt you format yourself"
                )
            with self._lock:
                if self._template is None:
                    self._template = ChatTemplate(source)
        specials = self._text().special_tokens if self.has_tokenizer else {}
        return self._template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=specials,
            extra=chat_template_kwargs,
        )

    # ------------------------------------------------------------------
    # Forward passes

    def routing_stats(
        self,
        since: RoutingStats | Mapping[str, Any] | None = None,
        until: RoutingStats | Mapping[str, Any] | None = None,
    ) -> RoutingStats:
        """How the router has chosen experts since the file was opened, or
        over the tokens run since ``since`` (an earlier result of this call
        on the same engine: counts are subtracted and the figures computed
        again over that window). ``until`` ends the window at a snapshot the
        caller already holds instead of now (no new snapshot is taken), e.g.
        ``routing_stats(since=a, until=b)`` for the tokens run between two.

        Per MoE layer: ``heat`` (times each expert was chosen), utilisation
        entropy (bits, and normalised to [0, 1]), the mean (``mean_margin``)
        and histogram of the margin between each token's top-1 and top-2
        router probabilities, router health (``dead``: experts never chosen;
        ``overloaded``: chosen more than 3x their uniform share; ``max_load``:
        the busiest expert's count over its uniform share) and ``residency``,
        one character per expert: ``R`` resident, ``P`` pinned in the expert
        cache, ``C`` cached, ``.`` on disk (as of ``until`` when given). A
        ``since`` that is not an earlier snapshot of this model (than
        ``until``, or now) raises ValueError.
        """
        earlier = None if since is None else json.dumps(since)
        later = None if until is None else json.dumps(until)
        result: RoutingStats = json.loads(self._native.routing_stats_json(earlier, later))
        return result

    def batch_stats(self) -> BatchStats:
        """The generation scheduler's counters since the engine opened:
        ``waiting`` and ``running`` generations, ``steps`` run,
        ``prompt_tokens`` and ``generated_tokens``, ``last_batch`` (sequences
        in the last step), ``step_tokens`` (steps by tokens per step, bucketed
        by the upper bounds ``step_token_buckets``, one more bucket for larger
        steps), ``step_sequences`` (steps by decoding sequences, the last slot
        ``max_batch`` or more), ``finished``, ``busy_seconds``, ``kv_tokens``
        (positions in the running generations' KV caches) and the limits
        ``max_batch``, ``max_queue`` and ``step_budget``; ``prefix_cache``
        (``None`` without one): its ``bytes``, ``blocks``, ``lookups``,
        ``hits``, ``prompt_tokens`` looked up and ``cached_tokens`` served."""
        result: BatchStats = json.loads(self._native.batch_stats_json())
        return result

    def store_stats(self) -> StoreStats:
        """Expert-cache figures since the file was opened: hits, misses,
        ``hit_rate``, bytes read from disk per token, prefetch accuracy
        (fraction of prefetched experts that were used), time waiting on I/O,
        per layer and in total. All zero when the whole model is resident."""
        result: StoreStats = json.loads(self._native.store_stats_json())
        return result

    def logits(self, token_ids: TokenIds) -> np.ndarray:
        """Logits of every position of a fresh forward pass over ``token_ids``.

        Returns a float32 array of shape ``(len(token_ids), vocab_size)``; row i
        scores the token that follows ``token_ids[: i + 1]``. No state is kept
        between calls.
        """
        ids = _as_ids(token_ids)
        buf = self._native.logits(ids)
        return np.frombuffer(buf, dtype=np.float32).reshape(len(ids), self.vocab_size)

    def hidden_states(self, token_ids: TokenIds) -> np.ndarray:
        """Residual-stream states, shape ``(num_layers + 1, len(token_ids), hidden_size)``.

        Index 0 is the embedding output, index i the output of layer i - 1, and
        the last index the final-normed output, as transformers'
        ``output_hidden_states``.
        """
        ids = _as_ids(token_ids)
        buf = self._native.hidden_states(ids)
        d = int(self._meta["config"]["hidden_size"])
        return np.frombuffer(buf, dtype=np.float32).reshape(self.num_layers + 1, len(ids), d)

    def mtp_draft_logits(self, token_ids: TokenIds, k: int = 1) -> np.ndarray:
        """The multi-token-prediction layer's logits, shape
        ``(len(token_ids) - 1 + k, vocab_size)``.

        Row ``i`` of the first ``len(token_ids) - 1`` comes from the hidden
        state at position ``i`` and token ``i + 1`` and predicts token
        ``i + 2``; then ``k`` draft steps follow the model's own most likely
        next token, each fed the step before's most likely token, as
        ``speculative="mtp"`` drafts. For checking the layer against a
        reference; raises :class:`InvalidInputError` for a file without
        the layer.
        """
        ids = _as_ids(token_ids)
        buf = self._native.mtp_draft_logits(ids, int(k))
        return np.frombuffer(buf, dtype=np.float32).reshape(len(ids) - 1 + int(k), self.vocab_size)

    # ------------------------------------------------------------------
    # Generation

    @overload
    def generate(  # type: ignore[overload-overlap]  # a str is also a Sequence[str]
        self,
        prompt: str,
        sampling: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        **options: Unpack[SamplingOptions],
    ) -> Completion: ...
    @overload
    def generate(
        self,
        prompt: TokenIds,
        sampling: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        **options: Unpack[SamplingOptions],
    ) -> TokenCompletion: ...
    @overload
    def generate(
        self,
        prompt: Sequence[str],
        sampling: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        **options: Unpack[SamplingOptions],
    ) -> list[Completion]: ...
    @overload
    def generate(
        self,
        prompt: Sequence[TokenIds],
        sampling: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        **options: Unpack[SamplingOptions],
    ) -> list[TokenCompletion]: ...
    def generate(
        self,
        prompt: Prompt | Sequence[Prompt],
        sampling: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        **options: Unpack[SamplingOptions],
    ) -> Result | list[Any]:
        """Continues a prompt.

        Text in, text out: a ``str`` prompt gives a :class:`Completion` (a
        ``str`` with ``finish_reason``, ``stop_reason``, ``token_ids`` and
        ``timings``). Token ids in, token ids out: a sequence of ints gives a
        :class:`TokenCompletion` (a ``list`` of the new ids with the same
        attributes). A list of prompts gives a list of results, each the same as
        its prompt would give alone.

        How tokens are chosen and when it stops: a :class:`SamplingParams`
        and/or its fields as keywords (``max_new_tokens``, ``temperature``,
        ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
        ``presence_penalty``, ``frequency_penalty``, ``seed``, ``stop``,
        ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``,
        ``logprobs``; keywords replace the object's fields). Every one left
        unset takes the model's default (:attr:`generation_defaults`).

        Stopping: on any end-of-sequence id of the model (unless
        ``ignore_eos``) and any id in ``stop_token_ids`` (kept in the token ids,
        never in the text); on any of the ``stop`` strings, also one spanning
        tokens (not included in the text); after ``max_new_tokens``; or when
        prompt plus output fill the context.

        ``add_special_tokens`` lets the tokenizer add its beginning-of-sequence
        token to a text prompt. ``logprobs=k`` fills the result's ``logprobs``,
        one :class:`TokenLogprob` per token id; asking for them changes no token.
        """
        params = sampling_params(sampling, options, "generate")
        if _is_batch(prompt):
            # All queued first, so they run batched.
            streams = [self._start(p, params, add_special_tokens=add_special_tokens) for p in prompt]
            return [s.result() for s in streams]
        return self._start(prompt, params, add_special_tokens=add_special_tokens).result()

    @overload
    def stream(
        self,
        prompt: str,
        sampling: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        **options: Unpack[SamplingOptions],
    ) -> Stream[str]: ...
    @overload
    def stream(
        self,
        prompt: TokenIds,
        sampling: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        **options: Unpack[SamplingOptions],
    ) -> Stream[int]: ...
    def stream(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        **options: Unpack[SamplingOptions],
    ) -> Stream[Any]:
        """Like :meth:`generate` for one prompt (the same options), but yields the
        output as it is produced: text pieces for a text prompt (never a broken
        character; joined they equal what :meth:`generate` returns), token ids
        for a token-id prompt. The returned :class:`Stream` tells
        ``finish_reason`` and ``timings`` once exhausted; leaving the loop early
        stops the work."""
        params = sampling_params(sampling, options, "stream")
        return self._start(prompt, params, add_special_tokens=add_special_tokens)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        **options: Unpack[SamplingOptions],
    ) -> Completion:
        """The assistant's reply to a conversation.

        ``messages`` is a list of ``{"role": ..., "content": ...}`` dicts (as
        OpenAI's: an assistant turn may carry ``tool_calls``, a ``tool`` turn
        answers one by its ``tool_call_id``); it is rendered with the model's
        chat template (see :meth:`apply_chat_template`) and continued as
        :meth:`generate` does, with the same options.

        ``tools`` (OpenAI's form: ``{"type": "function", "function": {"name",
        "description", "parameters"}}``) are given to the template, and the
        calls the model writes in its family's syntax come back parsed in
        the result's ``tool_calls``, not in its text. ``tool_choice`` is
        ``"auto"`` (the default), ``"none"`` (the tools are not shown),
        ``"required"`` (the model must call one of them) or a named function
        (``{"type": "function", "function": {"name": NAME}}``: it must call
        that one); the last two are enforced by constrained decoding, the
        call written in the template's own format with arguments valid
        against the tool's schema (one call only with
        ``parallel_tool_calls=False``). A model that reasons (``<think>``, GPT-OSS's
        analysis channel) gives its reasoning in ``reasoning_content``, apart
        from the answer.
        """
        params = sampling_params(sampling, options, "chat")
        text, make_parser, constraint = self._prepare_chat(
            messages,
            tools=tools,
            tool_choice=tool_choice,
            chat_template_kwargs=chat_template_kwargs,
            parallel_tool_calls=parallel_tool_calls,
        )
        if constraint:
            params = params.replace(**constraint)
        parser = make_parser()
        if parser is None:
            # The template writes the special tokens it wants itself.
            result = self._start(text, params, add_special_tokens=False).result()
            assert isinstance(result, Completion)
            return result
        # Markers may be special tokens: keep them in the text for the parser.
        stream = self._start(text, params.replace(skip_special_tokens=False), add_special_tokens=False)
        for piece in stream:
            parser.feed(piece)
        parser.finish()
        calls = parser.tool_calls
        reason = stream.finish_reason
        if calls and reason == "stop":
            reason = "tool_calls"
        return Completion(
            parser.content,
            stream.token_ids,
            reason,
            stream.stop_reason,
            stream.timings,
            stream.logprobs,
            reasoning_content=parser.reasoning if parser.reasoning or parser.think else None,
            tool_calls=calls,
        )

    def _prepare_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        call_id: Any = None,
        parallel_tool_calls: bool = True,
    ) -> tuple[str, Any, dict[str, str]]:
        """The rendered prompt of a chat, a function making a fresh
        :class:`~colibri._tools.OutputParser` for each generation from it
        (returning None when there is nothing to parse), and the constraint
        that forces a tool call (``{"grammar": ...}`` for ``tool_choice``
        ``"required"`` or a named function, else empty). Shared by
        :meth:`chat` and the server; errors are :class:`InvalidInputError`
        whose messages start with the field's path."""
        if tool_choice is None:
            tool_choice = "auto"
        named: str | None = None
        if isinstance(tool_choice, Mapping):
            fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
            named = fn.get("name") if isinstance(fn, Mapping) else None
            if not isinstance(named, str):
                raise InvalidInputError(
                    'tool_choice: a named function is {"type": "function", "function": {"name": NAME}}, '
                    f"got {dict(tool_choice)!r}"
                )
        elif tool_choice not in ("auto", "none", "required"):
            raise InvalidInputError(
                f"tool_choice: must be 'auto', 'none', 'required' or a named function, got {tool_choice!r}"
            )
        checked = check_tools(list(tools) if isinstance(tools, tuple) else tools) if tools is not None else []
        forced = tool_choice == "required" or named is not None
        if forced and not checked:
            raise InvalidInputError("tool_choice: forcing a tool call needs tools")
        if named is not None and named not in [t["function"]["name"] for t in checked]:
            raise InvalidInputError(f"tool_choice: no tool named {named!r} in tools")
        shown = [] if tool_choice == "none" else checked
        template = self.chat_template
        fmt, think = detect(template)
        if shown and template is not None and fmt is None:
            raise InvalidInputError(
                "tools: this model's chat template writes no tool-call format colibri can read "
                "(see the serving guide for the families it knows)"
            )
        prepared = prepare_messages(check_messages(messages))
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ChatTemplateError(
                "chat_template_kwargs must be a dict whose keys are variable names, "
                f"got {chat_template_kwargs!r:.80}"
            )
        kwargs = dict(chat_template_kwargs or {})
        if shown:
            kwargs["tools"] = shown
        text = self.apply_chat_template(prepared, chat_template_kwargs=kwargs or None)
        drop = list(self._text().special_tokens.values()) if self.has_tokenizer else []
        constraint: dict[str, str] = {}
        if forced:
            constraint["grammar"] = call_grammar(
                fmt,
                shown,
                name=named,
                parallel=parallel_tool_calls,
                special=self._special_ids(),
                after_think=think and text.rstrip().endswith(THINK_OPEN),
            )

        def make_parser() -> OutputParser | None:
            return parser_for(template, text, tools=shown, drop=drop, call_id=call_id or new_call_id)

        return text, make_parser, constraint

    def _special_ids(self) -> dict[str, int]:
        """The special tokens of the tokenizer: text to id."""
        if not self.has_tokenizer:
            return {}
        added = self._text().tokenizer.get_added_tokens_decoder()
        return {t.content: i for i, t in added.items() if t.special}

    def _start(
        self,
        prompt: Any,
        params: SamplingParams,
        *,
        add_special_tokens: bool,
        text_out: bool = False,
    ) -> Stream[Any]:
        # text_out: text pieces also for a token-id prompt (the server's case).
        text_mode = isinstance(prompt, str) or text_out
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_special_tokens=add_special_tokens)
            if not ids:
                raise InvalidInputError("the prompt is empty: it gives no tokens")
        elif _is_batch(prompt) and isinstance(prompt[0], str):
            raise InvalidInputError("stream() takes one prompt; call it once per prompt")
        else:
            ids = _as_ids(prompt, "prompt")
        stops = list(params.stop)
        codec = self._text() if text_mode or stops else None
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += [t for t in self.eos_token_ids if t not in stop_ids]
        full = params.with_defaults(self._defaults)
        extra: dict[str, Any] = {}
        if full.prediction is not None:
            guess = full.prediction
            extra["prediction"] = (
                self.tokenize(guess, add_special_tokens=False) if isinstance(guess, str) else list(guess)
            )
        native = self._native.start(ids, stop_ids=stop_ids, **full.native(), **extra)
        return Stream(
            native,
            codec=codec,
            text_mode=text_mode,
            stop=stops,
            skip_special_tokens=params.skip_special_tokens,
            context=ids,
            logprobs=params.logprobs is not None,
            stop_ids=stop_ids,
        )


def calibrate(
    model: PathLike,
    output: PathLike | None = None,
    *,
    text: str | None = None,
    token_ids: TokenIds | None = None,
    window: int = 512,
    max_tokens: int | None = None,
    threads: int | None = None,
    force: bool = False,
    progress: bool | None = None,
) -> Path:
    """Opens ``model`` (a ``.colibri`` file) and records its importance
    matrix: :meth:`Engine.calibrate`. Returns the output path."""
    engine = Engine(model, threads=threads)
    return engine.calibrate(
        output,
        text=text,
        token_ids=token_ids,
        window=window,
        max_tokens=max_tokens,
        force=force,
        progress=progress,
    )


def _calibration_text() -> str:
    from importlib.resources import files

    path = Path(str(files("colibri") / "data" / "calibration.txt"))
    if not path.is_file():
        raise ModelNotFoundError(
            f"the default calibration text is not part of this installation (expected {path}); give text="
        )
    return path.read_text(encoding="utf-8")


__all__ = ["Completion", "Engine", "Stream", "TokenCompletion", "calibrate", "generation_defaults"]
