"""How long each test module takes in `make test`, for the order its workers take them in (tests/conftest.py:
longest first). tests/durations.json holds the seconds of one full run; a module it does not know yet counts as
UNKNOWN_S, between the long and the many short ones. Refresh it from a run's JUnit report:

    make test PYTEST=".venv/bin/python -m pytest -q -n 2 --junitxml=/tmp/junit.xml"
    .venv/bin/python -m tests.durations /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_S = 20.0


def unit_seconds(modules: set[str], shared: dict[str, str]) -> dict[str, float]:
    """Seconds of each unit of work: a module, or the modules that share a worker (summed under their name)."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    units: dict[str, float] = defaultdict(float)
    for module in modules:
        units[shared.get(module, module)] += known.get(module, UNKNOWN_S)
    return units


def module_seconds(junit_xml: Path) -> dict[str, float]:
    """Seconds per test module in a JUnit report (its test cases' times, setup and teardown included)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        parts = case.get("classname", "").split(".")
        if parts[-1][:1].isupper():  # a test class's name ends the class name
            parts = parts[:-1]
        seconds["/".join(parts) + ".py"] += float(case.get("time", 0))
    return seconds


def main(junit_xml: str) -> None:
    seconds = module_seconds(Path(junit_xml))
    DURATIONS.write_text(json.dumps({m: round(s, 1) for m, s in sorted(seconds.items(), key=lambda kv: -kv[1])},
                                    indent=1) + "\n")
    print(f"{DURATIONS}: {len(seconds)} modules, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main(*sys.argv[1:])
