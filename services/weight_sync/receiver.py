"""The receiving side of a weight sync, shared by the rollout engines, the reference and the vLLM
worker extension.

- WeightReceiver: rank >= 1 of one group (blocking calls): receives a manifest's buckets over the
  group's collective and takes each bucket's CRC-32 while the next one lands; gloo and nccl groups send
  the CRC-32s after the last bucket (the actor checksums while it sends), torch groups in the manifest,
  and cuda_ipc has none (the bytes never leave the GPU: rlfabric.weight_sync.cuda_ipc).
- BucketAssembler: the same for the grpc transport, fed chunk by chunk (in any order) from the
  PushWeights streams of a push (rlfabric.weight_sync.grpc_stream).
- Membership: a service's async handle on at most one group (join, rejoin, receive, leave); the
  blocking work runs on threads, so the event loop keeps serving, and a new group replaces one whose
  join or receive is stuck.

A manifest with keep_base (weight_sync.delta) leaves its buckets as the receiver's base (DeltaBase), and a delta
manifest's buckets are applied to that base: the result is the full weights, checked tensor by tensor.

Either way the result is a list of (name, tensor) views that nothing has loaded yet: the engine swaps
them in atomically afterwards, and a checksum mismatch raises before anything changed. A manifest is
checked against the receiver's own weights (WeightLimits) before any bucket is allocated for it.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from rlfabric.core.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from rlfabric.weight_sync.buckets import (
    ChecksumMismatch,
    check_crc,
    checksum,
    crc32,
    crc32_combine,
    crcs_of_buffer,
    unpack,
)
from rlfabric.weight_sync.delta import DeltaBase
from rlfabric.weight_sync.manifest import Manifest, SyncGroup, WeightLimits
from rlfabric.weight_sync.phases import PhaseClock, SyncPhases

# Extra seconds a caller waits beyond the group's timeout for the collective's own error to surface.
SLACK_S = 5.0

Weights = list[tuple[str, torch.Tensor]]
T = TypeVar("T")


@dataclass(frozen=True)
class WeightSwap:
    """What a receiver reports after switching to new weights."""

    version: int
    paused_seconds: float  # how long generation (or compute) was held for the switch
    phases: SyncPhases = field(default_factory=SyncPhases)  # this receiver's: wire, checksum, apply
    adopted: bool = False  # the engine serves the received tensors themselves: their buffers are its now


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
    if group.transport == "cuda_ipc":
        from rlfabric.weight_sync.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(group, rank, device)
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
        self.base = DeltaBase()  # what the last keep_base sync brought, for the next delta (weight_sync.delta)

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

    def receive(self, manifest: Manifest, clock: PhaseClock | None = None) -> Weights:
        """Every bucket of `manifest`, checked; ChecksumMismatch after the last one lands if any is bad
        (all are received either way, so the group stays in step with the sender). The views stay
        valid until the next receive, which reuses the buffers. Seconds go to `clock`'s wire and checksum."""
        self.check(manifest)
        clock = clock or PhaseClock()
        buffers = self._buffers_for(manifest)
        mode = self.group.checksums

        def crc_of(buffer: torch.Tensor) -> int:
            with clock.timing("checksum"):
                return checksum(buffer)

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-crc") as checker:
            actual = []
            for buffer, bucket in zip(buffers, manifest.buckets, strict=True):
                with clock.timing("wire"):
                    if mode == "none":
                        self.transport.take(manifest.version, bucket.index, buffer)
                    else:
                        self.transport.broadcast(buffer)
                if mode != "none":  # while the next bucket lands
                    actual.append(checker.submit(crc_of, buffer))
            if mode == "after":  # the sender's CRC-32s follow the last bucket
                sent = torch.empty(4 * len(buffers), dtype=torch.uint8, device=self.transport.device)
                with clock.timing("wire"):
                    self.transport.broadcast(sent)
                expected, source = crcs_of_buffer(sent), "sent by the actor"
            else:
                expected, source = [bucket.crc32 for bucket in manifest.buckets], "in the manifest"
            for index, crc in enumerate(actual):
                check_crc(index, crc.result(), expected[index], source)
        if manifest.delta is not None:  # the base rebuilt, checked tensor by tensor
            return self.base.apply(manifest, unpack(buffers, manifest), clock)
        if manifest.keep_base:
            self.base.keep(manifest, buffers)
        return unpack(buffers, manifest)

    def hand_over(self) -> None:
        """The engine adopted the received tensors as its weights: their buffers are its now, and the next
        receive lands in new ones (the engine frees its previous weights meanwhile, so the memory stays two
        copies of the model during a sync and one between syncs)."""
        self._buffers = []

    def release_device_buffers(self) -> None:
        """Frees the receive buffers when they are on a GPU, once their weights are applied: a GPU's memory
        is too dear to hold a second copy of the model between syncs (CPU buffers stay for the next sync)."""
        if self._buffers and self._buffers[0].is_cuda:
            self._buffers = []

    def _buffers_for(self, manifest: Manifest) -> list[torch.Tensor]:
        """Last sync's buffers when the sizes match (every step of a run): the bytes then land in
        memory that is already mapped instead of page-faulting on the way in."""
        sizes = [b.num_bytes for b in manifest.buckets]
        if manifest.keep_base and manifest.delta is None:  # they become the base: not reused by the next receive
            return self.base.recycle(sizes, self.transport.device)
        if [b.numel() for b in self._buffers] != sizes:
            self._buffers = []  # free the old ones first
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self.transport.device) for n in sizes]
        return self._buffers

    def close(self) -> None:
        self._buffers = []
        self.base.clear()
        if self.transport is not None:
            self.transport.close()


class BucketAssembler:
    """Collects a PushWeights push's chunks into bucket buffers. The chunks of a bucket may come in
    any order (a push runs over several streams) but must cover it exactly once; each chunk's CRC-32
    is taken as it lands, and a bucket is checked as soon as its last chunk is in (ChecksumMismatch
    then), from the chunks' CRC-32s: no second pass over the bucket."""

    def __init__(self, manifest: Manifest, buffers: list[torch.Tensor] | None = None,
                 clock: PhaseClock | None = None):
        """`buffers` of the right sizes (an earlier push's) are reused, else new ones are made: the
        caller checks the manifest first (Manifest.from_proto, WeightLimits.check). The CRC-32 seconds
        go to `clock`'s checksum phase."""
        self.manifest = manifest
        self.clock = clock or PhaseClock()
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
        with self.clock.timing("checksum"):
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
    """A service's place in at most one weight-sync group. Joins and receives run on helper threads,
    each bounded by the group's timeout (itself at most weight_sync.max_timeout_s, checked where the
    group arrives: SyncGroup.from_proto).

    Joining a new group leaves the old one at once, whatever still runs on it: a join whose sender
    never comes or a receive whose peer died is abandoned (its caller gets ABORTED), and the receiver
    it was using is closed when its thread ends. A call given up on (timeout, cancelled RPC) leaves its
    group the same way. So a stuck group never blocks the next one, and no thread holds anything the
    next group needs. At most MAX_ABANDONED abandoned threads may still run: a rendezvous cannot be
    interrupted, each ends within its group's timeout."""

    MAX_ABANDONED = 8

    def __init__(self, device: torch.device | Callable[[], torch.device] | None = None,
                 limits: Callable[[], WeightLimits | None] | None = None):
        """`device`: where the bytes land (nccl and cuda_ipc need the owner's GPU), or a function that tells
        (read when joining a group: the owner may load its model later). `limits`: the owner's weights (read
        when joining), which every manifest must fit."""
        self._device = device or torch.device("cpu")
        self.limits = limits
        self._receiver: WeightReceiver | None = None
        self._left = asyncio.Event()  # set when the current group (or the join under way) is left
        self._lock = asyncio.Lock()  # one receive at a time
        self._busy: tuple[WeightReceiver, Future] | None = None  # the receive running on its thread
        self._abandoned: set[Future] = set()  # threads of given-up calls, still running
        self.joining: SyncGroup | None = None  # the group of the join under way

    @property
    def group(self) -> SyncGroup | None:
        return self._receiver.group if self._receiver else None

    async def join(self, group: SyncGroup, rank: int) -> None:
        group.check_rank(rank)
        self._abandoned = {call for call in self._abandoned if not call.done()}
        if len(self._abandoned) >= self.MAX_ABANDONED:
            raise ResourceExhausted(f"{len(self._abandoned)} abandoned weight-sync joins or receives still run until "
                                    "their groups' timeouts (weight_sync.max_timeout_s at most); retry after that")
        await self._leave()  # the old group, or a join still under way, is left at once
        left = self._left = asyncio.Event()
        self.joining = group
        try:
            joining = in_thread(f"weight-sync-join-{group.group_id}", self._new_receiver, group, rank)
            self._receiver = await self._wait(joining, group.timeout_s, f"joining weight-sync group {group.group_id}",
                                              left)
        finally:
            if self.joining is group:
                self.joining = None

    @property
    def device(self) -> torch.device:
        return self._device() if callable(self._device) else self._device

    def _new_receiver(self, group: SyncGroup, rank: int) -> WeightReceiver:
        return WeightReceiver(group, rank, self.device, self.limits() if self.limits else None)

    async def receive(self, manifest: Manifest, apply: Callable[[Weights], Awaitable[T]]) -> tuple[T, SyncPhases]:
        """Receives the manifest's weights; returns `await apply(weights)` and this side's phases (wire,
        checksum, apply). apply runs before any other receive may reuse the buffers the weights are views of."""
        async with self._lock:
            receiver, left = self._receiver, self._left
            if receiver is None:
                raise FailedPrecondition("this service has not joined a weight-sync group (JoinWeightSyncGroup first)")
            receiver.check(manifest)
            # each bucket's collective times out on its own; this is only a backstop
            bound = receiver.group.timeout_s * (len(manifest.buckets) + 1)
            clock = PhaseClock()
            receiving = in_thread(f"weight-sync-receive-{receiver.group.group_id}", receiver.receive, manifest, clock)
            self._busy = (receiver, receiving)
            try:
                weights = await self._wait(receiving, bound, f"receiving weight version {manifest.version}", left,
                                           close_result=False)
            except InvalidArgument:
                raise  # a bad manifest or checksum: every bucket arrived, the group is in step
            except BaseException:
                if self._receiver is receiver:
                    await self._leave()  # a failed or abandoned collective breaks the group
                raise
            started = time.perf_counter()
            result = None
            try:
                result = await apply(weights)
            finally:
                del weights
                if getattr(result, "adopted", False):
                    receiver.hand_over()
                else:
                    receiver.release_device_buffers()
            clock.add("apply", time.perf_counter() - started)
            return result, clock.phases()

    async def leave(self) -> None:
        await self._leave()

    async def _leave(self) -> None:
        """Leaves the current group: the receiver is closed now, or when the receive using it ends."""
        self._left.set()
        receiver, self._receiver = self._receiver, None
        if receiver is None:
            return
        busy = self._busy
        if busy is not None and busy[0] is receiver and not busy[1].done():
            busy[1].add_done_callback(lambda _: receiver.close())
        else:
            await asyncio.to_thread(receiver.close)

    async def _wait(self, call: Future, timeout_s: float, what: str, left: asyncio.Event, close_result: bool = True):
        """The result of `call` (running on its thread). When the group is left meanwhile (ABORTED), the
        timeout passes (DEADLINE_EXCEEDED) or the caller is cancelled, the call is abandoned: with
        `close_result`, the receiver it makes is closed when it ends."""
        result = asyncio.wrap_future(call)
        leaving = asyncio.ensure_future(left.wait())
        try:
            done, _ = await asyncio.wait({result, leaving}, timeout=timeout_s + SLACK_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            if result in done:
                return result.result()
        except BaseException:
            self._abandon(call, result, close_result)
            raise
        finally:
            leaving.cancel()
        self._abandon(call, result, close_result)
        if leaving in done:
            raise Aborted(f"{what}: abandoned, this service joined another weight-sync group (or left this one) "
                          "meanwhile")
        raise DeadlineExceeded(f"{what}: did not finish within {timeout_s:g} s (the group's timeout_s)")

    def _abandon(self, call: Future, result: asyncio.Future, close_result: bool) -> None:
        result.cancel()  # nothing waits for it any more (and the loop may be gone when it ends)
        if close_result:
            call.add_done_callback(_close_receiver)
        if not call.done():
            self._abandoned.add(call)


def _close_receiver(call: Future) -> None:
    """Closes the receiver an abandoned join made, once it is made."""
    if not call.cancelled() and call.exception() is None:
        call.result().close()


def in_thread(name: str, fn: Callable[..., T], *args) -> Future:
    """fn(*args) on a new daemon thread: a call that never returns blocks nothing but its own thread."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # handed to whoever waits on the future
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
