"""Process trees of the sandboxes (the custom reward worker, rlfabric.reward.custom_worker, and the
python tool's runner, rlfabric.env.python_runner): a child subreaper, killing every descendant of a
process, telling cheaply whether anything forked, and a memory bound on a whole tree.

A child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER) keeps its orphaned descendants: a process
whose parent exits is reparented to the nearest subreaper ancestor instead of init. So every process
started below it stays its descendant, one that called setsid() or double-forked into a daemon too,
and kill_descendants reaches it.

MemoryBound keeps the memory of all a sandbox's processes together under a limit (RLIMIT_AS bounds
each process alone, and four processes of 250 MiB each pass a 256 MiB RLIMIT_AS): a cgroup v1 memory
controller child of this process's own cgroup where one can be made (root, the cgroup file system
writable: the kernel then enforces the limit, page cache and tmpfs pages included), else counting
the tree's proportional set size (Pss) every TREE_CHECK_S and killing it past the limit. A
Kubernetes pod's cgroup file system is read-only, so there it counts. A cgroup v2 child with the
memory controller needs a cgroup without processes of its own (moving the service into a leaf of its
own first); that is not done here: on cgroup v2 the tree is counted too.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
MIB = 1024 * 1024
# How often a supervisor checks its sandbox's memory while user code runs: the cgroup's OOM count (a
# read), or without a cgroup the tree's Pss (a scan of the process table, so less often, and only where
# something forked). RLIMIT_AS still caps each process meanwhile, so between checks the tree holds at
# most its processes' count times the limit.
MEMORY_CHECK_S = 0.05
TREE_CHECK_S = 0.2
CGROUP_PREFIX = "rlfabric-sandbox-"


def set_child_subreaper() -> bool:
    """Makes this process a child subreaper: its orphaned descendants are reparented to it, not to
    init. Linux only (prctl PR_SET_CHILD_SUBREAPER, kernel 3.4+); False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
            return True
        error = ctypes.get_errno()
    except (OSError, AttributeError) as exc:
        error = exc
    print(
        f"rlfabric sandbox: cannot become a child subreaper ({error}); processes that user code "
        "starts in a session of their own may outlive it",
        file=sys.stderr,
    )
    return False


def kill_descendants(pid: int, timeout_s: float = 5.0, spare: int | None = None) -> int:
    """SIGKILLs every live descendant of process `pid` but `spare` (whose descendants are killed too),
    again and again until none is left (they may fork meanwhile; a killed process cannot). Returns how
    many kill signals were sent.

    `pid` must be this process or an unreaped child of it (so the number cannot have been reused).
    Killed processes stay zombies until their parent reaps them; a child subreaper `pid` ends up
    their parent. Gives up after timeout_s (a fork bomb outrunning it; RLIMIT_NPROC makes that rare).
    """
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return 0
    sent = 0
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            live = [p for p in root.children(recursive=True) if p.pid != spare and _running(p)]
        except psutil.NoSuchProcess:
            return sent
        if not live or time.monotonic() > deadline:
            return sent
        for process in live:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()  # psutil checks that the pid still names the same process
                sent += 1
        time.sleep(0.001)  # let the signals land before looking again


def end_supervisor(supervisor: subprocess.Popen, exit_s: float) -> int:
    """Ends a sandbox supervisor's call (the reward worker's, the python tool's): kills every process below
    it, again until it exits (it reaps them, cleans up and exits as its child did), and returns its exit code.
    A supervisor still starting up may fork its child meanwhile: that one is killed too, as long as it lives.
    One still there after exit_s is frozen first (SIGSTOP: it forks nothing more), its tree and session
    killed, then itself, so that nothing it started outlives it as an orphan. It must lead its own session."""
    deadline = time.monotonic() + exit_s
    while True:
        kill_descendants(supervisor.pid)
        try:
            return supervisor.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                break
    with contextlib.suppress(ProcessLookupError):
        os.kill(supervisor.pid, signal.SIGSTOP)
    kill_descendants(supervisor.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(supervisor.pid, signal.SIGKILL)
    supervisor.kill()
    return supervisor.wait()


def reap_children() -> int:
    """Reaps every child of this process that has ended, without waiting; how many."""
    reaped = 0
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            reaped += 1
    return reaped


def wait_for_children(pid: int, keep: int | None, timeout_s: float = 1.0) -> bool:
    """Waits until process `pid` has no child but `keep`, zombies included (its reaper reaps them);
    False if some remain after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = [child for child in psutil.Process(pid).children() if child.pid != keep]
        except psutil.NoSuchProcess:
            return True
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


class ForkCounter:
    """The number of tasks (processes and threads) started on this machine since boot, read from
    /proc/stat ("processes"): while it stands still nothing forked, so a supervisor skips the scan of
    the process table (milliseconds) after an item that started nothing. The last pid would not do:
    it wraps around (pid_max may be 32768), so code could fork until it reads as before."""

    def __init__(self):
        try:
            self._fd: int | None = os.open("/proc/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def read(self) -> int | None:
        """The count now; None where /proc/stat cannot say (then every check scans)."""
        if self._fd is None:
            return None
        data, offset = b"", 0
        while True:  # (past 64 KiB on machines with many CPUs and interrupts)
            chunk = os.pread(self._fd, 1 << 16, offset)
            data += chunk
            start = data.find(b"\nprocesses ")
            end = data.find(b"\n", start + 1) if start >= 0 else -1
            if end >= 0:
                return int(data[start + 11 : end])
            if not chunk:
                return None
            offset += len(chunk)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class MemoryBound:
    """Keeps all of a sandbox's processes together under limit_mb (see the module docstring).

    Made by the supervisor (root where a cgroup is to be made) before it forks the confined process;
    that process joins `cgroup` (join_cgroup) before it drops its privileges. The supervisor then
    calls check(its own pid) while user code runs, and close() once every process of it has ended.
    """

    _names = itertools.count()

    def __init__(self, limit_mb: int | None, use_cgroup: bool):
        self.limit_mb = limit_mb or None
        self.cgroup = ""
        """The cgroup directory the confined process joins; empty = the tree is counted instead."""
        self.warning = ""
        """Why no cgroup bounds it (a limit was asked for, use_cgroup was on, and none could be made)."""
        self._forks: ForkCounter | None = None  # (opened at the first check: no confined child inherits it)
        self._quiet_forks: int | None = None  # the fork count when the tree last held one process
        self._next_scan = 0.0
        self._oom_control: int | None = None  # the cgroup's memory.oom_control, opened at the first check
        if self.limit_mb and use_cgroup:
            try:
                self.cgroup = _make_memory_cgroup(self.limit_mb * MIB, next(self._names))
            except OSError as error:
                self.warning = (
                    f"no memory cgroup for the sandbox ({error}): its memory limit ({self.limit_mb} MiB, "
                    f"all its processes together) is enforced by counting its processes' memory every "
                    f"{TREE_CHECK_S:g} s instead"
                )

    def check(self, root: int) -> str:
        """Why the sandbox (the descendants of process `root`) is past its limit, or '' if it is not.
        With a cgroup: the kernel's OOM killer killed one of its processes. Counted: the processes'
        Pss together exceed the limit (a single process is left to its RLIMIT_AS)."""
        if not self.limit_mb:
            return ""
        if self.cgroup:
            if self._oom_control is None:  # kept open: a pread costs microseconds, an open a hundred
                path = os.path.join(self.cgroup, "memory.oom_control")
                self._oom_control = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            killed = _oom_kills(self._oom_control)
            if not killed:
                return ""
            return (
                f"the sandbox went past its memory limit of {self.limit_mb} MiB (all its processes "
                f"together): the kernel killed {killed} of its processes"
            )
        if time.monotonic() < self._next_scan:
            return ""
        self._next_scan = time.monotonic() + TREE_CHECK_S
        self._forks = self._forks or ForkCounter()
        forks = self._forks.read()
        if forks is not None and forks == self._quiet_forks:
            return ""
        try:
            processes = psutil.Process(root).children(recursive=True)
        except psutil.NoSuchProcess:
            return ""
        if len(processes) <= 1:
            self._quiet_forks = forks
            return ""
        held = sum(_proportional_size(process) for process in processes)
        if held <= self.limit_mb * MIB:
            return ""
        return (
            f"the sandbox went past its memory limit of {self.limit_mb} MiB: its {len(processes)} "
            f"processes held {held / MIB:.0f} MiB together"
        )

    def close(self) -> None:
        """Remove the cgroup (its processes have ended) and the counter's descriptor."""
        if self._forks is not None:
            self._forks.close()
        if self._oom_control is not None:
            os.close(self._oom_control)
            self._oom_control = None
        if self.cgroup:
            _remove_cgroup(self.cgroup)
            self.cgroup = ""


def join_cgroup(cgroup: str) -> None:
    """Moves this process into `cgroup` (before it drops its privileges); its children follow."""
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _proportional_size(process: psutil.Process) -> int:
    """Pss in bytes (pages shared after a fork count once in all), or the rss where smaps_rollup is missing."""
    try:
        with open(f"/proc/{process.pid}/smaps_rollup", "rb") as rollup:
            for line in rollup:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # gone, or no smaps_rollup (Linux < 4.14)
        pass
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        return process.memory_info().rss
    return 0


def _own_memory_cgroup_v1() -> str:
    """This process's directory in the cgroup v1 memory hierarchy; OSError where there is none."""
    with open("/proc/self/cgroup") as cgroups:
        paths = [line.rstrip("\n").split(":", 2) for line in cgroups]
    path = next((p for _, controllers, p in paths if "memory" in controllers.split(",")), None)
    if path is None:
        raise OSError("no cgroup v1 memory controller (cgroup v2 would need a delegated subtree)")
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            after = fields[fields.index("-") + 1 :]
            if after[0] == "cgroup" and "memory" in after[2].split(","):
                mount_root, mount_point = fields[3], fields[4]
                relative = os.path.relpath(path, mount_root) if mount_root != "/" else path.lstrip("/")
                return os.path.normpath(os.path.join(mount_point, relative))
    raise OSError("the cgroup v1 memory controller is not mounted")


def _make_memory_cgroup(limit_bytes: int, serial: int) -> str:
    """A new memory cgroup below this process's own, limited to limit_bytes (swap included where the
    kernel accounts it); the ones left by dead processes are removed first."""
    parent = _own_memory_cgroup_v1()
    _remove_stale_cgroups(parent)
    cgroup = os.path.join(parent, f"{CGROUP_PREFIX}{os.getpid()}-{serial}")
    os.mkdir(cgroup, 0o755)
    try:
        with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w") as limit:
            limit.write(str(limit_bytes))
        with contextlib.suppress(FileNotFoundError):  # no swap accounting
            with open(os.path.join(cgroup, "memory.memsw.limit_in_bytes"), "w") as limit:
                limit.write(str(limit_bytes))
    except OSError:
        _remove_cgroup(cgroup)
        raise
    return cgroup


def _remove_stale_cgroups(parent: str) -> None:
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in entries:
            if not entry.name.startswith(CGROUP_PREFIX):
                continue
            owner = entry.name.removeprefix(CGROUP_PREFIX).split("-")[0]
            if owner.isdigit() and not psutil.pid_exists(int(owner)):
                with contextlib.suppress(OSError):
                    os.rmdir(entry.path)  # refused while processes are still in it


def _remove_cgroup(cgroup: str) -> None:
    for _ in range(100):  # the last processes may take a moment to leave it
        try:
            os.rmdir(cgroup)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def _oom_kills(oom_control: int) -> int:
    """How many processes of the cgroup the kernel's OOM killer has killed (under_oom on old kernels), read
    from its open memory.oom_control."""
    try:
        text = os.pread(oom_control, 4096, 0).decode()
    except OSError:
        return 0
    fields = dict(line.split() for line in text.splitlines() if line.strip())
    if "oom_kill" in fields:
        return int(fields["oom_kill"])
    return int(fields.get("under_oom", 0))
