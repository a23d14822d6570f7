"""Process trees of the custom reward sandbox (rlfabric.reward.custom_worker): a child subreaper,
and killing every descendant of a process.

A child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER) keeps its orphaned descendants: a process
whose parent exits is reparented to the nearest subreaper ancestor instead of init. So every process
started below it stays its descendant, one that called setsid() or double-forked into a daemon too,
and kill_descendants reaches it. No cgroup or PID namespace needed (containers rarely may create them).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


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
        f"rlfabric custom reward worker: cannot become a child subreaper ({error}); processes that the "
        "reward function starts in a session of their own may outlive a timeout",
        file=sys.stderr,
    )
    return False


def kill_descendants(pid: int, timeout_s: float = 5.0) -> int:
    """SIGKILLs every live descendant of process `pid`, again and again until none is left (they may
    fork meanwhile; a killed process cannot). Returns how many kill signals were sent.

    `pid` must be this process or an unreaped child of it (so the number cannot have been reused).
    Killed processes stay zombies until their parent reaps them; a child subreaper `pid` ends up
    their parent. Gives up after timeout_s (a fork bomb outrunning it).
    """
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return 0
    sent = 0
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            live = [process for process in root.children(recursive=True) if _running(process)]
        except psutil.NoSuchProcess:
            return sent
        if not live or time.monotonic() > deadline:
            return sent
        for process in live:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()  # psutil checks that the pid still names the same process
                sent += 1
        time.sleep(0.001)  # let the signals land before looking again


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
