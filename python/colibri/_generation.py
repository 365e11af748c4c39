"""Generation results and the per-call driver that turns native token steps
into text: incremental detokenisation, stop strings, finish reasons, timings.

The native side (``NativeGeneration``) receives the engine scheduler's tokens,
waiting for each with the GIL released; everything here runs between tokens,
which is also where a KeyboardInterrupt lands.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar, Union

from ._text import IncrementalDetokenizer, StopMatcher, TextCodec
from ._tools import ToolCall

T = TypeVar("T", str, int)


@dataclass(frozen=True)
class Timings:
    """Counts and wall-clock times of one generation."""

    prompt_tokens: int
    """Tokens in the prompt."""
    generated_tokens: int
    """Tokens generated (including a final end-of-sequence token)."""
    prefill_seconds: float
    """Time to run the prompt and choose the first token."""
    decode_seconds: float
    """Time to produce every later token."""
    cached_tokens: int = 0
    """Of the prompt's tokens, those whose state came from the prefix cache
    instead of being computed (``Engine(prefix_cache=...)``)."""
    drafted_tokens: int = 0
    """Tokens drafted by speculative decoding (``speculative=``)."""
    accepted_tokens: int = 0
    """Of them, those the model's own choice confirmed."""
    decode_passes: int = 0
    """Forward passes after the first token (fewer than the tokens when drafts were confirmed)."""

    @property
    def acceptance_rate(self) -> float:
        """Share of the drafted tokens confirmed (0 without drafts)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens after the first per forward pass (1 without speculation)."""
        steps = self.generated_tokens - 1
        return steps / self.decode_passes if self.decode_passes else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prompt tokens computed per second of prefill (those from the prefix
        cache not counted; 0 if nothing was run)."""
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second after the first (which prefill produced); 0 with fewer than two."""
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    def __str__(self) -> str:
        text = (
            f"prompt {self.prompt_tokens} tokens ({self.prefill_tokens_per_second:.1f} tok/s), "
            f"generated {self.generated_tokens} tokens ({self.decode_tokens_per_second:.1f} tok/s)"
        )
        if self.cached_tokens:
            text += f", {self.cached_tokens} prompt tokens from the prefix cache"
        if self.drafted_tokens:
            text += (
                f", {self.accepted_tokens} of {self.drafted_tokens} drafts confirmed "
                f"({self.tokens_per_pass:.2f} tokens per pass)"
            )
        return text


class TokenLogprob(NamedTuple):
    """One generated token's log-probability under the model's distribution
    (softmax of its logits, before temperature, penalties or truncation) and
    the most likely tokens at that position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Completion(str):
    """Generated text: a ``str``, with what produced it.

    Attributes:
        token_ids: every generated token id (a final end-of-sequence id included).
        finish_reason: ``"stop"`` (an end-of-sequence id, a stop id or a stop
            string), ``"length"`` (``max_new_tokens`` or the context was reached),
            or ``None`` for a stream closed before its end.
        stop_reason: the stop string or token id that ended it, else ``None``.
        timings: :class:`Timings`.
        logprobs: one :class:`TokenLogprob` per token id when ``logprobs``
            was asked for, else ``None``.
        reasoning_content: from :meth:`Engine.chat` with a model that
            reasons (``<think>`` templates, GPT-OSS's analysis channel): its
            reasoning, apart from the answer (the ``str`` itself); else ``None``.
        tool_calls: from :meth:`Engine.chat` given ``tools``: the calls the
            model made (:class:`ToolCall`, arguments as JSON text); ``finish_reason``
            is then ``"tool_calls"``. Empty otherwise.
    """

    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    timings: Timings
    logprobs: list[TokenLogprob] | None
    reasoning_content: str | None
    tool_calls: list[ToolCall]

    def __new__(
        cls,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        stop_reason: str | int | None,
        timings: Timings,
        logprobs: list[TokenLogprob] | None = None,
        reasoning_content: str | None = None,
        tool_calls: list[ToolCall] | None = None,
    ) -> Completion:
        self = super().__new__(cls, text)
        self.token_ids = token_ids
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.timings = timings
        self.logprobs = logprobs
        self.reasoning_content = reasoning_content
        self.tool_calls = list(tool_calls or [])
        return self

    @property
    def text(self) -> str:
        """The text as a plain ``str``."""
        return str.__str__(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # str's own pickling would call __new__ with the text alone.
        args = (
            self.text,
            self.token_ids,
            self.finish_reason,
            self.stop_reason,
            self.timings,
            self.logprobs,
            self.reasoning_content,
            self.tool_calls,
        )
        return (Completion, args)

    def __repr__(self) -> str:
        return f"Completion({str.__repr__(self)}, finish_reason={self.finish_reason!r})"


class TokenCompletion(list):  # type: ignore[type-arg]
    """Generated token ids: a ``list`` of int, with ``finish_reason``,
    ``stop_reason``, ``timings`` and ``logprobs`` as :class:`Completion` has them."""

    finish_reason: str | None
    stop_reason: str | int | None
    timings: Timings
    logprobs: list[TokenLogprob] | None

    def __init__(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        stop_reason: str | int | None,
        timings: Timings,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        super().__init__(token_ids)
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.timings = timings
        self.logprobs = logprobs

    def __repr__(self) -> str:
        return f"TokenCompletion({list.__repr__(self)}, finish_reason={self.finish_reason!r})"


Result = Union[Completion, TokenCompletion]


class Stream(Generic[T]):
    """An iterator over a generation as it is produced: text pieces for a text
    prompt, token ids for a token-id prompt.

    After the last piece, ``finish_reason``, ``stop_reason``, ``timings``,
    ``token_ids`` and ``result()`` tell how it went. Leaving the loop early (or
    ``close()``) stops the generation; ``finish_reason`` then stays ``None``.
    Usable as a context manager, which closes it.
    """

    def __init__(
        self,
        native: Any,
        *,
        codec: TextCodec | None,
        text_mode: bool,
        stop: Sequence[str],
        skip_special_tokens: bool,
        context: Sequence[int] = (),
        logprobs: bool = False,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        self._native = native
        # The ids a "stop" ends on; None: every id that ends a generation is
        # one. (A constrained generation also ends, on an ordinary token,
        # when its constraint is complete.)
        self._stop_ids = None if stop_ids is None else frozenset(stop_ids)
        self._logprobs = logprobs
        self._text_mode = text_mode
        self._detok = None if codec is None else IncrementalDetokenizer(codec, skip_special_tokens, context)
        self._matcher = StopMatcher(stop) if stop else None
        self._pieces: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._it: Generator[Any, None, None] = self._run()

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        return next(self._it)  # type: ignore[no-any-return]

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops the generation (nothing more is computed)."""
        self._it.close()

    def cancel(self) -> None:
        """Stops the generation from any thread, also while another thread
        waits in ``next()``: the iteration ends at once, ``finish_reason``
        stays ``None``."""
        self._native.cancel()

    @property
    def token_ids(self) -> list[int]:
        """Every token generated so far (a fresh list)."""
        return list(self._native.token_ids)

    @property
    def num_tokens(self) -> int:
        """How many tokens were generated so far (``len(token_ids)``, without copying them)."""
        return int(self._native.num_tokens)

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One :class:`TokenLogprob` per token so far, when the generation
        was started with ``logprobs``; else ``None``."""
        return self.logprobs_from(0)

    def logprobs_from(self, start: int) -> list[TokenLogprob] | None:
        """Those of the tokens from index ``start`` on."""
        if not self._logprobs:
            return None
        ids = self._native.token_ids
        rows = self._native.logprobs(start)
        return [TokenLogprob(t, lp, top) for t, (lp, top) in zip(ids[start:], rows)]

    @property
    def text(self) -> str:
        """The text emitted so far (for a text prompt)."""
        return "".join(self._pieces)

    @property
    def timings(self) -> Timings:
        """Counts and times so far."""
        return Timings(*self._native.timings())

    def result(self) -> Result:
        """Runs the generation to its end and returns the whole result."""
        for _ in self:
            pass
        reason = self.finish_reason
        lps = self.logprobs
        if self._text_mode:
            return Completion(self.text, self.token_ids, reason, self.stop_reason, self.timings, lps)
        return TokenCompletion(self.token_ids, reason, self.stop_reason, self.timings, lps)

    def _text(self, piece: str) -> str:
        """Passes decoded text through the stop matcher; records what is emitted."""
        if self._matcher is not None and piece:
            piece = self._matcher.push(piece)
        if piece:
            self._pieces.append(piece)
        return piece

    def _stopped_by_string(self) -> bool:
        if self._matcher is None or self._matcher.matched is None:
            return False
        self.finish_reason, self.stop_reason = "stop", self._matcher.matched
        return True

    def _run(self) -> Generator[Any, None, None]:
        try:
            yield from self._steps()
        finally:
            # Ended by a stop string, closed early or failed: the scheduler
            # frees the place (a no-op once the native side has finished).
            self._native.cancel()

    def _steps(self) -> Generator[Any, None, None]:
        native, detok = self._native, self._detok
        for tok in native:
            if native.finish_reason == "stop" and (self._stop_ids is None or tok in self._stop_ids):
                # An end-of-sequence or stop id: kept in the ids, never in the text.
                self.stop_reason = tok
                if not self._text_mode:
                    yield tok
                break
            if not self._text_mode:
                yield tok
            if detok is None:
                continue
            out = self._text(detok.push(tok))
            if self._text_mode and out:
                yield out
            if self._stopped_by_string():
                return
        if detok is not None:
            out = self._text(detok.flush())
            if not self._stopped_by_string() and self._matcher is not None:
                rest = self._matcher.flush()
                if rest:
                    self._pieces.append(rest)
                    out += rest
            if self._text_mode and out:
                yield out
            if self.finish_reason is not None:
                return
        self.finish_reason = native.finish_reason
