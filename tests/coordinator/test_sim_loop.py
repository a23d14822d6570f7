"""The real coordinator on 8 simulated rollout replicas and a simulated actor: sync and async runs complete with
staleness, weight versions, checkpoints and metrics as usual, the metrics say the run was simulated, and the phases
take at least the time the cost models give them (in-process, and over gRPC with the grpc weight-sync transport)."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlfabric.sim.trainer_cost import TrainerCost
from rlfabric.sim.weights import SyncCost
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import MESHES, fast_config

STEPS = 3
SIM = ["rollout.engine=sim", "actor.engine=sim", "rollout.replicas=8", "data.max_response_length=64",
       "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "rollout.n=4", f"trainer.total_steps={STEPS}",
       "sim.time_scale=0.01", "sim.trainer.parameters=7000000000", "sim.rollout.failure_rate=0.05",
       "weight_sync.transport=grpc",
       # A part fails all its attempts with probability 0.05 ** attempts: 1e-4 at the default 3, over a run's
       # hundred-odd parts a failed run in ~1% (seen); at 9, 2e-12.
       "trainer.rollout_retries=8"]


async def run(mesh: str, config, run_dir):
    async with MESHES[mesh](config, run_dir) as coordinator:
        await coordinator.start_run()
        updates = [update async for update in coordinator.stream_metrics(from_step=1)]
        return updates, await coordinator.run_status()


@pytest.mark.parametrize(("mesh", "mode"), [("in-process", "sync"), ("in-process", "async"), ("grpc", "sync")])
def test_a_run_on_eight_sim_replicas_completes_as_usual(tiny_model, tmp_path, mesh, mode):
    config = fast_config(tiny_model, *SIM, f"trainer.mode={mode}")
    updates, status = asyncio.run(asyncio.wait_for(run(mesh, config, tmp_path / "run"), timeout=120))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert [u.step for u in updates] == list(range(1, STEPS + 1))
    metrics = [dict(u.metrics) for u in updates]
    staleness = 0 if mode == "sync" else config.trainer.max_staleness
    update_s = TrainerCost.of(config).update_seconds(1)  # per token
    sync = SyncCost.of(config)
    for step, m in enumerate(metrics, 1):
        assert m["sim/simulated"] == 1.0 and m["sim/time_scale"] == 0.01
        assert m["rollout/staleness/max"] <= staleness
        assert m["rollout/weight_version"] == step + 1  # the first sync is version 1, each step's after it
        assert m["timing_s/update"] >= m["sim/actor/tokens"] * update_s * 0.99
        assert m["timing_s/update_weights"] >= (sync.gather_s + sync.wire_s) * 0.99
        assert 0 < m["response_length/mean"] <= 64
        # The router's counts since the last step: injected failures are reworked, nothing arrives twice.
        assert m["rollout/router/rework_samples"] == m["rollout/router/failed_inflight_samples"]
        assert m["rollout/router/duplicate_samples"] == 0
        if mode == "sync":  # only this step's samples were generating
            assert m["rollout/router/requested_samples"] == m["rollout/router/delivered_samples"] == 16 * 4
    checkpoint = json.loads((tmp_path / "run" / "checkpoints" / f"global_step_{STEPS}" / "actor" / "meta.json").read_text())
    assert checkpoint["simulated"] and checkpoint["updates"] == STEPS
