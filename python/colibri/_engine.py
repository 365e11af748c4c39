"""The Python face of the native engine: argument checking and NumPy arrays.

No maths happens here; every call goes to the Rust core with the GIL released.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Sequence
from typing import Any, Union

import numpy as np

from . import _colibri
from ._errors import InvalidInputError

TokenIds = Union[Sequence[int], "np.ndarray"]
PathLike = Union[str, "os.PathLike[str]"]


def _as_ids(token_ids: Any, what: str = "token_ids") -> list[int]:
    """Validates a 1-D sequence of integer token ids and returns it as a list."""
    if isinstance(token_ids, (str, bytes)):
        raise InvalidInputError(
            f"{what} must be a sequence of integer token ids, got {type(token_ids).__name__} "
            "(text prompts need a tokenizer, which this version does not expose yet)"
        )
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise InvalidInputError(f"{what} must be 1-D, got an array of shape {token_ids.shape}")
        if not np.issubdtype(token_ids.dtype, np.integer):
            raise InvalidInputError(f"{what} must hold integers, got dtype {token_ids.dtype}")
        return [int(t) for t in token_ids.tolist()]
    try:
        items = list(token_ids)
    except TypeError:
        raise InvalidInputError(
            f"{what} must be a sequence of integer token ids, got {type(token_ids).__name__}"
        ) from None
    out = []
    for i, t in enumerate(items):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise InvalidInputError(f"{what}[{i}] = {t!r} is not an integer token id")
        out.append(int(t))
    return out


class Engine:
    """A `.colibri` model opened for inference.

    Opening maps the file (nothing is copied) and validates it. One engine can
    be shared by several Python threads: each call runs in its own session.

    Args:
        path: a ``.colibri`` file made by :func:`colibri.convert`.
        threads: worker threads for compute (default: the number of physical cores).
    """

    def __init__(self, path: PathLike, *, threads: int | None = None) -> None:
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
            raise InvalidInputError(f"threads must be a positive integer or None, got {threads!r}")
        if threads is not None and threads < 1:
            raise InvalidInputError(f"threads must be at least 1, got {threads}")
        self._path = os.fspath(path)
        self._native = _colibri.NativeEngine(self._path, threads)
        self._meta = json.loads(self._native.metadata_json())

    def __repr__(self) -> str:
        return (
            f"Engine({self._path!r}, architecture={self.architecture!r}, "
            f"dtype={self._meta['weight_dtype']!r}, threads={self.threads})"
        )

    @property
    def path(self) -> str:
        """The file this engine reads."""
        return self._path

    @property
    def config(self) -> dict[str, Any]:
        """The canonical model config (a fresh copy; editing it changes nothing)."""
        return json.loads(json.dumps(self._meta["config"]))

    @property
    def source_config(self) -> dict[str, Any] | None:
        """The checkpoint's original config.json, as embedded at conversion."""
        return self._meta.get("source_config")

    @property
    def architecture(self) -> str:
        """The Hugging Face class the model was converted from, e.g. ``MixtralForCausalLM``."""
        return str(self._meta["architecture"])

    @property
    def dtype(self) -> str:
        """Storage type of the weight matrices (``f32``, ``bf16`` or ``f16``)."""
        return str(self._meta["weight_dtype"])

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
        """Number of decoder layers."""
        return len(self._meta["config"]["layers"])

    @property
    def threads(self) -> int:
        """Worker threads used for compute."""
        return int(self._native.threads)

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

    def generate(
        self,
        token_ids: TokenIds,
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Continues ``token_ids`` and returns only the new token ids.

        Greedy at ``temperature=0`` (the default); otherwise samples from the
        tempered distribution, reproducibly for a given ``seed``. Stops after
        ``max_new_tokens``, after producing any id in ``stop_token_ids`` (which
        is kept in the output), or when the context is full.
        """
        ids = _as_ids(token_ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidInputError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if seed is None:
            seed = random.SystemRandom().getrandbits(64)
        elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise InvalidInputError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        stops = _as_ids(stop_token_ids or [], "stop_token_ids")
        return list(self._native.generate(ids, max_new_tokens, float(temperature), seed, stops))


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    dtype: str | None = None,
    force: bool = False,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Converts a Hugging Face checkpoint folder into one ``.colibri`` file.

    Args:
        src: folder with ``config.json`` and ``*.safetensors`` (sharded or not).
        dst: output file. Refused if it exists, unless ``force=True``.
        dtype: storage type of the weight matrices: ``"f32"``, ``"bf16"``, ``"f16"``,
            or ``None`` to keep the checkpoint's own type. Norms, biases and the
            router are always stored in f32.
        progress: draw a progress bar on stderr (default: when stderr is a terminal).

    Returns a summary: ``path``, ``architecture``, ``dtype``, ``tensors``, ``bytes``.
    A failed or interrupted conversion leaves no file behind.
    """
    if progress is None:
        progress = sys.stderr.isatty()
    return dict(
        _colibri.convert_checkpoint(os.fspath(src), os.fspath(dst), dtype, bool(force), bool(progress))
    )
