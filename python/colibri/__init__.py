"""colibri-moe: fast, exact CPU inference for Mixture-of-Experts language models.

>>> import colibri
>>> engine = colibri.Engine.demo()                      # or Engine("model.colibri"),
>>> print(engine.generate("Once upon a time", max_new_tokens=32))  # Engine.from_pretrained("hf-folder")
>>> for piece in engine.stream("Once upon a time"):
...     print(piece, end="", flush=True)
"""

from __future__ import annotations

from ._colibri import __version__, supported_architectures, supported_dtypes
from ._engine import Engine, convert, plan
from ._errors import (
    ChatTemplateError,
    CheckpointError,
    ColibriError,
    ColibriIOError,
    ContextLengthError,
    FormatError,
    InvalidInputError,
    ModelNotFoundError,
    OutputExistsError,
    TokenizerError,
    UnsupportedModelError,
)
from ._generation import Completion, Stream, Timings, TokenCompletion

__all__ = [
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
    "Stream",
    "Timings",
    "TokenCompletion",
    "TokenizerError",
    "UnsupportedModelError",
    "__version__",
    "convert",
    "plan",
    "supported_architectures",
    "supported_dtypes",
]
