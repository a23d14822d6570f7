"""What a service asks of the host it runs on: its CPU thread budget, its resident memory, whether an address
is this machine's own, how to write a list of its cores, and the tokenizer of a model directory. Every role uses
these, so they live below the roles (a trainer importing the launcher or the rollout for them made the packages
lean on each other)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def cpu_thread_budget() -> int:
    """The CPU threads this process may use: its OMP_NUM_THREADS (set by the launcher), else its cores."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return len(os.sched_getaffinity(0))


def current_rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost: addresses only this machine reaches. A host name is not
    resolved (it may resolve to any interface): False."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def index_ranges(indices) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (sorted first): the list syntax of cpusets, taskset and vLLM's core binding."""
    indices = sorted(indices)
    parts, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            parts.append(str(start) if start == index else f"{start}-{index}")
            start = None
    return ",".join(parts)


def trust_remote_code(config) -> bool:
    """model.trust_remote_code (read defensively: the field belongs to the model section's owner)."""
    return bool(getattr(config.model, "trust_remote_code", False))


def check_model_directory(path: str, key: str = "model.path") -> None:
    """ValueError naming `key` unless `path` is a local Hugging Face model directory (it holds config.json);
    checked without importing transformers, so a wrong path fails in a blink."""
    directory = Path(path)
    if not directory.is_dir():
        hub_id = "/" in path and not directory.is_absolute() and not path.startswith(".")
        why = "it looks like a hub id, and rlfabric reads local directories only" if hub_id else "no such directory"
        raise ValueError(f"{key} {path}: {why}; point it at a local Hugging Face model directory (one with "
                         "config.json)")
    if not (directory / "config.json").is_file():
        raise ValueError(f"{key} {path}: no config.json there; point it at a local Hugging Face model directory")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
