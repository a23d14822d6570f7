"""Clients of the reference service: ReferenceInterface (what the coordinator calls), over gRPC
(ReferenceClient), and in this process (LocalReferenceClient); the teacher's (algorithm.distill), a reference of
another model, the same three as TeacherInterface, TeacherClient and LocalTeacherClient. The reference for free under LoRA, the actor's base model, is
rlfabric.coordinator.peers.ActorAsReference."""

from __future__ import annotations

from abc import abstractmethod

import torch

from rlfabric.core import codec
from rlfabric.core.client import RoleInterface, ServiceClient
from rlfabric.trainer.client import LocalTrainerClient, Tensors, decoded_tensors, log_probs_input
from rlfabric.v1 import reference_pb2, reference_pb2_grpc
from rlfabric.weight_sync.manifest import Manifest, SyncGroup
from rlfabric.weight_sync.phases import SyncPhases
from rlfabric.weight_sync.receiver import WeightSwap

SERVICE = reference_pb2.DESCRIPTOR.services_by_name["ReferenceService"].full_name


class ReferenceInterface(RoleInterface):
    """The reference policy: log-probs, and the receiving side of the weight syncs that reset it to the policy
    (reference.sync_ref_model)."""

    role = "reference"

    @abstractmethod
    async def compute_log_probs(self, batch: Tensors, temperature: float = 1.0, compute_entropy: bool = False,
                                timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """{"log_probs": [B, T]} under the reference weights."""

    @abstractmethod
    async def get_status(self) -> reference_pb2.ReferenceServiceGetStatusResponse:
        """Model, ranks, weight version."""

    @abstractmethod
    async def join_weight_sync_group(self, group: SyncGroup, rank: int, timeout_s: float | None = None) -> None:
        """Joins (or rejoins) the actor's weight-sync group as `rank`."""

    @abstractmethod
    async def receive_weights(self, manifest: Manifest, timeout_s: float | None = None) -> WeightSwap:
        """The version now served (paused_seconds: how long the load took) and the reference's phases."""


class ReferenceClient(ServiceClient, ReferenceInterface):
    """ReferenceInterface over gRPC."""

    stub_class = reference_pb2_grpc.ReferenceServiceStub

    async def compute_log_probs(self, batch: Tensors, temperature: float = 1.0, compute_entropy: bool = False,
                                timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        request = reference_pb2.ReferenceServiceComputeLogProbsRequest(
            input=log_probs_input(temperature, compute_entropy))
        payload = codec.serialized_with_batch(request, ("input", "batch"), batch)
        response = await self.call_serialized(SERVICE, "ComputeLogProbs", payload,
                                              reference_pb2.ReferenceServiceComputeLogProbsResponse, timeout_s)
        return decoded_tensors(response.outputs)

    async def get_status(self) -> reference_pb2.ReferenceServiceGetStatusResponse:
        return await self.call("GetStatus", reference_pb2.ReferenceServiceGetStatusRequest())

    async def join_weight_sync_group(self, group: SyncGroup, rank: int, timeout_s: float | None = None) -> None:
        request = reference_pb2.ReferenceServiceJoinWeightSyncGroupRequest(group=group.to_proto(), rank=rank)
        await self.call("JoinWeightSyncGroup", request, timeout_s)

    async def receive_weights(self, manifest: Manifest, timeout_s: float | None = None) -> WeightSwap:
        request = reference_pb2.ReferenceServiceReceiveWeightsRequest(manifest=manifest.to_proto())
        response = await self.call("ReceiveWeights", request, timeout_s)
        return WeightSwap(response.version, response.phases.apply_s, SyncPhases.from_proto(response.phases))


class LocalReferenceClient(LocalTrainerClient, ReferenceInterface):
    """ReferenceInterface over a TrainerEngine("reference") in this process."""

    async def compute_log_probs(self, batch: Tensors, temperature: float = 1.0, compute_entropy: bool = False,
                                timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        return await self._forward(batch, temperature, compute_entropy)

    async def get_status(self) -> reference_pb2.ReferenceServiceGetStatusResponse:
        status = self.engine.status()
        return reference_pb2.ReferenceServiceGetStatusResponse(
            model=status.model, weight_version=self.engine.weight_sync.weight_version,
            device=status.device.to_proto())

    async def join_weight_sync_group(self, group: SyncGroup, rank: int, timeout_s: float | None = None) -> None:
        await self.engine.weight_sync.join(group, rank)

    async def receive_weights(self, manifest: Manifest, timeout_s: float | None = None) -> WeightSwap:
        return await self.engine.weight_sync.receive(manifest)


class TeacherInterface(ReferenceInterface):
    """The teacher of on-policy distillation (algorithm.distill): a reference service holding teacher.model_path,
    whose log-probs score the student's samples. It is never synced: its weight-sync calls are refused."""

    role = "teacher"


class TeacherClient(ReferenceClient, TeacherInterface):
    """TeacherInterface over gRPC (the ReferenceService's wire)."""


class LocalTeacherClient(LocalReferenceClient, TeacherInterface):
    """TeacherInterface over a TrainerEngine("teacher") in this process."""
