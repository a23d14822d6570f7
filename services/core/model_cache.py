"""The machine's model cache: model directories that are built once and then reused.

    ~/.cache/rlfabric/models/NAME     (RLFABRIC_CACHE, else $XDG_CACHE_HOME/rlfabric, moves it)

`built_once(name, build)` returns NAME's directory, calling `build(directory)` the first time. Concurrent
callers (several services or runs starting together) wait on a file lock; a build that was interrupted
leaves only a `.NAME.building` directory, which the next build replaces. A directory counts as built when
it holds DONE_MARKER, written last. Only what lives under the cache is ever removed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("rlfabric.models")

DONE_MARKER = ".rlfabric-model.json"  # written last: a directory without it is incomplete


def cache_root() -> Path:
    root = os.environ.get("RLFABRIC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlfabric"
    return Path(root) / "models"


def is_built(directory: Path) -> bool:
    return (directory / DONE_MARKER).exists()


def built_once(name: str, build: Callable[[Path], object], about: dict | None = None) -> Path:
    """NAME's directory in the machine's cache, built by `build(directory)` on first use; `about` is written
    into its DONE_MARKER (what it is, where it came from)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if not is_built(target):
            shutil.rmtree(target, ignore_errors=True)  # an interrupted earlier build
            building = root / f".{name}.building"
            shutil.rmtree(building, ignore_errors=True)
            started = time.monotonic()
            print(f"rlfabric: building {name} into {target} (once per machine)", file=sys.stderr, flush=True)
            build(building)
            (building / DONE_MARKER).write_text(json.dumps({"name": name, **(about or {})}))
            building.rename(target)
            log.info("built %s in %.0f s", name, time.monotonic() - started)
    return target.resolve()
