"""An OpenAI-compatible HTTP server over one :class:`~colibri.Engine`.

``colibri serve MODEL`` (or :func:`serve`) answers ``/v1/chat/completions``,
``/v1/completions`` (both streaming as server-sent events or not),
Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``,
``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text). Chat requests
take ``tools``: they are rendered through the model's chat template and the
calls the model writes in its family's syntax come back as ``tool_calls``
(``tool_use`` blocks), its reasoning as ``reasoning_content`` (``thinking``
blocks); see :mod:`colibri._tools` and :mod:`colibri._anthropic`. Every request
becomes one or more generations on the engine's scheduler, so concurrent
clients share steps: the weights are read once per step for all of them.

Needs the ``serve`` extra (``pip install 'colibri-moe[serve]'``): Starlette,
uvicorn and prometheus_client.

Each generation runs in a pump thread that iterates its
:class:`~colibri.Stream` and hands the pieces to the event loop; a client that
disconnects cancels its generations at the next token.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from . import _anthropic
from ._errors import BusyError, ColibriError, ContextLengthError, InvalidInputError
from ._sampling import MAX_DRAFT_TOKENS, MAX_TOP_LOGPROBS, SamplingParams
from ._tools import Delta

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"colibri's server needs the 'serve' extra: pip install 'colibri-moe[serve]' (missing: {e.name})"
    ) from e

__all__ = ["create_app", "serve"]

#: Largest request body accepted (bytes); a larger one is answered 413.
MAX_BODY = 8 << 20
#: Most choices one request may ask for (``n``).
MAX_N = 16
#: Most stop strings (OpenAI's limit).
MAX_STOP = 4
#: Most alternatives per token in ``top_logprobs`` (OpenAI's limit).
#: Routed tokens the dashboard's heat map and the router-health metrics
#: cover (the most recent ones).
ROUTING_WINDOW = 1024

# Fields each endpoint takes; anything else is a 400 naming the field.
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "user",
    # vLLM's extra sampling fields.
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    # colibri's: speculative decoding for this request.
    "speculative",
    "draft_tokens",
    # Accepted and ignored: they change nothing a local server does.
    "metadata",
    "store",
    "service_tier",
    "logit_bias",
}
_CHAT = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "chat_template_kwargs",
    # Taken in their no-op forms (what some clients send by default); the
    # forms that ask for something this server does not do are 400s.
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    # OpenAI's predicted outputs: drafts for speculative decoding.
    "prediction",
}
_COMPLETION = _COMMON | {"prompt", "echo", "suffix", "best_of", "return_token_ids"}


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


# ----------------------------------------------------------------------
# Request parsing: one function per field kind, each naming the field.


def _int(body: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"must be an integer, got {json.dumps(v)}")
    if v < low or (high is not None and v > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise _bad(name, f"must be {bound}, got {v}")
    return v


def _float(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise _bad(name, f"must be a number, got {json.dumps(v)}")
    if not low <= v <= high:
        raise _bad(name, f"must be between {low} and {high}, got {v}")
    return float(v)


def _bool(body: Mapping[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad(name, f"must be true or false, got {json.dumps(v)}")
    return v


def _stops(body: Mapping[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise _bad("stop", "must be a non-empty string or a list of them")
    if len(v) > MAX_STOP:
        raise _bad("stop", f"at most {MAX_STOP} stop strings, got {len(v)}")
    return list(v)


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _no_parser() -> None:
    return None


@dataclass
class Job:
    """What one request asks: its prompts, how many choices each, the options."""

    prompts: list[Any]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    prompt_field: str
    options: dict[str, Any] = field(default_factory=dict)
    #: vLLM's extra: each choice also carries its generated token ids.
    return_token_ids: bool = False
    #: The field that set the number of tokens, None when it is the default.
    length_field: str | None = None
    #: False: only the first tool call a choice makes is kept (``parallel_tool_calls``).
    parallel_calls: bool = True
    #: Makes each choice's tool-call / reasoning parser (None: plain text).
    make_parser: Callable[[], Any] = field(default=lambda: _no_parser())
    #: The request field a constraint (json_schema / grammar option) came from.
    constraint_field: str = "response_format"


def _prediction(p: Any) -> str:
    """The text of OpenAI's ``prediction`` field (``{"type": "content",
    "content": text or text parts}``)."""
    content = p.get("content") if isinstance(p, dict) and p.get("type") == "content" else None
    if isinstance(content, list) and all(
        isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content
    ):
        content = "".join(c["text"] for c in content)
    if not isinstance(content, str):
        raise _bad("prediction", 'must be {"type": "content", "content": a string or text parts}')
    return content


def _parse(
    body: Any, allowed: set[str], chat: bool, engine: Any, model_name: str, call_id: Any = None
) -> Job:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(unknown[0], "unknown field")
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )
    if body.get("logit_bias"):
        raise _bad("logit_bias", "is not supported")
    for name in ("echo", "suffix"):
        if body.get(name):
            raise _bad(name, "is not supported")
    constraint = _response_format(body) if chat else {}
    parallel = _bool(body, "parallel_tool_calls") is not False
    _int(body, "best_of", 1, 1)  # checked only: 1, the default, is all there is
    n = _int(body, "n", 1, MAX_N) or 1
    stream = bool(_bool(body, "stream"))
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options", "must be an object with include_usage")
        if not stream:
            raise _bad("stream_options", "is only allowed with stream: true")
    include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
    # Tokens to generate: absent means up to the context (chat) or 16
    # (completions), as OpenAI's endpoints default; a number given must
    # leave room for itself after the prompt (checked once it is tokenised).
    fields = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    length_field = next((f for f in fields if body.get(f) is not None), None)
    max_tokens = _int(body, length_field, 1) if length_field else None
    if max_tokens is None:
        max_tokens = engine.context_length if chat else 16
    opts: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": _float(body, "temperature", 0.0, 2.0),
        "top_p": _float(body, "top_p", 0.0, 1.0),
        "presence_penalty": _float(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _float(body, "frequency_penalty", -2.0, 2.0),
        "top_k": _int(body, "top_k", -1, 1 << 31),
        "min_p": _float(body, "min_p", 0.0, 1.0),
        "repetition_penalty": _float(body, "repetition_penalty", 1e-3, 100.0),
        "seed": _int(body, "seed", -(1 << 63), (1 << 64) - 1),
        "stop": _stops(body),
        "ignore_eos": bool(_bool(body, "ignore_eos")),
        "stop_token_ids": None,
        "skip_special_tokens": True,
    }
    if opts["top_k"] == -1:  # vLLM's spelling of "off"
        opts["top_k"] = 0
    if "speculative" in body:
        spec = body["speculative"]
        if spec not in (None, "ngram", "mtp"):
            raise _bad("speculative", 'must be "ngram", "mtp" or null')
        opts["speculative"] = spec
    draft = _int(body, "draft_tokens", 1, MAX_DRAFT_TOKENS)
    if draft is not None:
        opts["draft_tokens"] = draft
    if body.get("prediction") is not None:
        opts["prediction"] = _prediction(body["prediction"])
    if opts["seed"] is not None and opts["seed"] < 0:
        opts["seed"] += 1 << 64
    skip = _bool(body, "skip_special_tokens")
    if skip is not None:
        opts["skip_special_tokens"] = skip
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.vocab_size for t in stop_ids
        ):
            raise _bad("stop_token_ids", "must be a list of token ids in the vocabulary")
        opts["stop_token_ids"] = stop_ids
    logprobs: int | None = None
    if chat:
        if _bool(body, "logprobs"):
            logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        elif body.get("top_logprobs") is not None:
            raise _bad("top_logprobs", "needs logprobs: true")
    else:
        logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    make_parser: Callable[[], Any] = _no_parser
    constraint_field = "response_format"
    if chat:
        ids, make_parser, forced = _render(body, engine, call_id, parallel)
        if forced and constraint:
            raise _bad("response_format", "cannot be JSON while tool_choice forces a tool call")
        if forced:
            constraint, constraint_field = forced, "tool_choice"
        prompts: list[Any] = [ids]
    else:
        prompts = _prompts(body)
    if len(prompts) * n > MAX_N:
        raise _bad("n", f"{len(prompts)} prompts x n={n} asks {len(prompts) * n} choices; at most {MAX_N}")
    job = Job(prompts, n, stream, include_usage, logprobs, "messages" if chat else "prompt", opts)
    job.make_parser = make_parser
    job.parallel_calls = parallel
    job.options.update(constraint)
    job.constraint_field = constraint_field
    if make_parser() is not None:
        # Tool-call and reasoning markers can be special tokens: the parser
        # reads them, and drops the end-of-sequence and padding texts.
        opts["skip_special_tokens"] = False
    job.return_token_ids = bool(_bool(body, "return_token_ids"))
    job.length_field = length_field
    if not engine.has_tokenizer and not (job.return_token_ids and all(_token_ids(p) for p in prompts)):
        raise APIError(
            400,
            "this model has no tokenizer: give the prompt as token ids and set return_token_ids: true",
            param="prompt",
        )
    return job


def _response_format(body: Mapping[str, Any]) -> dict[str, Any]:
    """The constraint ``response_format`` asks for: none for ``text``, any
    JSON object for ``json_object``, the given schema for ``json_schema``
    (strict or not, the output is constrained to it)."""
    fmt = body.get("response_format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _bad("response_format", 'must be an object with a type, such as {"type": "text"}')
    kind = fmt["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise _bad("response_format", 'json_schema must be an object {"name": ..., "schema": {...}}')
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise _bad("response_format", "json_schema.schema must be a JSON Schema object")
        return {"json_schema": schema}
    raise _bad("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _field_error(e: InvalidInputError, default: str) -> APIError:
    """A 400 naming the field a message starts with (``tools[0].function.name: ...``)."""
    text = str(e)
    head = text.split(":", 1)[0]
    param = head if re.fullmatch(r"[A-Za-z_]+(\[\d+\]|\.[A-Za-z_]+)*", head) else default
    return APIError(400, text if param != default or head == default else f"{default}: {text}", param=param)


def _render(
    body: Mapping[str, Any], engine: Any, call_id: Any = None, parallel: bool = True
) -> tuple[list[int], Callable[[], Any], dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):
            # The parts form: only text parts can be given to a text model.
            texts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise _bad(f"messages[{i}].content", "only text parts are supported")
                texts.append(part["text"])
            messages[i] = {**m, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    tools = body.get("tools")
    if tools == []:
        tools = None  # what some clients send for none
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, (str, dict)):
        raise _bad("tool_choice", "must be 'none', 'auto', 'required' or a named function")
    try:
        text, make_parser, constraint = engine._prepare_chat(
            messages,
            tools=tools,
            tool_choice=choice,
            chat_template_kwargs=kwargs,
            call_id=call_id,
            parallel_tool_calls=parallel,
        )
    except InvalidInputError as e:
        raise _field_error(e, "messages") from e
    return list(engine.tokenize(text, add_special_tokens=False)), make_parser, constraint


def _prompts(body: Mapping[str, Any]) -> list[Any]:
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if _token_ids(p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return list(p)
    if isinstance(p, list) and p and all(_token_ids(x) for x in p):
        return list(p)
    raise _bad("prompt", "must be a string, a list of strings, a list of token ids or a list of those")


# ----------------------------------------------------------------------
# Running generations: one pump thread per choice.


#: Tokens before a log-probability entry that its token is decoded after.
_LOGPROB_CONTEXT = 4


@dataclass
class _Choice:
    index: int
    prompt_tokens: int = 0
    #: Of them, tokens whose state came from the prefix cache.
    cached_tokens: int = 0
    #: The last few ids before the next log-probability entry to show: its
    #: token is decoded after them, keeping the space a tokenizer drops from
    #: the start of a text ("▁Paris" is " Paris" after a word, "Paris" alone).
    recent: list[int] = field(default_factory=list)
    #: ``text_offset`` of the next completions entry.
    lp_offset: int = 0
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    first_token: float | None = None
    token_ids: list[int] = field(default_factory=list)
    #: (token id, logprob, top alternatives) per token, when asked for.
    logprobs: list[Any] = field(default_factory=list)
    #: The stop string or token id that ended it.
    stop_reason: str | int | None = None
    #: Splits the text into answer, reasoning and tool calls (None: plain text).
    parser: Any = None
    reasoning: str = ""
    tool_calls: list[Any] = field(default_factory=list)

    @property
    def finish(self) -> str | None:
        """OpenAI's finish_reason: ``tool_calls`` when the model ended after calling."""
        if self.tool_calls and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason


class _Run:
    """The generations of one request, fed to the event loop as
    ``(choice, piece)`` events (``piece`` None when a choice ends)."""

    def __init__(
        self,
        engine: Any,
        job: Job,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[tuple[int, Any, Any]],
        metrics: _Metrics,
    ) -> None:
        # The queue is made on the event loop's thread: this runs in a worker
        # thread, where Python 3.9's Queue() finds no loop to bind to.
        self.job, self.loop, self.queue, self.metrics, self.engine = job, loop, queue, metrics, engine
        self.choices: list[_Choice] = []
        self.streams: list[Any] = []
        self.started = time.perf_counter()
        try:
            ids = [engine.tokenize(p) if isinstance(p, str) else list(p) for p in job.prompts]
        except InvalidInputError as e:
            raise _bad(job.prompt_field, str(e)) from e
        ctx = engine.context_length
        for p in ids:
            if not p:
                raise _bad(job.prompt_field, "is empty: it gives no tokens")
            if len(p) >= ctx:
                raise APIError(
                    400,
                    f"This model's maximum context length is {ctx} tokens; the prompt has {len(p)}",
                    param=job.prompt_field,
                    code="context_length_exceeded",
                )
            want = job.options["max_new_tokens"]
            if job.length_field is not None and len(p) + want > ctx:
                raise APIError(
                    400,
                    f"This model's maximum context length is {ctx} tokens; the prompt has {len(p)} "
                    f"and {job.length_field} asks {want} more",
                    param=job.length_field,
                    code="context_length_exceeded",
                )
            bad = next((t for t in p if not 0 <= t < engine.vocab_size), None)
            if bad is not None:
                raise _bad(
                    job.prompt_field, f"token id {bad} is not in the vocabulary of {engine.vocab_size}"
                )
        try:
            for k, p in enumerate(ids):
                for j in range(job.n):
                    opts = dict(job.options)
                    if opts.get("seed") is not None:
                        opts["seed"] = (opts["seed"] + j) % (1 << 64)
                    # Token ids in, text pieces out.
                    # (A model without a tokenizer: ids out, no text.)
                    stream = engine._start(
                        p,
                        SamplingParams(**opts, logprobs=job.logprobs),
                        text_out=engine.has_tokenizer,
                        add_special_tokens=False,
                    )
                    self.streams.append(stream)
                    self.choices.append(
                        _Choice(
                            index=k * job.n + j,
                            prompt_tokens=len(p),
                            recent=list(p[-_LOGPROB_CONTEXT:]),
                            parser=job.make_parser(),
                        )
                    )
        except BusyError as e:
            self.cancel()
            raise APIError(
                429, str(e), type="rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"}
            ) from e
        except ContextLengthError as e:
            self.cancel()
            raise APIError(400, str(e), param=job.prompt_field, code="context_length_exceeded") from e
        except InvalidInputError as e:
            self.cancel()
            # The engine's checks start their messages with the option's name.
            name = str(e).split(" ", 1)[0]
            if name.rstrip(":") in ("json_schema", "regex", "grammar"):
                # A constraint the engine could not compile: the field it came from.
                raise APIError(400, f"{job.constraint_field}: {e}", param=job.constraint_field) from e
            raise APIError(400, str(e), param=name if name in _COMMON else None) from e
        for c, s in zip(self.choices, self.streams):
            threading.Thread(target=self._pump, args=(c, s), daemon=True, name="colibri-pump").start()

    def _pump(self, choice: _Choice, stream: Any) -> None:
        """Iterates one stream's text pieces onto the event loop, each with
        the log-probabilities of its new tokens (None unless asked for)."""
        put = self.loop.call_soon_threadsafe
        want_lps = self.job.logprobs is not None
        try:
            last, sent = self.started, 0
            for piece in stream:
                now, n = time.perf_counter(), stream.num_tokens
                if choice.first_token is None and n:
                    choice.first_token = now
                    choice.cached_tokens = stream.timings.cached_tokens
                    self.metrics.ttft.observe(now - self.started)
                    self.metrics.monitor.ttfts.append(now - self.started)
                elif n > choice.tokens:
                    # A piece can hold several tokens: their mean gap.
                    gap = (now - last) / (n - choice.tokens)
                    for _ in range(n - choice.tokens):
                        self.metrics.tpot.observe(gap)
                last, choice.tokens = now, n
                lps = stream.logprobs_from(sent) if want_lps else None
                sent += len(lps or ())
                text = piece if isinstance(piece, str) else ""
                out: Any = text if choice.parser is None else self._calls_kept(choice.parser.feed(text))
                if self.job.stream:
                    if out or lps or choice.parser is None:
                        put(self.queue.put_nowait, (choice.index, out, lps))
                else:
                    # Nobody waits for the pieces: the loop is woken once, at
                    # the end (every wake-up takes a core from the compute).
                    if choice.parser is None:
                        choice.text += text
                    choice.logprobs.extend(lps or ())
            choice.token_ids = stream.token_ids
            choice.tokens = len(choice.token_ids)
            choice.cached_tokens = stream.timings.cached_tokens
            choice.finish_reason = stream.finish_reason
            choice.stop_reason = stream.stop_reason
            if choice.parser is not None:
                held = self._calls_kept(choice.parser.finish())
                if self.job.stream and held:
                    put(self.queue.put_nowait, (choice.index, held, None))
                choice.text = choice.parser.content
                choice.reasoning = choice.parser.reasoning
                choice.tool_calls = choice.parser.tool_calls[: None if self.job.parallel_calls else 1]
            # The last tokens may have brought no text (a stop id).
            rest = stream.logprobs_from(sent) if want_lps else None
            if not self.job.stream:
                choice.logprobs.extend(rest or ())
                rest = None
            put(self.queue.put_nowait, (choice.index, None, rest))
        except BaseException as e:  # delivered to the request, never lost in a thread
            put(self.queue.put_nowait, (choice.index, e, None))

    def _calls_kept(self, d: Delta) -> Delta:
        if not self.job.parallel_calls:
            d.calls = [c for c in d.calls if c.index == 0]
        return d

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()

    async def events(self) -> AsyncIterator[tuple[_Choice, str | None, list[Any] | None]]:
        """Each choice's pieces as they come, then ``(choice, None, ...)`` at
        its end; the third item holds the new tokens' log-probabilities."""
        left = len(self.choices)
        while left:
            i, piece, lps = await self.queue.get()
            if isinstance(piece, BaseException):
                self.cancel()
                if isinstance(piece, ColibriError):
                    raise APIError(500, f"generation failed: {piece}", type="server_error") from piece
                raise piece
            if piece is None:
                left -= 1
            if lps:
                self.choices[i].logprobs.extend(lps)
            yield self.choices[i], piece, lps

    def _texts(self, choice: _Choice, lps: list[Any]) -> list[tuple[str, list[tuple[str, float]]]]:
        """Each entry's token and alternatives as text, decoded after the
        tokens before it so the texts join to the completion; ``token_id:N``
        for a model without a tokenizer (vLLM's spelling). Entries are shown
        once each, in order: this moves the choice's context past them."""
        out = []
        for t in lps:
            if not self.engine.has_tokenizer:
                out.append((f"token_id:{t.token_id}", [(f"token_id:{i}", v) for i, v in t.top]))
                continue
            ctx = choice.recent
            base = str(self.engine.detokenize(ctx))
            top = [(self._after(ctx, base, i), v) for i, v in t.top]
            out.append((self._after(ctx, base, t.token_id), top))
            choice.recent = [*ctx, t.token_id][-_LOGPROB_CONTEXT:]
        return out

    def _after(self, ctx: list[int], base: str, token_id: int) -> str:
        """The text ``token_id`` adds after the tokens ``ctx`` (whose text is ``base``)."""
        full = str(self.engine.detokenize([*ctx, token_id]))
        return full[len(os.path.commonprefix([base, full])) :]

    def chat_logprobs(self, choice: _Choice, lps: list[Any]) -> dict[str, Any]:
        """OpenAI's chat form: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

        def entry(text: str, lp: float) -> dict[str, Any]:
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

        content = [
            {**entry(text, t.logprob), "top_logprobs": [entry(a, v) for a, v in top]}
            for t, (text, top) in zip(lps, self._texts(choice, lps))
        ]
        return {"content": content, "refusal": None}

    def completion_logprobs(self, choice: _Choice, lps: list[Any]) -> dict[str, Any]:
        """The legacy completions form: parallel lists, each token's offset
        in the completion's text (the texts join to it)."""
        texts = self._texts(choice, lps)
        offsets = []
        for text, _ in texts:
            offsets.append(choice.lp_offset)
            choice.lp_offset += len(text)
        return {
            "tokens": [text for text, _ in texts],
            "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [dict(top) for _, top in texts],
            "text_offset": offsets,
        }

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: prompt tokens once per prompt (``n`` choices share
        it), of them those the prefix cache served, and the tokens generated."""
        prompt = sum(c.prompt_tokens for c in self.choices[:: self.job.n])
        cached = sum(c.cached_tokens for c in self.choices[:: self.job.n])
        completion = sum(c.tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


# ----------------------------------------------------------------------
# Metrics


class _Monitor:
    """Recent history of the engine's counters, so the dashboard and
    ``/metrics`` can give rates over the last seconds and routing over the
    last :data:`ROUTING_WINDOW` tokens. Sampled whenever either is read."""

    #: Seconds the token rates average over.
    RATE_SECONDS = 5.0

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: (time, prompt tokens, generated tokens), one every quarter second.
        self.rates: deque[tuple[float, int, int]] = deque(maxlen=64)
        #: Routing snapshots, one each time tokens have run since the last.
        self.routing: deque[dict[str, Any]] = deque(maxlen=256)
        #: Recent times to first token (seconds).
        self.ttfts: deque[float] = deque(maxlen=64)

    def sample(self, engine: Any) -> dict[str, Any]:
        """Counters now, token rates and the routing window."""
        now = time.monotonic()
        b = engine.batch_stats()
        r = engine.routing_stats()
        with self.lock:
            if not self.rates or now - self.rates[-1][0] >= 0.25:
                self.rates.append((now, b["prompt_tokens"], b["generated_tokens"]))
            if not self.routing or self.routing[-1]["tokens"] != r["tokens"]:
                self.routing.append(r)
            # Rates: against the oldest sample within RATE_SECONDS.
            t0, p0, g0 = next(
                (x for x in self.rates if now - x[0] <= self.RATE_SECONDS + 0.25), self.rates[-1]
            )
            span = now - t0
            rate_in = (b["prompt_tokens"] - p0) / span if span > 0 else 0.0
            rate_out = (b["generated_tokens"] - g0) / span if span > 0 else 0.0
            # Routing: since the last snapshot at least ROUTING_WINDOW tokens
            # back, else since the engine opened (at least the window, or
            # everything when less has run).
            earlier = None
            for snap in self.routing:
                if snap["tokens"] <= r["tokens"] - ROUTING_WINDOW:
                    earlier = snap
            ttfts = sorted(self.ttfts)
        # The window ends at the snapshot in hand: one snapshot per sample.
        window = r if earlier is None else engine.routing_stats(since=earlier, until=r)
        return {
            "batch": b,
            "tokens_per_second_in": rate_in,
            "tokens_per_second_out": rate_out,
            "ttft_p50": ttfts[len(ttfts) // 2] if ttfts else None,
            "routing": window,
        }


class _Metrics:
    """Prometheus metrics of one app: request-side histograms observed here,
    the engine's own counters read at each scrape."""

    def __init__(self, engine_ref: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self.monitor = _Monitor()
        self.ttft = Histogram(
            "colibri_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.tpot = Histogram(
            "colibri_time_per_output_token_seconds",
            "Time between consecutive generated tokens of one choice.",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5),
            registry=self.registry,
        )
        self.requests = Counter(
            "colibri_requests",
            "Requests answered, by endpoint and status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine_ref, self.monitor))


class _EngineCollector:
    def __init__(self, engine_ref: Callable[[], Any], monitor: _Monitor) -> None:
        self.engine_ref = engine_ref
        self.monitor = monitor

    def collect(self) -> Iterable[Any]:
        engine = self.engine_ref()
        if engine is None:
            return
        m = self.monitor.sample(engine)
        b = m["batch"]
        yield CounterMetricFamily(
            "colibri_prompt_tokens", "Prompt tokens processed.", value=b["prompt_tokens"]
        )
        yield CounterMetricFamily(
            "colibri_generation_tokens", "Tokens generated.", value=b["generated_tokens"]
        )
        yield CounterMetricFamily(
            "colibri_drafted_tokens", "Tokens drafted by speculative decoding.", value=b["drafted_tokens"]
        )
        yield CounterMetricFamily(
            "colibri_accepted_draft_tokens",
            "Drafted tokens the model's own choice confirmed (each saved a forward pass).",
            value=b["accepted_tokens"],
        )
        yield _gauge("colibri_queue_depth", "Generations waiting for a place.", b["waiting"])
        yield _gauge("colibri_running_sequences", "Generations running.", b["running"])
        yield _gauge("colibri_batch_size", "Sequences in the last step.", b["last_batch"])
        yield CounterMetricFamily("colibri_steps", "Scheduler steps run.", value=b["steps"])
        yield CounterMetricFamily(
            "colibri_busy_seconds", "Seconds the scheduler spent in steps.", value=b["busy_seconds"]
        )
        yield _gauge(
            "colibri_kv_cache_tokens", "Positions held in running generations' KV caches.", b["kv_tokens"]
        )
        # The state of running sequences: their positions' bytes plus each one's fixed part.
        state = engine.state_bytes()
        yield _gauge(
            "colibri_kv_cache_bytes",
            "Bytes of KV cache those positions fill.",
            b["kv_tokens"] * state["per_token"] + b["running"] * state["per_sequence"],
        )
        # Pooled attention's pieces (DeepSeek-V4), each as its share of those bytes.
        pieces = engine.state_pieces()
        if pieces:
            doc = "Bytes of running generations' state, by piece."
            g = GaugeMetricFamily("colibri_state_piece_bytes", doc, labels=["piece"])
            for name, (per_token, per_sequence) in pieces.items():
                g.add_metric([name], b["kv_tokens"] * per_token + b["running"] * per_sequence)
            yield g
        # Tokens per step as a histogram (the scheduler keeps the buckets).
        bounds, counts = b["step_token_buckets"], b["step_tokens"]
        acc, buckets = 0, []
        for bound, count in zip([*map(float, bounds), float("inf")], counts):
            acc += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), acc))
        h = HistogramMetricFamily("colibri_step_tokens", "Tokens per scheduler step.")
        h.add_metric([], buckets, sum_value=None)
        yield h
        pc = b.get("prefix_cache")
        if pc is not None:
            yield from _prefix_metrics(pc)
        s = engine.store_stats()
        yield _gauge("colibri_expert_cache_hit_rate", "Routed-expert lookups served from RAM.", s["hit_rate"])
        yield _gauge(
            "colibri_expert_bytes_read_per_token",
            "Expert bytes read from disk per token.",
            s["bytes_read_per_token"],
        )
        # Router health over the recent window.
        over = f" over the last {ROUTING_WINDOW} routed tokens"
        per_layer = [
            (
                "colibri_routing_entropy",
                "Normalised entropy of each layer's expert use (1 = uniform)",
                "entropy",
            ),
            ("colibri_router_dead_experts", "Experts of each layer never chosen", "dead"),
            ("colibri_router_overloaded_experts", "Experts chosen over 3x their uniform share", "overloaded"),
            ("colibri_router_max_load", "Busiest expert's choices over its uniform share", "max_load"),
            ("colibri_router_top1_margin", "Mean top-1 minus top-2 router probability", "mean_margin"),
        ]
        layers = m["routing"].get("layers", [])
        for metric, doc, key in per_layer:
            g = GaugeMetricFamily(metric, doc + over + ".", labels=["layer"])
            for layer in layers:
                v = layer[key]
                g.add_metric([str(layer["layer"])], len(v) if isinstance(v, list) else v)
            yield g


def _prefix_metrics(pc: dict[str, Any]) -> Iterable[Any]:
    """The prefix cache's memory and how much of the prompts it served."""
    for name, doc, key in (
        ("bytes", "Bytes the prefix cache holds.", "bytes"),
        ("budget_bytes", "Most bytes the prefix cache may hold.", "budget_bytes"),
        ("blocks", "Blocks of prompt state the prefix cache holds.", "blocks"),
    ):
        yield _gauge(f"colibri_prefix_cache_{name}", doc, pc[key])
    looked = pc["prompt_tokens"]
    yield _gauge(
        "colibri_prefix_cache_hit_rate",
        "Share of the prompt tokens looked up that the prefix cache served.",
        pc["cached_tokens"] / looked if looked else 0.0,
    )
    for name, doc, key in (
        ("cached_tokens", "Prompt tokens served from the prefix cache.", "cached_tokens"),
        ("hits", "Requests that started from cached state.", "hits"),
        ("lookups", "Requests looked up in the prefix cache.", "lookups"),
        ("evicted_blocks", "Blocks dropped to stay within the budget.", "evicted_blocks"),
    ):
        yield CounterMetricFamily(f"colibri_prefix_cache_{name}", doc, value=pc[key])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


# ----------------------------------------------------------------------
# The app


def create_app(
    engine: Any | Callable[[], Any],
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    speculative: str | None = None,
    draft_tokens: int = 4,
    metrics_view: Callable[[CollectorRegistry], bytes] | None = None,
    dashboard_view: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Starlette:
    """The ASGI app serving ``engine``; pass a callable to load the engine in
    the background (requests are answered 503 until it returns).
    ``speculative`` and ``draft_tokens`` are the defaults of requests that do
    not set them (see :class:`~colibri.SamplingParams`). ``metrics_view``
    renders ``/metrics`` from the app's registry (default: the registry as
    it is) and ``dashboard_view`` turns the dashboard's data before it is
    sent (default: as it is): :mod:`colibri.ray` adds the other replicas'.
    The registry is ``app.state.metrics_registry``, and
    ``app.state.dashboard_sample()`` reads the dashboard's data now."""
    SamplingParams(speculative=speculative, draft_tokens=draft_tokens)  # checked now, not per request
    spec_default = {"speculative": speculative, "draft_tokens": draft_tokens}

    def with_defaults(job: Job) -> Job:
        for k, v in spec_default.items():
            job.options.setdefault(k, v)
        return job

    state: dict[str, Any] = {"engine": None, "error": None}
    name = model_name

    def usable(e: Any) -> Any:
        # A server-wide default of MTP drafts needs the layer in the file.
        if speculative == "mtp" and not getattr(e, "has_mtp", True):
            raise InvalidInputError(
                f"--speculative mtp: {e.path} holds no multi-token-prediction layer (convert the "
                "checkpoint with --keep-mtp, or use --speculative ngram)"
            )
        return e

    if callable(engine) and not hasattr(engine, "generate"):
        loader = engine

        def load() -> None:
            try:
                state["engine"] = usable(loader())
            except BaseException as e:  # reported by /health and every request
                state["error"] = e

        threading.Thread(target=load, daemon=True, name="colibri-load").start()
    else:
        state["engine"] = usable(engine)
    metrics = _Metrics(lambda: state["engine"])
    created = int(time.time())

    def served_name() -> str:
        e = state["engine"]
        return name or (os.path.splitext(os.path.basename(e.path))[0] if e is not None else "colibri")

    def ready() -> Any:
        if state["error"] is not None:
            raise APIError(500, f"the model failed to load: {state['error']}", type="server_error")
        e = state["engine"]
        if e is None:
            raise APIError(
                503, "the model is still loading", type="server_error", headers={"Retry-After": "1"}
            )
        return e

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        token = got[7:] if got.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    async def body_of(request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY:
            raise APIError(413, f"the request body is {size} bytes; at most {MAX_BODY}")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise APIError(413, f"the request body is larger than {MAX_BODY} bytes")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from e
        except RecursionError as e:
            raise APIError(400, "the request body nests too deeply") from e

    def endpoint(kind: str) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            status = 200
            try:
                check_key(request)
                e = ready()
                body = await body_of(request)
                chat = kind == "chat"
                allowed = _CHAT if chat else _COMPLETION
                job = with_defaults(await asyncio.to_thread(_parse, body, allowed, chat, e, served_name()))
                loop = asyncio.get_running_loop()
                queue: asyncio.Queue[tuple[int, Any, Any]] = asyncio.Queue()
                run = await asyncio.to_thread(_Run, e, job, loop, queue, metrics)
                if job.stream:
                    return StreamingResponse(
                        _sse(run, chat, served_name(), request),
                        media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache"},
                    )
                return JSONResponse(await _whole(run, chat, served_name(), request))
            except APIError as err:
                status = err.status
                return err.response()
            except Exception as err:  # a bug: answered, logged, the server goes on
                status = 500
                logging.getLogger("colibri.server").exception("request failed")
                return APIError(
                    500, f"internal error: {type(err).__name__}: {err}", type="server_error"
                ).response()
            finally:
                metrics.requests.labels(kind, str(status)).inc()

        return handle

    async def messages(request: Request) -> Response:
        status = 200
        try:
            check_key(request)
            e = ready()
            body = await body_of(request)
            try:
                chat = _anthropic.to_chat(body)
            except _anthropic.MessagesError as err:
                raise APIError(400, str(err)) from err
            job = with_defaults(
                await asyncio.to_thread(_parse, chat, _CHAT, True, e, served_name(), _anthropic.tool_use_id)
            )
            # max_tokens is an upper bound here: the context ends a longer one.
            job.length_field = None
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[tuple[int, Any, Any]] = asyncio.Queue()
            run = await asyncio.to_thread(_Run, e, job, loop, queue, metrics)
            if job.stream:
                return StreamingResponse(
                    _anthropic_sse(run, served_name(), request),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )

            async def collect() -> None:
                async for _ in run.events():
                    pass

            await _until_done_or_gone(run, request, collect())
            c = run.choices[0]
            return JSONResponse(
                _anthropic.message_body(
                    model=served_name(),
                    text=c.text,
                    reasoning=c.reasoning,
                    calls=c.tool_calls,
                    finish=_anthropic_finish(run, c),
                    stop=c.stop_reason,
                    usage=run.usage(),
                )
            )
        except APIError as err:
            status = err.status
            return JSONResponse(
                _anthropic.error_body(err.status, err.message), status_code=err.status, headers=err.headers
            )
        except Exception as err:  # a bug: answered, logged, the server goes on
            status = 500
            logging.getLogger("colibri.server").exception("request failed")
            return JSONResponse(
                _anthropic.error_body(500, f"internal error: {type(err).__name__}: {err}"), status_code=500
            )
        finally:
            metrics.requests.labels("messages", str(status)).inc()

    async def count_tokens(request: Request) -> Response:
        try:
            check_key(request)
            e = ready()
            body = await body_of(request)
            try:
                chat = _anthropic.to_chat(body, counting=True)
            except _anthropic.MessagesError as err:
                raise APIError(400, str(err)) from err
            ids, _, _ = await asyncio.to_thread(_render, chat, e)
            return JSONResponse({"input_tokens": len(ids)})
        except APIError as err:
            return JSONResponse(
                _anthropic.error_body(err.status, err.message), status_code=err.status, headers=err.headers
            )

    async def models(request: Request) -> Response:
        try:
            check_key(request)
            ready()
        except APIError as err:
            return err.response()
        card = {"id": served_name(), "object": "model", "created": created, "owned_by": "colibri"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        if state["error"] is not None:
            return JSONResponse({"status": "error", "error": str(state["error"])}, status_code=500)
        if state["engine"] is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": served_name()})

    async def prometheus(request: Request) -> Response:
        try:
            check_key(request)
        except APIError as err:
            return err.response()
        data = await asyncio.to_thread(metrics_view or generate_latest, metrics.registry)
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def dashboard(request: Request) -> Response:
        # The page holds no data: it reads /dashboard/data (with the key
        # given after # in its address when the server has one).
        return HTMLResponse(_dashboard_page(), headers={"Cache-Control": "no-cache"})

    def dashboard_sample() -> dict[str, Any]:
        e = ready()
        m = metrics.monitor.sample(e)
        b, r = m.pop("batch"), m["routing"]
        store = e.store_stats()
        m.update(
            {
                "model": served_name(),
                "queue": b["waiting"],
                "running": b["running"],
                "batch_size": b["last_batch"],
                "max_batch": b["max_batch"],
                "kv_tokens": b["kv_tokens"],
                "generated_tokens": b["generated_tokens"],
                "streaming": bool(store["streaming"]),
                "hit_rate": store["hit_rate"],
                "routing_window": ROUTING_WINDOW,
                "top_k": ((e.config.get("moe") or {}).get("router") or {}).get("top_k"),
            }
        )
        m["routing"] = {"tokens": r["tokens"], "layers": r["layers"]}
        return m

    async def dashboard_data(request: Request) -> Response:
        try:
            check_key(request)
            m = await asyncio.to_thread(dashboard_sample)
        except APIError as err:
            return err.response()
        if dashboard_view is not None:
            m = await asyncio.to_thread(dashboard_view, m)
        return JSONResponse(m)

    async def not_found(request: Request, exc: Exception) -> Response:
        return APIError(
            404, f"no such endpoint: {request.method} {request.url.path}", code="not_found"
        ).response()

    async def wrong_method(request: Request, exc: Exception) -> Response:
        return APIError(405, f"{request.method} is not allowed on {request.url.path}").response()

    routes = [
        Route("/v1/chat/completions", endpoint("chat"), methods=["POST"]),
        Route("/v1/completions", endpoint("completion"), methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/", dashboard, methods=["GET"]),
        Route("/dashboard/data", dashboard_data, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: wrong_method})
    app.state.metrics_registry = metrics.registry
    app.state.dashboard_sample = dashboard_sample
    return app


@functools.lru_cache(maxsize=1)
def _dashboard_page() -> str:
    """The page, read from the package once."""
    from importlib.resources import files

    return files("colibri").joinpath("data", "dashboard.html").read_text(encoding="utf-8")


async def _until_done_or_gone(run: _Run, request: Request, work: Any) -> Any:
    """Awaits ``work``; if the client goes away first, cancels the run."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                run.cancel()
                task.cancel()
                raise APIError(499, "client closed the request")
    finally:
        if not task.done():
            task.cancel()


class _ClientGone(Exception):
    """The client of a streamed response went away."""


async def _while_connected(run: _Run, request: Request) -> AsyncIterator[tuple[Any, Any, Any]]:
    """The run's events; raises :class:`_ClientGone` once the client has gone.
    The transport does not fail a write to a closed socket, so the server is
    asked, at most every 20 ms."""
    checked = time.perf_counter()
    async for ev in run.events():
        now = time.perf_counter()
        if now - checked > 0.02:
            checked = now
            if await request.is_disconnected():
                raise _ClientGone
        yield ev


async def _whole(run: _Run, chat: bool, model: str, request: Request) -> dict[str, Any]:
    async def collect() -> None:
        # The pumps of a non-streamed request keep their own text and
        # log-probabilities; only the choices' ends come through.
        async for _ in run.events():
            pass

    await _until_done_or_gone(run, request, collect())
    want_lps = run.job.logprobs
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    choices = []
    for c in run.choices:
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if c.parser is not None and c.parser.think:
                message["reasoning_content"] = c.reasoning or None
            if c.tool_calls:
                message["content"] = c.text or None
                message["tool_calls"] = [t.to_openai() for t in c.tool_calls]
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": None if want_lps is None else run.chat_logprobs(c, c.logprobs),
                    "finish_reason": c.finish,
                }
            )
        else:
            lps = None if want_lps is None else run.completion_logprobs(c, c.logprobs)
            choices.append(
                {"index": c.index, "text": c.text, "logprobs": lps, "finish_reason": c.finish_reason}
            )
            if run.job.return_token_ids:
                choices[-1]["token_ids"] = c.token_ids
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": run.usage(),
    }


async def _sse(run: _Run, chat: bool, model: str, request: Request) -> AsyncIterator[str]:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if run.job.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def choice(
        c: _Choice, text: Any, finish: str | None, lps: list[Any] | None = None, role: bool = False
    ) -> dict[str, Any]:
        logprobs: dict[str, Any] | None = None
        if run.job.logprobs is not None and not role:
            if chat:
                logprobs = run.chat_logprobs(c, lps or [])
            else:
                logprobs = run.completion_logprobs(c, lps or [])
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if isinstance(text, Delta):
                delta.update(_openai_delta(text))
            elif text is not None:
                delta["content"] = text
            return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": c.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    try:
        if chat:
            for c in run.choices:
                yield chunk([choice(c, None, None, role=True)])
        try:
            async for c, piece, lps in _while_connected(run, request):
                if piece is None:
                    yield chunk([choice(c, None if chat else "", c.finish, lps)])
                else:
                    yield chunk([choice(c, piece, None, lps)])
        except APIError as err:
            yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.type}})}\n\n"
            return
        except _ClientGone:
            return
        if run.job.include_usage:
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": run.usage(),
            }
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        # Finished, or the client went away (the response task is cancelled
        # and this runs): nothing more is computed for it.
        run.cancel()


def _anthropic_finish(run: _Run, c: _Choice) -> str | None:
    """The finish reason, ``context`` when the context ended it before max_tokens."""
    if c.finish == "length" and c.tokens < run.job.options["max_new_tokens"]:
        return "context"
    return c.finish


async def _anthropic_sse(run: _Run, model: str, request: Request) -> AsyncIterator[str]:
    """Anthropic's event stream for a one-choice run."""
    c = run.choices[0]
    events = _anthropic.Events(model, c.prompt_tokens)
    try:
        try:
            async for _, piece, _ in _while_connected(run, request):
                if not events.started:
                    # After the first token, when the prefix cache's share is known.
                    yield events.start(c.cached_tokens)
                if piece is None:
                    continue
                for ev in events.delta(piece if isinstance(piece, Delta) else Delta(content=piece)):
                    yield ev
        except APIError as err:
            if not events.started:
                yield events.start(0)
            yield _anthropic.event(
                "error", {"error": _anthropic.error_body(err.status, err.message)["error"]}
            )
            return
        except _ClientGone:
            return
        if not events.started:
            yield events.start(c.cached_tokens)
        for ev in events.stop(_anthropic_finish(run, c), c.stop_reason, c.tokens):
            yield ev
    finally:
        run.cancel()


def _openai_delta(d: Delta) -> dict[str, Any]:
    """A parser's delta as OpenAI's chat chunk delta: content,
    reasoning_content, and tool_calls (index, id, type and name once, then
    argument fragments)."""
    out: dict[str, Any] = {}
    if d.content:
        out["content"] = d.content
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    calls = []
    for c in d.calls:
        if c.id is not None:
            calls.append(
                {
                    "index": c.index,
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
            )
        else:
            calls.append({"index": c.index, "function": {"arguments": c.arguments}})
    if calls:
        out["tool_calls"] = calls
    return out


def serve(
    model: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    log_level: str = "info",
    speculative: str | None = None,
    draft_tokens: int = 4,
    **engine_options: Any,
) -> None:
    """Serves a model until interrupted: ``model`` is an
    :class:`~colibri.Engine`, a callable returning one (loaded in the
    background; requests are answered 503 meanwhile), a ``.colibri`` path, a
    Hugging Face folder, or ``"demo"``. ``engine_options`` go to the engine
    (``threads``, ``ram_budget``, ``max_batch``, ``max_queue``, ...);
    ``speculative`` and ``draft_tokens`` are the requests' defaults."""
    import uvicorn

    from ._engine import Engine

    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)

        def load() -> Any:
            if path == "demo":
                return Engine.demo(**engine_options)
            if os.path.isdir(path):
                return Engine.from_pretrained(path, **engine_options)
            return Engine(path, **engine_options)

        model = load
    app = create_app(
        model, model_name=model_name, api_key=api_key, speculative=speculative, draft_tokens=draft_tokens
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level)
