"""Type stubs of the native extension (src/python/mod.rs)."""

from os import PathLike
from typing import Any, Literal, final

__all__ = [
    "NativeEngine",
    "NativeGeneration",
    "NativeStage",
    "__version__",
    "convert_checkpoint",
    "kernel_tables",
    "parse_bytes",
    "plan_json",
    "recipes",
    "split_model",
    "stage_bytes",
    "stage_file_info",
    "stage_plan",
    "supported_architectures",
    "supported_dtypes",
    "token_bytes",
    "weight_classes",
]

__version__: str

@final
class NativeEngine:
    def __new__(
        cls,
        path: str | PathLike[str],
        *,
        threads: int | None = None,
        ram_budget: int | None = None,
        lru: bool = True,
        pin_hot: bool = True,
        prefetch: bool = False,
        io: str = "buffered",
        heat_file: str | None = None,
        kv_cache_dtype: str = "auto",
        max_batch: int = 16,
        max_queue: int = 0,
        weights: Literal["auto", "map", "copy"] = "auto",
        max_state_bytes: int = 0,
        prefix_cache_bytes: int = 0,
    ) -> NativeEngine: ...
    def close(self) -> str | None: ...
    def batch_stats_json(self) -> str: ...
    def kv_dtype(self) -> str: ...
    def kv_bytes_per_token(self) -> int: ...
    def state_bytes(self) -> tuple[int, int]: ...
    def routing_stats_json(self, since: str | None = None, until: str | None = None) -> str: ...
    def store_stats_json(self) -> str: ...
    def logits(self, token_ids: list[int]) -> bytearray: ...
    def hidden_states(self, token_ids: list[int]) -> bytearray: ...
    def mtp_draft_logits(self, token_ids: list[int], k: int) -> bytearray: ...
    def start(
        self,
        token_ids: list[int],
        *,
        max_new_tokens: int,
        stop_ids: list[int],
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        repetition_penalty: float,
        presence_penalty: float,
        frequency_penalty: float,
        seed: int,
        logprobs: int | None = None,
        json_schema: str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        speculative: str | None = None,
        draft_tokens: int = 4,
        prediction: list[int] = ...,
    ) -> NativeGeneration: ...
    def metadata_json(self) -> str: ...
    def tokenizer_json(self) -> str | None: ...
    def tensors(self) -> list[tuple[str, str, list[int], int]]: ...
    def tensor_classes(self) -> list[tuple[str, str]]: ...
    def recipe(self) -> str | None: ...
    def calibrate(
        self,
        windows: list[list[int]],
        output: str | PathLike[str],
        source: str,
        *,
        progress: bool = True,
    ) -> tuple[int, int]: ...
    @property
    def threads(self) -> int: ...

@final
class NativeGeneration:
    def __iter__(self) -> NativeGeneration: ...
    def __next__(self) -> int: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    def logprobs(self, start: int = 0) -> list[tuple[float, list[tuple[int, float]]]]: ...
    def timings(self) -> tuple[int, int, float, float, int, int, int, int]: ...
    def cancel(self) -> None: ...

@final
class NativeStage:
    def __new__(
        cls,
        path: str | PathLike[str],
        *,
        start: int | None = None,
        end: int | None = None,
        threads: int | None = None,
        kv_cache_dtype: str = "auto",
        weights: str = "auto",
        ram_budget: int | None = None,
    ) -> NativeStage: ...
    @property
    def layers(self) -> tuple[int, int]: ...
    @property
    def is_last(self) -> bool: ...
    @property
    def sequences(self) -> int: ...
    @property
    def threads(self) -> int: ...
    def begin(self, id: int, max_seq: int) -> None: ...
    def start(
        self,
        id: int,
        token_ids: list[int],
        *,
        max_new_tokens: int,
        stop_ids: list[int],
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        repetition_penalty: float,
        presence_penalty: float,
        frequency_penalty: float,
        seed: int,
        logprobs: int | None = None,
        json_schema: str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
    ) -> None: ...
    def forward(self, id: int, token_ids: list[int], residual: bytes | None = None) -> bytearray: ...
    def step(
        self, id: int, residual: bytes | None
    ) -> tuple[int | None, str | None, tuple[float, list[tuple[int, float]]] | None]: ...
    def routing_stats_json(self, since: str | None = None, until: str | None = None) -> str: ...
    def store_stats_json(self) -> str: ...
    def kv_dtype(self) -> str: ...
    def state_bytes(self) -> tuple[int, int]: ...
    def step_many(self, ids: list[int], token_ids: list[int], residual: bytes | None = None) -> Any: ...
    def metadata_json(self) -> str: ...
    def tokenizer_json(self) -> str | None: ...
    def release(self, id: int) -> None: ...
    def run(self, token_ids: list[int], residual: bytes | None = None) -> bytearray: ...

def convert_checkpoint(
    src: str | PathLike[str],
    dst: str | PathLike[str],
    *,
    dtype: str | None = None,
    force: bool = False,
    progress: bool = True,
    imatrix: str | PathLike[str] | None = None,
    keep_mtp: bool | None = None,
) -> dict[str, Any]: ...
def supported_architectures() -> list[str]: ...
def supported_dtypes() -> list[str]: ...
def recipes() -> list[tuple[str, str, str]]: ...
def weight_classes() -> list[str]: ...
def parse_bytes(text: str) -> int: ...
def kernel_tables() -> tuple[str, list[str]]: ...
def plan_json(path: str | PathLike[str], ram_budget: int | None = None) -> str: ...
def token_bytes(tokenizer_json: str, vocab: int) -> list[bytes]: ...
def stage_plan(path: str | PathLike[str], shares: list[float]) -> list[tuple[int, int]]: ...
def stage_bytes(path: str | PathLike[str]) -> tuple[list[int], int, int]: ...
def stage_file_info(path: str | PathLike[str]) -> str | None: ...
def split_model(
    path: str | PathLike[str],
    out: str | PathLike[str],
    plan: list[tuple[int, int]],
    *,
    force: bool = False,
    progress: bool = True,
) -> list[tuple[str, int, int, int]]: ...
