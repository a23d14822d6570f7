"""Issue 49's row "run scaled 2 -> 4 -> 1 rollout replicas mid-run": an async GRPO run (trainer.max_staleness 1) on the
tiny model over real services on loopback (the coordinator behind its gRPC server, hf rollout replicas). After step
1 two more replicas start and register (CoordinatorService.RegisterRolloutReplica); once both have served, three of
the four deregister and drain (their servers stop as SIGTERM stops them). The run completes, every step trains on
data.train_batch_size x rollout.n samples, no sample is delivered twice, no sample is more than one version behind,
the joiners serve the current weights, and the leavers take no request after the sync that let them go."""

from __future__ import annotations

import asyncio

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions
from rlfabric.core.server import ServerOptions
from rlfabric.launch.local import prepare_run_dir, service_names
from rlfabric.rollout.client import RolloutClient
from rlfabric.serve import build_service
from rlfabric.v1 import coordinator_pb2
from tests.conftest import ServerThread
from tests.coordinator.meshes import fast_config
from tests.rollout.test_router import streams_served

STEPS = 8
SAMPLES = 8 * 4  # fast_config: data.train_batch_size 8, rollout.n 4


class ElasticMesh:
    """The services of fast_config on loopback in this process, rollout replicas kept by address."""

    def __init__(self, config, run_dir):
        prepare_run_dir(config, run_dir)
        self.config = config
        self.servers: list[ServerThread] = []
        self.rollout: dict[str, ServerThread] = {}
        for _, role in service_names(config):
            server = self._start(role)
            getattr(config.cluster, role).append(server.address)
        self.coordinator = self._start("coordinator")

    def _start(self, role: str) -> ServerThread:
        server = ServerThread(build_service(role, self.config), ServerOptions(port=0, metrics_port=None))
        self.servers.append(server)
        if role == "rollout":
            self.rollout[server.address] = server
        return server

    async def start_replica(self) -> str:
        """A new rollout replica, ready; its address."""
        return (await asyncio.to_thread(self._start, "rollout")).address

    def close(self) -> None:
        self.coordinator.stop()
        for server in self.servers:
            server.stop()


def test_a_run_scaled_from_2_to_4_to_1_rollout_replicas_completes_with_every_step_full(tiny_model, tmp_path):
    config = fast_config(tiny_model, "rollout.replicas=2", "trainer.mode=async", "trainer.max_staleness=1",
                         f"trainer.total_steps={STEPS}")
    mesh = ElasticMesh(config, tmp_path / "run")
    first = list(mesh.rollout)
    joiners: list[str] = []
    leavers: list[str] = []
    served_when_left: dict[str, float] = {}

    async def scenario():
        options = ChannelOptions.from_config(config)
        async with CoordinatorClient(mesh.coordinator.address, options) as coordinator:
            await coordinator.start_run()
            metrics = {}
            async for update in coordinator.stream_metrics(from_step=1):
                metrics[update.step] = dict(update.metrics)
                if update.step == 1:  # scale up: 2 -> 4
                    joiners.extend([await mesh.start_replica(), await mesh.start_replica()])
                    for address in joiners:
                        await coordinator.register_rollout_replica(address)
                elif not leavers and all(streams_served(mesh.rollout[a]) for a in joiners):  # scale down: 4 -> 1
                    leavers.extend([*first, joiners[0]])
                    for address in leavers:
                        await coordinator.deregister_rollout_replica(address)
                elif leavers and update.metrics.get("rollout/left") and not served_when_left:
                    # Let go of at this step's sync: they drain and stop, as SIGTERM stops them.
                    served_when_left.update({a: streams_served(mesh.rollout[a]) for a in leavers})
                    await asyncio.gather(*(asyncio.to_thread(mesh.rollout[a].stop, 5.0) for a in leavers))
            async with RolloutClient(joiners[1], options) as survivor:
                version = (await survivor.status()).weight_version
            return metrics, await coordinator.run_status(), version

    try:
        metrics, status, survivor_version = asyncio.run(asyncio.wait_for(scenario(), timeout=240))
    finally:
        mesh.close()

    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert sorted(metrics) == list(range(1, STEPS + 1))
    replicas = [metrics[step]["rollout/replicas"] for step in sorted(metrics)]
    assert replicas[0] == 2 and 4 in replicas and replicas[-1] == 1, replicas
    assert sum(m["rollout/joined"] for m in metrics.values()) == 2
    assert sum(m["rollout/left"] for m in metrics.values()) == 3
    for step, step_metrics in metrics.items():
        assert step_metrics["rollout/samples"] == SAMPLES, (step, step_metrics["rollout/samples"])
        assert step_metrics["rollout/staleness/max"] <= 1, (step, step_metrics["rollout/staleness/max"])
        assert step_metrics["rollout/router/duplicate_samples"] == 0
        # what a failed replica had in flight was sent again, all of it
        assert step_metrics["rollout/router/rework_samples"] == step_metrics["rollout/router/failed_inflight_samples"]
    # The joiners served; the leavers took no request after the sync that let them go.
    assert all(streams_served(mesh.rollout[a]) > 0 for a in joiners)
    assert served_when_left and all(streams_served(mesh.rollout[a]) == n for a, n in served_when_left.items())
    assert survivor_version == metrics[STEPS]["rollout/weight_version"]
