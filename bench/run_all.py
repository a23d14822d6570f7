"""`make bench`: runs every benchmark module in turn (each writes bench/results/<name>.json).

    python -m bench.run_all              # all of them
    python -m bench.run_all scale load   # bench/scale_bench.py and bench/load_bench.py (make bench BENCH="scale load")
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time

import bench


def main() -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.endswith("_bench"))
    wanted = [f"{name}_bench" for name in sys.argv[1:]]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise SystemExit(f"no benchmark {', '.join(unknown)} in bench/ (there are: "
                         f"{', '.join(name.removesuffix('_bench') for name in names)})")
    for name in wanted or names:
        print(f"== bench.{name}", flush=True)
        start = time.perf_counter()
        sys.argv = [f"bench.{name}"]  # each parses its own options: the defaults here
        importlib.import_module(f"bench.{name}").main()
        print(f"== bench.{name} done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
