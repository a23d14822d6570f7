"""Typed clients of the reward service: domain objects in, domain objects out.

    async with RewardClient("127.0.0.1:50055") as reward:
        results = await reward.score([ScoreItem("openai/gsm8k", "... #### 72", "72")])

Three implementations of one interface (RewardInterface: score, status, close), chosen where the
caller is built:
- RewardClient:        one service over gRPC;
- LocalRewardClient:   a RewardEngine in this process (tests, single-process runs);
- ShardedRewardClient: several replicas; a batch goes out as requests of at most request_items
                       items, dealt round-robin and all in flight at once.
Failures come back as rlfabric.core.errors exceptions (InvalidArgument, ResourceExhausted, ...).
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Sequence

from rlfabric.core.client import ChannelOptions, RoleInterface, ServiceClient
from rlfabric.core.errors import RlfabricError
from rlfabric.reward import wire
from rlfabric.reward.engine import RewardEngine, RewardStatus
from rlfabric.reward.items import ItemResult, ScoreItem
from rlfabric.v1 import reward_pb2, reward_pb2_grpc


class RewardInterface(RoleInterface):
    """Scores rollouts against their ground truth."""

    role = "reward"

    @abstractmethod
    async def score(self, items: Sequence[ScoreItem], timeout_s: float | None = None) -> list[ItemResult]:
        """One ItemResult per item, in order; raises InvalidArgument etc. when the request is refused."""

    @abstractmethod
    async def status(self, timeout_s: float | None = None) -> RewardStatus:
        """Data sources served, items scored and failed."""


class RewardClient(ServiceClient, RewardInterface):
    """RewardInterface over gRPC, to one service."""

    stub_class = reward_pb2_grpc.RewardServiceStub

    async def score(self, items: Sequence[ScoreItem], timeout_s: float | None = None) -> list[ItemResult]:
        response = await self.call("Score", wire.request_from_items(items), timeout_s)
        return wire.results_from_response(response)

    async def status(self, timeout_s: float | None = None) -> RewardStatus:
        response = await self.call("GetStatus", reward_pb2.RewardServiceGetStatusRequest(), timeout_s)
        return RewardStatus(list(response.data_sources), response.items_scored, response.items_failed)


class LocalRewardClient(RewardInterface):
    """RewardInterface over an engine in this process (started and stopped by its owner). The items go
    through their wire form and back, with the servicer's checks in its order, so the engine scores what
    it would be sent and a batch RewardClient refuses is refused here with the same error."""

    def __init__(self, engine: RewardEngine):
        self.engine = engine

    async def score(self, items: Sequence[ScoreItem], timeout_s: float | None = None) -> list[ItemResult]:
        request = wire.request_from_items(items)
        self.engine.check_batch_size(len(request.items))
        return await self.engine.score(wire.items_from_request(request))

    async def status(self, timeout_s: float | None = None) -> RewardStatus:
        return self.engine.status()

    async def close(self) -> None:
        pass


class ShardedRewardClient(RewardInterface):
    """Spreads every batch over several replicas; results come back in the batch's order.

    Validation is all-or-nothing per request, not per batch: when one request is refused the call
    raises, though other replicas may have scored (and counted) their parts.
    """

    def __init__(self, clients: Sequence[RewardInterface], request_items: int = 512):
        if not clients:
            raise ValueError("ShardedRewardClient needs at least one client")
        if request_items < 1:
            raise ValueError(f"request_items must be >= 1, got {request_items}")
        self.clients = list(clients)
        self.request_items = request_items

    @classmethod
    def connect(
        cls, addresses: Sequence[str], options: ChannelOptions | None = None, request_items: int = 512
    ) -> ShardedRewardClient:
        """One RewardClient per address (e.g. config.cluster.reward)."""
        return cls([RewardClient(address, options) for address in addresses], request_items)

    async def score(self, items: Sequence[ScoreItem], timeout_s: float | None = None) -> list[ItemResult]:
        size = self.request_items
        starts = range(0, len(items), size)
        parts = await asyncio.gather(
            *(
                self._score_part(self.clients[n % len(self.clients)], items, start, size, timeout_s)
                for n, start in enumerate(starts)
            ),
            return_exceptions=True,  # a refused request raises only once every other one has finished
        )
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        return [result for part in parts for result in part]

    async def status(self, timeout_s: float | None = None) -> RewardStatus:
        """Counters summed over the replicas; the data sources of the first."""
        statuses = await asyncio.gather(*(client.status(timeout_s) for client in self.clients))
        return RewardStatus(
            statuses[0].data_sources,
            sum(status.items_scored for status in statuses),
            sum(status.items_failed for status in statuses),
        )

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self.clients))

    async def __aenter__(self) -> ShardedRewardClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @staticmethod
    async def _score_part(client, items, start: int, size: int, timeout_s: float | None) -> list[ItemResult]:
        part = items[start : start + size]
        try:
            return await client.score(part, timeout_s)
        except RlfabricError as error:  # say where in the whole batch "item i" of this request is
            raise type(error)(f"items {start}..{start + len(part) - 1} of the batch: {error}") from None
