"""The docs site builds with `mkdocs build --strict` (every nav page, link, anchor and snippet resolves; config
keys link to their rows), and the README stays a short front door: at most 250 lines, every journey linked
within its first 120."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The pages a newcomer's journeys start at (issue 45): each linked from the README's first 120 lines.
JOURNEYS = ("docs/install.md", "docs/quickstart.md", "docs/your-model-data-reward.md",
            "docs/coming-from-verl-trl.md", "docs/python-api.md", "docs/kubernetes.md", "docs/multi-turn.md",
            "docs/observability.md", "docs/configuration/index.md", "docs/metrics.md", "docs/benchmarks.md",
            "docs/security.md", "docs/faq.md")


def test_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    quickstart = (tmp_path / "quickstart.html").read_text()
    assert "0.189 at step 1" in quickstart, "the README's quickstart section reaches the quickstart page"
    assert "--8&lt;--" not in quickstart and "--8<--" not in quickstart
    assert 'id="actor.lr"' in (tmp_path / "configuration" / "actor.html").read_text()
    # docs/hooks/config_links.py: a quoted key links to its row
    assert 'href="configuration/actor.html#actor.lr"' in (tmp_path / "peer-bench.html").read_text()


def test_readme_is_short_and_links_every_journey_early():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    head = "\n".join(lines[:120])
    missing = [page for page in JOURNEYS if f"]({page})" not in head]
    assert not missing, f"journeys not linked from the README's first 120 lines: {missing}"
