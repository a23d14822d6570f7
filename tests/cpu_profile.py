"""CPU seconds per test module: what a module costs on a shared machine, where wall seconds depend on what else
runs. The suite's wall time on 2 cores is about its CPU seconds over 2, so this is the figure to cut.

    .venv/bin/python -m pytest -q -n 2 -p tests.cpu_profile            # writes /tmp/rlfabric-cpu/<worker>.jsonl
    .venv/bin/python -m tests.cpu_profile /tmp/rlfabric-cpu              # the modules, most CPU first

A test's CPU is its own process's plus that of the processes it started and reaped (getrusage's CHILDREN, which
holds grandchildren their parents reaped); a daemon nobody reaps (Ray's raylet) is not counted. A module's fixtures
are torn down in its last test's teardown, so its sum holds its boots and shutdowns.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

OUT = Path(os.environ.get("RLFABRIC_CPU_PROFILE", "/tmp/rlfabric-cpu"))


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, (own, children) = time.monotonic(), _cpu()
    yield
    own_after, children_after = _cpu()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"{worker}.jsonl", "a") as out:
        out.write(json.dumps({"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
                              "own_cpu_s": round(own_after - own, 2),
                              "children_cpu_s": round(children_after - children, 2)}) + "\n")


def modules(folder: Path) -> dict[str, dict[str, float]]:
    """Wall and CPU seconds per module, summed over the folder's records."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            module = totals[record["test"].split("::")[0]]
            module["wall_s"] += record["wall_s"]
            module["cpu_s"] += record["own_cpu_s"] + record["children_cpu_s"]
    return totals


def main(folder: str = str(OUT), top: str = "60") -> None:
    totals = modules(Path(folder))
    ranked = sorted(totals.items(), key=lambda kv: -kv[1]["cpu_s"])
    for module, seconds in ranked[: int(top)]:
        print(f"{seconds['cpu_s']:8.1f} cpu  {seconds['wall_s']:7.1f} wall  {module}")
    print(f"{sum(s['cpu_s'] for s in totals.values()):8.1f} cpu  "
          f"{sum(s['wall_s'] for s in totals.values()):7.1f} wall  all {len(totals)} modules")


if __name__ == "__main__":
    main(*sys.argv[1:])
