"""Shared fixtures: the golden cases and converted models, made once per session."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import colibri

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.npz").exists())


def read_safetensors(path: Path) -> tuple[dict[str, dict], bytes]:
    """Header entries and the raw data section of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n :]


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Writes {name: (dtype, shape, bytes)} as a safetensors file."""
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def load_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a (possibly sharded) checkpoint folder."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        header, data = read_safetensors(f)
        for name, e in header.items():
            s, t = e["data_offsets"]
            out[name] = (e["dtype"], e["shape"], data[s:t])
    return out


def copy_case_single_file(case: str, dst: Path) -> Path:
    """A golden case re-saved as one model.safetensors, for tests that edit it."""
    src = GOLDEN / case
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    write_safetensors(dst / "model.safetensors", load_tensors(src))
    return dst


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(case, dtype) -> path of the .colibri file, converting once."""
    root = tmp_path_factory.mktemp("converted")
    cache: dict[tuple[str, str | None], Path] = {}

    def get(case: str, dtype: str | None = None) -> Path:
        key = (case, dtype)
        if key not in cache:
            out = root / f"{case}-{dtype or 'auto'}.colibri"
            colibri.convert(GOLDEN / case, out, dtype=dtype, progress=False)
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session")
def golden():
    """golden(case) -> the case's golden arrays."""
    cache: dict[str, dict[str, np.ndarray]] = {}

    def get(case: str) -> dict[str, np.ndarray]:
        if case not in cache:
            with np.load(GOLDEN / case / "golden.npz") as z:
                cache[case] = {k: z[k] for k in z.files}
        return cache[case]

    return get


@pytest.fixture(scope="session")
def mixtral(converted):
    """An engine on the small Mixtral fixture."""
    return colibri.Engine(converted("mixtral"), threads=2)
