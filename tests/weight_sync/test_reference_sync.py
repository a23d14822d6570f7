"""The reference receives the actor's weights too (at start, when the actor resumed from a checkpoint),
here with two FSDP2 ranks: rank 0 receives, every rank loads its shard."""

from __future__ import annotations

from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.reference.client import ReferenceClient
from tests.actor.helpers import make_batch

from .helpers import Mesh, mesh_config


async def _sync_and_compare(mesh: Mesh) -> tuple[float, float, int]:
    batch = make_batch()
    plane = WeightSyncPlane(mesh.actor_client, {}, mesh.config, reference=mesh.reference.address)
    async with ReferenceClient(mesh.reference.address) as reference:
        before = (await reference.compute_log_probs(batch))["log_probs"]  # leaves the FSDP2 root unsharded
        report = await plane.sync(1)
        assert report.ok, report.failed
        after = (await reference.compute_log_probs(batch))["log_probs"]
        version = (await reference.get_status()).weight_version
    await plane.close()
    actor = (await mesh.actor_client.compute_log_probs(batch))["log_probs"]
    return float((before - actor).abs().max()), float((after - actor).abs().max()), version


def test_a_two_rank_reference_loads_the_actors_weights(tiny_model):
    mesh = Mesh(mesh_config(tiny_model, "weight_sync.transport=gloo", "reference.world_size=2"), {}, reference=True)
    try:
        mesh.train_step(seed=3)
        before, after, version = mesh.run(_sync_and_compare(mesh))
    finally:
        mesh.stop()
    assert before > 0.01 and after < 1e-5 and version == 1
