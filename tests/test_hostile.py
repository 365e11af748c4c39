"""Hostile files under an address-space limit: a header that claims huge
shapes must be refused before anything that size is allocated, with a
typed error, not a crash (an allocation failure aborts the process)."""

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# The child process gets this much address space: the interpreter, NumPy,
# the extension and its thread stacks fit; a claimed tensor of 2^60 values,
# a vocabulary of 10^12 or a KV cache for 2^24 positions do not.
LIMIT = 2 << 30

CHILD = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    import colibri
    try:
        {action}
    except colibri.ColibriError as e:
        print("error", type(e).__name__, str(e)[:300])
    else:
        print("ok")
    """
)


def run_limited(action: str) -> str:
    """Runs `action` (Python, with `colibri` and `path` bound) in a child under
    the address-space limit; returns its one-line verdict."""
    code = CHILD.format(limit=LIMIT, action=action)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"child died ({r.returncode}): {r.stderr[-2000:]}"
    return r.stdout.strip()


def with_meta(good: bytes, edit) -> bytes:
    """`good` with its metadata JSON changed by `edit` (padded to its old length)."""
    magic, ver, flags, mlen, doff = struct.unpack("<8sIIQQ", good[:32])
    meta = json.loads(good[32 : 32 + mlen])
    edit(meta)
    text = json.dumps(meta, separators=(",", ":")).encode()
    assert 32 + len(text) <= doff, "the edited metadata must fit before the data"
    head = struct.pack("<8sIIQQ", magic, ver, flags, len(text), doff)
    return head + text + good[32 + len(text) :]


def set_config(key, value):
    def edit(meta):
        meta["config"][key] = value

    return edit


def set_first_tensor(key, value):
    def edit(meta):
        meta["tensors"][0][key] = value

    return edit


@pytest.mark.parametrize(
    "name,edit",
    [
        ("vocabulary of 10^12", set_config("vocab_size", 10**12)),
        ("hidden size of 2^40", set_config("hidden_size", 1 << 40)),
        ("2^60-value tensor", set_first_tensor("shape", [1 << 30, 1 << 30])),
        ("tensor past the file", set_first_tensor("nbytes", 1 << 62)),
        ("offset near 2^64", set_first_tensor("offset", (1 << 64) - 64)),
        ("2^40 heads", set_config("num_heads", 1 << 40)),
    ],
)
def test_huge_claims_in_a_colibri_file_are_refused_before_allocation(tmp_path, converted, name, edit):
    bad = tmp_path / "bad.colibri"
    bad.write_bytes(with_meta(converted("olmoe").read_bytes(), edit))
    verdict = run_limited(f"colibri.Engine({str(bad)!r}, threads=1)")
    assert verdict.startswith("error FormatError"), f"{name}: {verdict}"


def test_a_huge_context_claim_costs_only_the_session_asked_for(tmp_path, converted):
    # The context length is a ceiling, not an allocation: a file that claims
    # 2^24 positions (the most the reader accepts; 10^15 is refused as
    # implausible) opens and generates within the limit.
    big = tmp_path / "ctx.colibri"
    big.write_bytes(with_meta(converted("olmoe").read_bytes(), set_config("max_seq_len", 1 << 24)))
    verdict = run_limited(
        f"e = colibri.Engine({str(big)!r}, threads=1); "
        "out = e.generate([1, 2, 3], max_new_tokens=4, ignore_eos=True); "
        "assert len(out) == 4"
    )
    assert verdict == "ok", verdict


def test_a_safetensors_header_claiming_2_60_values_is_a_checkpoint_error(tmp_path):
    src = tmp_path / "ck"
    src.mkdir()
    header = {"w": {"dtype": "F32", "shape": [1 << 30, 1 << 30], "data_offsets": [0, 16]}}
    text = json.dumps(header).encode()
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"\x00" * 16)
    cfg = (Path(__file__).parent / "fixtures/golden/olmoe/config.json").read_text()
    (src / "config.json").write_text(cfg)
    verdict = run_limited(f"colibri.convert({str(src)!r}, {str(tmp_path / 'out.colibri')!r})")
    assert verdict.startswith("error CheckpointError"), verdict
