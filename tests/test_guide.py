"""The guide's examples run as written, and its command-line page matches the parser.

Every ```python block of docs/guide/*.md runs in a fresh folder holding
``model.colibri`` (a copy of the demo model) and ``path/to/checkpoint`` (a
tiny random Qwen3-MoE checkpoint from the parity fixtures); a block that
raises fails its test. A block that talks to ``http://127.0.0.1:8000`` gets a
live server on the demo model, on a free port written into the block.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import colibri
from colibri.cli import build_parser
from conftest import GOLDEN

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide"
PAGES = ("python.md", "cli.md", "serving.md", "bigger-than-ram.md", "tuning.md")
SERVED = "http://127.0.0.1:8000"


def examples() -> Iterator[tuple[str, int, str]]:
    """(page, line, code) of every Python block in the guide."""
    for page in sorted(GUIDE.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            yield page.name, text.count("\n", 0, m.start()) + 1, m.group(1)


EXAMPLES = list(examples())


def test_the_guide_has_its_pages_and_examples():
    for page in PAGES:
        assert (GUIDE / page).is_file(), f"docs/guide/{page} is missing"
    assert len(EXAMPLES) >= 10


@contextlib.contextmanager
def live_demo_server() -> Iterator[str]:
    """The demo model behind the OpenAI routes on a free loopback port; yields its URL."""
    from test_server import live

    from colibri.server import create_app

    engine = colibri.Engine.demo(threads=2)
    try:
        with live(create_app(engine)) as url:
            yield url
    finally:
        engine.close()


@pytest.mark.parametrize(("page", "line", "code"), EXAMPLES, ids=[f"{p}:{n}" for p, n, _ in EXAMPLES])
def test_guide_example_runs(page, line, code, tmp_path, monkeypatch):
    shutil.copy(colibri.Engine.demo().path, tmp_path / "model.colibri")
    shutil.copytree(GOLDEN / "qwen3_moe", tmp_path / "path" / "to" / "checkpoint")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    out = io.StringIO()
    with contextlib.ExitStack() as stack:
        if SERVED in code:
            code = code.replace(SERVED, stack.enter_context(live_demo_server()))
        stack.enter_context(contextlib.redirect_stdout(out))
        exec(compile(code, f"docs/guide/{page}:{line}", "exec"), {"__name__": "__guide__"})


def test_cli_page_names_every_command_and_flag():
    """docs/guide/cli.md has a section per subcommand naming each of its flags,
    there or in the shared "Model flags" / "Sampling flags" tables it refers to."""
    text = (GUIDE / "cli.md").read_text(encoding="utf-8")
    parts = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    sections = {k[len("`colibri ") : -1]: v for k, v in parts.items() if k.startswith("`colibri ")}
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert sorted(sections) == sorted(commands), "cli.md's sections are not the parser's subcommands"
    for name, sub in commands.items():
        named = sections[name]
        for shared in ("Model flags", "Sampling flags"):
            if shared.lower() in named:
                named += parts[shared]
        for action in sub._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in named or f" {flag}" in named, (
                        f"cli.md does not name `colibri {name} {flag}`"
                    )
