"""Per-module wall time of a test run, from pytest's JUnit XML (setup + call + teardown of each test).

bash scripts/test.sh --junitxml=/tmp/run.xml
python scripts/suite_times.py /tmp/run.xml            # a Markdown table, slowest module first
python scripts/suite_times.py /tmp/run.xml --json     # the same rows as JSON
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
    args = parser.parse_args(argv)
    rows = module_times(args.junit_xml)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print("| module | tests | s |\n|---|---|---|")
    for r in rows:
        bad = {k: r[k] for k in ("failure", "error", "skipped") if r.get(k)}
        print(f"| {r['module']} | {r['tests']}{' ' + str(bad) if bad else ''} | {r['seconds']:.0f} |")
    print(f"| all | {sum(r['tests'] for r in rows)} | {sum(r['seconds'] for r in rows):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
