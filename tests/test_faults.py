"""Faults while writing and signals while working: a conversion that runs out
of disk or is stopped by SIGINT/SIGTERM leaves no output and no temporary
file; a generation stopped by a signal leaves an engine whose next call gives
the same tokens as before.

Each case runs colibri in a child process (the signal tests need one to
signal, the disk tests a file-size limit or a mount namespace of their own)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import colibri
from conftest import write_safetensors

CLI = [sys.executable, "-m", "colibri"]


def mixtral_checkpoint(dst: Path, hidden=512, inter=1024, layers=6, experts=8, vocab=4096) -> Path:
    """A random Mixtral-layout f16 checkpoint of about 170 MB: big enough that
    converting it takes a good fraction of a second, small enough to write fast."""
    dst.mkdir(parents=True, exist_ok=True)
    heads, kv, hd = 8, 4, 64
    cfg = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)

    def mat(rows: int, cols: int) -> tuple[str, list[int], bytes]:
        x = rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
        return ("F16", [rows, cols], x.astype(np.float16).tobytes())

    def norm(n: int) -> tuple[str, list[int], bytes]:
        return ("F16", [n], np.ones(n, dtype=np.float16).tobytes())

    t = {"model.embed_tokens.weight": mat(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        t[p + "self_attn.q_proj.weight"] = mat(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = mat(kv * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = mat(kv * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = mat(hidden, heads * hd)
        t[p + "block_sparse_moe.gate.weight"] = mat(experts, hidden)
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            t[q + "w1.weight"] = mat(inter, hidden)
            t[q + "w2.weight"] = mat(hidden, inter)
            t[q + "w3.weight"] = mat(inter, hidden)
    t["model.norm.weight"] = norm(hidden)
    t["lm_head.weight"] = mat(vocab, hidden)
    write_safetensors(dst / "model.safetensors", t)
    return dst


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    return mixtral_checkpoint(tmp_path_factory.mktemp("faults") / "hf")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def wait_for(pred, timeout: float = 60.0, what: str = "the child") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


# ------------------------------------------------------------------ disk full


def test_a_write_past_the_file_size_limit_leaves_nothing(big_checkpoint, tmp_path):
    """RLIMIT_FSIZE (with SIGXFSZ ignored) makes a write fail part-way, as a
    full disk does; the conversion reports it and removes its temporary."""
    out = tmp_path / "out"
    out.mkdir()
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))
        from colibri.cli import main
        sys.exit(main(["convert", {str(big_checkpoint)!r}, "-o", {str(out / "m.colibri")!r},
                       "--dtype", "q8_0"]))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "File too large" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert leftovers(out) == []


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d"
    return subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -rm` to mount a private tmpfs")
def test_a_full_disk_leaves_nothing_and_says_so(big_checkpoint, tmp_path):
    """A real full disk: a 16 MB tmpfs in a private mount namespace, then a
    conversion whose output is about 95 MB. The folder is listed from inside
    the namespace (the mount vanishes with it)."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    cmd = " ".join(
        [
            f"mount -t tmpfs -o size=16m tmpfs {mnt} &&",
            f"{sys.executable} -m colibri convert {big_checkpoint} -o {mnt}/m.colibri --dtype q8_0;",
            "echo rc=$?; ls -A",
            str(mnt),
        ]
    )
    r = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert "rc=1" in r.stdout, (r.stdout, r.stderr)
    assert f"{mnt}/m.colibri: No space left on device" in r.stderr, r.stderr  # the output, not the temporary
    assert "Traceback" not in r.stderr
    assert r.stdout.strip().splitlines()[-1] == "rc=1", r.stdout  # and `ls -A` listed nothing


def test_an_output_folder_that_does_not_exist_is_named(tmp_path):
    src = Path(__file__).parent / "fixtures" / "golden" / "mixtral"
    with pytest.raises(colibri.InvalidInputError, match="the folder .*missing does not exist"):
        colibri.convert(src, tmp_path / "missing" / "m.colibri", progress=False)
    assert leftovers(tmp_path) == []


# ------------------------------------------------------- signals during convert


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_convert_leaves_nothing(big_checkpoint, tmp_path, sig, status):
    out = tmp_path / "out"
    out.mkdir()
    child = subprocess.Popen(
        [*CLI, "convert", str(big_checkpoint), "-o", str(out / "m.colibri"), "--dtype", "q8_0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The temporary exists once tensors are being written: signal then.
        wait_for(lambda: any(out.iterdir()) or child.poll() is not None, what="the conversion to start")
        child.send_signal(sig)
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == status, err
    assert ("interrupted" if sig == signal.SIGINT else "terminated") in err
    assert "Traceback" not in err
    assert leftovers(out) == []


# ------------------------------------------------------ signals during generate


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_cli_generate_stops_it_cleanly(tmp_path, sig, status):
    """`colibri generate` streaming experts under a RAM budget (so it keeps a
    heat file beside the model): stopped part-way, it exits with the signal's
    status and leaves nothing but the model and, at most, a complete heat file."""
    model = tmp_path / "demo.colibri"
    shutil.copy(_demo_file(), model)
    child = subprocess.Popen(
        [*CLI, "generate", str(model), "It was", "-n", "400", "--ram", "1MB", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout.read(1)  # the first piece of text is out: mid-generation
        child.send_signal(sig)
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
    err = err.decode()
    assert child.returncode == status, err
    assert "Traceback" not in err
    left = leftovers(tmp_path)
    assert all(name in ("demo.colibri", "demo.colibri.heat") for name in left), left


def _demo_file() -> Path:
    return Path(colibri.__file__).parent / "data" / "demo.colibri"


SIGNAL_CHILD = textwrap.dedent(
    """
    import signal
    import colibri

    class Stop(Exception):
        pass

    def on_term(signum, frame):
        raise Stop
    signal.signal(signal.SIGTERM, on_term)

    engine = colibri.Engine.demo(threads=1)
    # The demo samples by default (its generation_config): fix the draws.
    ref = engine.generate("It was", max_new_tokens=24, seed=7)
    caught = None
    try:
        for i, piece in enumerate(engine.stream("It was", max_new_tokens=400, ignore_eos=True)):
            if i == 2:
                print("started", flush=True)  # the parent signals now
    except KeyboardInterrupt:
        caught = "KeyboardInterrupt"
    except Stop:
        caught = "Stop"
    again = engine.generate("It was", max_new_tokens=24, seed=7)
    print(caught, again == ref and again.token_ids == ref.token_ids, flush=True)
    """
)


@pytest.mark.parametrize("sig, caught", [(signal.SIGINT, "KeyboardInterrupt"), (signal.SIGTERM, "Stop")])
def test_a_signal_during_generate_raises_the_handlers_exception_and_the_engine_goes_on(sig, caught):
    """The exception the signal handler raised reaches the caller (Ctrl-C's
    KeyboardInterrupt; a SIGTERM handler's own class), whether it lands in the
    native step (most of the time is spent there) or between steps, and the
    engine's next generation is the same as before."""
    child = subprocess.Popen(
        [sys.executable, "-c", SIGNAL_CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "started"
        child.send_signal(sig)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert out.split() == [caught, "True"], (out, err)
