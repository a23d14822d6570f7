"""Smoke test of the real entry point: `python -m rlfabric serve actor` with two ranks, then SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from rlfabric.actor.client import ActorClient
from rlfabric.core.client import wait_until_serving
from tests.trainer.helpers import make_batch
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_serve_actor_with_two_ranks_then_sigterm(tiny_model, tmp_path):
    config = {"model": {"path": str(tiny_model)}, "rollout": {"n": 2},
              "actor": {"world_size": 2, "ppo_mini_batch_size": 2}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    port_file = tmp_path / "ports.json"
    log = open(tmp_path / "actor.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "rlfabric", "serve", "actor", "--config", str(tmp_path / "run.yaml"),
         "--port", "0", "--metrics-port", "0", "--port-file", str(port_file)],
        cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert process.poll() is None, (tmp_path / "actor.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ports = json.loads(port_file.read_text())
        address = f"127.0.0.1:{ports['grpc']}"
        batch = make_batch(rows=4)

        async def talk():
            await wait_until_serving(address, timeout_s=90)
            async with ActorClient(address) as actor:
                status = await actor.get_status()
                old = (await actor.compute_log_probs(batch))["log_probs"]
                metrics = await actor.update_policy({**batch, "old_log_probs": old, "advantages": torch.ones(4, 5)})
                return status, metrics

        status, metrics = asyncio.run(talk())
        assert status.world_size == 2 and metrics["actor/grad_norm"] > 0
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).read().decode()
        assert 'rlfabric_train_tokens_total{role="actor"}' in exposition
        ranks = _children(process.pid)
        assert len(ranks) == 1  # rank 1, started by the service
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        wait_until(lambda: not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], 10,
                   "rank 1 to exit with the service")
        assert "Traceback" not in (tmp_path / "actor.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()
        log.close()


def _children(parent: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                children.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return children
