"""ReferenceService (thin: proto -> tensors -> await engine -> proto) and build_service, which
rlfabric.serve calls. It joins the actor's weight-sync groups as a receiver (JoinWeightSyncGroup,
ReceiveWeights) when the run resets the reference to the policy (reference.sync_ref_model)."""

from __future__ import annotations

from rlfabric.core import codec
from rlfabric.core.config import RunConfig
from rlfabric.core.server import ServiceDefinition
from rlfabric.trainer.engine import TrainerEngine
from rlfabric.trainer.servicer import build_trainer_service, decode_log_probs_input
from rlfabric.v1 import reference_pb2, reference_pb2_grpc
from rlfabric.weight_sync.manifest import Manifest, SyncGroup


class ReferenceServicer(reference_pb2_grpc.ReferenceServiceServicer):
    def __init__(self, engine: TrainerEngine):
        self.engine = engine

    async def ComputeLogProbs(self, request, context):
        tensors, temperature, entropy = decode_log_probs_input(request.input)
        outputs = await self.engine.compute(tensors, temperature, entropy, base_model=request.input.base_model,
                                            with_sum_pi_squared=request.input.compute_sum_pi_squared)
        response = reference_pb2.ReferenceServiceComputeLogProbsResponse()
        codec.encode_batch(outputs, out=response.outputs)
        return response

    async def JoinWeightSyncGroup(self, request, context):
        group = SyncGroup.from_proto(request.group, self.engine.config.weight_sync.max_timeout_s)
        await self.engine.weight_sync.join(group, request.rank)
        return reference_pb2.ReferenceServiceJoinWeightSyncGroupResponse()

    async def ReceiveWeights(self, request, context):
        swap = await self.engine.weight_sync.receive(Manifest.from_proto(request.manifest))
        return reference_pb2.ReferenceServiceReceiveWeightsResponse(version=swap.version, phases=swap.phases.to_proto())

    async def GetStatus(self, request, context):
        # weight_version 0: the weights as loaded from the model path
        status = self.engine.status()
        return reference_pb2.ReferenceServiceGetStatusResponse(
            model=status.model, weight_version=self.engine.weight_sync.weight_version,
            device=status.device.to_proto())


def build_service(config: RunConfig) -> ServiceDefinition:
    """The reference role: ReferenceService over a TrainerEngine("reference")."""
    return build_trainer_service("reference", config, ReferenceServicer,
                                 reference_pb2_grpc.add_ReferenceServiceServicer_to_server, "rlfabric.v1.ReferenceService")
