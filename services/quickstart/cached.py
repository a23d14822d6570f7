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


def cache_name(seed: int = 0, moe: bool = False) -> str:
    """quickstart[-moe]-seed<seed>-<digest of SOURCES and LIBRARIES' versions>."""
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update((PACKAGE / source).read_bytes())
    for library in LIBRARIES:
        digest.update(f"{library}=={metadata.version(library)}".encode())
    return f"quickstart{'-moe' if moe else ''}-seed{seed}-{digest.hexdigest()[:16]}"


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
