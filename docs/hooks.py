"""The tables generated from the code, written into the Markdown pages, and the build's check.

A page holds each generated table between two comment lines, ``<!-- NAME -->`` and
``<!-- /NAME -->``, so it reads on GitHub as it does on the site. ``render`` replaces what
lies between them with what the function behind ``NAME`` returns now:

- ``verl-keys``: verl's key table (``rlwire.trainer.config.verl_keys.alias_table``);
- ``megatron-ddp-memory-table``: Megatron's bytes per parameter
  (``rlwire.megatron_ddp._table.memory_table``; megatron_ddp's README keeps a copy, which a
  test of that package compares with the same function);
- ``config-reference``: the index of the configuration reference, and
  ``config-reference:PAGE``: that page's sections of it, both cut from
  ``rlwire.trainer.config.describe_config()`` (``rlwire-train --help-config`` prints it whole)
  along ``CONFIG_PAGES``.

After a change to the code behind a table, write the pages again (the workspace environment:
the functions import rlwire)::

    uv run python docs/hooks.py --write     # rewrites the stale regions in docs/
    uv run python docs/hooks.py --check     # exit 1 naming each stale page

As an MkDocs hook this module only checks: a page whose region is stale fails the build,
naming the command above, as does a table no page shows. ``tests/test_docs_pages.py``
makes the same check in ``uv run pytest``.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
WRITE_COMMAND = "uv run python docs/hooks.py --write"

CONFIG_PAGES: dict[str, tuple[str, ...]] = {
    "model-data-reward": ("model", "data", "reward"),
    "actor": ("actor",),
    "rollout": ("rollout", "ckpt_engine"),
    "algorithm": ("algorithm", "validation", "agent"),
    "trainer": ("trainer", "async", "ray"),
}
"""Configuration reference page (``reference/config-PAGE.md``) -> the top-level sections it
shows, each with its subsections (``actor`` takes ``actor.optim``, ...)."""

_REGION = re.compile(
    r"^<!-- (?P<name>[\w:-]+) -->\n(?P<body>.*?)^<!-- /(?P=name) -->$", re.M | re.S
)


def _call(module: str, function: str) -> str:
    return str(getattr(importlib.import_module(module), function)())


def _config_sections() -> list[tuple[str, str]]:
    """``describe_config()`` cut at its ``### `section` `` headings: (section, Markdown)."""
    text = _call("rlwire.trainer.config", "describe_config")
    parts = re.split(r"(?m)^(?=### `)", text)
    found = []
    for part in filter(str.strip, parts):
        heading = re.match(r"### `([^`]+)`", part)
        if heading is None:
            raise ValueError(f"describe_config(): text before its first section: {part[:80]!r}")
        found.append((heading[1], part.strip("\n")))
    return found


def _top(section: str) -> str:
    return section.split(".")[0]


def _unplaced(sections: list[tuple[str, str]]) -> list[str]:
    placed = {top for tops in CONFIG_PAGES.values() for top in tops}
    return sorted({_top(name) for name, _ in sections} - placed)


def _config_page(page: str) -> str:
    if page not in CONFIG_PAGES:
        raise ValueError(f"config-reference:{page}: no such page in CONFIG_PAGES")
    tops = CONFIG_PAGES[page]
    sections = _config_sections()
    return "\n\n".join(md for name, md in sections if _top(name) in tops)


def _slug(title: str) -> str:
    """The anchor MkDocs' ``toc`` gives a heading (its default ``slugify``)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def _config_index() -> str:
    sections = _config_sections()
    unplaced = _unplaced(sections)
    if unplaced:
        raise ValueError(f"sections on no page (add them to CONFIG_PAGES): {unplaced}")
    rows = ["| section | keys |", "|---|---:|"]
    for name, md in sections:
        page = next(p for p, tops in CONFIG_PAGES.items() if _top(name) in tops)
        keys = sum(1 for line in md.splitlines() if line.startswith("| `"))
        rows.append(f"| [`{name}`](config-{page}.md#{_slug(name)}) | {keys} |")
    return "\n".join(rows)


GENERATED: dict[str, Callable[[], str]] = {
    "config-reference": _config_index,
    "verl-keys": lambda: _call("rlwire.trainer.config.verl_keys", "alias_table"),
    "megatron-ddp-memory-table": lambda: _call("rlwire.megatron_ddp._table", "memory_table"),
}
"""Region name -> function returning its Markdown (``config-reference:PAGE`` aside)."""


def generate(name: str) -> str:
    """The Markdown that belongs between ``<!-- name -->`` and ``<!-- /name -->``."""
    if name.startswith("config-reference:"):
        text = _config_page(name.split(":", 1)[1])
    elif name in GENERATED:
        text = GENERATED[name]()
    else:
        raise ValueError(f"<!-- {name} -->: no generated table of that name")
    return text.strip("\n")


def regions(markdown: str) -> list[str]:
    """The names of the generated regions a page holds."""
    return [m.group("name") for m in _REGION.finditer(markdown) if _is_generated(m["name"])]


def _is_generated(name: str) -> bool:
    return name in GENERATED or name.startswith("config-reference:")


def render(markdown: str) -> str:
    """The page with every generated region as the code gives it now."""

    def fill(m: re.Match[str]) -> str:
        name = m["name"]
        if not _is_generated(name):
            return m[0]
        return f"<!-- {name} -->\n{generate(name)}\n<!-- /{name} -->"

    return _REGION.sub(fill, markdown)


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def stale() -> list[Path]:
    """The pages whose generated regions differ from the code's."""
    return [p for p in pages() if render(text := p.read_text()) != text]


def main(argv: list[str]) -> int:
    if argv not in (["--write"], ["--check"]):
        print("usage: python docs/hooks.py --write | --check", file=sys.stderr)
        return 2
    changed = stale()
    for page in changed:
        if argv == ["--write"]:
            page.write_text(render(page.read_text()))
            print(f"wrote {page.relative_to(DOCS.parent)}")
        else:
            print(f"{page.relative_to(DOCS.parent)}: stale; run {WRITE_COMMAND}")
    return 1 if changed and argv == ["--check"] else 0


# The MkDocs hooks: check, never rewrite. MkDocs is imported only here, so that the tests
# and the command above run without it.

_shown: set[str] = set()


def _fail(message: str) -> Exception:
    from mkdocs.exceptions import PluginError

    return PluginError(message)


def on_pre_build(config: Any) -> None:
    _shown.clear()  # `mkdocs serve` rebuilds in one process


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    try:
        current = render(markdown)
    except Exception as err:  # the build must say which table failed, not only why
        raise _fail(f"{page.file.src_path}: a generated table failed: {err!r}") from err
    if current != markdown:
        raise _fail(
            f"{page.file.src_path}: a generated table differs from the code; run {WRITE_COMMAND}"
        )
    _shown.update(regions(markdown))
    return markdown


def on_post_build(config: Any) -> None:
    wanted = set(GENERATED) | {f"config-reference:{page}" for page in CONFIG_PAGES}
    missing = sorted(wanted - _shown)
    if missing:
        raise _fail(f"generated tables no page shows (marker lines missing): {missing}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
