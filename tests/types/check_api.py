"""Static checks of the public API's types: `mypy --strict tests/types` in
.ci/run (never run, only type-checked). Each assert_type fails the check if
the API's annotations stop promising it."""

from __future__ import annotations

import numpy as np
from typing_extensions import assert_type

import colibri


def check(engine: colibri.Engine, ids: list[int]) -> None:
    params = colibri.SamplingParams(temperature=0.7, seed=1)
    assert_type(engine.generate("text"), colibri.Completion)
    assert_type(engine.generate("text", params, max_new_tokens=4), colibri.Completion)
    assert_type(engine.generate(ids), colibri.TokenCompletion)
    assert_type(engine.generate(np.array(ids)), colibri.TokenCompletion)
    assert_type(engine.generate(["a", "b"]), list[colibri.Completion])
    assert_type(engine.generate([ids, ids]), list[colibri.TokenCompletion])
    assert_type(engine.stream("text"), colibri.Stream[str])
    assert_type(engine.stream(ids, params), colibri.Stream[int])
    assert_type(engine.chat([{"role": "user", "content": "hi"}], top_k=5), colibri.Completion)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    reply = engine.chat([{"role": "user", "content": "hi"}], tools=[tool], tool_choice="auto")
    assert_type(reply.tool_calls, list[colibri.ToolCall])
    assert_type(reply.reasoning_content, str | None)
    assert_type(reply.tool_calls[0].arguments, str)
    assert_type(params.replace(seed=2), colibri.SamplingParams)
    with colibri.Engine.demo() as e:
        assert_type(e, colibri.Engine)
    engine.generate("text", temprature=0.5)  # type: ignore[call-overload]
    engine.generate("text", max_new_tokens="8")  # type: ignore[call-overload]
