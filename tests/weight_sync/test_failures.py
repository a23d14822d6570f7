"""Failure behaviour and dtypes: a receiver killed mid-sync gives a bounded error and is dropped, a
restarted one rejoins, and float32 actor weights arrive cast to a bfloat16 rollout."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.quickstart.tiny_model import make_tiny_model
from rlfabric.rollout.router import RolloutRouter
from tests.numerics import ENGINE_LOGPROB_GAP

from .helpers import Mesh, RolloutProcess, logprob_gap, mesh_config

pytestmark = pytest.mark.slow

TIMEOUT_S = 5.0  # weight_sync.timeout_s of these meshes
SLACK_S = 10.0  # what sync() may take beyond it


@pytest.fixture(scope="module")
def bigger_model(tmp_path_factory):
    """~9.5 M parameters (38 MB in float32): a bucket is several times the loopback socket buffers,
    so a stopped receiver really stalls the broadcast half-way."""
    return make_tiny_model(tmp_path_factory.mktemp("bigger-model"), hidden_size=384, num_layers=4,
                           num_heads=12, intermediate_size=1536)


async def _plane(mesh: Mesh, receivers: dict[str, str]) -> WeightSyncPlane:
    """The plane over `receivers`, serving the coordinator's rollout router over the same replicas (made on the
    mesh's loop, where its channels live)."""
    router = RolloutRouter(list(receivers.values()))
    return WeightSyncPlane(mesh.actor_client, receivers, mesh.config, serving=router)


@pytest.mark.parametrize("transport", ["gloo", "grpc"])
def test_a_receiver_killed_mid_sync_fails_in_bounded_time_and_is_left_out(transport, bigger_model, tmp_path):
    """gloo also restarts the replica (new process, new port): it rejoins and is current after one sync."""
    config = mesh_config(bigger_model, f"weight_sync.transport={transport}", f"weight_sync.timeout_s={TIMEOUT_S}")
    mesh = Mesh(config, {"live": config})
    victim = RolloutProcess(config, tmp_path, "victim")
    restarted = None
    try:
        victim.wait_ready(mesh.loop)
        plane = mesh.run(_plane(mesh, {**mesh.addresses, "victim": victim.address}))
        assert mesh.run(plane.open()) == {}
        assert mesh.run(plane.sync(1)).ok

        # 1. Freeze the victim so the sync stalls on it half-way through a bucket, then kill it.
        os.kill(victim.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        sync = asyncio.run_coroutine_threadsafe(plane.sync(2), mesh.loop.loop)
        time.sleep(1.0)
        victim.kill()
        report = sync.result(timeout=TIMEOUT_S * 4 + SLACK_S)
        assert time.monotonic() - started < TIMEOUT_S + SLACK_S
        assert "victim" in report.failed, report
        if transport == "grpc":  # independent streams: the live replica got version 2 regardless
            assert "live" not in report.failed and report.paused_seconds["live"] >= 0
        if transport == "gloo":  # a supervisor restarts the replica meanwhile
            restarted = RolloutProcess(config, tmp_path, "victim-restarted")

        # 2. The next sync leaves the dead replica out and reaches the live one; the router the plane serves
        #    generates on the live one only, through the clients the plane used (one client per replica).
        report = mesh.run(plane.sync(3))
        assert set(report.failed) == {"victim"} and "unreachable" in report.failed["victim"]
        assert set(report.paused_seconds) == {"live"}
        assert mesh.logprob_gap(mesh.addresses["live"]) <= ENGINE_LOGPROB_GAP
        router = plane.serving
        assert router.excluded() == [victim.address]
        assert [r.address for r in router.healthy()] == [mesh.addresses["live"]]
        assert plane._members["live"].client is router.client_of(mesh.addresses["live"])

        # 3. The restarted replica rejoins under the same name and is current after its first sync.
        if restarted is not None:
            restarted.wait_ready(mesh.loop)
            plane.add_receiver("victim", restarted.address)
            mesh.train_step(seed=5)
            report = mesh.run(plane.sync(4))
            assert report.ok, report.failed
            assert logprob_gap(restarted.address, mesh.actor_client, mesh.loop) <= ENGINE_LOGPROB_GAP
        mesh.run(plane.close())
        mesh.run(router.close())
    finally:
        for process in (victim, restarted):
            if process is not None:
                process.kill()
        mesh.stop()


@pytest.mark.numerics
def test_float32_actor_weights_arrive_cast_to_a_bfloat16_rollout(tiny_model):
    # The actor trains in float32 (model.dtype auto on CPU); the plane asks it for rollout.dtype.
    config = mesh_config(tiny_model, "weight_sync.transport=gloo", "rollout.dtype=bfloat16")
    mesh = Mesh(config, {"bf16": config})
    try:
        plane = mesh.run(_plane(mesh, mesh.addresses))
        mesh.train_step(seed=7)
        report = mesh.run(plane.sync(1))
        assert report.ok, report.failed
        actor_state = mesh.actor.server.service.engine.worker.model.state_dict()
        rollout_state = mesh.rollouts["bf16"].server.service.engine.net.state_dict()
        float32_bytes = sum(t.numel() * 4 for name, t in actor_state.items() if name != "lm_head.weight")
        assert report.num_bytes < 0.55 * float32_bytes  # bfloat16 on the wire
        for name, value in actor_state.items():
            assert rollout_state[name].dtype == torch.bfloat16
            assert torch.equal(rollout_state[name], value.to(torch.bfloat16)), name
        assert mesh.logprob_gap(mesh.addresses["bf16"]) > ENGINE_LOGPROB_GAP  # bfloat16 really is coarser...
        assert mesh.logprob_gap(mesh.addresses["bf16"]) < 0.1  # ...but the same model
        mesh.run(plane.close())
        mesh.run(plane.serving.close())
    finally:
        mesh.stop()
