"""User reward functions, run in a pool of worker processes with a per-item timeout and a memory cap.

The config names a Python file and a function in it with VeRL's custom_reward_function signature:

    def compute_score(data_source, solution_str, ground_truth, extra_info, **function_kwargs) -> float | dict

A dict's "score" is the reward; its other numeric entries become metrics. With signature="trl" the
function is TRL's kind instead, fn(prompts, completions, **columns) -> list[float] (see
rlfabric.reward.signatures), called through the same workers and sandbox. The function never runs in
the caller's process. An item whose function raises (MemoryError included) gets status "error", one
that runs past timeout_s gets "timeout", one whose worker dies (segfault, os._exit) gets "crashed";
each scores 0, and a hung or dead worker (or one that hit MemoryError, or whose processes together
went past memory_limit_mb: "error" saying so) is killed and replaced, so the next item and batch go
on. Every process the function started is killed and reaped when its item ends, and killing a worker
kills them too, whatever session or process group they moved to (setsid, a double-forked daemon):
see custom_worker.

The function is confined (rlfabric.sandbox.confine, settings in reward.custom_sandbox; docs/sandbox.md):
as root, no network, a uid of the worker's own, an empty environment plus what the config lists,
limits on processes, memory (all its processes together), file size, descriptors and CPU time; its
keyword arguments reach it over a pipe, not the command line, and only its worker's supervisor, which
runs no user code, writes results to the pool.
What cannot be done here (not root, no network namespace, no cgroup) is logged once as a warning.

    with CustomScorerPool("my_reward.py", "compute_score", num_workers=2, timeout_s=5) as pool:
        results = pool.score_batch(items)
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlfabric.reward.items import (
    STATUS_CRASHED,
    STATUS_ERROR,
    STATUS_TIMEOUT,
    ItemResult,
    ScoreItem,
    failed,
    json_default,
    result_from_value,
)
from rlfabric.reward.signatures import SIGNATURES
from rlfabric.sandbox.confine import user_variables, worker_environment
from rlfabric.sandbox.process_tree import end_supervisor

if TYPE_CHECKING:  # (not at run time: each worker imports this package, and pydantic costs it ~0.3 s)
    from rlfabric.core.config import CustomSandboxConfig

logger = logging.getLogger(__name__)

# The supervisor reaps what was killed and exits as its scorer did; this is how long to wait for that.
_SUPERVISOR_EXIT_S = 2.0

# Why not concurrent.futures.ProcessPoolExecutor or multiprocessing.Pool: neither can kill one hung
# task (a worker in an infinite loop is stuck there for good), a dead worker breaks the whole
# executor, and both unpickle in this process whatever the user's code returned. Instead each worker
# is a fresh interpreter (spawn semantics: nothing of this process, its threads or its CUDA state is
# forked) running rlfabric.reward.custom_worker, one item at a time, JSON lines over its stdin/stdout
# pipes; so a hung or dead worker is killed (its whole process tree) and only it is replaced, and
# start-up costs one interpreter plus this package (~0.1 s), paid once per worker, not per batch.
# A worker is a supervisor (the process started here, a child subreaper running no user code) and
# its forked scorer; killing every descendant of the supervisor reaches all the user's processes.

_STARTING = "starting"  # process started, function not loaded yet
_IDLE = "idle"
_BUSY = "busy"  # scoring item `item`, must answer by `deadline`
_FAILED = "failed"  # could not load the function; retried at the next batch
_DEAD = "dead"  # killed and reaped


class CustomFunctionLoadError(RuntimeError):
    """A worker could not load the user's function (missing name, import error, crash on import)."""


class _Worker:
    """One worker process and what the pool knows about it."""

    def __init__(self, proc: subprocess.Popen, deadline: float):
        self.proc = proc
        self.state = _STARTING
        self.item = -1
        self.deadline = deadline
        self.load_error = ""
        self._buffer = b""

    def send(self, data: bytes) -> bool:
        """Write one request; False if the process is gone.

        A blocking write is safe: only idle workers are sent to, and an idle worker is reading.
        """
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:  # BrokenPipeError: the process died while idle
            return False
        return True

    def read_messages(self) -> list[dict] | None:
        """The messages completed by the bytes now readable; None once the process closed its end."""
        data = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not data:
            return None
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        return [json.loads(line) for line in lines]

    @property
    def reaped(self) -> bool:
        return self.proc.returncode is not None

    def kill(self) -> str:
        """Kill the worker and everything it started, reap it, and say how its scorer ended."""
        # Every descendant of the supervisor (a child subreaper): the scorer and whatever the user's
        # code started, in whatever session or process group. The supervisor then reaps them and
        # exits as the scorer did (SIGKILL here, or the scorer's own exit code or signal if it died first).
        returncode = end_supervisor(self.proc, _SUPERVISOR_EXIT_S)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.state = _DEAD
        if returncode < 0:
            try:
                return f"was killed by signal {signal.Signals(-returncode).name}"
            except ValueError:
                return f"was killed by signal {-returncode}"
        return f"exited with code {returncode}"


def check_custom_file(path: str) -> None:
    """FileNotFoundError unless the custom function's file (reward.custom_path) is a file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom reward file not found: {path!r}")


class CustomScorerPool:
    """Scores items with a user's function in num_workers persistent worker processes."""

    def __init__(
        self,
        path: str,
        name: str = "compute_score",
        num_workers: int = 2,
        timeout_s: float = 10.0,
        memory_limit_mb: int | None = 4096,
        function_kwargs: dict[str, Any] | None = None,
        start_timeout_s: float = 60.0,
        sandbox: CustomSandboxConfig | None = None,
        signature: str = "verl",
    ):
        """Start the workers and wait until each has loaded the function.

        memory_limit_mb caps each of a worker's processes' address space (RLIMIT_AS, virtual memory:
        a function that imports torch needs a few GB) and all of them together (resident; see
        rlfabric.sandbox.process_tree.MemoryBound); None = no cap. function_kwargs (JSON
        values) are passed to every call, as VeRL's custom_reward_function.reward_kwargs.
        sandbox confines the function (None = the defaults of reward.custom_sandbox). signature is how
        the function is called: "verl" or "trl" (rlfabric.reward.signatures).
        Raises FileNotFoundError or CustomFunctionLoadError when the function cannot be loaded.
        """
        check_custom_file(path)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if signature not in SIGNATURES:
            raise ValueError(f"signature must be one of {SIGNATURES}, got {signature!r}")
        self.path = os.path.abspath(path)
        self.name = name
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        if sandbox is None:
            from rlfabric.core.config import CustomSandboxConfig

            sandbox = CustomSandboxConfig()
        variables = user_variables(sandbox.env, sandbox.env_passthrough)
        # Sent on each worker's stdin: keyword arguments and variables may hold secrets.
        self._settings = (
            json.dumps(
                {
                    "path": self.path,
                    "name": name,
                    "memory_limit_mb": memory_limit_mb,
                    "function_kwargs": function_kwargs or {},
                    "signature": signature,
                    "sandbox": {**sandbox.model_dump(), "variables": variables},
                    "parent_pid": os.getpid(),
                }
            ).encode()
            + b"\n"
        )
        self.sandbox_warnings: list[str] = []
        """What the sandbox could not do (e.g. no network namespace), as the workers reported it."""
        self._lock = threading.Lock()  # one batch at a time
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        try:
            self._workers = [self._start_worker() for _ in range(num_workers)]
            while any(worker.state == _STARTING for worker in self._workers):
                self._wait(results=None)
            errors = [worker.load_error for worker in self._workers if worker.state == _FAILED]
            if errors:
                raise CustomFunctionLoadError(f"cannot load {name!r} from {self.path!r}: {errors[0]}")
        except BaseException:
            self.close()
            raise

    def score_batch(self, items: Sequence[ScoreItem]) -> list[ItemResult]:
        """Score every item, one ItemResult per item in order; failures are per item, never raised."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the custom scorer pool is closed")
            results: list[ItemResult | None] = [None] * len(items)
            requests: list[bytes] = [b""] * len(items)
            pending: deque[int] = deque()
            for index, item in enumerate(items):
                try:
                    requests[index] = _encode(item)
                    pending.append(index)
                except (TypeError, ValueError) as exc:
                    results[index] = failed(STATUS_ERROR, f"item cannot be sent to the worker as JSON: {exc}")

            # Workers that failed to load get another try each batch (the file may have been fixed).
            for slot, worker in enumerate(self._workers):
                if worker.state in (_FAILED, _DEAD):
                    self._workers[slot] = self._start_worker()

            try:
                while pending or any(worker.state == _BUSY for worker in self._workers):
                    self._dispatch(pending, requests, results)
                    if pending and all(worker.state == _FAILED for worker in self._workers):
                        message = f"no worker could load the function: {self._workers[0].load_error}"
                        for index in pending:
                            results[index] = failed(STATUS_ERROR, message)
                        break
                    self._wait(results)
            except BaseException:
                # Interrupted (e.g. KeyboardInterrupt): a busy worker's late answer must not land in the next batch.
                for worker in list(self._workers):
                    if worker.state == _BUSY:
                        self._replace(worker)
                raise
            return results  # type: ignore[return-value]  (every slot is filled by now)

    def close(self) -> None:
        """Kill every worker. The pool cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                if not worker.reaped:
                    self._kill(worker)
            self._selector.close()

    def __enter__(self) -> CustomScorerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- worker bookkeeping ---

    def _start_worker(self) -> _Worker:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlfabric.reward.custom_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,  # own process group: killpg reaches its children; no terminal signals
            env=worker_environment(),  # none of this service's secrets
        )
        worker = _Worker(proc, deadline=time.monotonic() + self.start_timeout_s)
        self._selector.register(proc.stdout.fileno(), selectors.EVENT_READ, worker)
        worker.send(self._settings)  # if it died already, its closed stdout says so
        return worker

    def _kill(self, worker: _Worker) -> str:
        self._selector.unregister(worker.proc.stdout.fileno())
        return worker.kill()

    def _replace(self, worker: _Worker) -> None:
        if not worker.reaped:
            self._kill(worker)
        self._workers[self._workers.index(worker)] = self._start_worker()

    def _load_failed(self, worker: _Worker, message: str) -> None:
        if not worker.reaped:
            self._kill(worker)
        worker.state = _FAILED
        worker.load_error = message

    def _dispatch(self, pending: deque[int], requests: list[bytes], results: list[ItemResult | None]) -> None:
        for worker in list(self._workers):
            if worker.state != _IDLE or not pending:
                continue
            index = pending.popleft()
            if worker.send(requests[index]):
                worker.state = _BUSY
                worker.item = index
                worker.deadline = time.monotonic() + self.timeout_s
            else:
                pending.appendleft(index)  # never ran: give it to another worker
                self._replace(worker)

    def _wait(self, results: list[ItemResult | None] | None) -> None:
        """Handle what workers sent before the nearest deadline, then anyone past their deadline."""
        deadlines = [w.deadline for w in self._workers if w.state in (_STARTING, _BUSY)]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0
        for key, _ in self._selector.select(timeout):
            worker: _Worker = key.data
            try:
                messages = worker.read_messages()
            except ValueError:  # not JSON: the protocol is broken, treat the worker as dead
                messages = None
            if messages is None:
                self._on_exit(worker, results)
                continue
            for message in messages:
                self._on_message(worker, message, results)

        now = time.monotonic()
        for worker in list(self._workers):
            if worker.deadline > now:
                continue
            if worker.state == _BUSY:
                results[worker.item] = failed(
                    STATUS_TIMEOUT,
                    f"no result within {self.timeout_s:g} s; the worker was killed and replaced",
                )
                self._replace(worker)
            elif worker.state == _STARTING:
                self._load_failed(
                    worker, f"the worker did not load the function within {self.start_timeout_s:g} s"
                )

    def _on_message(self, worker: _Worker, message: dict, results: list[ItemResult | None] | None) -> None:
        kind = message.get("type")
        if worker.state == _STARTING and kind == "ready":
            worker.state = _IDLE
            for warning in message["warnings"]:
                if warning not in self.sandbox_warnings:
                    self.sandbox_warnings.append(warning)
                    logger.warning("custom reward sandbox: %s", warning)
        elif worker.state == _STARTING and kind == "load_error":
            self._load_failed(worker, message["message"])
        elif worker.state == _BUSY and kind == "result":
            results[worker.item] = result_from_value(message["value"])
            worker.state = _IDLE
        elif worker.state == _BUSY and kind == "error":
            results[worker.item] = failed(STATUS_ERROR, message["message"])
            worker.state = _IDLE
            if message.get("recycle"):
                self._replace(worker)
        else:
            self._on_exit(worker, results)  # out of protocol: do not trust this worker any more

    def _on_exit(self, worker: _Worker, results: list[ItemResult | None] | None) -> None:
        if worker.reaped:  # already handled (killed after an earlier message)
            return
        state = worker.state
        how = self._kill(worker)
        if state == _STARTING:
            self._load_failed(worker, f"the worker process {how} while loading the function")
            return
        if state == _BUSY:
            results[worker.item] = failed(STATUS_CRASHED, f"the worker process {how} while scoring this item")
        self._replace(worker)


def _encode(item: ScoreItem) -> bytes:
    request = {
        "data_source": item.data_source,
        "solution_str": item.response,
        "ground_truth": item.ground_truth,
        "extra_info": item.extra_info,
        "prompt": item.prompt,  # (a trl function's `prompts`)
    }
    # json.dumps escapes newlines inside strings, so one request is one line.
    return json.dumps(request, default=json_default).encode() + b"\n"

