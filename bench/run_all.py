"""`make bench`: runs every benchmark module in turn (each writes bench/results/<name>.json)."""

from __future__ import annotations

import importlib
import pkgutil
import time

import bench


def main() -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.endswith("_bench"))
    for name in names:
        print(f"== bench.{name}", flush=True)
        start = time.perf_counter()
        importlib.import_module(f"bench.{name}").main()
        print(f"== bench.{name} done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
