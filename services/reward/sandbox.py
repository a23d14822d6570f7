"""The confinement of user reward code: what the scorer of rlfabric.reward.custom_worker does to itself
before it runs any of it, and the helpers its supervisor needs.

When the service runs as root (the case this is built for):
- network: a network namespace of its own (unshare CLONE_NEWNET) with no interface but a loopback that
  is down: no connection anywhere, the services on this host included;
- identity: no supplementary groups, the configured unprivileged gid and uid (real, effective and
  saved), and no_new_privs (a setuid binary gains nothing). So the code cannot read root's 0600 files
  (the token file), nor signal, trace or read the memory and descriptors of the service or of its
  supervisor (root processes);
- environment: PATH, HOME and TMPDIR (a private, empty working directory), the variables the
  interpreter needs to start, and what the config lists; nothing else of the service's environment;
- limits: RLIMIT_AS (memory_limit_mb), NPROC (counted per uid: every worker's processes and threads
  together), FSIZE, NOFILE, CORE 0, and CPU, renewed before each item (RLIMIT_CPU counts a
  process's whole life, and a worker scores many items); a process the function starts inherits
  the scorer's limit of the moment.
Not root: the network namespace comes with a user namespace of its own where the kernel allows
unprivileged ones; the uid stays the service's, so the code can read what the service can and signal
its supervisor; RLIMIT_NPROC is not set (it would count the service's own threads).
The supervisor renews the scorer's hard CPU limit where it has CAP_SYS_RESOURCE (root usually has it,
Docker's default capability set does not); without it the scorer renews a soft limit itself, which
user code could raise (the per-item timeout still bounds the scorer). Each step that cannot be done
is a warning the pool logs once, except a refused network namespace with require_network_isolation,
and a refused uid change as root: those are load errors.

Still reachable from inside: files readable by every uid (checkpoints written with umask 022 are),
world-writable directories such as /tmp and /dev/shm (each file capped at max_file_mb, not their
number), and unix sockets in the file system that the uid may connect to.
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
import sys
import tempfile

import psutil

CLONE_NEWUSER = 0x10000000  # <linux/sched.h>
CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38  # <linux/prctl.h>
CAP_SYS_RESOURCE = 24  # <linux/capability.h>
MIB = 1024 * 1024

# What the interpreter needs to start (and to start another Python); nothing secret.
INTERPRETER_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH")


class SandboxError(RuntimeError):
    """A confinement step that must not be skipped failed; the worker reports it as a load error."""


def worker_environment() -> dict[str, str]:
    """The environment the pool starts a worker with: the interpreter's variables of this process only."""
    return {name: os.environ[name] for name in INTERPRETER_VARIABLES if name in os.environ}


def user_variables(env: dict[str, str], passthrough: list[str]) -> dict[str, str]:
    """The variables the config gives user code: env, plus the service's own of the passthrough names."""
    return {**{name: os.environ[name] for name in passthrough if name in os.environ}, **env}


def make_workdir(uid: int, gid: int) -> str:
    """A new empty directory, owned by the sandbox uid when running as root; the scorer's cwd and HOME."""
    workdir = tempfile.mkdtemp(prefix="rlfabric-reward-")
    if os.geteuid() == 0:
        os.chown(workdir, uid, gid)
    return workdir


def can_renew_hard_cpu_limit() -> bool:
    """Whether this process may raise another process's hard limits (CAP_SYS_RESOURCE)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    except OSError:
        pass
    return False


def renew_cpu_limit(scorer: psutil.Process, seconds: int) -> None:
    """Let the scorer use `seconds` more CPU seconds from now: SIGXCPU then, SIGKILL a second later."""
    used = scorer.cpu_times()
    limit = math.ceil(used.user + used.system) + seconds
    resource.prlimit(scorer.pid, resource.RLIMIT_CPU, (limit, limit + 1))


def renew_own_cpu_limit(seconds: int) -> None:
    """Let this process use `seconds` more CPU seconds from now (SIGXCPU then); a soft limit only."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    _set_soft_cpu_limit(math.ceil(used.ru_utime + used.ru_stime) + seconds)


def confine(sandbox: dict, memory_limit_mb: int | None, workdir: str, hard_cpu_limit: bool) -> list[str]:
    """Confine this process (the scorer, single-threaded) as the module docstring says; the warnings.

    `sandbox` is a CustomSandboxConfig as a dict, plus "variables" (user_variables). Raises
    SandboxError where a step must not be skipped.
    """
    warnings: list[str] = []
    as_root = os.geteuid() == 0
    if not sandbox["allow_network"]:
        # First: a user namespace (not root) can only be made by a single-threaded process.
        warning = isolate_network(as_root)
        if warning and sandbox["require_network_isolation"]:
            raise SandboxError(f"{warning} (reward.custom_sandbox.require_network_isolation is set)")
        warnings += [warning] if warning else []
    set_limits(sandbox, memory_limit_mb, as_root, hard_cpu_limit)
    if not hard_cpu_limit:
        warnings.append(
            "the worker lacks CAP_SYS_RESOURCE: RLIMIT_CPU is a soft limit, which user code could "
            "raise (the per-item timeout still holds)"
        )
    os.chdir(workdir)
    interpreter_variables = worker_environment()
    os.environ.clear()
    os.environ.update(interpreter_variables)
    bin_dirs = [os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]
    os.environ.update(PATH=os.pathsep.join(bin_dirs), HOME=workdir, TMPDIR=workdir)
    os.environ.update(sandbox["variables"])
    if as_root:
        drop_privileges(sandbox["uid"], sandbox["gid"])
    else:
        warnings.append(
            f"the reward service does not run as root, so user code runs as its uid {os.getuid()}: it can "
            "read every file the service can and signal the service's processes; no RLIMIT_NPROC either"
        )
    _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    stdlib = os.path.dirname(os.__file__)
    if not os.access(stdlib, os.R_OK | os.X_OK):
        warnings.append(
            f"uid {os.getuid()} cannot read the Python installation ({stdlib}): user code can only "
            "import modules the worker had already imported; make it readable to that uid"
        )
    return warnings


def isolate_network(as_root: bool) -> str:
    """Move this process into a network namespace of its own; a warning saying why not, or ''."""
    if not sys.platform.startswith("linux"):
        return "no network namespaces outside Linux: user code has this host's network"
    uid, gid = os.getuid(), os.getgid()  # (in a new user namespace they read as unmapped)
    flags = CLONE_NEWNET if as_root else CLONE_NEWUSER | CLONE_NEWNET
    if _libc().unshare(flags) != 0:
        error = os.strerror(ctypes.get_errno())
        how = "unshare(CLONE_NEWNET)" if as_root else "unshare(CLONE_NEWUSER | CLONE_NEWNET) without root"
        return (
            f"cannot isolate user code from the network: {how} failed ({error}); it has this host's network"
        )
    if not as_root:  # the same uid and gid inside the new user namespace
        maps = {"uid_map": f"{uid} {uid} 1", "setgroups": "deny", "gid_map": f"{gid} {gid} 1"}
        for name, text in maps.items():  # in this order: gid_map only after setgroups is denied
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    return ""


def set_limits(sandbox: dict, memory_limit_mb: int | None, as_root: bool, hard_cpu_limit: bool) -> None:
    """Set this process's resource limits (hard ones too: user code cannot raise them back)."""
    limits = {
        resource.RLIMIT_FSIZE: sandbox["max_file_mb"] * MIB,
        resource.RLIMIT_NOFILE: sandbox["max_open_files"],
        resource.RLIMIT_CORE: 0,
    }
    if memory_limit_mb:  # a hog gets MemoryError, not the host's OOM killer
        limits[resource.RLIMIT_AS] = memory_limit_mb * MIB
    if as_root:  # NPROC counts per uid: only the sandbox's own uid makes it a limit of user code alone
        limits[resource.RLIMIT_NPROC] = sandbox["max_processes"]
    for kind, limit in limits.items():
        _, hard = resource.getrlimit(kind)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(kind, (limit, limit))
    if hard_cpu_limit:  # SIGXCPU at the soft limit, SIGKILL a second later at the hard one
        resource.setrlimit(resource.RLIMIT_CPU, (sandbox["cpu_limit_s"], sandbox["cpu_limit_s"] + 1))
    else:
        _set_soft_cpu_limit(sandbox["cpu_limit_s"])


def drop_privileges(uid: int, gid: int) -> None:
    """Become uid:gid for good (real, effective and saved ids), with no supplementary groups."""
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        raise SandboxError(f"cannot run user code as uid {uid}, gid {gid}: {exc}") from exc


def _set_soft_cpu_limit(seconds: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(
        resource.RLIMIT_CPU, (seconds if hard == resource.RLIM_INFINITY else min(seconds, hard), hard)
    )


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
