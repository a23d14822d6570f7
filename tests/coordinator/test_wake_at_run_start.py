"""A run that does not sleep its replicas (trainer.colocated false) still wakes one that a stopped colocated
run left asleep, before its first weight sync: else the sync fills freed weights and generation waits for a
wake-up that never comes."""

from __future__ import annotations

import asyncio

from rlfabric.launch.inprocess import InProcessMesh
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config


def test_a_run_that_is_not_colocated_wakes_a_replica_left_asleep(tiny_model, tmp_path):
    config = fast_config(tiny_model, "trainer.total_steps=1", "trainer.colocated=false")

    async def scenario():
        async with InProcessMesh(config, tmp_path / "run") as mesh:
            rollout = mesh.engine("rollout-0")
            await rollout.sleep(2)  # as a colocated run leaves it when stopped mid-step
            assert rollout.status().sleeping
            await mesh.coordinator.start_run()
            updates = [update async for update in mesh.coordinator.stream_metrics(from_step=1)]
            return updates, await mesh.coordinator.run_status(), rollout.status()

    updates, status, rollout_status = asyncio.run(asyncio.wait_for(scenario(), timeout=180))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert [u.step for u in updates] == [1] and not rollout_status.sleeping
    assert rollout_status.weight_version > 0
