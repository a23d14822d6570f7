"""Worker process of CustomScorerPool: loads one user function and scores the items it is sent.

Started by the pool as ``python -m rlfabric.reward.custom_worker SETTINGS_JSON``, never by hand.
Protocol on stdin/stdout, one JSON object per line:
  worker -> pool, once:   {"type": "ready"} or {"type": "load_error", "message": ...}
  pool -> worker:         {"data_source", "solution_str", "ground_truth", "extra_info"}
  worker -> pool, per item: {"type": "result", "value": float | {str: float}}
                            or {"type": "error", "message": ..., "recycle": bool}
What the user's function returns is turned into floats here, so the pool only ever parses JSON.
"""

from __future__ import annotations

import importlib.util
import json
import numbers
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rlfabric.reward.items import describe_exception


def load_function(path: str, name: str) -> Callable[..., Any]:
    """Import the Python file at path as a module and return its attribute name."""
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.append(directory)  # let the file import its neighbours (appended: never shadows stdlib)
    spec = importlib.util.spec_from_file_location("custom_reward_module", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise AttributeError(f"{path!r} has no function {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in {path!r} is a {type(fn).__name__}, not a function")
    return fn


def to_plain(value: Any) -> float | dict[str, float]:
    """A float, or a dict of the numeric entries (the "score" entry required), from a user's result."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"the result dict has no 'score' key (keys: {sorted(map(str, value))})")
        plain = {str(key): float(item) for key, item in value.items() if isinstance(item, numbers.Real)}
        plain["score"] = _to_float(value["score"])
        return plain
    if isinstance(value, (list, tuple)) and value:
        value = value[0]  # VeRL takes res[0] of a sequence
    return _to_float(value)


def _to_float(value: Any) -> float:
    # numbers, numpy scalars and one-element tensors; not strings
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"the score is a {type(value).__name__}, not a number")
    return float(value)


def _exit_when_orphaned(parent_pid: int) -> None:
    # A worker stuck in a user's loop never reads the EOF a dead pool leaves; this thread still runs.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def main(settings_json: str) -> int:
    settings = json.loads(settings_json)

    # 1. Keep the protocol pipes on private descriptors: what the user prints goes to stderr,
    #    and a user read of stdin sees an empty file.
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)

    def send(message: dict) -> None:
        replies.write(json.dumps(message).encode() + b"\n")
        replies.flush()

    threading.Thread(target=_exit_when_orphaned, args=(settings["parent_pid"],), daemon=True).start()

    # 2. Cap the address space before any user code runs: a hog gets MemoryError, not the host's OOM killer.
    if settings["memory_limit_mb"]:
        limit = settings["memory_limit_mb"] * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # hard too: user code cannot raise it back

    # 3. Load the user's function.
    try:
        fn = load_function(settings["path"], settings["name"])
    except Exception as exc:
        send({"type": "load_error", "message": describe_exception(exc)})
        return 1
    send({"type": "ready"})
    kwargs = settings["function_kwargs"]

    # 4. Score items until the pool closes the pipe.
    for line in requests:
        item = json.loads(line)
        try:
            value = fn(
                item["data_source"], item["solution_str"], item["ground_truth"], item["extra_info"], **kwargs
            )
            reply = {"type": "result", "value": to_plain(value)}
        except Exception as exc:  # MemoryError included
            # After a MemoryError the pool replaces this worker rather than trust its heap.
            reply = {
                "type": "error",
                "message": describe_exception(exc),
                "recycle": isinstance(exc, MemoryError),
            }
        # Sent after the except block, so the traceback and the user's locals are freed by now.
        send(reply)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
