"""One run of the python tool's code, confined as the reward sandbox confines user reward code.

Started by rlfabric.env.python_tool as ``python -m rlfabric.env.python_runner``, never by hand. stdin:
one JSON line of settings, then the code. The process splits in two, as the reward worker does:
- the supervisor (this process, a child subreaper, running no user code) claims a uid of the call's
  own (root), makes the memory bound (a cgroup, or counting) and the private working directory,
  waits for the runner while it checks the memory of all the call's processes together, then kills
  every descendant left (whatever session they moved to), releases the uid (what it wrote to
  the host's temp dirs deleted), removes the directory and exits as the
  runner did. Past the memory limit it kills them all at once and writes {"memory_exceeded": why}
  as a JSON line to stderr;
- the runner, its child, confines itself (rlfabric.sandbox.confine.confine: own network namespace,
  the claimed uid as root, private /tmp, /var/tmp and /dev/shm with env.python.sandbox.private_tmp,
  empty environment, resource limits), writes the confinement's warnings as one JSON line to stderr,
  points its stderr at stdout and runs the code: what it prints (a traceback included) is the tool's output.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import sys
import time
import traceback

from rlfabric.sandbox.confine import SandboxError, UidClaim, claim_uid, confine, make_workdir
from rlfabric.sandbox.imports import import_installed_modules
from rlfabric.sandbox.process_tree import MEMORY_CHECK_S, MemoryBound, kill_descendants, set_child_subreaper


def main() -> int:
    settings_line = sys.stdin.buffer.readline()
    settings = json.loads(settings_line)
    code = sys.stdin.buffer.read().decode(errors="replace")
    set_child_subreaper()
    sandbox = settings["sandbox"]
    try:  # a uid of this call's own (root only): its signals and RLIMIT_NPROC reach only its processes
        claim = claim_free_uid(sandbox, time.monotonic() + settings["timeout_s"] / 2) if os.geteuid() == 0 else None
    except SandboxError as error:
        _report({"sandbox_error": str(error)})
        return 1
    if claim is not None:
        sandbox["uid"] = claim.uid
    bound = MemoryBound(settings["memory_limit_mb"] or None, sandbox["memory_cgroup"])
    if bound.warning:
        _report({"warnings": [bound.warning]})
    workdir = make_workdir(sandbox["uid"], sandbox["gid"])
    sys.stdout.flush()
    runner = os.fork()
    if runner == 0:
        os._exit(run_confined(code, settings, workdir, bound.cgroup))
    status = wait_within_memory(runner, bound)
    kill_descendants(os.getpid())
    with contextlib.suppress(ChildProcessError):
        while True:  # every descendant is dead: reap the zombies that came to us
            os.waitpid(-1, 0)
    if claim is not None:
        claim.release()
    bound.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def claim_free_uid(sandbox: dict, deadline: float) -> UidClaim:
    """A uid of the sandbox's range, waiting for one while every one is taken (by concurrent calls)
    until `deadline` (half the call's timeout: the other half is the code's); then SandboxError."""
    while True:
        try:
            return claim_uid(sandbox["uid"], sandbox["uid_count"])
        except SandboxError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def wait_within_memory(runner: int, bound: MemoryBound) -> int:
    """The runner's wait status once it has ended. With a memory limit, the memory of all the call's
    processes is checked every MEMORY_CHECK_S meanwhile; past it they are killed, and why reported."""
    if not bound.limit_mb:
        return os.waitpid(runner, 0)[1]
    try:
        ended = os.pidfd_open(runner)  # readable once the runner has ended
    except OSError:  # Linux < 5.3: look every MEMORY_CHECK_S
        ended = None
    try:
        while True:
            select.select([ended] if ended is not None else [], [], [], MEMORY_CHECK_S)
            pid, status = os.waitpid(runner, os.WNOHANG)
            if pid:
                return status
            reason = bound.check(os.getpid())
            if reason:
                kill_descendants(os.getpid())
                _report({"memory_exceeded": reason})
                return os.waitpid(runner, 0)[1]
    finally:
        if ended is not None:
            os.close(ended)


def _report(message: dict) -> None:
    print(json.dumps(message), file=sys.stderr, flush=True)


def run_confined(code: str, settings: dict, workdir: str, cgroup: str) -> int:
    """The runner's part: confine, report the warnings, run the code with stderr on stdout."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    # The installed modules the code imports, while this process may still read them (see the reward worker).
    import_installed_modules(code.encode(), os.path.join(workdir, "code.py"))
    try:
        memory_limit_mb = settings["memory_limit_mb"] or None
        warnings = confine(settings["sandbox"], memory_limit_mb, workdir, hard_cpu_limit=False, cgroup=cgroup)
    except SandboxError as error:
        _report({"sandbox_error": str(error)})
        return 1
    _report({"warnings": warnings})
    os.dup2(1, 2)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<code>", "exec"), namespace)  # the point of the tool: it is confined above
    except SystemExit as exit_:
        code_ = exit_.code
        return code_ if isinstance(code_, int) else (0 if code_ is None else 1)
    except BaseException as error:  # the model reads the traceback, as python prints it
        print_code_traceback(error)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def print_code_traceback(error: BaseException) -> None:
    """The traceback python would print for the code alone (without this module's frame)."""
    report = traceback.TracebackException.from_exception(error)
    report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != __file__])
    print("".join(report.format()), end="", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
