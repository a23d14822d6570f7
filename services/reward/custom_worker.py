"""Worker process of CustomScorerPool: loads one user function and scores the items it is sent.

Started by the pool as ``python -m rlfabric.reward.custom_worker SETTINGS_JSON``, never by hand.
The process splits in two (one fork, no second interpreter):
- the supervisor, the process the pool started, runs no user code. On Linux it is a child
  subreaper (prctl PR_SET_CHILD_SUBREAPER): every process the user's code starts stays its
  descendant, even one that calls setsid() or double-forks into a daemon, where it would otherwise
  be reparented to init. When the scorer ends it kills every descendant left, reaps them and exits
  as the scorer did (same exit code or signal); when the pool's process dies, it does the same.
- the scorer, its child, loads the function and talks to the pool over the inherited pipes.
So the pool kills a worker by killing every descendant of the supervisor (kill_descendants), which
reaches whatever the user's code started, whatever session or process group it moved to.
Without PR_SET_CHILD_SUBREAPER (not Linux) a process that leaves the tree (its parent exits) escapes.

Protocol on stdin/stdout, one JSON object per line:
  worker -> pool, once:   {"type": "ready"} or {"type": "load_error", "message": ...}
  pool -> worker:         {"data_source", "solution_str", "ground_truth", "extra_info"}
  worker -> pool, per item: {"type": "result", "value": float | {str: float}}
                            or {"type": "error", "message": ..., "recycle": bool}
What the user's function returns is turned into floats here, so the pool only ever parses JSON.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import numbers
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rlfabric.reward.items import describe_exception
from rlfabric.reward.process_tree import kill_descendants, set_child_subreaper


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


def _exit_when_orphaned(parent_pid: int, cleanup: Callable[[], object] | None = None) -> None:
    # A process stuck in a user's loop never reads the EOF a dead parent leaves; this thread still runs.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            if cleanup is not None:
                cleanup()
            os._exit(1)


def main(settings_json: str) -> int:
    settings = json.loads(settings_json)
    set_child_subreaper()
    supervisor = os.getpid()
    scorer = os.fork()
    if scorer == 0:
        return score_items(settings, supervisor)
    return supervise(scorer, settings["parent_pid"])


def supervise(scorer: int, pool_pid: int) -> int:
    """The supervisor's part: wait for the scorer, kill and reap whatever it left, end as it ended."""
    # The protocol pipes are the scorer's: without our copies, the pool sees EOF when it dies.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    me = os.getpid()
    threading.Thread(
        target=_exit_when_orphaned, args=(pool_pid, lambda: kill_descendants(me)), daemon=True
    ).start()
    while True:  # reaping the orphans that land here meanwhile
        pid, status = os.waitpid(-1, 0)
        if pid == scorer:
            break
    kill_descendants(me)
    with contextlib.suppress(ChildProcessError):
        while True:  # every descendant is dead: each zombie comes to us once its parent is reaped
            os.waitpid(-1, 0)
    sys.stderr.flush()
    if os.WIFSIGNALED(status):  # die of the same signal, so the pool can say how the scorer ended
        number = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of the supervisor
        with contextlib.suppress(OSError, ValueError):  # (SIGKILL's cannot be set, nor needs to be)
            signal.signal(number, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            signal.raise_signal(number)
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(status))


def score_items(settings: dict, supervisor_pid: int) -> int:
    """The scorer's part: load the user's function and score items until the pool closes the pipe."""
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

    threading.Thread(target=_exit_when_orphaned, args=(supervisor_pid,), daemon=True).start()

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
