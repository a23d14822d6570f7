"""One run of the python tool's code, confined as the reward sandbox confines user reward code.

Started by rlfabric.env.python_tool as ``python -m rlfabric.env.python_runner``, never by hand. stdin:
one JSON line of settings, then the code. The process splits in two, as the reward worker does:
- the supervisor (this process, a child subreaper, running no user code) makes the private working
  directory, waits for the runner, then kills every descendant left (whatever session they moved to),
  removes the directory and exits as the runner did;
- the runner, its child, confines itself (rlfabric.reward.sandbox.confine: own network namespace,
  another uid as root, empty environment, resource limits), writes the confinement's warnings as one
  JSON line to stderr, points its stderr at stdout and runs the code: what it prints (a traceback
  included) is the tool's output.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import traceback

from rlfabric.reward.custom_worker import import_installed_modules
from rlfabric.reward.process_tree import kill_descendants, set_child_subreaper
from rlfabric.reward.sandbox import SandboxError, confine, make_workdir


def main() -> int:
    settings_line = sys.stdin.buffer.readline()
    settings = json.loads(settings_line)
    code = sys.stdin.buffer.read().decode(errors="replace")
    set_child_subreaper()
    sandbox = settings["sandbox"]
    workdir = make_workdir(sandbox["uid"], sandbox["gid"])
    sys.stdout.flush()
    runner = os.fork()
    if runner == 0:
        os._exit(run_confined(code, settings, workdir))
    _, status = os.waitpid(runner, 0)
    kill_descendants(os.getpid())
    with contextlib.suppress(ChildProcessError):
        while True:  # every descendant is dead: reap the zombies that came to us
            os.waitpid(-1, 0)
    shutil.rmtree(workdir, ignore_errors=True)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def run_confined(code: str, settings: dict, workdir: str) -> int:
    """The runner's part: confine, report the warnings, run the code with stderr on stdout."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    # The installed modules the code imports, while this process may still read them (see the reward worker).
    import_installed_modules(code.encode(), os.path.join(workdir, "code.py"))
    try:
        warnings = confine(settings["sandbox"], settings["memory_limit_mb"] or None, workdir, hard_cpu_limit=False)
    except SandboxError as error:
        print(json.dumps({"sandbox_error": str(error)}), file=sys.stderr, flush=True)
        return 1
    print(json.dumps({"warnings": warnings}), file=sys.stderr, flush=True)
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
