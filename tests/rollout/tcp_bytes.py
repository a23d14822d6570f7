"""Bytes sent between processes over loopback TCP, read from the kernel (tcp_info bytes_sent, through `ss`):
how the tensor-parallel tests and bench show what the actor sends to each vLLM worker."""

from __future__ import annotations

import subprocess
from collections import defaultdict


def tcp_bytes_between_processes() -> dict[tuple[int, int], int]:
    """Bytes sent so far over every established TCP connection of this host, summed per (sender pid, receiver
    pid); 0 stands for a socket whose owner `ss` cannot see."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True).stdout
    sockets, owner = [], {}
    lines = out.splitlines()
    for head, info in zip(lines[::2], lines[1::2], strict=False):
        fields = head.split()
        local, peer = fields[2], fields[3]
        pid = int(head.split("pid=")[1].split(",")[0]) if "pid=" in head else 0
        sent = int(info.split("bytes_sent:")[1].split()[0]) if "bytes_sent:" in info else 0
        owner[local] = pid
        sockets.append((local, peer, sent))
    per_pair: dict[tuple[int, int], int] = defaultdict(int)
    for local, peer, sent in sockets:
        per_pair[(owner[local], owner.get(peer, 0))] += sent
    return dict(per_pair)


def bytes_sent_since(before: dict[tuple[int, int], int], after: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """What each (sender pid, receiver pid) sent between two readings (connections opened meanwhile included)."""
    return {pair: n - before.get(pair, 0) for pair, n in after.items() if n > before.get(pair, 0)}
