"""What a weight sync sends, as plain dataclasses: the group's rendezvous info and the manifest of
flattened buckets. Conversion to and from the rlfabric.v1 messages lives here too, with the checks
a receiver runs on a manifest it did not build (InvalidArgument naming what is wrong)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rlfabric.core import codec
from rlfabric.core.errors import InvalidArgument
from rlfabric.v1 import weight_sync_pb2

TRANSPORTS = ("nccl", "gloo", "grpc")
_TRANSPORT_WIRE = {
    "nccl": weight_sync_pb2.WEIGHT_TRANSPORT_NCCL,
    "gloo": weight_sync_pb2.WEIGHT_TRANSPORT_GLOO,
    "grpc": weight_sync_pb2.WEIGHT_TRANSPORT_GRPC,
}
_TRANSPORT_NAME = {wire: name for name, wire in _TRANSPORT_WIRE.items()}
# Tensors start at multiples of this many bytes inside a bucket, so every dtype can view its slice.
ALIGNMENT = 64


def transport_to_proto(name: str) -> int:
    """"nccl" | "gloo" | "grpc" -> WeightTransport; "auto" or "" -> UNSPECIFIED (the actor chooses)."""
    return _TRANSPORT_WIRE.get(name, weight_sync_pb2.WEIGHT_TRANSPORT_UNSPECIFIED)


def transport_from_proto(wire: int) -> str:
    """WeightTransport -> "nccl" | "gloo" | "grpc"; "" for UNSPECIFIED."""
    return _TRANSPORT_NAME.get(wire, "")


@dataclass(frozen=True)
class SyncGroup:
    """Everything a receiver needs to join the actor's group (rlfabric.v1.WeightSyncGroup)."""

    group_id: str
    transport: str  # "nccl" | "gloo" | "grpc"
    world_size: int  # the sender (rank 0) plus every receiver
    timeout_s: float
    store_host: str = ""  # gloo
    store_port: int = 0  # gloo
    nccl_unique_id: bytes = b""  # nccl

    def to_proto(self) -> weight_sync_pb2.WeightSyncGroup:
        return weight_sync_pb2.WeightSyncGroup(
            group_id=self.group_id, transport=transport_to_proto(self.transport), world_size=self.world_size,
            nccl_unique_id=self.nccl_unique_id, store_host=self.store_host, store_port=self.store_port,
            timeout_s=self.timeout_s)

    @classmethod
    def from_proto(cls, message: weight_sync_pb2.WeightSyncGroup) -> SyncGroup:
        transport = transport_from_proto(message.transport)
        if not message.group_id:
            raise InvalidArgument("weight-sync group has no group_id")
        if not transport:
            raise InvalidArgument(f"weight-sync group {message.group_id} has no transport")
        if message.world_size < 2:
            raise InvalidArgument(f"weight-sync group {message.group_id}: world_size {message.world_size} < 2")
        if not (math.isfinite(message.timeout_s) and message.timeout_s > 0):
            raise InvalidArgument(f"weight-sync group {message.group_id}: timeout_s must be > 0")
        if transport == "gloo" and not (message.store_host and 0 < message.store_port < 65536):
            raise InvalidArgument(f"gloo group {message.group_id} needs store_host and store_port")
        if transport == "nccl" and not message.nccl_unique_id:
            raise InvalidArgument(f"nccl group {message.group_id} needs nccl_unique_id")
        return cls(message.group_id, transport, message.world_size, message.timeout_s, message.store_host,
                   message.store_port, bytes(message.nccl_unique_id))

    def check_rank(self, rank: int) -> None:
        if not 1 <= rank < self.world_size:
            raise InvalidArgument(f"receiver rank {rank} outside 1..{self.world_size - 1} of group {self.group_id}")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor inside a bucket: `num_bytes` bytes at `offset`, cast to `dtype`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BucketSpec:
    """One flattened bucket: sent as a single collective (or stream of chunks)."""

    index: int
    num_bytes: int
    tensors: tuple[TensorSpec, ...]
    crc32: int = 0  # filled in once the bucket is packed


@dataclass(frozen=True)
class Manifest:
    """One sync: receivers serve `version` once every bucket has landed and checked out."""

    version: int
    group_id: str
    buckets: tuple[BucketSpec, ...] = field(default_factory=tuple)

    @property
    def num_bytes(self) -> int:
        return sum(b.num_bytes for b in self.buckets)

    def to_proto(self) -> weight_sync_pb2.WeightManifest:
        return weight_sync_pb2.WeightManifest(version=self.version, group_id=self.group_id, buckets=[
            weight_sync_pb2.WeightBucket(index=b.index, num_bytes=b.num_bytes, crc32=b.crc32, tensors=[
                weight_sync_pb2.WeightTensorSpec(name=t.name, dtype=codec.wire_dtype(t.dtype), shape=t.shape,
                                                 offset=t.offset) for t in b.tensors])
            for b in self.buckets])

    @classmethod
    def from_proto(cls, message: weight_sync_pb2.WeightManifest) -> Manifest:
        """The manifest, after checking it describes buckets a receiver can safely slice."""
        if not message.buckets:
            raise InvalidArgument("weight manifest has no buckets")
        if message.version < 0:
            raise InvalidArgument(f"weight manifest version {message.version} < 0")
        buckets, names = [], set()
        for position, bucket in enumerate(message.buckets):
            if bucket.index != position:
                raise InvalidArgument(f"weight manifest bucket {position} has index {bucket.index}")
            if bucket.num_bytes <= 0:
                raise InvalidArgument(f"weight manifest bucket {position} has {bucket.num_bytes} bytes")
            tensors = []
            for spec in bucket.tensors:
                tensor = TensorSpec(spec.name, codec.torch_dtype(spec.dtype), tuple(spec.shape), spec.offset)
                where = f"weight manifest bucket {position} tensor {spec.name!r}"
                if not spec.name or spec.name in names:
                    raise InvalidArgument(f"{where}: empty or repeated name")
                if any(d < 0 for d in tensor.shape) or spec.offset < 0 or spec.offset % ALIGNMENT:
                    raise InvalidArgument(f"{where}: negative dimension or misaligned offset {spec.offset}")
                if spec.offset + tensor.num_bytes > bucket.num_bytes:
                    raise InvalidArgument(f"{where}: bytes {spec.offset}..{spec.offset + tensor.num_bytes} "
                                          f"outside the bucket's {bucket.num_bytes}")
                names.add(spec.name)
                tensors.append(tensor)
            buckets.append(BucketSpec(bucket.index, bucket.num_bytes, tuple(tensors), bucket.crc32))
        return cls(message.version, message.group_id, tuple(buckets))
