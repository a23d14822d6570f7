"""CriticService (thin: proto -> tensors -> await engine -> proto) and build_service, which
rlfabric.serve calls."""

from __future__ import annotations

from rlfabric.core import codec
from rlfabric.core.config import RunConfig
from rlfabric.core.server import ServiceDefinition
from rlfabric.trainer.client import FORWARD_BATCH, VALUE_UPDATE_BATCH
from rlfabric.trainer.engine import TrainerEngine
from rlfabric.trainer.servicer import build_trainer_service
from rlfabric.v1 import critic_pb2, critic_pb2_grpc


class CriticServicer(critic_pb2_grpc.CriticServiceServicer):
    def __init__(self, engine: TrainerEngine):
        self.engine = engine

    async def ComputeValues(self, request, context):
        batch = codec.decode_batch(request.batch, *FORWARD_BATCH)
        outputs = await self.engine.compute(batch.tensors)
        response = critic_pb2.CriticServiceComputeValuesResponse()
        codec.encode_batch(outputs, out=response.outputs)
        return response

    async def UpdateValues(self, request, context):
        batch = codec.decode_batch(request.batch, *VALUE_UPDATE_BATCH)
        metrics = await self.engine.update(batch.tensors, request.global_step)
        return critic_pb2.CriticServiceUpdateValuesResponse(metrics=metrics)

    async def SaveCheckpoint(self, request, context):
        num_bytes = await self.engine.save_checkpoint(request.location.path)
        return critic_pb2.CriticServiceSaveCheckpointResponse(num_bytes=num_bytes)

    async def LoadCheckpoint(self, request, context):
        step = await self.engine.load_checkpoint(request.location.path)
        return critic_pb2.CriticServiceLoadCheckpointResponse(optimizer_step=step)

    async def GetStatus(self, request, context):
        status = self.engine.status()
        return critic_pb2.CriticServiceGetStatusResponse(
            model=status.model, world_size=status.world_size, optimizer_step=status.optimizer_step)


def build_service(config: RunConfig) -> ServiceDefinition:
    """The critic role: CriticService over a TrainerEngine("critic")."""
    return build_trainer_service("critic", config, CriticServicer, critic_pb2_grpc.add_CriticServiceServicer_to_server,
                                 "rlfabric.v1.CriticService")
