"""The shapes of the engine's reports (typed dicts: plain ``dict`` at run
time, exact keys for a type checker). tests/test_api.py checks each against
what the native layer really returns, so they cannot drift apart. Their
annotations stay evaluable on Python 3.9 (``typing.get_type_hints``, as
pydantic and the tests call it): no ``X | None`` here."""

from typing import Optional, TypedDict


class LayerRouting(TypedDict):
    """Routing of one MoE layer (see ``Engine.routing_stats``)."""

    layer: int
    tokens: int
    #: How often each expert was chosen.
    heat: list[int]
    #: Utilisation entropy in bits, and as a fraction of the uniform maximum.
    entropy_bits: float
    entropy: float
    margin_sum: float
    #: Mean top-1/top-2 router margin, and its histogram over [0, 1].
    mean_margin: float
    margin_histogram: list[int]
    #: Experts never chosen, and chosen more than 3x their uniform share.
    dead: list[int]
    overloaded: list[int]
    #: The busiest expert's choices over the uniform share.
    max_load: float
    #: One character per expert: R resident, P pinned, C cached, . on disk.
    residency: str


class RoutingStats(TypedDict):
    """``Engine.routing_stats()``."""

    tokens: int
    layers: list[LayerRouting]


class StorePolicy(TypedDict):
    lru: bool
    pin_hot: bool
    prefetch: bool


class StoreLayer(TypedDict):
    layer: int
    hits: int
    misses: int
    bytes_read: int


class StoreWeights(TypedDict):
    """Where the weights live (``Engine(mmap=...)``)."""

    #: "mapped", "copied" or "streamed" (a RAM budget).
    backing: str
    #: Share of the weights on 2 MiB pages measured at open, or None.
    huge_pages: Optional[float]
    note: str


class StoreStats(TypedDict):
    """``Engine.store_stats()``: where routed experts come from and what reading them cost."""

    streaming: bool
    io: str
    policy: StorePolicy
    budget_bytes: int
    slot_bytes: int
    slots: int
    pinned: int
    lookups: int
    hits: int
    hits_in_flight: int
    misses: int
    hit_rate: float
    tokens: int
    reads: int
    bytes_read: int
    bytes_read_per_token: float
    read_seconds: float
    io_wait_seconds: float
    slot_wait_seconds: float
    slot_waits: int
    overflow_reads: int
    read_errors: int
    reopens: int
    prefetch_predicted: int
    prefetch_predicted_used: int
    prefetch_accuracy: float
    prefetch_reads: int
    prefetch_reads_used: int
    prefetch_reads_wasted: int
    prefetch_dropped: int
    prefetch_errors: int
    layers: list[StoreLayer]
    warnings: list[str]
    weights: StoreWeights


class PrefixCacheStats(TypedDict):
    """``BatchStats["prefix_cache"]``: the prefix cache's size and use."""

    budget_bytes: int
    bytes: int
    blocks: int
    #: Tokens per block: the granularity of what is cached.
    block_tokens: int
    lookups: int
    hits: int
    #: Prompt tokens of the requests looked up, and of them those served.
    prompt_tokens: int
    cached_tokens: int
    evicted_blocks: int


class BatchStats(TypedDict):
    """``Engine.batch_stats()``: the scheduler's counters since the engine opened."""

    waiting: int
    running: int
    steps: int
    prompt_tokens: int
    generated_tokens: int
    last_batch: int
    #: Upper bounds of the tokens-per-step buckets, and the counts per bucket.
    step_token_buckets: list[int]
    step_tokens: list[int]
    #: Steps by how many sequences ran in them.
    step_sequences: list[int]
    finished: int
    busy_seconds: float
    kv_tokens: int
    max_batch: int
    max_queue: int
    step_budget: int
    #: ``None`` without a prefix cache.
    prefix_cache: Optional[PrefixCacheStats]
    #: Tokens drafted by speculative decoding, and of them those confirmed.
    drafted_tokens: int
    accepted_tokens: int


class Plan(TypedDict):
    """``colibri.plan(path, ram_budget)``: what a budget holds and what it is expected to read."""

    budget: Optional[int]
    streams: bool
    file_bytes: int
    dense_bytes: int
    expert_bytes: int
    experts: int
    moe_layers: int
    top_k: int
    slab_bytes: int
    slot_bytes: int
    min_budget: int
    slots: int
    pinned_slots: int
    resident_bytes: int
    streamed_bytes: int
    expected_hit_rate: float
    expected_bytes_per_token: float
    estimate: str
    warnings: list[str]
    state_bytes_per_token: int
    state_bytes_per_sequence: int


__all__ = [
    "BatchStats",
    "LayerRouting",
    "Plan",
    "RoutingStats",
    "StoreLayer",
    "StorePolicy",
    "StoreStats",
    "StoreWeights",
]
