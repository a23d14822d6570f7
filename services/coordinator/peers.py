"""The coordinator's connections to the other services, from the config's cluster section."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from rlfabric.actor.client import ActorClient, CriticClient, ReferenceClient
from rlfabric.core.client import ChannelOptions, wait_until_serving
from rlfabric.core.config import RunConfig
from rlfabric.core.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from rlfabric.core.router import RolloutRouter
from rlfabric.reward.client import ShardedRewardClient
from rlfabric.reward.items import ItemResult, ScoreItem

log = logging.getLogger("rlfabric.coordinator")
T = TypeVar("T")


def blame(role: str, address: str, timeout_s: float, error: Exception, attempts: int = 1) -> Exception:
    """A deadline or connection error of a call to `role`, re-worded to name the role, its address and
    the deadline it missed; other errors unchanged."""
    tries = f" ({attempts} attempts)" if attempts > 1 else ""
    if isinstance(error, DeadlineExceeded):
        return DeadlineExceeded(f"{role} at {address} did not answer within {timeout_s:g} s{tries}: {error}")
    if isinstance(error, Unavailable):
        return Unavailable(f"{role} at {address} is unreachable{tries}: {error}")
    return error


@dataclass
class Peers:
    """Typed clients of every role this run uses (None for roles it does not use)."""

    actor: ActorClient
    rollout: RolloutRouter
    reward: ShardedRewardClient
    reference: ReferenceClient | None
    critic: CriticClient | None
    rollout_addresses: list[str]

    @classmethod
    def connect(cls, config: RunConfig) -> Peers:
        """Clients for config.cluster's addresses; FailedPrecondition names a role the run needs but lacks."""
        cluster = config.cluster
        wanted = {"actor": True, "rollout": True, "reward": True,
                  "reference": config.uses_reference(), "critic": config.uses_critic()}
        missing = [role for role, needed in wanted.items() if needed and not getattr(cluster, role)]
        if missing:
            raise FailedPrecondition(f"the run needs cluster.{', cluster.'.join(missing)} (service addresses) "
                                     "but the config has none")
        options = ChannelOptions.from_config(config)
        return cls(
            actor=ActorClient(cluster.actor[0], options),
            rollout=RolloutRouter(cluster.rollout, options, max_attempts=config.trainer.rollout_retries + 1),
            reward=ShardedRewardClient.connect(cluster.reward, options),
            reference=ReferenceClient(cluster.reference[0], options) if wanted["reference"] else None,
            critic=CriticClient(cluster.critic[0], options) if wanted["critic"] else None,
            rollout_addresses=list(cluster.rollout),
        )

    async def wait_until_ready(self, timeout_s: float) -> None:
        """Every service answers readiness SERVING (UNAVAILABLE names the one that does not)."""
        clients = [self.actor, self.reference, self.critic, *self.reward.clients]
        clients += [replica.client for replica in self.rollout.replicas]

        async def one(client):
            try:
                await wait_until_serving(client.address, client.options, timeout_s=timeout_s)
            except Exception as error:
                raise Unavailable(f"{type(client).__name__} at {client.address} is not ready: {error}") from None

        await asyncio.gather(*(one(c) for c in clients if c is not None))

    async def ask(self, role: str, call: Awaitable[T]) -> T:
        """Awaits a call to the actor, reference or critic; a missed deadline or a lost connection
        names the role and its address (see blame)."""
        client = {"actor": self.actor, "reference": self.reference, "critic": self.critic}[role]
        try:
            return await call
        except (DeadlineExceeded, Unavailable) as error:
            raise blame(role, client.address, client.options.timeout_s, error) from None

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
                    clients = [c for c in self.reward.clients if hasattr(c, "address")]
                    if not clients:
                        raise
                    address = ", ".join(c.address for c in clients)
                    raise blame("reward", address, clients[0].options.timeout_s, error, attempt) from None
                log.warning("reward scoring failed (%s); retrying in %.1f s", error, delay)
                await asyncio.sleep(delay)

    async def close(self) -> None:
        closers = [self.actor.close(), self.rollout.close(), self.reward.close()]
        closers += [c.close() for c in (self.reference, self.critic) if c is not None]
        await asyncio.gather(*closers, return_exceptions=True)
