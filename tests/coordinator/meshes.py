"""The two meshes the loop tests run on, built from the same config and the same engines:

- in_process(config, run_dir): rlfabric.launch.inprocess.InProcessMesh, in-process clients end to end;
- over_grpc(config, run_dir): each role's service (rlfabric.serve.build_service, as `rlfabric serve`
  builds it) on a real gRPC server on loopback in this process, the coordinator's RunController behind
  its own server, and a CoordinatorClient: every call crosses the wire, weight sync included (gloo).

Both yield a CoordinatorInterface, so a test written against it runs on either.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from rlfabric.coordinator.client import CoordinatorClient, CoordinatorInterface
from rlfabric.coordinator.peers import Peers
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import RunConfig, load_config
from rlfabric.core.server import ServerOptions
from rlfabric.launch.inprocess import InProcessMesh
from rlfabric.launch.local import prepare_run_dir, service_names
from rlfabric.serve import build_service
from tests.conftest import ServerThread

# Small steps on the quickstart's task: 8 prompts x 4 samples, one optimizer step each.
FAST = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "rollout.seed=0",
        "trainer.progress_bar=false", "trainer.plot=false", "trainer.loggers=[jsonl]", "trainer.total_steps=2",
        "weight_sync.timeout_s=30"]


def fast_config(model_path: Path, *overrides: str) -> RunConfig:
    return load_config(None, [f"model.path={model_path}", *FAST, *overrides])


@contextlib.asynccontextmanager
async def in_process(config: RunConfig, run_dir: Path,
                     wrap_peers: Callable[[Peers], Peers] | None = None) -> AsyncIterator[CoordinatorInterface]:
    async with InProcessMesh(config, run_dir, wrap_peers=wrap_peers) as mesh:
        yield mesh.coordinator


@contextlib.asynccontextmanager
async def over_grpc(config: RunConfig, run_dir: Path) -> AsyncIterator[CoordinatorInterface]:
    prepare_run_dir(config, run_dir)
    servers: list[ServerThread] = []
    try:
        for _, role in service_names(config):
            servers.append(ServerThread(build_service(role, config), ServerOptions(port=0, metrics_port=None)))
            getattr(config.cluster, role).append(servers[-1].address)
        coordinator = ServerThread(build_service("coordinator", config), ServerOptions(port=0, metrics_port=None))
        servers.insert(0, coordinator)  # stopped first
        async with CoordinatorClient(coordinator.address, ChannelOptions.from_config(config)) as client:
            yield client
    finally:
        for server in servers:
            server.stop()


MESHES = {"in-process": in_process, "grpc": over_grpc}


async def finished(client: CoordinatorInterface) -> dict[int, dict[str, float]]:
    """Follows the run to its end; the metrics of every step."""
    return {update.step: dict(update.metrics) async for update in client.stream_metrics(from_step=1)}


def run_to_end(open_mesh, config, run_dir) -> tuple[dict[int, dict[str, float]], object]:
    """One run on the mesh open_mesh(config, run_dir) opens, followed to its end: its metrics and final status."""

    async def scenario():
        async with open_mesh(config, run_dir) as client:
            await client.start_run()
            return await finished(client), await client.run_status()

    return asyncio.run(scenario())


def run_to_the_end(mesh, timeout_s: float = 300) -> tuple[list[dict[str, float]], object]:
    """StartRun on a running mesh's coordinator (rlfabric.launch.local.LocalMesh), with its own config: every
    step's metrics until the run ends, and its final GetRunStatus."""

    async def train():
        options = ChannelOptions.from_config(mesh.config)
        async with CoordinatorClient(mesh.endpoints["coordinator"][0]["grpc"], options) as client:
            await client.start_run()
            metrics = [dict(update.metrics) async for update in client.stream_metrics(timeout_s=timeout_s)]
            return metrics, await client.run_status()

    return asyncio.run(train())
