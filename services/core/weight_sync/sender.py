"""The sending side of weight sync: rank 0 of every group the actor opens.

    sender = WeightSender(host, device, channel_options, timeout_s=120, bucket_bytes=512 << 20)
    group = sender.open("gloo", num_receivers=2)          # -> receivers' JoinWeightSyncGroup
    manifest = sender.prepare(group.group_id, 7, state)    # packs; -> receivers' ReceiveWeights
    result = await sender.broadcast(group.group_id, 7)     # while the receivers receive

open() returns at once: rank 0's half of the rendezvous runs on a helper thread and completes when
every receiver has joined; broadcast() waits for it. A group whose collective failed is broken
(gloo and NCCL cannot resume after a peer is lost): later calls get FAILED_PRECONDITION naming
the first failure, and the caller opens a new group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rlfabric.core.client import ChannelOptions
from rlfabric.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from rlfabric.core.weight_sync.buckets import dedupe_shared, pack
from rlfabric.core.weight_sync.grpc_stream import PushPayload, PushResult, push_weights
from rlfabric.core.weight_sync.manifest import Manifest, SyncGroup
from rlfabric.core.weight_sync.receiver import SLACK_S

log = logging.getLogger("rlfabric.weight_sync")


@dataclass(frozen=True)
class BroadcastResult:
    num_bytes: int  # per receiver
    seconds: float  # gloo, nccl: the collective; grpc: the pushes, each receiver's checks and switch included
    pushes: tuple[PushResult, ...] = ()  # grpc transport: one per receiver


@dataclass
class _Group:
    group: SyncGroup
    bucket_bytes: int
    dtype: torch.dtype | None
    addresses: tuple[str, ...] = ()  # grpc
    connecting: Future | None = None  # rank 0's transport, once every receiver joined
    store: object = None  # gloo: the TCPStore must outlive the process group
    prepared: tuple[Manifest, list[torch.Tensor]] | None = None  # the manifest and its packed buffers
    last: tuple[Manifest, list[torch.Tensor]] | None = None  # the packed buffers, kept for the next pack
    broken: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one broadcast at a time
    buffers_lock: threading.Lock = field(default_factory=threading.Lock)  # no pack into buffers being sent


class WeightSender:
    """Rank 0 of the weight-sync groups of one actor."""

    def __init__(self, host: str, device: torch.device, options: ChannelOptions | None = None,
                 timeout_s: float = 120.0, bucket_bytes: int = 512 << 20):
        self.host, self.device, self.options = host, device, options or ChannelOptions()
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self._groups: dict[str, _Group] = {}
        self._threads = ThreadPoolExecutor(max_workers=8, thread_name_prefix="weight-sync")

    def default_transport(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def open(self, transport: str = "", num_receivers: int = 1, bucket_bytes: int = 0,
             dtype: torch.dtype | None = None, timeout_s: float = 0.0, addresses: tuple[str, ...] = ()) -> SyncGroup:
        """A new group with this actor as rank 0; receivers join with ranks 1..num_receivers."""
        transport = transport or self.default_transport()
        timeout_s = timeout_s or self.timeout_s
        if num_receivers < 1:
            raise InvalidArgument(f"num_receivers must be >= 1, got {num_receivers}")
        if bucket_bytes < 0 or timeout_s < 0:
            raise InvalidArgument("bucket_bytes and timeout_s must be >= 0 (0 = the default)")
        if transport == "grpc" and len(addresses) != num_receivers:
            raise InvalidArgument(f"the grpc transport needs one receiver address per receiver: got {len(addresses)} "
                                  f"for num_receivers {num_receivers}")
        group_id = f"ws-{uuid.uuid4().hex[:12]}"
        world_size = num_receivers + 1
        entry = _Group(SyncGroup(group_id, transport, world_size, timeout_s), bucket_bytes or self.bucket_bytes,
                       dtype, tuple(addresses))
        if transport == "gloo":
            from rlfabric.core.weight_sync.gloo import GlooTransport

            entry.store = GlooTransport.host_store(self.host, world_size, timeout_s)
            entry.group = SyncGroup(group_id, transport, world_size, timeout_s, store_host=self.host,
                                    store_port=entry.store.port)
            entry.connecting = self._threads.submit(GlooTransport, entry.group, 0, entry.store)
        elif transport == "nccl":
            from rlfabric.core.weight_sync.nccl import NcclTransport, new_unique_id

            if self.device.type != "cuda":
                raise FailedPrecondition("the nccl weight-sync transport needs the actor on a CUDA device; "
                                         "this actor runs on CPU (use gloo or grpc)")
            entry.group = SyncGroup(group_id, transport, world_size, timeout_s, nccl_unique_id=new_unique_id())
            entry.connecting = self._threads.submit(NcclTransport, entry.group, 0, self.device)
        elif transport != "grpc":
            raise InvalidArgument(f"unknown weight-sync transport {transport!r}")
        self._groups[group_id] = entry
        log.info("weight-sync group opened", extra={"fields": {
            "group_id": group_id, "transport": transport, "world_size": world_size, "timeout_s": timeout_s}})
        return entry.group

    def _entry(self, group_id: str) -> _Group:
        entry = self._groups.get(group_id)
        if entry is None:
            raise NotFound(f"no weight-sync group {group_id!r} (closed, or opened by an earlier actor process)")
        if entry.broken:
            raise FailedPrecondition(f"weight-sync group {group_id} is broken ({entry.broken}); open a new one")
        return entry

    def prepare(self, group_id: str, version: int, state: Mapping[str, torch.Tensor]) -> Manifest:
        """Packs `state` (CPU tensors) into the group's buckets; they stay until broadcast()."""
        entry = self._entry(group_id)
        if version < 0:
            raise InvalidArgument(f"weight version must be >= 0, got {version}")
        with entry.buffers_lock:
            entry.prepared = None
            reuse, buffers = entry.last or (None, None)
            manifest, buffers = pack(dedupe_shared(state), entry.bucket_bytes, version, group_id, entry.dtype,
                                     reuse, buffers)
            entry.last = (manifest, buffers)
            entry.prepared = (manifest, buffers)
        return manifest

    async def broadcast(self, group_id: str, version: int) -> BroadcastResult:
        """Sends the prepared buckets to every receiver (the packed buffers stay for the next pack)."""
        entry = self._entry(group_id)
        async with entry.lock:
            if entry.prepared is None or entry.prepared[0].version != version:
                prepared = "nothing" if entry.prepared is None else f"version {entry.prepared[0].version}"
                raise FailedPrecondition(f"weight-sync group {group_id} has {prepared} prepared, not version "
                                         f"{version}: call PrepareWeightSync first")
            (manifest, payload), entry.prepared = entry.prepared, None
            started = time.perf_counter()
            if entry.group.transport == "grpc":
                pushes = await self._push(entry, manifest, payload)
                return BroadcastResult(manifest.num_bytes, time.perf_counter() - started, pushes)
            try:
                await self._wait(entry, len(payload), asyncio.get_running_loop().run_in_executor(
                    self._threads, self._send, entry, payload))
            except Exception as error:
                entry.broken = f"{type(error).__name__}: {error}"
                self._drop(entry)
                raise
            return BroadcastResult(manifest.num_bytes, time.perf_counter() - started)

    async def _push(self, entry: _Group, manifest: Manifest, buffers: list[torch.Tensor]) -> tuple[PushResult, ...]:
        """grpc: PushWeights to every receiver at once, each chunk encoded once for all of them while
        the streams ask for it (no pack may refill the buffers meanwhile)."""
        deadline = entry.group.timeout_s * len(manifest.buckets)  # the group's timeout per bucket
        lock = entry.buffers_lock
        if not lock.acquire(blocking=False):  # a pack is running (on the actor's torch thread)
            acquiring = asyncio.get_running_loop().run_in_executor(self._threads, lock.acquire)
            try:
                await asyncio.shield(acquiring)
            except asyncio.CancelledError:
                acquiring.add_done_callback(lambda _: lock.release())
                raise
        try:
            payload = PushPayload(manifest, buffers, receivers=len(entry.addresses))
            return tuple(await asyncio.gather(*(push_weights(a, payload, deadline, self.options)
                                                for a in entry.addresses)))
        finally:
            lock.release()

    def _send(self, entry: _Group, buffers: list[torch.Tensor]) -> None:
        try:
            transport = entry.connecting.result(timeout=entry.group.timeout_s)  # every receiver has joined
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded(f"weight-sync group {entry.group.group_id}: not every receiver joined within "
                                   f"weight_sync.timeout_s={entry.group.timeout_s:g}") from None
        with entry.buffers_lock:
            for buffer in buffers:
                transport.broadcast(buffer.to(transport.device, non_blocking=True))

    async def _wait(self, entry: _Group, num_buckets: int, future) -> None:
        # The rendezvous and each bucket's collective time out on their own; this is only a backstop.
        timeout = (num_buckets + 1) * entry.group.timeout_s + SLACK_S
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"weight-sync group {entry.group.group_id}: broadcast did not finish within "
                                   f"{timeout:g} s") from None

    def _drop(self, entry: _Group) -> None:
        entry.prepared = entry.last = None
        connecting, entry.connecting = entry.connecting, None
        if connecting is not None:
            connecting.add_done_callback(lambda f: f.exception() is None and f.result().close())
        entry.store = None

    def close(self, group_id: str) -> None:
        """Forgets the group and frees its buffers and sockets; closing an unknown group is a no-op."""
        entry = self._groups.pop(group_id, None)
        if entry is not None:
            self._drop(entry)
            log.info("weight-sync group closed", extra={"fields": {"group_id": group_id}})

    def close_all(self) -> None:
        for group_id in list(self._groups):
            self.close(group_id)
        self._threads.shutdown(wait=False, cancel_futures=True)
