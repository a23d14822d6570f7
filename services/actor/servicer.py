"""ActorService (thin: proto -> tensors -> await engine -> proto) and build_service, which rlfabric.serve
calls; the service of each model role is built by rlfabric.trainer.servicer.build_trainer_service (one engine, three roles).

Weight sync (rlfabric.weight_sync): the actor is rank 0 of the groups it opens
(OpenWeightSyncGroup, PrepareWeightSync, BroadcastWeights, CloseWeightSyncGroup); the reference
joins one and receives (JoinWeightSyncGroup, ReceiveWeights).
"""

from __future__ import annotations

from rlfabric.core import codec
from rlfabric.core.config import RunConfig
from rlfabric.core.server import ServiceDefinition
from rlfabric.trainer import ragged
from rlfabric.trainer.client import POLICY_UPDATE_BATCH
from rlfabric.trainer.engine import TrainerEngine
from rlfabric.trainer.servicer import build_trainer_service, decode_log_probs_input
from rlfabric.v1 import actor_pb2, actor_pb2_grpc
from rlfabric.weight_sync.manifest import transport_from_proto


class ActorServicer(actor_pb2_grpc.ActorServiceServicer):
    def __init__(self, engine: TrainerEngine):
        self.engine = engine

    async def ComputeLogProbs(self, request, context):
        tensors, temperature, entropy = decode_log_probs_input(request.input)
        outputs = await self.engine.compute(tensors, temperature, entropy, base_model=request.input.base_model,
                                            with_sum_pi_squared=request.input.compute_sum_pi_squared)
        response = actor_pb2.ActorServiceComputeLogProbsResponse()
        codec.encode_batch(outputs, out=response.outputs)
        return response

    async def UpdatePolicy(self, request, context):
        batch = codec.decode_batch(request.batch, *POLICY_UPDATE_BATCH)
        metrics = await self.engine.update(batch.tensors, request.global_step)
        return actor_pb2.ActorServiceUpdatePolicyResponse(metrics=metrics)

    async def UpdatePolicyStream(self, request_iterator, context):
        batch = await ragged.received_batch(request_iterator)
        codec.check_batch_names(batch.names(), *POLICY_UPDATE_BATCH)
        metrics = await self.engine.update(batch, batch.header.global_step)
        return actor_pb2.ActorServiceUpdatePolicyStreamResponse(metrics=metrics)

    async def SaveCheckpoint(self, request, context):
        num_bytes = await self.engine.save_checkpoint(request.location.path)
        return actor_pb2.ActorServiceSaveCheckpointResponse(num_bytes=num_bytes)

    async def LoadCheckpoint(self, request, context):
        step = await self.engine.load_checkpoint(request.location.path)
        return actor_pb2.ActorServiceLoadCheckpointResponse(optimizer_step=step)

    async def ExportHF(self, request, context):
        num_bytes = await self.engine.export_hf(request.path)
        return actor_pb2.ActorServiceExportHFResponse(num_bytes=num_bytes)

    async def OpenWeightSyncGroup(self, request, context):
        dtype = codec.torch_dtype(request.target_dtype) if request.target_dtype else None
        group = await self.engine.weight_sync.open(
            transport_from_proto(request.transport), request.num_receivers, request.bucket_bytes, dtype,
            request.timeout_s, tuple(request.grpc_receiver_addresses), request.delta, relay=request.relay,
            delta_base_from=request.delta_base_from)
        return actor_pb2.ActorServiceOpenWeightSyncGroupResponse(group=group.to_proto())

    async def PrepareWeightSync(self, request, context):
        base = request.delta_base_version if request.HasField("delta_base_version") else None
        manifest = await self.engine.weight_sync.prepare(request.group_id, request.version, base)
        return actor_pb2.ActorServicePrepareWeightSyncResponse(manifest=manifest.to_proto())

    async def BroadcastWeights(self, request, context):
        result = await self.engine.weight_sync.broadcast(request.group_id, request.version)
        pushes = [actor_pb2.WeightPushResult(address=p.address, version=p.version, paused_seconds=p.paused_seconds,
                                             error=p.error, phases=p.phases.to_proto()) for p in result.pushes]
        return actor_pb2.ActorServiceBroadcastWeightsResponse(num_bytes=result.num_bytes, seconds=result.seconds,
                                                              pushes=pushes, phases=result.phases.to_proto(),
                                                              egress_bytes=result.egress_bytes)

    async def CloseWeightSyncGroup(self, request, context):
        await self.engine.weight_sync.close(request.group_id)
        return actor_pb2.ActorServiceCloseWeightSyncGroupResponse()

    async def GetStatus(self, request, context):
        status = self.engine.status()
        return actor_pb2.ActorServiceGetStatusResponse(
            model=status.model, world_size=status.world_size, optimizer_step=status.optimizer_step,
            num_parameters=status.num_parameters, device=status.device.to_proto())


def build_service(config: RunConfig) -> ServiceDefinition:
    """The actor role: ActorService over a TrainerEngine("actor")."""
    return build_trainer_service("actor", config, ActorServicer, actor_pb2_grpc.add_ActorServiceServicer_to_server,
                                 "rlfabric.v1.ActorService")
