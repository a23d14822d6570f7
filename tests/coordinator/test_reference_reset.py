"""Reference resets (reference.sync_ref_model, TRL's name for TR-DPO's): every reference.ref_model_sync_steps steps,
after that step's actor update, the reference takes the actor's weights. A real run on the in-process mesh (a gloo
group between its actor and reference engines), the reference's log-probs taken beside the actor's in each step."""

from __future__ import annotations

import asyncio
import dataclasses

from rlfabric.launch.inprocess import InProcessMesh
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config


class BesideTheActor:
    """The run's reference client; each of its log-prob passes (phase 2 of a step, before the step's update) also
    asks the actor on the same batch and keeps the largest gap between the two."""

    def __init__(self, reference, actor):
        self.reference, self.actor = reference, actor
        self.gaps: list[float] = []

    def __getattr__(self, name):
        return getattr(self.reference, name)

    async def compute_log_probs(self, batch, *args, **kwargs):
        ours = (await self.reference.compute_log_probs(batch, *args, **kwargs))["log_probs"]
        actors = (await self.actor.compute_log_probs(batch, *args))["log_probs"]
        self.gaps.append(float((ours - actors)[batch["response_mask"].bool()].abs().max()))
        return {"log_probs": ours}


def test_every_second_step_the_reference_takes_the_actors_weights(tiny_model, tmp_path):
    config = fast_config(tiny_model, "trainer.total_steps=3", "actor.use_kl_loss=true", "actor.lr=1e-3",
                         "reference.sync_ref_model=true", "reference.ref_model_sync_steps=2",
                         "reference.ref_model_mixup_alpha=1.0")
    watched: list[BesideTheActor] = []

    def beside_the_actor(peers):
        watched.append(BesideTheActor(peers.reference, peers.actor))
        return dataclasses.replace(peers, reference=watched[-1])

    async def scenario():
        async with InProcessMesh(config, tmp_path / "run", wrap_peers=beside_the_actor) as mesh:
            await mesh.coordinator.start_run()
            metrics = {update.step: dict(update.metrics) async for update in mesh.coordinator.stream_metrics(1)}
            reference_version = mesh.engine("reference").weight_sync.weight_version
            return metrics, await mesh.coordinator.run_status(), reference_version

    metrics, status, reference_version = asyncio.run(scenario())
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    step_1, step_2, step_3 = watched[0].gaps
    assert step_1 < 1e-5  # both hold the initial weights
    assert step_2 > 1e-3  # the actor trained at step 1, the reference was not reset
    assert step_3 < 1e-5  # right after step 2's reset, before step 3's update
    assert ["timing_s/sync_ref_model" in metrics[step] for step in (1, 2, 3)] == [False, True, False]
    assert reference_version == metrics[2]["rollout/weight_version"]  # step 2's policy
