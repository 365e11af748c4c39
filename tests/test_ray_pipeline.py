"""A model split into pipeline stages on a local multi-node Ray cluster
(colibri.ray.Engine): the single process's logits bit for bit and its greedy
and seeded tokens through 2 and 3 stages, for GQA, MLA and linear-attention
layers; both transports; concurrent generations; a killed stage fails the
request in flight with an error naming it and the pipeline serves again.

The cluster is three Ray nodes of one CPU each on 127.0.0.1, started once for
the module; every wait in colibri.ray has a timeout.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import colibri

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")
from colibri.ray import Engine as PipelineEngine  # noqa: E402

PROMPT = [3, 17, 5, 9, 22, 31, 8, 2, 14]


@pytest.fixture(scope="module")
def cluster():
    head = {"num_cpus": 1, "include_dashboard": False}
    c = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
    for _ in range(2):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, include_dashboard=False, logging_level="error")
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def single(path):
    e = colibri.Engine(path, threads=1)
    return e


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_stages_equal_one_process(cluster, converted, case):
    path = converted(case)
    local = single(path)
    want_logits = local.logits(PROMPT)
    want_greedy = list(local.generate(PROMPT, max_new_tokens=12, temperature=0))
    want_seeded = list(local.generate(PROMPT, max_new_tokens=12, temperature=1.0, top_k=20, seed=7))
    for stages in (2, 3):
        with PipelineEngine(path, stages=stages, timeout=60) as e:
            plan = e.pipeline.plan
            assert len(plan) == stages and plan[0][0] == 0 and plan[-1][1] == local.num_layers
            assert all(a[1] == b[0] for a, b in zip(plan, plan[1:])), plan
            # One stage per node.
            assert len({s["node"] for s in e.stages()}) == stages
            got = e.logits(PROMPT)
            assert got.dtype == want_logits.dtype
            assert np.array_equal(got, want_logits), f"{case}, {stages} stages"
            assert list(e.generate(PROMPT, max_new_tokens=12, temperature=0)) == want_greedy
            seeded = e.generate(PROMPT, max_new_tokens=12, temperature=1.0, top_k=20, seed=7)
            assert list(seeded) == want_seeded
            assert seeded.finish_reason == "length"


def test_a_folder_of_stage_files_runs_each_stage_where_its_file_is(cluster, converted, tmp_path):
    path = converted("deepseek_v3")
    local = single(path)
    want_logits = local.logits(PROMPT)
    want = list(local.generate(PROMPT, max_new_tokens=12, temperature=0))
    files = colibri.split(path, 3, out=tmp_path, progress=False)
    with PipelineEngine(tmp_path, timeout=60) as e:
        assert e.pipeline.plan == [f["layers"] for f in files]
        described = e.stages()
        assert len({s["node"] for s in described}) == 3
        assert [s["weight_bytes"] for s in described] == [f["bytes"] for f in files]
        assert np.array_equal(e.logits(PROMPT), want_logits)
        assert list(e.generate(PROMPT, max_new_tokens=12, temperature=0)) == want
    # Each stage streaming its experts from its own file under a RAM budget.
    budget = max(colibri.plan(f["path"])["min_budget"] for f in files)
    with PipelineEngine(tmp_path, stages=3, ram_budget=budget, transport="actor", timeout=60) as e:
        assert list(e.generate(PROMPT, max_new_tokens=12, temperature=0)) == want
        assert e.store_stats()["misses"] > 0  # the experts were read into slots
    with pytest.raises(colibri.StageError, match="found files of a split into \\[3\\] stages"):
        PipelineEngine(tmp_path, stages=2, timeout=60)
    with pytest.raises(colibri.ModelNotFoundError, match="no stage files in .*nowhere on any of the 3 node"):
        PipelineEngine(tmp_path / "nowhere", timeout=60)


def test_plain_actor_calls_and_streams_and_text(cluster):
    local = colibri.Engine.demo(threads=1)
    want = local.generate("The garden at night", max_new_tokens=10, temperature=0)
    with PipelineEngine.demo(stages=2, transport="actor", timeout=60) as e:
        assert e.pipeline.transport == "actor"
        got = e.generate("The garden at night", max_new_tokens=10, temperature=0)
        assert got.text == want.text and got.token_ids == want.token_ids
        pieces = list(e.stream("The garden at night", max_new_tokens=10, temperature=0))
        assert "".join(pieces) == want.text
        # A stop string ends the stream early; the stages forget the sequence.
        first = want.text.split()[1]
        cut = e.generate("The garden at night", max_new_tokens=10, temperature=0, stop=[first])
        assert first not in cut.text and cut.finish_reason == "stop"


def test_concurrent_generations_share_batched_passes(cluster, converted):
    path = converted("qwen3_moe")
    local = single(path)
    prompts = [PROMPT[i % 5 :] + [i + 1] for i in range(8)]
    want = [list(local.generate(p, max_new_tokens=16, temperature=0)) for p in prompts]
    with PipelineEngine(path, stages=2, timeout=60) as e:
        got: list[list[int] | None] = [None] * len(prompts)

        def run(i: int) -> None:
            got[i] = list(e.generate(prompts[i], max_new_tokens=16, temperature=0))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert got == want
        # Eight sequences, two messages in flight: decode steps waited and
        # went through the stages together, in batched passes.
        assert e.pipeline.batched_steps > 0
        # Finished sequences are released on every stage (the release
        # messages follow the last steps through the pipeline).
        deadline = time.monotonic() + 10
        while any(s["sequences"] for s in e.stages()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [s["sequences"] for s in e.stages()] == [0, 0]


def test_bad_requests_get_typed_errors(cluster, converted):
    path = converted("qwen3_moe")
    with pytest.raises(colibri.InvalidInputError, match="stages"):
        PipelineEngine(path, stages=4, timeout=30)  # three layers
    with pytest.raises(colibri.InvalidInputError, match="transport"):
        PipelineEngine(path, stages=2, transport="tcp")
    with pytest.raises(colibri.ModelNotFoundError):
        PipelineEngine(str(path) + ".missing", stages=2)
    with PipelineEngine(path, stages=2, timeout=60) as e:
        with pytest.raises(colibri.InvalidInputError, match="speculative"):
            e.generate(PROMPT, max_new_tokens=4, speculative="ngram")
        with pytest.raises(colibri.InvalidInputError, match="out of range"):
            e.logits([10**6])
        with pytest.raises(colibri.ContextLengthError):
            e.generate([1] * (e.context_length + 1), max_new_tokens=1)
        with pytest.raises(colibri.InvalidInputError, match="not available through pipeline stages"):
            e.hidden_states(PROMPT)
        # Refused by the last stage after the first has begun the sequence
        # (a constraint needs a tokenizer, which this model has not).
        with pytest.raises(colibri.ColibriError):
            e.generate(PROMPT, max_new_tokens=2, regex="a+")
        # Still serving after the errors, and no stage holds a failed sequence.
        assert len(e.generate(PROMPT, max_new_tokens=3, temperature=0)) == 3
        deadline = time.monotonic() + 10
        while any(s["sequences"] for s in e.stages()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [s["sequences"] for s in e.stages()] == [0, 0]


def test_a_killed_stage_fails_its_request_and_the_pipeline_restarts(cluster, converted):
    path = converted("deepseek_v3")
    want = list(single(path).generate(PROMPT, max_new_tokens=40, temperature=0))
    with PipelineEngine(path, stages=3, timeout=20) as e:
        # Long enough that the stream cannot finish before the kill lands
        # (40 tokens of this toy model can all arrive before it does).
        stream = e.stream(PROMPT, max_new_tokens=2000, temperature=0, ignore_eos=True)
        it = iter(stream)
        next(it)
        ray.kill(e.pipeline.actors[1])
        with pytest.raises(colibri.StageError, match=r"stage 1 \(layers"):
            for _ in it:
                pass
        assert e.pipeline.restarts == 1
        assert list(e.generate(PROMPT, max_new_tokens=40, temperature=0)) == want


def test_the_server_serves_a_pipeline_with_its_metrics(cluster):
    """create_app over the pipeline: the OpenAI client gets the single
    process's text; /metrics and the stats add the stages up, each MoE layer's
    routing heat from the stage that runs it equal to one process's."""
    import openai
    from test_server import live

    from colibri.server import create_app

    local = colibri.Engine.demo(threads=1)
    prompt = "Her sister was"
    want = local.generate(prompt, max_new_tokens=12, temperature=0)
    with PipelineEngine.demo(stages=2, timeout=60) as e:
        with live(create_app(e, model_name="demo")) as url:
            c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            r = c.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0)
            assert r.choices[0].text == want.text
            chat = c.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0
            )
            assert (
                chat.choices[0].message.content
                == local.chat([{"role": "user", "content": "Hello"}], max_new_tokens=6, temperature=0).text
            )
            import httpx

            made = r.usage.completion_tokens + chat.usage.completion_tokens
            metrics = httpx.get(url + "/metrics", timeout=30).text
            assert f"colibri_generation_tokens_total {float(made)}" in metrics
        b = e.batch_stats()
        assert b["generated_tokens"] == made and b["finished"] == 2 and b["running"] == 0
        # Same tokens, same routing: every layer's heat is one process's.
        # (The demo's multi-token-prediction layer, which stages do not run,
        # is the local engine's last row.)
        heat = [layer["heat"] for layer in e.routing_stats()["layers"]]
        assert len(heat) == e.num_layers and any(any(h) for h in heat)
        assert heat == [layer["heat"] for layer in local.routing_stats()["layers"]][: e.num_layers]
        assert e.store_stats()["weights"]["backing"] in ("mapped", "copied")


def test_a_plan_too_big_for_a_node_is_refused_with_the_sizes():
    from colibri.ray._pipeline import too_small

    assert too_small([100 * 2**20, 50 * 2**20], [200 * 2**20, 200 * 2**20]) is None
    assert too_small([100, 50], [0.0, 0.0]) is None  # no memory reported: not judged
    why = too_small([300 * 2**20, 50 * 2**20], [200 * 2**20, 200 * 2**20])
    assert why is not None and "stage 0 needs 300.0 MiB of weights, its node has 200.0 MiB" in why
    assert "stage 1" not in why


def test_serve_replicas_of_a_pipeline(cluster, tmp_path):
    """deployment(stages=2) (``colibri serve --ray --stages 2``): a Serve
    replica whose engine is a two-stage pipeline over stage files, each
    streaming its experts under a RAM budget (``--ram``), answers the openai
    client with one process's text."""
    import openai
    from ray import serve
    from test_ray_serve import free_port

    from colibri.ray import deployment

    want = colibri.Engine.demo(threads=1).generate("Emma was", max_new_tokens=10, temperature=0)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        files = colibri.split(colibri.Engine.demo().path, 2, out=tmp_path, progress=False)
        budget = max(colibri.plan(f["path"])["min_budget"] for f in files)
        app = deployment(str(tmp_path), replicas=1, stages=2, ram_budget=budget, model_name="demo")
        serve.run(app, name="colibri", route_prefix="/")
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        r = c.completions.create(model="demo", prompt="Emma was", max_tokens=10, temperature=0)
        assert r.choices[0].text == want.text
    finally:
        serve.shutdown()
