"""Fixtures for the reward service tests: a real RewardService on loopback, built the way
`rlfabric serve reward` builds it, and helpers to call it with the typed client or a raw stub."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rlfabric.core.config import RewardConfig, RunConfig
from rlfabric.reward.client import RewardClient
from rlfabric.reward.servicer import build_service
from rlfabric.v1 import reward_pb2, reward_pb2_grpc


class RewardServer:
    """A served reward role and ways to talk to it."""

    def __init__(self, thread):
        self.thread = thread
        self.address = thread.address
        self.engine = thread.server.service.engine
        self.registry = thread.server.service.registry

    def call(self, method: str, *args):
        """RewardClient.<method>(*args) on a fresh client and event loop."""

        async def run():
            async with RewardClient(self.address) as client:
                return await getattr(client, method)(*args)

        return asyncio.run(run())

    def score(self, items):
        return self.call("score", items)

    def status(self):
        return self.call("status")

    def raw_score(self, items: list[reward_pb2.ScoreItem]) -> reward_pb2.RewardServiceScoreResponse:
        """Score through a plain generated stub (for status codes and fields the client never sends)."""
        with grpc.insecure_channel(self.address) as channel:
            return reward_pb2_grpc.RewardServiceStub(channel).Score(
                reward_pb2.RewardServiceScoreRequest(items=items), timeout=30
            )

    def raw_error(self, items: list[reward_pb2.ScoreItem]) -> grpc.RpcError:
        """The RpcError a raw Score call fails with (the test fails if it succeeds)."""
        with pytest.raises(grpc.RpcError) as info:
            self.raw_score(items)
        return info.value

    def metric(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def reward_server(serve_in_thread):
    """Factory: reward_server(**RewardConfig fields) -> RewardServer serving that config."""

    def start(**fields) -> RewardServer:
        return RewardServer(serve_in_thread(build_service(RunConfig(reward=RewardConfig(**fields)))))

    return start
