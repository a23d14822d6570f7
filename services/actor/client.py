"""Clients of the actor service: torch tensors in, torch tensors out (what the three model roles' clients
share is in rlfabric.trainer.client: they run one engine, rlfabric.trainer.engine).

    async with ActorClient("127.0.0.1:50051") as actor:
        out = await actor.compute_log_probs(batch, temperature=0.7)        # {"log_probs": [B, T]}
        metrics = await actor.update_policy({**batch, "old_log_probs": out["log_probs"], "advantages": adv})

ActorInterface is what the coordinator calls; ActorClient implements it over gRPC and LocalActorClient
over a TrainerEngine in this process (the in-process mesh, rlfabric.launch.inprocess). `batch` is
a dict of tensors in the layout of rlfabric.trainer.batch. Failed calls raise the domain error of their
status code (InvalidArgument, Unavailable, ...), over gRPC naming the role, its address and the call;
in process the same class, raised by the same check (a request is checked against the batch schemas
of rlfabric.trainer.client by both: the servicer while decoding, the local client before calling the engine).
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from rlfabric.core import codec
from rlfabric.core.client import ServiceClient
from rlfabric.trainer import ragged
from rlfabric.trainer.client import (
    POLICY_UPDATE_BATCH,
    LocalTrainerClient,
    Tensors,
    TrainableInterface,
    decoded_tensors,
    log_probs_input,
)
from rlfabric.v1 import actor_pb2, actor_pb2_grpc, common_pb2
from rlfabric.weight_sync.grpc_stream import PushResult
from rlfabric.weight_sync.manifest import Manifest, SyncGroup, transport_to_proto
from rlfabric.weight_sync.phases import SyncPhases
from rlfabric.weight_sync.sender import BroadcastResult

SERVICE = actor_pb2.DESCRIPTOR.services_by_name["ActorService"].full_name

# -- the interfaces ----------------------------------------------------------------------------------


class ActorInterface(TrainableInterface):
    """The policy being trained: log-probs, PPO updates, checkpoints, and the sending side of weight sync."""

    role = "actor"

    @abstractmethod
    async def compute_log_probs(self, batch: Tensors, temperature: float = 1.0, compute_entropy: bool = False,
                                timeout_s: float | None = None, base_model: bool = False,
                                compute_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        """{"log_probs": [B, T]} (+ "entropy" [B, T], + "sum_pi_squared" [B, T]: sum_v pi(v)^2), float32, 0 on
        response padding. base_model: with LoRA, the base model's (the adapters off), which is the reference
        policy."""

    @abstractmethod
    async def update_policy(self, batch: Tensors, global_step: int = 0,
                            timeout_s: float | None = None) -> dict[str, float]:
        """PPO update on the batch (+ old_log_probs, advantages[, ref_log_probs, rollout_is_weights]);
        VeRL-named metrics."""

    @abstractmethod
    async def export_hf(self, path: str, timeout_s: float | None = None) -> int:
        """The policy as a Hugging Face directory; bytes written."""

    @abstractmethod
    async def get_status(self) -> actor_pb2.ActorServiceGetStatusResponse:
        """Model, ranks, optimizer step."""

    @abstractmethod
    async def open_weight_sync_group(self, transport: str, num_receivers: int, bucket_bytes: int = 0,
                                     target_dtype: torch.dtype | None = None, timeout_s: float = 0.0,
                                     grpc_receiver_addresses: tuple[str, ...] = (), delta: bool = False,
                                     relay: str = "", delta_base_from: str = "") -> SyncGroup:
        """A new weight-sync group with the actor as rank 0 (transport "auto"/"" lets the actor choose); `delta`:
        it keeps what it last sent, to send only the change (weight_sync.delta); `relay` (grpc): "chain" = the
        receivers forward the push along grpc_receiver_addresses (weight_sync.relay); `delta_base_from`: an open delta
        group whose base the new one takes over, closing it (its first sync may then be a delta)."""

    @abstractmethod
    async def prepare_weight_sync(self, group_id: str, version: int, timeout_s: float | None = None,
                                  delta_base_version: int | None = None) -> Manifest:
        """Gathers and packs the weights; the manifest to hand to every receiver. Delta groups: the change against
        `delta_base_version` when every receiver holds it and the actor last sent it, else the full weights."""

    @abstractmethod
    async def broadcast_weights(self, group_id: str, version: int, timeout_s: float | None = None) -> BroadcastResult:
        """Sends the prepared weights to the group (the receivers are in ReceiveWeights meanwhile)."""

    @abstractmethod
    async def close_weight_sync_group(self, group_id: str, timeout_s: float | None = None) -> None:
        """Drops the group and what it holds."""


class ActorClient(ServiceClient, ActorInterface):
    """ActorInterface over gRPC."""

    stub_class = actor_pb2_grpc.ActorServiceStub

    async def compute_log_probs(self, batch: Tensors, temperature: float = 1.0, compute_entropy: bool = False,
                                timeout_s: float | None = None, base_model: bool = False,
                                compute_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        request = actor_pb2.ActorServiceComputeLogProbsRequest(
            input=log_probs_input(temperature, compute_entropy, base_model, compute_sum_pi_squared))
        payload = codec.serialized_with_batch(request, ("input", "batch"), batch)
        response = await self.call_serialized(SERVICE, "ComputeLogProbs", payload,
                                              actor_pb2.ActorServiceComputeLogProbsResponse, timeout_s)
        return decoded_tensors(response.outputs)

    async def update_policy(self, batch: Tensors, global_step: int = 0,
                            timeout_s: float | None = None) -> dict[str, float]:
        """Streamed without its padding (UpdatePolicyStream, rlfabric.trainer.ragged): no message holds the
        whole batch. A batch outside that layout goes whole (UpdatePolicy), and the actor's checks name why."""
        rows = ragged.unpadded(batch)
        if rows is None:
            request = actor_pb2.ActorServiceUpdatePolicyRequest(global_step=global_step)
            payload = codec.serialized_with_batch(request, ("batch",), batch)
            response = await self.call_serialized(SERVICE, "UpdatePolicy", payload,
                                                  actor_pb2.ActorServiceUpdatePolicyResponse, timeout_s)
            return dict(response.metrics)
        response = await self.call_client_stream("UpdatePolicyStream", update_requests(rows, global_step), timeout_s)
        return dict(response.metrics)

    async def save_checkpoint(self, path: str, timeout_s: float | None = None) -> int:
        request = actor_pb2.ActorServiceSaveCheckpointRequest(location=common_pb2.CheckpointLocation(path=str(path)))
        return (await self.call("SaveCheckpoint", request, timeout_s)).num_bytes

    async def load_checkpoint(self, path: str, timeout_s: float | None = None) -> int:
        request = actor_pb2.ActorServiceLoadCheckpointRequest(location=common_pb2.CheckpointLocation(path=str(path)))
        return (await self.call("LoadCheckpoint", request, timeout_s)).optimizer_step

    async def export_hf(self, path: str, timeout_s: float | None = None) -> int:
        return (await self.call("ExportHF", actor_pb2.ActorServiceExportHFRequest(path=str(path)), timeout_s)).num_bytes

    async def get_status(self) -> actor_pb2.ActorServiceGetStatusResponse:
        return await self.call("GetStatus", actor_pb2.ActorServiceGetStatusRequest())

    async def open_weight_sync_group(self, transport: str, num_receivers: int, bucket_bytes: int = 0,
                                     target_dtype: torch.dtype | None = None, timeout_s: float = 0.0,
                                     grpc_receiver_addresses: tuple[str, ...] = (), delta: bool = False,
                                     relay: str = "", delta_base_from: str = "") -> SyncGroup:
        request = actor_pb2.ActorServiceOpenWeightSyncGroupRequest(
            transport=transport_to_proto(transport), num_receivers=num_receivers, bucket_bytes=bucket_bytes,
            target_dtype=codec.wire_dtype(target_dtype) if target_dtype is not None else 0, timeout_s=timeout_s,
            grpc_receiver_addresses=list(grpc_receiver_addresses), delta=delta, relay=relay,
            delta_base_from=delta_base_from)
        return SyncGroup.from_proto((await self.call("OpenWeightSyncGroup", request)).group)

    async def prepare_weight_sync(self, group_id: str, version: int, timeout_s: float | None = None,
                                  delta_base_version: int | None = None) -> Manifest:
        request = actor_pb2.ActorServicePrepareWeightSyncRequest(group_id=group_id, version=version,
                                                                 delta_base_version=delta_base_version)
        return Manifest.from_proto((await self.call("PrepareWeightSync", request, timeout_s)).manifest)

    async def broadcast_weights(self, group_id: str, version: int, timeout_s: float | None = None) -> BroadcastResult:
        request = actor_pb2.ActorServiceBroadcastWeightsRequest(group_id=group_id, version=version)
        response = await self.call("BroadcastWeights", request, timeout_s)
        pushes = tuple(PushResult(p.address, p.version, p.paused_seconds, p.error, SyncPhases.from_proto(p.phases))
                       for p in response.pushes)
        return BroadcastResult(response.num_bytes, response.seconds, pushes, SyncPhases.from_proto(response.phases),
                               response.egress_bytes)

    async def close_weight_sync_group(self, group_id: str, timeout_s: float | None = None) -> None:
        request = actor_pb2.ActorServiceCloseWeightSyncGroupRequest(group_id=group_id)
        await self.call("CloseWeightSyncGroup", request, timeout_s)


def update_requests(rows: ragged.Unpadded | Tensors, global_step: int = 0):
    """UpdatePolicyStream's messages: the header, then the rows a piece at a time (each cut as it is sent)."""
    rows = rows if isinstance(rows, ragged.Unpadded) else ragged.unpadded(rows)
    yield actor_pb2.ActorServiceUpdatePolicyStreamRequest(header=rows.header(global_step))
    for piece in rows.pieces():
        yield actor_pb2.ActorServiceUpdatePolicyStreamRequest(rows=piece)


class LocalActorClient(LocalTrainerClient, ActorInterface):
    """ActorInterface over a TrainerEngine("actor") in this process (started and stopped by its owner)."""

    async def compute_log_probs(self, batch: Tensors, temperature: float = 1.0, compute_entropy: bool = False,
                                timeout_s: float | None = None, base_model: bool = False,
                                compute_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        return await self._forward(batch, temperature, compute_entropy, base_model, compute_sum_pi_squared)

    async def update_policy(self, batch: Tensors, global_step: int = 0,
                            timeout_s: float | None = None) -> dict[str, float]:
        return await self._update(batch, POLICY_UPDATE_BATCH, global_step)

    async def export_hf(self, path: str, timeout_s: float | None = None) -> int:
        return await self.engine.export_hf(str(path))

    async def get_status(self) -> actor_pb2.ActorServiceGetStatusResponse:
        status = self.engine.status()
        return actor_pb2.ActorServiceGetStatusResponse(
            model=status.model, world_size=status.world_size, optimizer_step=status.optimizer_step,
            num_parameters=status.num_parameters, device=status.device.to_proto())

    async def open_weight_sync_group(self, transport: str, num_receivers: int, bucket_bytes: int = 0,
                                     target_dtype: torch.dtype | None = None, timeout_s: float = 0.0,
                                     grpc_receiver_addresses: tuple[str, ...] = (), delta: bool = False,
                                     relay: str = "", delta_base_from: str = "") -> SyncGroup:
        return await self.engine.weight_sync.open("" if transport == "auto" else transport, num_receivers,
                                                  bucket_bytes, target_dtype, timeout_s, grpc_receiver_addresses,
                                                  delta, relay=relay, delta_base_from=delta_base_from)

    async def prepare_weight_sync(self, group_id: str, version: int, timeout_s: float | None = None,
                                  delta_base_version: int | None = None) -> Manifest:
        return await self.engine.weight_sync.prepare(group_id, version, delta_base_version)

    async def broadcast_weights(self, group_id: str, version: int, timeout_s: float | None = None) -> BroadcastResult:
        return await self.engine.weight_sync.broadcast(group_id, version)

    async def close_weight_sync_group(self, group_id: str, timeout_s: float | None = None) -> None:
        await self.engine.weight_sync.close(group_id)


