"""Text: the embedded tokenizer, special tokens, streaming detokenisation,
stop strings and chat templates."""

from __future__ import annotations

import datetime
import json
import random

import pytest

import colibri
from colibri._text import ChatTemplate, IncrementalDetokenizer, StopMatcher, TextCodec, template_from_metadata
from conftest import NON_ASCII, STYLES, build_tokenizer, make_text_checkpoint

TEXTS = [
    "Once upon a time",
    f"caf{NON_ASCII[0]} {NON_ASCII} {NON_ASCII[1]}ber",
    "two\nlines, 42!",
    "  spaces  at both ends  ",
    "🙂🙂",
    "",
]


def codec(style: str, vocab: int = 113, **config_changes) -> TextCodec:
    cfg = dict(STYLES[style]["tokenizer_config"], **config_changes)
    return TextCodec(build_tokenizer(vocab, style), cfg)


@pytest.mark.parametrize("style", ["llama", "chatml"])
def test_round_trips_with_non_ascii_text(request, style):
    engine = request.getfixturevalue(style)
    for text in TEXTS:
        ids = engine.tokenize(text, add_special_tokens=False)
        assert engine.detokenize(ids) == text, (text, ids)
        full = engine.tokenize(text)
        assert engine.detokenize(full, skip_special_tokens=True) == text
    # Characters outside the alphabet become several byte tokens each.
    assert len(engine.tokenize("🙂", add_special_tokens=False)) >= 4


def test_special_tokens_follow_the_tokenizer_config(llama, chatml):
    # Llama style: <s> is added in front, </s> is the end of sequence.
    assert llama.bos_token_id == llama.tokenize("<s>", add_special_tokens=False)[0]
    assert llama.eos_token_ids == [llama.tokenize("</s>", add_special_tokens=False)[0]]
    ids = llama.tokenize("Once upon a time")
    assert ids[0] == llama.bos_token_id and ids[1:] == llama.tokenize(
        "Once upon a time", add_special_tokens=False
    )
    # Special tokens written in the text are recognised as such.
    ids = llama.tokenize("the end</s>", add_special_tokens=False)
    assert ids[-1] in llama.eos_token_ids
    assert llama.detokenize(ids) == "the end</s>"
    assert llama.detokenize(ids, skip_special_tokens=True) == "the end"
    # ChatML style: no beginning-of-sequence token; eos from tokenizer_config and generation_config.
    assert chatml.bos_token_id is None
    assert chatml.tokenize("hello") == chatml.tokenize("hello", add_special_tokens=False)
    im_end, endoftext = (
        chatml.tokenize(t, add_special_tokens=False)[0] for t in ("<|im_end|>", "<|endoftext|>")
    )
    assert set(chatml.eos_token_ids) == {im_end, endoftext}
    assert chatml.pad_token_id == endoftext


def test_add_bos_and_add_eos_in_the_config_win_over_the_tokenizer_file():
    plain = codec("llama").encode("hi there", add_special_tokens=False)
    assert codec("llama").encode("hi there") == [1, *plain]
    assert codec("llama", add_bos_token=False).encode("hi there") == plain
    assert codec("llama", add_eos_token=True).encode("hi there") == [1, *plain, 2]
    assert codec("llama", add_bos_token=False, add_eos_token=True).encode("hi there") == [*plain, 2]
    # The ChatML tokenizer adds nothing; asking for eos adds it.
    plain = codec("chatml").encode("hi", add_special_tokens=False)
    assert codec("chatml").encode("hi") == plain
    assert codec("chatml", add_eos_token=True).encode("hi") == [*plain, 2]


def test_add_bos_false_read_from_a_converted_file(tmp_path):
    cfg = dict(STYLES["llama"]["tokenizer_config"], add_bos_token=False)
    src = make_text_checkpoint("olmoe", tmp_path / "src", "llama", tokenizer_config=cfg)
    colibri.convert(src, tmp_path / "m.colibri", progress=False)
    engine = colibri.Engine(tmp_path / "m.colibri", threads=1)
    assert engine.tokenize("hello") == engine.tokenize("hello", add_special_tokens=False)
    assert engine.bos_token_id == 1


class _Raising:
    """Stands in for a tokenizers.Tokenizer whose decode raises `error`."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def decode(self, ids, skip_special_tokens=False):
        raise self.error


class PanicException(BaseException):
    """Named as pyo3's exception for a panic in the tokenizers package's Rust code."""


class _Signal(BaseException):
    """Like the CLI's SIGTERM exception: raised by a signal handler mid-call."""


@pytest.mark.parametrize("error", [ValueError("bad id"), PanicException("index out of bounds")])
def test_a_failing_decode_is_a_tokenizer_error(error):
    c = codec("llama")
    c.tokenizer = _Raising(error)
    with pytest.raises(colibri.TokenizerError, match=f"failed to decode: {type(error).__name__}"):
        c.decode([1, 2])


@pytest.mark.parametrize("error", [KeyboardInterrupt(), _Signal(), SystemExit(3)])
def test_a_signal_landing_in_a_decode_passes_through(error):
    c = codec("llama")
    c.tokenizer = _Raising(error)
    with pytest.raises(type(error)):
        c.decode([1, 2])


def test_streaming_detokenisation_never_splits_a_character():
    c = codec("llama")
    for text in TEXTS + [NON_ASCII * 3, f"a{NON_ASCII}b"]:
        ids = c.encode(text, add_special_tokens=False)
        d = IncrementalDetokenizer(c, skip_special_tokens=False)
        pieces = [d.push(t) for t in ids] + [d.flush()]
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces), pieces
    # A 4-byte character: nothing until its last byte arrives, then all of it.
    ids = c.encode("🙂", add_special_tokens=False)
    d = IncrementalDetokenizer(c, skip_special_tokens=False)
    got = [d.push(t) for t in ids]
    assert got[-1].endswith("🙂") and all("🙂" not in g for g in got[:-1])
    # Bytes that never complete a character come out as U+FFFD at the end, as a full decode gives.
    lone = c.encode("🙂", add_special_tokens=False)[:2]
    d = IncrementalDetokenizer(c, skip_special_tokens=False)
    assert "".join([d.push(t) for t in lone] + [d.flush()]) == c.decode(lone)


def test_stop_matcher_finds_stops_across_pieces():
    m = StopMatcher(["o w"])
    out = [m.push(p) for p in ["Hel", "lo", " ", "wo", "rld"]]
    assert "".join(out) == "Hell" and m.matched == "o w"
    # The earliest match wins, whichever stop string it is.
    m = StopMatcher(["world", "lo"])
    assert m.push("hello world") == "hel" and m.matched == "lo"
    # Random splits of random text give the same answer as a search of the whole text.
    rng = random.Random(5)
    for _ in range(300):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice("ab c") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        m = StopMatcher(stops)
        out = "".join(m.push(p) for p in pieces)
        if m.matched is None:
            out += m.flush()
        hits = [(text.find(s), s) for s in stops if s in text]
        want = text[: min(hits)[0]] if hits else text
        assert out == want, (text, stops, pieces)


# ---------------------------------------------------------------------------
# Chat templates


def test_chatml_template_renders_the_conversation(chatml):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Hello {NON_ASCII}"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Tell me a story."},
    ]
    want = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert chatml.apply_chat_template(messages, add_generation_prompt=False) == want
    assert chatml.apply_chat_template(messages) == want + "<|im_start|>assistant\n"
    # The rendered special tokens are single tokens once tokenized.
    ids = chatml.tokenize(chatml.apply_chat_template(messages), add_special_tokens=False)
    assert ids.count(chatml.tokenize("<|im_start|>", add_special_tokens=False)[0]) == len(messages) + 1


def test_template_sees_the_special_tokens_and_can_refuse(llama):
    text = llama.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    assert text == "<s>[INST] hi [/INST]yo</s>"
    with pytest.raises(colibri.ChatTemplateError, match="only user and assistant roles") as e:
        llama.apply_chat_template([{"role": "system", "content": "x"}])
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    "messages, needle",
    [
        ("hello", "list"),
        ([{"content": "no role"}], "role"),
        (["not a dict"], "dict"),
    ],
)
def test_bad_messages(chatml, messages, needle):
    with pytest.raises(colibri.ChatTemplateError, match=needle):
        chatml.chat(messages)


def test_image_parts_are_refused(chatml):
    """The vision tower of a multimodal checkpoint is not converted, so an
    image part cannot be rendered into placeholder tokens and silently
    ignored: it is refused, naming the part."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    with pytest.raises(colibri.InvalidInputError, match=r"messages\[0\]\.content\[1\] is a image_url part"):
        chatml.chat(msgs, max_new_tokens=2)


def render(source: str, messages=(), **extra) -> str:
    return ChatTemplate(source).render(
        list(messages), add_generation_prompt=True, special_tokens={}, extra=extra
    )


def test_template_helpers_match_transformers():
    assert render("{{ strftime_now('%Y') }}") == str(datetime.datetime.now().year)
    msgs = [{"role": "user", "content": "caf\u00e9 <b>"}]
    assert render("{{ messages | tojson }}", msgs) == json.dumps(msgs, ensure_ascii=False)
    first_only = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    )
    assert render(first_only, msgs * 3) == "user"
    assert render("{% generation %}kept{% endgeneration %}") == "kept"
    assert render("{% if enable_thinking is false %}no-think{% endif %}", enable_thinking=False) == "no-think"
    # trim_blocks / lstrip_blocks, as transformers configures jinja.
    assert render("{% if true %}\n  x\n{% endif %}\n") == "  x\n"


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",  # the sandbox hides internals
        "{% set _ = messages.append({'role': 'x'}) %}",  # and values are immutable
        "{{ raise_exception('custom failure') }}",
        "{{ 1 / 0 }}",
    ],
)
def test_template_failures_are_chat_template_errors(source):
    with pytest.raises(colibri.ChatTemplateError):
        render(source, [{"role": "user", "content": "x"}])


def test_template_that_does_not_compile():
    with pytest.raises(colibri.ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_named_templates_in_tokenizer_config():
    cfg = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    assert template_from_metadata(None, cfg) == "D"
    assert template_from_metadata("C", cfg) == "C"
    assert template_from_metadata(None, {}) is None


# ---------------------------------------------------------------------------
# Models without a tokenizer or a template


def test_a_model_without_a_tokenizer_takes_token_ids_only(mixtral):
    assert not mixtral.has_tokenizer
    for call in (
        lambda: mixtral.tokenize("hello"),
        lambda: mixtral.detokenize([1, 2]),
        lambda: mixtral.generate("hello", max_new_tokens=2),
        lambda: mixtral.stream("hello"),
        lambda: mixtral.generate([1, 2], max_new_tokens=2, stop=["x"]),
        lambda: mixtral.tokenizer,
    ):
        with pytest.raises(colibri.TokenizerError, match="no tokenizer") as e:
            call()
        assert isinstance(e.value, ValueError)
    assert len(mixtral.generate([1, 2, 3], max_new_tokens=3, ignore_eos=True)) == 3
    with pytest.raises(colibri.ChatTemplateError, match="no chat template"):
        mixtral.chat([{"role": "user", "content": "hi"}])
    # The eos id still comes from config.json / generation_config.json.
    assert mixtral.eos_token_ids == [2]


def test_a_model_without_a_chat_template(tmp_path):
    cfg = {k: v for k, v in STYLES["llama"]["tokenizer_config"].items() if k != "chat_template"}
    src = make_text_checkpoint("mixtral", tmp_path / "src", "llama", tokenizer_config=cfg)
    colibri.convert(src, tmp_path / "m.colibri", progress=False)
    engine = colibri.Engine(tmp_path / "m.colibri", threads=1)
    assert engine.chat_template is None
    assert engine.generate("hi", max_new_tokens=2, ignore_eos=True).token_ids
    with pytest.raises(colibri.ChatTemplateError, match="no chat template"):
        engine.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_chat_template_file_beside_the_checkpoint_is_used(tmp_path):
    src = make_text_checkpoint("mixtral", tmp_path / "src", "llama")
    (src / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    colibri.convert(src, tmp_path / "m.colibri", progress=False)
    engine = colibri.Engine(tmp_path / "m.colibri", threads=1)
    assert engine.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"
