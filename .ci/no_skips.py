"""Fail a lane whose framework's tests did not run: `python .ci/no_skips.py JUNIT.xml...`.

A lane that installs a framework on purpose (vLLM, verl, TRL, the Agents SDK) runs its
marked tests with `--junitxml`; this reads the reports and exits 1, naming each test, when
nothing ran or when any test was skipped (an import that fails inside the lane's
environment skips a test that `importorskip`s it: green without testing). Exit 0 prints
the count. Standard library only: it runs with whichever interpreter the lane has.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(paths: list[str]) -> int:
    ran = 0
    skipped: list[str] = []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as exc:
            print(f"FAIL: no test report at {path}: {exc}")
            return 1
        for case in root.iter("testcase"):
            skip = case.find("skipped")
            if skip is None:
                ran += 1
                continue
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            skipped.append(f"{name}: {skip.get('message', '').strip()}")
    for line in skipped:
        print(f"FAIL: skipped in a lane that installed its framework: {line}")
    if ran == 0:
        print(f"FAIL: no test ran ({', '.join(paths)})")
    if skipped or ran == 0:
        return 1
    print(f"ok: {ran} tests ran, none skipped")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python .ci/no_skips.py JUNIT.xml...")
    sys.exit(main(sys.argv[1:]))
