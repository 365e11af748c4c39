"""Multi-token-prediction (MTP) layers against the goldens of make_golden.py.

The two fixtures carry one MTP layer each in a Hub layout: ``deepseek_v3_mtp``
(DeepSeek-V3 / GLM-4.5: ``model.layers.{L}.*`` with enorm, hnorm, eh_proj,
shared_head) and ``qwen3_5_moe_mtp`` (Qwen3.5 / Qwen3-Next: ``mtp.*``). Their
``mtp_draft_logits`` [T-1+K, V] hold the teacher-forced rows for ``mtp_ids``
(T ids) and then K draft steps; tests/fixtures/README.md gives the formula.
Transformers runs no MTP layer in its forward, so the goldens come from the
family's decoder layer run by the fixture script (and agree with transformers'
own MtpModel to ~4e-7 of the logit range, meta.json ``mtp``).

Tolerances as in test_parity.py: within 1e-4 * max(1, max|logit|) and the
same argmax on every row (each row's top-1 leads its top-2 by more than 1e-2,
meta.json ``mtp.min_teacher_forced_row_gap`` and the draft-step gaps), so the
draft tokens, which feed the later steps, are those of the goldens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import colibri
from conftest import GOLDEN

MTP_CASES = ("deepseek_v3_mtp", "qwen3_5_moe_mtp")


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    """with_mtp(case) -> the case converted with keep_mtp=True (once per module)."""
    root = tmp_path_factory.mktemp("mtp")
    cache: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in cache:
            out = root / f"{case}-mtp.colibri"
            colibri.convert(GOLDEN / case, out, keep_mtp=True, progress=False)
            cache[case] = out
        return cache[case]

    return get


def mtp_inputs(golden, case: str) -> tuple[list[int], int, np.ndarray]:
    g = golden(case)
    ids = g["mtp_ids"].tolist()
    k = int(g["mtp_k"].item())
    want = g["mtp_draft_logits"]
    assert want.shape == (len(ids) - 1 + k, g["logits_33"].shape[-1])
    return ids, k, want


@pytest.mark.parametrize("case", MTP_CASES)
def test_mtp_draft_logits_match_the_reference(case, with_mtp, golden):
    ids, k, want = mtp_inputs(golden, case)
    engine = colibri.Engine(with_mtp(case))
    got = engine.mtp_draft_logits(ids, k=k)
    assert isinstance(got, np.ndarray)
    assert got.shape == want.shape and got.dtype == np.float32, (got.shape, got.dtype)
    assert rel_err(got, want) <= 1e-4, f"{case}: {rel_err(got, want):.2e}"
    teacher = len(ids) - 1
    draft_got, draft_want = got[teacher:].argmax(-1), want[teacher:].argmax(-1)
    assert (draft_got == draft_want).all(), f"{case}: draft tokens {draft_got} != {draft_want}"
    assert (got.argmax(-1) == want.argmax(-1)).all(), f"{case}: argmax of a teacher-forced row differs"


@pytest.mark.parametrize("case", MTP_CASES)
def test_one_draft_step_gives_the_first_rows(case, with_mtp, golden):
    """The teacher-forced rows and the first step do not depend on how many steps follow."""
    ids, _, want = mtp_inputs(golden, case)
    got = colibri.Engine(with_mtp(case)).mtp_draft_logits(ids, k=1)
    assert got.shape == (len(ids), want.shape[-1])
    assert rel_err(got, want[: len(ids)]) <= 1e-4, f"{case}: {rel_err(got, want[: len(ids)]):.2e}"


@pytest.mark.parametrize("case", MTP_CASES)
def test_keeping_the_mtp_layer_leaves_the_main_model_alone(case, with_mtp, golden):
    """The MTP layer is not read as one more main layer: the ordinary goldens still hold."""
    g = golden(case)
    engine = colibri.Engine(with_mtp(case))
    for t in (7, 33):
        got, want = engine.logits(g[f"ids_{t}"]), g[f"logits_{t}"]
        assert rel_err(got, want) <= 1e-4, f"{case} T={t}: {rel_err(got, want):.2e}"


@pytest.mark.parametrize("case", MTP_CASES)
def test_a_file_converted_without_keep_mtp_has_no_mtp_layers(case, converted, golden):
    ids, k, _ = mtp_inputs(golden, case)
    engine = colibri.Engine(converted(case))
    with pytest.raises(colibri.InvalidInputError, match=r"(?i)mtp|multi-token") as err:
        engine.mtp_draft_logits(ids, k=k)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("case", MTP_CASES)
def test_mtp_drafts_change_no_token(case, with_mtp, golden):
    """speculative="mtp": greedy and seeded output token for token (and
    log-probability for log-probability) the output without drafts, alone
    and beside other sequences; drafts are made and counted."""
    engine = colibri.Engine(with_mtp(case))
    g = golden(case)
    prompts = [g["ids_33"].tolist(), g["ids_7"].tolist(), g["ids_33"].tolist()[5:20]]
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
        want = [engine.generate(p, max_new_tokens=24, logprobs=2, **sampling) for p in prompts]
        for k in (1, 3):
            got = engine.generate(
                prompts[0], max_new_tokens=24, logprobs=2, speculative="mtp", draft_tokens=k, **sampling
            )
            assert list(got) == list(want[0]) and got.logprobs == want[0].logprobs, (case, sampling, k)
            t = got.timings
            assert t.drafted_tokens > 0 and t.decode_passes + t.accepted_tokens == t.generated_tokens - 1, t
        both = engine.generate(prompts, max_new_tokens=24, speculative="mtp", draft_tokens=2, **sampling)
        assert [list(b) for b in both] == [list(w) for w in want], (case, sampling)


def test_mtp_drafts_with_a_prefix_cache_change_nothing(with_mtp, golden):
    """A drafting sequence computes its whole prompt (the layer needs its
    rows) but still fills the prefix cache for others."""
    case = "qwen3_5_moe_mtp"
    g = golden(case)
    prompt = g["ids_33"].tolist()
    plain = colibri.Engine(with_mtp(case)).generate(prompt, max_new_tokens=16)
    engine = colibri.Engine(with_mtp(case), prefix_cache="16MiB")
    first = engine.generate(prompt, max_new_tokens=16, speculative="mtp")
    again = engine.generate(prompt, max_new_tokens=16, speculative="mtp")
    other = engine.generate(prompt, max_new_tokens=16)
    assert list(first) == list(again) == list(other) == list(plain)
    assert again.timings.cached_tokens == 0 and other.timings.cached_tokens > 0


def test_mtp_drafts_with_experts_streamed_change_nothing(with_mtp, golden):
    """Under a RAM budget smaller than the experts (the MTP layer's among
    them, read through the same store), drafting changes no token."""
    case = "deepseek_v3_mtp"
    prompt = golden(case)["ids_33"].tolist()
    want = colibri.Engine(with_mtp(case)).generate(prompt, max_new_tokens=20)
    small = colibri.Engine(with_mtp(case), ram_budget=60_000)
    got = small.generate(prompt, max_new_tokens=20, speculative="mtp", draft_tokens=3)
    assert list(got) == list(want) and got.timings.drafted_tokens > 0
    stats = small.store_stats()
    assert stats["streaming"] and stats["misses"] > 0, stats
    # The MTP layer's experts come through the store too.
    assert stats["layers"][-1]["hits"] + stats["layers"][-1]["misses"] > 0, stats["layers"][-1]


def test_the_cli_keeps_the_layer_when_asked_and_info_says_so(tmp_path, capsys):
    from colibri.cli import main

    src = GOLDEN / "qwen3_5_moe_mtp"
    out = tmp_path / "m.colibri"
    assert main(["convert", str(src), "-o", str(out), "--keep-mtp", "-q"]) == 0
    assert main(["info", str(out)]) == 0
    assert "1 multi-token-prediction layer" in capsys.readouterr().out
    assert main(["convert", str(src), "-o", str(out), "--force", "-q"]) == 0  # 5% rule: dropped here
    assert main(["info", str(out)]) == 0
    assert "multi-token-prediction" not in capsys.readouterr().out.split("not converted")[0]


def test_a_server_default_of_mtp_drafts_needs_the_layer(converted):
    from colibri.server import create_app

    with pytest.raises(colibri.InvalidInputError, match="--keep-mtp"):
        create_app(colibri.Engine(converted("qwen3_moe")), speculative="mtp")
    create_app(colibri.Engine.demo(), speculative="mtp")  # the demo keeps its MTP head
