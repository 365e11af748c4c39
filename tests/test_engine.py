"""The Engine surface: shapes, options, errors and thread safety."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import colibri
from conftest import GOLDEN


def test_properties(mixtral):
    assert mixtral.architecture == "MixtralForCausalLM"
    assert mixtral.vocab_size == mixtral.config["vocab_size"] > 0
    assert mixtral.num_layers == len(mixtral.config["layers"])
    assert mixtral.threads == 2
    cfg = mixtral.config
    cfg["vocab_size"] = -1
    assert mixtral.config["vocab_size"] > 0, "config must be a copy"
    assert "MixtralForCausalLM" in repr(mixtral)


def test_logits_shape_and_types(mixtral):
    ids = [1, 5, 9]
    for form in (ids, tuple(ids), np.array(ids, dtype=np.int64), np.array(ids, dtype=np.int32)):
        out = mixtral.logits(form)
        assert out.shape == (3, mixtral.vocab_size) and out.dtype == np.float32
        np.testing.assert_array_equal(out, mixtral.logits(ids))


def test_logits_are_stateless(mixtral):
    a = mixtral.logits([3, 4, 5])
    mixtral.logits([7] * 20)
    np.testing.assert_array_equal(a, mixtral.logits([3, 4, 5]))


@pytest.mark.parametrize(
    "ids, error, needle",
    [
        ([], colibri.InvalidInputError, "empty"),
        ([1, 2, 10_000], colibri.InvalidInputError, "position 2"),
        ([1, -1], colibri.InvalidInputError, "-1"),
        ([1, 2.5], colibri.InvalidInputError, "2.5"),
        ("hello", colibri.InvalidInputError, "token ids"),
        (np.zeros((2, 2), dtype=np.int64), colibri.InvalidInputError, "1-D"),
        (np.zeros(3, dtype=np.float32), colibri.InvalidInputError, "integers"),
        (5, colibri.InvalidInputError, "sequence"),
    ],
)
def test_bad_token_ids(mixtral, ids, error, needle):
    with pytest.raises(error, match=needle) as e:
        mixtral.logits(ids)
    assert isinstance(e.value, ValueError)


def test_sequence_longer_than_context(mixtral):
    n = mixtral.context_length + 1
    with pytest.raises(colibri.ContextLengthError, match=str(n)):
        mixtral.logits([1] * n)
    with pytest.raises(colibri.ContextLengthError):
        mixtral.generate([1] * n, max_new_tokens=1)
    # A prompt that fits generates until the context is full, then stops.
    out = mixtral.generate([1] * (mixtral.context_length - 3), max_new_tokens=50)
    assert len(out) == 3


def test_generate_options(mixtral):
    prompt = [2, 7, 1]
    assert mixtral.generate(prompt, max_new_tokens=0) == []
    greedy = mixtral.generate(prompt, max_new_tokens=8)
    assert len(greedy) == 8 and all(0 <= t < mixtral.vocab_size for t in greedy)
    a = mixtral.generate(prompt, max_new_tokens=8, temperature=1.0, seed=123)
    assert a == mixtral.generate(prompt, max_new_tokens=8, temperature=1.0, seed=123)
    draws = {tuple(mixtral.generate(prompt, max_new_tokens=8, temperature=1.5, seed=s)) for s in range(6)}
    assert len(draws) > 1, "different seeds should give different samples"
    stop = greedy[3]
    first = greedy.index(stop)
    assert mixtral.generate(prompt, max_new_tokens=8, stop_token_ids=[stop]) == greedy[: first + 1]
    for bad in (dict(max_new_tokens=-1), dict(temperature=-0.5), dict(seed=-3), dict(max_new_tokens=1.5)):
        with pytest.raises(colibri.InvalidInputError):
            mixtral.generate(prompt, **bad)


def test_greedy_generation_is_argmax_of_logits(mixtral):
    seq = [4, 8, 15]
    out = mixtral.generate(seq, max_new_tokens=5)
    for tok in out:
        assert int(mixtral.logits(seq)[-1].argmax()) == tok
        seq.append(tok)


def test_thread_count_does_not_change_results(converted):
    ids = list(range(1, 30))
    one = colibri.Engine(converted("qwen2_moe"), threads=1)
    two = colibri.Engine(converted("qwen2_moe"), threads=2)
    np.testing.assert_array_equal(one.logits(ids), two.logits(ids))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(colibri.InvalidInputError):
            colibri.Engine(converted("qwen2_moe"), threads=bad)


def test_concurrent_calls_agree_with_sequential_ones(mixtral):
    prompts = [[i, i + 1, i + 2] * 5 for i in range(1, 9)]
    want = [mixtral.logits(p) for p in prompts]
    got: list = [None] * len(prompts)

    def work(i):
        got[i] = mixtral.logits(prompts[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_opening_bad_files(tmp_path, converted):
    with pytest.raises(colibri.ModelNotFoundError) as e:
        colibri.Engine(tmp_path / "missing.colibri")
    assert isinstance(e.value, FileNotFoundError)
    with pytest.raises(colibri.FormatError, match="directory"):
        colibri.Engine(tmp_path)
    junk = tmp_path / "junk.colibri"
    junk.write_bytes(b"\x00" * 100)
    with pytest.raises(colibri.FormatError, match="magic"):
        colibri.Engine(junk)
    good = converted("olmoe").read_bytes()
    for cut in (10, 40, 5000, len(good) - 1):
        trunc = tmp_path / f"trunc{cut}.colibri"
        trunc.write_bytes(good[:cut])
        with pytest.raises(colibri.FormatError):
            colibri.Engine(trunc)
    flipped = bytearray(good)
    flipped[40:48] = b"\xff" * 8  # inside the JSON metadata
    bad = tmp_path / "flipped.colibri"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(colibri.FormatError):
        colibri.Engine(bad)


def test_errors_share_one_base_class():
    for cls in (
        colibri.FormatError,
        colibri.UnsupportedModelError,
        colibri.CheckpointError,
        colibri.InvalidInputError,
        colibri.ContextLengthError,
        colibri.OutputExistsError,
        colibri.ModelNotFoundError,
        colibri.ColibriIOError,
    ):
        assert issubclass(cls, colibri.ColibriError)


def test_kv_cache_types(converted):
    path = converted("mixtral")
    ids = list(range(3, 40))
    auto = colibri.Engine(path, threads=2)
    f16 = colibri.Engine(path, threads=2, kv_cache_dtype="f16")
    assert auto.kv_cache_dtype == "f32", "an f32 model keeps an exact f32 cache by default"
    assert f16.kv_cache_dtype == "f16"
    a, b = auto.logits(ids), f16.logits(ids)
    # Rounding cached keys and values to f16 moves the logits a little, not much.
    assert 0 < np.abs(a - b).max() < 1e-2 * np.abs(a).max()
    np.testing.assert_array_equal(b, f16.logits(ids))
    with pytest.raises(colibri.InvalidInputError, match="kv_cache"):
        colibri.Engine(path, kv_cache_dtype="int8")


def test_state_bytes_split_per_token_and_per_sequence(converted):
    path = converted("mixtral")
    cfg = json.loads((GOLDEN / "mixtral" / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # Keys and values of every kv head in every layer, per token; nothing fixed per sequence.
    values = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim
    for dtype, size in (("f32", 4), ("f16", 2)):
        e = colibri.Engine(path, threads=1, kv_cache_dtype=dtype)
        assert e.state_bytes() == {"per_token": values * size, "per_sequence": 0}
        assert e.kv_bytes_per_token == values * size
