"""colibri-moe: fast, exact CPU inference for Mixture-of-Experts language models.

>>> import colibri
>>> colibri.convert("path/to/hf-folder", "model.colibri")
>>> engine = colibri.Engine("model.colibri")
>>> engine.generate([1, 2, 3], max_new_tokens=8)
"""

from __future__ import annotations

from ._colibri import __version__, supported_architectures, supported_dtypes
from ._engine import Engine, convert
from ._errors import (
    CheckpointError,
    ColibriError,
    ColibriIOError,
    ContextLengthError,
    FormatError,
    InvalidInputError,
    ModelNotFoundError,
    OutputExistsError,
    UnsupportedModelError,
)

__all__ = [
    "CheckpointError",
    "ColibriError",
    "ColibriIOError",
    "ContextLengthError",
    "Engine",
    "FormatError",
    "InvalidInputError",
    "ModelNotFoundError",
    "OutputExistsError",
    "UnsupportedModelError",
    "__version__",
    "convert",
    "supported_architectures",
    "supported_dtypes",
]
