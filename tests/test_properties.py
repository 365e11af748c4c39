"""Property tests of the Python surface: whatever a caller passes, the answer
is a correct result or a typed `ColibriError`, never another exception, a
crash or a hang, and the engine still answers the next call as before.
Derandomised, so every run draws the same examples."""

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
