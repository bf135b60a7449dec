"""Per-module wall time of a test run, from pytest's JUnit XML (setup + call + teardown of each test).

The test command (scripts/test.sh) writes its JUnit XML under the run's temp dir and prints this table at its end.

python scripts/suite_times.py RUN.xml                 # a Markdown table, slowest module first (--top N: the first N)
python scripts/suite_times.py RUN.xml --json          # the same rows as JSON
python scripts/suite_times.py RUN.xml --order tests/module_order.json   # the order the next runs start modules in
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def module_times(path: str) -> list[dict]:
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "?").replace(".", "/") + ".py"
        seconds[module] += float(case.get("time") or 0)
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        counts[module][outcome] += 1
    rows = [
        {"module": m, "seconds": round(s, 1), "tests": sum(counts[m].values()), **dict(counts[m])}
        for m, s in seconds.items()
    ]
    return sorted(rows, key=lambda r: -r["seconds"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit_xml")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--top", type=int, default=0, help="only the N slowest modules in the table")
    parser.add_argument("--order", help="write the modules, slowest first, to this JSON file (tests/conftest.py)")
    args = parser.parse_args(argv)
    rows = module_times(args.junit_xml)
    if args.order:
        names = [r["module"].removeprefix("tests/").removesuffix(".py") for r in rows]
        source = f"scripts/suite_times.py --order, from {args.junit_xml} (a fresh-clone run's JUnit XML)"
        with open(args.order, "w") as f:
            json.dump({"source": source, "slowest_first": names}, f, indent=1)
            f.write("\n")
        return 0
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print("| module | tests | s |\n|---|---|---|")
    for r in rows[: args.top or None]:
        bad = {k: r[k] for k in ("failure", "error", "skipped") if r.get(k)}
        print(f"| {r['module']} | {r['tests']}{' ' + str(bad) if bad else ''} | {r['seconds']:.0f} |")
    print(f"| all | {sum(r['tests'] for r in rows)} | {sum(r['seconds'] for r in rows):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
