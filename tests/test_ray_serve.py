"""Engine replicas behind Ray Serve, on a one-machine Ray cluster bound to
127.0.0.1: two replicas of the demo model (one CPU each) answer the real
``openai`` client as one engine does, ``/metrics`` holds both replicas'
samples, and a replica killed mid-stream ends that stream with an error
event while the other replica answers and Serve starts a new one."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

import colibri

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from colibri.ray import deployment  # noqa: E402  (after the skip: needs ray)

PROMPTS = ["Emma was", "The house", "Her sister", "Mr. Knightley"]
TIMEOUT = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check, timeout: float = TIMEOUT):
    """Polls ``check`` until it returns something true; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def url():
    # A cluster of its own ("local"), even where another is running on this machine.
    ray.init(
        address="local",
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment("demo", replicas=2, threads_per_replica=1), name="colibri", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def demo():
    return colibri.Engine.demo(threads=1)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def replica_labels(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {
        line.split('replica="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("colibri_generation_tokens_total{")
    }


def two(labels: set[str]) -> set[str] | None:
    return labels if len(labels) == 2 else None


def running_replicas() -> int:
    status = serve.status().applications["colibri"].deployments["ColibriEngine"]
    return int(status.replica_states.get("RUNNING", 0))


def test_replicas_answer_as_one_engine_does(url, demo):
    c = client(url)
    assert [m.id for m in c.models.list()] == ["demo"]

    def ask(prompt: str) -> tuple[str, str]:
        raw = c.completions.with_raw_response.create(
            model="demo", prompt=prompt, max_tokens=12, temperature=0
        )
        return raw.parse().choices[0].text, raw.headers["x-colibri-replica"]

    # Concurrent requests spread over both replicas; each answer is the engine's.
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, PROMPTS * 2))
    for prompt, (text, _) in zip(PROMPTS * 2, answers):
        assert text == str(demo.generate(prompt, max_new_tokens=12, temperature=0))
    assert len({replica for _, replica in answers}) == 2
    # Streamed chat: the pieces join to Engine.chat's answer.
    msgs = [{"role": "user", "content": "Tell me of Emma."}]
    pieces = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="demo", messages=msgs, max_tokens=16, temperature=0, stream=True
        )
        if ch.choices
    ]
    assert "".join(pieces) == str(demo.chat(msgs, max_new_tokens=16, temperature=0))
    # Errors come back in OpenAI's shape from the replica.
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="demo", prompt="x", max_tokens=4, temperature=-1)
    assert httpx.get(url + "/health", timeout=TIMEOUT).json()["status"] == "ok"
    assert httpx.get(url + "/", timeout=TIMEOUT).status_code == 200


def test_the_dashboard_adds_the_replicas_up(url):
    def both() -> dict | None:
        d = httpx.get(url + "/dashboard/data", timeout=TIMEOUT).json()
        return d if d.get("replicas") == 2 else None

    d = wait_for("both replicas in the dashboard's data", both)
    assert d["max_batch"] == 2 * 16 and d["model"] == "demo"
    # The joined window: each of its tokens chose top-2 experts.
    assert d["routing"]["layers"][0]["tokens"] == sum(d["routing"]["layers"][0]["heat"]) // 2


def test_metrics_label_every_replica(url):
    client(url).completions.create(model="demo", prompt="Emma", max_tokens=2, temperature=0)
    labels = wait_for("both replicas in /metrics", lambda: two(replica_labels(url)))
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    # One family header, the samples of both replicas under it.
    assert text.count("# TYPE colibri_queue_depth gauge") == 1
    for label in labels:
        assert f'colibri_queue_depth{{replica="{label}"}}' in text


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_client_that_goes_away_stops_its_generations(url):
    body = {"prompt": "Emma", "max_tokens": 480, "n": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    before = metric_sum(url, "colibri_generation_tokens_total")
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then the connection closes
    wait_for("the generations to stop", lambda: metric_sum(url, "colibri_running_sequences") == 0)
    # Longer than the whole request takes (under 2 s here), and than the
    # other replica's metrics can lag (a second).
    time.sleep(3)
    # Whole, the request makes 8 x 480 tokens; cancelled, a small part of them.
    assert metric_sum(url, "colibri_generation_tokens_total") - before < 8 * 480 / 2


def test_a_killed_replica_ends_its_stream_with_an_error_and_comes_back(url, demo):
    wait_for("two running replicas", lambda: running_replicas() == 2)
    c = client(url)
    long = {"max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}
    want = str(demo.generate(PROMPTS[1], max_new_tokens=400, temperature=0, ignore_eos=True))
    # Long non-streamed requests keep both replicas' batches busy (so the
    # stream below lasts seconds); those on the replica killed have sent
    # nothing yet when it dies, so the front sends them to the other one.
    pool = ThreadPoolExecutor(8)
    pending = [
        pool.submit(lambda: c.completions.create(model="demo", prompt=PROMPTS[1], **long)) for _ in range(8)
    ]
    time.sleep(0.5)
    errors: list[BaseException] = []
    with c.completions.with_streaming_response.create(
        model="demo", prompt=PROMPTS[0], stream=True, **long
    ) as response:
        victim = response.headers["x-colibri-replica"]
        chunks = iter(response.parse())
        next(chunks)  # the stream is under way
        ray.kill(ray.get_actor(f"SERVE_REPLICA::colibri#ColibriEngine#{victim}", namespace="serve"))

        def drain() -> None:
            try:
                for _ in chunks:
                    pass
            except BaseException as e:  # what the client saw
                errors.append(e)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        reader.join(TIMEOUT)
        assert not reader.is_alive(), "the stream did not end"
    assert len(errors) == 1 and isinstance(errors[0], openai.APIError), errors
    assert "replica" in str(errors[0])
    for f in pending:
        assert f.result(timeout=TIMEOUT).choices[0].text == want
    pool.shutdown()
    # New requests go to the replica left; Serve starts another in the dead one's place.
    r = c.completions.create(model="demo", prompt=PROMPTS[2], max_tokens=8, temperature=0)
    assert r.choices[0].text == str(demo.generate(PROMPTS[2], max_new_tokens=8, temperature=0))
    wait_for("the replica to come back", lambda: running_replicas() == 2)

    def replaced() -> bool:
        labels = replica_labels(url)
        return len(labels) == 2 and victim not in labels

    wait_for("the new replica in /metrics", replaced)


def test_routing_joined_over_replicas_is_what_one_engine_reports(demo):
    """Joining one replica's routing changes nothing (the statistics are
    worked out as the engine does); joining two adds their choices."""
    from colibri.ray._serve import _merge_layer

    for prompt in PROMPTS:
        demo.generate(prompt, max_new_tokens=40)
    layers = demo.routing_stats()["layers"]
    for layer in layers:
        once = _merge_layer([layer])
        assert once.keys() == layer.keys()
        for key, value in layer.items():
            assert once[key] == (pytest.approx(value) if isinstance(value, float) else value), key
        twice = _merge_layer([layer, layer])
        assert twice["heat"] == [2 * h for h in layer["heat"]] and twice["tokens"] == 2 * layer["tokens"]
        assert twice["entropy"] == pytest.approx(layer["entropy"])
        assert twice["dead"] == layer["dead"] and twice["overloaded"] == layer["overloaded"]


def test_autoscaling_adds_a_replica_when_requests_queue(url):
    """The last test: it replaces the two-replica application with one
    scaling between 1 and 2 replicas of batches of 2, and keeps it queued."""
    serve.delete("colibri")
    serve.run(
        deployment("demo", autoscale="1:2", threads_per_replica=1, max_batch=2),
        name="colibri",
        route_prefix="/",
    )
    assert running_replicas() == 1
    stop = threading.Event()

    def keep_asking() -> None:
        with httpx.Client(timeout=TIMEOUT) as http:
            while not stop.is_set():
                body = {"prompt": "Emma", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
                assert http.post(url + "/v1/completions", json=body).status_code == 200

    with ThreadPoolExecutor(8) as pool:
        clients = [pool.submit(keep_asking) for _ in range(8)]
        try:
            wait_for("a second replica", lambda: running_replicas() == 2)
        finally:
            stop.set()
        for c in clients:
            c.result(timeout=TIMEOUT)


def test_a_cut_streams_error_event_is_an_error_to_both_sdks():
    """The event the front ends a cut stream with: the openai and anthropic
    clients each raise it as an API error, message intact (the kill above
    exercises the openai one end to end)."""
    import anthropic

    from colibri.ray._serve import _error_event

    def sdk_http(sdk: Any) -> Any:
        base = sdk._base_client
        return getattr(base, "httpx2", None) or base.httpx

    def served(path: str, first: bytes, http: Any) -> Any:
        # Each SDK takes a client of the HTTP package it is built on.
        body = first + _error_event(path, "the replica serving this request died")

        def handle(request: Any) -> Any:
            return http.Response(200, headers={"content-type": "text/event-stream"}, content=body)

        return http.Client(transport=http.MockTransport(handle))

    start = {
        "type": "message_start",
        "message": {
            "id": "m",
            "type": "message",
            "role": "assistant",
            "model": "demo",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 0},
        },
    }
    a = anthropic.Anthropic(
        base_url="http://x",
        api_key="none",
        max_retries=0,
        http_client=served(
            "/v1/messages",
            f"event: message_start\ndata: {json.dumps(start)}\n\n".encode(),
            sdk_http(anthropic),
        ),
    )
    with pytest.raises(anthropic.APIError, match="replica serving this request died"):
        with a.messages.stream(model="demo", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as s:
            for _ in s:
                pass
    chunk = {
        "id": "c",
        "object": "text_completion",
        "created": 0,
        "model": "demo",
        "choices": [{"index": 0, "text": "a", "finish_reason": None, "logprobs": None}],
    }
    o = openai.OpenAI(
        base_url="http://x/v1",
        api_key="none",
        max_retries=0,
        http_client=served("/v1/completions", f"data: {json.dumps(chunk)}\n\n".encode(), sdk_http(openai)),
    )
    with pytest.raises(openai.APIError, match="replica serving this request died"):
        for _ in o.completions.create(model="demo", prompt="hi", stream=True):
            pass
