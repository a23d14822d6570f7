"""The coordinator's connections to the other services, from the config's cluster section.

Each peer is a role's client interface (ActorInterface, ...): the loop calls it directly,
`await peers.actor.update_policy(batch)`, and a failure arrives as the domain error of its status code,
naming the role and its address (rlfabric.core.client.ServiceClient.domain_error).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlfabric.actor.client import ActorClient, ActorInterface
from rlfabric.coordinator.multi_turn import env_address_of
from rlfabric.core.client import ChannelOptions, ServiceClient, wait_until_serving
from rlfabric.core.config import RunConfig
from rlfabric.core.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from rlfabric.critic.client import CriticClient, CriticInterface
from rlfabric.env.client import EnvClient
from rlfabric.reference.client import ReferenceClient, ReferenceInterface, TeacherClient, TeacherInterface
from rlfabric.reward.client import RewardInterface, ShardedRewardClient
from rlfabric.reward.items import ItemResult, ScoreItem
from rlfabric.rollout.router import RolloutRouter
from rlfabric.trainer.client import Tensors
from rlfabric.v1 import reference_pb2
from rlfabric.weight_sync.manifest import Manifest, SyncGroup
from rlfabric.weight_sync.receiver import WeightSwap

log = logging.getLogger("rlfabric.coordinator")


class ActorAsReference(ReferenceInterface):
    """The reference for free with LoRA (actor.lora): the actor's base model, its adapters off, is the
    reference policy, so reference log-probs are the actor's ComputeLogProbs with base_model and no
    reference service runs. It takes no weights: the base model never changes."""

    def __init__(self, actor: ActorInterface):
        self.actor = actor

    async def compute_log_probs(self, batch: Tensors, temperature: float = 1.0, compute_entropy: bool = False,
                                timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        return await self.actor.compute_log_probs(batch, temperature, compute_entropy, timeout_s, base_model=True)

    async def get_status(self) -> reference_pb2.ReferenceServiceGetStatusResponse:
        status = await self.actor.get_status()
        return reference_pb2.ReferenceServiceGetStatusResponse(model=status.model, device=status.device)

    async def join_weight_sync_group(self, group: SyncGroup, rank: int, timeout_s: float | None = None) -> None:
        raise FailedPrecondition("the reference is the actor's base model (LoRA): it joins no weight sync")

    async def receive_weights(self, manifest: Manifest, timeout_s: float | None = None) -> WeightSwap:
        raise FailedPrecondition("the reference is the actor's base model (LoRA): it takes no weights")

    async def close(self) -> None:
        """The actor's connection is the actor client's to close."""


@dataclass
class Peers:
    """The clients of every role this run uses (None for roles it does not use)."""

    actor: ActorInterface
    rollout: RolloutRouter
    reward: RewardInterface
    reference: ReferenceInterface | None
    critic: CriticInterface | None
    teacher: TeacherInterface | None = None  # algorithm.distill's teacher
    # The environment the rollout replicas call (rollout.multi_turn over gRPC), for the readiness wait
    # only: the coordinator itself never calls it. env_key is the config key that named its address.
    env: EnvClient | None = None
    env_key: str = ""

    @classmethod
    def connect(cls, config: RunConfig) -> Peers:
        """gRPC clients for config.cluster's addresses (build_peers' rules), and the run's environment."""
        options = ChannelOptions.from_config(config)
        clients = RoleClients(
            actor=lambda address: ActorClient(address, options),
            reference=lambda address: ReferenceClient(address, options),
            critic=lambda address: CriticClient(address, options),
            teacher=lambda address: TeacherClient(address, options),
            rollout=lambda addresses: RolloutRouter(addresses, options,
                                                    max_attempts=config.trainer.rollout_retries + 1,
                                                    hedge_after=config.trainer.rollout_hedge_after),
            reward=lambda addresses: ShardedRewardClient.connect(addresses, options),
        )
        peers = build_peers(config, clients)
        # The environment's token, not the mesh's.
        return dataclasses.replace(peers, **environment_of(config, ChannelOptions.for_env(config)))

    def grpc_clients(self) -> list[ServiceClient]:
        """The gRPC clients behind the peers, one per service."""
        reward = self.reward.clients if isinstance(self.reward, ShardedRewardClient) else [self.reward]
        clients = [self.actor, self.reference, self.critic, self.teacher, *reward, *(r.client for r in self.rollout.replicas),
                   self.env]
        return [client for client in clients if isinstance(client, ServiceClient)]

    async def wait_until_ready(self, timeout_s: float) -> None:
        """Every service answers readiness SERVING, the environment of a multi-turn run included
        (UNAVAILABLE names the one that does not, and for the environment the key that named it)."""

        async def one(client: ServiceClient):
            try:
                await wait_until_serving(client.address, client.options, timeout_s=timeout_s)
            except Exception as error:
                named = f" ({self.env_key})" if client is self.env else ""
                raise Unavailable(f"{client.role} at {client.address}{named} is not ready: {error}") from None

        await asyncio.gather(*(one(client) for client in self.grpc_clients()))

    async def score(self, items: list[ScoreItem], retry_window_s: float = 120.0,
                    backoff_s: float = 1.0) -> list[ItemResult]:
        """Scores every item exactly once into the batch; results are positional, so a retried request
        replaces, never duplicates, the lost one.

        A reward service that is unreachable (restarting: UNAVAILABLE) is retried with backoff (1, 2, 4,
        8, 8... s) for up to retry_window_s; one that missed a deadline (stuck: DEADLINE_EXCEEDED) is
        retried once, since a second full deadline rarely helps and a frozen service must fail the run
        in bounded time.
        """
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + retry_window_s
        attempt, deadlines_missed = 0, 0
        while True:
            attempt += 1
            try:
                return await self.reward.score(items)
            except (Unavailable, DeadlineExceeded) as error:
                deadlines_missed += isinstance(error, DeadlineExceeded)
                delay = backoff_s * 2 ** min(attempt - 1, 3)
                if deadlines_missed > 1 or loop.time() + delay > give_up_at:
                    raise type(error)(f"{error} (scoring gave up at attempt {attempt})") from None
                log.warning("reward scoring failed (%s); retrying in %.1f s", error, delay)
                await asyncio.sleep(delay)

    async def close(self) -> None:
        closers = [self.actor.close(), self.rollout.close(), self.reward.close()]
        closers += [c.close() for c in (self.reference, self.critic, self.teacher, self.env) if c is not None]
        await asyncio.gather(*closers, return_exceptions=True)


@dataclass
class RoleClients:
    """How a mesh reaches each role, given its address(es): gRPC clients (Peers.connect) or clients of
    engines in this process (rlfabric.launch.inprocess)."""

    actor: Callable[[str], ActorInterface]
    reference: Callable[[str], ReferenceInterface]
    critic: Callable[[str], CriticInterface]
    teacher: Callable[[str], TeacherInterface]
    rollout: Callable[[list[str]], RolloutRouter]
    reward: Callable[[list[str]], RewardInterface]


def build_peers(config: RunConfig, clients: RoleClients) -> Peers:
    """The run's peers, whichever the mesh: the roles the run needs (FailedPrecondition names one
    config.cluster lacks), a reference service only where the run uses one, and under LoRA the actor's
    base model as the reference."""
    cluster = config.cluster
    wanted = {"actor": True, "rollout": True, "reward": True,
              "reference": config.uses_reference(), "critic": config.uses_critic(),
              "teacher": config.uses_teacher()}
    missing = [role for role, needed in wanted.items() if needed and not getattr(cluster, role)]
    if missing:
        raise FailedPrecondition(f"the run needs cluster.{', cluster.'.join(missing)} (service addresses) "
                                 "but the config has none")
    actor = clients.actor(cluster.actor[0])
    if config.needs_reference_log_probs() and config.actor.lora.enabled:
        reference = ActorAsReference(actor)  # the base model under the actor's LoRA adapters
    else:
        reference = clients.reference(cluster.reference[0]) if wanted["reference"] else None
    return Peers(actor=actor, rollout=clients.rollout(list(cluster.rollout)), reward=clients.reward(list(cluster.reward)),
                 reference=reference, critic=clients.critic(cluster.critic[0]) if wanted["critic"] else None,
                 teacher=clients.teacher(cluster.teacher[0]) if wanted["teacher"] else None)


def environment_of(config: RunConfig, options: ChannelOptions) -> dict:
    """Peers' env and env_key for a multi-turn run whose environment address the config names (none
    otherwise: the replicas may still know one from their own config)."""
    address, key = env_address_of(config)
    if not config.rollout.multi_turn.enable or not address:
        return {}
    return {"env": EnvClient(address, options), "env_key": key}
