"""The conventional parts of the Python API: SamplingParams as the one
definition of the sampling options, Engine.close() and the context manager,
the kv_cache_dtype name."""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
import typing

import pytest

import colibri
from colibri._sampling import SamplingOptions

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def demo():
    return colibri.Engine.demo(threads=2)


def test_sampling_params_is_frozen_checked_and_normalised():
    p = colibri.SamplingParams(temperature=1, stop="END", stop_token_ids=[3, 4], max_new_tokens=5)
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    assert p.replace(temperature=0.2).temperature == 0.2 and p.temperature == 1.0
    assert pickle.loads(pickle.dumps(p)) == p and hash(p) == hash(p.replace())
    for bad, field in [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(top_k=1.5), "top_k"),
        (dict(temperature="hot"), "temperature"),
        (dict(seed=2**64), "seed"),
        (dict(stop=[1]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=21), "logprobs"),
        (dict(max_new_tokens=True), "max_new_tokens"),
    ]:
        with pytest.raises(colibri.InvalidInputError, match=field):
            colibri.SamplingParams(**bad)
    with pytest.raises(TypeError, match="no field 'temp'"):
        p.replace(temp=1)


def test_keywords_and_sampling_params_are_the_same_request(demo):
    p = colibri.SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=12)
    by_object = demo.generate(PROMPT, p)
    by_keywords = demo.generate(PROMPT, temperature=0.8, top_p=0.9, seed=7, max_new_tokens=12)
    assert by_object == by_keywords and by_object.token_ids == by_keywords.token_ids
    # Keywords beside the object replace its fields.
    assert demo.generate(PROMPT, p, seed=8) == demo.generate(PROMPT, p.replace(seed=8))
    assert "".join(demo.stream(PROMPT, p)) == by_object
    ids = demo.tokenize(PROMPT)
    assert list(demo.generate(ids, p)) == by_object.token_ids
    # The same object serves a batch; each prompt as alone.
    batch = demo.generate([PROMPT, "A"], p)
    assert batch[0] == by_object and batch[1] == demo.generate("A", p)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temp'"):
        demo.generate(PROMPT, temp=0.5)
    with pytest.raises(colibri.InvalidInputError, match="SamplingParams"):
        demo.generate(PROMPT, {"temperature": 0.5})  # type: ignore[call-overload]


def test_one_definition_of_the_options():
    fields = [f.name for f in dataclasses.fields(colibri.SamplingParams)]
    assert fields == list(SamplingOptions.__annotations__), "SamplingOptions lists SamplingParams' fields"


def test_close_ends_work_saves_heat_and_refuses_later_calls(demo, tmp_path):
    heat = tmp_path / "demo.heat"
    plan = colibri.plan(demo.path)
    budget = plan["dense_bytes"] + plan["expert_bytes"] // 3
    engine = colibri.Engine(demo.path, threads=2, ram_budget=budget, heat_file=heat)
    engine.generate(PROMPT, max_new_tokens=4)
    long = engine.stream(PROMPT, max_new_tokens=100_000, ignore_eos=True)
    next(iter(long))
    engine.close()
    # Saved at close, not at garbage collection (the engine is still referenced).
    assert heat.is_file() and heat.stat().st_size > 0
    with pytest.raises(colibri.ColibriError, match="closed"):
        list(long)  # the running generation ended with an error
    assert engine.closed and "closed" in repr(engine)
    calls = (lambda: engine.generate(PROMPT), lambda: engine.logits([1, 2]), lambda: engine.routing_stats())
    for call in calls:
        with pytest.raises(colibri.InvalidInputError, match="this Engine is closed"):
            call()
    engine.close()  # again: nothing


def test_context_manager_closes_and_concurrent_callers_get_an_error(demo):
    with colibri.Engine(demo.path, threads=2) as engine:
        assert engine.generate(PROMPT, max_new_tokens=3, temperature=0) == demo.generate(
            PROMPT, max_new_tokens=3, temperature=0
        )
        errors: list[BaseException] = []

        def run():
            try:
                engine.generate(PROMPT, max_new_tokens=100_000, ignore_eos=True)
            except BaseException as e:  # noqa: BLE001 - recorded for the assertion
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        while engine.batch_stats()["running"] == 0 and t.is_alive():
            time.sleep(0.001)
    t.join(timeout=30)
    assert not t.is_alive() and engine.closed
    assert len(errors) == 1 and isinstance(errors[0], colibri.ColibriError), errors


def test_kv_cache_dtype_is_the_name_and_the_old_one_warns(demo):
    assert colibri.Engine(demo.path, kv_cache_dtype="f16").kv_cache_dtype == "f16"
    with pytest.warns(DeprecationWarning, match="kv_cache_dtype"):
        assert colibri.Engine(demo.path, kv_cache="f32").kv_cache_dtype == "f32"
    with pytest.raises(colibri.InvalidInputError, match="kv_cache"):
        colibri.Engine(demo.path, kv_cache_dtype="int8")


def _is_typeddict(t: object) -> bool:
    # typing.is_typeddict is Python 3.10+: a TypedDict is a dict class with __total__.
    return isinstance(t, type) and issubclass(t, dict) and hasattr(t, "__total__")


def _keys_match(shape: type, value: dict, where: str) -> None:
    hints = typing.get_type_hints(shape)
    assert set(hints) == set(value), (
        f"{where}: typed {sorted(set(hints) ^ set(value))} differ from the report"
    )
    for k, hint in hints.items():
        inner = typing.get_args(hint)
        if _is_typeddict(hint):
            _keys_match(hint, value[k], f"{where}.{k}")
        elif typing.get_origin(hint) is list and inner and _is_typeddict(inner[0]):
            for i, item in enumerate(value[k]):
                _keys_match(inner[0], item, f"{where}.{k}[{i}]")


def test_typed_reports_have_exactly_the_native_keys(demo):
    plan = colibri.plan(demo.path)
    engine = colibri.Engine(
        demo.path, ram_budget=plan["dense_bytes"] + plan["expert_bytes"] // 3, heat_file="off"
    )
    engine.generate(PROMPT, max_new_tokens=4)
    _keys_match(colibri.RoutingStats, engine.routing_stats(), "routing_stats()")
    _keys_match(colibri.StoreStats, engine.store_stats(), "store_stats()")
    _keys_match(colibri.BatchStats, engine.batch_stats(), "batch_stats()")
    _keys_match(colibri.Plan, colibri.plan(demo.path, plan["min_budget"] * 2), "plan()")
    assert engine.store_stats()["layers"], "a streaming engine reports its layers"
