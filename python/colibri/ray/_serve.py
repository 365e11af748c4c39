"""Engine replicas behind Ray Serve.

An application of three deployments:

* ``ColibriEngine``: the replicas. Each opens the model itself (memory-mapped
  by default, so replicas on one node read the same pages of the page cache),
  reserves ``threads_per_replica`` CPUs and runs :func:`colibri.server.create_app`
  in-process: every route of ``colibri serve`` answers there, unchanged.
* ``ColibriFront``: the HTTP ingress. It reads a request's body, hands the
  request to a replica through a streaming handle (Serve picks the replica:
  of two sampled, the one with fewer requests in flight) and relays the
  replica's ASGI messages. Because the relay sits outside the replicas, a
  replica that dies is handled here: a request that has had no answer yet is
  sent to another replica; a stream already under way ends with an error
  event in its API's shape.
* ``ColibriMetrics``: where the replicas leave their Prometheus metrics and
  dashboard data, once a second each. ``/metrics`` (answered by whichever
  replica Serve picks) is that replica's own metrics, read now, plus the
  others' latest, every sample labelled with its ``replica``; the
  dashboard's data adds the replicas' counts up and joins their routing
  windows. A replica that has not reported for :data:`STALE_SECONDS` is left
  out (it has died; Serve starts another).

Ray is imported only when an application is built: ``pip install
'colibri-moe[ray]'`` brings it.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, MutableMapping
from typing import Any, Callable

__all__ = ["deployment", "require", "serve"]

#: Seconds between a replica's reports of its metrics.
PUSH_SECONDS = 1.0
#: A replica whose last report is older than this is left out of ``/metrics``.
STALE_SECONDS = 5.0
#: Seconds requests must queue beyond full batches before autoscaling adds a
#: replica (Serve's default, 30, is long for a queue of generations); the
#: load is averaged over 1.5 times this.
UPSCALE_SECONDS = 10.0
#: Times the front tries a request whose replica died before answering.
ATTEMPTS = 3
#: Largest body the front relays (the replica's own limit answers 413 beyond it).
_BODY_LIMIT = 8 << 20

_log = logging.getLogger("colibri.ray")

# The scope keys a replica's app reads; the rest (Serve's own state) stays behind.
_SCOPE_KEYS = (
    "type",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "root_path",
    "headers",
    "client",
    "server",
)

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]


def _import_ray() -> tuple[Any, Any]:
    """``ray`` and ``ray.serve``, or an ImportError naming the extra."""
    try:
        ray = importlib.import_module("ray")
        serve = importlib.import_module("ray.serve")
    except ImportError as e:
        raise ImportError(
            f"colibri's Ray replicas need the 'ray' extra: pip install 'colibri-moe[ray]' (missing: {e.name})"
        ) from e
    return ray, serve


def require() -> None:
    """Raises the ImportError naming the extra when Ray, or what
    ``colibri.server`` (which every replica runs) needs, is missing here."""
    _import_ray()
    importlib.import_module("colibri.server")


# ----------------------------------------------------------------------
# Metrics across replicas


def _labelled(families: Iterable[Any], replica: str) -> list[Any]:
    """Copies of ``families`` (prometheus_client ``Metric``s) with every
    sample labelled ``replica``."""
    from prometheus_client.metrics_core import Metric

    out = []
    for fam in families:
        copy = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        copy.samples = [s._replace(labels={**s.labels, "replica": replica}) for s in fam.samples]
        out.append(copy)
    return out


def _render(reports: Iterable[list[Any]]) -> bytes:
    """One Prometheus text of several replicas' labelled families: a family
    appears once, with the samples of every replica."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric

    merged: dict[str, Any] = {}
    for families in reports:
        for fam in families:
            into = merged.get(fam.name)
            if into is None:
                into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            into.samples.extend(fam.samples)

    class Merged:
        def collect(self) -> Iterable[Any]:
            return list(merged.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry)


def _merge_layer(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """One MoE layer's routing over several replicas: the choices added up
    and the statistics worked out again from them, as the engine does."""
    heat = [sum(col) for col in zip(*(layer["heat"] for layer in layers))]
    tokens = sum(layer["tokens"] for layer in layers)
    chosen, experts = sum(heat), len(heat)
    bits = -sum(h / chosen * math.log2(h / chosen) for h in heat if h) if chosen else 0.0
    share = chosen / experts if experts else 0.0
    margin = sum(layer["margin_sum"] for layer in layers)
    return {
        **layers[0],  # the layer number, and residency: the answering replica's
        "tokens": tokens,
        "heat": heat,
        "entropy_bits": bits,
        "entropy": bits / math.log2(experts) if experts > 1 else 0.0,
        "margin_sum": margin,
        "mean_margin": margin / tokens if tokens else 0.0,
        "margin_histogram": [sum(col) for col in zip(*(layer["margin_histogram"] for layer in layers))],
        "dead": [i for i, h in enumerate(heat) if h == 0] if chosen else [],
        "overloaded": [i for i, h in enumerate(heat) if share and h > 3 * share],
        "max_load": max(heat) / share if share else 0.0,
    }


#: Dashboard fields that add up over replicas.
_SUMMED = (
    "tokens_per_second_in",
    "tokens_per_second_out",
    "queue",
    "running",
    "batch_size",
    "max_batch",
    "kv_tokens",
    "generated_tokens",
)


def _merge_dashboard(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The dashboard's data over several replicas (the first answers):
    counts and rates added up, the routing windows joined, the median of
    the replicas' median times to first token, the mean hit rate."""
    out = dict(samples[0])
    for key in _SUMMED:
        out[key] = sum(s[key] for s in samples)
    ttfts = [s["ttft_p50"] for s in samples if s["ttft_p50"] is not None]
    out["ttft_p50"] = statistics.median(ttfts) if ttfts else None
    out["hit_rate"] = statistics.fmean(s["hit_rate"] for s in samples)
    out["streaming"] = any(s["streaming"] for s in samples)
    out["replicas"] = len(samples)
    layers = zip(*(s["routing"]["layers"] for s in samples))
    out["routing"] = {
        "tokens": sum(s["routing"]["tokens"] for s in samples),
        "layers": [_merge_layer(list(group)) for group in layers],
    }
    return out


class _Board:
    """The replicas' latest metrics and dashboard data (a one-replica
    deployment of its own)."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, list[Any], dict[str, Any] | None]] = {}

    def put(self, replica: str, families: list[Any], dashboard: dict[str, Any] | None) -> None:
        self.reports[replica] = (time.monotonic(), families, dashboard)

    def drop(self, replica: str) -> None:
        self.reports.pop(replica, None)

    def take(self, exclude: str = "") -> list[tuple[str, list[Any], dict[str, Any] | None]]:
        """The fresh reports but ``exclude``'s, by replica id; stale ones are forgotten."""
        now = time.monotonic()
        for rid in [r for r, (t, _, _) in self.reports.items() if now - t > STALE_SECONDS]:
            del self.reports[rid]
        return sorted((rid, fams, d) for rid, (_, fams, d) in self.reports.items() if rid != exclude)


# ----------------------------------------------------------------------
# The replica


def _open(model: str, options: Mapping[str, Any]) -> Any:
    """The engine for ``model``: ``"demo"``, a .colibri file or a checkpoint
    folder; with ``stages``, a pipeline of that many stages on the cluster
    (``threads`` each)."""
    from .._engine import Engine, _demo_path

    if options.get("stages"):
        from ._pipeline import Engine as Pipeline

        kept = {k: v for k, v in options.items() if k in ("kv_cache_dtype", "mmap", "ram_budget")}
        path = str(_demo_path()) if model == "demo" else model
        return Pipeline(path, stages=options["stages"], threads_per_stage=options.get("threads"), **kept)
    if model == "demo":
        return Engine.demo(**options)
    if os.path.isdir(model):
        return Engine.from_pretrained(model, **options)
    return Engine(model, **options)


class _Replica:
    """One engine and the app of ``colibri serve`` over it."""

    def __init__(
        self, model: str, engine_options: dict[str, Any], app_options: dict[str, Any], board: Any
    ) -> None:
        from ..server import create_app

        _, serve = _import_ray()
        self.replica = str(serve.get_replica_context().replica_id.unique_id)
        self.board = board
        self.engine = _open(model, engine_options)
        self.app = create_app(
            self.engine, metrics_view=self._metrics_text, dashboard_view=self._dashboard, **app_options
        )
        self.registry = self.app.state.metrics_registry
        self.dashboard_sample = self.app.state.dashboard_sample
        self.stop = threading.Event()
        self.pusher = threading.Thread(target=self._push, daemon=True, name="colibri-metrics")
        self.pusher.start()

    def _push(self) -> None:
        while not self.stop.wait(PUSH_SECONDS):
            try:
                families = _labelled(self.registry.collect(), self.replica)
                dashboard = self.dashboard_sample()
                self.board.put.remote(self.replica, families, dashboard).result(timeout_s=10)
            except Exception as e:  # the board restarting: the next report goes through
                _log.debug("metrics report failed: %s", e)

    def _others(self) -> list[tuple[str, list[Any], dict[str, Any] | None]]:
        try:
            return list(self.board.take.remote(self.replica).result(timeout_s=10))
        except Exception as e:  # only this replica's then
            _log.warning("could not read the other replicas' reports: %s", e)
            return []

    def _metrics_text(self, registry: Any) -> bytes:
        own = _labelled(registry.collect(), self.replica)
        return _render([own, *(fams for _, fams, _ in self._others())])

    def _dashboard(self, own: dict[str, Any]) -> dict[str, Any]:
        return _merge_dashboard([own, *(d for _, _, d in self._others() if d is not None)])

    async def request(self, scope: dict[str, Any], body: bytes) -> AsyncIterator[list[Message]]:
        """Runs one HTTP request through the app; yields its ASGI messages,
        as many at a time as are ready (a Ray object per token would cost
        more than the token when a replica decodes fast)."""
        out: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await out.put(dict(message))

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            done = False
            while not done:
                batch: list[Message] = []
                message = await out.get()
                while message is not None:
                    if message["type"] == "http.response.start":
                        # Which replica answered: for logs, and for tests that kill it.
                        headers = [*message.get("headers", []), (b"x-colibri-replica", self.replica.encode())]
                        message = {**message, "headers": headers}
                    last = batch[-1] if batch else None
                    if last is not None and last["type"] == message["type"] == "http.response.body":
                        # Consecutive pieces of a body travel as one.
                        batch[-1] = {**message, "body": last["body"] + message.get("body", b"")}
                    else:
                        batch.append(message)
                    if out.empty():
                        break
                    message = out.get_nowait()
                done = message is None
                if batch:
                    yield batch
        finally:
            if not task.done():
                # The caller went away: the app sees its client gone, and
                # cancels the generations at their next token.
                gone.set()
                await asyncio.wait({task}, timeout=5)
                task.cancel()

    def check_health(self) -> None:
        if self.engine.closed:
            raise RuntimeError("the engine is closed")

    def __del__(self) -> None:
        # Serve calls this when it stops the replica, after its requests end.
        stop = getattr(self, "stop", None)
        if stop is not None:
            stop.set()
            self.engine.close()
            try:
                self.board.drop.remote(self.replica)
            except Exception:  # shutting down: the report goes stale anyway
                pass


# ----------------------------------------------------------------------
# The front


def _error_event(path: str, message: str) -> bytes:
    """The last event of a stream cut short, in the shape of its API."""
    if path.rstrip("/").endswith("/messages"):
        data = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n".encode()


def _json(status: int, message: str) -> list[Message]:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
    return [
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")],
        },
        {"type": "http.response.body", "body": body.encode(), "more_body": False},
    ]


class _Front:
    """The ASGI app of the ingress: relays each request to a replica."""

    def __init__(self, engines: Any) -> None:
        ray, _ = _import_ray()
        self.engines = engines.options(stream=True)
        self.died = (ray.exceptions.RayActorError,)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False) or len(body) > _BODY_LIMIT:
                break
        plain = {k: scope[k] for k in _SCOPE_KEYS if k in scope}
        for attempt in range(1, ATTEMPTS + 1):
            if await self._relay(plain, body, send, last=attempt == ATTEMPTS):
                return

    async def _relay(self, scope: dict[str, Any], body: bytes, send: Send, last: bool) -> bool:
        """One try on a replica; False when it died before answering (and
        this is not the last try), True when the response is complete."""
        replies = self.engines.request.remote(scope, body)
        started, stream, finished = False, False, False
        try:
            async for batch in replies:
                for message in batch:
                    if message["type"] == "http.response.start":
                        started = True
                        headers = dict(message.get("headers", []))
                        stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                    await send(message)
                    finished = message["type"] == "http.response.body" and not message.get("more_body")
            return True
        except self.died as e:
            reason = f"the replica serving this request stopped ({type(e).__name__})"
            if not started:
                if not last:
                    _log.warning("%s; trying another", reason)
                    return False
                for message in _json(503, reason):
                    await send(message)
                return True
            _log.warning("%s mid-response", reason)
            tail = _error_event(scope["path"], reason) if stream else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            finished = True
            return True
        finally:
            if not finished:
                replies.cancel()


# ----------------------------------------------------------------------
# Building the application


def _autoscale(value: tuple[int, int] | str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        a, sep, b = value.partition(":")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise ValueError(f"autoscale must be MIN:MAX (e.g. 1:4), got {value!r}")
        value = (int(a), int(b))
    low, high = value
    if not 0 <= low <= high or high < 1:
        raise ValueError(f"autoscale needs 0 <= MIN <= MAX and MAX >= 1, got {low}:{high}")
    return low, high


def deployment(
    model: str | os.PathLike[str],
    *,
    replicas: int | None = None,
    autoscale: tuple[int, int] | str | None = None,
    threads_per_replica: int = 1,
    api_key: str | None = None,
    model_name: str | None = None,
    speculative: str | None = None,
    draft_tokens: int = 4,
    **engine_options: Any,
) -> Any:
    """The Serve application (a bound deployment, for ``serve.run``) of
    ``model`` (``"demo"``, a ``.colibri`` file, or a checkpoint folder,
    converted here once; the path must be the same on every node; with
    ``stages``, also a folder of stage files from :func:`colibri.split`) on
    ``replicas`` replicas (default 1), or between ``autoscale = (MIN,
    MAX)`` of them scaled on the requests each has in flight and queued
    (``"MIN:MAX"`` works too). Each replica reserves ``threads_per_replica``
    CPUs and runs that many engine threads. ``engine_options`` go to every
    replica's :class:`~colibri.Engine` (``mmap`` defaults to ``True`` so the
    replicas of one node share the page cache); the rest are
    :func:`colibri.server.create_app`'s. With ``stages=K`` a replica is a
    :class:`colibri.ray.Engine` of K pipeline stages, each reserving
    ``threads_per_replica`` CPUs (the replica itself reserves none)."""
    require()
    _, serve = _import_ray()
    path = os.fspath(model)
    # A folder is a checkpoint, unless it is a pipeline's folder of stage files.
    stage_files = bool(engine_options.get("stages")) and not os.path.isfile(os.path.join(path, "config.json"))
    if path != "demo" and os.path.isdir(path) and not stage_files:
        # Converted here, once, not by every replica at the same time.
        from .._engine import Engine

        with Engine.from_pretrained(path, mmap=True) as e:
            path = e.path
    if replicas is not None and autoscale is not None:
        raise ValueError("give replicas or autoscale, not both")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    if isinstance(threads_per_replica, bool) or not isinstance(threads_per_replica, int):
        raise ValueError(f"threads_per_replica must be a positive integer, got {threads_per_replica!r}")
    if threads_per_replica < 1:
        raise ValueError(f"threads_per_replica must be at least 1, got {threads_per_replica}")
    scale = _autoscale(autoscale)
    if "threads" in engine_options:
        raise ValueError("give threads_per_replica, not threads")
    stages = engine_options.get("stages")
    if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
        raise ValueError(f"stages must be a positive integer, got {stages!r}")
    if stages and engine_options.get("ram_budget") is not None and (path == "demo" or os.path.isfile(path)):
        raise ValueError(
            "stages of a whole model file keep their experts resident: give no RAM budget, or a folder of "
            "stage files (colibri.split)"
        )
    options = {"mmap": True, **engine_options, "threads": threads_per_replica}
    max_batch = int(options.get("max_batch", 16))
    app_options = {
        "api_key": api_key,
        "model_name": model_name or ("demo" if path == "demo" else None),
        "speculative": speculative,
        "draft_tokens": draft_tokens,
    }
    # A replica takes as many requests as its batch holds; the rest wait in
    # Serve's queue, from which a replica that dies has taken nothing.
    engine_config: dict[str, Any] = {
        "name": "ColibriEngine",
        # With stages a replica only relays; its stages reserve the CPUs.
        "ray_actor_options": {"num_cpus": 0 if stages else threads_per_replica},
        "max_ongoing_requests": max_batch,
    }
    if scale is None:
        engine_config["num_replicas"] = replicas or 1
    else:
        engine_config["autoscaling_config"] = {
            "min_replicas": scale[0],
            "initial_replicas": max(scale[0], 1),
            "max_replicas": scale[1],
            # Up when the replicas hold more than full batches (requests queue).
            "target_ongoing_requests": max_batch,
            "upscale_delay_s": UPSCALE_SECONDS,
            # Serve wants the window longer than its metrics interval (10 s).
            "look_back_period_s": 1.5 * UPSCALE_SECONDS,
        }
    light = {"ray_actor_options": {"num_cpus": 0}, "max_ongoing_requests": 1 << 14}
    quiet = {"enable_access_log": False}  # a report a second from each replica
    board = serve.deployment(_Board, name="ColibriMetrics", num_replicas=1, logging_config=quiet, **light)
    engines = serve.deployment(_Replica, **engine_config)

    class ColibriFront:
        def __init__(self, engines: Any) -> None:
            self.front = _Front(engines)

        def __serve_build_asgi_app__(self) -> Any:
            return self.front

    front = serve.deployment(serve.ingress()(ColibriFront), name="ColibriFront", num_replicas=1, **light)
    return front.bind(engines.bind(path, options, app_options, board.bind()))


def serve(
    model: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    replicas: int | None = None,
    autoscale: tuple[int, int] | str | None = None,
    threads_per_replica: int | None = None,
    address: str | None = None,
    log_level: str = "warning",
    log: Callable[[str], None] | None = None,
    **options: Any,
) -> None:
    """Runs :func:`deployment` on a Ray cluster until interrupted: the one at
    ``address`` (default: ``RAY_ADDRESS``, else a new one of this machine
    alone, on loopback), its HTTP proxy on ``host:port``; ``log`` is told the
    address once the replicas are up. ``threads_per_replica`` defaults to
    the cluster's CPUs shared among the replicas (the most of them, when
    autoscaling). ``options`` are :func:`deployment`'s."""
    ray, rserve = _import_ray()
    started = not ray.is_initialized()
    if started:
        chatty = log_level in ("debug", "info")
        settings: dict[str, Any] = {"log_to_driver": chatty, "logging_level": log_level.upper()}
        if address is None and not os.environ.get("RAY_ADDRESS"):
            # A new cluster of this machine alone (not one someone else
            # started here), listening on loopback only.
            address = "local"
            settings["_node_ip_address"] = "127.0.0.1"
        ray.init(address=address, include_dashboard=False, **settings)
        logging.getLogger("ray.serve").setLevel(log_level.upper())
    try:
        if threads_per_replica is None:
            most = replicas or (_autoscale(autoscale) or (1, 1))[1]
            threads_per_replica = max(1, int(ray.cluster_resources().get("CPU", 1)) // most)
        app = deployment(
            model, replicas=replicas, autoscale=autoscale, threads_per_replica=threads_per_replica, **options
        )
        rserve.start(http_options={"host": host, "port": port})
        rserve.run(app, name="colibri", route_prefix="/")
        if log is not None:
            log(
                f"serving on http://{host}:{port}/v1 through Ray Serve "
                f"(threads per replica: {threads_per_replica}; Ctrl-C stops)"
            )
        while True:
            time.sleep(3600)
    finally:
        try:
            rserve.delete("colibri")
        finally:
            if started:
                ray.shutdown()
