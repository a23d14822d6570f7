"""The quickstart model in the machine's model cache (rlfabric.core.model_cache): its warm start trains for
a while (400 steps, tens of CPU seconds), so it is built once per machine and each run dir gets a copy.

The cache entry's name carries a digest of what decides the weights: the sources of the tiny model, the
warm start and its examples, and the torch and transformers versions. Changing any of them builds a new
entry; an entry is never rebuilt in place. Nothing here imports torch (the launchers call it).
"""

from __future__ import annotations

import hashlib
import shutil
from importlib import metadata
from pathlib import Path

from rlfabric.core.model_cache import DONE_MARKER, built_once, cache_root, is_built

PACKAGE = Path(__file__).resolve().parents[1]  # the rlfabric package
SOURCES = ("quickstart/tiny_model.py", "quickstart/warm_start.py", "reward/find_vowel.py")
LIBRARIES = ("torch", "transformers")


# What decides the lookup model's weights besides SOURCES: its warm start, the episodes it renders and the task.
LOOKUP_SOURCES = (*SOURCES, "quickstart/lookup_warm_start.py", "rollout/agent_loop.py", "env/lookup.py",
                  "env/items.py")


def _digest(sources: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for source in sources:
        digest.update((PACKAGE / source).read_bytes())
    for library in LIBRARIES:
        digest.update(f"{library}=={metadata.version(library)}".encode())
    return digest.hexdigest()[:16]


def cache_name(seed: int = 0, moe: bool = False) -> str:
    """quickstart[-moe]-seed<seed>-<digest of SOURCES and LIBRARIES' versions>."""
    return f"quickstart{'-moe' if moe else ''}-seed{seed}-{_digest(SOURCES)}"


def cached_directory(seed: int = 0, moe: bool = False) -> Path:
    """Where the cache holds (or will hold) the quickstart model of `seed` (moe: its tiny Qwen3-MoE twin)."""
    return cache_root() / cache_name(seed, moe)


def is_cached(seed: int = 0, moe: bool = False) -> bool:
    return is_built(cached_directory(seed, moe))


def cached_quickstart_model(seed: int = 0, moe: bool = False) -> Path:
    """The quickstart model's directory in the cache, built (make_quickstart_model) on first use."""
    from rlfabric.quickstart.warm_start import make_quickstart_model

    return built_once(cache_name(seed, moe), lambda directory: make_quickstart_model(directory, seed=seed, moe=moe),
                      about={"built_by": "rlfabric.quickstart.warm_start.make_quickstart_model", "seed": seed,
                             "moe": moe})


def copy_cached(seed: int, out_dir: Path) -> Path:
    """A copy of the cached model in out_dir (a run's own: nothing the run does reaches the cache)."""
    shutil.copytree(cached_directory(seed), out_dir, ignore=shutil.ignore_patterns(DONE_MARKER), dirs_exist_ok=True)
    return out_dir.resolve()


def cached_lookup_model(seed: int = 0, steps: int = 500, call_fraction: float = 1.0) -> Path:
    """make_lookup_model's model (the lookup task's warm start: 1,100 steps for its LEARNER, over a minute of
    CPU) in the cache, built on first use. A run reads model.path and writes only into its run dir."""
    from rlfabric.quickstart.lookup_warm_start import make_lookup_model

    name = f"lookup-seed{seed}-steps{steps}-calls{call_fraction:g}-{_digest(LOOKUP_SOURCES)}"
    return built_once(name, lambda directory: make_lookup_model(directory, seed=seed, steps=steps,
                                                                call_fraction=call_fraction),
                      about={"built_by": "rlfabric.quickstart.lookup_warm_start.make_lookup_model", "seed": seed,
                             "steps": steps, "call_fraction": call_fraction})
