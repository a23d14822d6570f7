"""The warm agent host (agent.subprocess.preload): one process per subprocess runner that imports the agent's
installed dependencies once and forks a child per episode, instead of a new interpreter per episode.

    python -m rlfabric.agents.forkserver ENTRYPOINT FD      (started by rlfabric.agents.warm, never by hand)

FD is a unix SOCK_SEQPACKET socket to the runner; each message is one JSON object (no pickle), and a request to
run carries the episode's stdin, stdout and stderr as descriptors (SCM_RIGHTS):
    runner -> host  {"op": "run", "id": 7, "env": {OPENAI_*}, "jail": AgentJail JSON, "gateway": "h:p"|"-",
                     "require": false}  + [stdin, stdout, stderr]
                    {"op": "kill", "id": 7}                       (the episode's time is up: SIGKILL its launcher)
    host -> runner  {"ready": true, "preloaded": [...], "threads": 1, "import_s": 1.2}   once, after the imports
                    {"id": 7, "status": 0, "cpu_s": 0.05}    its launcher exited (status as a shell says it; the
                                                              CPU of the launcher and the agent it reaped)
The host runs no agent code: it imports only what the entrypoint's file imports at its top level from installed
packages (the interpreter's standard library and site-packages: the same trust as rlfabric, which every
sandbox here imports as root before its uid drop), never the entrypoint's own file nor its folder's modules.
Per episode, as the cold path (rlfabric.agents.jail, whose pieces this reuses), a launcher is forked:
- it becomes the child subreaper of what the agent starts, and dies with the host (PR_SET_PDEATHSIG);
- with a gateway, it moves into a network namespace of its own, listens there on 127.0.0.1:PORT, forks the
  agent, moves back (setns) and relays each connection to the gateway, as the jail does (single-threaded when
  it forks: the relay's threads start after);
- the agent child confines itself (confine_agent: private /tmp, /var/tmp, /dev/shm; the agent.* limits; the
  episode's claimed uid; no_new_privs), sets the episode's OPENAI_* variables, then loads the entrypoint's file
  and runs the episode as `python -m rlfabric.agents.host` does (rlfabric.agents.host.run_episode);
- when the agent ends, the launcher kills what is left of its uid and exits with its status.
What a fork shares with its parent and a new interpreter would not: the preloaded modules' state (a fresh copy
per episode; no episode's change reaches another) and the random generators' state: `random` reseeds itself
in a forked child, numpy's global generator is reseeded here. RLIMIT_CPU counts from the fork (the imports
are not charged to the episode) and RLIMIT_DATA counts the inherited modules' memory, as the cold path's imports.
A host whose imports left threads running (fork keeps only the calling thread) says so, and the runner uses a
process per episode instead.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import selectors
import signal
import site
import socket
import sys
import sysconfig
import threading
import time
import traceback

from rlfabric.agents.confinement import AgentJail, SandboxError, confine_agent
from rlfabric.agents.entrypoint import split_entrypoint
from rlfabric.agents.host import run_episode
from rlfabric.agents.jail import (
    NO_ISOLATION,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    isolated_listener,
    relay,
)
from rlfabric.sandbox.confine import CLONE_NEWNET, kill_processes_of

MESSAGE_BYTES = 1 << 20  # the largest control message (a request's env and jail: a few KiB)


def installed_roots() -> list[str]:
    """Where installed modules live: the standard library and every site-packages folder on the path (a .pth
    file's included)."""
    paths = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages())
    paths.update(entry for entry in sys.path if os.path.basename(entry) in ("site-packages", "dist-packages"))
    return sorted(os.path.realpath(path) + "/" for path in paths if path)


def preloadable(entrypoint: str) -> list[str]:
    """The installed modules the entrypoint's file (or module) imports at its top level, in order; never the
    entrypoint itself nor a module of its own folder or package."""
    where, _ = split_entrypoint(entrypoint)
    if where.endswith(".py"):
        source_path, own = where, ""
    else:
        spec = importlib.util.find_spec(where)
        source_path, own = (spec.origin if spec else ""), where.partition(".")[0]
    try:
        with open(source_path, "rb") as file:
            tree = ast.parse(file.read())
    except (OSError, SyntaxError, ValueError):
        return []  # the child's import reports it, as the cold path's would
    names: list[str] = []
    for node in tree.body:  # top level only (and what an if or try there imports): no function runs here
        for statement in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(statement, ast.Import):
                names += [alias.name for alias in statement.names]
            elif isinstance(statement, ast.ImportFrom) and statement.level == 0 and statement.module:
                names.append(statement.module)
    roots = installed_roots()
    kept: list[str] = []
    for name in names:
        if name.partition(".")[0] != own and name not in kept and _installed(name, roots):
            kept.append(name)
    return kept


def _installed(name: str, roots: list[str]) -> bool:
    top = name.partition(".")[0]
    if top in sys.builtin_module_names:
        return True
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    origin = (
        spec.origin
        if spec.origin not in (None, "namespace")
        else next(iter(spec.submodule_search_locations or []), "")
    )
    if origin in ("built-in", "frozen"):
        return True
    return bool(origin) and any(os.path.realpath(origin).startswith(root) for root in roots)


def preload(names: list[str]) -> list[str]:
    """Imports each; the ones that imported (one that fails is left to the episode, which reports it)."""
    done = []
    for name in names:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
            done.append(name)
    return done


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m rlfabric.agents.forkserver ENTRYPOINT FD", file=sys.stderr)
        return 2
    entrypoint, control = argv[0], socket.socket(fileno=int(argv[1]))
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # with the runner's process
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # a launcher's orphans are reaped here
    started = time.perf_counter()
    loaded = preload(preloadable(entrypoint))
    _send(
        control,
        {
            "ready": True,
            "preloaded": loaded,
            "threads": threading.active_count(),
            "import_s": round(time.perf_counter() - started, 3),
        },
    )
    serve_requests(control, entrypoint)
    return 0


def serve_requests(control: socket.socket, entrypoint: str) -> None:
    """Until the runner closes the socket: a launcher per request, its status when it exits; then every
    launcher still running is killed."""
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler: the wakeup fd hears of the signal)
    launchers: dict[int, int] = {}  # pid -> the request's id
    events = selectors.DefaultSelector()
    events.register(control, selectors.EVENT_READ)
    events.register(woken, selectors.EVENT_READ)
    while True:
        for key, _ in events.select():
            if key.fileobj == woken:
                os.read(woken, 4096)
                _report_exits(control, launchers)
                continue
            message, fds, *_ = socket.recv_fds(control, MESSAGE_BYTES, 3)
            if not message:
                for pid in launchers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return
            request = json.loads(message)
            if request["op"] == "kill":
                pid = next((pid for pid, id_ in launchers.items() if id_ == request["id"]), None)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                events.close()
                os.close(woken), os.close(wake)
                _launch(request, fds, control, entrypoint)  # never returns
            for fd in fds:
                os.close(fd)
            launchers[pid] = request["id"]
        _report_exits(control, launchers)  # (a SIGCHLD that arrived while a request was read)


def _report_exits(control: socket.socket, launchers: dict[int, int]) -> None:
    with contextlib.suppress(ChildProcessError):
        while True:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                return
            if pid in launchers:  # else an orphan the host reaped as subreaper
                code = os.waitstatus_to_exitcode(status)
                _send(
                    control,
                    {
                        "id": launchers.pop(pid),
                        "status": code if code >= 0 else 128 - code,
                        "cpu_s": usage.ru_utime + usage.ru_stime,
                    },
                )


def _send(control: socket.socket, message: dict) -> None:
    control.sendall(json.dumps(message).encode())


def _launch(request: dict, fds: list[int], control: socket.socket, entrypoint: str) -> None:
    """The launcher (forked from the host, single-threaded, root as the host is): the jail's part for one
    episode, the agent forked instead of exec'd."""
    code = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        control.close()
        for target, fd in enumerate(fds):  # (received descriptors are above 2: the host's own 0-2 are open)
            os.dup2(fd, target)
            os.close(fd)
        code = _launch_agent(request, entrypoint, libc)
    except BaseException:  # noqa: BLE001 (a launcher never returns into the host's loop)
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def _launch_agent(request: dict, entrypoint: str, libc: ctypes.CDLL) -> int:
    jail = AgentJail.from_json(request["jail"])
    listener = gateway = None
    own = -1  # this namespace, to come back to
    if request["gateway"] != "-":
        host, _, port = request["gateway"].rpartition(":")
        gateway = (host, int(port))
        own = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            listener = isolated_listener(gateway[1])
        except OSError as error:
            os.close(own)
            own = -1
            why = "not root: " if os.geteuid() != 0 else ""
            then = (
                "agent.require_network_isolation is set, so it does not run"
                if request["require"]
                else "it has this host's network"
            )
            print(
                f"rlfabric agent jail: cannot isolate the agent from the network ({why}"
                f"{error.strerror or error}); {then}",
                file=sys.stderr,
            )
            if request["require"]:
                return NO_ISOLATION
    me = os.getpid()
    agent = os.fork()
    if agent == 0:
        if listener is not None:
            listener.close()
            os.close(own)
        _run_agent(request, entrypoint, jail, me)  # never returns
    if listener is not None:
        # Back to the host's namespace: the relay connects to the gateway from there.
        if libc.setns(own, CLONE_NEWNET) != 0:
            os.kill(agent, signal.SIGKILL)
            raise OSError(ctypes.get_errno(), "setns back to the host's network namespace failed")
        os.close(own)
        threading.Thread(target=relay, args=(listener, gateway), daemon=True).start()
    status = os.waitpid(agent, 0)[1]
    # Its leftovers (setsid, double forks) hold the episode's pipes. Being their subreaper, this process has a
    # child while any is left: only then is the scan of every process for its uid needed.
    if jail.uid is not None and os.geteuid() == 0 and _reap_children():
        kill_processes_of(jail.uid)
        _reap_children()
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _reap_children() -> bool:
    """Reaps what has exited below this process; whether any child is still running."""
    try:
        while True:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return True
    except ChildProcessError:
        return False


def _run_agent(request: dict, entrypoint: str, jail: AgentJail, parent: int) -> None:
    """The agent's process: confined as the jail's exec'd child would be, then the episode."""
    code = 1
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
        try:
            variables, warnings = confine_agent(jail)
        except SandboxError as error:
            print(f"rlfabric agent jail: {error}", file=sys.stderr)
            os._exit(127)
        for warning in warnings:
            print(f"rlfabric agent jail: {warning}", file=sys.stderr)
        os.environ.update({**request["env"], **variables})
        # A forked child keeps its parent's generator state; a new process seeds anew.
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        code = run_episode(entrypoint)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (as an uncaught exception ends an interpreter: traceback, status 1)
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
