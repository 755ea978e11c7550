"""Every ``rlwire-train`` command the READMEs and the documentation show still loads: its keys,
values, presets and config files are valid now (checked with ``--print-config``: the same
parse and checks a run starts with, and nothing run). A key renamed in the code fails here
until the docs say the new name."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted(ROOT.glob("packages/*/README.md")),
    *sorted(ROOT.glob("docs/**/*.md")),
    *sorted(ROOT.glob("examples/**/*.md")),
]
# Placeholders a reader replaces with their own (a module of theirs, a file they write).
PLACEHOLDERS = ("mypkg.", "my_pkg.", "run.yaml")


def _commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of each ``rlwire-train`` line in a shell block."""
    found = []
    for page in PAGES:
        fenced = inside = False  # in a fenced block; in a shell one
        text = re.sub(r"\\\n\s*", " ", page.read_text())  # continued lines, joined
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip().startswith("```"):
                fenced = not fenced  # a block's closing fence ends it, whatever its language
                inside = fenced and line.strip()[3:] in ("bash", "sh", "shell", "")
                continue
            if not inside or "rlwire-train" not in line:
                continue
            words = shlex.split(line, comments=True)
            if "rlwire-train" not in words or "--with" in words:  # --with: another package
                continue
            argv = words[words.index("rlwire-train") + 1 :]
            if argv[:1] == ["plot"] or any(p in line for p in PLACEHOLDERS):
                continue
            found.append((f"{page.relative_to(ROOT)}:{number}", argv))
    return found


COMMANDS = _commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 20, COMMANDS  # the reader did not lose them (a fence's language)


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_loads(where, argv, monkeypatch):
    from rlwire.trainer.cli import main

    monkeypatch.chdir(ROOT)  # --config paths are the repository's
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*argv, "--print-config"])
    assert code == 0, f"{where}: rlwire-train {' '.join(argv)}\n{err.getvalue()}"
