"""The quickstart model is built once per machine (rlfabric.quickstart.cached) and each run dir gets a copy
of its own; the model cache (rlfabric.core.model_cache) builds an entry once, under a lock, and replaces only
its own unfinished builds."""

from __future__ import annotations

import hashlib
import shutil
import threading

import pytest

from rlfabric.core import model_cache
from rlfabric.launch import local
from rlfabric.quickstart import cached

pytestmark = pytest.mark.slow  # one warm start (~20-40 s of CPU) into a fresh cache


def digests(directory) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())
            if path.is_file()}


def test_the_quickstart_model_is_built_once_per_machine_and_each_run_gets_a_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFABRIC_CACHE", str(tmp_path / "cache"))
    first = local.build_tiny_model(tmp_path / "run-a")
    entry = cached.cached_directory()
    assert model_cache.is_built(entry) and (first / "config.json").exists()
    assert not (first / model_cache.DONE_MARKER).exists()  # the run's copy is a model dir, not a cache entry
    built = digests(entry)
    assert {k: v for k, v in built.items() if k != model_cache.DONE_MARKER} == digests(first)

    def no_build(*args, **kwargs):
        raise AssertionError(f"the cached model was built again: {args}")

    monkeypatch.setattr(local.subprocess, "run", no_build)
    second = local.build_tiny_model(tmp_path / "run-b")
    assert digests(second) == digests(first)
    (second / "model.safetensors").write_bytes(b"a run's own change")  # reaches neither the cache nor run-a
    assert digests(entry) == built and digests(first) != digests(second)
    assert local.build_tiny_model(tmp_path / "run-b") == second.resolve()  # a run dir keeps its model
    assert (second / "model.safetensors").read_bytes() == b"a run's own change"


def test_the_cache_entry_follows_what_decides_the_weights(tmp_path, monkeypatch):
    """A change to the warm start's source names another entry; the seed and the MoE twin do too."""
    name = cached.cache_name()
    assert name == cached.cache_name() and name != cached.cache_name(seed=1) and name != cached.cache_name(moe=True)
    package = tmp_path / "package"
    for source in cached.SOURCES:
        (package / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(cached.PACKAGE / source, package / source)
    monkeypatch.setattr(cached, "PACKAGE", package)
    assert cached.cache_name() == name
    with (package / "quickstart" / "warm_start.py").open("a") as source:
        source.write("\n# a changed warm start\n")
    assert cached.cache_name() != name


def test_an_entry_is_built_once_by_concurrent_callers_and_an_unfinished_build_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFABRIC_CACHE", str(tmp_path / "cache"))
    root = model_cache.cache_root()
    (root / ".thing.building").mkdir(parents=True)  # an earlier build that was killed
    (root / ".thing.building" / "half").write_text("x")
    (root / "thing").mkdir()  # renamed, but without its marker: not built
    builds = []

    def build(directory):
        builds.append(directory.name)
        directory.mkdir()
        (directory / "weights").write_text("w")

    threads = [threading.Thread(target=model_cache.built_once, args=("thing", build, {"kind": "test"}))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert builds == [".thing.building"]
    assert sorted(p.name for p in (root / "thing").iterdir()) == sorted([model_cache.DONE_MARKER, "weights"])
    assert not (root / ".thing.building").exists()
