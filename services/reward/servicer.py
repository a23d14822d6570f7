"""RewardService: proto -> domain items -> await the engine -> proto (no scoring logic here), and
build_service, which `rlfabric serve reward` calls. Nothing here imports torch."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import RunConfig
from rlfabric.core.server import ServiceBinding, ServiceDefinition
from rlfabric.reward import wire
from rlfabric.reward.engine import RewardEngine
from rlfabric.v1 import reward_pb2, reward_pb2_grpc

SERVICE_NAME = "rlfabric.v1.RewardService"


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Thin gRPC face of a RewardEngine; domain errors become status codes in the ErrorInterceptor."""

    def __init__(self, engine: RewardEngine):
        self.engine = engine

    async def Score(self, request: reward_pb2.RewardServiceScoreRequest,
                    context) -> reward_pb2.RewardServiceScoreResponse:
        self.engine.check_batch_size(len(request.items))  # before converting a too-large batch
        results = await self.engine.score(wire.items_from_request(request))
        return wire.response_from_results(results)

    async def GetStatus(self, request, context) -> reward_pb2.RewardServiceGetStatusResponse:
        status = self.engine.status()
        return reward_pb2.RewardServiceGetStatusResponse(
            data_sources=status.data_sources,
            items_scored=status.items_scored,
            items_failed=status.items_failed,
        )


def build_service(config: RunConfig) -> ServiceDefinition:
    """The reward role: a RewardEngine for config.reward behind RewardService."""
    registry = CollectorRegistry()
    # Only a judge reads the mesh's credentials: a reward service without one starts without them.
    judge_options = ChannelOptions.from_config(config) if config.reward.judge.addresses else None
    engine = RewardEngine(config.reward, registry, max_response_length=config.data.max_response_length,
                          judge_options=judge_options)
    binding = ServiceBinding(RewardServicer(engine), reward_pb2_grpc.add_RewardServiceServicer_to_server, SERVICE_NAME)
    return ServiceDefinition(role="reward", bindings=[binding], engine=engine, registry=registry)
