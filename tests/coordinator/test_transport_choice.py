"""weight_sync.transport auto is chosen at run start from the devices the services report, over real services
on loopback. This host has no GPU, so the engines' device reports are faked, and so is the CUDA IPC of the
same-device path (FakeIpcSharing, which lends CPU buffers within this process): one GPU for actor and rollout
(a one-GPU machine with the defaults) trains over the same-device path, cuda_ipc; nccl forced onto it is refused
by StartRun, naming the key, before the run starts; a GPU each gives nccl."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.errors import FailedPrecondition
from rlfabric.rollout import hf_engine
from rlfabric.trainer import engine as actor_engine
from rlfabric.v1 import coordinator_pb2
from rlfabric.weight_sync import cuda_ipc
from rlfabric.weight_sync.cuda_ipc import FakeIpcSharing
from rlfabric.weight_sync.devices import DeviceReport
from tests.coordinator.meshes import fast_config, over_grpc
from tests.weight_sync.helpers import Mesh

GPU_A = DeviceReport("cuda:0", "GPU-0c9e8a44-0000-4000-8000-00000000000a")
GPU_B = DeviceReport("cuda:0", "GPU-0c9e8a44-0000-4000-8000-00000000000b")  # cuda:0 of another process


def fake_devices(monkeypatch, actor: DeviceReport, rollout: DeviceReport) -> None:
    """What the actor's and the hf rollout's device reports would say on a GPU machine."""
    monkeypatch.setattr(actor_engine, "report_of", lambda device, init_cuda=True: actor)
    monkeypatch.setattr(hf_engine, "report_of", lambda device, init_cuda=True: rollout)


def chosen(caplog) -> list[dict]:
    return [record.fields for record in caplog.records if record.getMessage() == "weight-sync transport chosen"]


def test_one_gpu_with_the_defaults_trains_over_the_same_device_path(tiny_model, tmp_path, monkeypatch, caplog):
    fake_devices(monkeypatch, GPU_A, GPU_A)
    lent = FakeIpcSharing()
    monkeypatch.setattr(cuda_ipc, "sharing_for", lambda device: lent)
    caplog.set_level(logging.INFO, logger="rlfabric.coordinator.weight_sync")
    config = fast_config(tiny_model, "trainer.total_steps=1")

    async def scenario():
        async with over_grpc(config, tmp_path / "run") as coordinator:
            await coordinator.start_run()
            updates = [update async for update in coordinator.stream_metrics(from_step=1)]
            return updates, await coordinator.run_status(), config.cluster.rollout[0]

    updates, status, rollout = asyncio.run(asyncio.wait_for(scenario(), timeout=180))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert [update.step for update in updates] == [1]
    # The step's sync, phase by phase: the actor packed and lent, the replica copied and switched, no CRC-32.
    metrics = updates[0].metrics
    assert all(metrics[f"timing_s/update_weights/{phase}"] > 0 for phase in ("pack", "wire", "receive_wire", "apply"))
    assert metrics["timing_s/update_weights/checksum"] == metrics["timing_s/update_weights/receive_checksum"] == 0
    assert chosen(caplog) == [{"transport": "cuda_ipc", "why": f"the actor and {rollout} share GPU {GPU_A.uuid}"}]
    assert lent._lent  # the actor lent its staging buffers


def test_nccl_forced_onto_one_gpu_is_refused_before_the_run_starts(tiny_model, tmp_path, monkeypatch):
    fake_devices(monkeypatch, GPU_A, GPU_A)
    config = fast_config(tiny_model, "weight_sync.transport=nccl")

    async def scenario():
        async with over_grpc(config, tmp_path / "run") as coordinator:
            with pytest.raises(FailedPrecondition) as refused:
                await coordinator.start_run()
            return refused.value, await coordinator.run_status()

    error, status = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert "weight_sync.transport nccl cannot run on these devices: the actor and" in str(error)
    assert "set weight_sync.transport to auto or gloo" in str(error)
    assert status.state == coordinator_pb2.RUN_STATE_UNSPECIFIED and status.step == 0  # no run began


def test_a_gpu_each_gives_nccl_and_the_reports_cross_the_wire(tiny_model, monkeypatch):
    fake_devices(monkeypatch, GPU_A, GPU_B)
    config = fast_config(tiny_model)
    mesh = Mesh(config, {"rollout-0": config})
    try:
        plane = WeightSyncPlane(mesh.actor_client, mesh.addresses, config)
        choice = mesh.run(plane.choose_transport())
        assert (choice.transport, choice.reason) == ("nccl", "every member holds a GPU of its own")
        assert plane.transport == "nccl"
        mesh.run(plane.close())
    finally:
        mesh.stop()
