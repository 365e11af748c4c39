"""The colibri exception hierarchy.

Every error raised by the native core is an instance of one of these classes
(the mapping lives in ``src/python/mod.rs``). Classes that correspond to a
built-in category also derive from it, so ``except ValueError`` or
``except FileNotFoundError`` work as expected.
"""

from __future__ import annotations

__all__ = [
    "BusyError",
    "ChatTemplateError",
    "CheckpointError",
    "ColibriError",
    "ColibriIOError",
    "ContextLengthError",
    "FormatError",
    "InvalidInputError",
    "ModelNotFoundError",
    "OutputExistsError",
    "TokenizerError",
    "UnsupportedModelError",
]


class ColibriError(Exception):
    """Base class of every colibri error."""


class FormatError(ColibriError):
    """A .colibri file is malformed, truncated or of an unknown version."""


class UnsupportedModelError(ColibriError):
    """The checkpoint's architecture or one of its features is not supported."""


class CheckpointError(ColibriError):
    """A Hugging Face checkpoint folder is inconsistent (missing tensors, bad shapes, bad config)."""


class InvalidInputError(ColibriError, ValueError):
    """An argument is unusable: token id out of range, empty prompt, bad option."""


class ContextLengthError(InvalidInputError):
    """The sequence does not fit in the model's context window."""


class TokenizerError(InvalidInputError):
    """Text was given to a model that has no tokenizer, or its tokenizer cannot be loaded."""


class ChatTemplateError(InvalidInputError):
    """The model has no chat template, or rendering it failed (bad messages, template error)."""


class OutputExistsError(ColibriError, FileExistsError):
    """The output of a conversion exists and overwriting was not requested."""


class ModelNotFoundError(ColibriError, FileNotFoundError):
    """A file or folder that was named does not exist."""


class ColibriIOError(ColibriError, OSError):
    """An operating-system error while reading or writing a file."""


class BusyError(ColibriError):
    """The engine's queue of waiting generations is full (``max_queue``); try again later."""


class StageError(ColibriError):
    """A pipeline stage of a model split across machines failed or died
    (``colibri.ray``); the message names the stage, its layers and its node."""
