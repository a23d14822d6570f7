"""weight_sync.delta end to end: a short GRPO run on the tiny model over real services on loopback (gloo, a
bfloat16 rollout): after the run's first sync, which sends the full weights, every step's sync sends only the
change, and the step metrics say how much (weight_sync/delta_bytes of weight_sync/full_bytes)."""

from __future__ import annotations

import asyncio

from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config, over_grpc

STEPS = 3


def test_a_run_with_weight_sync_delta_sends_only_the_change(tiny_model, tmp_path):
    config = fast_config(tiny_model, "weight_sync.delta=true", "rollout.dtype=bfloat16", "actor.lr=1e-6",
                         f"trainer.total_steps={STEPS}")

    async def scenario():
        async with over_grpc(config, tmp_path / "run") as coordinator:
            await coordinator.start_run()
            updates = [update async for update in coordinator.stream_metrics(from_step=1)]
            return updates, await coordinator.run_status()

    updates, status = asyncio.run(asyncio.wait_for(scenario(), timeout=240))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert [update.step for update in updates] == list(range(1, STEPS + 1))
    for update in updates:  # each step's sync follows an earlier one: a delta
        metrics = update.metrics
        assert 0 < metrics["weight_sync/delta_bytes"] < metrics["weight_sync/full_bytes"], dict(metrics)
        assert metrics["weight_sync/delta_ratio"] < 0.5 and metrics["weight_sync/delta_fallback_full"] == 0
        assert metrics["weight_sync/gbytes"] * 1e9 == metrics["weight_sync/delta_bytes"]
