"""The quantised weight types stay close to the demo model they were made from.

The bundled demo model (bf16, trained) is re-encoded into q8_0, q4_0 and q4_1
and compared with the shipped file on English prose, position by position,
with the measures and the text that scripts/accuracy.py uses (scripts/_common.py).
docs/accuracy.md has the full figures and how they were made.

Measured on this text (557 positions; the same numbers on every thread
count, since the engine's logits do not depend on it; the block types run
with their default f16 KV cache):

    type   top-1 agreement   mean KL      cross-entropy (bf16: 4.4617)
    q8_0   0.9856            2.0e-4       4.4624
    q4_0   0.9210            4.9e-3       4.4754
    q4_1   0.9192            4.4e-3       4.4675

The bounds below leave room for changes in summation order (new kernels)
without letting a real regression through: a broken scale, a wrong nibble
order or a mis-interleaved row sends top-1 agreement towards 1/4096 and KL
to whole nats.
"""

from __future__ import annotations

import numpy as np
import pytest

import colibri
from conftest import load_script

acc = load_script("accuracy")
common = load_script("_common")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    if not common.DEMO.is_file():
        pytest.skip("the demo model is not in this checkout")
    work = tmp_path_factory.mktemp("accuracy")
    ref = colibri.Engine(common.DEMO, threads=2)
    # The importance matrix of the default calibration text (training prose,
    # disjoint from the text measured on).
    imatrix = ref.calibrate(work / "demo.imatrix", progress=False)
    out = {}
    runs = [(t, t, None) for t in (*acc.BLOCK_TYPES, "q4k", "q5k", "q6k")]
    runs += [(f"{t}+imatrix", t, imatrix) for t in ("q4_0", "q4_1", "q4k")]
    runs += [(r, r, None) for r in ("q4_1-mix-down8", "q4k-mix")]
    for t, dtype, im in runs:
        path = work / f"demo-{t}.colibri"
        colibri.convert(common.DEMO, path, dtype=dtype, imatrix=im, progress=False)
        eng = colibri.Engine(path, threads=2)
        assert eng.dtype == {"q4_1-mix-down8": "q4_1", "q4k-mix": "q4k"}.get(dtype, dtype)
        # The tokenizer travelled with the re-encoded file.
        seqs = common.windows(eng.tokenize("\n".join(common.PROSE) + "\n"), 128)
        m = acc.measure(ref, eng, seqs, score_next=True)
        out[t] = {
            "top1": m["agree"] / m["positions"],
            "kl": m["kl"] / m["positions"],
            "ce_ref": m["nll_ref"] / m["scored"],
            "ce": m["nll_other"] / m["scored"],
            "positions": m["positions"],
        }
    return out


def test_enough_positions(measured):
    # One position is 1/557 of top-1 agreement, so 0.97 below means at most
    # 16 flipped argmaxes (8 were seen).
    assert measured["q8_0"]["positions"] >= 500


def test_q8_0_is_nearly_lossless(measured):
    m = measured["q8_0"]
    # Seen 0.9856 and 2.0e-4: the 8 flipped argmaxes are all at positions where
    # the reference's two best tokens are within 0.0014 in probability.
    assert m["top1"] >= 0.97, m
    assert m["kl"] <= 1e-3, m
    assert abs(m["ce"] - m["ce_ref"]) <= 2e-3, m


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_4_bit_types_stay_bounded(measured, dtype):
    m = measured[dtype]
    # Seen about 0.92 and 4.4e-3 to 4.9e-3; cross-entropy up by 0.006 to 0.014 nats.
    assert m["top1"] >= 0.85, m
    assert m["kl"] <= 1.5e-2, m
    assert m["ce"] - m["ce_ref"] <= 0.03, m


def test_error_ordering(measured):
    k8, k40, k41 = (measured[t]["kl"] for t in ("q8_0", "q4_0", "q4_1"))
    # q8_0 is about 20x closer than either 4-bit type.
    assert k8 * 8 < min(k40, k41), (k8, k40, k41)
    # q4_1 is closer than q4_0 on this model, but only by about 10% on this
    # text (25% on held-out Austen; on random models 20-35%, and on one of the
    # widened random fixtures it is slightly worse, see docs/accuracy.md). So
    # only the order is asserted, not a ratio.
    assert k41 < k40, (k41, k40)


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_an_importance_matrix_lowers_the_error(measured, dtype):
    plain, weighted = measured[dtype]["kl"], measured[f"{dtype}+imatrix"]["kl"]
    # Seen 4.93e-3 -> 4.28e-3 (q4_0, 0.87x) and 4.36e-3 -> 3.55e-3 (q4_1,
    # 0.81x): the quantisers minimise the activation-weighted error.
    assert weighted < 0.95 * plain, (weighted, plain)


def test_super_block_types_order_by_bits(measured):
    k = {t: measured[t]["kl"] for t in ("q4_0", "q4k", "q5k", "q6k", "q8_0")}
    # Seen 4.93e-3 (q4_0, 4.54 bpw), 3.93e-3 (q4k, 4.66), 9.6e-4 (q5k, 5.66),
    # 4.1e-4 (q6k, 6.73), 2.3e-4 (q8_0, 8.53) on this text.
    assert k["q4k"] < k["q4_0"], k
    assert k["q5k"] < 0.5 * k["q4k"], k
    assert k["q6k"] < 0.7 * k["q5k"], k
    assert measured["q4k+imatrix"]["kl"] < k["q4k"], "seen 3.51e-3"
    # The 4-bit recipe: q4k experts, q5k down projections and attention q/o,
    # q6k elsewhere (the tied embedding, the output head, at q8_0; 5.52 bpw
    # here): seen 4.2e-4, 9x below q4k alone (3.9e-4 with q6k q/o).
    assert measured["q4k-mix"]["kl"] < 0.3 * k["q4k"], measured["q4k-mix"]


def test_the_mixed_recipe_is_close_to_q8_0(measured):
    # Attention, embedding (also the tied output head) and the experts' down
    # projections at q8_0, the rest of the experts at q4_1: seen 3.3e-4
    # mean KL, 13x below q4_1 alone, at 6.7 bits per weight against q4_1's
    # 5.0 and q8_0's 8.5.
    m, k41 = measured["q4_1-mix-down8"]["kl"], measured["q4_1"]["kl"]
    assert m * 5 < k41, (m, k41)
    assert measured["q4_1-mix-down8"]["top1"] >= 0.95


def test_measure_is_zero_against_itself():
    # The measure itself: a model compared with itself agrees everywhere with KL 0.
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, 11)).astype(np.float32)
    m = common.compare(logits, logits, np.array([1, 2, 3, 4, 5, 6, -1]))
    assert m["agree"] == 7 and m["kl"] == 0.0 and m["nll_ref"] == m["nll_other"]
