"""The launcher of subprocess and command agents: a network that reaches the gateway only
(agent.network_isolation), and the confinement of rlfabric.agents.confinement (a uid of the episode's own,
limits, private temp dirs).

    python -m rlfabric.agents.jail [--require] HOST:PORT|- JAIL_JSON -- ARGV...
        (the gateway's address, or - for the host's network; an AgentJail as JSON; the agent's program)

As root, a thread of this process moves into a network namespace of its own (unshare CLONE_NEWNET is per
thread), brings its loopback up, listens on 127.0.0.1:PORT there and forks the agent from it: the agent has that
namespace, with no interface but the loopback, so no other port of this host and no outside address answers.
This process's main thread, still in the host's namespace, relays each connection made to 127.0.0.1:PORT to the
gateway. So OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 works unchanged, and nothing else does. The forked child,
single-threaded, confines itself (confine_agent: mounts, limits, the uid) and execs the agent; its warnings go to
the agent's stderr.

Why a relay here rather than socat on a unix socket of the gateway: this process must stay anyway (the agent's
parent, killed with it: PR_SET_PDEATHSIG), holds sockets of both namespaces at once (a socket keeps the
namespace of the thread that made it), so it needs neither a socket file nor a change to the gateway, and it
adds no process and no system dependency per episode. The relay is two threads per connection copying bytes;
it runs as root, the agent as its own uid.

Not root (no namespace without a user namespace, and a user namespace needs a single-threaded caller), or where
the kernel refuses: stderr says so and the agent runs with this host's network, or, with
agent.require_network_isolation, this exits with status NO_ISOLATION before the agent runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import struct
import sys
import threading

from rlfabric.agents.confinement import AgentJail, SandboxError, confine_agent
from rlfabric.sandbox.confine import CLONE_NEWNET, kill_processes_of

NO_ISOLATION = 125  # the exit status when the agent would run without a network namespace and may not
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # <linux/prctl.h>
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1  # <linux/sockios.h>, <net/if.h>
CHUNK = 65536


def isolated_listener(port: int) -> socket.socket:
    """In the calling thread: a network namespace of its own, its loopback up, a socket listening on
    127.0.0.1:port in it. OSError where it cannot be made."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"unshare(CLONE_NEWNET) failed ({os.strerror(error)})")
    with socket.socket() as control:
        flags = struct.unpack("16sH", fcntl.ioctl(control, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
        fcntl.ioctl(control, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))
    return socket.create_server(("127.0.0.1", port))


def relay(listener: socket.socket, gateway: tuple[str, int]) -> None:
    """Forever: each connection to the listener joined to a new one to the gateway (made in this thread's
    namespace, the host's)."""
    while True:
        inside, _ = listener.accept()
        try:
            outside = socket.create_connection(gateway)
        except OSError:
            inside.close()
            continue
        for source, target in ((inside, outside), (outside, inside)):
            threading.Thread(target=_pump, args=(source, target), daemon=True).start()


def _pump(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(CHUNK):
            target.sendall(data)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)


def _start_agent(argv: list[str], parent: int, jail: AgentJail) -> None:
    """In the forked child: die with the thread that forked it, confine itself, then become the agent."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)
    try:
        variables, warnings = confine_agent(jail)
        for warning in warnings:
            print(f"rlfabric agent jail: {warning}", file=sys.stderr)
        os.execvpe(argv[0], argv, {**os.environ, **variables})
    except SandboxError as error:
        print(f"rlfabric agent jail: {error}", file=sys.stderr)
    except OSError as error:
        print(f"rlfabric agent jail: cannot run {argv[0]}: {error}", file=sys.stderr)
    os._exit(127)


def main(argv: list[str]) -> int:
    require = argv[:1] == ["--require"]
    argv = argv[1:] if require else argv
    if len(argv) < 4 or argv[2] != "--" or (argv[0] != "-" and ":" not in argv[0]):
        print(
            "usage: python -m rlfabric.agents.jail [--require] HOST:PORT|- JAIL_JSON -- ARGV...",
            file=sys.stderr,
        )
        return 2
    host, _, port = argv[0].rpartition(":")
    gateway = (host, int(port)) if argv[0] != "-" else None
    jail, program = AgentJail.from_json(argv[1]), argv[3:]
    outcome: dict = {}
    exited = threading.Event()

    def agent_in_its_namespace() -> None:  # the thread the agent dies with (PR_SET_PDEATHSIG)
        if gateway is not None:
            try:
                outcome["listener"] = isolated_listener(gateway[1])
            except OSError as error:
                outcome["error"] = error.strerror or str(error)
        parent = os.getpid()
        if "error" not in outcome or not require:
            outcome["pid"] = pid = os.fork()
            if pid == 0:
                _start_agent(program, parent, jail)
            outcome["started"].set()
            outcome["status"] = os.waitpid(pid, 0)[1]
            if (
                jail.uid is not None and os.geteuid() == 0
            ):  # its leftovers (setsid, double forks) hold our pipes
                kill_processes_of(jail.uid)  # (ours to reap: this is their subreaper)
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
        else:
            outcome["started"].set()
        exited.set()

    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # what the agent orphans stays below this
    outcome["started"] = threading.Event()
    threading.Thread(target=agent_in_its_namespace, daemon=True).start()
    outcome["started"].wait()
    if "error" in outcome:
        why = "not root: " if os.geteuid() != 0 else ""
        print(
            f"rlfabric agent jail: cannot isolate the agent from the network ({why}{outcome['error']}); "
            + (
                "agent.require_network_isolation is set, so it does not run"
                if "pid" not in outcome
                else "it has this host's network"
            ),
            file=sys.stderr,
        )
        if "pid" not in outcome:
            return NO_ISOLATION
    elif gateway is not None:
        threading.Thread(target=relay, args=(outcome["listener"], gateway), daemon=True).start()
    exited.wait()
    code = os.waitstatus_to_exitcode(outcome["status"])
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell says it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
