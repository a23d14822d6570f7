"""The receiving side of a weight sync, shared by the rollout engines, the reference and the vLLM
worker extension.

- WeightReceiver: rank >= 1 of one group (blocking calls): receives a manifest's buckets over the
  group's collective and checks each bucket's CRC-32 while the next one lands.
- BucketAssembler: the same for the grpc transport, fed chunk by chunk (in any order) from the
  PushWeights streams of a push (rlfabric.weight_sync.grpc_stream).
- Membership: a service's async handle on at most one group (join, rejoin, receive, leave); the
  blocking work runs on a thread, so the event loop keeps serving.

Either way the result is a list of (name, tensor) views that nothing has loaded yet: the engine swaps
them in atomically afterwards, and a checksum mismatch raises before anything changed. A manifest is
checked against the receiver's own weights (WeightLimits) before any bucket is allocated for it.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from rlfabric.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from rlfabric.weight_sync.buckets import ChecksumMismatch, crc32, crc32_combine, unpack, verify
from rlfabric.weight_sync.manifest import Manifest, SyncGroup, WeightLimits

# Extra seconds a caller waits beyond the group's timeout for the collective's own error to surface.
SLACK_S = 5.0

Weights = list[tuple[str, torch.Tensor]]
T = TypeVar("T")


@dataclass(frozen=True)
class WeightSwap:
    """What a receiver reports after switching to new weights."""

    version: int
    paused_seconds: float  # how long generation (or compute) was held for the switch


def open_transport(group: SyncGroup, rank: int, device: torch.device):
    """The collective of `group` for `rank`; None for grpc (the bytes come by PushWeights)."""
    if group.torch_group:
        from rlfabric.weight_sync.torch_group import TorchGroupTransport

        return TorchGroupTransport(group, rank, device)
    if group.transport == "gloo":
        from rlfabric.weight_sync.gloo import GlooTransport

        return GlooTransport(group, rank)
    if group.transport == "nccl":
        from rlfabric.weight_sync.nccl import NcclTransport

        return NcclTransport(group, rank, device)
    return None


class WeightReceiver:
    """Rank `rank` of `group`; joining blocks until every rank has joined (or the timeout). With
    `limits`, every manifest is checked against the receiver's own weights before its buckets are
    allocated."""

    def __init__(self, group: SyncGroup, rank: int, device: torch.device | None = None,
                 limits: WeightLimits | None = None):
        group.check_rank(rank)
        self.group, self.rank, self.limits = group, rank, limits
        self.transport = open_transport(group, rank, device or torch.device("cpu"))
        self._buffers: list[torch.Tensor] = []  # reused by the next receive of the same sizes

    def check(self, manifest: Manifest) -> None:
        """FailedPrecondition unless `manifest` can arrive over this receiver's collective;
        InvalidArgument / ResourceExhausted when it does not fit the receiver's weights."""
        if manifest.group_id != self.group.group_id:
            raise FailedPrecondition(f"manifest is for weight-sync group {manifest.group_id!r}, this receiver "
                                     f"joined {self.group.group_id!r}")
        if self.transport is None:
            raise FailedPrecondition(f"group {self.group.group_id} uses the grpc transport: the actor sends "
                                     "the weights with PushWeights, not ReceiveWeights")
        if self.limits is not None:
            self.limits.check(manifest)

    def receive(self, manifest: Manifest) -> Weights:
        """Every bucket of `manifest`, checked; ChecksumMismatch after the last one lands if any is bad
        (all are received either way, so the group stays in step with the sender). The views stay
        valid until the next receive, which reuses the buffers."""
        self.check(manifest)
        buffers = self._buffers_for(manifest)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-crc") as checker:
            checks = []
            for buffer, bucket in zip(buffers, manifest.buckets, strict=True):
                self.transport.broadcast(buffer)
                checks.append(checker.submit(verify, buffer, bucket))
            for check in checks:
                check.result()
        return unpack(buffers, manifest)

    def _buffers_for(self, manifest: Manifest) -> list[torch.Tensor]:
        """Last sync's buffers when the sizes match (every step of a run): the bytes then land in
        memory that is already mapped instead of page-faulting on the way in."""
        sizes = [b.num_bytes for b in manifest.buckets]
        if [b.numel() for b in self._buffers] != sizes:
            self._buffers = []  # free the old ones first
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self.transport.device) for n in sizes]
        return self._buffers

    def close(self) -> None:
        self._buffers = []
        if self.transport is not None:
            self.transport.close()


class BucketAssembler:
    """Collects a PushWeights push's chunks into bucket buffers. The chunks of a bucket may come in
    any order (a push runs over several streams) but must cover it exactly once; each chunk's CRC-32
    is taken as it lands, and a bucket is checked as soon as its last chunk is in (ChecksumMismatch
    then), from the chunks' CRC-32s: no second pass over the bucket."""

    def __init__(self, manifest: Manifest, buffers: list[torch.Tensor] | None = None):
        """`buffers` of the right sizes (an earlier push's) are reused, else new ones are made: the
        caller checks the manifest first (Manifest.from_proto, WeightLimits.check)."""
        self.manifest = manifest
        sizes = [b.num_bytes for b in manifest.buckets]
        if buffers is None or [b.numel() for b in buffers] != sizes:
            buffers = None  # dropped before the new ones are mapped
            buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        self.buffers = buffers
        self._views = [memoryview(b.numpy()) for b in self.buffers]
        self._filled = [0] * len(self.buffers)
        # per bucket: (offset, end, crc32) of every chunk received, sorted by offset
        self._pieces: list[list[tuple[int, int, int]]] = [[] for _ in self.buffers]
        self._incomplete = sum(1 for size in sizes if size)

    @property
    def complete(self) -> bool:
        """Every bucket has all its bytes (and checked out)."""
        return self._incomplete == 0

    def add(self, bucket_index: int, offset: int, data) -> None:
        """Copies one chunk (bytes or a buffer view) into its bucket; raises InvalidArgument for a
        chunk outside the manifest's buckets or overlapping one already received, ChecksumMismatch
        when it completes a bucket whose bytes do not match the manifest."""
        if not 0 <= bucket_index < len(self.buffers):
            raise InvalidArgument(f"PushWeights chunk for bucket {bucket_index}; the manifest has "
                                  f"{len(self.buffers)}")
        size, length = len(self._views[bucket_index]), len(data)
        end = offset + length
        pieces = self._pieces[bucket_index]
        at = bisect.bisect_left(pieces, (offset,))
        if (not length or offset < 0 or end > size or (at > 0 and pieces[at - 1][1] > offset)
                or (at < len(pieces) and pieces[at][0] < end)):
            raise InvalidArgument(f"PushWeights chunk of bucket {bucket_index} at bytes {offset}..{end}: outside the "
                                  f"bucket's {size} bytes, empty, or overlapping bytes already received "
                                  f"({self._filled[bucket_index]} of {size} received)")
        view = self._views[bucket_index][offset:end]
        view[:] = data
        pieces.insert(at, (offset, end, crc32(view)))
        self._filled[bucket_index] += length
        if self._filled[bucket_index] == size:
            self._incomplete -= 1
            self._check(bucket_index)

    def _check(self, bucket_index: int) -> None:
        crc = 0
        for offset, end, piece in self._pieces[bucket_index]:
            crc = crc32_combine(crc, piece, end - offset)
        spec = self.manifest.buckets[bucket_index]
        if crc != spec.crc32:
            raise ChecksumMismatch(f"weight bucket {bucket_index}: CRC-32 {crc:#010x} of the received bytes != "
                                   f"{spec.crc32:#010x} in the manifest; update rejected, the old weights keep serving")

    def finish(self) -> Weights:
        """The named tensors once every bucket is complete (each was checked as it completed)."""
        missing = [i for i, view in enumerate(self._views) if self._filled[i] != len(view)]
        if missing:
            raise InvalidArgument(f"PushWeights stream ended before bucket(s) {missing} were complete")
        return unpack(self.buffers, self.manifest)


class Membership:
    """A service's place in at most one weight-sync group. Joining a new group leaves the old one;
    joins and receives run one at a time on a helper thread, each bounded by the group's timeout."""

    def __init__(self, device: torch.device | None = None,
                 limits: Callable[[], WeightLimits | None] | None = None):
        """`limits`: the owner's weights (read when joining a group), which every manifest must fit."""
        self.device = device or torch.device("cpu")
        self.limits = limits
        self._receiver: WeightReceiver | None = None
        self._lock = asyncio.Lock()
        self._thread_lock = threading.Lock()  # a timed-out call's thread may still be running

    @property
    def group(self) -> SyncGroup | None:
        return self._receiver.group if self._receiver else None

    async def join(self, group: SyncGroup, rank: int) -> None:
        group.check_rank(rank)
        async with self._lock:
            await self._call(group.timeout_s, self._join, group, rank)

    def _join(self, group: SyncGroup, rank: int) -> None:
        self._leave()
        self._receiver = WeightReceiver(group, rank, self.device, self.limits() if self.limits else None)

    async def receive(self, manifest: Manifest, apply: Callable[[Weights], Awaitable[T]]) -> T:
        """Receives the manifest's weights and returns `await apply(weights)`; apply runs before any
        other receive may reuse the buffers the weights are views of."""
        async with self._lock:
            receiver = self._receiver
            if receiver is None:
                raise FailedPrecondition("this service has not joined a weight-sync group (JoinWeightSyncGroup first)")
            receiver.check(manifest)
            try:
                # each bucket's collective times out on its own; this is only a backstop
                bound = receiver.group.timeout_s * (len(manifest.buckets) + 1)
                weights = await self._call(bound, receiver.receive, manifest)
            except InvalidArgument:
                raise  # a bad manifest or checksum: the group itself is fine
            except Exception:
                await asyncio.to_thread(self._locked, self._leave)  # a failed collective breaks the group
                raise
            return await apply(weights)

    async def leave(self) -> None:
        async with self._lock:
            await asyncio.to_thread(self._locked, self._leave)

    def _leave(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def _locked(self, fn, *args):
        with self._thread_lock:
            return fn(*args)

    async def _call(self, timeout_s: float, fn, *args):
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._locked, fn, *args), timeout_s + SLACK_S)
        except TimeoutError:
            raise DeadlineExceeded(f"weight sync step {fn.__name__} did not finish within {timeout_s:g} s") from None
