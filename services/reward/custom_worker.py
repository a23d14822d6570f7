"""Worker process of CustomScorerPool: loads one user function and scores the items it is sent.

Started by the pool as ``python -m rlfabric.reward.custom_worker``, never by hand; its settings
(function_kwargs included, which may hold API keys) come as the first line on stdin, never on the
command line, where `ps` would show them. The process splits in two (one fork, no second interpreter):
- the supervisor, the process the pool started, runs no user code and is the only one holding the
  pool's pipes. It relays each item to the scorer over a private socket with a fresh random nonce,
  checks the reply (sent by the scorer's own pid, per SO_PASSCRED, for that nonce, numbers only) and
  only then writes a result to the pool; a reply out of protocol fails the item and ends the worker.
  It is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): every process the user's code starts stays
  its descendant, even one that calls setsid() or double-forks into a daemon. It claims the worker's
  own uid (rlfabric.sandbox.confine.claim_uid) and makes its memory bound (process_tree.MemoryBound),
  which it checks while an item runs. When the scorer ends it kills every descendant left, reaps
  them, releases the uid (deleting what it left in the host's temp dirs) and exits as the
  scorer did (same exit code or signal); when the pool's process dies, it does the same.
- the scorer, its child, confines itself (rlfabric.sandbox.confine: own network namespace, the
  worker's uid, empty environment, resource limits, the memory cgroup) before it runs any user code,
  then loads the function from the source the supervisor read and scores items. Its stdin is
  /dev/null, its stdout goes to stderr: what the user's code prints or writes to any descriptor it
  has reaches no result channel.
Nothing an item starts outlives it: before the scorer replies it kills and reaps every process below
it (a child subreaper too, so orphans included), and before the supervisor passes the reply on it
kills whatever is left but the scorer and waits until it is reaped; both skip the process-table scan
where /proc/stat says nothing forked since. So no leftover reads the next item, holds memory or
counts against RLIMIT_NPROC. A process the function forks finds the channel's descriptor pointing at
/dev/null (os.register_at_fork), and one it execs never has it (close-on-exec). The sandbox past its
memory limit (all its processes together) fails the item with that reason, and the worker is replaced.
So the pool kills a worker by killing every descendant of the supervisor (kill_descendants), which
reaches whatever the user's code started, whatever session or process group it moved to.
Without PR_SET_CHILD_SUBREAPER (not Linux) a process that leaves the tree (its parent exits) escapes.
Code running inside the scorer's own process is the function itself: it can return any score for
the item it is given, so what the checks stop is the forging of results by anything else (a
process the function starts, an earlier item's leftovers), and by naive writes from the function.

The messages, with the pool and between scorer and supervisor, and the supervisor's checks of every
reply are in rlfabric.reward.custom_protocol.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import numbers
import os
import resource
import shutil
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any, NoReturn

import psutil

from rlfabric.reward.custom_protocol import Relay, encode_line, write_all
from rlfabric.reward.items import describe_exception
from rlfabric.reward.signatures import caller, check_signature
from rlfabric.sandbox.confine import (
    SandboxError,
    UidClaim,
    can_renew_hard_cpu_limit,
    claim_uid,
    clear_temp_files,
    confine,
    make_workdir,
    renew_own_cpu_limit,
)
from rlfabric.sandbox.imports import import_installed_modules
from rlfabric.sandbox.process_tree import (
    MemoryBound,
    kill_descendants,
    reap_children,
    set_child_subreaper,
)


def load_function(path: str, source: bytes, name: str) -> Callable[..., Any]:
    """Run the source of the Python file at path as a module and return its attribute name.

    The supervisor read the source: the sandbox uid may not be allowed to read the file.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.append(directory)  # let the file import its neighbours (appended: never shadows stdlib)
    module = types.ModuleType("custom_reward_module")
    module.__file__ = path
    sys.modules[module.__name__] = module
    lines = source.decode(errors="replace").splitlines(True)
    linecache.cache[path] = (len(source), None, lines, path)  # tracebacks show its lines
    exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)
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


def main() -> int:
    settings = _read_settings()
    set_child_subreaper()
    sandbox = settings["sandbox"]
    try:  # read here, as root: the sandbox uid may not be allowed to
        with open(settings["path"], "rb") as file:
            source = file.read()
        # A uid of this worker's alone (root only): its processes are the only ones its code may signal.
        claim = claim_uid(sandbox["uid"], sandbox["uid_count"]) if os.geteuid() == 0 else None
    except (OSError, SandboxError) as exc:
        write_all(1, encode_line({"type": "load_error", "message": describe_exception(exc)}))
        return 1
    if claim is not None:
        sandbox["uid"] = claim.uid
    bound = MemoryBound(settings["memory_limit_mb"], sandbox["memory_cgroup"])
    workdir = make_workdir(sandbox["uid"], sandbox["gid"])
    hard_cpu_limit = can_renew_hard_cpu_limit()
    channel, scorer_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # each read says which process wrote it
    supervisor = os.getpid()
    scorer = os.fork()
    if scorer == 0:
        channel.close()
        return run_scorer(scorer_end, source, settings, workdir, hard_cpu_limit, supervisor, bound.cgroup)
    scorer_end.close()
    supervise(scorer, channel, settings, hard_cpu_limit, _Sandbox(workdir, bound, claim))


class _Sandbox:
    """What the supervisor made for its scorer and removes when it ends: the working directory, the
    memory bound (a cgroup, maybe) and the claimed uid (with what it left in the host's temp dirs)."""

    def __init__(self, workdir: str, bound: MemoryBound, claim: UidClaim | None):
        self.workdir = workdir
        self.bound = bound
        self.claim = claim

    def remove(self) -> None:
        """Once every process of the sandbox is dead."""
        if self.claim is not None:
            self.claim.release()
        self.bound.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _read_settings() -> dict:
    """The settings line on stdin (the pool sends nothing more before the worker is ready)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(0, 1 << 16)
        if not chunk:
            sys.exit(1)  # the pool went away before sending them
        data += chunk
    return json.loads(data)


def supervise(
    scorer: int, channel: socket.socket, settings: dict, hard_cpu_limit: bool, sandbox: _Sandbox
) -> NoReturn:
    """The supervisor's part: relay items and checked replies until the scorer ends or breaks the
    protocol, or the pool goes; then kill and reap whatever is left and end as the scorer ended."""
    me = os.getpid()

    def clean_up() -> None:
        kill_descendants(me)
        sandbox.remove()

    threading.Thread(target=_exit_when_orphaned, args=(settings["parent_pid"], clean_up), daemon=True).start()
    cpu_limit_s = settings["sandbox"]["cpu_limit_s"] if hard_cpu_limit else None  # else the scorer's job
    relay = Relay(psutil.Process(scorer), channel, cpu_limit_s, sandbox.bound)
    reaper = _Reaper(scorer)
    relay.run(reaper.exited_fd)
    kill_descendants(me)
    status = reaper.wait()
    with contextlib.suppress(ChildProcessError):
        while True:  # every descendant is dead: each zombie comes to us once its parent is reaped
            os.waitpid(-1, 0)
    sandbox.remove()
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


class _Reaper:
    """Reaps the supervisor's children (orphans land here) in a thread until the scorer ends.

    The scorer itself is left a zombie until wait(): its pid cannot name another process meanwhile.
    """

    def __init__(self, scorer: int):
        self.scorer = scorer
        self.exited_fd, self._exited_signal = os.pipe()  # readable once the scorer has ended
        self._thread = threading.Thread(target=self._reap, daemon=True)
        self._thread.start()

    def _reap(self) -> None:
        while True:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            if ended.si_pid == self.scorer:
                os.write(self._exited_signal, b"x")
                return
            os.waitpid(ended.si_pid, 0)

    def wait(self) -> int:
        """Reap the scorer once it has ended; its wait status."""
        self._thread.join()
        return os.waitpid(self.scorer, 0)[1]


def run_scorer(
    channel: socket.socket,
    source: bytes,
    settings: dict,
    workdir: str,
    hard_cpu_limit: bool,
    supervisor_pid: int,
    cgroup: str,
) -> int:
    """The scorer's part: confine itself, load the user's function and score the items the
    supervisor sends until it closes the channel."""
    # 1. Keep no descriptor of the pool's: stdin is /dev/null, what the user prints goes to stderr.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    os.closerange(3, channel.fileno())
    os.closerange(channel.fileno() + 1, os.sysconf("SC_OPEN_MAX"))
    # No process the function forks gets the channel (an exec'd one never does: it is close-on-exec).
    os.register_at_fork(after_in_child=lambda: _cut_off(channel.fileno()))
    # Orphans of the function's processes come to the scorer, which kills and reaps them after each item.
    set_child_subreaper()

    def send(message: dict) -> None:
        channel.sendall(encode_line(message))

    # 2. Confine this process before any user code runs (see rlfabric.sandbox.confine); what it may no
    # longer read, the installed modules the file imports, is imported first.
    import_installed_modules(source, settings["path"])
    own_uid = os.geteuid() == 0  # (confine drops root for the worker's claimed uid)
    try:
        warnings = confine(settings["sandbox"], settings["memory_limit_mb"], workdir, hard_cpu_limit, cgroup)
    except SandboxError as exc:
        send({"type": "load_error", "message": str(exc)})
        return 1
    except Exception as exc:
        send({"type": "load_error", "message": f"cannot confine the function: {describe_exception(exc)}"})
        return 1
    threading.Thread(target=_exit_when_orphaned, args=(supervisor_pid,), daemon=True).start()

    # 3. Load the user's function.
    try:
        fn = load_function(settings["path"], source, settings["name"])
        check_signature(fn, settings["signature"], settings["name"])
    except Exception as exc:
        send({"type": "load_error", "message": describe_exception(exc)})
        return 1
    _end_own_processes()
    send({"type": "ready", "warnings": warnings})
    score = caller(fn, settings["signature"], settings["function_kwargs"])
    cpu_limit_s = settings["sandbox"]["cpu_limit_s"]

    # 4. Score items until the supervisor closes the channel.
    for line in channel.makefile("rb"):
        item = json.loads(line)
        nonce = item.pop("nonce")
        if not hard_cpu_limit:  # else the supervisor renewed it
            renew_own_cpu_limit(cpu_limit_s)
        try:
            reply = {"type": "result", "value": to_plain(score(item))}
        except Exception as exc:  # MemoryError included
            # After a MemoryError the pool replaces this worker rather than trust its heap.
            reply = {
                "type": "error",
                "message": describe_exception(exc),
                "recycle": isinstance(exc, MemoryError),
            }
        # Sent after the except block, so the traceback and the user's locals are freed by now.
        reply["nonce"] = nonce
        reply["ended"] = _end_own_processes()
        clear_temp_files(workdir, own_uid)  # what the item wrote there, the next one does not see
        send(reply)
    return 0


def _end_own_processes() -> bool:
    """Kill and reap every process below the scorer, if it has any; whether it had. Exact and cheap:
    the scorer is a child subreaper, so with no child (waitid: ECHILD) it has no descendant either.
    Told it had some, the supervisor kills whatever is left too (custom_protocol.Relay._end_item)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    kill_descendants(os.getpid())
    reap_children()
    return True


def _cut_off(channel_fd: int) -> None:
    """In a process the function forked: the channel's descriptor now reads and writes /dev/null."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, channel_fd)
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
