"""Bucketing: named tensors -> a few flat byte buffers (cast to the receivers' dtype, CRC-32 each),
and back: a received buffer -> named views.

Why buckets: one collective per tensor pays a rendezvous per tensor (slime measured ~200 s vs ~16 s
for a 16B model with 512 MB buckets); one buffer for the whole model would double the peak memory
of the largest transfer. A tensor larger than the bucket size gets a bucket of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# ISA-L's CRC-32 is zlib's (the same values), 4-5x faster; its crc32_combine gives crc32(a + b) from
# the parts' CRCs, so a bucket whose chunks arrive out of order (several PushWeights streams) is
# checked chunk by chunk as they land, with no second pass over the whole bucket.
from isal.isal_zlib import crc32, crc32_combine  # noqa: F401 - crc32_combine: the receivers'

from rlfabric.core.errors import InvalidArgument
from rlfabric.weight_sync.manifest import BucketSpec, Manifest, TensorSpec, aligned

CRC32_IMPLEMENTATION = "isal"  # recorded by the weight-sync bench


def plan_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int,
                 dtype: torch.dtype | None = None, dense: bool = False) -> list[BucketSpec]:
    """Groups tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor alone).
    Floating-point tensors are announced in `dtype` (None keeps each tensor's own). `dense`: each tensor
    starts where the one before ends (rounded up to its element size only), the layout of SGLang's
    flattened buckets; otherwise at multiples of ALIGNMENT."""
    if bucket_bytes <= 0:
        raise InvalidArgument(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    buckets: list[BucketSpec] = []
    current: list[TensorSpec] = []
    offset = 0
    for name, tensor in tensors.items():
        wire = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        spec = TensorSpec(name, wire, tuple(tensor.shape), 0)
        if current and offset + spec.num_bytes > bucket_bytes:
            buckets.append(BucketSpec(len(buckets), offset, tuple(current)))
            current, offset = [], 0
        if dense:
            offset = -(-offset // wire.itemsize) * wire.itemsize
        current.append(TensorSpec(name, wire, spec.shape, offset))
        offset = offset + spec.num_bytes if dense else aligned(offset + spec.num_bytes)
    if current:
        buckets.append(BucketSpec(len(buckets), offset, tuple(current)))
    return buckets


def pack_bucket(spec: BucketSpec, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's bytes (uint8, CPU): each tensor cast to its announced dtype at its offset. `out`, a
    buffer an earlier pack of the same plan filled, is reused (its alignment padding is still zero)."""
    buffer = out if out is not None else torch.zeros(spec.num_bytes, dtype=torch.uint8)
    for tensor_spec in spec.tensors:
        view = tensor_view(buffer, tensor_spec)
        view.copy_(tensors[tensor_spec.name].detach().reshape(tensor_spec.shape))  # casts on the way
    return buffer


def tensor_view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor `spec` as a view into a bucket buffer (no copy)."""
    return buffer[spec.offset : spec.offset + spec.num_bytes].view(spec.dtype).view(spec.shape)


def checksum(buffer: torch.Tensor) -> int:
    """zlib's CRC-32 of a bucket's bytes (GPU buffers are copied to the host first)."""
    return crc32(buffer.detach().cpu().contiguous().view(torch.uint8).numpy())


def pack(tensors: Mapping[str, torch.Tensor], bucket_bytes: int, version: int, group_id: str,
         dtype: torch.dtype | None = None, reuse: Manifest | None = None,
         buffers: list[torch.Tensor] | None = None, dense: bool = False) -> tuple[Manifest, list[torch.Tensor]]:
    """Plans, packs and checksums every bucket: the manifest and the buffers to send, in order.
    `buffers` packed for the manifest `reuse` are filled again when the plan is the same (every step
    of a run): the bytes land in memory that is already mapped, which matters at GB scale."""
    plan = plan_buckets(tensors, bucket_bytes, dtype, dense)
    same = reuse is not None and buffers is not None and [(b.num_bytes, b.tensors) for b in reuse.buckets] == [
        (b.num_bytes, b.tensors) for b in plan]
    packed, buckets = [], []
    for spec in plan:
        buffer = pack_bucket(spec, tensors, buffers[spec.index] if same else None)
        packed.append(buffer)
        buckets.append(BucketSpec(spec.index, spec.num_bytes, spec.tensors, checksum(buffer)))
    return Manifest(version, group_id, tuple(buckets)), packed


class ChecksumMismatch(InvalidArgument):
    """A received bucket's bytes do not match the manifest's CRC-32: the whole update is rejected."""


def verify(buffer: torch.Tensor, spec: BucketSpec) -> None:
    """Raises ChecksumMismatch when the bucket's bytes are not what the sender packed."""
    actual = checksum(buffer)
    if actual != spec.crc32:
        raise ChecksumMismatch(f"weight bucket {spec.index}: CRC-32 {actual:#010x} of the received bytes != "
                               f"{spec.crc32:#010x} in the manifest; update rejected, the old weights keep serving")


def unpack(buffers: list[torch.Tensor], manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of every tensor of the received buckets, in manifest order."""
    return [(t.name, tensor_view(buffer, t)) for buffer, bucket in zip(buffers, manifest.buckets, strict=True)
            for t in bucket.tensors]


def dedupe_shared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drops later names of tensors that share storage with an earlier one (tied embeddings): the
    receiver's model ties them again, so the bytes travel once."""
    seen: set[tuple[int, int, tuple]] = set()
    kept = {}
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        kept[name] = tensor
    return kept
