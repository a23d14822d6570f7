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
from rlfabric.weight_sync.phases import PhaseClock

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


def pack_checksummed(spec: BucketSpec, tensors: Mapping[str, torch.Tensor], out: torch.Tensor,
                     clock: PhaseClock | None = None, checksums: bool = True) -> int:
    """Packs bucket `spec` into the first spec.num_bytes of `out` (a staging buffer the size of the largest
    bucket, possibly holding an earlier bucket's bytes: the gaps are zeroed) and returns its CRC-32 (0 with
    `checksums` False), taken tensor by tensor right after each is copied, while its bytes are still in the
    cache. Seconds go to `clock`'s pack and checksum phases."""
    clock = clock or PhaseClock()
    crc, end = 0, 0
    for tensor_spec in (*spec.tensors, None):
        start = spec.num_bytes if tensor_spec is None else tensor_spec.offset
        with clock.timing("pack"):
            if start > end:  # alignment padding, and the bucket's tail
                out[end:start].zero_()
            if tensor_spec is not None:
                tensor_view(out, tensor_spec).copy_(tensors[tensor_spec.name].detach().reshape(tensor_spec.shape))
        stop = start if tensor_spec is None else start + tensor_spec.num_bytes
        if checksums and stop > end:
            with clock.timing("checksum"):
                crc = crc32(out[end:stop].numpy(), crc)
        end = stop
    return crc


def tensor_view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor `spec` as a view into a bucket buffer (no copy)."""
    return buffer[spec.offset : spec.offset + spec.num_bytes].view(spec.dtype).view(spec.shape)


def checksum(buffer: torch.Tensor) -> int:
    """zlib's CRC-32 of a bucket's bytes (GPU buffers are copied to the host first)."""
    return crc32(buffer.detach().cpu().contiguous().view(torch.uint8).numpy())


def pack(tensors: Mapping[str, torch.Tensor], bucket_bytes: int, version: int, group_id: str,
         dtype: torch.dtype | None = None, reuse: Manifest | None = None,
         buffers: list[torch.Tensor] | None = None, dense: bool = False,
         clock: PhaseClock | None = None) -> tuple[Manifest, list[torch.Tensor]]:
    """Plans, packs and checksums every bucket: the manifest and the buffers to send, in order.
    `buffers` packed for the manifest `reuse` are filled again when the plan is the same (every step
    of a run): the bytes land in memory that is already mapped, which matters at GB scale. Seconds go to
    `clock`'s pack and checksum phases."""
    clock = clock or PhaseClock()
    plan = plan_buckets(tensors, bucket_bytes, dtype, dense)
    same = reuse is not None and buffers is not None and [(b.num_bytes, b.tensors) for b in reuse.buckets] == [
        (b.num_bytes, b.tensors) for b in plan]
    packed, buckets = [], []
    for spec in plan:
        with clock.timing("pack"):
            buffer = pack_bucket(spec, tensors, buffers[spec.index] if same else None)
        packed.append(buffer)
        with clock.timing("checksum"):
            crc = checksum(buffer)
        buckets.append(BucketSpec(spec.index, spec.num_bytes, spec.tensors, crc))
    return Manifest(version, group_id, tuple(buckets)), packed


def crc_buffer(crcs: list[int]) -> torch.Tensor:
    """The buckets' CRC-32s as the buffer broadcast after the last bucket: 4 bytes each, little-endian."""
    return torch.frombuffer(bytearray(b"".join(crc.to_bytes(4, "little") for crc in crcs)), dtype=torch.uint8)


def crcs_of_buffer(buffer: torch.Tensor) -> list[int]:
    """crc_buffer's CRC-32s back."""
    data = buffer.cpu().numpy().tobytes()
    return [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]


class ChecksumMismatch(InvalidArgument):
    """A received bucket's bytes do not match the manifest's CRC-32: the whole update is rejected."""


def verify(buffer: torch.Tensor, spec: BucketSpec) -> None:
    """Raises ChecksumMismatch when the bucket's bytes are not what the sender packed."""
    check_crc(spec.index, checksum(buffer), spec.crc32, "in the manifest")


def check_crc(index: int, actual: int, expected: int, source: str = "sent by the actor") -> None:
    """Raises ChecksumMismatch when bucket `index`'s CRC-32 is not the one the sender gave (`source`: where)."""
    if actual != expected:
        raise ChecksumMismatch(f"weight bucket {index}: CRC-32 {actual:#010x} of the received bytes != "
                               f"{expected:#010x} {source}; update rejected, the old weights keep serving")


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
