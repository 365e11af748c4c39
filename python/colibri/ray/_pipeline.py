"""One model split into pipeline stages across the machines of a Ray cluster.

Each stage is a Ray actor owning a contiguous range of layers (the first
also embeds, the last also applies the head and samples); the actors sit in
a placement group, one bundle per node. A step of a sequence is one message
that passes through every stage in order: the residual stream ``[T, D]``
(f32) travels between them, the token comes back from the last. The
messages go through a Ray Compiled Graph (``transport="compiled"``) or plain
chained actor calls (``"actor"``); either way Ray owns placement, lifetime
and failure. A driver thread keeps up to one message per stage in flight, so
with several sequences every stage works at once (micro-batches of one
sequence each).

Numbers are the single-process engine's bit for bit: each stage runs its
layers exactly as the whole model would, and the last stage's sampler is the
engine's own.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import queue
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Any

from .. import _colibri
from .._engine import Engine as _LocalEngine
from .._engine import _budget_bytes, _demo_path
from .._errors import ContextLengthError, InvalidInputError, ModelNotFoundError, StageError

#: A message waiting for the driver, and the future of its answer.
_Queued = tuple[dict[str, Any], "Future[dict[str, Any]]"]

_RAY_HINT = "colibri.ray needs Ray: pip install 'colibri-moe[ray]'"

#: Error kinds a stage reports that map back to the engine's own classes.
_KINDS: dict[str, type[Exception]] = {
    "InvalidInputError": InvalidInputError,
    "ContextLengthError": ContextLengthError,
}


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise ImportError(_RAY_HINT) from e
    return ray


def _memory_of_process() -> dict[str, int]:
    # VmRSS, and RssFile: the mapped file's pages this process has touched.
    out = {"rss": 0, "rss_file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssFile"):
                    out["rss" if key == "VmRSS" else "rss_file"] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _quietly(f: Any) -> None:
    try:
        f()
    except Exception:  # noqa: BLE001 - a dead stage may fail a teardown too
        pass


def _where(index: int, layers: Any, node: str) -> str:
    return f"stage {index} (layers {layers[0]}..{layers[1]}, node {node[:12]})"


def too_small(stage_bytes: list[int], node_memory: list[float]) -> str | None:
    """Why a stage plan does not fit its nodes (a stage's weights over the
    memory Ray reports for its node), or None. A node reporting no memory is
    not judged."""
    mib = 2**20
    small = [
        f"stage {i} needs {b / mib:.1f} MiB of weights, its node has {m / mib:.1f} MiB"
        for i, (b, m) in enumerate(zip(stage_bytes, node_memory))
        if 0 < m < b
    ]
    return "no stage plan fits the nodes: " + "; ".join(small) if small else None


def _stage_files_here(folder: str) -> list[tuple[str, dict[str, Any] | None, str]]:
    """The stage files in ``folder`` on this node: (path, what it holds,
    why it could not be read)."""
    out: list[tuple[str, dict[str, Any] | None, str]] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    for name in names:
        path = os.path.join(folder, name)
        if not name.endswith(".colibri") or not os.path.isfile(path):
            continue
        try:
            info = _colibri.stage_file_info(path)
        except Exception as e:  # noqa: BLE001 - reported with the rest
            out.append((path, None, str(e)))
            continue
        if info is not None:
            out.append((path, json.loads(info), ""))
    return out


def choose_split(
    found: dict[str, list[tuple[str, dict[str, Any] | None, str]]], folder: str, stages: int | None
) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """From the stage files each node holds (``found``: node id -> what
    :func:`_stage_files_here` saw), the node and path of every stage of one
    split, and its files' descriptions. Stages go to distinct nodes where
    the files allow it. Raises :class:`StageError` saying what is missing
    (:class:`ModelNotFoundError` when no node holds any stage file there)."""
    splits: dict[tuple[str, int], dict[int, list[tuple[str, str, dict[str, Any]]]]] = {}
    unreadable = []
    for node, files in found.items():
        for path, info, why in files:
            if info is None:
                unreadable.append(f"{path} on node {node[:12]}: {why}")
                continue
            key = (info["origin"], int(info["stages"]))
            splits.setdefault(key, {}).setdefault(int(info["stage"]), []).append((node, path, info))
    note = f" (unreadable: {'; '.join(unreadable)})" if unreadable else ""
    keys = [k for k in splits if stages is None or k[1] == stages]
    if not keys:
        other = sorted({k[1] for k in splits})
        have = f"; found files of a split into {other} stages" if other else ""
        # Nothing at all there is a model not found; files of another split, a stage error.
        error = StageError if splits or unreadable else ModelNotFoundError
        raise error(
            f"no stage files{'' if stages is None else f' of a {stages}-stage split'} in {folder} on any "
            f"of the {len(found)} node(s){have}{note}: cut the model with `colibri split` and copy the files "
            "there"
        )
    if len(keys) > 1:
        raise StageError(
            f"{folder} holds stage files of {len(keys)} different splits (of model files "
            f"{sorted(k[0] for k in keys)}); keep one split there, or say stages="
        )
    by_stage = splits[keys[0]]
    k = keys[0][1]
    missing = [i for i in range(k) if i not in by_stage]
    if missing:
        raise StageError(
            f"stage(s) {', '.join(str(i + 1) for i in missing)} of {k} are on no node: copy those stage "
            f"files into {folder} on a node{note}"
        )
    # As many stages as possible on nodes of their own: a bipartite matching
    # of stages to the nodes holding their files (augmenting paths); a stage
    # left over shares the first node holding its file.
    holder: dict[str, int] = {}

    def claim(i: int, seen: set[str]) -> bool:
        for node, _, _ in by_stage[i]:
            if node not in seen:
                seen.add(node)
                if node not in holder or claim(holder[node], seen):
                    holder[node] = i
                    return True
        return False

    for i in range(k):
        claim(i, set())
    mine = {i: node for node, i in holder.items()}
    nodes, paths = [], []
    for i in range(k):
        node, path, _ = next(c for c in by_stage[i] if c[0] == mine.get(i, by_stage[i][0][0]))
        nodes.append(node)
        paths.append(path)
    return nodes, paths, [by_stage[i][0][2] for i in range(k)]


class _StageBody:
    """What one stage actor runs (``ray.remote`` is applied when a pipeline
    starts, so importing this module needs no Ray)."""

    def __init__(
        self, path: str, index: int, start: int | None, end: int | None, options: dict[str, Any]
    ) -> None:
        ray = _ray()
        self.node = ray.get_runtime_context().get_node_id()
        self.rss_before = _memory_of_process()
        self.native = _colibri.NativeStage(path, start=start, end=end, **options)
        self.index, self.layers = index, tuple(self.native.layers)
        self.last = bool(self.native.is_last)

    def describe(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "layers": self.layers,
            "node": self.node,
            "last": self.last,
            "pid": os.getpid(),
            "threads": self.native.threads,
            "sequences": self.native.sequences,
            "memory": _memory_of_process(),
            "memory_at_start": self.rss_before,
        }

    def metadata(self) -> tuple[str, str | None]:
        return self.native.metadata_json(), self.native.tokenizer_json()

    def routing_stats_json(self, since: str | None, until: str | None) -> str:
        return self.native.routing_stats_json(since, until)

    def store_stats_json(self) -> str:
        return self.native.store_stats_json()

    def kv(self) -> tuple[str, tuple[int, int]]:
        return self.native.kv_dtype(), self.native.state_bytes()

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One message through this stage: the residual rows on to the next
        stage, or (last stage) the token or logits back to the driver. A
        failure becomes an error message the later stages pass on."""
        op, sid = msg["op"], msg.get("id", 0)
        sids = msg["ids"] if op == "steps" else [sid]
        if "error" in msg or op == "release":
            for i in sids:
                self.native.release(i)
            return msg
        try:
            h = msg.get("h")
            if op == "steps":  # one decode step of several sequences, one pass
                out = self.native.step_many(sids, msg["tokens"], h)
                if self.last:
                    return {"op": op, "ids": sids, "results": out}
                return {**msg, "h": bytes(out)}
            if op == "run":
                rows = bytes(self.native.run(msg["ids"], h))
                return {"op": op, "out": rows} if self.last else {**msg, "h": rows}
            if op == "start" and not self.last:
                self.native.begin(sid, msg["max_seq"])
            if not self.last:
                out = dict(msg)
                out["h"] = bytes(self.native.forward(sid, msg["ids"], h))
                return out
            if op == "start":
                self.native.start(sid, msg["ids"], **msg["options"])
            token, finish, logprobs = self.native.step(sid, h)
            return {"op": op, "id": sid, "token": token, "finish": finish, "logprobs": logprobs}
        except Exception as e:  # noqa: BLE001 - every failure goes back as a message
            for i in sids:
                self.native.release(i)
            return {
                "op": op,
                "id": sid,
                "ids": sids,
                "error": str(e),
                "kind": type(e).__name__,
                "stage": self.index,
                "layers": self.layers,
                "node": self.node,
            }


class Pipeline:
    """The stage actors of one model and the driver thread that feeds them.
    :class:`Engine` wraps it; use that."""

    def __init__(
        self,
        path: str,
        *,
        stages: int | None,
        threads_per_stage: int | None,
        transport: str,
        shares: list[float] | None,
        kv_cache_dtype: str,
        weights: str,
        ram_budget: int | None,
        timeout: float,
        address: str | None,
    ) -> None:
        ray = _ray()
        if transport not in ("compiled", "actor"):
            raise InvalidInputError(f'transport must be "compiled" or "actor", got {transport!r}')
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
            raise InvalidInputError(f"stages must be a positive integer, got {stages!r}")
        t = threads_per_stage
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise InvalidInputError(f"threads_per_stage must be a positive integer, got {t!r}")
        if not timeout > 0:
            raise InvalidInputError(f"timeout must be positive seconds, got {timeout!r}")
        # A whole model file here, or else a folder of stage files that the
        # nodes hold (this machine need not hold any of them).
        self.split = not os.path.isfile(path)
        if self.split:
            if shares is not None:
                raise InvalidInputError("shares: stage files were cut with their shares already; give none")
            if os.path.exists(path) and not os.path.isdir(path):
                raise ModelNotFoundError(f"{path} is neither a model file nor a folder of stage files")
        else:
            part = _colibri.stage_file_info(path)
            if part is not None:
                raise InvalidInputError(
                    f"{path} is one stage file ({json.loads(part)['stages']} in the split): give the folder "
                    "that holds the stage files"
                )
            if ram_budget is not None:
                raise InvalidInputError(
                    "stages of a whole model file keep their experts resident: cut the model into stage "
                    "files (colibri split) for stages that stream their experts under a RAM budget"
                )
            stages = 2 if stages is None else stages
            if shares is not None and len(shares) != stages:
                raise InvalidInputError(f"shares: one per stage ({stages}), got {len(shares)}")
            _colibri.stage_plan(path, [1.0] * stages)  # refuses a count the layers cannot make
        self.path, self.stages, self.transport, self.timeout = path, stages or 0, transport, float(timeout)
        self.threads = threads_per_stage or 1
        self._options: dict[str, Any] = {
            "threads": self.threads,
            "kv_cache_dtype": kv_cache_dtype,
            "weights": weights,
            "ram_budget": ram_budget,
        }
        self.files: list[str] = [path] * self.stages
        self._ids = itertools.count(1)
        self._queue: queue.Queue[_Queued | None] = queue.Queue()
        self._lock = threading.Lock()
        self.restarts = 0
        #: Messages completed, and most decode steps joined into one.
        self.steps = 0
        self.max_batch = 32
        #: Decode steps that ran in a message with others, and the most
        #: recent message's sequences.
        self.batched_steps = 0
        self.last_batch = 0
        self.counts = {"prompt_tokens": 0, "generated_tokens": 0, "running": 0, "finished": 0}
        self._stop = False
        # A Ray this pipeline started (no cluster was joined) stops with it.
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # Not ray.init()'s own default, which also joins whatever cluster
            # this machine ran last (a stale one makes it wait for minutes).
            where = address or os.environ.get("RAY_ADDRESS") or "local"
            ray.init(address=where, include_dashboard=False, logging_level=logging.WARNING)
        try:
            self._start(ray, shares)
        except BaseException:
            if self._owns_ray:
                ray.shutdown()
            raise

    def _start(self, ray: Any, shares: list[float] | None) -> None:
        pins = self._find_stage_files(ray) if self.split else None
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < self.stages * self.threads:
            raise StageError(
                f"{self.stages} stages of {self.threads} CPU(s) need {self.stages * self.threads} CPUs; "
                f"the Ray cluster has {cpus:g}"
            )
        self._pg = self._place(ray, pins)
        try:
            self.plan = self._plan(ray, shares)
            self._start_actors(ray)
        except BaseException:
            ray.util.remove_placement_group(self._pg)
            raise
        self._thread = threading.Thread(target=self._drive, name="colibri-pipeline", daemon=True)
        self._thread.start()

    # -- placement -----------------------------------------------------

    def _find_stage_files(self, ray: Any) -> list[str]:
        """Asks every node which stage files it holds in the folder, picks
        each stage's node, and returns them (one per stage)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = ray.remote(num_cpus=0)(_stage_files_here)
        alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        asks = [
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(self.path)
            for n in alive
        ]
        try:
            found = dict(zip(alive, ray.get(asks, timeout=self.timeout)))
        except Exception as e:
            raise StageError(f"could not list the stage files in {self.path} on the nodes: {e}") from e
        nodes, self.files, infos = choose_split(found, self.path, self.stages or None)
        self.stages = len(nodes)
        self._layers = [(int(i["layers"][0]), int(i["layers"][1])) for i in infos]
        self._file_bytes = [int(i["bytes"]) for i in infos]
        if len(set(nodes)) < len(nodes):
            warnings.warn(
                f"{len(nodes)} stages on {len(set(nodes))} node(s): the stage files allow no other placement",
                RuntimeWarning,
                stacklevel=6,
            )
        return nodes

    def _place(self, ray: Any, pins: list[str] | None) -> Any:
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        alive = [n for n in ray.nodes() if n.get("Alive")]
        # One stage per node where there are enough nodes; otherwise they
        # share (one machine trying the pipeline out). Stage files pin each
        # stage to a node holding its file.
        strategy = "STRICT_SPREAD" if len(alive) >= self.stages else "PACK"
        if pins is not None:
            strategy = "STRICT_SPREAD" if len(set(pins)) == len(pins) else "PACK"
        elif strategy == "PACK" and self.stages > 1:
            warnings.warn(
                f"{self.stages} stages on a cluster of {len(alive)} node(s): stages share nodes",
                RuntimeWarning,
                stacklevel=5,
            )
        selectors = None if pins is None else [{NODE_ID_LABEL_KEY: n} for n in pins]
        bundles = [{"CPU": self.threads}] * self.stages
        pg = placement_group(bundles, strategy=strategy, bundle_label_selector=selectors)
        try:
            ray.get(pg.ready(), timeout=self.timeout)
        except Exception as e:
            ray.util.remove_placement_group(pg)
            raise StageError(
                f"Ray could not place {self.stages} stages of {self.threads} CPU(s) each "
                f"({strategy}) within {self.timeout:.0f} s: {e}"
            ) from e
        return pg

    def _plan(self, ray: Any, shares: list[float] | None) -> list[tuple[int, int]]:
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(self._pg)["bundles_to_node_id"]
        memory = {n["NodeID"]: float(n.get("Resources", {}).get("memory", 0.0)) for n in ray.nodes()}
        self.nodes = [nodes[i] for i in range(self.stages)]
        node_memory = [memory.get(n, 0.0) for n in self.nodes]
        if self.split:
            self.stage_bytes = self._file_bytes
            # Under a RAM budget a stage holds its dense part and the budget,
            # not its file: the budget is the user's word for what fits.
            refusal = None if self._options["ram_budget"] else too_small(self.stage_bytes, node_memory)
            if refusal:
                raise StageError(refusal)
            return self._layers
        if shares is None:
            shares = node_memory if all(m > 0 for m in node_memory) else [1.0] * self.stages
        plan = [tuple(r) for r in _colibri.stage_plan(self.path, [float(s) for s in shares])]
        per_layer, embed, head = _colibri.stage_bytes(self.path)
        n = len(per_layer)
        self.stage_bytes = [sum(per_layer[a:b]) + embed * (a == 0) + head * (b == n) for a, b in plan]
        refusal = too_small(self.stage_bytes, node_memory)
        if refusal:
            raise StageError(refusal)
        return [(int(a), int(b)) for a, b in plan]

    # -- actors --------------------------------------------------------

    def _start_actors(self, ray: Any) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(_StageBody)
        self.actors = []
        for i, (a, b) in enumerate(self.plan):
            where = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)
            opts = remote.options(num_cpus=self.threads, max_restarts=0, scheduling_strategy=where)
            # A stage file runs the layers it holds.
            layers = (None, None) if self.split else (a, b)
            self.actors.append(opts.remote(self.files[i], i, *layers, self._options))
        try:
            self.described = ray.get([a.describe.remote() for a in self.actors], timeout=self.timeout)
        except Exception as e:
            for a in self.actors:
                ray.kill(a)
            raise StageError(f"the stages did not start: {e}") from e
        self._dag = None
        if self.transport == "compiled":
            from ray.dag import InputNode

            with InputNode() as inp:
                node = inp
                for a in self.actors:
                    node = a.call.bind(node)
            self._dag = node.experimental_compile(_max_inflight_executions=max(2, self.stages))

    def _teardown(self, ray: Any) -> None:
        if self._dag is not None:
            # The compiled graph's teardown waits for each stage's loop to
            # see the cancel, which a loop spinning on its channel sometimes
            # never does (seen on 2 cores): give it a while, then kill.
            dag, self._dag = self._dag, None
            done = threading.Thread(target=_quietly, args=(dag.teardown,), daemon=True)
            done.start()
            done.join(timeout=min(10.0, self.timeout))
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def metadata(self) -> tuple[str, str | None]:
        ray = _ray()
        meta: tuple[str, str | None] = ray.get(self.actors[-1].metadata.remote(), timeout=self.timeout)
        return meta

    def describe(self) -> list[dict[str, Any]]:
        """Each stage's layers, node, threads and memory (RSS and the mapped
        file's resident pages)."""
        ray = _ray()
        out: list[dict[str, Any]] = ray.get([a.describe.remote() for a in self.actors], timeout=self.timeout)
        for d, b in zip(out, self.stage_bytes):
            d["weight_bytes"] = b
        return out

    # -- the driver ----------------------------------------------------

    def submit(self, msg: dict[str, Any]) -> Future[dict[str, Any]]:
        """Queues one message through every stage; its future holds the last
        stage's answer."""
        fut: Future[dict[str, Any]] = Future()
        if self._stop:
            fut.set_exception(StageError("the pipeline is closed"))
        else:
            self._queue.put((msg, fut))
        return fut

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        """:meth:`submit`, waited for, a stage's error raised as its class."""
        out = self.submit(msg).result(timeout=self.timeout * 2)
        if "error" in out:
            cls = _KINDS.get(out["kind"], StageError)
            raise cls(f"{out['error']} [{_where(out['stage'], out['layers'], out['node'])}]")
        return out

    def new_id(self) -> int:
        return next(self._ids)

    def count(self, prompt: int = 0, generated: int = 0, started: int = 0, finished: int = 0) -> None:
        # What batch_stats() reports, kept by the generations.
        with self._lock:
            self.counts["prompt_tokens"] += prompt
            self.counts["generated_tokens"] += generated
            self.counts["running"] += started - finished
            self.counts["finished"] += finished

    def batch_stats(self) -> dict[str, Any]:
        """``colibri.Engine.batch_stats``'s fields for the pipeline: counts of
        generations and tokens, messages as steps; the fields of a
        single scheduler that have no meaning here are zero."""
        with self._lock:
            c = dict(self.counts)
        return {
            "waiting": self._queue.qsize(),
            "running": c["running"],
            "steps": self.steps,
            "prompt_tokens": c["prompt_tokens"],
            "generated_tokens": c["generated_tokens"],
            "last_batch": self.last_batch,
            "step_token_buckets": [],
            "step_tokens": [self.steps],
            "step_sequences": [],
            "finished": c["finished"],
            "busy_seconds": 0.0,
            "kv_tokens": 0,
            "max_batch": self.max_batch,
            "max_queue": 0,
            "step_budget": 0,
            "prefix_cache": None,
            "drafted_tokens": 0,
            "accepted_tokens": 0,
        }

    def routing_stats_json(self, since: str | None, until: str | None) -> str:
        """Routing statistics: each layer's from the stage that runs it."""

        ray = _ray()
        if until is None:
            calls = [a.routing_stats_json.remote(None, None) for a in self.actors]
            snaps = ray.get(calls, timeout=self.timeout)
            merged = json.loads(snaps[0])
            merged["layers"] = [
                layer
                for (a, b), snap in zip(self.plan, snaps)
                for layer in json.loads(snap)["layers"]
                if a <= layer["layer"] < b
            ]
            until = json.dumps(merged)
        if since is None:
            return until
        # A window is a function of its two snapshots; any stage computes it.
        out: str = ray.get(self.actors[0].routing_stats_json.remote(since, until), timeout=self.timeout)
        return out

    def store_stats_json(self) -> str:
        """Expert-store statistics, the stages' counts added up."""

        ray = _ray()
        stats = [json.loads(x) for x in ray.get([a.store_stats_json.remote() for a in self.actors])]
        total = stats[0]
        for other in stats[1:]:
            for k, v in other.items():
                if k != "tokens" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] += v
            total["warnings"] += other["warnings"]
        total["layers"] = [
            layer for (a, b), st in zip(self.plan, stats) for layer in st["layers"] if a <= layer["layer"] < b
        ]
        total["hit_rate"] = total["hits"] / total["lookups"] if total["lookups"] else 0.0
        total["bytes_read_per_token"] = total["bytes_read"] / total["tokens"] if total["tokens"] else 0.0
        used, predicted = total["prefetch_predicted_used"], total["prefetch_predicted"]
        total["prefetch_accuracy"] = used / predicted if predicted else 0.0
        return json.dumps(total)

    def _send(self, msg: dict[str, Any]) -> Any:
        if self._dag is not None:
            return self._dag.execute(msg)
        ref = msg
        for a in self.actors:
            ref = a.call.remote(ref)
        return ref

    def _drive(self) -> None:
        ray = _ray()
        inflight: collections.deque[tuple[Any, list[Future[dict[str, Any]]]]] = collections.deque()
        while True:
            # Fill the pipeline: up to one message per stage in flight, the
            # decode steps waiting at that moment joined into one message.
            while len(inflight) < self.stages:
                try:
                    item = self._queue.get(timeout=None if not inflight else 0) if not self._stop else None
                except queue.Empty:
                    break
                if item is None:
                    break
                items = [item]
                while item[0]["op"] == "step" and len(items) < self.max_batch:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None or more[0]["op"] != "step":
                        self._queue.put(more)  # back in line (a start, a release, or the close)
                        break
                    items.append(more)
                msg, futs = self._message(items)
                self.last_batch = len(items)
                if len(items) > 1:
                    self.batched_steps += len(items)
                try:
                    inflight.append((self._send(msg), futs))
                except Exception as e:  # noqa: BLE001 - a dead stage fails the send
                    err = self._failed(ray, e, inflight)
                    for f in futs:
                        f.set_exception(err)
            if not inflight:
                if self._stop:
                    # Anything queued after close fails rather than waits.
                    while not self._queue.empty():
                        left = self._queue.get_nowait()
                        if left is not None:
                            left[1].set_exception(StageError("the pipeline is closed"))
                    return
                continue
            ref, futs = inflight.popleft()
            try:
                out = ray.get(ref, timeout=self.timeout)
            except Exception as e:  # noqa: BLE001 - a stage died or timed out
                err = self._failed(ray, e, inflight)
                for f in futs:
                    f.set_exception(err)
                continue
            self.steps += 1
            if out["op"] != "steps" or "error" in out:
                for f in futs:
                    f.set_result(out)
                continue
            for f, (token, finish, logprobs) in zip(futs, out["results"]):
                f.set_result({"op": "step", "token": token, "finish": finish, "logprobs": logprobs})

    @staticmethod
    def _message(items: list[_Queued]) -> tuple[dict[str, Any], list[Future[dict[str, Any]]]]:
        # Several decode steps become one "steps" message (one batched pass
        # on every stage); anything else goes as it is.
        if len(items) == 1:
            return items[0][0], [items[0][1]]
        msg = {"op": "steps", "ids": [m["id"] for m, _ in items], "tokens": [m["ids"][0] for m, _ in items]}
        return msg, [f for _, f in items]

    def _failed(self, ray: Any, e: Exception, inflight: collections.deque[Any]) -> StageError:
        # Name the stage that is gone, fail everything in flight, and start
        # every stage afresh (the others' sequences died with the request).
        dead = []
        for i, a in enumerate(self.actors):
            try:
                ray.get(a.describe.remote(), timeout=min(5.0, self.timeout))
            except Exception:  # noqa: BLE001 - this one is gone
                dead.append(i)
        names = ", ".join(_where(i, self.plan[i], self.nodes[i]) for i in dead)
        err = StageError(
            f"{names or 'a stage'} failed: {type(e).__name__}: {e}; in-flight requests end here, the "
            "pipeline restarts its stages"
        )
        while inflight:
            for f in inflight.popleft()[1]:
                f.set_exception(err)
        self._teardown(ray)
        try:
            self._start_actors(ray)
            self.restarts += 1
        except StageError as again:
            self._stop = True
            err = StageError(f"{err}; restarting failed: {again}")
        return err

    def close(self) -> None:
        if self._stop and not self._thread.is_alive():
            return
        self._stop = True
        self._queue.put(None)
        self._thread.join(timeout=self.timeout)
        ray = _ray()
        self._teardown(ray)
        ray.util.remove_placement_group(self._pg)
        if self._owns_ray:
            ray.shutdown()


class _Generation:
    """A generation through the pipeline, with ``NativeGeneration``'s
    interface (what :class:`colibri.Stream` reads)."""

    def __init__(self, pipe: Pipeline, ids: list[int], options: dict[str, Any], max_seq: int) -> None:
        self._pipe, self._ids, self._options, self._max_seq = pipe, ids, options, max_seq
        self._id = pipe.new_id()
        self._tokens: list[int] = []
        self._logprobs: list[Any] = []
        self._finish: str | None = "length" if options["max_new_tokens"] == 0 else None
        self._cancelled = False
        self._released = False
        self._prefill = self._decode = 0.0

    def __iter__(self) -> _Generation:
        return self

    def __next__(self) -> int:
        if self._finish is not None or self._cancelled:
            self._release()
            raise StopIteration
        began = time.perf_counter()
        if not self._tokens:
            msg = {"op": "start", "id": self._id, "ids": self._ids, "max_seq": self._max_seq}
            msg["options"] = self._options
        else:
            msg = {"op": "step", "id": self._id, "ids": self._tokens[-1:]}
        try:
            out = self._pipe.call(msg)
        except BaseException:
            self._finish_failed()
            raise
        took = time.perf_counter() - began
        if not self._tokens:
            self._pipe.count(prompt=len(self._ids), started=1)
            self._prefill = took
        else:
            self._decode += took
        token = out["token"]
        if token is None:
            self._release()
            raise StopIteration
        self._tokens.append(int(token))
        self._pipe.count(generated=1)
        if out["logprobs"] is not None:
            self._logprobs.append(out["logprobs"])
        self._finish = out["finish"]
        return int(token)

    def _finish_failed(self) -> None:
        # The failing stage and those after it have let the sequence go; the
        # ones before it still hold it (after a restart no stage does, and
        # the release is a no-op).
        self._cancelled = True
        if not self._pipe._stop:
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._pipe.count(finished=int(bool(self._tokens)))
            self._pipe.submit({"op": "release", "id": self._id})

    def cancel(self) -> None:
        self._cancelled = True
        self._release()

    @property
    def finish_reason(self) -> str | None:
        return self._finish

    @property
    def token_ids(self) -> list[int]:
        return list(self._tokens)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def logprobs(self, start: int = 0) -> list[Any]:
        return self._logprobs[start:]

    def timings(self) -> tuple[int, int, float, float, int, int, int, int]:
        passes = max(0, len(self._tokens) - 1)
        return (len(self._ids), len(self._tokens), self._prefill, self._decode, 0, 0, 0, passes)


class _PipelineNative:
    """The part of ``NativeEngine``'s interface :class:`colibri.Engine`
    uses, served by a :class:`Pipeline`."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        self._meta, self._tokenizer = pipe.metadata()
        ray = _ray()
        self._kv: tuple[str, tuple[int, int]] = ray.get(pipe.actors[-1].kv.remote(), timeout=pipe.timeout)
        self.threads = pipe.threads * pipe.stages

    def metadata_json(self) -> str:
        return self._meta

    def tokenizer_json(self) -> str | None:
        return self._tokenizer

    def start(self, ids: list[int], *, stop_ids: list[int], **options: Any) -> _Generation:
        if options.pop("speculative", None) is not None:
            raise InvalidInputError("speculative decoding does not run through pipeline stages")
        options.pop("draft_tokens", None)
        if options.pop("prediction", None):
            raise InvalidInputError("prediction (drafts from an expected output) needs speculative decoding")

        ctx = int(json.loads(self._meta)["config"]["max_seq_len"])
        if not ids:
            raise InvalidInputError("empty token sequence: give at least one token id")
        if len(ids) > ctx:
            raise ContextLengthError(f"prompt of {len(ids)} tokens is longer than the context of {ctx}")
        options["stop_ids"] = list(stop_ids)
        max_seq = min(len(ids) + int(options["max_new_tokens"]), ctx)
        return _Generation(self.pipe, list(ids), options, max_seq)

    def kv_dtype(self) -> str:
        return self._kv[0]

    def kv_bytes_per_token(self) -> int:
        return self._kv[1][0]

    def state_bytes(self) -> tuple[int, int]:
        return self._kv[1]

    def batch_stats_json(self) -> str:

        return json.dumps(self.pipe.batch_stats())

    def routing_stats_json(self, since: str | None, until: str | None) -> str:
        return self.pipe.routing_stats_json(since, until)

    def store_stats_json(self) -> str:
        return self.pipe.store_stats_json()

    def logits(self, ids: list[int]) -> bytes:
        out: bytes = self.pipe.call({"op": "run", "ids": list(ids)})["out"]
        return out

    def close(self) -> None:
        self.pipe.close()

    def __getattr__(self, name: str) -> Any:
        raise InvalidInputError(f"{name} is not available through pipeline stages (colibri.ray.Engine)")


class Engine(_LocalEngine):
    """:class:`colibri.Engine` over a model split into ``stages`` pipeline
    stages on the machines of a Ray cluster: the same ``generate``,
    ``stream``, ``chat`` and ``logits``, with the same tokens and logits as
    one process. Joins the running Ray cluster (or ``address``), or starts a
    local one, as ``ray.init()`` does.

    Args:
        path: the ``.colibri`` file, at the same path on every node; or a
            folder of stage files cut by :func:`colibri.split` (``colibri
            split``), each node holding the files of the stages it may run
            in that folder (this machine need hold none). Each stage then
            runs on a node that has its file, on distinct nodes where the
            files allow it.
        stages: how many stages (at most one per node when the cluster has
            that many nodes; they share nodes otherwise, with a warning).
            Default: 2 for a model file; the split's count for stage files.
        threads_per_stage: CPUs each stage reserves and computes with.
        transport: ``"compiled"`` (a Ray Compiled Graph) or ``"actor"``
            (chained actor calls).
        shares: each stage's relative share of the weights; by default each
            node's memory, as Ray reports it (model files only: stage files
            were cut with theirs).
        ram_budget: with stage files, RAM for each stage's routed experts
            (bytes, or a size such as ``"8GB"``): a stage whose experts do
            not fit streams them from its own disk, as
            :class:`colibri.Engine` does.
        timeout: seconds any wait on a stage may take before it counts as
            failed.
    """

    def __init__(  # noqa: PLR0913 - mirrors the keyword arguments above
        self,
        path: str | os.PathLike[str],
        *,
        stages: int | None = None,
        threads_per_stage: int | None = None,
        transport: str = "compiled",
        shares: list[float] | None = None,
        kv_cache_dtype: str = "auto",
        mmap: bool | None = None,
        ram_budget: int | str | None = None,
        timeout: float = 120.0,
        address: str | None = None,
    ) -> None:
        self._path = os.fspath(path)
        self._ram_budget = _budget_bytes(ram_budget)
        weights = "auto" if mmap is None else "map" if mmap else "copy"
        self.pipeline = Pipeline(
            self._path,
            stages=stages,
            threads_per_stage=threads_per_stage,
            transport=transport,
            shares=shares,
            kv_cache_dtype=kv_cache_dtype,
            weights=weights,
            ram_budget=self._ram_budget,
            timeout=timeout,
            address=address,
        )
        self._native = _PipelineNative(self.pipeline)  # type: ignore[assignment]
        self._attach()

    @classmethod
    def demo(cls, *, threads: int | None = None, **options: Any) -> Engine:
        """The demo model split into stages (``options`` as for this class)."""
        if threads is not None:
            options.setdefault("threads_per_stage", threads)
        return cls(_demo_path(), **options)

    def __repr__(self) -> str:
        if self.closed:
            return f"colibri.ray.Engine({self._path!r}, closed)"
        p = self.pipeline
        return f"colibri.ray.Engine({self._path!r}, stages={p.plan}, transport={p.transport!r})"

    @property
    def threads(self) -> int:
        return self.pipeline.threads * self.pipeline.stages

    def stages(self) -> list[dict[str, Any]]:
        """Each stage: its layers, node, threads, weight bytes and memory."""
        return self.pipeline.describe()
