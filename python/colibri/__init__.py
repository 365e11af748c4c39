"""colibri-moe: fast, exact CPU inference for Mixture-of-Experts language models.

>>> import colibri
>>> engine = colibri.Engine.demo()                      # or Engine("model.colibri"),
>>> print(engine.generate("Once upon a time", max_new_tokens=32))  # Engine.from_pretrained("hf-folder")
>>> for piece in engine.stream("Once upon a time"):
...     print(piece, end="", flush=True)
"""

from __future__ import annotations

from typing import Any

from ._colibri import __version__, supported_architectures, supported_dtypes
from ._colibri import kernel_tables as _kernel_tables
from ._colibri import recipes as _recipes
from ._convert import convert, split
from ._engine import Engine, calibrate, plan
from ._errors import (
    BusyError,
    ChatTemplateError,
    CheckpointError,
    ColibriError,
    ColibriIOError,
    ContextLengthError,
    FormatError,
    InvalidInputError,
    ModelNotFoundError,
    OutputExistsError,
    StageError,
    TokenizerError,
    UnsupportedModelError,
)
from ._generation import Completion, Stream, Timings, TokenCompletion, TokenLogprob
from ._sampling import SamplingOptions, SamplingParams
from ._stats import BatchStats, LayerRouting, Plan, RoutingStats, StoreStats, StoreWeights
from ._tools import ToolCall


def kernels() -> dict[str, Any]:
    """Which kernel table runs the matrices and attention, and which this CPU has.

    ``{"active": "amx", "available": ["scalar", "avx2", "avxvnni", "avx512", "amx"]}``:
    the table is chosen once per process, the best this CPU (and, for AMX,
    the operating system) runs, or the one the ``COLIBRI_ISA`` environment
    variable names when it can run. Every table gives prefill and decode the
    same bits; tables differ from one another in the last bits of a result.
    """
    active, available = _kernel_tables()
    return {"active": active, "available": available}


def recipes() -> dict[str, dict[str, str]]:
    """The named conversion recipes ``convert(dtype=...)`` takes besides
    single types: ``{name: {"spec": "experts=q4_1,...", "description": ...}}``."""
    return {name: {"spec": spec, "description": desc} for name, spec, desc in _recipes()}


__all__ = [
    "BatchStats",
    "LayerRouting",
    "Plan",
    "RoutingStats",
    "StoreStats",
    "StoreWeights",
    "SamplingOptions",
    "SamplingParams",
    "BusyError",
    "ChatTemplateError",
    "CheckpointError",
    "ColibriError",
    "ColibriIOError",
    "Completion",
    "ContextLengthError",
    "Engine",
    "FormatError",
    "InvalidInputError",
    "ModelNotFoundError",
    "OutputExistsError",
    "StageError",
    "Stream",
    "Timings",
    "TokenCompletion",
    "TokenLogprob",
    "TokenizerError",
    "ToolCall",
    "UnsupportedModelError",
    "__version__",
    "calibrate",
    "convert",
    "split",
    "kernels",
    "plan",
    "recipes",
    "supported_architectures",
    "supported_dtypes",
]
