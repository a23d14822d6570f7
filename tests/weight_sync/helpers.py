"""Helpers of the weight-sync tests: a mesh of real services on loopback (actor, rollout replicas,
optionally the reference), an event loop to drive the plane from sync tests, a PPO step that moves
the actor's weights, and the rollout-vs-actor log-prob comparison."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

from rlfabric.actor.client import ActorClient
from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.config import RunConfig, dump_config, load_config
from rlfabric.core.server import ServerOptions
from rlfabric.rollout.servicer import build_service as build_rollout
from rlfabric.serve import build_service as build_trainer
from tests.conftest import ServerThread
from tests.rollout.helpers import generate, sampled_log_probs
from tests.rollout.test_actor_agreement import actor_batch
from tests.trainer.helpers import make_batch

PROMPTS = [[1, 90, 88, 74], [1, 70, 88, 88, 78, 88, 89, 70, 83], [40, 41]]
# A vLLM (CPU) replica small enough to sit beside the others in one test process.
VLLM_REPLICA = ("rollout.engine=vllm", "rollout.max_num_seqs=16", "rollout.kv_cache_space_gb=1")


def mesh_config(model_path, *overrides: str) -> RunConfig:
    """Tiny model, a PPO step big enough to move the log-probs, short sync timeout."""
    return load_config(None, [f"model.path={model_path}", "rollout.n=2", "actor.lr=0.01",
                              "actor.ppo_mini_batch_size=4", "weight_sync.timeout_s=5", *overrides])


class Loop:
    """An event loop on a daemon thread, so sync tests can await the plane and its clients."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def serve(service) -> ServerThread:
    return ServerThread(service, ServerOptions(port=0, metrics_port=None))


class Mesh:
    """An actor, rollout replicas and (optionally) a reference, each a real gRPC server in this process."""

    def __init__(self, config: RunConfig, rollout_configs: dict[str, RunConfig], reference: bool = False):
        self.config = config
        self.loop = Loop()
        self.actor = serve(build_trainer("actor", config))
        self.rollouts = {name: serve(build_rollout(c)) for name, c in rollout_configs.items()}
        self.reference = serve(build_trainer("reference", config)) if reference else None
        self.actor_client = self.loop.run(self._client())

    async def _client(self) -> ActorClient:
        return ActorClient(self.actor.address)

    @property
    def addresses(self) -> dict[str, str]:
        return {name: server.address for name, server in self.rollouts.items()}

    def run(self, coroutine, timeout: float = 120):
        return self.loop.run(coroutine, timeout)

    def open_plane(self) -> WeightSyncPlane:
        """The coordinator's weight-sync plane from this actor to every replica, opened (each joined)."""
        plane = self.run(self._plane())
        assert self.run(plane.open()) == {}
        return plane

    async def _plane(self) -> WeightSyncPlane:
        return WeightSyncPlane(self.actor_client, self.addresses, self.config)

    def train_step(self, seed: int) -> None:
        """One PPO update with positive advantages: the actor's weights move."""
        batch = make_batch(rows=8, seed=seed)
        old = self.run(self.actor_client.compute_log_probs(batch))["log_probs"]
        self.run(self.actor_client.update_policy({**batch, "old_log_probs": old, "advantages": torch.ones(8, 5)}))

    def serves_the_actors_weights(self, replica: str) -> bool:
        """Every weight of the hf replica `replica` equals the actor's, cast to the replica's dtype, bit for bit
        (whatever the device: log-probs agree to 1e-3 only in float32)."""
        actor = self.run(self.actor.server.service.engine.gather_weights())
        served = self.rollouts[replica].server.service.engine._base_weights()
        return all(torch.equal(served[name], tensor.to(served[name].dtype).to(served[name].device))
                   for name, tensor in actor.items())

    def logprob_gap(self, rollout_address: str, seed: int = 0) -> float:
        """Largest |rollout sampled log-prob - actor log-prob| over sampled tokens (temperature 1)."""
        return logprob_gap(rollout_address, self.actor_client, self.loop, seed)

    def stop(self) -> None:
        self.run(self.actor_client.close())
        for server in [*self.rollouts.values(), self.reference, self.actor]:
            if server is not None:
                server.stop()
        self.loop.stop()


def logprob_gap(rollout_address: str, client, loop: Loop, seed: int = 0) -> float:
    with grpc.insecure_channel(rollout_address) as channel:
        samples = generate(channel, PROMPTS, n=2, max_tokens=12, temperature=1.0, seed=seed)
    batch = actor_batch(samples, PROMPTS)
    actor_log_probs = loop.run(client.compute_log_probs(batch, temperature=1.0))["log_probs"]
    rollout_log_probs = sampled_log_probs(samples, batch)
    mask = batch["response_mask"].bool()
    return float((actor_log_probs[mask] - rollout_log_probs[mask]).abs().max())


class ServiceProcess:
    """`python -m rlfabric serve <role>` in its own process (so a test can kill it), ready once it serves."""

    def __init__(self, role: str, config: RunConfig, workdir: Path, name: str):
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = workdir / f"{name}.yaml"
        dump_config(config, config_path)
        self.port_file = workdir / f"{name}-{time.monotonic_ns()}.ports.json"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlfabric", "serve", role, "--config", str(config_path), "--port", "0",
             "--metrics-port", "0", "--port-file", str(self.port_file)],
            env=self.environment(), stdout=subprocess.DEVNULL, stderr=(workdir / f"{name}.log").open("ab"))
        deadline = time.monotonic() + 120
        while not self.port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{role} process {name} did not start (exit code {self.process.poll()}); see "
                                   f"{workdir / f'{name}.log'}")
            time.sleep(0.1)
        self.address = f"127.0.0.1:{json.loads(self.port_file.read_text())['grpc']}"

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def wait_ready(self, loop: Loop) -> None:
        from rlfabric.core.client import wait_until_serving

        loop.run(wait_until_serving(self.address, timeout_s=120), timeout=130)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        """Asks the service to stop (SIGTERM), killing it after 30 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


class RolloutProcess(ServiceProcess):
    """`python -m rlfabric serve rollout` in its own process (so a test can kill it)."""

    def __init__(self, config: RunConfig, workdir: Path, name: str):
        super().__init__("rollout", config, workdir, name)

    def environment(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
