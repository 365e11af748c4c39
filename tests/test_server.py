"""The OpenAI-compatible server, live on 127.0.0.1: the real ``openai``
client, streaming and not, many clients at once, and every kind of bad
request answered in OpenAI's error shape while the server goes on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn

import colibri
from colibri.server import create_app

PROMPTS = [f"{w} was" for w in ("Emma", "The house", "Her sister", "The letter", "Mr. Knightley", "The ball")]


@contextmanager
def live(app) -> Iterator[str]:
    """Serves ``app`` on a free loopback port in a thread; yields its URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def demo():
    return colibri.Engine.demo(threads=2, max_batch=8)


@pytest.fixture(scope="module")
def url(demo):
    with live(create_app(demo)) as u:
        yield u


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_the_openai_client_gets_what_generate_gives(url, demo):
    c = client(url)
    assert [m.id for m in c.models.list()] == ["demo"]
    want = demo.generate(PROMPTS[0], max_new_tokens=12, temperature=0)
    r = c.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == str(want)
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(demo.tokenize(PROMPTS[0]))
    assert r.usage.completion_tokens == len(want.token_ids)
    # Streamed: the pieces join to the same text, usage comes last.
    pieces, usage = [], None
    for ch in c.completions.create(
        model="demo",
        prompt=PROMPTS[0],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if ch.choices:
            pieces.append(ch.choices[0].text)
        if ch.usage is not None:
            usage = ch.usage
    assert "".join(pieces) == str(want)
    assert usage is not None and usage.completion_tokens == len(want.token_ids)
    # Chat, whole and streamed, against Engine.chat.
    msgs = [{"role": "user", "content": "Tell me of Emma."}]
    want = demo.chat(msgs, max_new_tokens=16, temperature=0)
    r = c.chat.completions.create(model="demo", messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == str(want)
    assert r.choices[0].message.role == "assistant"
    deltas = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="demo", messages=msgs, max_tokens=16, temperature=0, stream=True
        )
        if ch.choices
    ]
    assert "".join(deltas) == str(want)
    # Content as text parts: joined by newlines, as vLLM joins them.
    texts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "of Emma."}]
    r = c.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": texts}], max_tokens=16, temperature=0
    )
    joined = [{"role": "user", "content": "Tell me\nof Emma."}]
    assert r.choices[0].message.content == str(demo.chat(joined, max_new_tokens=16, temperature=0))

    def prompt_tokens(msgs: list) -> int:
        return len(demo.tokenize(demo.apply_chat_template(msgs), add_special_tokens=False))

    glued = [{"role": "user", "content": "Tell meof Emma."}]
    assert r.usage.prompt_tokens == prompt_tokens(joined) != prompt_tokens(glued)
    # Stop strings, seeds, n and vLLM's extra fields.
    r = c.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[" the"])
    assert r.choices[0].text == str(
        demo.generate(PROMPTS[1], max_new_tokens=30, temperature=0, stop=[" the"])
    )
    r = c.completions.create(
        model="demo", prompt=PROMPTS[2], max_tokens=10, temperature=0.8, seed=7, n=3, extra_body={"top_k": 20}
    )
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    for j, ch in enumerate(sorted(r.choices, key=lambda ch: ch.index)):
        alone = demo.generate(PROMPTS[2], max_new_tokens=10, temperature=0.8, seed=7 + j, top_k=20)
        assert ch.text == str(alone)


def test_sixteen_concurrent_clients_get_their_serial_outputs(url, demo):
    prompts = [PROMPTS[k % len(PROMPTS)] + " " * (k // len(PROMPTS)) for k in range(16)]
    serial = [str(demo.generate(p, max_new_tokens=24, temperature=0)) for p in prompts]
    before = demo.batch_stats()

    def one(p: str) -> str:
        r = client(url).completions.create(model="demo", prompt=p, max_tokens=24, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, prompts))
    assert got == serial
    after = demo.batch_stats()
    shared = [a - b for a, b in zip(after["step_sequences"], before["step_sequences"])]
    assert sum(shared[2:]) > 0, f"no step decoded two requests together: {shared}"


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(url, demo):
    room = demo.context_length - len(demo.tokenize(PROMPTS[3]))
    body = {"prompt": PROMPTS[3], "max_tokens": room, "temperature": 0, "ignore_eos": True, "stream": True}
    before = demo.batch_stats()["generated_tokens"]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
    deadline = time.monotonic() + 10
    while demo.batch_stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert demo.batch_stats()["running"] == 0, "the generation went on after the client left"
    # Stopped well before the context was full (what it would run to).
    made = demo.batch_stats()["generated_tokens"] - before
    assert made < demo.context_length - 10, made
    r = client(url).completions.create(model="demo", prompt=PROMPTS[3], max_tokens=4, temperature=0)
    assert r.choices[0].text == str(demo.generate(PROMPTS[3], max_new_tokens=4, temperature=0))


def error_of(r: httpx.Response) -> dict:
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    return e


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", 400),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
        ({"prompt": "x", "top_p": 0}, "top_p", 400),
        ({"prompt": "x", "top_p": 1e-50}, "top_p", 400),
        ({"prompt": "x", "temperature": "hot"}, "temperature", 400),
        ({"prompt": "x", "n": 1000}, "n", 400),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate", 400),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
        ({"prompt": []}, "prompt", 400),
        ({"prompt": [1, 2, 10**9]}, "prompt", 400),
        ({"prompt": "x", "model": "gpt-5"}, "model", 404),
        ({"prompt": "x", "logprobs": 21}, "logprobs", 400),
        ({"prompt": "x", "logprobs": True}, "logprobs", 400),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", 400),
    ],
)
def test_bad_requests_are_clean_4xx_and_the_server_goes_on(url, body, param, status):
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert error_of(r)["param"] == param
    ok = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_chat_takes_the_no_op_forms_of_format_and_tools_and_refuses_the_rest(url, demo):
    msgs = [{"role": "user", "content": "Tell me of Emma."}]
    plain = client(url).chat.completions.create(model="demo", messages=msgs, max_tokens=6, temperature=0)
    # What some clients send by default changes nothing.
    same = client(url).chat.completions.create(
        model="demo",
        messages=msgs,
        max_tokens=6,
        temperature=0,
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        parallel_tool_calls=False,
    )
    assert same.choices[0].message.content == plain.choices[0].message.content
    nulls = {"response_format": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None}
    for extra in (nulls, {"tool_choice": "auto"}):
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": msgs, "max_tokens": 6, "temperature": 0, **extra},
            timeout=30,
        )
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"]["content"] == plain.choices[0].message.content
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, param in [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {}}, "response_format"),
        ({"tools": [tool]}, "tools"),
        ({"tools": {"f": 1}}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        assert error_of(r)["param"] == param, extra
    # The completions endpoint has no such fields.
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "tools": []}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "tools"


def test_logprobs_are_the_engines_streamed_or_not(url, demo):
    want = demo.generate(PROMPTS[1], max_new_tokens=10, temperature=0, logprobs=3)
    c = client(url)
    # Chat-style, through the real client.
    r = c.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Tell me about Emma."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    ids = demo.tokenize(
        demo.apply_chat_template([{"role": "user", "content": "Tell me about Emma."}]),
        add_special_tokens=False,
    )
    chat_want = demo.generate(ids, max_new_tokens=6, temperature=0, logprobs=2)
    # Each token as it reads in the text: they join to the message.
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    for got, exp in zip(content, chat_want.logprobs):
        assert got.logprob == pytest.approx(exp.logprob, abs=1e-6)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([v for _, v in exp.top], abs=1e-6)
        # Greedy: the chosen token is the most likely one.
        assert got.top_logprobs[0].logprob == got.logprob >= got.top_logprobs[1].logprob
    # Completions, whole and streamed: the same numbers.
    body = {"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0, "logprobs": 3}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert whole["token_logprobs"] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-6)
    assert "".join(whole["tokens"]).startswith(str(want))
    assert [len(t) for t in whole["top_logprobs"]] == [3] * len(want.logprobs)
    assert whole["text_offset"] == [len("".join(whole["tokens"][:i])) for i in range(len(whole["tokens"]))]
    streamed: dict[str, list] = {"token_logprobs": [], "tokens": [], "text_offset": []}
    for ch in c.completions.create(model="demo", stream=True, **body):
        if ch.choices and ch.choices[0].logprobs is not None:
            for k, v in streamed.items():
                v += getattr(ch.choices[0].logprobs, k)
    assert streamed["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=0)
    assert streamed["tokens"] == whole["tokens"] and streamed["text_offset"] == whole["text_offset"]
    # Not asked for: null, as OpenAI answers.
    plain = httpx.post(url + "/v1/completions", json={**body, "logprobs": None}, timeout=60).json()
    assert plain["choices"][0]["logprobs"] is None


def test_logprob_tokens_keep_the_space_a_tokenizer_strips_from_a_lone_token(llama):
    # The Llama-style tokenizer drops the space of a word's "▁" at the start
    # of a text, so each token decoded alone would not join to the text.
    with live(create_app(llama)) as u:
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 2,
            "skip_special_tokens": False,
            "return_token_ids": True,
        }
        whole = httpx.post(u + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        lps = whole["logprobs"]
        assert "".join(lps["tokens"]) == whole["text"]
        assert lps["tokens"] != [llama.detokenize([t]) for t in whole["token_ids"]]
        assert lps["text_offset"] == [len("".join(lps["tokens"][:i])) for i in range(len(lps["tokens"]))]
        # The alternatives read the same way: the chosen one (greedy, the
        # most likely) among them with the same text.
        assert all(tok in top for tok, top in zip(lps["tokens"], lps["top_logprobs"]))
        chat = {
            "messages": [{"role": "user", "content": "Tell me of the bird."}],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "skip_special_tokens": False,
        }
        r = httpx.post(u + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
        assert "".join(t["token"] for t in r["logprobs"]["content"]) == r["message"]["content"]


def test_malformed_bodies_long_prompts_and_unknown_routes(url, demo):
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    r = httpx.post(url + "/v1/chat/completions", json=[1, 2], timeout=30)
    assert r.status_code == 400
    r = httpx.post(url + "/v1/completions", content=b"[" * 100_000, timeout=30)
    assert r.status_code == 400 and "deeply" in error_of(r)["message"]
    # A prompt longer than the context: a 400 naming the limit.
    long = [5] * (demo.context_length + 1)
    r = httpx.post(url + "/v1/completions", json={"prompt": long}, timeout=30)
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    # A prompt that fits, with more tokens asked than the context has left:
    # a 400 naming the field that asked (OpenAI's answer), on both endpoints;
    # the lengths' defaults stop at the context instead.
    fits = [5] * (demo.context_length - 4)
    body = {"prompt": fits, "max_tokens": 5, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    assert error_of(r)["param"] == "max_tokens"
    body = {"prompt": fits, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.json()["usage"]["completion_tokens"] == 4
    chat = {"messages": [{"role": "user", "content": "Emma"}], "max_completion_tokens": demo.context_length}
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "max_completion_tokens"
    # A million-token prompt, as ids and as text: the same 400.
    for prompt in ([5] * 1_000_000, "Emma " * 1_000_000):
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt}, timeout=60)
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    # A body beyond the server's limit is not read at all.
    r = httpx.post(url + "/v1/completions", json={"prompt": "x" * (9 << 20)}, timeout=60)
    assert r.status_code == 413
    assert httpx.get(url + "/v1/nowhere", timeout=30).status_code == 404
    assert httpx.get(url + "/v1/completions", timeout=30).status_code == 405
    assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"


def test_metrics_are_prometheus_text(url):
    client(url).completions.create(model="demo", prompt="Emma", max_tokens=3)
    text = httpx.get(url + "/metrics", timeout=30).text
    for name in (
        "colibri_generation_tokens_total",
        "colibri_prompt_tokens_total",
        "colibri_time_to_first_token_seconds_bucket",
        "colibri_time_per_output_token_seconds_count",
        "colibri_queue_depth",
        "colibri_running_sequences",
        "colibri_step_tokens_bucket",
        "colibri_kv_cache_bytes",
        "colibri_expert_cache_hit_rate",
        'colibri_routing_entropy{layer="0"}',
    ):
        assert name in text, name
    generated = next(
        float(x.split()[1]) for x in text.splitlines() if x.startswith("colibri_generation_tokens_total")
    )
    assert generated >= 3


def test_an_api_key_guards_everything_but_health(demo):
    with live(create_app(demo, api_key="sesame")) as u:
        with pytest.raises(openai.AuthenticationError):
            client(u, "wrong").completions.create(model="demo", prompt="x", max_tokens=2)
        assert httpx.get(u + "/v1/models").status_code == 401
        assert httpx.get(u + "/metrics").status_code == 401
        assert httpx.get(u + "/health").status_code == 200
        r = client(u, "sesame").completions.create(model="demo", prompt="x", max_tokens=2)
        assert r.usage.completion_tokens >= 1


def test_a_full_queue_is_429_with_retry_after():
    e = colibri.Engine.demo(threads=2, max_batch=1, max_queue=1)
    with live(create_app(e)) as u:
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(lambda _: httpx.post(u + "/v1/completions", json=body, timeout=60), range(8)))
        busy = [r for r in rs if r.status_code == 429]
        assert busy, [r.status_code for r in rs]
        assert all(r.status_code in (200, 429) for r in rs)
        assert busy[0].headers["retry-after"] == "1"
        assert error_of(busy[0])["type"] == "rate_limit_exceeded"
        assert httpx.post(u + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_requests_while_loading_are_503():
    gate = threading.Event()

    def load():
        gate.wait(20)
        return colibri.Engine.demo(threads=2)

    with live(create_app(load)) as u:
        r = httpx.post(u + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert httpx.get(u + "/health").status_code == 503
        gate.set()
        deadline = time.monotonic() + 20
        while httpx.get(u + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert httpx.post(u + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_colibri_serve_on_the_command_line(tmp_path):
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "colibri", "serve", "--demo", "--threads", "2", "--port", str(port)]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        u = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(u + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert p.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.05)
        r = client(u).chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert r.usage.completion_tokens >= 1
    finally:
        p.send_signal(signal.SIGINT)
        try:
            _, err = p.communicate(timeout=30)
        finally:
            p.kill()  # a server that missed the signal would serve on
    assert p.returncode == 0, err
    assert f"serving on http://127.0.0.1:{port}/v1" in err
    bad = subprocess.run([*cmd[:4], "--port", "0", "--demo"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--port" in bad.stderr


def test_metrics_give_pooled_state_by_piece(converted):
    """DeepSeek-V4's pooled attention: one gauge per piece of its state."""
    engine = colibri.Engine(converted("deepseek_v4"), threads=1)
    with live(create_app(engine)) as u:
        text = httpx.get(u + "/metrics", timeout=30).text
    for piece in engine.state_pieces():
        assert f'colibri_state_piece_bytes{{piece="{piece}"}}' in text, piece
    assert set(engine.state_pieces()) >= {"window", "pool_entries", "index_keys"}
