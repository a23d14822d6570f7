"""The Node.js lookup agent (examples/agents/node): where node is, and its pinned openai package installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

AGENT_DIR = Path(__file__).parents[2] / "examples" / "agents" / "node"
AGENT = AGENT_DIR / "lookup_agent.mjs"
NODE = shutil.which("node")
NO_NODE = "node is not installed (`make system-deps` installs it)"


def install_node_agent() -> None:
    """The openai package of package-lock.json, installed (npm ci) if missing."""
    if not (AGENT_DIR / "node_modules" / "openai").is_dir():
        npm = shutil.which("npm")
        assert npm, "node is installed but npm is not"
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=AGENT_DIR, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
