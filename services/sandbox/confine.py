"""The confinement of user code: what the scorer of rlfabric.reward.custom_worker and the runner of
rlfabric.env.python_runner do to themselves before they run any of it, and the helpers their
supervisors need. The two sandboxes never share a uid, a cgroup or a /tmp.

When the service runs as root (the case this is built for):
- network: a network namespace of its own (unshare CLONE_NEWNET) with no interface but a loopback that
  is down: no connection anywhere, the services on this host included;
- identity: a uid of its own, claimed by the supervisor from the sandbox's range (uid .. uid +
  uid_count - 1; claim_uid): one per reward worker, one per python tool call, never one a process of
  anything else runs as. So user code can signal (kill(-1) included) and count against RLIMIT_NPROC
  only its own processes, not the other sandbox's nor another worker's. No supplementary groups, the
  configured gid, no_new_privs (a setuid binary gains nothing): it cannot read root's 0600 files (the
  token file), nor signal, trace or read the memory and descriptors of the service or its supervisor;
- files: with private_tmp (the default), empty tmpfs of its own on /tmp, /var/tmp and /dev/shm (a
  mount namespace), gone when it ends; a long-lived process (the reward scorer) empties them and its
  working directory after each item (clear_temp_files), so no call sees what an earlier one wrote;
  else (and where no mount namespace can be made) the supervisor deletes what its uid left in them
  when it ends (UidClaim.release);
- memory: all its processes together under memory_limit_mb (rlfabric.sandbox.process_tree.MemoryBound:
  a cgroup where one can be made, else counting the tree), each one also under RLIMIT_AS;
- environment: PATH, HOME and TMPDIR (a private, empty working directory), the variables the
  interpreter needs to start, and what the config lists; nothing else of the service's environment;
- limits: RLIMIT_AS (memory_limit_mb), NPROC (per uid: the worker's or call's processes and threads),
  FSIZE, NOFILE, CORE 0, and CPU, renewed before each item (RLIMIT_CPU counts a process's whole life,
  and a worker scores many items); a process the function starts inherits the limit of the moment.
Not root: the namespaces come with a user namespace of its own where the kernel allows unprivileged
ones; the uid stays the service's, so the code can read what the service can and signal its
supervisor; RLIMIT_NPROC is not set (it would count the service's own threads), and files it leaves
in /tmp cannot be told from the service's. The supervisor renews the scorer's hard CPU limit where it
has CAP_SYS_RESOURCE (root usually has it, Docker's default capability set does not); without it the
scorer renews a soft limit itself, which user code could raise (the per-item timeout still bounds the
scorer). Each step that cannot be done is a warning the pool logs once, except a refused network
namespace with require_network_isolation, and a refused uid change as root: those are load errors.

Still reachable from inside: files readable by every uid (checkpoints written with umask 022 are),
world-writable directories other than those three (/run/lock), and unix sockets in the file system
that the uid may connect to.

Why no bubblewrap (bwrap), which gives mount, pid and user namespaces, a private /tmp and
--die-with-parent: run as root it keeps the caller's uid (its --uid needs a user namespace that maps
the sandbox uid to root outside), and run as the sandbox uid it must exec a Python that uid can read
(not so where the interpreter lives under /root, mode 0700: the installed modules are imported here
as root before the uid drop). The reward scorer is one forked, long-lived process per worker whose
replies the supervisor checks by pid; bwrap would mean a new interpreter per worker inside it, and it
offers no per-item cleanup, no memory bound on a tree, no uid allocation and no rlimits: all stay
ours. And where bwrap could not run (a Kubernetes pod: no CAP_SYS_ADMIN, the runtime's seccomp
profile refuses user namespaces, /proc is masked so a new proc cannot be mounted) this code is needed
anyway. What bwrap would add is a few lines here: unshare(CLONE_NEWNS) and three tmpfs mounts.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import math
import os
import resource
import shutil
import stat
import sys
import tempfile

import psutil

from rlfabric.sandbox.process_tree import join_cgroup

CLONE_NEWNS = 0x00020000  # <linux/sched.h>
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000  # <linux/mount.h>
PR_SET_NO_NEW_PRIVS = 38  # <linux/prctl.h>
CAP_SYS_RESOURCE = 24  # <linux/capability.h>
MIB = 1024 * 1024

# What the interpreter needs to start (and to start another Python); nothing secret.
INTERPRETER_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH")
# The world-writable directories every uid may leave files in: private tmpfs with private_tmp, else
# cleared of the sandbox uid's files when it ends.
SHARED_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
# Where claimed uids are locked (one file per uid, flock held by the claiming supervisor): /run is root's.
UID_LOCK_DIRS = ("/run/rlfabric-sandbox-uids", os.path.join(tempfile.gettempdir(), "rlfabric-sandbox-uids-0"))


# Whether this process mounted private SHARED_TEMP_DIRS (mount_private_temp_dirs): only then may
# clear_temp_files empty them whole.
_private_temp_dirs = False


class SandboxError(RuntimeError):
    """A confinement step that must not be skipped failed; the worker reports it as a load error."""


def worker_environment() -> dict[str, str]:
    """The environment the pool starts a worker with: the interpreter's variables of this process only."""
    return {name: os.environ[name] for name in INTERPRETER_VARIABLES if name in os.environ}


def user_variables(env: dict[str, str], passthrough: list[str]) -> dict[str, str]:
    """The variables the config gives user code: env, plus the service's own of the passthrough names."""
    return {**{name: os.environ[name] for name in passthrough if name in os.environ}, **env}


class UidClaim:
    """A uid this process holds for one sandbox (a lock on its file in UID_LOCK_DIRS); no other claim
    gets it until release() or this process's death."""

    def __init__(self, uid: int, lock_fd: int):
        self.uid = uid
        self._lock_fd = lock_fd

    def release(self) -> None:
        """Delete what the uid left in SHARED_TEMP_DIRS and free it. Its processes must be dead (the
        supervisor, a child subreaper, killed every one: none can have left its tree)."""
        if self._lock_fd < 0:
            return
        remove_files_of(self.uid)
        os.close(self._lock_fd)  # (the lock goes with it)
        self._lock_fd = -1


def claim_uid(first: int, count: int) -> UidClaim:
    """A uid of first .. first + count - 1 that no other claim holds (in any process of this machine)
    and no process runs as (else it is not the sandbox's alone: a leftover of a supervisor that was
    killed, or a user of the host), its files in SHARED_TEMP_DIRS deleted: the range must be the
    sandbox's alone. Root only. SandboxError when every one is taken."""
    lock_dir = _uid_lock_dir()
    in_use: set[int] | None = None  # read once a lock is held (a scan of every process: milliseconds)
    for uid in range(first, first + count):
        fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (per open file: two claims of one process exclude)
        except BlockingIOError:
            os.close(fd)
            continue
        in_use = _uids_in_use() if in_use is None else in_use
        if uid in in_use:
            os.close(fd)
            continue
        remove_files_of(uid)  # left by a holder that died before its release
        return UidClaim(uid, fd)
    raise SandboxError(
        f"no free uid for the sandbox in {first}..{first + count - 1}: each is claimed by another worker "
        "or call, or a process runs as it (raise uid_count, or move the range)"
    )


def kill_processes_of(uid: int, rounds: int = 20) -> int:
    """SIGKILL every live process whose real or effective uid is `uid` (an agent's tree that escaped its
    launcher: double forks, setsid), again until none is left (one may fork while the others die; RLIMIT_NPROC
    bounds how many it can make); how many were killed. Zombies are left to their parents."""
    killed = 0
    for _ in range(rounds):
        victims = []
        for process in psutil.process_iter(["uids", "status"]):
            uids = process.info["uids"]
            if uids and uid in (uids.real, uids.effective) and process.info["status"] != psutil.STATUS_ZOMBIE:
                victims.append(process)
        if not victims:
            break
        for process in victims:
            with contextlib.suppress(psutil.Error):
                process.kill()
                killed += 1
        psutil.wait_procs(victims, timeout=1.0)
    return killed


def _uids_in_use() -> set[int]:
    uids = set()
    for process in psutil.process_iter(["uids"]):
        if process.info["uids"]:
            uids.update(process.info["uids"])
    return uids


def _uid_lock_dir() -> str:
    """The first of UID_LOCK_DIRS that is (or can be made) a directory of root's alone."""
    for path in UID_LOCK_DIRS:
        with contextlib.suppress(OSError):
            os.makedirs(path, mode=0o700, exist_ok=True)
            info = os.lstat(path)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and not info.st_mode & 0o077:
                return path
    tried = ", ".join(UID_LOCK_DIRS)
    raise SandboxError(f"no directory of root's alone to lock the sandbox's uids in (tried {tried})")


def remove_files_of(uid: int, directories: tuple[str, ...] = SHARED_TEMP_DIRS) -> None:
    """Deletes every entry of `directories` that `uid` owns (a directory with all it holds). Its processes
    must be dead: rmtree does not follow symbolic links, and nothing of the uid can swap them meanwhile."""
    for directory in directories:
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if info.st_uid != uid:
                        continue
                    if stat.S_ISDIR(info.st_mode):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)


def make_workdir(uid: int, gid: int) -> str:
    """A new empty directory, owned by the sandbox uid when running as root; the scorer's cwd and HOME."""
    workdir = tempfile.mkdtemp(prefix="rlfabric-sandbox-")
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


def confine(
    sandbox: dict, memory_limit_mb: int | None, workdir: str, hard_cpu_limit: bool, cgroup: str = ""
) -> list[str]:
    """Confine this process (the scorer, single-threaded) as the module docstring says; the warnings.

    `sandbox` is a CustomSandboxConfig as a dict, its "uid" the one claimed for this sandbox, plus
    "variables" (user_variables). `cgroup` is the MemoryBound's cgroup to join ('' = none). Raises
    SandboxError where a step must not be skipped.
    """
    warnings: list[str] = []
    as_root = os.geteuid() == 0
    # First: a user namespace (not root) can only be made by a single-threaded process.
    warnings += enter_namespaces(sandbox, memory_limit_mb, workdir, as_root)
    if cgroup:  # while this process may still write there
        join_cgroup(cgroup)
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
            f"the service does not run as root, so user code runs as its uid {os.getuid()}: it can "
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


def enter_namespaces(sandbox: dict, memory_limit_mb: int | None, workdir: str, as_root: bool) -> list[str]:
    """The network namespace (unless allow_network) and the private temp dirs (with private_tmp) of the
    sandbox, in one unshare; the warnings. SandboxError for a refused network namespace with
    require_network_isolation."""
    network, mounts = not sandbox["allow_network"], sandbox["private_tmp"]
    if not (network or mounts):
        return []
    if not sys.platform.startswith("linux"):
        error = "no namespaces outside Linux"
    else:
        error = _unshare((CLONE_NEWNET if network else 0) | (CLONE_NEWNS if mounts else 0), as_root)
    warnings = []
    if error and network:
        warning = f"cannot isolate user code from the network: {error}; it has this host's network"
        if sandbox["require_network_isolation"]:
            raise SandboxError(f"{warning} (custom_sandbox.require_network_isolation is set)")
        warnings.append(warning)
    if mounts and not error:
        error = mount_private_temp_dirs(memory_limit_mb, workdir)
    if mounts and error:
        kept = "deleted when it ends" if as_root else "left there (not root: no uid of its own tells it apart)"
        warnings.append(
            f"no private {', '.join(SHARED_TEMP_DIRS)} for user code ({error}): what it writes there is {kept}"
        )
    return warnings


def _unshare(flags: int, as_root: bool) -> str:
    """Move this process into new namespaces (`flags`); as not root inside a user namespace of its own
    that maps its uid and gid to themselves. Why not, or ''."""
    uid, gid = os.getuid(), os.getgid()  # (in a new user namespace they read as unmapped)
    if _libc().unshare(flags if as_root else flags | CLONE_NEWUSER) != 0:
        how = "unshare" if as_root else "unshare with a user namespace, not being root,"
        return f"{how} failed ({os.strerror(ctypes.get_errno())})"
    if not as_root:
        maps = {"uid_map": f"{uid} {uid} 1", "setgroups": "deny", "gid_map": f"{gid} {gid} 1"}
        for name, text in maps.items():  # in this order: gid_map only after setgroups is denied
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    return ""


def mount_private_temp_dirs(memory_limit_mb: int | None, workdir: str) -> str:
    """In this process's new mount namespace: an empty tmpfs (each at most memory_limit_mb) on each of
    SHARED_TEMP_DIRS, and the working directory made again inside if it was there. Why not, or ''."""
    libc = _libc()
    owner = os.stat(workdir)
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # nothing propagates to the host
        return f"mount --make-rprivate / failed ({os.strerror(ctypes.get_errno())})"
    options = b"mode=1777" + (b",size=%dm" % memory_limit_mb if memory_limit_mb else b"")
    for directory in SHARED_TEMP_DIRS:
        if os.path.isdir(directory) and libc.mount(
            b"tmpfs", directory.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options
        ) != 0:
            return f"mounting a tmpfs on {directory} failed ({os.strerror(ctypes.get_errno())})"
    if not os.path.isdir(workdir):  # it was in the host's /tmp, now hidden: the same path, empty, in ours
        os.makedirs(workdir, mode=0o700)
        os.chown(workdir, owner.st_uid, owner.st_gid)
    global _private_temp_dirs
    _private_temp_dirs = True
    return ""


def clear_temp_files(workdir: str, own_uid: bool) -> None:
    """After an item, in the confined process: empty the working directory (cwd, HOME, TMPDIR) and, where
    they are this process's own tmpfs, SHARED_TEMP_DIRS (the working directory itself stays); else, with
    `own_uid` (root dropped to the sandbox's uid), delete what that uid has there. Neither: the working
    directory only (the uid is the service's, whose files there are not the item's)."""
    _remove_entries(workdir)
    if _private_temp_dirs:
        for directory in SHARED_TEMP_DIRS:
            _remove_entries(directory, keep=workdir)
    elif own_uid:
        remove_files_of(os.getuid())


def _remove_entries(directory: str, keep: str = "") -> None:
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if keep and (entry.path == keep or keep.startswith(entry.path + os.sep)):
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)


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
