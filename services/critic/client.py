"""Clients of the critic service: CriticInterface (what the coordinator calls), over gRPC (CriticClient)
and in this process (LocalCriticClient)."""

from __future__ import annotations

from abc import abstractmethod

import torch

from rlfabric.core import codec
from rlfabric.core.client import ServiceClient
from rlfabric.trainer.client import (
    FORWARD_BATCH,
    VALUE_UPDATE_BATCH,
    LocalTrainerClient,
    Tensors,
    TrainableInterface,
    decoded_tensors,
)
from rlfabric.v1 import common_pb2, critic_pb2, critic_pb2_grpc

SERVICE = critic_pb2.DESCRIPTOR.services_by_name["CriticService"].full_name


class CriticInterface(TrainableInterface):
    """The value model: values, value-loss updates, checkpoints."""

    role = "critic"

    @abstractmethod
    async def compute_values(self, batch: Tensors, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """{"values": [B, T]}, 0 on response padding."""

    @abstractmethod
    async def update_values(self, batch: Tensors, global_step: int = 0,
                            timeout_s: float | None = None) -> dict[str, float]:
        """Value-loss update on the batch (+ values, returns); critic/* metrics."""

    @abstractmethod
    async def get_status(self) -> critic_pb2.CriticServiceGetStatusResponse:
        """Model, ranks, optimizer step."""


class CriticClient(ServiceClient, CriticInterface):
    """CriticInterface over gRPC."""

    stub_class = critic_pb2_grpc.CriticServiceStub

    async def compute_values(self, batch: Tensors, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        payload = codec.serialized_with_batch(critic_pb2.CriticServiceComputeValuesRequest(), ("batch",), batch)
        response = await self.call_serialized(SERVICE, "ComputeValues", payload,
                                              critic_pb2.CriticServiceComputeValuesResponse, timeout_s)
        return decoded_tensors(response.outputs)

    async def update_values(self, batch: Tensors, global_step: int = 0,
                            timeout_s: float | None = None) -> dict[str, float]:
        request = critic_pb2.CriticServiceUpdateValuesRequest(global_step=global_step)
        payload = codec.serialized_with_batch(request, ("batch",), batch)
        response = await self.call_serialized(SERVICE, "UpdateValues", payload,
                                              critic_pb2.CriticServiceUpdateValuesResponse, timeout_s)
        return dict(response.metrics)

    async def save_checkpoint(self, path: str, timeout_s: float | None = None) -> int:
        request = critic_pb2.CriticServiceSaveCheckpointRequest(location=common_pb2.CheckpointLocation(path=str(path)))
        return (await self.call("SaveCheckpoint", request, timeout_s)).num_bytes

    async def load_checkpoint(self, path: str, timeout_s: float | None = None) -> int:
        request = critic_pb2.CriticServiceLoadCheckpointRequest(location=common_pb2.CheckpointLocation(path=str(path)))
        return (await self.call("LoadCheckpoint", request, timeout_s)).optimizer_step

    async def get_status(self) -> critic_pb2.CriticServiceGetStatusResponse:
        return await self.call("GetStatus", critic_pb2.CriticServiceGetStatusRequest())


class LocalCriticClient(LocalTrainerClient, CriticInterface):
    """CriticInterface over a TrainerEngine("critic") in this process."""

    async def compute_values(self, batch: Tensors, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        codec.check_batch(batch, *FORWARD_BATCH)
        return await self.engine.compute(dict(batch))

    async def update_values(self, batch: Tensors, global_step: int = 0,
                            timeout_s: float | None = None) -> dict[str, float]:
        return await self._update(batch, VALUE_UPDATE_BATCH, global_step)

    async def get_status(self) -> critic_pb2.CriticServiceGetStatusResponse:
        status = self.engine.status()
        return critic_pb2.CriticServiceGetStatusResponse(
            model=status.model, world_size=status.world_size, optimizer_step=status.optimizer_step)
