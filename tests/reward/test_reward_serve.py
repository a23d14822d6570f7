"""Smoke test of the real entry point: `python -m rlfabric serve reward` scores, exports its
metrics, never loads torch, and exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlfabric.core.client import wait_until_serving
from rlfabric.core.errors import ResourceExhausted
from rlfabric.reward import STATUS_OK, ScoreItem
from rlfabric.reward.client import RewardClient

CONFIG = """\
reward:
  compute_score_kwargs: {method: flexible}
  default_score_for_unknown: 0.25
  max_items_per_request: 4
"""


@pytest.fixture
def served(tmp_path):
    config, port_file = tmp_path / "run.yaml", tmp_path / "ports.json"
    config.write_text(CONFIG)
    command = [
        sys.executable,
        "-m",
        "rlfabric",
        "serve",
        "reward",
        "--config",
        str(config),
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--port-file",
        str(port_file),
    ]
    # Without an LD_PRELOAD an in-process vLLM engine of an earlier test may have left in os.environ
    # (vLLM's CPU platform preloads torch's libgomp): the light image's process has none.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert process.poll() is None, f"serve exited {process.returncode}: {process.stdout.read()}"
        assert time.monotonic() < deadline, "no port file within 60 s"
        time.sleep(0.05)
    yield process, json.loads(port_file.read_text())
    if process.poll() is None:
        process.kill()
        process.wait()


def test_serve_reward_entry_point(served):
    process, ports = served
    address = f"127.0.0.1:{ports['grpc']}"

    async def talk():
        await wait_until_serving(address, timeout_s=60)
        async with RewardClient(address) as client:
            results = await client.score(
                [ScoreItem("openai/gsm8k", "it is 72", "72"), ScoreItem("foo", "", "")]
            )
            with pytest.raises(ResourceExhausted, match="5 items in one request"):
                await client.score([ScoreItem("openai/gsm8k", "1", "1")] * 5)
            return results, await client.status()

    results, status = asyncio.run(talk())
    # The config file reached the engine: flexible GSM8K matching and a default for unknown sources.
    assert [(r.status, r.score) for r in results] == [(STATUS_OK, 1.0), (STATUS_OK, 0.25)]
    assert (status.items_scored, status.items_failed) == (2, 0)
    assert "openai/gsm8k" in status.data_sources

    metrics = (
        urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5).read().decode()
    )
    assert "rlfabric_reward_items_total 2.0" in metrics
    assert 'rlfabric_reward_failures_total{reason="timeout"} 0.0' in metrics

    # The light image has no torch: a rule-based reward process must not load it.
    maps = Path(f"/proc/{ports['pid']}/maps").read_text()
    assert "libtorch" not in maps and "torch/lib" not in maps

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
