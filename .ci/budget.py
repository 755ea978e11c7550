"""The default selection's time budget: `python .ci/budget.py JUNIT.xml [--each S] [--total S]
[--report-only]`.

Reads pytest's JUnit report of `uv run pytest` (CI's step 1) and lists every test whose
setup, call and teardown together took more than `--each` seconds (10), and the selection's
total against `--total` (150). Exit 1 when either is exceeded, unless `--report-only`:
then the same lines are printed as SHORT and the exit is 0 (how CI runs it while the suite
is still over its budget; CONTRIBUTING.md says by how much). Standard library only.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python .ci/budget.py")
    parser.add_argument("junit")
    parser.add_argument("--each", type=float, default=10.0, help="seconds a test may take")
    parser.add_argument("--total", type=float, default=150.0, help="seconds for all of them")
    parser.add_argument("--report-only", action="store_true", help="print, never fail")
    args = parser.parse_args(argv)
    try:
        root = ET.parse(args.junit).getroot()
    except (OSError, ET.ParseError) as exc:
        print(f"FAIL: no test report at {args.junit}: {exc}")
        return 1
    cases = [
        (f"{c.get('classname', '')}::{c.get('name', '')}", float(c.get("time") or 0.0))
        for c in root.iter("testcase")
    ]
    total = sum(seconds for _, seconds in cases)
    over = sorted(((s, n) for n, s in cases if s > args.each), reverse=True)
    word = "SHORT" if args.report_only else "FAIL"
    for seconds, name in over:
        print(f"{word}: {name} took {seconds:.1f} s (each test: at most {args.each:g} s)")
    if total > args.total:
        print(f"{word}: {len(cases)} tests took {total:.0f} s (at most {args.total:g} s)")
    else:
        print(f"ok: {len(cases)} tests took {total:.0f} s (at most {args.total:g} s)")
    return 0 if args.report_only or (not over and total <= args.total) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
