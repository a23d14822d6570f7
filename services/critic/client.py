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
        request = critic_pb2.CriticServiceComputeValuesRequest()
        codec.encode_batch(batch, out=request.batch)
        return decoded_tensors((await self.call("ComputeValues", request, timeout_s)).outputs)

    async def update_values(self, batch: Tensors, global_step: int = 0,
                            timeout_s: float | None = None) -> dict[str, float]:
        request = critic_pb2.CriticServiceUpdateValuesRequest(global_step=global_step)
        codec.encode_batch(batch, out=request.batch)
        return dict((await self.call("UpdateValues", request, timeout_s)).metrics)

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
