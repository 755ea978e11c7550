"""Workspace invariants every package must keep (see README "Layout")."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
LIBRARIES = [p for p in PACKAGES if p.name != "trainer"]
# What a library may never import: it must stay usable without the trainer stack.
FORBIDDEN_IN_LIBRARIES = {"ray", "vllm"}


def _pyproject(pkg: Path) -> dict:
    return tomllib.loads((pkg / "pyproject.toml").read_text())


def test_there_are_packages():
    assert PACKAGES, "no package under packages/"


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_package_layout(pkg: Path):
    name = pkg.name
    project = _pyproject(pkg)["project"]
    assert project["name"] == "rlwire-" + name.replace("_", "-")
    src = pkg / "src" / "rlwire"
    assert not (src / "__init__.py").exists(), "rlwire must stay a namespace package"
    assert (src / name / "__init__.py").exists()
    assert (src / name / "py.typed").exists()
    assert (pkg / "README.md").exists()
    assert list((pkg / "tests").glob("test_*.py")), f"{name} has no tests"
    # Test files are collected together in one run: their names must be unique.
    for test_file in (pkg / "tests").glob("test_*.py"):
        assert test_file.name.startswith(f"test_{name}"), test_file.name


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_package_is_a_workspace_member(pkg: Path):
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert f"packages/{pkg.name}" in root["tool"]["uv"]["workspace"]["members"]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("pkg", LIBRARIES, ids=lambda p: p.name)
def test_libraries_do_not_import_sideways_or_the_trainer_stack(pkg: Path):
    for source in (pkg / "src").rglob("*.py"):
        for name in _imports(source):
            top = name.split(".")[0]
            assert top not in FORBIDDEN_IN_LIBRARIES, f"{source}: imports {name}"
            if top == "rlwire":
                assert name.split(".")[1] == pkg.name, f"{source}: imports sibling {name}"
