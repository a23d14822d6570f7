"""What a subprocess or command agent's process does to itself before it execs the agent (in the child
rlfabric.agents.jail forks), and the paths it must still reach.

    spec = AgentJail(uid=64320, gid=65534, private_tmp=True, limits=Limits(...), reachable=reachable_paths(argv))
    warnings = confine_agent(spec)      # in the forked child, as root; then exec

As root, in this order:
- a mount namespace of its own (unshare CLONE_NEWNS, / made private): with private_tmp, empty tmpfs on /tmp,
  /var/tmp and /dev/shm (each at most memory_limit_mb);
- the paths it must reach (the interpreter's installation, its program, its entrypoint's folder, its working
  directory) kept reachable by the sandbox uid: one that lay under a private temp dir, or below a directory other
  uids may not pass (here the interpreter lives under /root, mode 0700), is bound back at its own path (a
  read-only bind, made from a descriptor opened before the mounts) on a fresh tmpfs of mode 0755 laid over that
  directory. So the rest of /root stays hidden, the token file included, while Python starts;
- RLIMIT_DATA (memory_limit_mb), NPROC (per uid), CPU (SIGXCPU, SIGKILL a second later), NOFILE, FSIZE, CORE 0.
  DATA, not AS as the reward scorer has: it counts the private writable memory a process maps, so a hog still
  fails, but not address space reserved and never written: V8 reserves ~10 GiB per WebAssembly instance, and
  node's fetch (undici's llhttp is WebAssembly) died with "Out of memory: Cannot allocate Wasm memory" under an
  RLIMIT_AS of 4 GiB (it ran at 16);
- no supplementary groups, gid, then the claimed uid (real, effective and saved), then no_new_privs.
HOME and TMPDIR are the private /tmp. Not root (uid None): the namespaces come with a user namespace where the
kernel allows one (rlfabric.sandbox.confine), the limits but NPROC are set, and the uid stays the service's.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import resource
import shutil
import stat
import sys
from dataclasses import dataclass, field

from rlfabric.sandbox.confine import (
    CLONE_NEWNS,
    MIB,
    MS_NODEV,
    MS_NOSUID,
    MS_PRIVATE,
    MS_REC,
    PR_SET_NO_NEW_PRIVS,
    SHARED_TEMP_DIRS,
    SandboxError,
    _unshare,
    drop_privileges,
)

MS_RDONLY, MS_REMOUNT, MS_BIND = 0x1, 0x20, 0x1000  # <linux/mount.h>


@dataclass
class Limits:
    """The agent.* resource limits of each agent process."""

    memory_limit_mb: int = 4096
    max_processes: int = 128
    max_open_files: int = 1024
    max_file_mb: int = 256
    cpu_limit_s: int = 600


@dataclass
class AgentJail:
    """How the launcher confines an agent before exec (besides the network, jail.py's): passed as JSON."""

    uid: int | None = None  # the claimed sandbox uid; None = stay the service's
    gid: int = 65534
    private_tmp: bool = True
    limits: Limits | None = None
    reachable: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> AgentJail:
        values = json.loads(text)
        limits = values.pop("limits")
        return cls(**values, limits=Limits(**limits) if limits is not None else None)


def reachable_paths(argv: list[str], entrypoint_dir: str = "", working_dir: str = "") -> list[str]:
    """What an agent must still reach: this interpreter's installation and import path (a Python agent runs
    the same one), rlfabric's own package, the program argv[0] names (and, when it is another venv's
    interpreter, that venv and its base installation), the files its arguments name, the entrypoint's folder
    and the working directory; resolved, existing, none below another."""
    import rlfabric

    paths = [
        sys.base_prefix,
        sys.prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        os.path.dirname(os.path.realpath(rlfabric.__path__[0])),
        *(entry for entry in sys.path if entry),
    ]
    program = shutil.which(argv[0]) if argv else None
    if program:
        paths.append(os.path.dirname(os.path.realpath(program)))
        venv = os.path.dirname(os.path.dirname(os.path.abspath(program)))
        if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
            # Another venv's interpreter (a link into its base installation, e.g. verifiers' side venv): the link,
            # the venv's packages and the base installation's standard library.
            paths += [venv, os.path.dirname(os.path.dirname(os.path.realpath(program)))]
    paths += [os.path.dirname(os.path.abspath(arg)) for arg in argv[1:] if os.path.isfile(arg)]
    paths += [entrypoint_dir, working_dir or os.getcwd()]
    resolved = sorted({os.path.realpath(path) for path in paths if path and os.path.isdir(path)})
    # A temp dir itself (a script's folder when it runs from /tmp) or above one: what it holds is asked for alone.
    resolved = [
        path
        for path in resolved
        if not any(
            directory == path or directory.startswith(path.rstrip("/") + "/")
            for directory in SHARED_TEMP_DIRS
        )
    ]
    kept: list[str] = []
    for path in resolved:  # sorted: a folder comes before what it holds
        if not any(path == parent or path.startswith(parent.rstrip("/") + "/") for parent in kept):
            kept.append(path)
    return kept


def confine_agent(jail: AgentJail) -> tuple[dict[str, str], list[str]]:
    """Confine this (single-threaded, forked) process as the module docstring says: (the variables to set in
    the agent's environment, the warnings). SandboxError where the uid cannot be changed as root."""
    as_root = os.geteuid() == 0
    warnings: list[str] = []
    variables: dict[str, str] = {}
    limits = jail.limits
    if jail.private_tmp or jail.uid is not None:
        error = _unshare(CLONE_NEWNS, as_root) if sys.platform.startswith("linux") else "not Linux"
        if not error:
            error = _mount_private_view(jail, limits.memory_limit_mb if limits else 0, warnings)
        if error:
            what = (
                f"it shares the host's {', '.join(SHARED_TEMP_DIRS)}"
                if jail.private_tmp
                else "paths below directories closed to its uid stay out of its reach"
            )
            warnings.append(f"no mount namespace for the agent ({error}): {what}")
        elif jail.private_tmp:
            variables.update(HOME="/tmp", TMPDIR="/tmp")
    if limits is not None:
        _set_limits(limits, as_root and jail.uid is not None)
    if jail.uid is not None and as_root:
        drop_privileges(jail.uid, jail.gid)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    return variables, warnings


def _mount_private_view(jail: AgentJail, memory_limit_mb: int, warnings: list[str]) -> str:
    """In this process's new mount namespace: the private temp dirs, and jail.reachable bound back where the
    sandbox uid could not reach them. Why not, or ''."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return f"mount --make-rprivate / failed ({os.strerror(ctypes.get_errno())})"
    # Held open before the tmpfs hide them, and in this namespace (a bind from another's is EINVAL).
    holds = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in jail.reachable if os.path.isdir(path)}
    try:
        return _lay_out(libc, jail, holds, memory_limit_mb, warnings)
    finally:
        for descriptor in holds.values():
            os.close(descriptor)


def _lay_out(
    libc: ctypes.CDLL, jail: AgentJail, holds: dict[str, int], memory_limit_mb: int, warnings: list[str]
) -> str:
    blocked = {
        path: _closed_ancestor(path) if jail.uid is not None else "" for path in holds
    }  # (before they hide)
    size = b",size=%dm" % memory_limit_mb if memory_limit_mb else b""
    covered: list[str] = []  # tmpfs of ours: the temp dirs, and the directories laid over
    if jail.private_tmp:
        for directory in SHARED_TEMP_DIRS:
            if os.path.isdir(directory):
                if _mount_tmpfs(libc, directory, b"mode=1777" + size):
                    return f"mounting a tmpfs on {directory} failed ({os.strerror(ctypes.get_errno())})"
                covered.append(directory)
    if jail.uid is None and not covered:
        return ""
    for path, descriptor in holds.items():
        hidden = any(path.startswith(directory + "/") for directory in covered)
        closed = blocked[path]
        if not hidden and not closed:
            continue
        if closed and not any(closed == d or closed.startswith(d + "/") for d in covered):
            if _mount_tmpfs(libc, closed, b"mode=0755,size=1m"):
                warnings.append(
                    f"cannot lay a tmpfs over {closed} ({os.strerror(ctypes.get_errno())}): the agent "
                    f"cannot reach {path}"
                )
                continue
            covered.append(closed)
        os.makedirs(path, mode=0o755, exist_ok=True)
        target = path.encode()
        if (
            libc.mount(f"/proc/self/fd/{descriptor}".encode(), target, None, MS_BIND | MS_REC, None) != 0
            or libc.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) != 0
        ):
            warnings.append(f"cannot bind {path} for the agent ({os.strerror(ctypes.get_errno())})")
    if jail.uid is not None:
        for path in holds:
            mode = os.stat(path).st_mode
            if not mode & stat.S_IROTH or not mode & stat.S_IXOTH:
                warnings.append(
                    f"uid {jail.uid} cannot read {path} (mode {stat.S_IMODE(mode):o}): the agent may "
                    "fail to start; make it readable to other users"
                )
    return ""


def _mount_tmpfs(libc: ctypes.CDLL, directory: str, options: bytes) -> int:
    return libc.mount(b"tmpfs", directory.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options)


def _closed_ancestor(path: str) -> str:
    """The topmost directory above `path` that other users may not pass (no o+x), or ''."""
    parts = path.strip("/").split("/")
    for end in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:end])
        with contextlib.suppress(OSError):
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                return ancestor
    return ""


def _set_limits(limits: Limits, own_uid: bool) -> None:
    """Hard limits too: the agent cannot raise them back."""
    values = {
        resource.RLIMIT_NOFILE: limits.max_open_files,
        resource.RLIMIT_FSIZE: limits.max_file_mb * MIB,
        resource.RLIMIT_CORE: 0,
    }
    if limits.memory_limit_mb:
        values[resource.RLIMIT_DATA] = limits.memory_limit_mb * MIB
    if own_uid:  # NPROC counts per uid: only a uid of the episode's own makes it the agent's limit
        values[resource.RLIMIT_NPROC] = limits.max_processes
    for kind, value in values.items():
        _, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = limits.cpu_limit_s if hard == resource.RLIM_INFINITY else min(limits.cpu_limit_s, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1 if hard == resource.RLIM_INFINITY else hard))


__all__ = ["AgentJail", "Limits", "SandboxError", "confine_agent", "reachable_paths"]
