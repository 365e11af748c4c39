"""The prefix cache: on every family's fixture, a prompt served partly from
cached state gives the tokens and log-probabilities of the same prompt
computed afresh, bit for bit; it reports what it served, keeps to its budget,
and refuses a bad size."""

from __future__ import annotations

import pytest

import colibri
from colibri import InvalidInputError
from conftest import CASES

BLOCK = 16


def _run(engine: colibri.Engine, prompt: list[int]) -> tuple[list[int], list[object], int]:
    out = engine.generate(prompt, max_new_tokens=8, logprobs=3)
    return list(out), list(out.logprobs or []), out.timings.cached_tokens


@pytest.mark.parametrize("case", CASES)
def test_a_cached_prefix_gives_the_bits_of_a_fresh_prefill(case, converted, golden):
    g = golden(case)
    path = converted(case)
    fresh, cached = colibri.Engine(path), colibri.Engine(path, prefix_cache="64MiB")
    first = g["ids_33"].tolist()
    said, _, _ = _run(fresh, first)
    # A repeat, the next turn of a conversation, and a prompt that leaves
    # the first after 20 tokens.
    turns = [
        (first, 0),
        (first, 32),
        (first + said + g["ids_7"].tolist(), 32),
        (first[:20] + g["ids_7"].tolist(), 16),
    ]
    for k, (prompt, served) in enumerate(turns):
        want_ids, want_lps, none = _run(fresh, prompt)
        got_ids, got_lps, hit = _run(cached, prompt)
        assert none == 0
        assert got_ids == want_ids and got_lps == want_lps, f"{case} turn {k}"
        stats = cached.batch_stats()["prefix_cache"]
        assert stats is not None
        # A linear-attention or pooled-attention (DeepSeek-V4) model keeps
        # its states at each prompt's last block end only: the diverging
        # prompt finds none at 16.
        recurrent = case.startswith(
            ("qwen3_next", "qwen3_5_moe", "kimi_linear", "nemotron_h", "granitemoehybrid", "deepseek_v4")
        )
        assert hit == (0 if recurrent and k == 3 else served), f"{case} turn {k}: {stats}"
    stats = cached.batch_stats()["prefix_cache"]
    assert stats is not None and stats["lookups"] == 4 and stats["block_tokens"] == BLOCK
    assert stats["cached_tokens"] == sum(t[1] for t in turns) - (16 if recurrent else 0)
    assert 0 < stats["bytes"] <= stats["budget_bytes"] == 64 << 20
    assert fresh.batch_stats()["prefix_cache"] is None


def test_a_small_budget_evicts_and_stays_exact(converted, golden):
    g = golden("qwen3_moe")
    path = converted("qwen3_moe")
    fresh, cached = colibri.Engine(path), colibri.Engine(path, prefix_cache=20_000)
    prompts = [[(t + k) % 100 for t in g["ids_33"].tolist()] for k in range(6)]
    for p in prompts + prompts[::-1]:
        assert _run(cached, p)[:2] == _run(fresh, p)[:2]
    stats = cached.batch_stats()["prefix_cache"]
    assert stats is not None
    assert stats["evicted_blocks"] > 0 and stats["bytes"] <= 20_000
    assert stats["hits"] >= 1  # the most recent prompts are still there


@pytest.mark.parametrize("bad", [-1, "lots", 1.5, True])
def test_a_bad_budget_is_refused(bad):
    with pytest.raises(InvalidInputError, match="prefix_cache"):
        colibri.Engine.demo(prefix_cache=bad)


def test_concurrent_requests_share_a_cached_prefix(converted, golden):
    """Many requests at once on one cached prefix each get their own output."""
    import concurrent.futures

    g = golden("olmoe")
    path = converted("olmoe")
    fresh, cached = colibri.Engine(path), colibri.Engine(path, prefix_cache="16MiB")
    base = g["ids_33"].tolist()
    _run(cached, base)
    prompts = [base + [k, k + 1] for k in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _run(cached, p), prompts))
    for p, (ids, lps, hit) in zip(prompts, got):
        assert (ids, lps) == _run(fresh, p)[:2]
        assert hit == 32


def test_longrope_rows_are_reused_only_in_their_regime(converted, golden):
    """Phi-MoE's LongRoPE rotates a run of tokens ending past 24 (the
    fixture's threshold) with other magnitudes: rows cached under a short
    prompt do not serve a long one, and the output stays exact."""
    g = golden("phimoe")
    path = converted("phimoe")
    fresh, cached = colibri.Engine(path), colibri.Engine(path, prefix_cache="16MiB")
    short = g["ids_33"].tolist()[:20]
    long = short + g["ids_7"].tolist() + [5, 6, 7]
    for prompt, served in ((short, 0), (long, 0), (long, 16), (short, 16)):
        want_ids, want_lps, _ = _run(fresh, prompt)
        got_ids, got_lps, hit = _run(cached, prompt)
        assert (got_ids, got_lps) == (want_ids, want_lps)
        assert hit == served, (len(prompt), hit)
