"""Text in and out: the tokenizer embedded in a .colibri file, streaming
detokenisation, stop strings and chat templates.

The tokenizer is the checkpoint's own ``tokenizer.json``, run by the
``tokenizers`` package. Chat templates are rendered by jinja2 in an immutable
sandbox with the helpers transformers gives templates (``raise_exception``,
``strftime_now``, ``tojson``), so a template from the Hub renders here as it
does there, and cannot touch anything outside the values it is given.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from ._errors import ChatTemplateError, InvalidInputError, TokenizerError

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class TextCodec:
    """The model's tokenizer plus the checkpoint's special-token settings.

    ``add_bos_token`` / ``add_eos_token`` in tokenizer_config.json win over what
    the tokenizer.json post-processor does, as in transformers (older Llama and
    Mistral conversions rely on this): when they disagree, the post-processor is
    replaced by one that adds exactly the configured tokens.
    """

    def __init__(self, tokenizer_json: str, tokenizer_config: Mapping[str, Any] | None) -> None:
        from tokenizers import Tokenizer

        with _tokenizer_errors("the model's embedded tokenizer cannot be loaded"):
            self.tokenizer = Tokenizer.from_str(tokenizer_json)
            cfg = dict(tokenizer_config or {})
            self.special_tokens: dict[str, str] = {}
            for name in SPECIAL_TOKEN_NAMES:
                text = _token_text(cfg.get(name))
                if text is not None:
                    self.special_tokens[name] = text
            self._align_special_tokens(cfg.get("add_bos_token"), cfg.get("add_eos_token"))

    def token_id(self, name: str) -> int | None:
        """Id of a special token named in tokenizer_config.json (``"bos_token"`` ...), if it has one."""
        text = self.special_tokens.get(name)
        return None if text is None else self.tokenizer.token_to_id(text)

    def _align_special_tokens(self, add_bos: Any, add_eos: Any) -> None:
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        bos_id, eos_id = self.token_id("bos_token"), self.token_id("eos_token")
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        full = self.tokenizer.encode("a", add_special_tokens=True).ids
        extra = len(full) > len(plain)
        has_bos = extra and bos_id is not None and full[0] == bos_id
        has_eos = extra and eos_id is not None and full[-1] == eos_id
        want_bos = has_bos if not isinstance(add_bos, bool) or bos_id is None else add_bos
        want_eos = has_eos if not isinstance(add_eos, bool) or eos_id is None else add_eos
        if (want_bos, want_eos) == (has_bos, has_eos):
            return
        from tokenizers.processors import TemplateProcessing

        pre = [f"{bos}:0"] if want_bos else []
        post = [f"{eos}:0"] if want_eos else []
        single = [*pre, "$A:0", *post]
        pair = [
            *single,
            *[p.replace(":0", ":1") for p in pre],
            "$B:1",
            *[p.replace(":0", ":1") for p in post],
        ]
        specials = ([(bos, bos_id)] if want_bos else []) + (
            [(eos, eos_id)] if want_eos and eos != bos else []
        )
        self.tokenizer.post_processor = TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with _tokenizer_errors("the tokenizer failed to encode"):
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        with _tokenizer_errors("the tokenizer failed to decode"):
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


@contextmanager
def _tokenizer_errors(what: str) -> Iterator[None]:
    """Turns whatever the tokenizers package raises on a hostile tokenizer
    (plain Exception, or PanicException, a BaseException, when its Rust code
    panics) into a TokenizerError. Any other BaseException passes through: a
    signal handler's exception (Ctrl-C, the CLI's SIGTERM) can land while a
    decode runs and must still stop the program."""
    try:
        yield
    except TokenizerError:
        raise
    except Exception as e:
        raise TokenizerError(f"{what}: {type(e).__name__}: {e}") from None
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise TokenizerError(f"{what}: {type(e).__name__}: {e}") from None


class IncrementalDetokenizer:
    """Turns tokens into text one at a time without splitting a character.

    A character can span tokens (byte-level BPE, byte fallback), and some
    decoders change a token's text depending on what precedes it (SentencePiece
    drops the space of the first token decoded). So each step decodes a short
    window of recent tokens twice, with and without the new ones, and emits the
    difference only once it no longer ends in an incomplete character (U+FFFD).
    The window starts inside ``context`` (the end of the prompt), so a
    continuation keeps its leading space: prompt text + pieces reads as the
    decode of prompt + output.
    """

    CONTEXT = 6  # prompt tokens kept as context: enough for any decoder's look-back

    def __init__(self, codec: TextCodec, skip_special_tokens: bool, context: Sequence[int] = ()) -> None:
        self._codec = codec
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context)[-self.CONTEXT :]
        self._prefix = 0  # start of the window whose text is already known
        self._read = len(self._ids)  # end of that window

    def _decode(self, start: int, end: int) -> str:
        return self._codec.decode(self._ids[start:end], self._skip)

    def push(self, token_id: int) -> str:
        """Adds a token; returns the new complete text (maybe empty)."""
        self._ids.append(token_id)
        done = self._decode(self._prefix, self._read)
        now = self._decode(self._prefix, len(self._ids))
        if len(now) <= len(done) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(done) :]

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character shows as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        done = self._decode(self._prefix, self._read)
        now = self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return now[len(done) :]


class StopMatcher:
    """Finds the first stop string in streamed text, also across pieces.

    Text that could still be the start of a stop string is held back (at most
    the longest stop string less one character); everything before a match is
    released, the match itself and anything after it never are.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.matched: str | None = None

    def push(self, piece: str) -> str:
        """Adds text; returns what is safe to emit. After a match, ``matched`` is set."""
        if self.matched is not None:
            return ""
        self._pending += piece
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self._pending.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.matched = best[1]
            out, self._pending = self._pending[: best[0]], ""
            return out
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return ""
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """The held-back text, at the end of the generation."""
        out, self._pending = self._pending, ""
        return out


# ---------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' version: unlike jinja's own filter, no HTML escaping.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


# Bounds on what a template may build. A chat template comes with a model
# downloaded from a stranger; the sandbox stops it reaching anything outside
# its values, these stop it exhausting memory or time. Real templates stay far
# below them (a prompt must fit the context anyway).
TEMPLATE_MAX_INT_ARG = 1 << 20  # any integer argument to a call or filter (widths, counts)
TEMPLATE_MAX_SIZE = 1 << 20  # a string or list made by `*`, `%`; characters or items
TEMPLATE_MAX_RANGE_TOTAL = 1 << 20  # elements of all range() calls in one render
TEMPLATE_MAX_OUTPUT = 1 << 24  # characters of rendered text
TEMPLATE_MAX_POW_BITS = 1 << 12  # bits of an integer made by `**`


class _TemplateLimit(Exception):
    pass


def _check_args(what: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > TEMPLATE_MAX_INT_ARG:
            raise _TemplateLimit(f"{what} was given {a}, more than the limit of {TEMPLATE_MAX_INT_ARG}")


def _sized(value: Any, what: str) -> Any:
    if isinstance(value, (str, list, tuple)) and len(value) > TEMPLATE_MAX_SIZE:
        raise _TemplateLimit(f"{what} made {len(value)} items, more than the limit of {TEMPLATE_MAX_SIZE}")
    return value


def _environment() -> Any:
    import math

    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox, plus size checks on the operators and calls
        that can build a huge value from a short template."""

        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                    if right * math.log2(abs(left)) > TEMPLATE_MAX_POW_BITS:
                        raise _TemplateLimit(f"{left} ** {right} is too large")
                return left**right
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        if len(seq) * max(n, 0) > TEMPLATE_MAX_SIZE:
                            raise _TemplateLimit(f"repeating {len(seq)} items {n} times is too large")
                return left * right
            # `%`: a string format's widths and precisions are integer arguments.
            if isinstance(left, str):
                import re

                for width in re.findall(r"%[-+ #0]*(\d*)(?:\.(\d*))?", left):
                    for digits in width:
                        if digits and int(digits) > TEMPLATE_MAX_INT_ARG:
                            raise _TemplateLimit(f"a format width of {digits} is too large")
                if "*" in left:
                    _check_args("a `*` format width", right if isinstance(right, tuple) else (right,), {})
                return _sized(left % right, "a `%` format")
            return left % right

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _check_args("a call", args, kwargs)
            return _sized(super().call(__context, __obj, *args, **kwargs), "a call")

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant spans
        with it for training masks); here it renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return str(caller())

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, f)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _bounded_filter(name: str, f: Any) -> Any:
    """A filter whose integer arguments (`center(width)`, `indent(width)` ...)
    and result are held to the template bounds. Keeps jinja's decorators'
    marks (`jinja_pass_arg`), which decide what the filter is passed first."""
    import functools

    # The value filtered is not an argument: it comes first, after the
    # context or environment for filters marked to take one.
    skip = 2 if hasattr(f, "jinja_pass_arg") else 1

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_args(f"the filter {name}", args[skip:], kwargs)
        return _sized(f(*args, **kwargs), f"the filter {name}")

    return bounded


class ChatTemplate:
    """A compiled chat template."""

    def __init__(self, source: str) -> None:
        import jinja2

        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"the model's chat template does not compile (line {e.lineno}): {e.message}"
            ) from None
        except Exception as e:  # e.g. RecursionError on absurdly deep nesting
            raise ChatTemplateError(
                f"the model's chat template does not compile: {type(e).__name__}: {e}"
            ) from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        special_tokens: Mapping[str, str],
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        import jinja2

        if extra is not None and (
            not isinstance(extra, Mapping) or not all(isinstance(k, str) and k.isidentifier() for k in extra)
        ):
            raise ChatTemplateError(
                "chat_template_kwargs must be a dict whose keys are variable names, got "
                + (repr(extra)[:80] if not isinstance(extra, Mapping) else f"the keys {list(extra)[:8]!r}")
            )
        context: dict[str, Any] = {"tools": None, "documents": None, **special_tokens, **(extra or {})}
        context["messages"] = check_messages(messages)
        context["add_generation_prompt"] = bool(add_generation_prompt)
        context["range"] = _range_with_budget(TEMPLATE_MAX_RANGE_TOTAL)
        try:
            pieces, size = [], 0
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > TEMPLATE_MAX_OUTPUT:
                    raise _TemplateLimit(f"the rendered text is longer than {TEMPLATE_MAX_OUTPUT} characters")
                pieces.append(piece)
            return "".join(pieces)
        except _TemplateLimit as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        except Exception as e:  # a template can fail in many ways (TypeError on bad content ...)
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None


def _range_with_budget(budget: int) -> Any:
    """`range` for one render: every call spends its length from `budget`,
    so nested loops cannot multiply a template's work without bound."""
    left = [budget]

    def bounded_range(*args: Any) -> range:
        r = range(*args)
        left[0] -= len(r)
        if left[0] < 0:
            raise _TemplateLimit(f"the template's loops asked for more than {budget} range() items in all")
        return r

    return bounded_range


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validates a conversation: a list of dicts, each with a string ``role``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f'messages must be a list of {{"role": ..., "content": ...}} dicts, got {type(messages).__name__}'
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f'messages[{i}] needs a string "role"')
        content = m.get("content")
        if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text":
                    raise InvalidInputError(
                        f"messages[{i}].content[{j}] is a {kind or type(part).__name__} part: colibri runs "
                        "a model's language part only (a vision tower is not converted), so only text parts "
                        "are accepted"
                    )
        out.append(dict(m))
    return out


def template_from_metadata(chat_template: Any, tokenizer_config: Mapping[str, Any] | None) -> str | None:
    """The default chat template: the converter's copy, or tokenizer_config.json's
    (which may be a list of named templates, of which "default" is used)."""
    if isinstance(chat_template, str) and chat_template:
        return chat_template
    value = (tokenizer_config or {}).get("chat_template")
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default") or next(iter(named.values()), None)
        if isinstance(chosen, str) and chosen:
            return chosen
    return None
