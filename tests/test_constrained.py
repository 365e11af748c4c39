"""Constrained decoding: JSON Schema, regex and grammar constraints through
SamplingParams on the demo model (byte-level BPE) and the Llama-style
fixture (SentencePiece with byte fallback), the token bytes the engine
derives from each tokenizer, and the errors a bad constraint gives."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import openai
import pytest
from test_server import live

import colibri
from colibri import InvalidInputError, SamplingParams
from colibri._colibri import token_bytes
from colibri.server import create_app

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo():
    return colibri.Engine.demo(threads=2)


def validate(obj, schema) -> None:
    """jsonschema when it is installed, else the fields of PERSON by hand."""
    try:
        import jsonschema
    except ImportError:
        assert set(obj) == set(schema["required"]), obj
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
        assert obj["pet"] in ("cat", "dog", "none")
        assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
        assert all(isinstance(t, str) and len(t) <= 8 for t in obj["tags"])
    else:
        jsonschema.validate(obj, schema)


def test_greedy_json_schema_output_parses_and_validates(demo):
    for prompt in ("Once upon a time", "The weather today is", '{"name": "'):
        out = demo.generate(prompt, SamplingParams(json_schema=PERSON, max_new_tokens=200, temperature=0))
        assert out.finish_reason == "stop", out
        obj = json.loads(str(out))
        validate(obj, PERSON)
        # Compact, as json.dumps writes it.
        assert str(out) == json.dumps(obj, ensure_ascii=False) or "\\" in str(out)


def test_schema_as_text_and_json_object(demo):
    out = demo.generate("Hi", json_schema=json.dumps({"type": "object"}), max_new_tokens=60)
    if out.finish_reason == "stop":
        assert isinstance(json.loads(str(out)), dict)
    else:
        assert str(out).startswith("{")


def test_regex_and_grammar_constrain_the_text(demo):
    out = demo.generate(
        "The answer is", regex=r"(yes|no), because [a-z ]{1,20}\.", max_new_tokens=40, temperature=0
    )
    assert out.finish_reason == "stop"
    head, _, tail = str(out).partition(", because ")
    assert head in ("yes", "no") and tail.endswith(".") and len(tail) <= 21, str(out)
    grammar = 'start: "colour: " COLOUR "!"\nCOLOUR: "red" | "green" | "blue"\n'
    out = demo.generate("My favourite", grammar=grammar, max_new_tokens=20, temperature=0)
    assert str(out) in ("colour: red!", "colour: green!", "colour: blue!"), str(out)


def test_seeded_constrained_sampling_repeats(demo):
    p = SamplingParams(json_schema=PERSON, temperature=1.0, top_p=0.95, seed=123, max_new_tokens=120)
    a = demo.generate("Once upon a time", p)
    b = demo.generate("Once upon a time", p)
    assert a.token_ids == b.token_ids
    c = demo.generate("Once upon a time", p.replace(seed=124))
    assert c.token_ids != a.token_ids
    for out in (a, c):
        if out.finish_reason == "stop":
            validate(json.loads(str(out)), PERSON)


def test_max_new_tokens_cuts_a_constrained_output_as_length(demo):
    out = demo.generate("Once upon a time", json_schema=PERSON, max_new_tokens=5)
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5 and str(out).startswith("{")


def test_free_sequences_beside_constrained_ones_give_their_own_tokens(demo):
    free = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0)
    seeded = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=7)
    alone = [demo.generate("Once upon a time", free).token_ids, demo.generate("The cat", seeded).token_ids]
    results: dict[str, list[int]] = {}

    def run(name: str, prompt: str, p: SamplingParams) -> None:
        results[name] = demo.generate(prompt, p).token_ids

    jobs = [
        ("free", "Once upon a time", free),
        ("seeded", "The cat", seeded),
        ("json", "Once upon a time", SamplingParams(json_schema=PERSON, max_new_tokens=60, temperature=0)),
        (
            "rx",
            "The dog",
            SamplingParams(regex="[a-z]+( [a-z]+){5}", max_new_tokens=40, temperature=0.7, seed=3),
        ),
    ]
    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results["free"] == alone[0]
    assert results["seeded"] == alone[1]
    assert (
        results["json"]
        == demo.generate("Once upon a time", json_schema=PERSON, max_new_tokens=60, temperature=0).token_ids
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"json_schema": "{not json"}, "json_schema: not valid JSON"),
        ({"json_schema": ["a list"]}, "json_schema must be a dict"),
        ({"json_schema": {"type": "object"}, "regex": "a"}, "at most one"),
        ({"regex": 5}, "regex must be a string"),
    ],
)
def test_bad_constraints_are_refused_when_made(options, message):
    with pytest.raises(InvalidInputError, match=message):
        SamplingParams(**options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"json_schema": {"type": "no-such-type"}}, "json_schema: "),
        ({"json_schema": {"type": "string", "minLength": 5, "maxLength": 2}}, "json_schema: "),
        ({"regex": "(unclosed"}, "regex: "),
        ({"grammar": "start: missing_rule"}, "grammar: "),
        ({"grammar": "start: A\nA: /a/ & /b/"}, "matches no text"),
    ],
)
def test_constraints_the_engine_cannot_compile_or_satisfy_are_invalid_input(demo, options, message):
    with pytest.raises(InvalidInputError, match=message):
        demo.generate("Hi", max_new_tokens=5, **options)
    # And the engine goes on serving.
    assert demo.generate("Hi", max_new_tokens=2).token_ids


def _expected_bytes(tok, i: int, spacer: int | None) -> bytes | None:
    """What token i writes according to the tokenizers package (None when it
    cannot say: a partial UTF-8 sequence)."""
    piece = tok.id_to_token(i)
    if piece is None:
        return b""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    if spacer is None:
        text = tok.decode([i], skip_special_tokens=False)
    else:
        # SentencePiece strips the first space of the text: decode after a plain token.
        before = tok.decode([spacer], skip_special_tokens=False)
        text = tok.decode([spacer, i], skip_special_tokens=False)[len(before) :]
    return None if "\ufffd" in text else text.encode()


@pytest.mark.parametrize("which", ["demo", "llama"])
def test_token_bytes_match_the_tokenizer(which, demo, llama):
    from tokenizers import Tokenizer

    engine = demo if which == "demo" else llama
    text = engine._native.tokenizer_json()
    tok = Tokenizer.from_str(text)
    spec = json.loads(text)
    specials = {t["id"]: t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    vocab = engine.vocab_size
    got = token_bytes(text, vocab)
    assert len(got) == vocab
    spacer = None if which == "demo" else tok.token_to_id("a")
    checked = 0
    for i in range(min(vocab, tok.get_vocab_size())):
        if i in specials:
            assert got[i] == b"\xff" + specials[i].encode(), i
            continue
        want = _expected_bytes(tok, i, spacer)
        if want is not None:
            assert got[i] == want, (i, tok.id_to_token(i), got[i], want)
            checked += 1
    assert checked > vocab // 2


def test_a_sentencepiece_model_writes_constrained_text(llama):
    # Spaces, a newline (a byte-fallback token) and a multi-byte character.
    target = "ab cd\né"
    out = llama.generate("Hello", regex=r"ab cd\né", max_new_tokens=30, temperature=0)
    assert str(out) == target and out.finish_reason == "stop"
    out = llama.generate("Hello", regex=r"[0-9]{2}:[0-9]{2}!", max_new_tokens=12)
    assert len(str(out)) == 6 and str(out)[2] == ":" and out.finish_reason == "stop", str(out)
    # This vocabulary has no token for "{": no JSON can be written, which is
    # an error at once, not a generation that never ends.
    with pytest.raises(InvalidInputError, match="matches no text"):
        llama.generate("Hello", json_schema={"type": "object"}, max_new_tokens=5)


# ----------------------------------------------------------------------
# The server: response_format and forced tool calls, live with the real clients


# A short template writing Qwen3's (hermes) tool calls: Qwen3's own renders a
# tool preamble longer than the demo model's 512 positions.
HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call: {% for t in tools %}{{ t.function.name }} {% endfor %}"
    'as <tool_call>{"name": .., "arguments": ..}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["location", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER_SCHEMA},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "cet"]}},
                "required": ["zone"],
            },
        },
    },
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class HermesDemo(colibri.Engine):
    """The demo model behind a template with hermes tool calls: the demo
    model writes no tool call by itself; constrained decoding makes it."""

    chat_template = HERMES  # type: ignore[assignment]


@pytest.fixture(scope="module")
def hermes_demo():
    return HermesDemo.demo(threads=2, max_batch=8)


@pytest.fixture(scope="module")
def agent_url(hermes_demo):
    with live(create_app(hermes_demo)) as u:
        yield u


@pytest.fixture(scope="module")
def demo_url(demo):
    with live(create_app(demo)) as u:
        yield u


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_response_format_json_schema_and_json_object(demo_url):
    c = oai(demo_url)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = c.chat.completions.create(
        model="demo", messages=USER, response_format=fmt, max_tokens=200, temperature=0
    )
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].message.content), PERSON)
    r = c.chat.completions.create(
        model="demo", messages=USER, response_format={"type": "json_object"}, max_tokens=300, temperature=0
    )
    content = r.choices[0].message.content
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    # Streamed, the pieces join to the same JSON.
    pieces = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="demo", messages=USER, response_format=fmt, max_tokens=200, temperature=0, stream=True
        )
        if ch.choices
    ]
    validate(json.loads("".join(pieces)), PERSON)


def test_a_schema_the_engine_cannot_compile_is_a_400(demo_url):
    for fmt in (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 3, "maxLength": 1}},
        },
    ):
        r = httpx.post(
            demo_url + "/v1/chat/completions", json={"messages": USER, "response_format": fmt}, timeout=60
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format", r.text
    r = httpx.post(demo_url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200


def test_tool_choice_required_and_named_force_a_valid_call(agent_url):
    c = oai(agent_url)
    r = c.chat.completions.create(
        model="demo",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(t.function.name in ("get_weather", "get_time") for t in calls)
    for t in calls:
        args = json.loads(t.function.arguments)
        if t.function.name == "get_weather":
            validate_weather(args)
        else:
            assert args["zone"] in ("utc", "cet")
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(
        model="demo",
        messages=USER,
        tools=TOOLS,
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0.9,
        seed=11,
    )
    calls = r.choices[0].message.tool_calls
    assert [t.function.name for t in calls] == ["get_weather"], r
    validate_weather(json.loads(calls[0].function.arguments))
    # Streamed: each call's argument deltas join to valid arguments.
    args: dict[int, str] = {}
    stream = c.chat.completions.create(
        model="demo",
        messages=USER,
        tools=TOOLS,
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    for ch in stream:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert list(args) == [0]
    validate_weather(json.loads(args[0]))


def validate_weather(args) -> None:
    assert set(args) == {"location", "days"}, args
    assert isinstance(args["location"], str) and len(args["location"]) <= 20
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 14


def test_anthropic_any_and_tool_force_a_tool_use(agent_url):
    c = anthropic.Anthropic(base_url=agent_url, api_key="none", max_retries=0, timeout=120)
    tools = [{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER_SCHEMA}]
    for choice in (
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ):
        r = c.messages.create(
            model="demo",
            max_tokens=200,
            messages=USER,
            tools=tools,
            tool_choice=choice,
            extra_body={"temperature": 0},
        )
        assert r.stop_reason == "tool_use", r
        uses = [b for b in r.content if b.type == "tool_use"]
        assert uses and uses[0].name == "get_weather"
        validate_weather(uses[0].input)


def test_engine_chat_forces_a_call_too(hermes_demo):
    r = hermes_demo.chat(
        USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_new_tokens=200,
        temperature=0,
    )
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1, r
    # Parallel calls allowed: the demo model keeps calling (it never chooses to
    # end), each call whole, until max_new_tokens.
    r = hermes_demo.chat(USER, tools=TOOLS, tool_choice="required", max_new_tokens=120, temperature=0)
    assert len(r.tool_calls) >= 2 and all(json.loads(t.arguments) for t in r.tool_calls[:-1])


@pytest.mark.parametrize(
    "fmt", ["hermes", "qwen_xml", "glm", "deepseek", "dsml", "kimi", "minimax", "harmony"]
)
def test_every_format_has_a_grammar_the_engine_compiles_and_its_parser_reads(fmt, demo):
    """Each format's forced-call grammar compiles, and text it allows parses back
    to the call: the demo model writes under it (markers as text, the demo
    tokenizer has no such special tokens) and the format's parser reads it."""
    from colibri._tools import OutputParser, call_grammar

    grammar = call_grammar(fmt, TOOLS, name="get_time", parallel=False)
    out = demo.generate("The time is", grammar=grammar, max_new_tokens=400, temperature=0)
    assert out.finish_reason == "stop", (fmt, str(out))
    if fmt == "harmony":
        assert "to=functions.get_time" in out and '"zone"' in out
        return
    parser = OutputParser(fmt, False, "", TOOLS)
    parser.feed(str(out))
    parser.finish()
    assert [t.name for t in parser.tool_calls] == ["get_time"], (fmt, str(out))
    assert json.loads(parser.tool_calls[0].arguments)["zone"] in ("utc", "cet")


def test_the_cli_takes_a_schema_file_a_regex_and_a_grammar_file(tmp_path):
    import subprocess
    import sys

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(PERSON), encoding="utf-8")
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"\n', encoding="utf-8")

    def cli(*args: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "-m",
            "colibri",
            "generate",
            "--demo",
            "Hello",
            "-t",
            "0",
            "--threads",
            "2",
            *args,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    r = cli("--json-schema", str(schema), "-n", "200")
    assert r.returncode == 0, r.stderr
    validate(json.loads(r.stdout), PERSON)
    r = cli("--regex", "[0-9]{3}")
    assert r.returncode == 0 and len(r.stdout.strip()) == 3 and r.stdout.strip().isdigit(), r
    r = cli("--grammar", str(grammar))
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no"), r
    r = cli("--regex", "(")
    assert r.returncode != 0 and "regex" in r.stderr
    r = cli("--json-schema", str(tmp_path / "missing.json"))
    assert r.returncode != 0 and "--json-schema" in r.stderr


def test_anthropic_output_config_format_is_json_valid_against_it(demo_url):
    body = {
        "model": "demo",
        "max_tokens": 200,
        "messages": USER,
        "temperature": 0,
        "output_config": {"format": {"type": "json_schema", "schema": PERSON}},
    }
    r = httpx.post(demo_url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    validate(json.loads(r.json()["content"][0]["text"]), PERSON)
    body["output_config"] = {"format": {"type": "json_schema", "schema": {"type": "nope"}}}
    r = httpx.post(demo_url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_markers_that_are_special_tokens_are_written_as_those_tokens(demo):
    from colibri._tools import call_grammar

    # Pretend the demo's one special token opens and closes a call.
    grammar = call_grammar("deepseek", TOOLS, name="get_time", parallel=False, special={"<｜tool▁sep｜>": 0})
    assert "<[0]>" in grammar
    out = demo.generate(
        "The time is", grammar=grammar, max_new_tokens=400, temperature=0, skip_special_tokens=False
    )
    assert out.finish_reason == "stop" and 0 in out.token_ids, str(out)
    assert '<|endoftext|>{"zone": ' in str(out)
