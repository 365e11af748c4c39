"""The command line, run as a user would: a subprocess."""

from __future__ import annotations

import subprocess
import sys

from conftest import GOLDEN


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", *args], capture_output=True, text=True, timeout=120
    )


def test_convert_then_info(tmp_path):
    out = tmp_path / "m.colibri"
    r = run("convert", str(GOLDEN / "qwen2_moe"), "-o", str(out), "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "bf16" in r.stdout
    r = run("info", str(out))
    assert r.returncode == 0, r.stderr
    assert "Qwen2MoeForCausalLM" in r.stdout and "active per token" in r.stdout


def test_existing_output_is_a_one_line_error(tmp_path):
    out = tmp_path / "m.colibri"
    out.write_text("keep me")
    r = run("convert", str(GOLDEN / "mixtral"), "-o", str(out))
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "already exists" in r.stderr
    assert "Traceback" not in r.stderr
    assert out.read_text() == "keep me"
    r = run("convert", str(GOLDEN / "mixtral"), "-o", str(out), "--force", "-q")
    assert r.returncode == 0 and r.stdout == ""


def test_bad_file_and_bad_arguments(tmp_path):
    r = run("info", str(tmp_path / "nope.colibri"))
    assert r.returncode == 1 and "no such file" in r.stderr and "Traceback" not in r.stderr
    r = run("convert", str(GOLDEN / "mixtral"))
    assert r.returncode == 2 and "--output" in r.stderr
    r = run("convert", "--help")
    assert r.returncode == 0 and "--dtype" in r.stdout
