"""Anthropic's Messages API over the same generations as the OpenAI chat
endpoint: a request is translated into a chat request (system, messages
with text / tool_use / tool_result blocks, tools, tool_choice, thinking),
run the same way, and its output given back as content blocks (thinking,
text, tool_use), whole or as Anthropic's stream of events.

The translation is plain data in and out; :mod:`colibri.server` owns the
HTTP side.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from ._tools import Delta, ToolCall

__all__ = ["MessagesError", "error_body", "message_body", "to_chat", "Events"]

# Fields /v1/messages takes; anything else is a 400 naming the field.
FIELDS = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "output_config",
    # Accepted and ignored: they change nothing a local server does.
    "service_tier",
    "context_management",
    "cache_control",
    "container",
    "diagnostics",
    "inference_geo",
    "speed",
    "user_profile_id",
    "workspace_id",
}
COUNT_FIELDS = {
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "cache_control",
    "context_management",
}

#: Anthropic's error type for each status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
}

#: Stop reasons from the OpenAI side's finish reasons.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesError(ValueError):
    """A request this API refuses: the message names the field."""


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessagesError(f"{where}: must be a string or a list of text blocks")
    texts = []
    for j, b in enumerate(content):
        if not isinstance(b, Mapping) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, Mapping) else type(b).__name__
            raise MessagesError(f"{where}[{j}]: only text blocks can be given here, not {kind!r}")
        texts.append(b["text"])
    return "\n".join(texts)


def to_chat(body: Any, *, counting: bool = False) -> dict[str, Any]:
    """An Anthropic Messages request as a chat request for the OpenAI side
    (its ``model`` left out: any name is answered by the model served)."""
    if not isinstance(body, Mapping):
        raise MessagesError("the request body must be a JSON object")
    unknown = sorted(set(body) - (COUNT_FIELDS if counting else FIELDS))
    if unknown:
        raise MessagesError(f"{unknown[0]}: unknown field")
    out: dict[str, Any] = {}
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise MessagesError("messages: must be a non-empty list of messages")
    for i, m in enumerate(given):
        at = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant"):
            raise MessagesError(f"{at}.role: must be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise MessagesError(f"{at}.content: must be a string or a list of content blocks")
        texts: list[str] = []
        if m["role"] == "assistant":
            thoughts: list[str] = []
            calls: list[dict[str, Any]] = []
            for j, b in enumerate(content):
                kind = b.get("type") if isinstance(b, Mapping) else None
                if kind == "text" and isinstance(b.get("text"), str):
                    texts.append(b["text"])
                elif kind == "thinking" and isinstance(b.get("thinking"), str):
                    thoughts.append(b["thinking"])
                elif kind == "redacted_thinking":
                    pass
                elif kind == "tool_use":
                    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                        raise MessagesError(f"{at}.content[{j}]: a tool_use block needs an id and a name")
                    args = b.get("input", {})
                    if not isinstance(args, Mapping):
                        raise MessagesError(f"{at}.content[{j}].input: must be an object")
                    calls.append(
                        {
                            "id": b["id"],
                            "type": "function",
                            "function": {"name": b["name"], "arguments": args},
                        }
                    )
                else:
                    raise MessagesError(
                        f"{at}.content[{j}]: an assistant turn takes text, thinking and tool_use"
                    )
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if thoughts:
                turn["reasoning_content"] = "\n".join(thoughts)
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
            continue
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, Mapping) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_result":
                if not isinstance(b.get("tool_use_id"), str):
                    raise MessagesError(f"{at}.content[{j}].tool_use_id: must be the id of a tool_use block")
                result = b.get("content", "")
                text = _text_of(result, f"{at}.content[{j}].content")
                if b.get("is_error"):
                    text = "Error: " + text
                messages.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
            else:
                raise MessagesError(
                    f"{at}.content[{j}]: a user turn takes text and tool_result blocks, not {kind!r} "
                    "(colibri runs text models)"
                )
        if texts:
            messages.append({"role": "user", "content": "\n".join(texts)})
    out["messages"] = messages
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise MessagesError("tools: must be a list of tools")
        converted = []
        for i, t in enumerate(tools):
            at = f"tools[{i}]"
            if not isinstance(t, Mapping):
                raise MessagesError(f"{at}: must be an object")
            if t.get("type") not in (None, "custom"):
                raise MessagesError(
                    f"{at}.type: {t.get('type')!r} is a server tool, which this server does not run"
                )
            schema = t.get("input_schema")
            if not isinstance(schema, Mapping):
                raise MessagesError(f"{at}.input_schema: must be a JSON Schema object")
            f: dict[str, Any] = {"name": t.get("name"), "parameters": dict(schema)}
            if t.get("description") is not None:
                f["description"] = t["description"]
            converted.append({"type": "function", "function": f})
        out["tools"] = converted
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, Mapping) else None
        if kind not in ("auto", "none", "any", "tool"):
            raise MessagesError("tool_choice: must be an object with type 'auto', 'any', 'tool' or 'none'")
        # 'any' and 'tool' force a call (by constrained decoding), as OpenAI's
        # 'required' and a named function do.
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise MessagesError("tool_choice: type 'tool' needs the tool's name")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            out["tool_choice"] = "required" if kind == "any" else kind
        if choice.get("disable_parallel_tool_use") is not None:
            out["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    kwargs: dict[str, Any] = {}
    thinking = body.get("thinking")
    if thinking is not None:
        mode = thinking.get("type") if isinstance(thinking, Mapping) else None
        if mode not in ("enabled", "disabled", "adaptive", "between_tools"):
            raise MessagesError("thinking: must be an object with type 'enabled', 'adaptive' or 'disabled'")
        # Templates that can switch reasoning read enable_thinking (DeepSeek's also `thinking`).
        on = mode != "disabled"
        kwargs.update(enable_thinking=on, thinking=on)
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, Mapping):
            raise MessagesError("output_config: must be an object")
        fmt = config.get("format")
        if fmt is not None:
            if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
                raise MessagesError("output_config.format: must be an object with type 'json_schema'")
            schema = fmt.get("schema")
            if not isinstance(schema, Mapping):
                raise MessagesError("output_config.format.schema: must be a JSON Schema object")
            out["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": dict(schema)},
            }
        effort = config.get("effort")
        if effort is not None:
            if effort not in ("low", "medium", "high", "xhigh", "max"):
                raise MessagesError("output_config.effort: must be low, medium, high, xhigh or max")
            # GPT-OSS's template reads reasoning_effort (low, medium or high).
            kwargs["reasoning_effort"] = effort if effort in ("low", "medium") else "high"
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    if counting:
        return out
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise MessagesError("max_tokens: is required")
    out["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            out[name] = body[name]
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 1:
        raise MessagesError(f"temperature: must be between 0 and 1, got {temperature}")
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise MessagesError("stop_sequences: must be a list of non-empty strings")
        if stops:
            out["stop"] = stops
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, Mapping):
        raise MessagesError("metadata: must be an object")
    return out


def _input(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return {"_raw_arguments": call.arguments}


def stop_reason(finish: str | None, stop: Any) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence. The server passes
    ``"context"`` for a generation the context ended before ``max_tokens``."""
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    if finish == "context":
        return "model_context_window_exceeded", None
    return STOP_REASONS.get(finish or "stop", "end_turn"), None


def message_body(
    *,
    model: str,
    text: str,
    reasoning: str,
    calls: list[ToolCall],
    finish: str | None,
    stop: Any,
    usage: Mapping[str, Any],
) -> dict[str, Any]:
    """A whole response: content blocks in the order the model wrote them
    (thinking, text, tool_use)."""
    content: list[dict[str, Any]] = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text:
        content.append({"type": "text", "text": text})
    for c in calls:
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c)})
    reason, seq = stop_reason(finish, stop)
    return {
        "id": new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": {
            **input_usage(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]),
            "output_tokens": usage["completion_tokens"],
        },
    }


def input_usage(prompt_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's input counts: ``input_tokens`` are those computed, apart
    from those read from the prefix cache (the cache is filled as a side
    effect, never on request, so nothing counts as a cache write)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def event(kind: str, data: Mapping[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class Events:
    """Anthropic's stream for one message: ``start``, then ``delta`` for each
    piece (a block opens when the kind of text changes, and each tool call
    is a block of its own), then ``stop``."""

    def __init__(self, model: str, input_tokens: int) -> None:
        self.model, self.input_tokens = model, input_tokens
        self.cached_tokens = 0
        self.started = False
        self.index = -1
        self.open: str | None = None  # "text", "thinking" or "tool_use"
        self.call = -1  # the parser's index of the open tool call

    def start(self, cached_tokens: int) -> str:
        """``message_start``, once ``cached_tokens`` of the prompt are known
        to come from the prefix cache."""
        self.started, self.cached_tokens = True, cached_tokens
        message: dict[str, Any] = {
            "id": new_message_id(),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**input_usage(self.input_tokens, cached_tokens), "output_tokens": 0},
        }
        return event("message_start", {"message": message})

    def _close(self) -> Iterator[str]:
        if self.open is not None:
            yield event("content_block_stop", {"index": self.index})
            self.open = None

    def _begin(self, kind: str, block: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        self.index += 1
        self.open = kind
        yield event("content_block_start", {"index": self.index, "content_block": block})

    def delta(self, d: Delta) -> Iterator[str]:
        if d.reasoning:
            if self.open != "thinking":
                yield from self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield event(
                "content_block_delta",
                {"index": self.index, "delta": {"type": "thinking_delta", "thinking": d.reasoning}},
            )
        if d.content:
            if self.open != "text":
                yield from self._begin("text", {"type": "text", "text": ""})
            yield event(
                "content_block_delta",
                {"index": self.index, "delta": {"type": "text_delta", "text": d.content}},
            )
        for c in d.calls:
            if c.id is not None or self.open != "tool_use" or c.index != self.call:
                block = {"type": "tool_use", "id": c.id or tool_use_id(), "name": c.name or "", "input": {}}
                yield from self._begin("tool_use", block)
                self.call = c.index
            if c.arguments:
                yield event(
                    "content_block_delta",
                    {"index": self.index, "delta": {"type": "input_json_delta", "partial_json": c.arguments}},
                )

    def stop(self, finish: str | None, stop: Any, output_tokens: int) -> Iterator[str]:
        yield from self._close()
        reason, seq = stop_reason(finish, stop)
        yield event(
            "message_delta",
            {
                "delta": {"stop_reason": reason, "stop_sequence": seq},
                "usage": {
                    **input_usage(self.input_tokens, self.cached_tokens),
                    "output_tokens": output_tokens,
                },
            },
        )
        yield event("message_stop", {})
