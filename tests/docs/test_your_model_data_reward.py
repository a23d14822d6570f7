"""docs/your-model-data-reward.md as a user follows it: the page's marked bash blocks, run as they are
written in a folder that holds the repository's examples/, train two steps on the tiny model with the
example reward, whose extra metric must reach metrics.jsonl; the page's Python excerpts are the example
files' own lines, and its YAML snippets are valid config. Page and test cannot drift: the commands are
read from the page."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlfabric.core.config import config_from_dict

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "your-model-data-reward.md"
MARKER = "<!-- tests/docs/test_your_model_data_reward.py runs this block -->"


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def marked_commands(text: str) -> list[str]:
    """The bash blocks right after the marker line."""
    return re.findall(rf"^{re.escape(MARKER)}\n```bash\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_the_pages_excerpts_are_the_example_files_and_its_yaml_is_valid_config():
    text = PAGE.read_text()
    sources = (ROOT / "examples" / "rewards" / "capitals.py").read_text() + (
        ROOT / "examples" / "rewards" / "capitals_trl.py").read_text()
    excerpts = fenced_blocks(text, "python")
    assert len(excerpts) == 2 and all(excerpt in sources for excerpt in excerpts)
    snippets = fenced_blocks(text, "yaml")
    assert len(snippets) == 2
    for snippet in snippets:
        config_from_dict(yaml.safe_load(snippet))  # a stale or mistyped key is a ConfigError
    assert len(marked_commands(text)) == 3


@pytest.mark.slow
def test_the_tutorials_commands_train_and_log_the_rewards_extra_metric(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the page runs from a clone's root
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for commands in marked_commands(PAGE.read_text()):
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{commands}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    check = metric_lines(tmp_path / "runs" / "capitals-check")
    assert [line["step"] for line in check] == [1, 2]
    assert all(0.0 <= line["reward_extra/exact_match/mean"] <= 1.0 for line in check)
    rollouts = [json.loads(line) for line in (tmp_path / "runs" / "capitals-check" / "rollouts" / "step_1.jsonl")
                .read_text().splitlines()]
    assert rollouts and not any(row["score_failed"] for row in rollouts)  # the reward scored every response
    assert {row["data_source"] for row in rollouts} == {"capitals"}
    trl = metric_lines(tmp_path / "runs" / "capitals-trl")
    assert [line["step"] for line in trl] == [1] and trl[0]["reward/score_failed/count"] == 0
