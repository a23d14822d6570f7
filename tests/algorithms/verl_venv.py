"""A virtual environment holding VeRL itself, for tests that compare rlfabric's algorithm math with VeRL's own
functions (tests/algorithms/test_verl_parity.py).

VeRL is installed with --no-deps, plus only the small packages that importing verl.trainer.ppo.core_algos needs
and rlfabric's environment lacks; torch, numpy and the rest come from this interpreter's site-packages through a
.pth line, so torch is not installed twice. Built once per machine and VeRL version, under
~/.cache/rlfabric/verl-venv/ (RLFABRIC_CACHE or XDG_CACHE_HOME move it), by this interpreter's pip (`pip
--python`, pip >= 22.3) from the package index pip is configured for.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy
import torch

VERL_VERSION = "0.9.1"
# What `import verl.trainer.ppo.core_algos` needs beyond rlfabric's dependencies and dev tools (found by importing
# it in a venv of verl alone): verl/__init__ imports its DataProto (tensordict, which needs pyvers), the configs
# import omegaconf (whose parser needs antlr4), the profiler imports codetiming and orjson. Pinned to what
# verl 0.9.1 (tensordict<=0.10, hydra-core's omegaconf 2.3) and tensordict 0.10 (pyvers<0.2) ask for.
SMALL_DEPS = (
    "tensordict==0.10.0",
    "pyvers>=0.1,<0.2",
    "omegaconf==2.3.0",
    "antlr4-python3-runtime==4.9.3",
    "codetiming>=1.4",
    "orjson>=3.9",
)
READY_MARKER = ".rlfabric-verl-ready"  # written last: a venv without it is incomplete


def _host_site_dirs() -> list[str]:
    """The site-packages directories torch and numpy are imported from (the VeRL venv's .pth lines)."""
    dirs = [str(Path(module.__file__).resolve().parents[1]) for module in (torch, numpy)]
    return list(dict.fromkeys(dirs))


def venv_dir() -> Path:
    """Where the venv for this VeRL version, Python and host site-packages lives (a new one when any changes)."""
    root = os.environ.get("RLFABRIC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlfabric"
    key = "\n".join([VERL_VERSION, sys.version, *SMALL_DEPS, *_host_site_dirs()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return Path(root) / "verl-venv" / f"verl-{VERL_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {' '.join(command)}\n{done.stdout}\n{done.stderr}")


def _build(target: Path) -> None:
    _run([sys.executable, "-m", "venv", "--without-pip", str(target)], "creating the VeRL venv")
    python = target / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "rlfabric-host.pth").write_text("\n".join(_host_site_dirs()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--quiet",
          "--disable-pip-version-check", f"verl=={VERL_VERSION}", *SMALL_DEPS], "installing VeRL")
    _run([str(python), "-c", "import verl.trainer.ppo.core_algos"], "importing verl.trainer.ppo.core_algos")


def verl_python() -> Path:
    """The VeRL venv's interpreter, building the venv on first use (~20 s with a warm pip cache). RuntimeError,
    with pip's or Python's output, when it cannot be built."""
    target = venv_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building it right now
        if not (target / READY_MARKER).exists():
            shutil.rmtree(target, ignore_errors=True)  # an interrupted earlier build
            building = target.parent / f".{target.name}.building"
            shutil.rmtree(building, ignore_errors=True)
            _build(building)
            (building / READY_MARKER).write_text(f"verl=={VERL_VERSION}\n")
            building.rename(target)
    return target / "bin" / "python"
