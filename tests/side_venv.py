"""A virtual environment of its own for a package whose pins clash with the dev install (VeRL, verifiers), for
the tests that run that package's own code beside rlfabric's.

    VERL = SideVenv("verl", "0.9.1", ("verl==0.9.1", "tensordict==0.10.0", ...), "import verl.trainer.ppo.core_algos")
    python = VERL.python()      # built on first use, once per machine, Python and package list

The packages are installed with --no-deps; everything else comes from this interpreter's site-packages (those of
`host_modules`, after the venv's own) through a .pth line, so torch is not installed twice. The venv lives under
~/.cache/rlfabric/<name>-venv/ (RLFABRIC_CACHE or XDG_CACHE_HOME move it) and is built by this interpreter's pip
(`pip --python`, pip >= 22.3) from the package index pip is configured for, in place (a console script's shebang
names its venv), under a lock; a marker written last tells a finished venv from an interrupted build.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

READY_MARKER = ".rlfabric-ready"


@dataclass(frozen=True)
class SideVenv:
    name: str
    version: str
    packages: tuple[str, ...]
    """Installed with --no-deps: the package itself and, pinned, what it needs that the host lacks or holds at
    another version."""
    check: str
    """Python code the finished venv must run (an import of what the tests use)."""
    host_modules: tuple[str, ...] = ("numpy",)
    """Modules whose site-packages directories the venv's .pth line adds."""

    def host_site_dirs(self) -> list[str]:
        dirs = [str(Path(importlib.import_module(m).__file__).resolve().parents[1]) for m in self.host_modules]
        return list(dict.fromkeys(dirs))

    def directory(self) -> Path:
        """Where the venv for this version, package list, Python and host site-packages lives (a new one when any
        changes)."""
        root = os.environ.get("RLFABRIC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlfabric"
        key = "\n".join([self.version, sys.version, *self.packages, *self.host_site_dirs()])
        digest = hashlib.sha256(key.encode()).hexdigest()[:10]
        return Path(root) / f"{self.name}-venv" / f"{self.name}-{self.version}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"

    def python(self) -> Path:
        """The venv's interpreter, building the venv on first use. RuntimeError, with pip's or Python's output,
        when it cannot be built."""
        target = self.directory()
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building it right now
            if not (target / READY_MARKER).exists():
                shutil.rmtree(target, ignore_errors=True)  # an interrupted earlier build
                self._build(target)
                (target / READY_MARKER).write_text(f"{self.name}=={self.version}\n")
        return target / "bin" / "python"

    def _build(self, target: Path) -> None:
        _run([sys.executable, "-m", "venv", "--without-pip", str(target)], f"creating the {self.name} venv")
        python = target / "bin" / "python"
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        Path(site, "rlfabric-host.pth").write_text("\n".join(self.host_site_dirs()) + "\n")
        _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--quiet",
              "--disable-pip-version-check", *self.packages], f"installing {self.name}")
        _run([str(python), "-c", self.check], f"checking the {self.name} venv ({self.check})")


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {' '.join(command)}\n{done.stdout}\n{done.stderr}")
