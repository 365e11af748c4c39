"""Tool calls and reasoning in a model's own output syntax.

Each family writes tool calls its own way, and the chat template that came
with the checkpoint shows which: :func:`detect` reads the template's source
for the markers it renders and picks one format. An :class:`OutputParser`
of that format is fed the decoded text piece by piece (as a stream yields
it) and splits it into answer text, reasoning text and tool calls, each
call as OpenAI streams it: first its index, id and name, then fragments of
its arguments (a JSON object) that join to the whole.

The formats (``FORMATS``):

==============  ==============================================================
``hermes``      Qwen3 / Qwen3-MoE: ``<tool_call>{"name": .., "arguments": ..}</tool_call>``
``qwen_xml``    Qwen3-Coder, Qwen3.5/3.6: ``<tool_call><function=NAME>``
                ``<parameter=P>V</parameter></function></tool_call>``
``glm``         GLM-4.5/4.6/4.7/5: ``<tool_call>NAME<arg_key>K</arg_key>``
                ``<arg_value>V</arg_value></tool_call>``
``deepseek``    DeepSeek-V3.1 (and V3.2-Exp): ``<｜tool▁calls▁begin｜>``
                ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``...
``dsml``        DeepSeek-V3.2: ``<｜DSML｜function_calls><｜DSML｜invoke name="N">``
                ``<｜DSML｜parameter name="P" string="true">V</｜DSML｜parameter>``...
``kimi``        Kimi K2: ``<|tool_calls_section_begin|><|tool_call_begin|>``
                ``functions.NAME:I<|tool_call_argument_begin|>ARGS<|tool_call_end|>``...
``minimax``     MiniMax-M2: ``<minimax:tool_call><invoke name="N">``
                ``<parameter name="P">V</parameter></invoke></minimax:tool_call>``
``harmony``     GPT-OSS: messages on the analysis / commentary / final
                channels; a call is a commentary message ``to=functions.NAME``
==============  ==============================================================

Reasoning is the text between ``<think>`` and ``</think>`` for templates
that use them (a template that opens ``<think>`` in the prompt starts the
generation inside it), and harmony's analysis channel.

Markers may arrive split across pieces: text that could be the start of a
marker is held back until it is known. Markup left unfinished when the
generation ends is returned as answer text, never dropped; a call whose name
was already streamed keeps the arguments it got (as OpenAI's calls cut by
``max_tokens`` do).

The parameter values of the XML formats are text; each is typed by the
tool's JSON Schema: a string parameter stays as written, a number, boolean,
array or object is read as JSON (kept as text if it does not parse).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._errors import InvalidInputError

__all__ = [
    "FORMATS",
    "CallDelta",
    "Delta",
    "OutputParser",
    "ToolCall",
    "call_grammar",
    "detect",
    "check_tools",
    "new_call_id",
    "parser_for",
    "prepare_messages",
]

#: The tool-call formats, by name.
FORMATS = ("hermes", "qwen_xml", "glm", "deepseek", "dsml", "kimi", "minimax", "harmony")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def new_call_id() -> str:
    """A fresh call id, as OpenAI spells them."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model made: its id, the function's name and its
    arguments as JSON text (an object)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class CallDelta:
    """A piece of the call at ``index``: its id and name come once, first;
    ``arguments`` are fragments of the arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    """What a piece of generated text brought."""

    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def merge(self, other: Delta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        for c in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == c.index and c.id is None and c.name is None:
                last.arguments += c.arguments
            else:
                self.calls.append(CallDelta(c.index, c.id, c.name, c.arguments))


# ----------------------------------------------------------------------
# What the template is given


class JsonArguments(dict):  # type: ignore[type-arg]
    """A call's arguments as the template sees them: a mapping (templates
    that walk the arguments, ``is mapping``, ``| tojson``) that reads as its
    JSON text where a template joins it to a string (DeepSeek-V3.1 writes
    ``'<｜tool▁sep｜>' + arguments``)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: Any) -> Any:
        return str(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + str(self) if isinstance(other, str) else NotImplemented


def check_tools(tools: Any, field: str = "tools") -> list[dict[str, Any]]:
    """Validates OpenAI's ``tools``: a list of ``{"type": "function",
    "function": {"name", "description"?, "parameters"?}}``. A bad entry is an
    :class:`InvalidInputError` whose message starts with the field's path."""
    if not isinstance(tools, list):
        raise InvalidInputError(f"{field}: must be a list of tools")
    names: set[str] = set()
    out = []
    for i, t in enumerate(tools):
        at = f"{field}[{i}]"
        if not isinstance(t, Mapping):
            raise InvalidInputError(f"{at}: must be an object")
        if t.get("type") != "function":
            raise InvalidInputError(f"{at}.type: must be 'function'")
        f = t.get("function")
        if not isinstance(f, Mapping):
            raise InvalidInputError(f"{at}.function: must be an object with a name")
        unknown = sorted(set(f) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise InvalidInputError(f"{at}.function.{unknown[0]}: unknown field")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name):
            raise InvalidInputError(
                f"{at}.function.name: must be 1 to 64 letters, digits or '_-.:', got {json.dumps(name)}"
            )
        if name in names:
            raise InvalidInputError(f"{at}.function.name: {name!r} is given twice")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise InvalidInputError(f"{at}.function.description: must be a string")
        params = f.get("parameters")
        if params is not None:
            if not isinstance(params, Mapping):
                raise InvalidInputError(f"{at}.function.parameters: must be a JSON Schema object")
            if params.get("type", "object") != "object":
                raise InvalidInputError(f"{at}.function.parameters.type: must be 'object'")
            props = params.get("properties")
            if props is not None and not (
                isinstance(props, Mapping) and all(isinstance(v, Mapping) for v in props.values())
            ):
                raise InvalidInputError(f"{at}.function.parameters.properties: must map names to schemas")
        out.append({"type": "function", "function": dict(f)})
    return out


def prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A conversation made ready for a chat template: an assistant turn's
    ``tool_calls`` checked, their arguments (JSON text or an object) given
    as :class:`JsonArguments`, a missing content as ""; each ``tool`` turn's
    ``tool_call_id`` must name a call made before it. Errors are
    :class:`InvalidInputError` starting with the field's path."""
    out: list[dict[str, Any]] = []
    known: set[str] = set()
    for i, m in enumerate(messages):
        m = dict(m)
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise InvalidInputError(f"messages[{i}].tool_calls: must be a list")
            fixed = []
            for j, c in enumerate(calls):
                at = f"messages[{i}].tool_calls[{j}]"
                f = c.get("function") if isinstance(c, Mapping) else None
                if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
                    raise InvalidInputError(f"{at}.function: must be an object with a name and arguments")
                args = f.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError as e:
                        raise InvalidInputError(f"{at}.function.arguments: is not valid JSON: {e}") from None
                if not isinstance(args, Mapping):
                    raise InvalidInputError(f"{at}.function.arguments: must be a JSON object")
                cid = c.get("id")
                if cid is not None and not isinstance(cid, str):
                    raise InvalidInputError(f"{at}.id: must be a string")
                if cid:
                    known.add(cid)
                fixed.append(
                    {
                        **c,
                        "type": "function",
                        "function": {**f, "arguments": JsonArguments(args)},
                    }
                )
            m["tool_calls"] = fixed
            if m.get("content") is None:
                m["content"] = ""
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str):
                raise InvalidInputError(
                    f"messages[{i}].tool_call_id: a tool message needs the id of its call"
                )
            if cid not in known:
                raise InvalidInputError(
                    f"messages[{i}].tool_call_id: no earlier assistant message made a call with id {cid!r}"
                )
            if m.get("content") is None:
                m["content"] = ""
        out.append(m)
    return out


# ----------------------------------------------------------------------
# Choosing a format


def detect(template: str | None) -> tuple[str | None, bool]:
    """The tool-call format a chat template renders (None when it renders
    none colibri knows) and whether it marks reasoning with ``<think>``."""
    if not template:
        return None, False
    think = THINK_OPEN in template and THINK_CLOSE in template
    if "<|channel|>" in template and "<|message|>" in template:
        return "harmony", False
    if "<|tool_calls_section_begin|>" in template:
        return "kimi", think
    if "<minimax:tool_call>" in template or "minimax:tool_call" in template:
        return "minimax", think
    if "DSML" in template and "function_calls" in template:
        return "dsml", think
    if "tool▁calls▁begin" in template:
        return "deepseek", think
    if "<arg_key>" in template:
        return "glm", think
    if "<function=" in template and "<parameter=" in template:
        return "qwen_xml", think
    if "<tool_call>" in template:
        return "hermes", think
    return None, think


def parser_for(
    template: str | None,
    prompt: str,
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    drop: Iterable[str] = (),
    call_id: Any = new_call_id,
) -> OutputParser | None:
    """The parser for a generation from ``prompt`` (the rendered chat), or
    None when there is nothing to parse: no tools given (or no format the
    template shows) and no reasoning markers. ``tools`` are OpenAI's tool
    entries (their schemas type the XML formats' values); ``drop`` lists
    texts to remove from the output (end-of-sequence and padding tokens,
    which show once special tokens are kept)."""
    fmt, think = detect(template)
    if fmt == "harmony":
        return HarmonyParser(tools or [], drop=drop, call_id=call_id)
    if not tools:
        fmt = None
    if fmt is None and not think:
        return None
    return OutputParser(fmt, think, prompt, tools or [], drop=drop, call_id=call_id)


# ----------------------------------------------------------------------
# Forcing a call: a grammar of the format, for constrained decoding

#: How colibri writes JSON under a constraint (llguidance's compile options).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _embedded(schema: Any) -> str:
    """``%json {...}`` of a schema, compact as a top-level one is."""
    schema = dict(schema) if isinstance(schema, Mapping) else {}
    schema.setdefault("x-guidance", _COMPACT)
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _is_string(schema: Any) -> bool:
    return _schema_types(schema) == {"string"}


def _xml_text(schema: Any) -> str:
    """A string value of an XML format, between its tags: one of the
    schema's strings for an ``enum`` or ``const``, else text without ``<``
    (at most ``maxLength`` characters when the schema gives it)."""
    values = schema.get("enum") if "enum" in schema else [schema["const"]] if "const" in schema else None
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in values) + ")"
    most = schema.get("maxLength")
    if isinstance(most, int) and not isinstance(most, bool) and most >= 0:
        return f"/[^<]{{0,{most}}}/"
    return "XML_TEXT"


def _closed(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema with no properties beyond those it names,
    unless it says otherwise (a forced call writes only declared arguments)."""
    out = dict(schema)
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def call_grammar(
    fmt: str | None,
    tools: Sequence[Mapping[str, Any]],
    *,
    name: str | None = None,
    parallel: bool = True,
    special: Mapping[str, int] | None = None,
    after_think: bool = False,
) -> str:
    """A Lark grammar (llguidance's dialect) that makes the model write one
    tool call (several when ``parallel``) in ``fmt``, the format its template
    uses, to ``name`` or to any of ``tools``, with arguments valid against the
    tool's JSON Schema. Markers that are special tokens (``special``: text to
    id) are matched as those tokens. ``after_think``: the prompt left a
    ``<think>`` open; the grammar closes it first.

    The JSON formats (hermes, DeepSeek-V3.1, Kimi K2, harmony) constrain the
    whole arguments object. The XML formats (Qwen3-Coder, GLM, MiniMax,
    DeepSeek-V3.2 DSML) write one element per parameter: the required
    parameters come in the schema's order, then each optional one or not;
    a non-string value is JSON valid against its schema, a string value is
    one of its ``enum`` strings, or else any text without ``<`` (the formats
    cannot say where a value holding ``<`` ends) of at most its
    ``maxLength``. An object schema that does not say otherwise takes no
    properties beyond those it names."""
    if fmt is None:
        raise InvalidInputError(
            "tool_choice: this model's chat template writes no tool-call format colibri can read"
        )
    special = special or {}
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise InvalidInputError(f"tool_choice: no tool named {name!r} in tools")

    def lit(text: str) -> str:
        return f"<[{special[text]}]>" if text in special else json.dumps(text, ensure_ascii=False)

    def params(f: Mapping[str, Any]) -> Mapping[str, Any]:
        p = f.get("parameters")
        return _closed(p) if isinstance(p, Mapping) else {"type": "object", "properties": {}}

    def xml_args(f: Mapping[str, Any], open_: Any, close: str) -> str:
        """The parameters of one call, each ``open_(key, schema) VALUE close``."""
        props = params(f).get("properties") or {}
        required = [k for k in params(f).get("required") or [] if k in props]
        parts = []
        for k in [*required, *[k for k in props if k not in required]]:
            value = _xml_text(props[k]) if _is_string(props[k]) else _embedded(props[k])
            part = f"({open_(k, props[k])} {value} {lit(close)})"
            parts.append(part if k in required else part + "?")
        return " ".join(parts) if parts else '""'

    rules: list[str] = []
    calls: list[str] = []
    for i, f in enumerate(chosen):
        n, rule = f["name"], f"call_{i}"
        if fmt == "hermes":
            obj = {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": params(f)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            body = f'{lit("<tool_call>")} "\\n" {_embedded(obj)} "\\n" {lit("</tool_call>")}'
        elif fmt == "qwen_xml":
            args = xml_args(
                f, lambda k, _: json.dumps(f"<parameter={k}>\n", ensure_ascii=False), "\n</parameter>\n"
            )
            body = " ".join(
                [
                    lit("<tool_call>"),
                    json.dumps(f"\n<function={n}>\n", ensure_ascii=False),
                    args,
                    json.dumps("</function>\n", ensure_ascii=False),
                    lit("</tool_call>"),
                ]
            )
        elif fmt == "glm":

            def glm_key(k: str, _: Any) -> str:
                key = json.dumps(k, ensure_ascii=False)
                return f"{lit('<arg_key>')} {key} {lit('</arg_key>')} {lit('<arg_value>')}"

            args = xml_args(f, glm_key, "</arg_value>")
            body = f"{lit('<tool_call>')} {json.dumps(n, ensure_ascii=False)} {args} {lit('</tool_call>')}"
        elif fmt in ("minimax", "dsml"):
            p = "｜DSML｜" if fmt == "dsml" else ""

            def open_(k: str, schema: Any, p: str = p) -> str:
                flag = (' string="true"' if _is_string(schema) else ' string="false"') if p else ""
                return json.dumps(f'<{p}parameter name="{k}"{flag}>', ensure_ascii=False)

            args = xml_args(f, open_, f"</{p}parameter>\n")
            body = " ".join(
                [
                    json.dumps(f'<{p}invoke name="{n}">\n', ensure_ascii=False),
                    args,
                    json.dumps(f"</{p}invoke>\n", ensure_ascii=False),
                ]
            )
        elif fmt == "deepseek":
            body = " ".join(
                [
                    lit("<｜tool▁call▁begin｜>"),
                    json.dumps(n, ensure_ascii=False),
                    lit("<｜tool▁sep｜>"),
                    _embedded(params(f)),
                    lit("<｜tool▁call▁end｜>"),
                ]
            )
        elif fmt == "kimi":
            body = " ".join(
                [
                    lit("<|tool_call_begin|>"),
                    json.dumps(f"functions.{n}:", ensure_ascii=False),
                    "/[0-9]{1,3}/",
                    lit("<|tool_call_argument_begin|>"),
                    _embedded(params(f)),
                    lit("<|tool_call_end|>"),
                ]
            )
        elif fmt == "harmony":
            body = " ".join(
                [
                    lit("<|channel|>"),
                    json.dumps(f"commentary to=functions.{n} ", ensure_ascii=False),
                    lit("<|constrain|>"),
                    '"json"',
                    lit("<|message|>"),
                    _embedded(params(f)),
                    lit("<|call|>"),
                ]
            )
        else:
            raise InvalidInputError(f"tool_choice: forcing a call is not built for the {fmt} format")
        rules.append(f"{rule}: {body}")
        calls.append(rule)
    rules.append("call: " + " | ".join(calls))
    sep = {"hermes": '"\\n"', "qwen_xml": '"\\n"', "glm": '"\\n"'}.get(fmt, "")
    many = f"call ({sep} call)*" if parallel else "call"
    if fmt == "harmony" and parallel:
        many = f'call ({lit("<|start|>")} "assistant" call)*'
    section = {
        "minimax": (lit("<minimax:tool_call>") + ' "\\n"', lit("</minimax:tool_call>")),
        "dsml": (lit("<｜DSML｜function_calls>") + ' "\\n"', lit("</｜DSML｜function_calls>")),
        "deepseek": (lit("<｜tool▁calls▁begin｜>"), lit("<｜tool▁calls▁end｜>")),
        "kimi": (lit("<|tool_calls_section_begin|>"), lit("<|tool_calls_section_end|>")),
    }.get(fmt)
    start = f"{section[0]} {many} {section[1]}" if section else many
    if after_think:
        start = f'{lit(THINK_CLOSE)} "\\n\\n" {start}'
    rules.insert(0, f"start: {start}")
    rules.append(r"XML_TEXT: /[^<]*/")
    return "\n".join(rules) + "\n"


# ----------------------------------------------------------------------
# Typing a parameter value by the tool's schema


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, Mapping):
        return set()
    t = schema.get("type")
    types = (
        {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    )
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types |= _schema_types(option)
    if not types and "enum" in schema:
        types = {type_name(v) for v in schema["enum"]}
    return types


def type_name(v: Any) -> str:
    """The JSON Schema type name of a JSON value."""
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if v is None:
        return "null"
    return "array" if isinstance(v, list) else "object"


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema asks for: a string as
    written; numbers, booleans, null, arrays and objects read as JSON. A
    parameter the schema does not name, or a text that does not parse, stays
    a string."""
    types = _schema_types(schema)
    if not types or types == {"string"}:
        return text
    s = text.strip()
    if "null" in types and s.lower() in ("null", "none"):
        return None
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    try:
        v = json.loads(s)
    except ValueError:
        if "number" in types or "integer" in types:
            try:
                f = float(s)
            except ValueError:
                return text
            return int(f) if "integer" in types and f.is_integer() else f
        return text
    if type_name(v) in types or (type_name(v) == "integer" and "number" in types):
        return v
    if "string" in types:
        return text
    return v


def _properties(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for t in tools:
        f = t.get("function") if isinstance(t.get("function"), Mapping) else t
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
            continue
        params = f.get("parameters") or f.get("input_schema") or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[f["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


# ----------------------------------------------------------------------
# Text scanning helpers


def _held(buf: str, markers: Iterable[str]) -> int:
    """How many characters at the end of ``buf`` could be the start of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if m.startswith(buf[-k:]):
                best = k
                break
    return best


def _first(buf: str, markers: Iterable[str]) -> tuple[int, str] | None:
    """The earliest marker found in ``buf`` and where."""
    hits = [(buf.find(m), m) for m in markers]
    found = [(i, m) for i, m in hits if i >= 0]
    return min(found, key=lambda h: (h[0], -len(h[1]))) if found else None


class _Calls:
    """The calls a parser has started: numbering, ids and the deltas out."""

    def __init__(self, call_id: Any) -> None:
        self.call_id = call_id
        self.done: list[ToolCall] = []
        self.name: str | None = None
        self.id = ""
        self.args = ""
        self.out: list[CallDelta] = []

    @property
    def open(self) -> bool:
        return self.name is not None

    def start(self, name: str, call_id: str | None = None) -> None:
        self.name, self.args = name, ""
        self.id = call_id or self.call_id()
        self.out.append(CallDelta(len(self.done), self.id, name, ""))

    def add(self, fragment: str) -> None:
        if fragment:
            self.args += fragment
            self.out.append(CallDelta(len(self.done), None, None, fragment))

    def end(self) -> None:
        if self.name is not None:
            self.done.append(ToolCall(self.id, self.name, self.args))
            self.name = None

    def take(self) -> list[CallDelta]:
        out, self.out = self.out, []
        return out


# ----------------------------------------------------------------------
# Section bodies: one class per way of writing calls inside the markers.


class _Body:
    """The text inside one tool-call section (after its opening marker).
    ``feed`` takes more of it and returns True once the closing marker was
    read (what follows it is left in ``rest``); ``finish`` returns the raw
    text of a call that never got as far as its name."""

    end: str

    def __init__(self, calls: _Calls, props: Mapping[str, Mapping[str, Any]]) -> None:
        self.calls, self.props = calls, props
        self.buf = ""
        self.raw = ""  # consumed text of a call not started yet
        self.rest = ""

    def feed(self, text: str) -> bool:
        self.buf += text
        return self.step()

    def step(self) -> bool:
        raise NotImplementedError

    def _close(self) -> bool:
        """Reads the section's end if it is next; True when read."""
        s = self.buf.lstrip()
        if s.startswith(self.end):
            self.rest = s[len(self.end) :]
            self.buf, self.raw = "", ""
            return True
        return False

    def _open_call(self, s: str, pattern: str) -> bool:
        """Starts a call where ``s`` (the buffer without its leading space)
        opens one by ``pattern``, whose first group is the name; False while
        it does not."""
        m = re.match(pattern, s)
        if m is None:
            return False
        self.raw += self.buf[: len(self.buf) - len(s) + m.end()]
        self.calls.start(m.group(1).strip())
        self.buf = s[m.end() :]
        return True

    def _value(self, name: str, key: str, text: str) -> Any:
        return typed_value(text, self.props.get(name, {}).get(key))

    def _param(self, key: str, value: Any, first: bool) -> None:
        self.calls.add(
            ("{" if first else ", ")
            + json.dumps(key, ensure_ascii=False)
            + ": "
            + json.dumps(value, ensure_ascii=False)
        )

    def finish(self) -> str | None:
        """At the end of the generation: an open call is closed with what it
        has (None); else the text read since the last whole call."""
        if self.calls.open:
            self._finish_open()
            self.calls.end()
            return None
        return self.raw + self.buf

    def _finish_open(self) -> None:
        pass


class _HermesBody(_Body):
    """``{"name": "f", "arguments": {...}}</tool_call>``: the arguments are
    streamed as they come, the object's own closing brace held back."""

    end = "</tool_call>"
    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

    def __init__(self, calls: _Calls, props: Mapping[str, Mapping[str, Any]]) -> None:
        super().__init__(calls, props)
        self.pending = ""  # arguments text not yet sent (a possible closing brace and space)

    def step(self) -> bool:
        if not self.calls.open:
            m = self._HEAD.match(self.buf)
            if m is None:
                i = self.buf.find(self.end)
                if i < 0:
                    return False
                # Not name-first: read the whole object at once.
                try:
                    obj = json.loads(self.buf[:i])
                except ValueError:
                    obj = None
                if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                    return False  # left as text at the end
                args = obj.get("arguments", obj.get("parameters", {}))
                self.calls.start(obj["name"])
                self.calls.add(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
                self.calls.end()
                self.rest, self.buf, self.raw = self.buf[i + len(self.end) :], "", ""
                return True
            self.calls.start(json.loads(f'"{m.group(1)}"'))
            self.buf = self.buf[m.end() :]
        i = self.buf.find(self.end)
        text = self.buf if i < 0 else self.buf[:i]
        hold = 0 if i >= 0 else _held(text, [self.end])
        self.pending += text[: len(text) - hold]
        self.buf = self.buf[len(text) - hold :]
        if i >= 0:
            args = self.pending.rstrip()
            if args.endswith("}"):
                args = args[:-1].rstrip()
            self.calls.add(args)
            self.calls.end()
            self.rest, self.buf, self.raw, self.pending = self.buf[len(self.end) :], "", "", ""
            return True
        # Send all but a possible final "}" and the space around it.
        keep = len(self.pending) - len(self.pending.rstrip())
        core = self.pending[: len(self.pending) - keep]
        if core.endswith("}"):
            keep += 1 + len(core[:-1]) - len(core[:-1].rstrip())
        send = self.pending[: len(self.pending) - keep]
        self.calls.add(send)
        self.pending = self.pending[len(send) :]
        return False

    def _finish_open(self) -> None:
        self.calls.add(self.pending + self.buf)


class _QwenXmlBody(_Body):
    """``<function=NAME><parameter=P>\\nV\\n</parameter>...</function></tool_call>``."""

    end = "</tool_call>"

    def __init__(self, calls: _Calls, props: Mapping[str, Mapping[str, Any]]) -> None:
        super().__init__(calls, props)
        self.nparams = 0

    def step(self) -> bool:
        while True:
            s = self.buf.lstrip()
            if not self.calls.open:
                if self._close():
                    return True
                if not self._open_call(s, r"<function=([^>]*)>"):
                    return False
                self.nparams = 0
                continue
            if s.startswith("</function>") or s.startswith(self.end):
                # (a model may leave </function> out)
                self.calls.add("}" if self.nparams else "{}")
                self.calls.end()
                self.buf = s[len("</function>") :] if s.startswith("</function>") else s
                self.raw = ""
                continue
            if not s.startswith("<parameter="):
                return False
            close = s.find(">")
            if close < 0:
                return False
            key = s[len("<parameter=") : close].strip()
            body = s[close + 1 :]
            # A value ends at </parameter>, or where the next part begins when that is left out.
            hit = _first(body, ["</parameter>", "<parameter=", "</function>"])
            if hit is None:
                return False
            value = body[: hit[0]]
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            self._param(key, self._value(self.calls.name or "", key, value), self.nparams == 0)
            self.nparams += 1
            self.buf = body[hit[0] + (len(hit[1]) if hit[1] == "</parameter>" else 0) :]

    def _finish_open(self) -> None:
        self.calls.add("}" if self.nparams else "{}")


class _GlmBody(_Body):
    """``NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``
    (GLM-4.5/4.6 put newlines between the parts, 4.7 and 5 do not)."""

    end = "</tool_call>"

    def __init__(self, calls: _Calls, props: Mapping[str, Mapping[str, Any]]) -> None:
        super().__init__(calls, props)
        self.nparams = 0

    def step(self) -> bool:
        if not self.calls.open:
            s = self.buf.lstrip()
            hit = _first(s, ["<arg_key>", self.end, "\n"])
            if hit is None or not s[: hit[0]].strip():
                return False
            self.raw += self.buf[: len(self.buf) - len(s) + hit[0]]
            self.calls.start(s[: hit[0]].strip())
            self.buf = s[hit[0] :]
            self.nparams = 0
        while True:
            s = self.buf.lstrip()
            if s.startswith(self.end):
                self.calls.add("}" if self.nparams else "{}")
                self.calls.end()
                self.rest, self.buf, self.raw = s[len(self.end) :], "", ""
                return True
            m = re.match(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", s, re.S)
            if m is None:
                return False
            name = self.calls.name or ""
            self._param(
                m.group(1).strip(), self._value(name, m.group(1).strip(), m.group(2)), self.nparams == 0
            )
            self.nparams += 1
            self.buf = s[m.end() :]

    def _finish_open(self) -> None:
        self.calls.add("}" if self.nparams else "{}")


class _InvokeBody(_Body):
    """``<invoke name="N"><parameter name="P">V</parameter></invoke>...``
    then the section's end: MiniMax-M2 (no prefix) and DeepSeek-V3.2's
    DSML (every tag's name prefixed by ``｜DSML｜``, and a ``string``
    attribute saying whether the value is a string or JSON)."""

    def __init__(self, calls: _Calls, props: Mapping[str, Mapping[str, Any]], prefix: str, end: str) -> None:
        super().__init__(calls, props)
        self.p, self.end = prefix, end
        self.nparams = 0

    def step(self) -> bool:
        p = self.p
        while True:
            s = self.buf.lstrip()
            if not self.calls.open:
                if self._close():
                    return True
                if not self._open_call(s, rf'<{re.escape(p)}invoke\s+name\s*=\s*"?([^">]*)"?\s*>'):
                    return False
                self.nparams = 0
                continue
            close = f"</{p}invoke>"
            if s.startswith(close):
                self.calls.add("}" if self.nparams else "{}")
                self.calls.end()
                self.buf, self.raw = s[len(close) :], ""
                continue
            m = re.match(
                rf'<{re.escape(p)}parameter\s+name\s*=\s*"?([^">]*?)"?(?:\s+string\s*=\s*"(true|false)")?\s*>(.*?)</{re.escape(p)}parameter>',
                s,
                re.S,
            )
            if m is None:
                return False
            key, is_string, text = m.group(1).strip(), m.group(2), m.group(3)
            name = self.calls.name or ""
            if is_string == "true":
                value: Any = text
            elif is_string == "false":
                try:
                    value = json.loads(text)
                except ValueError:
                    value = self._value(name, key, text)
            else:
                value = self._value(name, key, text)
            self._param(key, value, self.nparams == 0)
            self.nparams += 1
            self.buf = s[m.end() :]

    def _finish_open(self) -> None:
        self.calls.add("}" if self.nparams else "{}")


class _SepBody(_Body):
    """Calls between special tokens with the arguments' JSON streamed as it
    comes: DeepSeek-V3.1 (``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``)
    and Kimi K2 (``<|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>ARGS<|tool_call_end|>``,
    whose call id is that head, as Kimi's template writes it back)."""

    def __init__(
        self,
        calls: _Calls,
        props: Mapping[str, Mapping[str, Any]],
        begin: str,
        sep: str,
        stop: str,
        end: str,
        kimi: bool,
    ) -> None:
        super().__init__(calls, props)
        self.begin, self.sep, self.stop, self.end, self.kimi = begin, sep, stop, end, kimi

    def step(self) -> bool:
        while True:
            if not self.calls.open:
                if self._close():
                    return True
                s = self.buf.lstrip()
                if not s.startswith(self.begin):
                    return False
                j = s.find(self.sep)
                if j < 0:
                    return False
                head = s[len(self.begin) : j].strip()
                self.raw += self.buf[: len(self.buf) - len(s) + j + len(self.sep)]
                self.buf = s[j + len(self.sep) :]
                if self.kimi:
                    m = re.match(r"(?:functions\.)?(.+?)(?::\d+)?$", head)
                    self.calls.start(m.group(1) if m else head, call_id=head)
                else:
                    self.calls.start(head)
                continue
            i = self.buf.find(self.stop)
            text = self.buf if i < 0 else self.buf[:i]
            hold = 0 if i >= 0 else _held(text, [self.stop])
            send = text[: len(text) - hold]
            if not self.calls.args:
                send = send.lstrip()
            self.calls.add(send)
            self.buf = self.buf[len(text) - hold :]
            if i < 0:
                return False
            self.buf = self.buf[len(self.stop) :]
            self.calls.end()
            self.raw = ""


# ----------------------------------------------------------------------
# The parsers


class OutputParser:
    """Splits a generation's text into answer, reasoning and tool calls.

    ``feed(piece)`` returns the :class:`Delta` the piece brought, ``finish()``
    what was held back; ``content``, ``reasoning`` and ``tool_calls`` hold
    the whole so far."""

    def __init__(
        self,
        fmt: str | None,
        think: bool,
        prompt: str,
        tools: Sequence[Mapping[str, Any]],
        *,
        drop: Iterable[str] = (),
        call_id: Any = new_call_id,
    ) -> None:
        self.format, self.think = fmt, think
        self.drop = [d for d in drop if d]
        self.props = _properties(tools)
        self._calls = _Calls(call_id)
        self.content = ""
        self.reasoning = ""
        self._buf = ""
        self._body: _Body | None = None
        # A template that opens <think> in the prompt: generation starts inside it.
        self._state = "reasoning" if think and prompt.rstrip().endswith(THINK_OPEN) else "content"
        self._lead = True  # strip the newlines that open a reasoning or answer part
        self._ws = ""  # trailing whitespace of the answer held back (dropped before a call)
        self._gap = ""
        self.opener = {
            "hermes": "<tool_call>",
            "qwen_xml": "<tool_call>",
            "glm": "<tool_call>",
            "deepseek": "<｜tool▁calls▁begin｜>",
            "dsml": "<｜DSML｜function_calls>",
            "kimi": "<|tool_calls_section_begin|>",
            "minimax": "<minimax:tool_call>",
        }.get(fmt or "")

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls.done)

    def _new_body(self) -> _Body:
        c, p = self._calls, self.props
        if self.format == "hermes":
            return _HermesBody(c, p)
        if self.format == "qwen_xml":
            return _QwenXmlBody(c, p)
        if self.format == "glm":
            return _GlmBody(c, p)
        if self.format == "minimax":
            return _InvokeBody(c, p, "", "</minimax:tool_call>")
        if self.format == "dsml":
            return _InvokeBody(c, p, "｜DSML｜", "</｜DSML｜function_calls>")
        if self.format == "deepseek":
            return _SepBody(
                c,
                p,
                "<｜tool▁call▁begin｜>",
                "<｜tool▁sep｜>",
                "<｜tool▁call▁end｜>",
                "<｜tool▁calls▁end｜>",
                False,
            )
        return _SepBody(
            c,
            p,
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
            "<|tool_calls_section_end|>",
            True,
        )

    def _markers(self) -> list[str]:
        if self._state == "reasoning":
            return [THINK_CLOSE]
        out = [THINK_OPEN] if self.think else []
        return out + ([self.opener] if self.opener else [])

    def _take_piece(self, piece: str) -> None:
        self._buf += piece
        for d in self.drop:
            self._buf = self._buf.replace(d, "")

    def feed(self, piece: str) -> Delta:
        self._take_piece(piece)
        out = Delta()
        while self._buf:
            if self._state == "section":
                assert self._body is not None
                text, self._buf = self._buf, ""
                done = self._body.feed(text)
                out.calls += self._calls.take()
                if not done:
                    break
                self._buf, self._body, self._state, self._lead = self._body.rest, None, "content", True
                continue
            markers = self._markers()
            hit = _first(self._buf, markers)
            upto = hit[0] if hit else len(self._buf) - _held(self._buf, markers + self.drop)
            self._emit(self._buf[:upto], out, final=hit is not None)
            if hit is None:
                self._buf = self._buf[upto:]
                break
            self._buf = self._buf[upto + len(hit[1]) :]
            if hit[1] == THINK_OPEN:
                self._state, self._lead, self._ws = "reasoning", True, ""
            elif hit[1] == THINK_CLOSE:
                self._state, self._lead = "content", True
            else:
                # The space before a call is the template's, not the answer's
                # (kept aside in case the call never comes to be).
                self._gap, self._ws = self._ws, ""
                self._state, self._body = "section", self._new_body()
        return out

    def _emit(self, text: str, out: Delta, final: bool) -> None:
        if self._lead:
            text = text.lstrip("\n")
            if text:
                self._lead = False
        if self._state == "reasoning":
            # Whitespace before </think> is the template's.
            text = self._ws + text
            keep = len(text) - len(text.rstrip())
            self._ws = "" if final else text[len(text) - keep :]
            text = text[: len(text) - keep]
            self.reasoning += text
            out.reasoning += text
            return
        text = self._ws + text
        keep = len(text) - len(text.rstrip())
        self._ws = text[len(text) - keep :]
        text = text[: len(text) - keep]
        self.content += text
        out.content += text

    def finish(self) -> Delta:
        """The end of the generation: what was held back, unfinished markup as answer text."""
        out = Delta()
        if self._state == "section" and self._body is not None:
            raw = self._body.finish()
            out.calls += self._calls.take()
            if raw is not None:
                text = self._gap + (self.opener or "") + raw
                self.content += text
                out.content += text
            self._body, self._state = None, "content"
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            rest = rest.rstrip()
            self.reasoning += rest
            out.reasoning += rest
        else:
            rest = self._ws + rest
            self.content += rest
            out.content += rest
        self._ws = ""
        return out


class HarmonyParser(OutputParser):
    """GPT-OSS's harmony format. The prompt ends with ``<|start|>assistant``;
    each message is a header (``<|channel|>NAME``, maybe ``to=functions.F``
    and ``<|constrain|>json``) then ``<|message|>`` and its text up to
    ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last two are
    end-of-sequence tokens, so usually never seen). The analysis channel is
    reasoning, a message to a function is a call, the rest is the answer."""

    _ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def __init__(
        self, tools: Sequence[Mapping[str, Any]], *, drop: Iterable[str] = (), call_id: Any = new_call_id
    ) -> None:
        super().__init__("harmony", False, "", tools, drop=drop, call_id=call_id)
        self.think = True  # it reasons, on its analysis channel
        self._state = "header"
        self._header = ""
        self._route = "content"

    def feed(self, piece: str) -> Delta:
        self._take_piece(piece)
        out = Delta()
        while self._buf:
            if self._state == "between":
                s = self._buf.lstrip()
                if s.startswith("<|start|>"):
                    self._buf, self._state, self._header = s[len("<|start|>") :], "header", ""
                    continue
                if "<|start|>".startswith(s):
                    break
                self._state, self._route = "body", "content"  # text outside any message: the answer
                continue
            if self._state == "header":
                i = self._buf.find("<|message|>")
                if i < 0:
                    break
                self._header, self._buf = self._buf[:i], self._buf[i + len("<|message|>") :]
                self._open(self._header, out)
                self._state = "body"
                continue
            hit = _first(self._buf, self._ENDS)
            upto = (
                hit[0] if hit else len(self._buf) - _held(self._buf, [*self._ENDS, "<|start|>", *self.drop])
            )
            if hit is None and "<|start|>" in self._buf:  # a new message without an end
                upto = self._buf.find("<|start|>")
                hit = (upto, "")
            self._body_text(self._buf[:upto], out)
            if hit is None:
                self._buf = self._buf[upto:]
                break
            self._buf = self._buf[upto + len(hit[1]) :]
            self._close_message(out)
            self._state = "between"
        return out

    def _open(self, header: str, out: Delta) -> None:
        m = re.search(r"<\|channel\|>\s*(\w+)", header)
        channel = m.group(1) if m else ""
        to = re.search(r"to=([^\s<]+)", header)
        if to is not None and to.group(1) != "assistant":
            name = to.group(1)
            self._calls.start(name[len("functions.") :] if name.startswith("functions.") else name)
            out.calls += self._calls.take()
            self._route = "call"
        else:
            self._route = "reasoning" if channel == "analysis" else "content"

    def _body_text(self, text: str, out: Delta) -> None:
        if not text:
            return
        if self._route == "call":
            self._calls.add(text if self._calls.args else text.lstrip())
            out.calls += self._calls.take()
        elif self._route == "reasoning":
            self.reasoning += text
            out.reasoning += text
        else:
            self.content += text
            out.content += text

    def _close_message(self, out: Delta) -> None:
        if self._route == "call":
            if not self._calls.args:
                self._calls.add("{}")
                out.calls += self._calls.take()
            self._calls.end()

    def finish(self) -> Delta:
        out = Delta()
        if self._state == "header" and self._buf:
            self.content += self._buf
            out.content += self._buf
        elif self._state == "body":
            self._body_text(self._buf, out)
            self._close_message(out)
        elif self._state == "between" and self._buf.strip():
            self.content += self._buf
            out.content += self._buf
        self._buf = ""
        return out
