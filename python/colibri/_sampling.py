"""How tokens are chosen and when a generation stops: one definition.

:class:`SamplingParams` is what ``generate``, ``stream``, ``chat``, the
command line and the server hand to the native scheduler. The same names
are accepted as keywords (``generate(p, temperature=0.7)``), typed by
:class:`SamplingOptions`; keywords given beside a ``SamplingParams`` replace
its fields. A field left ``None`` takes the model's default
(``Engine.generation_defaults``: its generation_config.json, else greedy).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np

from ._errors import InvalidInputError

#: Most tokens ``draft_tokens`` may ask to draft per step (the engine's limit).
MAX_DRAFT_TOKENS = 16

#: Most alternatives ``logprobs`` may ask for per token (the engine's limit).
MAX_TOP_LOGPROBS = 20

_INTS = ("max_new_tokens", "top_k")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


#: Token ids are 32-bit in the extension.
_ID_LIMIT = 1 << 32


def _as_ids(token_ids: Any, what: str = "token_ids") -> list[int]:
    """Validates a 1-D sequence of integer token ids and returns it as a list."""
    if isinstance(token_ids, (str, bytes)):
        raise InvalidInputError(
            f"{what} must be a sequence of integer token ids, got {type(token_ids).__name__} "
            "(pass text to generate(), stream() or tokenize())"
        )
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise InvalidInputError(f"{what} must be 1-D, got an array of shape {token_ids.shape}")
        if not np.issubdtype(token_ids.dtype, np.integer):
            raise InvalidInputError(f"{what} must hold integers, got dtype {token_ids.dtype}")
        # Python ints from here on, checked one by one as a list's are.
        token_ids = token_ids.tolist()
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
        v = int(t)
        # Ids past 32 bits cannot be in any vocabulary (and do not fit the
        # extension's integers): the same error the vocabulary check gives.
        if not 0 <= v < _ID_LIMIT:
            raise InvalidInputError(f"{what}[{i}] = {v} is out of range")
        out.append(v)
    return out


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when generation stops (frozen; see :meth:`replace`).

    Attributes:
        max_new_tokens: most tokens to generate.
        temperature: 0 = greedy (argmax); otherwise the softmax temperature.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the most likely tokens holding this much probability (1 = off).
        min_p: drop tokens less likely than ``min_p`` times the most likely (0 = off).
        repetition_penalty: transformers' penalty on every token of prompt and output (1 = off).
        presence_penalty, frequency_penalty: OpenAI's penalties on generated tokens (0 = off).
        seed: makes sampling reproducible whatever the thread count; ``None`` = a fresh random seed.
        stop: strings that end the output (not included in the text), also spanning tokens.
        stop_token_ids: ids that end the output (kept in the ids, never in the text).
        ignore_eos: do not stop on the model's end-of-sequence ids.
        skip_special_tokens: leave special tokens out of the returned text.
        logprobs: record for every generated token its log-probability and the
            ``logprobs`` (0 to 20) most likely tokens at its position (under the
            model's distribution, before temperature, penalties and truncation).
        json_schema: constrain the output to JSON valid against this JSON Schema
            (a dict, or its JSON text); written compactly (``{"a": 1, "b": 2}``)
            unless the schema's ``x-guidance`` entry asks for other separators.
        regex: constrain the output to text matching this regular expression
            (Rust ``regex`` syntax), whole.
        grammar: constrain the output to this grammar, in llguidance's Lark
            syntax (``start: ...``; ``%json {...}`` embeds a JSON Schema).
        speculative: ``"ngram"`` drafts up to ``draft_tokens`` tokens a step
            from an earlier occurrence of the text's last few tokens (prompt
            lookup); ``"mtp"`` drafts them with the model's own
            multi-token-prediction layer (a file converted with
            ``keep_mtp``; :attr:`Engine.has_mtp`); either way they are
            verified in one forward pass. ``None`` (default): one token per
            pass. The output is the same token for token, greedy or seeded;
            n-gram drafts pay where the output repeats its input, MTP drafts
            wherever the layer predicts well.
        draft_tokens: most tokens drafted per step, 1 to 16 (default 4).
        prediction: what the output is expected to be, mostly (a text, or
            token ids): the file an edit rewrites, say, as OpenAI's predicted
            outputs. Drafts are also taken from it, so the output comes
            faster where it agrees; it changes no token. Turns on
            ``speculative="ngram"`` unless ``speculative`` says otherwise.

    At most one of ``json_schema``, ``regex`` and ``grammar``: the engine masks
    every token the constraint does not allow before sampling, so greedy
    output always follows it; it ends with finish reason ``"stop"`` when the
    constraint is complete, ``"length"`` when ``max_new_tokens`` cut it short.
    A constraint the engine cannot compile, or one that matches no text, is
    an :class:`InvalidInputError` when the generation starts.

    ``None`` in any of the first eight fields takes the model's default.
    Values are checked when the object is made: a bad one is an
    :class:`InvalidInputError` naming the field.
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    json_schema: str | Mapping[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    speculative: str | None = None
    draft_tokens: int = 4
    prediction: str | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        for name in _INTS:
            v = getattr(self, name)
            if v is not None:
                if not _is_int(v) or v < 0:
                    raise InvalidInputError(f"{name} must be an integer >= 0, got {v!r}")
                set_(self, name, min(int(v), 2**32))  # the context bounds both long before that
        for name in _FLOATS:
            v = getattr(self, name)
            if v is not None:
                if not _is_number(v):
                    raise InvalidInputError(f"{name} must be a number, got {v!r}")
                set_(self, name, float(v))
        seed = self.seed
        if seed is not None:
            if not _is_int(seed) or not 0 <= seed < 2**64:
                raise InvalidInputError(f"seed must be an integer in [0, 2**64), got {seed!r}")
            set_(self, "seed", int(seed))
        stop: Any = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            raise InvalidInputError(f"stop must be a string or a list of strings, got {stop!r}")
        set_(self, "stop", stop)
        set_(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "skip_special_tokens"):
            set_(self, name, bool(getattr(self, name)))
        lp = self.logprobs
        if lp is not None:
            if not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS:
                raise InvalidInputError(
                    f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {lp!r}"
                )
            set_(self, "logprobs", int(lp))
        schema = self.json_schema
        if schema is not None:
            if isinstance(schema, str):
                try:
                    parsed = json.loads(schema)
                except ValueError as e:
                    raise InvalidInputError(f"json_schema: not valid JSON: {e}") from None
            elif isinstance(schema, Mapping):
                parsed = dict(schema)
            elif isinstance(schema, bool):
                parsed = schema
            else:
                raise InvalidInputError(
                    f"json_schema must be a dict or its JSON text, got {type(schema).__name__}"
                )
            if not isinstance(parsed, (dict, bool)):
                raise InvalidInputError(f"json_schema must be a JSON object, got {parsed!r}")
            try:
                # Stored as JSON text: the params stay hashable and the engine takes text.
                set_(self, "json_schema", json.dumps(parsed))
            except (TypeError, ValueError) as e:
                raise InvalidInputError(f"json_schema: cannot be written as JSON: {e}") from None
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise InvalidInputError(f"{name} must be a string, got {type(v).__name__}")
        given = [n for n in _CONSTRAINTS if getattr(self, n) is not None]
        if len(given) > 1:
            raise InvalidInputError(
                f"give at most one of json_schema, regex and grammar, got {' and '.join(given)}"
            )
        if self.speculative not in (None, "ngram", "mtp"):
            raise InvalidInputError(f'speculative must be "ngram", "mtp" or None, got {self.speculative!r}')
        guess = self.prediction
        if guess is not None:
            if not isinstance(guess, str):
                set_(self, "prediction", tuple(_as_ids(guess, "prediction")))
            if self.speculative is None:
                set_(self, "speculative", "ngram")
        if not _is_int(self.draft_tokens) or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidInputError(
                f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {self.draft_tokens!r}"
            )

    @property
    def constrained(self) -> bool:
        """Whether a JSON Schema, a regex or a grammar constrains the output."""
        return any(getattr(self, n) is not None for n in _CONSTRAINTS)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (checked as the constructor checks them)."""
        unknown = sorted(set(changes) - _FIELDS)
        if unknown:
            raise TypeError(f"SamplingParams has no field {unknown[0]!r}")
        return dataclasses.replace(self, **changes)

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """Every ``None`` of the first eight fields filled from ``defaults``
        (the model's generation defaults); the seed drawn at random if unset."""
        filled = {n: defaults[n] for n in (*_INTS, *_FLOATS) if getattr(self, n) is None and n in defaults}
        if self.seed is None:
            filled["seed"] = random.SystemRandom().getrandbits(64)
        return self.replace(**filled) if filled else self

    def native(self) -> dict[str, Any]:
        """The keywords of the native ``start`` call (after :meth:`with_defaults`)."""
        out = {n: getattr(self, n) for n in (*_INTS, *_FLOATS, "seed", "logprobs")}
        missing = [n for n, v in out.items() if v is None and n != "logprobs"]
        if missing:
            raise InvalidInputError(f"{missing[0]} has no value and the model gives no default")
        out.update({n: getattr(self, n) for n in _CONSTRAINTS if getattr(self, n) is not None})
        if self.speculative is not None:
            out.update(speculative=self.speculative, draft_tokens=self.draft_tokens)
        return out


class SamplingOptions(TypedDict, total=False):
    """The fields of :class:`SamplingParams` as keyword arguments (for typing ``**options``)."""

    max_new_tokens: int | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    skip_special_tokens: bool
    logprobs: int | None
    json_schema: str | Mapping[str, Any] | None
    regex: str | None
    grammar: str | None
    speculative: str | None
    draft_tokens: int
    prediction: str | Sequence[int] | None


_CONSTRAINTS = ("json_schema", "regex", "grammar")
_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params(sampling: SamplingParams | None, options: Mapping[str, Any], call: str) -> SamplingParams:
    """``sampling`` (or the defaults) with the keyword ``options`` of a call applied."""
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise InvalidInputError(f"{call}: sampling must be a SamplingParams, got {type(sampling).__name__}")
    unknown = sorted(set(options) - _FIELDS)
    if unknown:
        raise TypeError(f"{call}() got an unexpected keyword argument {unknown[0]!r}")
    base = sampling or SamplingParams()
    return base.replace(**options) if options else base


def _token_ids(v: Any) -> tuple[int, ...]:
    return tuple(_as_ids(() if v is None else v, "stop_token_ids"))


__all__ = ["MAX_TOP_LOGPROBS", "SamplingOptions", "SamplingParams"]
