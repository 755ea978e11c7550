"""Run inside a package's isolated environment: the package imports from the
installed wheel, and no rlwire package is importable beyond it and its declared
rlwire dependencies.

Usage: python check_isolated.py <package-dir-name>   (e.g. grad_sync)
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import pkgutil
import re
import sys
import sysconfig
from pathlib import Path


def rlwire_closure(dist: str) -> set[str]:
    """Import names of `dist` and every rlwire distribution it requires, transitively
    (its `test` extra included: CI installs the wheel with `[test]`)."""
    seen: set[str] = set()
    todo = [dist]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in md.requires(name) or []:
            if "extra ==" in req and not re.search(r"extra\s*==\s*['\"]test['\"]", req):
                continue
            dep = re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0].lower().replace("_", "-")
            if dep.startswith("rlwire-"):
                todo.append(dep)
    return {n.removeprefix("rlwire-").replace("-", "_") for n in seen}


def main() -> int:
    pkg = sys.argv[1]
    dist = "rlwire-" + pkg.replace("_", "-")
    module = importlib.import_module(f"rlwire.{pkg}")
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(module.__file__).resolve()
    if site not in where.parents:
        print(f"FAIL: rlwire.{pkg} imported from {where}, not from the installed wheel in {site}")
        return 1
    if not (where.parent / "py.typed").exists():
        print(f"FAIL: rlwire.{pkg} wheel lacks py.typed")
        return 1
    import rlwire

    if getattr(rlwire, "__file__", None) is not None:
        print(f"FAIL: rlwire is not a namespace package (it has {rlwire.__file__})")
        return 1
    present = {m.name for m in pkgutil.iter_modules(rlwire.__path__)}
    allowed = rlwire_closure(dist)
    extra = present - allowed
    if extra:
        print(f"FAIL: {dist} alone, yet rlwire.{{{', '.join(sorted(extra))}}} importable too")
        return 1
    print(f"ok: {dist} {md.version(dist)} alone; rlwire packages present: {sorted(present)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
