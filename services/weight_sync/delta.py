"""Delta sync (weight_sync.delta): each tensor's change against what the receiver already holds, not the tensor.

    sender = DeltaSender()                                   # the actor, per delta group: what it last sent
    manifest, buffers, sent = sender.prepare(state, ..., base_version, clock)   # the change, or the full weights
    sender.sent(*sent)                                       # once sent: the base of the next delta
    base = DeltaBase()                                       # a receiver: what it last received, as received
    base.keep(full_manifest, buffers)                        # after a full sync with keep_base
    weights = base.apply(delta_manifest, received_entries)   # after a delta: the new weights, checked

Both sides compare bit patterns in the receivers' dtype (a bfloat16 rollout's rounding is part of the base),
so the receiver rebuilds the sender's packed bytes exactly; each tensor's CRC-32 after applying proves it.
At RL learning rates most bfloat16 elements round to what they were, so few change per step. Per tensor the
smallest of these wins (rlfabric.v1.DeltaEncoding):

- unchanged: no bytes;
- sparse: the changed elements, zstd of their index gaps and new bit patterns, each split into byte planes
  (gaps are small, so their high bytes are zeros; neighbouring values share their high bytes);
- xor_zstd: zstd of the XOR of new and base bit patterns, every element. It is measured where at least
  XOR_FROM of the elements changed (a float32 rollout, large learning rates). Below that it saves about 7% of
  the bytes at twice the actor's time (SmolLM2-135M, a first AdamW step at lr 1e-5 and 2e-5, 7-9% of the
  elements changed: bench/results/weight_sync_delta.json, "encodings");
- raw: the new bytes, when no encoding is smaller.

A receiver whose base is not the delta's base version, or whose rebuilt tensor's CRC-32 differs, rejects the
delta (DeltaRejected, INVALID_ARGUMENT) after every byte has arrived, and keeps no base until the next full sync.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch
import zstandard

from rlfabric.core.errors import InvalidArgument
from rlfabric.weight_sync.buckets import crc32, pack, unpack
from rlfabric.weight_sync.manifest import BucketSpec, DeltaSpec, Manifest, TensorDelta, TensorSpec
from rlfabric.weight_sync.phases import PhaseClock

ZSTD_LEVEL = 1  # zstd's fastest level that still finds the zero runs
XOR_FROM = 1 / 4  # the changed fraction from which XOR + zstd is measured too
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit patterns per element size
_COUNT = struct.Struct("<Q")


class DeltaRejected(InvalidArgument):
    """A delta this receiver cannot apply (another base, or a rebuilt tensor whose CRC-32 differs): the sender
    sends the full weights instead; the old weights keep serving meanwhile."""


def _bits(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor's elements as integers of its element size, flat (a view into the bucket)."""
    return buffer[spec.offset : spec.offset + spec.num_bytes].view(_BITS[spec.dtype.itemsize])


def _planes(values: np.ndarray) -> bytes:
    """Byte k of every value, then byte k + 1, ...: runs a compressor finds (one strided copy per plane, far
    quicker than a transposed copy of the whole)."""
    data = values.view(np.uint8).reshape(-1, values.itemsize)
    return b"".join(np.ascontiguousarray(data[:, k]).tobytes() for k in range(values.itemsize))


def _from_planes(data: bytes, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
    """_planes' values back: `count` of `dtype` whose byte planes start at `offset` of `data`."""
    size = np.dtype(dtype).itemsize
    planes = np.frombuffer(data, dtype=np.uint8, count=count * size, offset=offset).reshape(size, count)
    values = np.empty(count, dtype=dtype)
    for k, plane in enumerate(planes):  # a strided write per plane, as _planes reads them
        values.view(np.uint8).reshape(count, size)[:, k] = plane
    return values


def encode_sparse(new: np.ndarray, changed: np.ndarray, compressor: zstandard.ZstdCompressor) -> bytes:
    """The sparse encoding of the elements of `new` at the flat indices `changed` (ascending)."""
    gaps = np.diff(changed, prepend=-1).astype(np.int32)
    return compressor.compress(b"".join((_COUNT.pack(changed.size), _planes(gaps), _planes(new[changed]))))


def encode_tensor(new: torch.Tensor, base: torch.Tensor, compressor: zstandard.ZstdCompressor,
                  encodings: Sequence[str] = ("sparse", "xor_zstd")) -> tuple[str, bytes]:
    """(encoding, bytes) of the change from `base` to `new`, both bit patterns of one tensor (flat): the smallest
    of `encodings` and raw (xor_zstd only from XOR_FROM changed, unless it is the only one asked for). numpy, on
    the calling thread: one core streams these passes faster than torch's threads do on a busy host."""
    new, base = new.numpy(), base.numpy()
    changed = np.flatnonzero(new != base)
    if changed.size == 0:
        return "unchanged", b""
    best = ("raw", new.nbytes)
    if "sparse" in encodings and new.size < 2**31:  # gaps travel as int32
        blob = encode_sparse(new, changed, compressor)
        if len(blob) < best[1]:
            best = ("sparse", blob)
    if "xor_zstd" in encodings and (changed.size >= XOR_FROM * new.size or best[0] == "raw"):
        blob = compressor.compress(np.bitwise_xor(new, base))
        if len(blob) < (best[1] if best[0] == "raw" else len(best[1])):
            best = ("xor_zstd", blob)
    return best if best[0] != "raw" else ("raw", new.tobytes())


def encode_delta(layout: Sequence[BucketSpec], new: Sequence[torch.Tensor], base: Sequence[torch.Tensor],
                 clock: PhaseClock | None = None, encodings: Sequence[str] = ("sparse", "xor_zstd"),
                 ) -> tuple[tuple[TensorDelta, ...], dict[str, torch.Tensor]]:
    """Every tensor of `layout` from its bucket in `base` to the same in `new` (CPU uint8 buffers of the layout):
    each tensor's TensorDelta (encoding, CRC-32 of its new bytes), and the encoded bytes of those that changed
    (uint8 tensors, by name), for the buckets. Seconds go to `clock`'s checksum and pack."""
    clock = clock or PhaseClock()
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    tensors, entries = [], {}
    for spec in layout:
        for tensor in spec.tensors:
            new_bits, base_bits = _bits(new[spec.index], tensor), _bits(base[spec.index], tensor)
            with clock.timing("checksum"):
                crc = crc32(new_bits.view(torch.uint8).numpy())
            with clock.timing("pack"):
                encoding, blob = encode_tensor(new_bits, base_bits, compressor, encodings)
            tensors.append(TensorDelta(tensor.name, encoding, crc))
            if encoding != "unchanged":
                entries[tensor.name] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return tuple(tensors), entries


def apply_tensor(base: torch.Tensor, encoding: str, data: memoryview | bytes,
                 decompressor: zstandard.ZstdDecompressor) -> None:
    """Applies one tensor's encoded change to its bit patterns `base` (flat), in place; DeltaRejected for bytes
    that do not decode to a change of this tensor."""
    bits = base.numpy()
    try:
        if encoding == "raw":
            if len(data) != bits.nbytes:
                raise ValueError(f"{len(data)} raw bytes for {bits.nbytes}")
            bits[:] = np.frombuffer(data, dtype=bits.dtype)
        elif encoding == "xor_zstd":
            flips = decompressor.decompress(data, max_output_size=bits.nbytes)
            if len(flips) != bits.nbytes:
                raise ValueError(f"{len(flips)} bytes of XOR for {bits.nbytes}")
            np.bitwise_xor(bits, np.frombuffer(flips, dtype=bits.dtype), out=bits)
        elif encoding == "sparse":
            plain = decompressor.decompress(data, max_output_size=_COUNT.size + bits.size * (4 + bits.itemsize))
            (count,) = _COUNT.unpack_from(plain)
            if not 0 < count <= bits.size or len(plain) != _COUNT.size + count * (4 + bits.itemsize):
                raise ValueError(f"{count} changed elements in {len(plain)} bytes")
            gaps = _from_planes(plain, _COUNT.size, count, np.int32)
            if int(gaps.min()) < 1:
                raise ValueError("index gaps must be >= 1")
            changed = np.cumsum(gaps, dtype=np.int64) - 1
            if int(changed[-1]) >= bits.size:
                raise ValueError(f"changed index {int(changed[-1])} past the tensor's {bits.size} elements")
            bits[changed] = _from_planes(plain, _COUNT.size + 4 * count, count, bits.dtype)
        elif encoding != "unchanged":
            raise ValueError(f"unknown encoding {encoding!r}")
    except (ValueError, zstandard.ZstdError) as error:
        raise DeltaRejected(f"delta rejected: a {encoding} change does not decode ({error})") from None


class DeltaSender:
    """The actor's side of a delta group: the full weights it last sent (as packed, in the receivers' dtype), and
    the buffers the next version is packed into (the two alternate: no copy per sync)."""

    def __init__(self):
        self.base: tuple[Manifest, list[torch.Tensor]] | None = None
        self._spare: list[torch.Tensor] | None = None

    def prepare(self, state: Mapping[str, torch.Tensor], bucket_bytes: int, version: int, group_id: str,
                dtype: torch.dtype | None, base_version: int | None, clock: PhaseClock,
                ) -> tuple[Manifest, list[torch.Tensor], tuple[Manifest, list[torch.Tensor]]]:
        """(manifest, its buffers, the full weights packed): the change against the base when the receivers hold
        it (`base_version` is the base's, with the same layout), else the full weights; either way keep_base."""
        base = self.base
        full, buffers = pack(state, bucket_bytes, version, group_id, dtype, base[0] if base else None, self._spare,
                             clock=clock)
        full = replace(full, keep_base=True)
        self._spare = None  # the prepared sync holds them until it is sent
        if base is None or base_version != base[0].version or _shape(base[0].buckets) != _shape(full.buckets):
            return full, buffers, (full, buffers)
        tensors, entries = encode_delta(full.buckets, buffers, base[1], clock)
        wire, wire_buffers = pack(entries, bucket_bytes, version, group_id, clock=clock)
        delta = replace(wire, keep_base=True, delta=DeltaSpec(base[0].version, full.buckets, tensors))
        return delta, wire_buffers, (full, buffers)

    def sent(self, manifest: Manifest, buffers: list[torch.Tensor]) -> None:
        """The full weights of a sync just sent are the base now; the old base's buffers take the next pack."""
        self._spare = self.base[1] if self.base is not None else None
        self.base = (manifest, buffers)


class DeltaBase:
    """What a receiver keeps for the next delta: the buckets of the version it last received, as received."""

    def __init__(self):
        self.version: int | None = None
        self.group_id = ""  # the group that sent it
        self.layout: tuple[BucketSpec, ...] = ()
        self.buffers: list[torch.Tensor] = []

    def clear(self) -> None:
        self.version, self.layout, self.buffers = None, (), []

    @property
    def manifest(self) -> Manifest | None:
        """The full weights the base holds as a push of them (keep_base: its receiver keeps them as its base
        too); None without a base."""
        if self.version is None:
            return None
        return Manifest(self.version, self.group_id, self.layout, keep_base=True)

    def recycle(self, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
        """Buffers for a full sync that will be kept: the base's own when their sizes match (the base is
        dropped first: they are overwritten), else new ones."""
        buffers = self.buffers if [b.numel() for b in self.buffers] == sizes else None
        self.clear()
        return buffers or [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]

    def keep(self, manifest: Manifest, buffers: list[torch.Tensor]) -> None:
        """The checked buckets of a full sync (manifest.keep_base) are the base now."""
        self.version, self.layout, self.buffers = manifest.version, manifest.buckets, buffers
        self.group_id = manifest.group_id

    def apply(self, manifest: Manifest, entries: list[tuple[str, torch.Tensor]],
              clock: PhaseClock | None = None) -> list[tuple[str, torch.Tensor]]:
        """The weights of delta `manifest`, rebuilt in the base's buffers from the received `entries` and checked
        tensor by tensor (the base is then that version): views, as a full receive returns them. DeltaRejected
        (no base kept) for another base or a tensor whose CRC-32 differs."""
        delta = manifest.delta
        if self.version != delta.base_version or _shape(self.layout) != _shape(delta.layout):
            held = "no base" if self.version is None else f"base version {self.version}"
            self.clear()
            raise DeltaRejected(f"delta rejected: version {manifest.version} is a change against version "
                                f"{delta.base_version} (of this layout); this receiver holds {held}")
        clock = clock or PhaseClock()
        self.version = None  # changed in place from here: no base unless every tensor checks out
        data = dict(entries)
        decompressor = zstandard.ZstdDecompressor()
        changes = iter(delta.tensors)
        for spec in delta.layout:
            buffer = self.buffers[spec.index]
            for tensor in spec.tensors:
                change = next(changes)
                bits = _bits(buffer, tensor)
                host = bits.cpu()  # a base on a GPU (nccl) is rebuilt on the host, tensor by tensor
                with clock.timing("apply"):
                    apply_tensor(host, change.encoding, _bytes_of(data.get(tensor.name)), decompressor)
                    if host is not bits:
                        bits.copy_(host)
                with clock.timing("checksum"):
                    crc = crc32(host.view(torch.uint8).numpy())
                if crc != change.crc32:
                    self.clear()
                    raise DeltaRejected(f"delta rejected: tensor {tensor.name!r} of version {manifest.version} has "
                                        f"CRC-32 {crc:#010x} once applied, the sender's is {change.crc32:#010x}")
        self.version, self.layout, self.group_id = manifest.version, delta.layout, manifest.group_id
        return unpack(self.buffers, Manifest(manifest.version, manifest.group_id, delta.layout))


def _shape(layout: tuple[BucketSpec, ...]) -> list:
    """A layout without its CRC-32s: what a delta and its base must share."""
    return [(b.num_bytes, b.tensors) for b in layout]


def _bytes_of(entry: torch.Tensor | None) -> memoryview:
    return memoryview(b"") if entry is None else memoryview(entry.contiguous().numpy())
