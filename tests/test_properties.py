"""Property tests of the Python surface: whatever a caller passes, the answer
is a correct result or a typed `ColibriError`, never another exception, a
crash or a hang, and the engine still answers the next call as before.
Derandomised, so every run draws the same examples."""

import functools
import math

import numpy as np
import pytest

import colibri

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

huge_ints = st.integers(min_value=-(2**70), max_value=2**70)
small_ids = st.integers(min_value=0, max_value=120)
ids = st.one_of(
    st.lists(st.one_of(small_ids, huge_ints), max_size=12),
    st.lists(small_ids, min_size=1, max_size=12).flatmap(
        lambda v: st.sampled_from(["int8", "uint8", "int16", "int32", "uint32", "int64", "uint64"]).map(
            lambda d: np.array(v).astype(d)
        )
    ),
    st.lists(st.floats(allow_nan=True), max_size=4),
    st.sampled_from([None, "abc", b"\x00", [[1, 2]], [True], np.zeros((2, 2), dtype=np.int64), 3]),
)

weird = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(["", "1", "hot", [], {}]),
)


def baseline(engine):
    return engine.logits([1, 2, 3])


@SETTINGS
@given(token_ids=ids)
def test_any_token_ids_give_logits_or_a_typed_error(mixtral, token_ids):
    want = baseline(mixtral)
    try:
        out = mixtral.logits(token_ids)
    except colibri.ColibriError:
        pass
    else:
        n = len(token_ids)
        assert out.shape == (n, mixtral.vocab_size)
        assert np.isfinite(out).all()
    np.testing.assert_array_equal(baseline(mixtral), want)


@SETTINGS
@given(
    temperature=weird,
    top_k=weird,
    top_p=weird,
    min_p=weird,
    repetition_penalty=weird,
    presence_penalty=weird,
    seed=weird,
    max_new_tokens=st.one_of(
        st.integers(min_value=-3, max_value=6),
        st.sampled_from([None, 1.5, "2", 2**70]),
    ),
)
def test_any_sampling_options_give_tokens_or_a_typed_error(mixtral, max_new_tokens, **opts):
    want = baseline(mixtral)
    kw = {k: v for k, v in opts.items() if v is not None}
    try:
        out = mixtral.generate([1, 2, 3], max_new_tokens=max_new_tokens, ignore_eos=True, **kw)
    except colibri.ColibriError:
        pass
    else:
        assert all(isinstance(t, int) and 0 <= t < mixtral.vocab_size for t in out)
        if isinstance(max_new_tokens, int) and max_new_tokens < 2**20:
            assert len(out) <= max_new_tokens
        t = kw.get("temperature")
        if isinstance(t, float) and math.isfinite(t) and t > 0:
            assert out.finish_reason in ("length", "stop")
    np.testing.assert_array_equal(baseline(mixtral), want)


@SETTINGS
@given(
    stop=st.one_of(
        st.none(),
        st.text(max_size=12),
        st.lists(st.text(max_size=40), max_size=4),
        st.sampled_from([[""], ["\x00"], ["é" * 50], 5, [5]]),
    ),
    prompt=st.text(max_size=30),
)
def test_any_stop_strings_and_prompt_text_give_text_or_a_typed_error(llama, stop, prompt):
    try:
        out = llama.generate(prompt, max_new_tokens=8, stop=stop, ignore_eos=True)
    except colibri.ColibriError:
        return
    assert isinstance(out.text, str)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for s in stops:
        if isinstance(s, str) and s:
            assert s not in out.text, f"{s!r} should have ended the text {out.text!r}"


# ------------------------------------------------------ concurrent calls, cancelled


job = st.tuples(
    st.lists(st.integers(min_value=0, max_value=100), min_size=1, max_size=6),  # prompt (vocabulary 113)
    st.integers(min_value=1, max_value=10),  # max_new_tokens
    st.one_of(st.none(), st.integers(min_value=0, max_value=10)),  # close the stream after this many
    st.one_of(st.none(), st.integers(min_value=0, max_value=2**32)),  # seed (None: greedy)
)


def run_job(engine, prompt, n, cancel_after, seed):
    opts = {"temperature": 0.0} if seed is None else {"temperature": 0.9, "seed": seed}
    out = []
    with engine.stream(prompt, max_new_tokens=n, ignore_eos=True, **opts) as s:
        for t in s:
            if cancel_after is not None and len(out) == cancel_after:
                break  # leaving the loop closes the stream: the cancellation
            out.append(t)
    return out


@settings(SETTINGS, max_examples=100)
@given(jobs=st.lists(job, min_size=2, max_size=6))
def test_concurrent_streams_some_cancelled_give_the_tokens_they_give_alone(mixtral, jobs):
    """Threads sharing one engine, some closing their stream part-way: every
    stream's tokens are those (or, cancelled, a prefix of those) of the same
    call made alone, no call hangs, and the engine answers as before."""
    import threading

    want = baseline(mixtral)
    got: list = [None] * len(jobs)
    errors: list = []

    def work(i):
        try:
            got[i] = run_job(mixtral, *jobs[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a concurrent call hung"
    assert not errors, errors
    for (prompt, n, cancel_after, seed), tokens in zip(jobs, got):
        alone = run_job(mixtral, prompt, n, None, seed)
        assert tokens == alone[: len(tokens)]
        assert len(tokens) == (n if cancel_after is None else min(n, cancel_after))
    np.testing.assert_array_equal(baseline(mixtral), want)


# ------------------------------------------------- messages and template kwargs


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=12)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", ""]), "content": json_values},
        optional={"name": json_values, "tool_calls": json_values, "reasoning_content": json_values},
    ),
    st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    json_values,
)
messages = st.one_of(st.lists(message, max_size=4), json_values)
template_kwargs = st.one_of(
    st.none(),
    st.dictionaries(
        st.one_of(
            st.sampled_from(["enable_thinking", "tools", "messages", "add_generation_prompt", "bos_token"]),
            st.text(max_size=8),
        ),
        json_values,
        max_size=4,
    ),
    st.sampled_from([[], "x", 3, {1: 2}]),
)


@SETTINGS
@given(msgs=messages, kwargs=template_kwargs)
def test_any_messages_and_template_kwargs_give_a_reply_or_a_typed_error(chatml, msgs, kwargs):
    try:
        text = chatml.apply_chat_template(msgs, chat_template_kwargs=kwargs)
    except colibri.ColibriError:
        pass
    else:
        assert isinstance(text, str)
    try:
        out = chatml.chat(msgs, chat_template_kwargs=kwargs, max_new_tokens=2)
    except colibri.ColibriError:
        pass
    else:
        assert isinstance(out.text, str)
    assert chatml.chat([{"role": "user", "content": "hi"}], max_new_tokens=2, temperature=0) == chatml.chat(
        [{"role": "user", "content": "hi"}], max_new_tokens=2, temperature=0
    )


# ------------------------------------------------- hostile templates and tokenizers


# Pieces of Jinja, so random templates parse often enough to reach rendering.
FRAGMENTS = [
    "{{ ",
    " }}",
    "{% ",
    " %}",
    "{%- ",
    " -%}",
    "for m in messages",
    "endfor",
    "if ",
    "else",
    "endif",
    "m['content']",
    "m.role",
    "messages[0]",
    "messages[-1]['content']",
    " ~ ",
    " + ",
    " * ",
    " ** ",
    " % ",
    "'%s'",
    "'%0*d'",
    "range(",
    ")",
    "(",
    "[",
    "]",
    "99999",
    "3",
    "-1",
    "1e308",
    "'a'",
    "|tojson",
    "|length",
    "|center(",
    "|indent(",
    "|join(', ')",
    "|list",
    "|replace('a', 'bb')",
    "raise_exception('no')",
    "loop.index",
    "namespace(n=0)",
    "set ns.n = ns.n + 1",
    "set x = ",
    "x",
    "add_generation_prompt",
    "bos_token",
    "strftime_now('%Y')",
    ".upper()",
    ".split()",
    "break",
    "continue",
    "generation",
    "endgeneration",
    "\n",
    "text ",
    "macro f(a)",
    "endmacro",
    "f(",
    "caller()",
    "call f(1)",
    "endcall",
    "'{{'",
    "__class__",
    ".__init__",
    "self",
    "cycler",
    "lipsum(",
    "dict(",
    "|map('upper')",
    "|sort",
]


@settings(SETTINGS, max_examples=1000)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=24), raw=st.text(max_size=20))
def test_any_template_source_renders_or_raises_a_chat_template_error(parts, raw):
    """A random template (Jinja fragments plus arbitrary text): it compiles and
    renders to a string, or raises ChatTemplateError, within the template
    bounds (no huge value, no endless loop, no escape from the sandbox)."""
    from colibri._text import TEMPLATE_MAX_OUTPUT, ChatTemplate

    source = "".join(parts) + raw
    try:
        out = ChatTemplate(source).render(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            add_generation_prompt=True,
            special_tokens={"bos_token": "<s>"},
        )
    except colibri.ChatTemplateError:
        return
    assert isinstance(out, str) and len(out) <= TEMPLATE_MAX_OUTPUT


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'a' * 10**9 }}",
        "{{ messages * 10**8 }}",
        "{{ 7 ** 99999999 }}",
        "{{ 'x' | center(10**9) }}",
        "{{ 'x'.ljust(10**9) }}",
        "{{ '%0999999999d' % 5 }}",
        "{{ '%*d' % (999999999, 5) }}",
        "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
        "{% for a in range(99999) %}{% for b in range(99999) %}{{ a }}{% endfor %}{% endfor %}",
        "{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}",
        "{%- if true %}" * 3000,
    ],
)
def test_hostile_templates_stop_quickly_with_a_chat_template_error(source):
    import time

    from colibri._text import ChatTemplate

    start = time.monotonic()
    with pytest.raises(colibri.ChatTemplateError):
        ChatTemplate(source).render(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, special_tokens={}
        )
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    "source",
    [
        "{{ ().__class__.__base__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.__class__.__mro__ }}",
        "{{ raise_exception.__globals__ }}",
        "{% set x = namespace(a=1) %}{% set x.__class__ = 1 %}{{ x.__class__ }}",
        "{{ messages.append(1) }}{{ messages }}",
        "{{ ''.format.__self__ }}",
    ],
)
def test_templates_cannot_reach_past_their_values(source):
    from colibri._text import ChatTemplate

    try:
        out = ChatTemplate(source).render(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, special_tokens={}
        )
    except colibri.ChatTemplateError:
        return
    for leak in ("<class", "<function", "<built-in", "__builtins__", "<module", ", 1]"):
        assert leak not in out, out


@functools.cache
def tokenizer_json(style: str) -> str:
    from conftest import build_tokenizer

    return build_tokenizer(113, style)


def mutate_json(value, draw):
    """One random edit somewhere inside a JSON value."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        return {**value, key: mutate_json(value[key], draw)}
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], mutate_json(value[i], draw), *value[i + 1 :]]
    return draw(json_values)


@settings(SETTINGS, max_examples=500)
@given(data=st.data(), edits=st.integers(min_value=1, max_value=4), text=st.text(max_size=20))
def test_a_mangled_tokenizer_json_loads_or_raises_a_tokenizer_error(data, edits, text):
    """tokenizer.json (embedded in a .colibri file from anywhere) with random
    edits at random depths, and random special-token settings: the codec loads
    and round-trips text, or raises TokenizerError, never another exception."""
    import json

    from colibri._text import TextCodec

    tok = json.loads(tokenizer_json(data.draw(st.sampled_from(["llama", "chatml"]))))
    for _ in range(edits):
        tok = mutate_json(tok, data.draw)
    config = data.draw(
        st.one_of(
            st.none(),
            st.fixed_dictionaries(
                {},
                optional={
                    "bos_token": st.one_of(st.text(max_size=5), json_values),
                    "eos_token": st.one_of(st.text(max_size=5), json_values),
                    "add_bos_token": json_values,
                    "add_eos_token": st.booleans(),
                },
            ),
        )
    )
    try:
        codec = TextCodec(json.dumps(tok), config)
        ids = codec.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert isinstance(codec.decode(ids), str)
    except colibri.TokenizerError:
        pass
