"""Generation: text and token-id APIs, streaming, stopping, sampling options,
reproducibility, thread safety, Ctrl-C and the conversion cache."""

from __future__ import annotations

import _thread
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import colibri
from colibri._engine import generation_defaults
from conftest import STYLES, make_text_checkpoint

PROMPT = "Once upon a time"
LONG = dict(max_new_tokens=40, ignore_eos=True)


def continuation(engine, prompt_ids, new_ids) -> str:
    """The text new_ids add after prompt_ids, from two whole decodes."""
    before = engine.detokenize(prompt_ids, skip_special_tokens=True)
    after = engine.detokenize(list(prompt_ids) + list(new_ids), skip_special_tokens=True)
    assert after.startswith(before)
    return after[len(before) :]


def test_text_in_text_out_and_ids_in_ids_out(llama):
    out = llama.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    assert isinstance(out, colibri.Completion) and isinstance(out, str)
    assert len(out.token_ids) == 12 and out.finish_reason == "length" and out.stop_reason is None
    # The text is what the ids add to the prompt's text (special tokens left out).
    ids = llama.tokenize(PROMPT)
    assert out == continuation(llama, ids, out.token_ids)
    same = llama.generate(ids, max_new_tokens=12, ignore_eos=True)
    assert isinstance(same, colibri.TokenCompletion) and same == out.token_ids
    assert same.finish_reason == "length"
    # Greedy is the argmax of the logits at every step.
    seq = list(ids)
    for tok in same[:4]:
        assert int(llama.logits(seq)[-1].argmax()) == tok
        seq.append(tok)


def test_a_list_of_prompts_gives_a_list_of_results(llama):
    prompts = [PROMPT, "The bird", "caf\u00e9"]
    outs = llama.generate(prompts, max_new_tokens=6, temperature=0.9, seed=4, ignore_eos=True)
    assert isinstance(outs, list) and len(outs) == 3
    for p, o in zip(prompts, outs):
        assert o == llama.generate(p, max_new_tokens=6, temperature=0.9, seed=4, ignore_eos=True)
    id_prompts = [[1, 5, 9], np.array([1, 7], dtype=np.int32)]
    outs = llama.generate(id_prompts, max_new_tokens=4, ignore_eos=True)
    assert [list(o) for o in outs] == [
        list(llama.generate(p, max_new_tokens=4, ignore_eos=True)) for p in id_prompts
    ]


def test_stream_yields_what_generate_returns(llama, chatml):
    for engine in (llama, chatml):
        for opts in (dict(LONG), dict(LONG, temperature=1.2, seed=3), dict(max_new_tokens=60)):
            want = engine.generate(PROMPT, **opts)
            stream = engine.stream(PROMPT, **opts)
            pieces = list(stream)
            assert all(isinstance(p, str) and p for p in pieces)
            assert "".join(pieces) == want == stream.text
            assert stream.finish_reason == want.finish_reason and stream.token_ids == want.token_ids
            assert stream.timings.generated_tokens == len(want.token_ids)
    ids = llama.tokenize(PROMPT)
    assert list(llama.stream(ids, max_new_tokens=9, ignore_eos=True)) == llama.generate(
        ids, **dict(LONG, max_new_tokens=9)
    )


def test_leaving_a_stream_early_stops_it(llama):
    stream = llama.stream(PROMPT, **LONG)
    first = [next(stream), next(stream)]
    stream.close()
    assert list(stream) == [] and stream.finish_reason is None
    assert len(stream.token_ids) < 40
    assert "".join(first) == llama.generate(PROMPT, **LONG)[: len("".join(first))]
    with llama.stream(PROMPT, **LONG) as s:
        next(s)
    assert s.finish_reason is None


def test_eos_from_generation_config_stops_and_is_not_in_the_text(tmp_path, llama):
    free = llama.generate(PROMPT, **LONG)
    eos = free.token_ids[5]
    src = make_text_checkpoint(
        "mixtral", tmp_path / "src", "llama", generation_config={"eos_token_id": [eos]}
    )
    colibri.convert(src, tmp_path / "m.colibri", progress=False)
    engine = colibri.Engine(tmp_path / "m.colibri", threads=2)
    # config.json and the tokenizer name </s> too.
    assert engine.eos_token_ids == [eos, 2] or (eos == 2 and engine.eos_token_ids == [2])
    first = min(i for i, t in enumerate(free.token_ids) if t in engine.eos_token_ids)
    out = engine.generate(PROMPT, max_new_tokens=40)
    assert out.finish_reason == "stop" and out.stop_reason == free.token_ids[first]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out == continuation(engine, engine.tokenize(PROMPT), free.token_ids[:first])
    assert engine.generate(PROMPT, **LONG).token_ids == free.token_ids
    # Token ids in: the eos id ends the list.
    ids = engine.generate(engine.tokenize(PROMPT), max_new_tokens=40)
    assert ids == free.token_ids[: first + 1] and ids.finish_reason == "stop"


def test_stop_token_ids(llama):
    free = llama.generate(PROMPT, **LONG)
    stop = free.token_ids[7]
    out = llama.generate(PROMPT, **LONG, stop_token_ids=[stop])
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_strings_spanning_tokens(llama):
    full = llama.generate(PROMPT, **LONG)
    pieces = list(llama.stream(PROMPT, **LONG))
    # A stop string made of the end of one piece and the start of the next
    # spans two tokens.
    k = next(i for i in range(1, len(pieces) - 1) if pieces[i].strip() and pieces[i + 1].strip())
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    want = full[: full.find(stop)]
    out = llama.generate(PROMPT, **LONG, stop=stop)
    assert out == want and stop not in out
    assert out.finish_reason == "stop" and out.stop_reason == stop
    stream = llama.stream(PROMPT, **LONG, stop=[stop])
    got = list(stream)
    assert "".join(got) == want and stream.finish_reason == "stop"
    assert len(stream.token_ids) < len(full.token_ids)
    # The earliest of several stop strings wins; one that never occurs changes nothing.
    other = full[-3:]
    first = min(full.find(other), full.find(stop))
    assert llama.generate(PROMPT, **LONG, stop=[other, stop, "never \u00e9 here"]) == full[:first]
    assert llama.generate(PROMPT, **LONG, stop="never \u00e9 here") == full
    # Token ids in: generation stops at the token that completes the stop string.
    prompt = llama.tokenize(PROMPT)
    ids = llama.generate(prompt, **LONG, stop=[stop])
    assert ids.finish_reason == "stop" and ids == full.token_ids[: len(ids)]
    assert stop in continuation(llama, prompt, ids)
    assert stop not in continuation(llama, prompt, ids[:-1])


SAMPLED = dict(
    temperature=0.9,
    top_k=40,
    top_p=0.95,
    min_p=0.02,
    repetition_penalty=1.1,
    presence_penalty=0.2,
    frequency_penalty=0.1,
    max_new_tokens=30,
    ignore_eos=True,
)


def test_a_seed_gives_the_same_output_whatever_the_thread_count(text_model):
    path = text_model("qwen3_moe", "chatml")
    engines = [colibri.Engine(path, threads=n) for n in (1, 2, 3)]
    for seed in (0, 17, 2**63 + 5):
        outs = [e.generate(PROMPT, seed=seed, **SAMPLED) for e in engines]
        assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
        assert outs[0] == outs[1] == outs[2]
    draws = {tuple(engines[1].generate(PROMPT, seed=s, **SAMPLED).token_ids) for s in range(5)}
    assert len(draws) > 1, "different seeds should give different samples"


def greedy_reference(engine, ids, n, rep=1.0, presence=0.0, frequency=0.0):
    """Greedy decoding with the penalties applied in NumPy to full forward passes."""
    seq, out = list(ids), []
    for _ in range(n):
        logits = engine.logits(seq)[-1].copy()
        seen = sorted(set(seq))
        s = logits[seen]
        logits[seen] = np.where(s < 0, s * np.float32(rep), s / np.float32(rep))
        for t in sorted(set(out)):
            logits[t] = logits[t] - np.float32(frequency) * np.float32(out.count(t)) - np.float32(presence)
        tok = int(np.argmax(logits))
        out.append(tok)
        seq.append(tok)
    return out


@pytest.mark.parametrize(
    "opts",
    [
        dict(repetition_penalty=1.7),
        dict(repetition_penalty=0.6),
        dict(presence_penalty=0.8),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=-0.3, frequency_penalty=0.4, repetition_penalty=1.3),
    ],
)
def test_penalties_match_a_reference(llama, opts):
    ids = llama.tokenize("The bird sang and sang")
    got = llama.generate(ids, max_new_tokens=12, ignore_eos=True, **opts)
    ref = greedy_reference(
        llama,
        ids,
        12,
        rep=opts.get("repetition_penalty", 1.0),
        presence=opts.get("presence_penalty", 0.0),
        frequency=opts.get("frequency_penalty", 0.0),
    )
    assert list(got) == ref
    assert list(got) != greedy_reference(llama, ids, 12), "the penalty should change something here"


def test_a_large_presence_penalty_never_repeats_a_token(llama):
    out = llama.generate(PROMPT, max_new_tokens=30, presence_penalty=1e4, ignore_eos=True)
    assert len(set(out.token_ids)) == 30


def test_filters_that_leave_one_token_are_greedy(llama):
    greedy = llama.generate(PROMPT, **LONG).token_ids
    for opts in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        for seed in (1, 2):
            assert llama.generate(PROMPT, **LONG, temperature=1.5, seed=seed, **opts).token_ids == greedy
    sampled = llama.generate(PROMPT, **LONG, temperature=1.5, seed=1).token_ids
    assert sampled != greedy


@pytest.mark.parametrize(
    "opts, needle",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=2), "min_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty="x"), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(stop=5), "stop"),
        (dict(stop=["ok", 3]), "stop"),
    ],
)
def test_bad_sampling_options_name_the_option(llama, opts, needle):
    with pytest.raises(colibri.InvalidInputError, match=needle):
        llama.generate(PROMPT, **opts)


def test_defaults_come_from_generation_config(tmp_path):
    assert generation_defaults(None)["temperature"] == 0.0
    assert generation_defaults({"temperature": 0.6})["temperature"] == 0.0, "only with do_sample"
    assert generation_defaults({"do_sample": True})["temperature"] == 1.0
    assert generation_defaults({"top_p": 7})["top_p"] == 1.0, "out-of-range values are ignored"
    gc = {
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_new_tokens": 7,
        "eos_token_id": 2,
    }
    src = make_text_checkpoint("mixtral", tmp_path / "src", "llama", generation_config=gc)
    colibri.convert(src, tmp_path / "m.colibri", progress=False)
    engine = colibri.Engine(tmp_path / "m.colibri", threads=2)
    d = engine.generation_defaults
    assert {k: d[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")} == {
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
    }
    assert d["max_new_tokens"] == 7
    explicit = dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.1, max_new_tokens=7)
    for seed in (3, 4):
        a = engine.generate(PROMPT, seed=seed, ignore_eos=True)
        assert len(a.token_ids) == 7
        assert a.token_ids == engine.generate(PROMPT, seed=seed, ignore_eos=True, **explicit).token_ids
    # An explicit value wins over the default.
    assert len(engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True).token_ids) == 3
    greedy = [engine.generate(PROMPT, temperature=0, seed=s, ignore_eos=True).token_ids for s in (1, 2)]
    assert greedy[0] == greedy[1] == greedy_reference(engine, engine.tokenize(PROMPT), 7, rep=1.1)


def test_timings_and_finish_reasons(llama):
    out = llama.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
    t = out.timings
    assert t.prompt_tokens == len(llama.tokenize(PROMPT)) and t.generated_tokens == 10
    assert t.prefill_seconds > 0 and t.decode_seconds > 0
    assert t.prefill_tokens_per_second > 0 and t.decode_tokens_per_second > 0
    assert "tok/s" in str(t)
    # The context fills up: "length" with exactly the room that was left.
    room = 5
    ids = [5] * (llama.context_length - room)
    out = llama.generate(ids, max_new_tokens=100, ignore_eos=True)
    assert len(out) == room and out.finish_reason == "length"
    assert llama.generate(PROMPT, max_new_tokens=0).token_ids == []


def test_concurrent_calls_give_the_sequential_results(llama):
    jobs = [dict(prompt=f"{PROMPT} {i}", seed=i, temperature=0.8 + i / 10) for i in range(6)]

    def run(job):
        out = llama.generate(job["prompt"], seed=job["seed"], temperature=job["temperature"], **LONG)
        streamed = "".join(
            llama.stream(job["prompt"], seed=job["seed"], temperature=job["temperature"], **LONG)
        )
        return out.token_ids, str(out), streamed

    want = [run(j) for j in jobs]
    got: list = [None] * len(jobs)
    errors: list = []

    def work(i):
        try:
            for _ in range(3):
                got[i] = run(jobs[i])
                assert got[i] == want[i]
        except Exception as e:  # reported below; an assertion in a thread would be lost
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == want
    for _, text, streamed in want:
        assert text == streamed


def test_keyboard_interrupt_stops_a_stream_and_the_engine_goes_on(llama):
    want = llama.generate(PROMPT, **LONG)
    stream = llama.stream(PROMPT, **LONG)
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(stream):
            if i == 2:
                _thread.interrupt_main()
    assert len(stream.token_ids) < 40
    assert llama.generate(PROMPT, **LONG) == want


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_during_generation_in_a_process(text_model):
    """SIGINT while a process generates in a loop: KeyboardInterrupt, then the
    same engine still gives the same answer."""
    script = textwrap.dedent(
        f"""
        import sys, colibri
        e = colibri.Engine({str(text_model())!r}, threads=1)
        ids = [3 + i % 100 for i in range(117)]
        want = list(e.generate(ids, max_new_tokens=8, ignore_eos=True))
        print("ready", flush=True)
        try:
            while True:
                for _ in e.stream(ids, max_new_tokens=8, ignore_eos=True):
                    pass
        except KeyboardInterrupt:
            pass
        assert list(e.generate(ids, max_new_tokens=8, ignore_eos=True)) == want
        print("usable", flush=True)
        """
    )
    p = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()  # a child that missed the signal would loop on
    assert p.returncode == 0, err
    assert out.strip() == "usable"


# ---------------------------------------------------------------------------
# Engine.from_pretrained


def test_from_pretrained_converts_once_and_reuses(tmp_path, monkeypatch):
    src = make_text_checkpoint("mixtral", tmp_path / "mixtral-hf", "llama")
    cache = tmp_path / "cache"
    a = colibri.Engine.from_pretrained(src, cache_dir=cache, threads=1)
    files = list(cache.glob("*.colibri"))
    assert len(files) == 1 and a.path == str(files[0])
    stamp = files[0].stat().st_mtime_ns
    b = colibri.Engine.from_pretrained(src, cache_dir=cache, threads=1)
    assert b.path == a.path and files[0].stat().st_mtime_ns == stamp, "reused, not converted again"
    assert b.generate(PROMPT, **LONG) == a.generate(PROMPT, **LONG)
    # Another dtype is another entry; the first stays.
    c = colibri.Engine.from_pretrained(src, dtype="bf16", cache_dir=cache, threads=1)
    assert c.dtype == "bf16" and len(list(cache.glob("*.colibri"))) == 2
    # A changed source converts again and replaces its stale entry.
    gc = dict(STYLES["llama"]["generation_config"], eos_token_id=[2, 7])
    (src / "generation_config.json").write_text(json.dumps(gc))
    d = colibri.Engine.from_pretrained(src, cache_dir=cache, threads=1)
    assert d.path != a.path and 7 in d.eos_token_ids
    assert not os.path.exists(a.path) and len(list(cache.glob("*.colibri"))) == 2
    # $COLIBRI_CACHE is the default place; a .colibri file opens as it is.
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "env-cache"))
    e = colibri.Engine.from_pretrained(src, threads=1)
    assert e.path.startswith(str(tmp_path / "env-cache"))
    assert colibri.Engine.from_pretrained(e.path).path == e.path
    with pytest.raises(colibri.ModelNotFoundError):
        colibri.Engine.from_pretrained(tmp_path / "missing", cache_dir=cache)


def test_results_survive_pickling_and_copying(llama):
    import copy
    import pickle

    out = llama.generate(PROMPT, max_new_tokens=5, ignore_eos=True)
    ids = llama.generate(llama.tokenize(PROMPT), max_new_tokens=5, ignore_eos=True)
    for r in (out, ids):
        for twin in (pickle.loads(pickle.dumps(r)), copy.copy(r), copy.deepcopy(r)):
            assert type(twin) is type(r) and twin == r
            for attr in ("finish_reason", "stop_reason", "timings"):
                assert getattr(twin, attr) == getattr(r, attr)
    assert pickle.loads(pickle.dumps(out)).token_ids == out.token_ids


def test_prompts_that_give_nothing_to_run(chatml):
    with pytest.raises(colibri.InvalidInputError, match="empty"):
        chatml.generate("")
    with pytest.raises(colibri.InvalidInputError, match="empty"):
        chatml.generate([])
    with pytest.raises(colibri.InvalidInputError, match="stop_token_ids"):
        chatml.generate(PROMPT, stop_token_ids=[-1])
    with pytest.raises(colibri.InvalidInputError, match="one prompt"):
        chatml.stream([PROMPT, PROMPT])


def test_logprobs_are_the_models_log_softmax_and_change_no_token():
    e = colibri.Engine.demo(threads=2)
    prompt = e.tokenize("Emma was")
    plain = e.generate(prompt, max_new_tokens=8, temperature=0.9, seed=3)
    r = e.generate(prompt, max_new_tokens=8, temperature=0.9, seed=3, logprobs=4)
    assert list(r) == list(plain) and plain.logprobs is None
    assert [t.token_id for t in r.logprobs] == list(r)
    # Against a fresh forward pass over prompt + output, in float64.
    logits = e.logits(prompt + list(r)[:-1])[len(prompt) - 1 :].astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    for row, t, z in zip(logits, r.logprobs, lse):
        assert t.logprob == pytest.approx(row[t.token_id] - z, abs=1e-4)
        assert [i for i, _ in t.top] == list(np.argsort(-row, kind="stable")[:4])
        assert [v for _, v in t.top] == pytest.approx(list(np.sort(row)[::-1][:4] - z), abs=1e-4)
    # A stream carries them too, aligned with its token ids; text prompts as well.
    s = e.stream("Emma was", max_new_tokens=5, temperature=0, logprobs=0)
    text = "".join(s)
    assert len(s.logprobs) == len(s.token_ids) and all(t.top == [] for t in s.logprobs)
    assert e.generate("Emma was", max_new_tokens=5, temperature=0, logprobs=0).logprobs == s.logprobs
    assert text == e.generate("Emma was", max_new_tokens=5, temperature=0)
    for bad in (-1, 21, 2.5, "3"):
        with pytest.raises(colibri.InvalidInputError, match="logprobs"):
            e.generate("Emma", max_new_tokens=1, logprobs=bad)
