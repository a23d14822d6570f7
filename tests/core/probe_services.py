"""Small servicers used to exercise the shared server runtime (interceptors, health, limits).

They are real gRPC servicers of the rlfabric.v1 services, served by the real runtime; only
their behaviour is scripted so each runtime path can be triggered on demand.
"""

from __future__ import annotations

import asyncio

from rlfabric.core import codec
from rlfabric.core.errors import InvalidArgument
from rlfabric.core.server import ServiceBinding, ServiceDefinition
from rlfabric.v1 import (
    actor_pb2,
    actor_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)


class ProbeReward(reward_pb2_grpc.RewardServiceServicer):
    """Score's behaviour follows items[0].data_source: ok, invalid, crash, sleep:<seconds>, or write:<path>
    (writes 1 MiB there, as a handler that does not expect its disk to be full)."""

    def __init__(self):
        self.finished = 0

    async def Score(self, request, context):
        source = request.items[0].data_source if request.items else "ok"
        if source == "invalid":
            raise InvalidArgument("item 0: ground_truth is required")
        if source == "crash":
            raise RuntimeError("scorer blew up")
        if source.startswith("sleep:"):
            await asyncio.sleep(float(source.split(":")[1]))
        if source.startswith("write:"):
            with open(source.removeprefix("write:"), "wb") as file:
                file.write(bytes(1 << 20))
        self.finished += 1
        return reward_pb2.RewardServiceScoreResponse(results=[reward_pb2.ScoreResult(score=1.0) for _ in request.items])


class ProbeActor(actor_pb2_grpc.ActorServiceServicer):
    """ComputeLogProbs decodes the batch with the codec and echoes the row count."""

    async def ComputeLogProbs(self, request, context):
        batch = codec.decode_batch(request.input.batch, required=["input_ids"])
        rows = batch.num_rows
        outputs = codec.encode_batch({"rows": codec.torch.zeros(rows)})
        return actor_pb2.ActorServiceComputeLogProbsResponse(outputs=outputs)


class ProbeCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """StreamMetrics yields three steps (server streaming)."""

    async def StreamMetrics(self, request, context):
        for step in range(request.from_step, request.from_step + 3):
            yield coordinator_pb2.CoordinatorServiceStreamMetricsResponse(step=step,
                                                                          metrics={"critic/score/mean": step / 10})


class ProbeRollout(rollout_pb2_grpc.RolloutServiceServicer):
    """PushWeights sums the bytes of the stream (client streaming)."""

    async def PushWeights(self, request_iterator, context):
        total = 0
        async for message in request_iterator:
            total += len(message.data)
        return rollout_pb2.RolloutServicePushWeightsResponse(version=total)


class GatedEngine:
    """An engine whose start() waits until the test opens the gate (a slow model load)."""

    def __init__(self, open_at_start: bool = True):
        self.gate = asyncio.Event()
        self.open_at_start = open_at_start
        self.stopped = False

    async def start(self) -> None:
        if not self.open_at_start:
            await self.gate.wait()

    async def stop(self) -> None:
        self.stopped = True


def probe_service(engine: GatedEngine | None = None) -> ServiceDefinition:
    """All four probe servicers in one server."""
    bindings = [
        ServiceBinding(ProbeReward(), reward_pb2_grpc.add_RewardServiceServicer_to_server, "rlfabric.v1.RewardService"),
        ServiceBinding(ProbeActor(), actor_pb2_grpc.add_ActorServiceServicer_to_server, "rlfabric.v1.ActorService"),
        ServiceBinding(
            ProbeCoordinator(), coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
            "rlfabric.v1.CoordinatorService",
        ),
        ServiceBinding(
            ProbeRollout(), rollout_pb2_grpc.add_RolloutServiceServicer_to_server, "rlfabric.v1.RolloutService"
        ),
    ]
    return ServiceDefinition(role="probe", bindings=bindings, engine=engine or GatedEngine())
