"""Tool-call and reasoning parsers, each on text its own family's chat
template writes: an assistant turn with tool calls is rendered through the
real template (tests/fixtures/templates), and what the model would have
generated after the prompt is parsed back, whole and in pieces of every
size, into the same answer, reasoning and calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colibri._errors import InvalidInputError
from colibri._text import ChatTemplate
from colibri._tools import (
    Delta,
    OutputParser,
    check_tools,
    detect,
    parser_for,
    prepare_messages,
    typed_value,
)

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather at a place.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "A city."},
                    "days": {"type": "integer", "description": "How many days."},
                    "metric": {"type": "boolean", "description": "Celsius or not."},
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Searches the web.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for."},
                    "filters": {"type": "object", "description": "Narrowing."},
                    "zip": {"type": "string", "description": "A code that looks like a number."},
                },
            },
        },
    },
]

CALLS = [
    ("get_weather", {"location": "Paris, France", "days": 3, "metric": True}),
    (
        "search",
        {"query": 'a < b & "quotes"\nand lines', "filters": {"site": ["a.org"], "n": 2}, "zip": "02134"},
    ),
]

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def render(name: str, messages: list, **extra) -> str:
    t = ChatTemplate((TEMPLATES / name).read_text(encoding="utf-8"))
    return t.render(
        prepare_messages(messages),
        add_generation_prompt=extra.pop("add_generation_prompt", False),
        special_tokens=SPECIALS,
        extra={"tools": TOOLS, **extra},
    )


def generated(name: str, reasoning: str, content: str, calls, end: str, ids=None, **extra) -> tuple[str, str]:
    """(prompt, what the model wrote after it) for an assistant turn."""
    user = [{"role": "user", "content": "Weather in Paris, and search?"}]
    prompt = render(name, user, add_generation_prompt=True, **extra)
    ids = ids or [f"call_{i}" for i in range(len(calls))]
    turn = {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "thinking": reasoning,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in zip(ids, calls)
        ],
    }
    if not reasoning:
        del turn["reasoning_content"], turn["thinking"]
    full = render(name, [*user, turn], **extra)
    # The assistant turn as the model writes it: after the generation prompt
    # (the templates open the turn the same way), up to its end marker.
    common = 0
    while common < min(len(prompt), len(full)) and prompt[common] == full[common]:
        common += 1
    assert common >= len(prompt.rstrip()) - len("<think>\n"), (prompt[common:], full[common:])
    out = full[len(prompt) :] if full.startswith(prompt) else full[common:]
    if end and end in out:
        out = out[: out.index(end)]
    return prompt, out


def run(parser: OutputParser, text: str, size: int) -> tuple[Delta, list[Delta]]:
    deltas = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
    deltas.append(parser.finish())
    whole = Delta()
    for d in deltas:
        whole.merge(d)
    return whole, deltas


def check_calls(parser: OutputParser, deltas: list[Delta], calls, ids=None) -> None:
    got = parser.tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    if ids:
        assert [c.id for c in got] == ids
    else:
        assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got)
    # Streamed as OpenAI does: index, id and name first, then argument fragments joining to the whole.
    by_index: dict[int, list] = {}
    for d in deltas:
        for c in d.calls:
            by_index.setdefault(c.index, []).append(c)
    assert sorted(by_index) == list(range(len(calls)))
    for i, parts in by_index.items():
        assert parts[0].id == got[i].id and parts[0].name == got[i].name
        assert all(p.id is None and p.name is None for p in parts[1:])
        assert "".join(p.arguments for p in parts) == got[i].arguments


CASES = [
    # (template, end of turn, reasoning, extra template variables, expected format)
    ("qwen3.jinja", "<|im_end|>", "They want the weather.\nTwo calls.", {}, "hermes"),
    ("qwen3.5.jinja", "<|im_end|>", "They want the weather.", {"enable_thinking": True}, "qwen_xml"),
    ("glm-4.6.jinja", "<|", "They want the weather.", {}, "glm"),
    ("deepseek-v3.1.jinja", "<｜end▁of▁sentence｜>", "", {}, "deepseek"),
    ("deepseek-v3.2.jinja", "<｜end▁of▁sentence｜>", "They want the weather.", {}, "dsml"),
    ("minimax-m2.jinja", "[e~[", "They want the weather.", {}, "minimax"),
]


@pytest.mark.parametrize(("name", "end", "reasoning", "extra", "fmt"), CASES)
@pytest.mark.parametrize("content", ["Let me look that up.", ""])
def test_each_format_reads_back_what_its_template_writes(name, end, reasoning, extra, fmt, content):
    source = (TEMPLATES / name).read_text(encoding="utf-8")
    assert detect(source)[0] == fmt
    prompt, text = generated(name, reasoning, content, CALLS, end, **extra)
    for size in (len(text), 1, 2, 3, 7):
        parser = parser_for(source, prompt, tools=TOOLS)
        assert parser is not None
        whole, deltas = run(parser, text, size)
        assert (whole.content, parser.content) == (content, content), (size, text)
        assert whole.reasoning == parser.reasoning == reasoning, (size, text)
        check_calls(parser, deltas, CALLS)


def test_kimi_calls_keep_their_own_ids():
    source = (TEMPLATES / "kimi-k2-thinking.jinja").read_text(encoding="utf-8")
    assert detect(source)[0] == "kimi"
    ids = ["functions.get_weather:0", "functions.search:1"]
    prompt, text = generated(
        "kimi-k2-thinking.jinja", "They want the weather.", "On it.", CALLS, "<|im_end|>", ids
    )
    assert text.startswith("<think>")
    for size in (len(text), 1, 4):
        parser = parser_for(source, prompt, tools=TOOLS)
        assert parser is not None
        whole, deltas = run(parser, text, size)
        assert (whole.content, whole.reasoning) == ("On it.", "They want the weather.")
        check_calls(parser, deltas, CALLS, ids)


def test_harmony_channels_and_a_call():
    source = (TEMPLATES / "gpt-oss.jinja").read_text(encoding="utf-8")
    assert detect(source)[0] == "harmony"
    one = CALLS[:1]  # the template writes one call per assistant turn
    prompt, text = generated("gpt-oss.jinja", "They want the weather.", "", one, "")
    assert prompt.endswith("<|start|>assistant") and text.startswith("<|channel|>analysis")
    for size in (len(text), 1, 5):
        parser = parser_for(source, prompt, tools=TOOLS)
        assert parser is not None
        whole, deltas = run(parser, text, size)
        assert (whole.content, whole.reasoning) == ("", "They want the weather.")
        check_calls(parser, deltas, one)
    # The answer after the tool's result, on the final channel; the model's
    # own form of the call header (recipient after the channel) too.
    answer = (
        "<|channel|>analysis<|message|>Sunny.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."
    )
    call = '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": "x"}'
    for text, content, reasoning, calls in [
        (answer, "It is sunny.", "Sunny.", []),
        (call, "", "", [("search", {"query": "x"})]),
    ]:
        for size in (len(text), 1, 3):
            parser = parser_for(source, prompt, tools=TOOLS)
            assert parser is not None
            whole, deltas = run(parser, text, size)
            assert (whole.content, whole.reasoning) == (content, reasoning)
            assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == calls


def test_reasoning_without_tools_and_a_prompt_that_opens_think():
    source = (TEMPLATES / "qwen3.5.jinja").read_text(encoding="utf-8")
    on = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    p = parser_for(source, on, tools=None)
    assert p is not None
    whole, _ = run(p, "Let me think.\nMore.\n</think>\n\nHello!", 2)
    assert (whole.reasoning, whole.content) == ("Let me think.\nMore.", "Hello!")
    p = parser_for(source, off, tools=None)
    assert p is not None
    whole, _ = run(p, "Hello! <tool_call> is just text here", 3)
    assert (whole.reasoning, whole.content) == ("", "Hello! <tool_call> is just text here")
    # A template with neither tools nor reasoning: nothing to parse.
    assert parser_for("{{ messages[0].content }}", "x", tools=TOOLS) is None
    # Cut off while reasoning: what came is reasoning.
    p = parser_for(source, on, tools=None)
    assert p is not None
    whole, _ = run(p, "Still thinking about", 4)
    assert (whole.reasoning, whole.content) == ("Still thinking about", "")


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("qwen3.jinja", 'Sure. <tool_call>\n{"name": "get_wea'),
        ("qwen3.jinja", "Sure. <tool_ca"),
        ("qwen3.5.jinja", "Sure. <tool_call>\n<funct"),
        ("minimax-m2.jinja", "Sure. <minimax:tool_call>\n<invoke na"),
        ("glm-4.6.jinja", "Sure. <tool_call>"),
    ],
)
def test_unfinished_markup_is_answer_text(name, text):
    source = (TEMPLATES / name).read_text(encoding="utf-8")
    prompt = "<think>\n\n</think>\n\n"
    for size in (len(text), 1, 3):
        p = parser_for(source, prompt, tools=TOOLS)
        assert p is not None
        whole, _ = run(p, text, size)
        assert whole.content == text and not p.tool_calls


def test_a_call_cut_off_keeps_its_name_and_the_arguments_so_far():
    source = (TEMPLATES / "deepseek-v3.1.jinja").read_text(encoding="utf-8")
    text = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "Par'
    p = parser_for(source, "<｜Assistant｜></think>", tools=TOOLS)
    assert p is not None
    run(p, text, 2)
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("get_weather", '{"location": "Par')]


def test_special_tokens_to_drop_and_markers_kept():
    source = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
    p = parser_for(source, "", tools=TOOLS, drop=["<|endoftext|>"])
    assert p is not None
    whole, _ = run(p, 'Hi<|endoftext|><tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>', 4)
    assert whole.content == "Hi" and [c.arguments for c in p.tool_calls] == ["{}"]


def test_values_are_typed_by_the_schema():
    assert typed_value("3", {"type": "integer"}) == 3
    assert typed_value("3.5", {"type": "number"}) == 3.5
    assert typed_value("02134", {"type": "string"}) == "02134"
    assert typed_value("True", {"type": "boolean"}) is True
    assert typed_value('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert typed_value("[1, 2]", {"type": "array"}) == [1, 2]
    assert typed_value("null", {"type": ["integer", "null"]}) is None
    assert typed_value("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == 7
    assert typed_value("seven", {"type": "integer"}) == "seven"  # kept as written
    assert typed_value("3", None) == "3"  # no schema: a string


def test_tools_and_tool_messages_are_checked():
    assert check_tools(TOOLS)[0]["function"]["name"] == "get_weather"
    for bad, field in [
        ({"f": 1}, "tools"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "code", "function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "params": {}}}], "tools[0].function.params"),
    ]:
        with pytest.raises(
            InvalidInputError, match=r"^" + field.replace("[", r"\[").replace("]", r"\]") + ":"
        ):
            check_tools(bad)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    msgs = prepare_messages(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        ]
    )
    args = msgs[1]["tool_calls"][0]["function"]["arguments"]
    assert args == {"x": 1} and "sep" + args == 'sep{"x": 1}' and msgs[1]["content"] == ""
    with pytest.raises(InvalidInputError, match=r"^messages\[1\]\.tool_call_id:"):
        prepare_messages(
            [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": ""}]
        )
    bad = {**call, "function": {"name": "f", "arguments": "{not json"}}
    with pytest.raises(InvalidInputError, match=r"arguments: is not valid JSON"):
        prepare_messages([{"role": "assistant", "tool_calls": [bad]}])


@pytest.mark.parametrize(
    ("name", "text", "calls"),
    [
        # GLM-4.7 and 5 write the parts without newlines.
        (
            "glm-4.6.jinja",
            "<tool_call>get_weather<arg_key>location</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
            [("get_weather", {"location": "Paris", "days": 2})],
        ),
        # Qwen3-Coder models sometimes leave </parameter> out.
        (
            "qwen3.5.jinja",
            "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n<parameter=days>\n2\n"
            "</function>\n</tool_call>",
            [("get_weather", {"location": "Paris", "days": 2})],
        ),
        # A call without parameters.
        ("qwen3.5.jinja", "<tool_call>\n<function=search>\n</function>\n</tool_call>", [("search", {})]),
        # Hermes JSON with the arguments first: read whole at its end.
        (
            "qwen3.jinja",
            '<tool_call>\n{"arguments": {"query": "x"}, "name": "search"}\n</tool_call>',
            [("search", {"query": "x"})],
        ),
        # MiniMax with an unquoted name, a value typed as an object.
        (
            "minimax-m2.jinja",
            '<minimax:tool_call>\n<invoke name=search>\n<parameter name="filters">{"n": 1}</parameter>\n'
            "</invoke>\n</minimax:tool_call>",
            [("search", {"filters": {"n": 1}})],
        ),
    ],
)
def test_variants_the_models_write(name, text, calls):
    source = (TEMPLATES / name).read_text(encoding="utf-8")
    for size in (len(text), 1, 4):
        p = parser_for(source, "<think>\n\n</think>\n\n", tools=TOOLS)
        assert p is not None
        whole, deltas = run(p, text, size)
        assert whole.content == "" and whole.reasoning == ""
        check_calls(p, deltas, calls)
