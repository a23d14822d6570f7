"""Issue 49's row "run scaled 2 -> 4 -> 1 rollout replicas mid-run": an async GRPO run (trainer.max_staleness 1) on the
tiny model over real services on loopback (the coordinator behind its gRPC server, hf rollout replicas). After step
1 the run is paused while two more replicas join: one in this process, registered by the test (CoordinatorService.RegisterRolloutReplica, as
an operator or discovery would), and one a real `rlfabric serve rollout` process that registers itself
(rollout.register_with). Once both have served, three of the four leave: the two first ones are deregistered and
drain, and the process gets SIGTERM, deregisters itself, drains and exits 0. The run completes, every step trains on
data.train_batch_size x rollout.n samples, no sample is delivered twice and what a leaver owed was sent again, no
sample is more than one version behind, the survivor (a joiner) serves the current weights, and the deregistered
replicas take no request after the sync that let them go."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import dump_config
from rlfabric.core.server import ServerOptions
from rlfabric.launch.local import await_port_file, prepare_run_dir, serve_command, service_names
from rlfabric.rollout.client import RolloutClient
from rlfabric.serve import build_service
from rlfabric.v1 import coordinator_pb2
from tests.conftest import ServerThread
from tests.coordinator.meshes import fast_config
from tests.rollout.test_router import streams_served
from tests.waiting import wait_until_async

pytestmark = pytest.mark.slow  # a replica in a process of its own, SIGTERM'd mid-run

STEPS = 8
GENERATE_STREAM = {"grpc_type": "server_stream", "grpc_service": "rlfabric.v1.RolloutService",
                   "grpc_method": "GenerateStream"}


def scraped_streams(metrics_port: int) -> float:
    """GenerateStream calls a replica in another process has started (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "grpc_server_started_total" and GENERATE_STREAM.items() <= sample.labels.items())
SAMPLES = 8 * 4  # fast_config: data.train_batch_size 8, rollout.n 4


class ElasticMesh:
    """The services of fast_config on loopback in this process, rollout replicas kept by address."""

    def __init__(self, config, run_dir):
        prepare_run_dir(config, run_dir)
        self.config, self.run_dir = config, run_dir
        self.process: subprocess.Popen | None = None
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

    async def start_process_replica(self) -> dict:
        """`rlfabric serve rollout` in a process of its own that registers with the coordinator; its ports."""
        config = self.config.model_copy(deep=True)
        config.rollout.register_with = self.coordinator.address
        dump_config(config, self.run_dir / "joiner.yaml")
        port_file = self.run_dir / "ports" / "joiner.json"
        command = serve_command("rollout", self.run_dir / "joiner.yaml", "127.0.0.1", port_file, "elastic")
        with open(self.run_dir / "logs" / "joiner.log", "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        ports = await asyncio.to_thread(await_port_file, port_file, self.process, 120)
        assert ports is not None, (self.run_dir / "logs" / "joiner.log").read_text()[-3000:]
        return ports

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.coordinator.stop()
        for server in self.servers:
            server.stop()


def test_a_run_scaled_from_2_to_4_to_1_rollout_replicas_completes_with_every_step_full(tiny_model, tmp_path):
    config = fast_config(tiny_model, "rollout.replicas=2", "trainer.mode=async", "trainer.max_staleness=1",
                         f"trainer.total_steps={STEPS}")
    mesh = ElasticMesh(config, tmp_path / "run")
    first = list(mesh.rollout)
    joined: list[str] = []  # the joiner in this process
    process_ports: dict = {}  # the joiner in a process of its own
    leavers: list[str] = []
    served_when_left: dict[str, float] = {}

    def joiners_served() -> bool:
        return bool(joined) and streams_served(mesh.rollout[joined[0]]) > 0 and scraped_streams(
            process_ports["metrics"]) > 0

    membership = mesh.coordinator.server.service.engine.membership

    async def scenario():
        options = ChannelOptions.from_config(config)
        async with CoordinatorClient(mesh.coordinator.address, options) as coordinator:
            await coordinator.start_run()
            metrics, left = {}, 0
            async for update in coordinator.stream_metrics(from_step=1):
                metrics[update.step] = dict(update.metrics)
                left += int(update.metrics.get("rollout/left", 0))
                if update.step == 1:  # scale up: 2 -> 4, the run paused while the joiners start
                    await coordinator.pause_run()
                    joined.append(await mesh.start_replica())
                    await coordinator.register_rollout_replica(joined[0])
                    process_ports.update(await mesh.start_process_replica())  # registers itself once ready
                    address = f"127.0.0.1:{process_ports['grpc']}"
                    await wait_until_async(lambda a=address: a in membership.registered, 120, "the process registered")
                    await coordinator.resume_run()
                elif not leavers and joiners_served():  # scale down: 4 -> 1
                    leavers.extend(first)
                    for address in first:
                        await coordinator.deregister_rollout_replica(address)
                    mesh.process.send_signal(signal.SIGTERM)  # deregisters itself, drains, exits
                elif left == 3 and not served_when_left:
                    # Let go of: the first two drain and stop, as SIGTERM stops them.
                    served_when_left.update({a: streams_served(mesh.rollout[a]) for a in leavers})
                    await asyncio.gather(*(asyncio.to_thread(mesh.rollout[a].stop, 5.0) for a in leavers))
            async with RolloutClient(joined[0], options) as survivor:
                version = (await survivor.status()).weight_version
            exit_code = await asyncio.to_thread(mesh.process.wait, 60)
            return metrics, await coordinator.run_status(), version, exit_code

    try:
        metrics, status, survivor_version, exit_code = asyncio.run(asyncio.wait_for(scenario(), timeout=240))
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
    # The joiners served; the leavers took no request after the sync that let them go; the process left cleanly.
    assert served_when_left and all(streams_served(mesh.rollout[a]) == n for a, n in served_when_left.items())
    assert exit_code == 0
    assert survivor_version == metrics[STEPS]["rollout/weight_version"]
