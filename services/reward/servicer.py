"""RewardService: proto -> domain items -> await the engine -> proto. No scoring logic here."""

from __future__ import annotations

from rlfabric.reward import wire
from rlfabric.reward.engine import RewardEngine
from rlfabric.v1 import reward_pb2, reward_pb2_grpc


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Thin gRPC face of a RewardEngine; domain errors become status codes in the ErrorInterceptor."""

    def __init__(self, engine: RewardEngine):
        self.engine = engine

    async def Score(self, request: reward_pb2.ScoreRequest, context) -> reward_pb2.ScoreResponse:
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
