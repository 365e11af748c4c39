"""Type stubs of the native extension (src/python/mod.rs)."""

from os import PathLike
from typing import Any, final

__version__: str

@final
class NativeEngine:
    def __new__(cls, path: str | PathLike[str], threads: int | None = None) -> NativeEngine: ...
    def logits(self, token_ids: list[int]) -> bytearray: ...
    def hidden_states(self, token_ids: list[int]) -> bytearray: ...
    def generate(
        self,
        token_ids: list[int],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        stop_ids: list[int],
    ) -> list[int]: ...
    def metadata_json(self) -> str: ...
    @property
    def threads(self) -> int: ...

def convert_checkpoint(
    src: str | PathLike[str],
    dst: str | PathLike[str],
    dtype: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict[str, Any]: ...
def supported_architectures() -> list[str]: ...
def supported_dtypes() -> list[str]: ...
