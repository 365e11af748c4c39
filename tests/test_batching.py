"""Continuous batching from Python: generations from many threads, and the
prompts of one ``generate([...])``, run together and give the tokens each
gives alone."""

from __future__ import annotations

import threading
import time

import pytest

import colibri

PROMPTS = [
    "It is a truth universally acknowledged",
    "The morning was",
    "She said",
    "Mr. Darcy",
    "In the garden",
    "A letter came",
    "They walked",
    "Nothing could be",
]


@pytest.fixture(scope="module")
def demo():
    return colibri.Engine.demo(threads=2, max_batch=4)


def test_a_list_of_prompts_runs_batched_and_each_gets_its_own_tokens(demo):
    alone = [demo.generate(p, max_new_tokens=20, temperature=0, ignore_eos=True) for p in PROMPTS]
    seeded = [demo.generate(p, max_new_tokens=20, temperature=0.9, seed=k) for k, p in enumerate(PROMPTS)]
    before = demo.batch_stats()
    together = demo.generate(PROMPTS, max_new_tokens=20, temperature=0, ignore_eos=True)
    after = demo.batch_stats()
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [str(r) for r in together] == [str(r) for r in alone]
    # Several decoders shared steps (max_batch 4, eight prompts).
    shared = [a - b for a, b in zip(after["step_sequences"], before["step_sequences"])]
    assert sum(shared[2:]) > 0, shared
    assert after["generated_tokens"] - before["generated_tokens"] == 8 * 20
    # Seeded sampling from threads at once: each seed its own tokens.
    out: dict[int, list[int]] = {}

    def run(k: int) -> None:
        out[k] = demo.generate(PROMPTS[k], max_new_tokens=20, temperature=0.9, seed=k).token_ids

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[k] for k in range(len(PROMPTS))] == [r.token_ids for r in seeded]


def test_a_stream_cancelled_from_another_thread_ends_and_frees_its_place(demo):
    s = demo.stream(PROMPTS[0], max_new_tokens=10_000, temperature=0, ignore_eos=True)
    first = next(s)
    assert first
    threading.Timer(0.05, s.cancel).start()
    pieces = list(s)  # ends once cancelled, well before the context is full
    assert s.finish_reason is None
    assert len(s.token_ids) < demo.context_length
    del pieces
    deadline = time.monotonic() + 5
    while demo.batch_stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert demo.batch_stats()["running"] == 0
    # The engine goes on, same tokens as before.
    again = demo.generate(PROMPTS[1], max_new_tokens=8, temperature=0)
    assert again.token_ids == demo.generate(PROMPTS[1], max_new_tokens=8, temperature=0).token_ids


def test_a_stream_cancelled_while_queued_ends_at_once_and_leaves_the_queue():
    e = colibri.Engine.demo(threads=2, max_batch=1)
    room = e.context_length - len(e.tokenize(PROMPTS[0]))
    running = e.stream(PROMPTS[0], max_new_tokens=room, temperature=0, ignore_eos=True)
    assert next(running)
    queued = e.stream(PROMPTS[1], max_new_tokens=8, temperature=0)
    assert e.batch_stats()["waiting"] == 1
    threading.Timer(0.05, queued.cancel).start()
    assert list(queued) == []  # waits, then ends when cancelled
    assert queued.finish_reason is None and queued.token_ids == []
    # It ended while the other still ran, not once a place freed for it.
    assert e.batch_stats()["running"] == 1
    deadline = time.monotonic() + 5
    while e.batch_stats()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert e.batch_stats()["waiting"] == 0 and e.batch_stats()["running"] == 1
    running.cancel()


def test_a_full_queue_is_a_busy_error_and_the_options_are_checked():
    e = colibri.Engine.demo(threads=2, max_batch=1, max_queue=1)
    held = [e.stream(PROMPTS[0], max_new_tokens=400, temperature=0, ignore_eos=True)]
    # Once the first runs, one more fits in the queue and the next is refused.
    deadline = time.monotonic() + 10
    while e.batch_stats()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(colibri.BusyError, match="queue is full"):
        for _ in range(50):
            held.append(e.stream(PROMPTS[0], max_new_tokens=400, temperature=0, ignore_eos=True))
    assert len(held) >= 2  # one running, one waiting
    for s in held:
        s.cancel()
    for bad in ({"max_batch": 0}, {"max_queue": -1}, {"max_batch": True}, {"max_batch": 1.5}):
        with pytest.raises(colibri.InvalidInputError, match="max_"):
            colibri.Engine.demo(**bad)


def test_a_state_memory_budget_queues_generations_and_refuses_what_cannot_fit(converted):
    """Under a budget one generation's state fills, generations run one after
    another with the tokens they give alone; one that alone needs more than
    the budget is a ContextLengthError naming it."""
    path = converted("qwen3_5_moe")
    alone = colibri.Engine(path)
    state = alone.state_bytes()
    prompts = [[3, 5, 7, 11 + k] for k in range(3)]
    one = state["per_sequence"] + (4 + 6) * state["per_token"]
    engine = colibri.Engine(path, max_state_memory=one + one // 2)
    got = engine.generate(prompts, max_new_tokens=6, temperature=0)
    assert [list(g) for g in got] == [
        list(alone.generate(p, max_new_tokens=6, temperature=0)) for p in prompts
    ]
    with pytest.raises(colibri.ContextLengthError, match="state"):
        engine.generate(prompts[0], max_new_tokens=200, temperature=0)
    with pytest.raises(colibri.InvalidInputError, match="max_state_memory"):
        colibri.Engine(path, max_state_memory=-1)
