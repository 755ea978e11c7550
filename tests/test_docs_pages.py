"""The documentation's pages as a reader gets them on GitHub: the generated tables equal the
code's, no page is too long to read there, history (commit hashes, issue numbers) stays on
the Results pages, and the tested versions are the ones the lock and the floors pin."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_BYTES = 15 * 1024

# What a reader reads: the site's pages and the repository's own pages.
SITE_PAGES = sorted(DOCS.rglob("*.md"))
RESULTS = DOCS / "results"
USER_PAGES = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted(ROOT.glob("packages/*/README.md")),
    *SITE_PAGES,
]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_equal_what_the_code_gives():
    """Each table between ``<!-- NAME -->`` and ``<!-- /NAME -->`` is what the function
    docs/hooks.py calls for it returns now, and every generated table is on some page."""
    hooks = _hooks()
    stale = [_name(p) for p in SITE_PAGES if hooks.render(p.read_text()) != p.read_text()]
    assert not stale, (
        f"generated tables differ from the code in {stale}: run `{hooks.WRITE_COMMAND}` "
        "and commit the pages it rewrites"
    )
    shown = {name for p in SITE_PAGES for name in hooks.regions(p.read_text())}
    wanted = set(hooks.GENERATED) | {f"config-reference:{p}" for p in hooks.CONFIG_PAGES}
    assert shown == wanted, f"no page shows {sorted(wanted - shown)}"


def test_the_configuration_reference_shows_every_section_once():
    hooks = _hooks()
    pages = [p for p in SITE_PAGES if p.parent.name == "reference"]
    text = "\n".join(p.read_text() for p in pages)
    for section, _ in hooks._config_sections():
        assert text.count(f"### `{section}`\n") == 1, section


def test_every_page_fits_on_a_screenful_of_scrolling():
    """No page a reader opens is over 15 KB (15,360 bytes): split it by topic instead."""
    over = {
        _name(p): p.stat().st_size
        for p in [ROOT / "README.md", *SITE_PAGES]
        if p.stat().st_size > MAX_BYTES
    }
    assert not over, f"pages over {MAX_BYTES} bytes (split them by topic): {over}"


HISTORY = [
    (re.compile(r"\b(?:issues?|PR|pull request)\s+#?\d+", re.I), "an issue or PR number"),
    (re.compile(r"(?<![\w&#/])#\d{1,6}\b"), "an issue number"),
    (re.compile(r"\bcommit\s+`?[0-9a-f]{7,40}\b", re.I), "a commit hash"),
    # an all-digit short hash where a commit is named by position ("slower than at 6525753")
    (re.compile(r"\b(?:at|of|before|after)\s+`?\d{7}\b(?![,.]\d)"), "a commit hash"),
    (re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"), "a commit hash"),
]


def _history(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in HISTORY:
            for match in pattern.finditer(line):
                found.append(f"{number}: {what}: {match.group(0)!r}")
    return found


@pytest.mark.parametrize("page", [p for p in USER_PAGES if RESULTS not in p.parents], ids=_name)
def test_pages_read_as_reference_not_history(page):
    """Commit hashes and issue numbers belong with a measurement's conditions, on the
    Results pages (docs/results/); elsewhere say what is true now."""
    found = _history(page.read_text())
    assert not found, f"{_name(page)}: {found}"


def test_the_history_check_finds_what_it_should():
    assert _history("at commit 6525753, and a59cd45") and _history("issue 61's target")
    assert _history("every mode is slower than at 6525753")
    assert _history("see #57") and _history("vLLM's PR 40096")
    assert not _history("seed 1000003, `#### 42`, [verl](verl.md#verls-keys), 100,000 inputs")


# Tested versions: docs/reference/versions.md against uv.lock, .ci/floors.txt and the
# packages' pyproject.toml.

VERSIONS = DOCS / "reference" / "versions.md"


def _version_rows() -> list[list[str]]:
    """The cells of the first table on the versions page, header and rule left out."""
    rows, in_table = [], False
    for line in VERSIONS.read_text().splitlines():
        if line.startswith("|"):
            in_table = True
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif in_table:
            break
    assert rows[0][:3] == ["package", "workspace (`uv.lock`)", "floor leg (`.ci/floors.txt`)"]
    return rows[2:]


def _workspace_lock() -> dict[str, set[str]]:
    """Each package's versions in uv.lock for the workspace's Python (3.11): one, but for a
    few platform-specific wheels."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    found: dict[str, set[str]] = {}
    for package in lock["package"]:
        markers = package.get("resolution-markers")
        if markers is None or any("python_full_version < '3.12'" in m for m in markers):
            name = canonicalize_name(package["name"])
            found.setdefault(name, set()).add(package["version"])
    return found


def _floors() -> dict[str, str]:
    floors = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            floors[canonicalize_name(name)] = version
    return floors


def _declared() -> dict[str, set[str]]:
    """Every specifier the packages declare for a dependency, extras included."""
    declared: dict[str, set[str]] = {}
    for path in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(path.read_text())["project"]
        wanted = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            wanted.extend(extra)
        for text in wanted:
            requirement = Requirement(text)
            if str(requirement.specifier):
                name = canonicalize_name(requirement.name)
                declared.setdefault(name, set()).add(str(requirement.specifier))
    return declared


def _package(cell: str) -> str:
    return canonicalize_name(cell.split()[0].strip("`"))


def test_the_tested_versions_page_states_what_the_lock_pins():
    lock = _workspace_lock()
    for cells in _version_rows():
        name, workspace = _package(cells[0]), cells[1]
        if workspace:
            assert lock.get(name) == {workspace}, (
                f"docs/reference/versions.md says {name} {workspace} for the workspace; "
                f"uv.lock holds {lock.get(name)}"
            )
    for name in ("torch", "transformers"):
        assert name in {_package(cells[0]) for cells in _version_rows()}, name


def test_the_tested_versions_page_states_the_floors_ci_tests():
    floors, rows = _floors(), _version_rows()
    stated = {_package(cells[0]): cells[2] for cells in rows if cells[2]}
    assert stated == floors, (
        "docs/reference/versions.md's floor column differs from .ci/floors.txt: "
        f"page {stated}, floors.txt {floors}"
    )


def test_the_tested_versions_page_states_the_declared_floors():
    declared = _declared()
    for cells in _version_rows():
        name, claim = _package(cells[0]), cells[3]
        if not claim:
            continue
        specifier = re.match(r"`(>=[\w.]+)`", claim)
        assert specifier, claim
        assert declared.get(name) == {specifier[1]}, (
            f"docs/reference/versions.md says {name} {specifier[1]}; the packages' "
            f"pyproject.toml declare {declared.get(name)}"
        )
    for name in ("torch", "transformers", "peft", "ray", "megatron-core"):
        floor = _floors()[name]
        (spec,) = declared[name]
        assert Version(floor) == Version(spec.removeprefix(">=")), (
            f"{name}: the floor leg tests {floor}, the packages declare {spec}"
        )
