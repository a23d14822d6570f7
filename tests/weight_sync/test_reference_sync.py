"""The reference receives the actor's weights (reference resets, reference.sync_ref_model), here with two FSDP2
ranks: rank 0 receives, every rank loads its shard; and it mixes them in by reference.ref_model_mixup_alpha."""

from __future__ import annotations

import pytest
import torch

from rlfabric.coordinator.weight_sync import SyncReport, WeightSyncPlane
from rlfabric.reference.client import ReferenceClient
from tests.trainer.helpers import make_batch

from .helpers import Mesh, mesh_config


async def _sync(mesh: Mesh, version: int) -> SyncReport:
    plane = WeightSyncPlane(mesh.actor_client, {}, mesh.config, reference=mesh.reference.address)
    try:
        return await plane.sync(version)
    finally:
        await plane.close()


async def _sync_and_compare(mesh: Mesh) -> tuple[float, float, int]:
    batch = make_batch()
    async with ReferenceClient(mesh.reference.address) as reference:
        before = (await reference.compute_log_probs(batch))["log_probs"]  # leaves the FSDP2 root unsharded
        report = await _sync(mesh, 1)
        assert report.ok, report.failed
        after = (await reference.compute_log_probs(batch))["log_probs"]
        version = (await reference.get_status()).weight_version
    actor = (await mesh.actor_client.compute_log_probs(batch))["log_probs"]
    return float((before - actor).abs().max()), float((after - actor).abs().max()), version


@pytest.mark.slow  # a process per rank
def test_a_two_rank_reference_loads_the_actors_weights(tiny_model):
    config = mesh_config(tiny_model, "weight_sync.transport=gloo", "reference.world_size=2",
                         "reference.ref_model_mixup_alpha=1.0")
    mesh = Mesh(config, {}, reference=True)
    try:
        mesh.train_step(seed=3)
        before, after, version = mesh.run(_sync_and_compare(mesh))
    finally:
        mesh.stop()
    assert before > 0.01 and after < 1e-5 and version == 1


def test_the_reference_mixes_what_it_receives_in_by_alpha(tiny_model):
    """TR-DPO's update, ref = alpha * policy + (1 - alpha) * ref, with alpha 0.25."""
    config = mesh_config(tiny_model, "weight_sync.transport=gloo", "reference.ref_model_mixup_alpha=0.25")
    mesh = Mesh(config, {}, reference=True)
    try:
        mesh.train_step(seed=3)
        reference = mesh.reference.server.service.engine
        # copies: on CPU the gathered tensors are the model's own, which the sync overwrites
        before = {name: tensor.clone() for name, tensor in mesh.run(reference.gather_weights()).items()}
        report = mesh.run(_sync(mesh, 1))
        after = mesh.run(reference.gather_weights())
        actor = mesh.run(mesh.actor.server.service.engine.gather_weights())
    finally:
        mesh.stop()
    assert report.ok, report.failed
    assert max(float((actor[name] - before[name]).abs().max()) for name in actor) > 1e-3  # the actor trained
    for name, tensor in actor.items():
        torch.testing.assert_close(after[name], 0.25 * tensor + 0.75 * before[name], rtol=0, atol=1e-6)
