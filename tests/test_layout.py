"""Workspace invariants every package must keep (see CONTRIBUTING.md "Layout")."""

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
# ... except inside a plug-in named after the framework it plugs into, which that framework
# loads through its entry point (rlwire.ckpt_engine.vllm: vLLM's weight-transfer engines) and
# which nothing else in the library imports.
PLUGINS = {"vllm"}


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


def _module_imports(pkg: Path, source: Path) -> set[str]:
    """Every module ``source`` imports, relative imports made absolute."""
    parts = source.relative_to(pkg / "src").with_suffix("").parts  # ("rlwire", name, ...)
    package = parts[:-1]  # a module's package; an __init__'s is its own
    names = _imports(source)
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - node.level + 1]
            names.add(".".join([*base, *([node.module] if node.module else [])]))
    return names


@pytest.mark.parametrize("pkg", LIBRARIES, ids=lambda p: p.name)
def test_libraries_do_not_import_sideways_or_the_trainer_stack(pkg: Path):
    root = pkg / "src" / "rlwire" / pkg.name
    for source in (pkg / "src").rglob("*.py"):
        inner = source.relative_to(root).parts
        plugin = inner[0] if len(inner) > 1 and inner[0] in PLUGINS else None
        for name in _module_imports(pkg, source):
            top = name.split(".")[0]
            assert top not in FORBIDDEN_IN_LIBRARIES or top == plugin, f"{source}: imports {name}"
            if top == "rlwire":
                assert name.split(".")[1] == pkg.name, f"{source}: imports sibling {name}"
                # the library itself never reaches into a plug-in (it would need the framework)
                reached = name.split(".")[2] if name.count(".") >= 2 else None
                assert plugin is not None or reached not in PLUGINS, f"{source}: imports {name}"


# The trainer by role, bottom to top: a module may import (at run time) its own group and
# the groups below it, never one above (type-only imports under TYPE_CHECKING excepted).
TRAINER = ROOT / "packages" / "trainer"
TRAINER_LAYERS = [
    {"errors", "checks", "plugins"},  # the foundation: root modules everything uses
    {"models"},
    {"rollout"},
    {"agent"},
    {"algorithms"},
    {"actor"},
    {"data"},
    {"outputs"},
    {"config"},
    {"runtime"},
    {"modes"},
    {"driver", "cli", "api", "__init__"},  # the entry points
    {"tools", "bench"},  # bench: the `python -m rlwire.trainer.bench` entry of tools.bench
]
TRAINER_SUBPACKAGES = {
    "models", "rollout", "agent", "algorithms", "actor", "data", "outputs", "config",
    "runtime", "modes", "tools",
}  # fmt: skip


def _layer(group: str) -> int:
    return next(i for i, names in enumerate(TRAINER_LAYERS) if group in names)


def _runtime_import_nodes(tree: ast.AST) -> list[ast.AST]:
    """Import nodes outside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skipped
    ]


def _trainer_group(parts: tuple[str, ...]) -> str:
    """The group of rlwire.trainer.<parts...>: its subpackage, or the root module's name."""
    return parts[0] if parts else "__init__"


def test_the_trainer_is_grouped_by_role_and_imports_point_down():
    root = TRAINER / "src" / "rlwire" / "trainer"
    found = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    assert found == TRAINER_SUBPACKAGES
    for name in TRAINER_SUBPACKAGES:  # each says what lives there and what it may import
        doc = ast.get_docstring(ast.parse((root / name / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), f"{name}/__init__.py: say what it may import"
    top = {p.stem for p in root.glob("*.py")}
    assert len(top) <= 8, f"at most 8 top-level modules in the trainer, found {sorted(top)}"
    modules = top | TRAINER_SUBPACKAGES
    assert modules <= set().union(*TRAINER_LAYERS), modules - set().union(*TRAINER_LAYERS)
    wrong = []
    for source in root.rglob("*.py"):
        inner = source.relative_to(root).with_suffix("").parts
        group = _trainer_group(inner if len(inner) > 1 else inner[:1])
        package = ("rlwire", "trainer", *inner[:-1])
        for node in _runtime_import_nodes(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = package[: len(package) - node.level + 1]
                names = [".".join([*base, *([node.module] if node.module else [])])]
                if node.module is None:
                    names = [f"{names[0]}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                names = [a.name for a in node.names]
            for name in names:
                parts = tuple(name.split("."))
                if parts[:2] != ("rlwire", "trainer"):
                    continue
                target = _trainer_group(parts[2:])
                if _layer(target) > _layer(group):
                    wrong.append(f"{source.relative_to(root)} ({group}) imports {name}")
    assert not wrong, "\n".join(wrong)


def _module_graph(root: Path) -> dict[str, set[str]]:
    """rlwire.trainer's modules -> the trainer modules each imports at module level, those
    under ``if TYPE_CHECKING:`` included (a name imported from a package is that package's
    ``__init__`` unless it is a submodule). Imports inside functions are left out: they
    run after every module loaded."""
    modules: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()

        def visit(body: list[ast.stmt], package=package, deps=deps) -> None:
            for node in body:
                if isinstance(node, ast.If):
                    visit(node.body)
                    visit(node.orelse)
                elif isinstance(node, ast.ImportFrom):
                    base = package[: len(package) - node.level + 1] if node.level else []
                    module = ".".join([*base, *([node.module] if node.module else [])])
                    for alias in node.names:
                        sub = f"{module}.{alias.name}"
                        deps.add(sub if sub in modules else module)
                elif isinstance(node, ast.Import):
                    deps.update(alias.name for alias in node.names)

        visit(ast.parse(path.read_text(), str(path)).body)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_no_import_circle_in_the_trainer():
    """Not even a type-only one: each module's imports can be read without coming back to
    it (issue 62 cut config.root -> config.sections -> data.dataset -> config.root and
    runtime.healing <-> runtime.job)."""
    graph = _module_graph(TRAINER / "src" / "rlwire" / "trainer")
    circles, done = [], set()

    def walk(node: str, path: list[str]) -> None:
        for dep in sorted(graph[node]):
            if dep in path:
                circles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in done:
                walk(dep, [*path, dep])
        done.add(node)

    for module in sorted(graph):
        if module not in done:
            walk(module, [module])
    assert graph["rlwire.trainer.config.sections"]  # the graph was read
    assert not circles, "\n".join(sorted(set(circles)))
