"""What an agent asks of the server, live on 127.0.0.1 with the real
``openai`` and ``anthropic`` clients: tools in, tool calls out (whole and
streamed), reasoning apart from the answer, tool results back in, the
Anthropic Messages API with its event stream, and every malformed request a
clean 4xx.

The demo model calls no tools by itself, so the tool-calling tests run the
demo engine behind a scripted stand-in: the prompt is rendered and tokenized
for real (through Qwen3's real chat template), and only the generation is
replaced by text that template's format writes, cut in small pieces (so
markers arrive split, as tokens split them). What is tested is the parser
and the API shapes, not the model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from test_server import live

import colibri
from colibri._generation import Timings
from colibri._text import ChatTemplate
from colibri.server import create_app

QWEN3 = (Path(__file__).parent / "fixtures" / "templates" / "qwen3.jinja").read_text(encoding="utf-8")

WEATHER = {
    "name": "get_weather",
    "description": "The weather at a place.",
    "input_schema": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["location"],
    },
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": WEATHER["name"],
            "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"],
        },
    }
]

# What the stand-in "model" writes, in Qwen3's format: a reasoned tool call
# for a fresh question, an answer once the tool's result is in the prompt.
CALL_TURN = (
    "<think>\nThe user wants the weather in Paris.\n</think>\n\n"
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "days": 2}}\n</tool_call>'
)
ANSWER_TURN = "<think>\nThe tool said sunny.\n</think>\n\nIt is sunny in Paris."
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Rome"}}\n</tool_call>'
)


class _Stream:
    """A finished-generation stand-in with the Stream surface the server and chat() use."""

    def __init__(self, engine: Any, text: str, stop: list[str]) -> None:
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        for s in stop:
            if s in text:
                text, self.stop_reason = text[: text.index(s)], s
        self._pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
        self._ids = engine.tokenize(text, add_special_tokens=False) if text else []
        self.num_tokens = 0

    def __iter__(self) -> Iterator[str]:
        per = max(1, len(self._ids) // max(1, len(self._pieces)))
        for p in self._pieces:
            self.num_tokens = min(len(self._ids), self.num_tokens + per)
            yield p
        self.num_tokens = len(self._ids)
        self.finish_reason = "stop"
        if self.stop_reason is None:
            self.stop_reason = 0

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def timings(self) -> Timings:
        return Timings(0, len(self._ids), 0.0, 0.0)

    @property
    def logprobs(self) -> None:
        return None

    def logprobs_from(self, start: int) -> None:
        return None

    def cancel(self) -> None:
        pass


class Scripted:
    """The demo engine with Qwen3's chat template, whose generations are scripted."""

    _prepare_chat = colibri.Engine._prepare_chat
    chat = colibri.Engine.chat

    #: Nothing runs through the demo model's 512 positions: the stand-in's
    #: context is as long as Qwen3's tool prompts need.
    context_length = 8192

    def __init__(self, engine: colibri.Engine) -> None:
        self._engine = engine
        self.chat_template = QWEN3
        self.prompts: list[str] = []
        self.params: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def apply_chat_template(self, messages, *, add_generation_prompt=True, chat_template_kwargs=None) -> str:
        specials = self._engine._text().special_tokens
        return ChatTemplate(QWEN3).render(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=specials,
            extra=chat_template_kwargs,
        )

    def _start(self, prompt, params, *, add_special_tokens, text_out=False) -> _Stream:
        text = prompt if isinstance(prompt, str) else self._engine.detokenize(prompt)
        self.prompts.append(text)
        self.params.append(params)
        script = ANSWER_TURN if "<tool_response>" in text else TWO_CALLS if "Rome" in text else CALL_TURN
        return _Stream(self._engine, script, list(params.stop))


@pytest.fixture(scope="module")
def demo():
    return colibri.Engine.demo(threads=2, max_batch=8)


@pytest.fixture(scope="module")
def scripted(demo):
    return Scripted(demo)


@pytest.fixture(scope="module")
def url(scripted):
    with live(create_app(scripted)) as u:
        yield u


@pytest.fixture(scope="module")
def plain_url(demo):
    with live(create_app(demo)) as u:
        yield u


def oai(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def claude(url: str, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


USER = [{"role": "user", "content": "What is the weather in Paris?"}]


# ----------------------------------------------------------------------
# OpenAI


def test_openai_tool_call_reasoning_and_the_round_trip(url, scripted):
    c = oai(url)
    r = c.chat.completions.create(model="demo", messages=USER, tools=OPENAI_TOOLS, max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "The user wants the weather in Paris."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "Paris", "days": 2}
    # The prompt showed the tools through the template.
    assert '"name": "get_weather"' in scripted.prompts[-1] and "<tools>" in scripted.prompts[-1]
    # The result goes back; the call is rendered in the model's format.
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24C"},
    ]
    r = c.chat.completions.create(model="demo", messages=history, tools=OPENAI_TOOLS, max_tokens=100)
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.reasoning_content == "The tool said sunny."
    prompt = scripted.prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "days": 2}}' in prompt
    assert "<tool_response>\nsunny, 24C\n</tool_response>" in prompt
    # Markers are read with special tokens kept.
    assert scripted.params[-1].skip_special_tokens is False


def test_openai_streams_tool_call_deltas(url):
    chunks = list(
        oai(url).chat.completions.create(
            model="demo", messages=USER, tools=OPENAI_TOOLS, max_tokens=100, stream=True
        )
    )
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks)
    assert (content, reasoning) == ("Let me check.", "The user wants the weather in Paris.")
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls[0].index == 0 and calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(tc.index == 0 and tc.id is None for tc in calls[1:])
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(args) == {"location": "Paris", "days": 2}
    assert len(calls) > 2, "the arguments came in one piece"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls(url):
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    for parallel, want in [(None, ["Paris", "Rome"]), (False, ["Paris"])]:
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = oai(url).chat.completions.create(model="demo", messages=msgs, tools=OPENAI_TOOLS, **extra)
        calls = r.choices[0].message.tool_calls
        assert [json.loads(c.function.arguments)["location"] for c in calls] == want
        assert len({c.id for c in calls}) == len(calls)
        chunks = oai(url).chat.completions.create(
            model="demo", messages=msgs, tools=OPENAI_TOOLS, stream=True, **extra
        )
        indexes = {tc.index for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])}
        assert indexes == set(range(len(want)))


def test_engine_chat_returns_calls_and_reasoning_apart(scripted):
    r = scripted.chat(USER, tools=OPENAI_TOOLS, max_new_tokens=100)
    assert str(r) == "Let me check." and r.finish_reason == "tool_calls"
    assert r.reasoning_content == "The user wants the weather in Paris."
    assert [(t.name, json.loads(t.arguments)) for t in r.tool_calls] == [
        ("get_weather", {"location": "Paris", "days": 2})
    ]
    # tool_choice none: the tools are not shown, nothing is parsed as a call.
    r = scripted.chat(USER, tools=OPENAI_TOOLS, tool_choice="none", max_new_tokens=100)
    assert "<tools>" not in scripted.prompts[-1] and r.tool_calls == []
    assert "<tool_call>" in str(r)
    with pytest.raises(colibri.InvalidInputError, match="no tool named"):
        scripted.chat(USER, tools=OPENAI_TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})


def error_of(r: httpx.Response) -> dict:
    return r.json()["error"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": OPENAI_TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
        ),
        ({"tools": OPENAI_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format"),
        (
            {
                "tools": OPENAI_TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_openai_bad_tool_requests_are_400s_naming_the_field(url, extra, param):
    r = httpx.post(url + "/v1/chat/completions", json={"messages": USER, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param, r.text
    assert httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=30).status_code == 200


def test_a_tool_result_for_an_unknown_call_is_a_400(url):
    msgs = [*USER, {"role": "tool", "tool_call_id": "call_nowhere", "content": "x"}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "tools": OPENAI_TOOLS}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "messages[1].tool_call_id", r.text
    bad_args = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}
    msgs = [*USER, {"role": "assistant", "content": None, "tool_calls": [bad_args]}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "messages[1].tool_calls[0].function.arguments"


def test_a_template_without_a_tool_format_refuses_tools(plain_url):
    r = httpx.post(
        plain_url + "/v1/chat/completions", json={"messages": USER, "tools": OPENAI_TOOLS}, timeout=30
    )
    assert r.status_code == 400 and error_of(r)["param"] == "tools"
    assert "no tool-call format" in error_of(r)["message"]


# ----------------------------------------------------------------------
# Anthropic


def test_anthropic_plain_text_whole_and_streamed(plain_url, demo):
    c = claude(plain_url)
    want = demo.chat(USER, max_new_tokens=12, temperature=0)
    greedy = {"extra_body": {"temperature": 0}}  # (the 2026 client has no temperature argument)
    r = c.messages.create(model="claude-any", max_tokens=12, messages=USER, **greedy)
    assert r.type == "message" and r.role == "assistant" and r.model == "demo"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == str(want)
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.finish_reason]
    assert r.usage.output_tokens == len(want.token_ids)
    with c.messages.stream(model="claude-any", max_tokens=12, messages=USER, **greedy) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == str(want)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    # A system prompt as blocks, a stop sequence.
    r = c.messages.create(
        model="claude-any",
        max_tokens=40,
        system=[{"type": "text", "text": "Be brief."}],
        messages=USER,
        stop_sequences=[" the"],
        **greedy,
    )
    sys_want = demo.chat(
        [{"role": "system", "content": "Be brief."}, *USER], max_new_tokens=40, temperature=0, stop=[" the"]
    )
    assert r.content[0].text == str(sys_want)
    if sys_want.stop_reason == " the":
        assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", " the")
    # max_tokens is an upper bound: the context ends a longer generation.
    r = c.messages.create(model="claude-any", max_tokens=100_000, messages=USER, **greedy)
    long = demo.chat(USER, temperature=0, max_new_tokens=100_000)
    assert long.finish_reason == "length", "the demo model's greedy reply ended before the context"
    assert r.stop_reason == "model_context_window_exceeded" and r.content[0].text == str(long)
    assert r.usage.input_tokens + r.usage.output_tokens == demo.context_length
    # count_tokens: the rendered prompt's tokens.
    n = c.messages.count_tokens(model="claude-any", messages=USER).input_tokens
    assert n == len(demo.tokenize(demo.apply_chat_template(USER), add_special_tokens=False))


def test_anthropic_tool_round_trip_whole_and_streamed(url, scripted):
    c = claude(url)
    r = c.messages.create(model="claude-any", max_tokens=200, tools=[WEATHER], messages=USER)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"]
    thinking, text, use = r.content
    assert thinking.thinking == "The user wants the weather in Paris." and text.text == "Let me check."
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"location": "Paris", "days": 2}
    # Streamed: the same blocks, from Anthropic's event sequence.
    with c.messages.stream(model="claude-any", max_tokens=200, tools=[WEATHER], messages=USER) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"location": "Paris", "days": 2} and final.stop_reason == "tool_use"
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert {"thinking_delta", "text_delta", "input_json_delta"} <= set(deltas)
    starts = [e.index for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == stops == [0, 1, 2]
    # The tool's result goes back; the answer ends the turn.
    history = [
        *USER,
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24C"}],
        },
    ]
    r2 = c.messages.create(model="claude-any", max_tokens=200, tools=[WEATHER], messages=history)
    assert r2.stop_reason == "end_turn"
    assert [b.type for b in r2.content] == ["thinking", "text"] and r2.content[
        1
    ].text == "It is sunny in Paris."
    prompt = scripted.prompts[-1]
    assert '"arguments": {"location": "Paris", "days": 2}' in prompt
    assert "<tool_response>\nsunny, 24C\n</tool_response>" in prompt


def test_anthropic_errors_have_anthropics_shape(url):
    c = claude(url)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(
            model="x",
            max_tokens=10,
            messages=[
                *USER,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}],
                },
            ],
        )
    assert "tool_call_id" in str(e.value) or "toolu_x" in str(e.value)
    for body, words in [
        ({"messages": USER}, "max_tokens"),
        (
            {"messages": USER, "max_tokens": 5, "tools": [WEATHER], "tool_choice": {"type": "some"}},
            "tool_choice",
        ),
        ({"messages": USER, "max_tokens": 5, "tools": [{"name": "f"}]}, "input_schema"),
        ({"messages": USER, "max_tokens": 5, "temperature": 1.5}, "temperature"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5},
            "image",
        ),
        ({"messages": USER, "max_tokens": 5, "frobnicate": 1}, "frobnicate"),
    ]:
        r = httpx.post(url + "/v1/messages", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        got = r.json()
        assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
        assert words in got["error"]["message"], got
    r = httpx.post(url + "/v1/messages", content=b"{nope", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_anthropic_x_api_key_and_bearer(demo):
    with live(create_app(demo, api_key="sesame")) as u:
        with pytest.raises(anthropic.AuthenticationError) as e:
            claude(u, "wrong").messages.create(model="x", max_tokens=2, messages=USER)
        assert e.value.body["error"]["type"] == "authentication_error"
        r = claude(u, "sesame").messages.create(model="x", max_tokens=2, messages=USER)
        assert r.usage.output_tokens >= 1
        h = {"Authorization": "Bearer sesame"}
        body = {"max_tokens": 2, "messages": USER}
        assert httpx.post(u + "/v1/messages", json=body, headers=h, timeout=30).status_code == 200
        # x-api-key opens the OpenAI side too.
        r = httpx.post(u + "/v1/chat/completions", json=body, headers={"x-api-key": "sesame"}, timeout=30)
        assert r.status_code == 200


class _Native:
    """Token ids played back as the native generation gives them (ending on an end-of-sequence id)."""

    def __init__(self, ids: list[int], eos: int) -> None:
        self._ids, self._eos = ids, eos
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[int]:
        for t in self._ids:
            self.token_ids.append(t)
            yield t
        self.finish_reason = "stop"
        self.token_ids.append(self._eos)
        yield self._eos

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def cancel(self) -> None:
        pass

    def timings(self) -> tuple[int, int, float, float]:
        return (0, len(self.token_ids), 0.0, 0.0)

    def logprobs(self, start: int) -> list[Any]:
        return []


def test_markers_that_are_special_tokens_reach_the_parser(demo):
    """Through the real Stream and detokenizer: with the markers as special
    tokens (as GPT-OSS's and Kimi's are), chat() decodes keeping them and
    drops only the end-of-sequence text; skipped, the call would be lost."""
    from tokenizers import AddedToken, Tokenizer

    from colibri._generation import Stream
    from colibri._text import TextCodec

    tok = Tokenizer.from_str(demo._text().tokenizer.to_str())
    markers = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    codec = TextCodec(tok.to_str(), {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    eos = codec.tokenizer.token_to_id("<|im_end|>")
    script = CALL_TURN + "<|endoftext|>"

    class Special(Scripted):
        def _text(self) -> TextCodec:
            return codec

        def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
            return codec.encode(text, add_special_tokens)

        def _start(self, prompt, params, *, add_special_tokens, text_out=False) -> Stream[Any]:
            self.params.append(params)
            ids = codec.encode(script, add_special_tokens=False)
            assert codec.tokenizer.token_to_id("<tool_call>") in ids
            return Stream(
                _Native(ids, eos),
                codec=codec,
                text_mode=True,
                stop=list(params.stop),
                skip_special_tokens=params.skip_special_tokens,
                context=codec.encode(prompt, add_special_tokens=False),
            )

    engine = Special(demo)
    r = engine.chat(USER, tools=OPENAI_TOOLS, max_new_tokens=100)
    assert engine.params[-1].skip_special_tokens is False
    assert str(r) == "Let me check." and r.reasoning_content == "The user wants the weather in Paris."
    assert [(t.name, json.loads(t.arguments)) for t in r.tool_calls] == [
        ("get_weather", {"location": "Paris", "days": 2})
    ]
    # What skipping them would have given: no markers, so no call to find.
    ids = codec.encode(script, add_special_tokens=False)
    assert "<tool_call>" not in codec.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------
# Prefix cache


def test_cached_prompt_tokens_are_reported_by_both_apis_and_metrics():
    """A repeated conversation is served from the prefix cache: the same
    answer, OpenAI's ``cached_tokens`` and Anthropic's
    ``cache_read_input_tokens`` (whole and streamed) say how much, and
    /metrics has the hit rate and the memory."""
    engine = colibri.Engine.demo(threads=2, prefix_cache="32MiB")
    history = [{"role": "user", "content": "Tell me about the weather in Paris and Rome. " * 6}]
    greedy = {"extra_body": {"temperature": 0}}
    with live(create_app(engine)) as u:
        o = oai(u)
        first = o.chat.completions.create(model="demo", messages=history, max_tokens=4, temperature=0)
        again = o.chat.completions.create(model="demo", messages=history, max_tokens=4, temperature=0)
        n = first.usage.prompt_tokens
        assert n > 32 and again.usage.prompt_tokens == n
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
        assert again.choices[0].message.content == first.choices[0].message.content
        c = claude(u)
        r = c.messages.create(model="claude-any", max_tokens=4, messages=history, **greedy)
        assert r.usage.cache_read_input_tokens == (n - 1) // 16 * 16
        assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n
        assert r.usage.cache_creation_input_tokens == 0
        with c.messages.stream(model="claude-any", max_tokens=4, messages=history, **greedy) as s:
            starts = [e.message.usage for e in s if e.type == "message_start"]
            final = s.get_final_message()
        assert starts[0].cache_read_input_tokens == (n - 1) // 16 * 16
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == n
        assert final.content[0].text == r.content[0].text
        metrics = httpx.get(u + "/metrics", timeout=10).text
        rate = next(
            float(x.split()[1]) for x in metrics.splitlines() if x.startswith("colibri_prefix_cache_hit_rate")
        )
        assert 0 < rate < 1
        held = next(
            float(x.split()[1]) for x in metrics.splitlines() if x.startswith("colibri_prefix_cache_bytes")
        )
        assert 0 < held <= 32 << 20


# ----------------------------------------------------------------------
# Speculative decoding


def test_speculative_requests_and_the_server_default(demo):
    """A request may ask for n-gram drafts, a server may draft by default;
    either way the answer is the one without, the counts reach /metrics, and
    a bad value is a 400 naming the field."""
    text = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
    with live(create_app(demo)) as u:
        o = oai(u)
        plain = o.completions.create(model="demo", prompt=text, max_tokens=24, temperature=0)
        fast = o.completions.create(
            model="demo", prompt=text, max_tokens=24, temperature=0, extra_body={"speculative": "ngram"}
        )
        assert fast.choices[0].text == plain.choices[0].text
        for bad in ({"speculative": "eagle"}, {"speculative": "ngram", "draft_tokens": 99}):
            with pytest.raises(openai.BadRequestError) as err:
                o.completions.create(model="demo", prompt=text, max_tokens=4, extra_body=bad)
            assert err.value.body["param"] in bad  # type: ignore[index]
    with live(create_app(demo, speculative="ngram", draft_tokens=6)) as u:
        before = demo.batch_stats()["drafted_tokens"]
        r = oai(u).completions.create(model="demo", prompt=text, max_tokens=24, temperature=0)
        assert r.choices[0].text == plain.choices[0].text
        assert demo.batch_stats()["drafted_tokens"] > before
        metrics = httpx.get(u + "/metrics", timeout=10).text
        assert "colibri_drafted_tokens_total" in metrics and "colibri_accepted_draft_tokens_total" in metrics
    with pytest.raises(colibri.InvalidInputError, match="draft_tokens"):
        create_app(demo, speculative="ngram", draft_tokens=0)


def test_openai_predicted_outputs(plain_url):
    """``prediction`` (OpenAI's predicted outputs) gives drafts: the same
    answer, right or wrong; a malformed one is a 400 naming it."""
    o = oai(plain_url)
    msgs = [{"role": "user", "content": "Tell me about Mr. Darcy."}]
    want = o.chat.completions.create(model="demo", messages=msgs, max_tokens=24, temperature=0)
    text = want.choices[0].message.content or ""
    for guess in (text, [{"type": "text", "text": text[:20]}, {"type": "text", "text": "!" + text[20:]}]):
        got = o.chat.completions.create(
            model="demo",
            messages=msgs,
            max_tokens=24,
            temperature=0,
            prediction={"type": "content", "content": guess},
        )
        assert got.choices[0].message.content == text
    with pytest.raises(openai.BadRequestError) as err:
        o.chat.completions.create(
            model="demo", messages=msgs, max_tokens=4, extra_body={"prediction": {"type": "image"}}
        )
    assert err.value.body["param"] == "prediction"  # type: ignore[index]
