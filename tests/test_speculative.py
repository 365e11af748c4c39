"""Speculative decoding with n-gram drafts: on every family's fixture and the
demo model, the output is token for token (and log-probability for
log-probability) the output without it, greedy and seeded; drafts are made,
some confirmed, and the counts are reported."""

from __future__ import annotations

import pytest

import colibri
from colibri import InvalidInputError
from conftest import CASES


@pytest.mark.parametrize("case", CASES)
def test_drafts_change_no_token_on_any_family(case, converted, golden):
    g = golden(case)
    engine = colibri.Engine(converted(case))
    # A prompt that repeats itself, so its n-grams recur.
    prompt = (g["ids_7"].tolist() * 5)[:33]
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
        want = engine.generate(prompt, max_new_tokens=20, logprobs=2, **sampling)
        got = engine.generate(prompt, max_new_tokens=20, logprobs=2, speculative="ngram", **sampling)
        assert list(got) == list(want) and got.logprobs == want.logprobs, f"{case} {sampling}"
        t = got.timings
        assert t.decode_passes + t.accepted_tokens == t.generated_tokens - 1, t
        assert want.timings.drafted_tokens == 0 and want.timings.decode_passes == len(want) - 1


def test_seeded_sampling_and_greedy_on_the_demo_model():
    engine = colibri.Engine.demo()
    text = "It is a truth universally acknowledged. It is a truth universally acknowledged. It is a"
    confirmed = 0
    for seed in range(6):
        opts = {"max_new_tokens": 48, "temperature": 0.7 if seed else 0, "top_p": 0.9, "seed": seed}
        want = engine.generate(text, **opts)
        for k in (1, 4, 16):
            got = engine.generate(text, speculative="ngram", draft_tokens=k, **opts)
            assert got.token_ids == want.token_ids, (seed, k)
            confirmed += got.timings.accepted_tokens
    assert confirmed > 0
    stats = engine.batch_stats()
    assert 0 < stats["accepted_tokens"] <= stats["drafted_tokens"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"speculative": "eagle"}, "speculative"),
        ({"speculative": "ngram", "draft_tokens": 0}, "draft_tokens"),
        ({"speculative": "ngram", "draft_tokens": 17}, "draft_tokens"),
    ],
)
def test_bad_speculation_is_refused(options, match):
    engine = colibri.Engine.demo()
    with pytest.raises(InvalidInputError, match=match):
        engine.generate("Hello", max_new_tokens=4, **options)


def test_mtp_drafts_need_the_layer_in_the_file(converted):
    engine = colibri.Engine(converted("qwen3_moe"))
    assert not engine.has_mtp
    with pytest.raises(InvalidInputError, match="multi-token-prediction layer"):
        engine.generate([1, 2, 3], max_new_tokens=4, speculative="mtp")


def test_the_demo_models_mtp_head_drafts_what_the_model_says():
    """The demo ships a trained multi-token-prediction head: its drafts are
    mostly confirmed (about 87% of first drafts agree with the model on
    held-out text, docs/demo_model.md), and the output is the plain one,
    greedy and seeded, for every draft length."""
    engine = colibri.Engine.demo()
    assert engine.has_mtp
    text = "Elizabeth was not quite sure"
    drafted = accepted = 0
    for seed in range(3):
        opts = {"max_new_tokens": 64, "temperature": 0.7 if seed else 0, "top_p": 0.9, "seed": seed}
        want = engine.generate(text, **opts)
        for k in (1, 2, 4):
            got = engine.generate(text, speculative="mtp", draft_tokens=k, **opts)
            assert got.token_ids == want.token_ids, (seed, k)
            drafted += got.timings.drafted_tokens
            accepted += got.timings.accepted_tokens
    assert drafted > 0 and accepted / drafted > 0.5, (accepted, drafted)


def test_a_prediction_speeds_up_what_it_gets_right_and_changes_nothing():
    """OpenAI-style predicted output: drafts come from it too, most hold
    where it is right, and a wrong prediction changes no token."""
    engine = colibri.Engine.demo()
    prompt = "Rewrite the sentence: The cat sat on the mat."
    want = engine.generate(prompt, max_new_tokens=40, temperature=0)
    text = str(want)
    for guess in (text, text[:30] + " something else entirely " + text[30:], "nothing like it at all"):
        got = engine.generate(prompt, max_new_tokens=40, temperature=0, prediction=guess)
        assert got.token_ids == want.token_ids
    right = engine.generate(prompt, max_new_tokens=40, temperature=0, prediction=text)
    assert right.timings.accepted_tokens >= 20 and right.timings.tokens_per_pass > 2
    ids = engine.generate(prompt, max_new_tokens=40, temperature=0, prediction=want.token_ids)
    assert ids.token_ids == want.token_ids and ids.timings.accepted_tokens >= 20
    with pytest.raises(InvalidInputError, match="prediction"):
        engine.generate(prompt, max_new_tokens=4, prediction=[engine.vocab_size])


def test_drafts_never_cross_the_longrope_threshold(converted, golden):
    """A generation that crosses Phi-MoE's LongRoPE threshold (24 in the
    fixture) gives the same tokens with drafts: no draft pass ends past it
    while the rows before it are short."""
    g = golden("phimoe")
    engine = colibri.Engine(converted("phimoe"))
    prompt = g["ids_7"].tolist() * 2
    want = engine.generate(prompt, max_new_tokens=30, logprobs=1, temperature=0)
    got = engine.generate(
        prompt, max_new_tokens=30, logprobs=1, temperature=0, prediction=list(want), draft_tokens=8
    )
    assert list(got) == list(want) and got.logprobs == want.logprobs
    assert got.timings.accepted_tokens > 0
