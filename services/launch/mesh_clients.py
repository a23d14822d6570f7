"""Clients of a running mesh, found from its folder: what `rlfabric.connect(run_dir)` returns.

    async with connect_to_run(Path("runs/quickstart-20261202-101500")) as mesh:
        status = await mesh.coordinator.run_status()       # the run's state, step and last metrics
        replica = await mesh.rollout[0].status()            # one rollout replica's engine and weight version

A launcher writes RUN_DIR/endpoints.json (role -> [{name, grpc, metrics, pid}]) once the services are bound,
and RUN_DIR/config.yaml with the mesh's token file and TLS settings, which the clients use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlfabric.actor.client import ActorClient
from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions, ServiceClient
from rlfabric.core.config import ConfigError, load_config
from rlfabric.critic.client import CriticClient
from rlfabric.env.client import EnvClient
from rlfabric.reference.client import ReferenceClient, TeacherClient
from rlfabric.reward.client import RewardClient
from rlfabric.rollout.client import RolloutClient


@dataclass
class MeshClients:
    """A gRPC client per service of a running mesh; a role the mesh does not run is None (or an empty list)."""

    coordinator: CoordinatorClient
    actor: ActorClient | None = None
    reference: ReferenceClient | None = None
    critic: CriticClient | None = None
    teacher: TeacherClient | None = None
    rollout: list[RolloutClient] = field(default_factory=list)  # one per replica: rollout-0, rollout-1, ...
    reward: list[RewardClient] = field(default_factory=list)
    env: EnvClient | None = None  # with the environment link's own token (env.auth_token_file)
    endpoints: dict[str, list[dict]] = field(default_factory=dict)  # RUN_DIR/endpoints.json as read

    def clients(self) -> list[ServiceClient]:
        """Every client, the coordinator first."""
        singles = [self.actor, self.reference, self.critic, self.teacher, self.env]
        return [self.coordinator, *(c for c in singles if c is not None), *self.rollout, *self.reward]

    async def close(self) -> None:
        for client in self.clients():
            await client.close()

    async def __aenter__(self) -> MeshClients:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def read_endpoints(run_dir: Path) -> dict[str, list[dict]]:
    """RUN_DIR/endpoints.json; a ConfigError saying so in one line when run_dir holds none (not a mesh's folder,
    or its mesh has not bound its ports yet)."""
    path = run_dir / "endpoints.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a running mesh's folder: it has no endpoints.json "
                          "(`rlfabric up` and `rlfabric train` write one once the services are bound)")
    return json.loads(path.read_text())


def connect_to_run(run_dir: Path) -> MeshClients:
    """Clients of every service RUN_DIR/endpoints.json lists, with the mesh's token and TLS (RUN_DIR/config.yaml)."""
    endpoints = read_endpoints(run_dir)
    config = load_config(run_dir / "config.yaml")
    options = ChannelOptions.from_config(config)

    def addresses(client_class: type[ServiceClient]) -> list[str]:
        return [entry["grpc"] for entry in endpoints.get(client_class.role, [])]

    def first(client_class: type[ServiceClient], channel_options: ChannelOptions = options):
        found = addresses(client_class)
        return client_class(found[0], channel_options) if found else None

    if not addresses(CoordinatorClient):
        raise ConfigError(f"{run_dir}/endpoints.json names no coordinator yet: the mesh is still starting")
    return MeshClients(
        coordinator=first(CoordinatorClient),
        actor=first(ActorClient),
        reference=first(ReferenceClient),
        critic=first(CriticClient),
        teacher=first(TeacherClient),
        rollout=[RolloutClient(address, options) for address in addresses(RolloutClient)],
        reward=[RewardClient(address, options) for address in addresses(RewardClient)],
        env=first(EnvClient, ChannelOptions.for_env(config)) if addresses(EnvClient) else None,
        endpoints=endpoints,
    )
