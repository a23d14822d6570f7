"""gRPC servicers of the actor, reference and critic roles (thin: proto -> tensors -> await engine -> proto),
and build_service, which rlfabric.serve calls for these roles.

Weight sync (rlfabric.weight_sync): the actor is rank 0 of the groups it opens
(OpenWeightSyncGroup, PrepareWeightSync, BroadcastWeights, CloseWeightSyncGroup); the reference
joins one and receives (JoinWeightSyncGroup, ReceiveWeights).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rlfabric.actor.client import FORWARD_BATCH, POLICY_UPDATE_BATCH, VALUE_UPDATE_BATCH, wire_temperature
from rlfabric.actor.engine import TrainerEngine
from rlfabric.core import codec
from rlfabric.core.config import RunConfig
from rlfabric.core.server import ServiceBinding, ServiceDefinition
from rlfabric.v1 import (
    actor_pb2,
    actor_pb2_grpc,
    critic_pb2,
    critic_pb2_grpc,
    reference_pb2,
    reference_pb2_grpc,
)
from rlfabric.weight_sync import Manifest, SyncGroup
from rlfabric.weight_sync.manifest import transport_from_proto


def _decode_log_probs_input(message: actor_pb2.LogProbsInput) -> tuple[dict, float, bool]:
    batch = codec.decode_batch(message.batch, *FORWARD_BATCH)
    return batch.tensors, wire_temperature(message.temperature), message.compute_entropy


class ActorServicer(actor_pb2_grpc.ActorServiceServicer):
    def __init__(self, engine: TrainerEngine):
        self.engine = engine

    async def ComputeLogProbs(self, request, context):
        tensors, temperature, entropy = _decode_log_probs_input(request.input)
        outputs = await self.engine.compute(tensors, temperature, entropy, base_model=request.input.base_model)
        return actor_pb2.ComputeLogProbsResponse(outputs=codec.encode_batch(outputs))

    async def UpdatePolicy(self, request, context):
        batch = codec.decode_batch(request.batch, *POLICY_UPDATE_BATCH)
        metrics = await self.engine.update(batch.tensors, request.global_step)
        return actor_pb2.UpdatePolicyResponse(metrics=metrics)

    async def SaveCheckpoint(self, request, context):
        num_bytes = await self.engine.save_checkpoint(request.location.path)
        return actor_pb2.SaveCheckpointResponse(num_bytes=num_bytes)

    async def LoadCheckpoint(self, request, context):
        step = await self.engine.load_checkpoint(request.location.path)
        return actor_pb2.LoadCheckpointResponse(optimizer_step=step)

    async def ExportHF(self, request, context):
        num_bytes = await self.engine.export_hf(request.path)
        return actor_pb2.ExportHFResponse(num_bytes=num_bytes)

    async def OpenWeightSyncGroup(self, request, context):
        dtype = codec.torch_dtype(request.target_dtype) if request.target_dtype else None
        group = await self.engine.open_weight_sync(
            transport_from_proto(request.transport), request.num_receivers, request.bucket_bytes, dtype,
            request.timeout_s, tuple(request.grpc_receiver_addresses))
        return actor_pb2.OpenWeightSyncGroupResponse(group=group.to_proto())

    async def PrepareWeightSync(self, request, context):
        manifest = await self.engine.prepare_weight_sync(request.group_id, request.version)
        return actor_pb2.PrepareWeightSyncResponse(manifest=manifest.to_proto())

    async def BroadcastWeights(self, request, context):
        result = await self.engine.broadcast_weights(request.group_id, request.version)
        return actor_pb2.BroadcastWeightsResponse(num_bytes=result.num_bytes, seconds=result.seconds, pushes=[
            actor_pb2.WeightPushResult(address=p.address, version=p.version, paused_seconds=p.paused_seconds,
                                       error=p.error) for p in result.pushes])

    async def CloseWeightSyncGroup(self, request, context):
        await self.engine.close_weight_sync(request.group_id)
        return actor_pb2.CloseWeightSyncGroupResponse()

    async def GetStatus(self, request, context):
        status = self.engine.status()
        return actor_pb2.ActorServiceGetStatusResponse(
            model=status.model, world_size=status.world_size, optimizer_step=status.optimizer_step,
            num_parameters=status.num_parameters)


class ReferenceServicer(reference_pb2_grpc.ReferenceServiceServicer):
    def __init__(self, engine: TrainerEngine):
        self.engine = engine

    async def ComputeLogProbs(self, request, context):
        tensors, temperature, entropy = _decode_log_probs_input(request.input)
        outputs = await self.engine.compute(tensors, temperature, entropy, base_model=request.input.base_model)
        return reference_pb2.ReferenceServiceComputeLogProbsResponse(outputs=codec.encode_batch(outputs))

    async def JoinWeightSyncGroup(self, request, context):
        await self.engine.join_weight_sync(SyncGroup.from_proto(request.group), request.rank)
        return reference_pb2.ReferenceServiceJoinWeightSyncGroupResponse()

    async def ReceiveWeights(self, request, context):
        version = await self.engine.receive_weights(Manifest.from_proto(request.manifest))
        return reference_pb2.ReferenceServiceReceiveWeightsResponse(version=version)

    async def GetStatus(self, request, context):
        # weight_version 0: the weights as loaded from the model path
        return reference_pb2.ReferenceServiceGetStatusResponse(model=self.engine.status().model,
                                                               weight_version=self.engine.weight_version)


class CriticServicer(critic_pb2_grpc.CriticServiceServicer):
    def __init__(self, engine: TrainerEngine):
        self.engine = engine

    async def ComputeValues(self, request, context):
        batch = codec.decode_batch(request.batch, *FORWARD_BATCH)
        outputs = await self.engine.compute(batch.tensors)
        return critic_pb2.ComputeValuesResponse(outputs=codec.encode_batch(outputs))

    async def UpdateValues(self, request, context):
        batch = codec.decode_batch(request.batch, *VALUE_UPDATE_BATCH)
        metrics = await self.engine.update(batch.tensors, request.global_step)
        return critic_pb2.UpdateValuesResponse(metrics=metrics)

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


_BINDINGS = {
    "actor": (ActorServicer, actor_pb2_grpc.add_ActorServiceServicer_to_server, "rlfabric.v1.ActorService"),
    "reference": (ReferenceServicer, reference_pb2_grpc.add_ReferenceServiceServicer_to_server,
                  "rlfabric.v1.ReferenceService"),
    "critic": (CriticServicer, critic_pb2_grpc.add_CriticServiceServicer_to_server, "rlfabric.v1.CriticService"),
}


def build_service(role: str, config: RunConfig) -> ServiceDefinition:
    """The actor, reference or critic service: its servicer over a TrainerEngine (loaded in start())."""
    servicer_class, add_to_server, full_name = _BINDINGS[role]
    registry = CollectorRegistry()
    engine = TrainerEngine(role, config, registry)
    binding = ServiceBinding(servicer_class(engine), add_to_server, full_name)
    return ServiceDefinition(role=role, bindings=[binding], engine=engine, registry=registry)
