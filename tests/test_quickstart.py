"""A new user's first five minutes: the demo model, the README's quickstart
command in a fresh virtual environment, its Python example, and its tables.

The demo model ships inside the package (python/colibri/data/demo.colibri);
these tests fail, not skip, when it is missing, since the README promises it.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np

import colibri

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def block(marker: str) -> str:
    """The fenced code between <!-- marker:start --> and <!-- marker:end -->."""
    text = README.read_text(encoding="utf-8")
    part = text.split(f"<!-- {marker}:start -->")[1].split(f"<!-- {marker}:end -->")[0]
    code = re.search(r"```\w*\n(.*?)```", part, re.S)
    assert code, f"no code block between the {marker} markers"
    return code.group(1)


def test_the_demo_model_ships_and_speaks_english():
    engine = colibri.Engine.demo(threads=2)
    assert engine.has_tokenizer
    # It has learned the language it was trained on: a real sentence is far
    # more likely than the same tokens in reverse order.
    ids = engine.tokenize(
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife."
    )

    def nll(seq: list[int]) -> float:
        logits = engine.logits(seq).astype(np.float64)[:-1]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        return float(-np.mean(logp[np.arange(len(seq) - 1), seq[1:]]))

    forward, backward = nll(ids), nll(ids[::-1])
    assert forward < backward - 1.0, (forward, backward)
    assert math.exp(forward) < engine.vocab_size / 10
    out = engine.generate("Once upon a time", max_new_tokens=24, seed=0)
    assert isinstance(out, colibri.Completion) and out.token_ids
    assert "".join(engine.stream("Once upon a time", max_new_tokens=24, seed=0)) == out


def test_generate_demo_on_the_command_line():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "generate",
            "--demo",
            "Once upon a time",
            "-n",
            "16",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    want = colibri.Engine.demo().generate("Once upon a time", max_new_tokens=16, seed=3)
    assert r.stdout == want + "\n"


def test_readme_python_example_runs():
    code = block("example")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue().strip()


def test_readme_quickstart_in_a_fresh_virtual_environment(tmp_path):
    """The README's first command, as written, in a new venv from this checkout."""
    command = block("quickstart").strip()
    assert "--demo" in command and command.startswith("pip install")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    env = dict(os.environ, VIRTUAL_ENV=str(env_dir), PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    r = subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=1500,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Successfully installed" in r.stdout, r.stdout[-2000:]
    story = r.stdout.split("Successfully installed", 1)[1].split("\n", 1)[1]
    assert story.strip(), r.stdout[-2000:]


def test_weight_type_table_matches_the_engine():
    text = README.read_text(encoding="utf-8")
    part = text.split("<!-- dtypes:start -->")[1].split("<!-- dtypes:end -->")[0]
    rows = [ln for ln in part.strip().splitlines()[2:] if ln.strip()]
    listed = [re.search(r"`([^`]+)`", ln).group(1) for ln in rows]  # type: ignore[union-attr]
    assert listed == colibri.supported_dtypes()
