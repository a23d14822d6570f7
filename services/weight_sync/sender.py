"""The sending side of weight sync: rank 0 of every group the actor opens.

    sender = WeightSender(host, device, channel_options, timeout_s=120, bucket_bytes=64 << 20)
    group = sender.open("gloo", num_receivers=2)          # -> receivers' JoinWeightSyncGroup
    manifest = sender.prepare(group.group_id, 7, state)    # plans; -> receivers' ReceiveWeights
    result = await sender.broadcast(group.group_id, 7)     # while the receivers receive
    result.phases                                          # gather (given to prepare), pack, checksum, wire

gloo, nccl and cuda_ipc syncs are pipelined (rlfabric.weight_sync.pipeline): prepare() only plans the
buckets, and broadcast() packs bucket k+1 into one of two staging buffers while bucket k is on the wire,
taking each bucket's CRC-32 as it packs (the receivers get the CRC-32s after the last bucket; cuda_ipc has
none). The packing reads `state` then, on the thread broadcast() is given (the actor's torch thread, so no
update changes the weights half-way). grpc pushes and torch groups (SGLang) pack and checksum every bucket in
prepare(), as their manifests carry the CRC-32s, and keep the packed buffers for the next sync. So do delta
groups (open(delta=True), weight_sync.delta): prepare() packs the full weights and, when the receivers hold the
version last sent, encodes the change against it (rlfabric.weight_sync.delta.DeltaSender); once sent, the packed
full weights are the base of the next delta.

open() returns at once: rank 0's half of the rendezvous runs on a thread of its own and completes
when every receiver has joined; broadcast() waits for it. A group whose collective failed is broken
(gloo and NCCL cannot resume after a peer is lost): later calls get FAILED_PRECONDITION naming
the first failure, and the caller opens a new group.

Bounds, so no caller can use the sender up: a group's timeout is at most max_timeout_s (more is
INVALID_ARGUMENT), and at most max_open_groups are open. Opening one more evicts the open group
unused for longest that is not moving bytes (one still connecting, or idle between syncs): its
rendezvous is abandoned (gloo: closing its store makes rank 0's join fail at once, so its thread
ends), its buffers are freed, and later calls on it get NOT_FOUND saying it was evicted. When every
group is mid-sync, open() is RESOURCE_EXHAUSTED. An NCCL rendezvous cannot be abandoned: its thread
gives up after the group's timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from rlfabric.core.client import ChannelOptions
from rlfabric.core.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from rlfabric.weight_sync.buckets import crc_buffer, dedupe_shared, pack, plan_buckets
from rlfabric.weight_sync.chain import RELAYS, push_chain
from rlfabric.weight_sync.delta import DeltaSender
from rlfabric.weight_sync.grpc_stream import PushPayload, PushResult, push_weights
from rlfabric.weight_sync.manifest import MAX_WORLD_SIZE, AdapterSpec, Manifest, SyncGroup
from rlfabric.weight_sync.phases import PhaseClock, SyncPhases
from rlfabric.weight_sync.pipeline import Pipeline, Staged, one_thread_on_the_host, staging_buffers
from rlfabric.weight_sync.receiver import SLACK_S, in_thread

log = logging.getLogger("rlfabric.weight_sync")

REMEMBERED_EVICTIONS = 256  # evicted group ids kept to explain a later call on one


@dataclass(frozen=True)
class BroadcastResult:
    num_bytes: int  # per receiver
    seconds: float  # gloo, nccl, cuda_ipc: packing and the collective; grpc: the pushes, each receiver's checks
    # and switch included
    pushes: tuple[PushResult, ...] = ()  # grpc transport: one per receiver
    phases: SyncPhases = field(default_factory=SyncPhases)  # the actor's: gather, pack, checksum, wire
    egress_bytes: int = 0  # grpc: bytes the actor itself sent, to all receivers together


@dataclass
class _Prepared:
    """A sync prepare() made ready for broadcast()."""

    manifest: Manifest
    phases: SyncPhases  # so far: the gather, and for grpc and torch groups the pack and checksum
    buffers: list[torch.Tensor] | None = None  # grpc, torch groups, delta groups: every bucket, packed
    state: Mapping[str, torch.Tensor] | None = None  # pipelined: the weights, packed while they are sent
    sent: tuple[Manifest, list[torch.Tensor]] | None = None  # delta groups: the full weights, the base once sent


@dataclass
class _Group:
    group: SyncGroup
    bucket_bytes: int
    dtype: torch.dtype | None
    addresses: tuple[str, ...] = ()  # grpc
    relay: str = "none"  # grpc: "chain" = push to the first address, which forwards along the rest
    connecting: Future | None = None  # rank 0's transport, once every receiver joined
    store: object = None  # gloo, cuda_ipc: the TCPStore must outlive the process group
    prepared: _Prepared | None = None
    last: tuple[Manifest, list[torch.Tensor]] | None = None  # grpc, torch groups: kept for the next pack
    staging: list[torch.Tensor] | None = None  # pipelined: the staging buffers, kept for the next sync
    delta: DeltaSender | None = None  # weight_sync.delta: what it last sent, and the change against it
    broken: str = ""
    evicted: str = ""  # why, once evicted
    last_used: float = field(default_factory=time.monotonic)  # opened, or a prepare or broadcast ended
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one broadcast at a time
    buffers_lock: threading.Lock = field(default_factory=threading.Lock)  # no pack into buffers being sent

    @property
    def pipelined(self) -> bool:
        return self.group.transport in ("gloo", "nccl", "cuda_ipc") and not self.group.torch_group and not self.delta

    @property
    def busy(self) -> bool:
        """Packing, or broadcasting over a connected transport: not to be evicted."""
        connected = self.connecting is None or (self.connecting.done() and self.connecting.exception() is None)
        return self.buffers_lock.locked() or (connected and self.lock.locked())


class WeightSender:
    """Rank 0 of the weight-sync groups of one actor."""

    def __init__(self, host: str, device: torch.device, options: ChannelOptions | None = None,
                 timeout_s: float = 120.0, bucket_bytes: int = 512 << 20, max_timeout_s: float = 600.0,
                 max_open_groups: int = 4):
        self.host, self.device, self.options = host, device, options or ChannelOptions()
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.max_timeout_s, self.max_open_groups = max_timeout_s, max_open_groups
        self._groups: dict[str, _Group] = {}
        self._evicted: OrderedDict[str, str] = OrderedDict()  # group id -> why (the latest few)

    def default_transport(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def open(self, transport: str = "", num_receivers: int = 1, bucket_bytes: int = 0,
             dtype: torch.dtype | None = None, timeout_s: float = 0.0, addresses: tuple[str, ...] = (),
             torch_group: bool = False, delta: bool = False, relay: str = "", delta_base_from: str = "") -> SyncGroup:
        """A new group with this actor as rank 0; receivers join with ranks 1..num_receivers. `torch_group` (gloo,
        nccl): a torch.distributed group an SGLang server can join (rlfabric.weight_sync.torch_group), whose buckets
        are packed densely, as SGLang's flattened buckets are. `delta` (gloo, nccl, grpc): the group keeps what it
        last sent (or `delta_base_from`'s: _take_base), and prepare() sends the change against it where the
        receivers hold it. `relay` (grpc): "chain" = the receivers forward the push along `addresses`."""
        transport = transport or self.default_transport()
        timeout_s = timeout_s or self.timeout_s
        if not 1 <= num_receivers < MAX_WORLD_SIZE:
            raise InvalidArgument(f"num_receivers must be 1..{MAX_WORLD_SIZE - 1} (a group has at most "
                                  f"{MAX_WORLD_SIZE} ranks), got {num_receivers}")
        if bucket_bytes < 0:
            raise InvalidArgument(f"bucket_bytes must be >= 0 (0 = the default), got {bucket_bytes}")
        if not 0 < timeout_s <= self.max_timeout_s:
            raise InvalidArgument(f"timeout_s must be > 0 and at most weight_sync.max_timeout_s="
                                  f"{self.max_timeout_s:g} (0 = the default, {self.timeout_s:g}), got {timeout_s:g}")
        if transport == "grpc" and len(addresses) != num_receivers:
            raise InvalidArgument(f"the grpc transport needs one receiver address per receiver: got {len(addresses)} "
                                  f"for num_receivers {num_receivers}")
        if transport not in ("gloo", "nccl", "grpc", "cuda_ipc"):
            raise InvalidArgument(f"unknown weight-sync transport {transport!r}")
        relay = relay or "none"
        if relay not in RELAYS:
            raise InvalidArgument(f"unknown weight-sync relay {relay!r} (one of {', '.join(RELAYS)})")
        if relay != "none" and transport != "grpc":
            raise InvalidArgument(f"weight-sync relay {relay} runs over the grpc transport, not {transport}")
        if torch_group and transport in ("grpc", "cuda_ipc"):
            raise InvalidArgument(f"the {transport} transport cannot be a torch group (SGLang joins gloo or nccl "
                                  "groups)")
        if delta and (torch_group or transport == "cuda_ipc"):
            raise InvalidArgument("delta weight sync runs over gloo, nccl and grpc groups (not cuda_ipc, where no "
                                  "byte travels, nor SGLang's torch groups, which take full buckets only)")
        if transport == "nccl" and self.device.type != "cuda":
            raise FailedPrecondition("the nccl weight-sync transport needs the actor on a CUDA device; "
                                     "this actor runs on CPU (use gloo or grpc)")
        sharing = self._sharing() if transport == "cuda_ipc" else None  # FailedPrecondition off a GPU
        inherited = self._take_base(delta_base_from) if delta and delta_base_from else None  # before it is evicted
        self._make_room()
        group_id = f"ws-{uuid.uuid4().hex[:12]}"
        world_size = num_receivers + 1
        entry = _Group(SyncGroup(group_id, transport, world_size, timeout_s), bucket_bytes or self.bucket_bytes,
                       dtype, tuple(addresses), relay, delta=(inherited or DeltaSender()) if delta else None)
        if torch_group:
            from rlfabric.weight_sync.gloo import GlooTransport
            from rlfabric.weight_sync.torch_group import TorchGroupTransport, host_store

            entry.store = host_store(self.host, world_size, timeout_s)
            entry.group = SyncGroup(group_id, transport, world_size, timeout_s, store_host=self.host,
                                    store_port=entry.store.port, torch_group=True)
            client = GlooTransport.connect_store(entry.group)  # as for gloo: closing the store ends the rendezvous
            entry.connecting = in_thread(f"weight-sync-{group_id}", TorchGroupTransport, entry.group, 0,
                                          self.device, client)
        elif transport == "gloo":
            from rlfabric.weight_sync.gloo import GlooTransport

            entry.store = GlooTransport.host_store(self.host, world_size, timeout_s)
            entry.group = SyncGroup(group_id, transport, world_size, timeout_s, store_host=self.host,
                                    store_port=entry.store.port)
            # Rank 0 joins through a client connection of its own, made here: closing the store
            # (entry.store, the only reference to the server) then fails an abandoned rendezvous at
            # once, where a client still connecting would retry until the timeout.
            client = GlooTransport.connect_store(entry.group)
            entry.connecting = in_thread(f"weight-sync-{group_id}", GlooTransport, entry.group, 0, client)
        elif transport == "cuda_ipc":
            from rlfabric.weight_sync.cuda_ipc import CudaIpcTransport
            from rlfabric.weight_sync.gloo import GlooTransport

            entry.store = GlooTransport.host_store(self.host, world_size, timeout_s)  # the control group's
            entry.group = SyncGroup(group_id, transport, world_size, timeout_s, store_host=self.host,
                                    store_port=entry.store.port, device_uuid=sharing.identity(self.device))
            client = GlooTransport.connect_store(entry.group)
            entry.connecting = in_thread(f"weight-sync-{group_id}", CudaIpcTransport, entry.group, 0, self.device,
                                          client, sharing)
        elif transport == "nccl":
            from rlfabric.weight_sync.nccl import NcclTransport, new_unique_id

            entry.group = SyncGroup(group_id, transport, world_size, timeout_s, nccl_unique_id=new_unique_id())
            entry.connecting = in_thread(f"weight-sync-{group_id}", NcclTransport, entry.group, 0, self.device)
        self._groups[group_id] = entry
        log.info("weight-sync group opened", extra={"fields": {
            "group_id": group_id, "transport": transport, "world_size": world_size, "timeout_s": timeout_s,
            "torch_group": torch_group, "delta": delta, "relay": relay, "delta_base_from": delta_base_from}})
        return entry.group

    def _take_base(self, group_id: str) -> DeltaSender | None:
        """Open group `group_id`'s delta base, the group closed (rebuilt for a joiner); None if gone, busy or none."""
        entry = self._groups.get(group_id)
        delta = entry.delta if entry is not None and not entry.busy and entry.delta and entry.delta.base else None
        if delta is not None:
            self.close(group_id)
        return delta

    def _sharing(self):
        """How this actor lends buffers by CUDA IPC (its GPU must have a UUID every process can compare)."""
        from rlfabric.weight_sync.cuda_ipc import sharing_for

        sharing = sharing_for(self.device)
        if not sharing.identity(self.device):
            raise FailedPrecondition(f"the cuda_ipc weight-sync transport cannot tell the UUID of {self.device}")
        return sharing

    def _make_room(self) -> None:
        """Evicts the group unused for longest, unless it is busy, when max_open_groups are open."""
        if len(self._groups) < self.max_open_groups:
            return
        idle = [entry for entry in self._groups.values() if not entry.busy]
        if not idle:
            raise ResourceExhausted(f"{len(self._groups)} weight-sync groups are open and all are mid-sync "
                                    f"(weight_sync.max_open_groups={self.max_open_groups}): close one, or retry "
                                    "when a sync has finished")
        victim = min(idle, key=lambda entry: entry.last_used)
        victim.evicted = (f"evicted to make room for a newer group (weight_sync.max_open_groups="
                          f"{self.max_open_groups}; it was the one unused for longest)")
        self._evicted[victim.group.group_id] = victim.evicted
        while len(self._evicted) > REMEMBERED_EVICTIONS:
            self._evicted.popitem(last=False)
        del self._groups[victim.group.group_id]
        self._drop(victim)
        log.warning("weight-sync group evicted", extra={"fields": {
            "group_id": victim.group.group_id, "idle_s": round(time.monotonic() - victim.last_used, 3)}})

    def transport_of(self, group_id: str) -> str:
        """The transport of an open group ("" for none)."""
        entry = self._groups.get(group_id)
        return entry.group.transport if entry is not None else ""

    def _entry(self, group_id: str) -> _Group:
        entry = self._groups.get(group_id)
        if entry is None:
            if group_id in self._evicted:
                raise NotFound(f"weight-sync group {group_id} was {self._evicted[group_id]}; open a new one")
            raise NotFound(f"no weight-sync group {group_id!r} (closed, or opened by an earlier actor process)")
        if entry.broken:
            raise FailedPrecondition(f"weight-sync group {group_id} is broken ({entry.broken}); open a new one")
        return entry

    def _check_not_evicted(self, entry: _Group) -> None:
        """For a call that found the group before an open() evicted it meanwhile."""
        if entry.evicted:
            raise NotFound(f"weight-sync group {entry.group.group_id} was {entry.evicted}; open a new one")

    def prepare(self, group_id: str, version: int, state: Mapping[str, torch.Tensor],
                adapter: AdapterSpec | None = None, gather_s: float = 0.0,
                delta_base_version: int | None = None) -> Manifest:
        """The manifest of sending `state` as `version`, ready for broadcast(). Pipelined transports only plan
        the buckets here (`state` is packed while it is sent, so it must not change until then); grpc, torch
        and delta groups pack and checksum every bucket now. With `adapter`, `state` is LoRA adapters alone (peft
        names) and the manifest says so. `gather_s`: how long the caller took to gather `state`. Delta groups:
        when `delta_base_version` (the version every receiver holds) is the version this group last sent, the
        manifest carries the change against it; else the full weights."""
        entry = self._entry(group_id)
        if version < 0:
            raise InvalidArgument(f"weight version must be >= 0, got {version}")
        if entry.delta and adapter is None:
            with entry.buffers_lock, one_thread_on_the_host(torch.device("cpu")):
                entry.prepared = None
                clock = PhaseClock(gather=gather_s)
                manifest, buffers, sent = entry.delta.prepare(dedupe_shared(state), entry.bucket_bytes, version,
                                                              group_id, entry.dtype, delta_base_version, clock)
                entry.prepared = _Prepared(manifest, clock.phases(), buffers=buffers, sent=sent)
        elif entry.pipelined:
            state = dedupe_shared(state)
            plan = plan_buckets(state, entry.bucket_bytes, entry.dtype)
            manifest = Manifest(version, group_id, tuple(plan), adapter)
            entry.prepared = _Prepared(manifest, SyncPhases(gather=gather_s), state=state)
        else:
            with entry.buffers_lock, one_thread_on_the_host(torch.device("cpu")):  # packs into host memory
                entry.prepared = None
                reuse, buffers = entry.last or (None, None)
                clock = PhaseClock(gather=gather_s)
                manifest, buffers = pack(dedupe_shared(state), entry.bucket_bytes, version, group_id, entry.dtype,
                                         reuse, buffers, dense=entry.group.torch_group, clock=clock)
                manifest = dataclasses.replace(manifest, adapter=adapter)
                entry.last = (manifest, buffers)
                entry.prepared = _Prepared(manifest, clock.phases(), buffers=buffers)
        entry.last_used = time.monotonic()
        self._check_not_evicted(entry)
        return manifest

    async def broadcast(self, group_id: str, version: int, pack_executor: Executor | None = None,
                        before_pack: Callable[[], None] | None = None) -> BroadcastResult:
        """Sends the prepared buckets to every receiver. Pipelined transports pack them on `pack_executor`
        meanwhile (None: a thread of their own), after `before_pack()` there (which may raise to refuse)."""
        entry = self._entry(group_id)
        async with entry.lock:
            self._check_not_evicted(entry)  # while it waited for the broadcast before
            if entry.prepared is None or entry.prepared.manifest.version != version:
                prepared = "nothing" if entry.prepared is None else f"version {entry.prepared.manifest.version}"
                raise FailedPrecondition(f"weight-sync group {group_id} has {prepared} prepared, not version "
                                         f"{version}: call PrepareWeightSync first")
            prepared, entry.prepared = entry.prepared, None
            manifest = prepared.manifest
            started = time.perf_counter()
            if entry.group.transport == "grpc":
                try:
                    pushes = await self._push(entry, manifest, prepared.buffers)
                finally:
                    entry.last_used = time.monotonic()
                    if prepared.sent is not None and entry.delta is not None:  # delta groups: the receivers' now
                        entry.delta.sent(*prepared.sent)
                seconds = time.perf_counter() - started
                return BroadcastResult(manifest.num_bytes, seconds, pushes, prepared.phases + SyncPhases(wire=seconds),
                                       sum(push.sent_bytes for push in pushes))
            try:
                if entry.pipelined:
                    phases = await self._send_pipelined(entry, prepared, pack_executor, before_pack)
                else:
                    crcs = [bucket.crc32 for bucket in manifest.buckets]
                    await self._wait(entry, len(prepared.buffers), asyncio.wrap_future(
                        in_thread(f"weight-sync-send-{group_id}", self._send, entry, prepared.buffers, crcs)))
                    phases = prepared.phases + SyncPhases(wire=time.perf_counter() - started)
                    if prepared.sent is not None and entry.delta is not None:  # delta groups: the receivers' now
                        entry.delta.sent(*prepared.sent)
            except Exception as error:
                self._check_not_evicted(entry)  # its rendezvous was abandoned under this broadcast
                entry.broken = f"{type(error).__name__}: {error}"
                self._drop(entry)
                raise
            finally:
                entry.last_used = time.monotonic()
            return BroadcastResult(manifest.num_bytes, time.perf_counter() - started, phases=phases)

    async def _push(self, entry: _Group, manifest: Manifest, buffers: list[torch.Tensor]) -> tuple[PushResult, ...]:
        """grpc: PushWeights to every receiver at once, each chunk encoded once for all of them while
        the streams ask for it (no pack may refill the buffers meanwhile)."""
        deadline = entry.group.timeout_s * max(1, len(manifest.buckets))  # the group's timeout per bucket
        lock = entry.buffers_lock
        if not lock.acquire(blocking=False):  # a pack is running (on the actor's torch thread)
            acquiring = asyncio.wrap_future(in_thread(f"weight-sync-wait-{entry.group.group_id}", lock.acquire))
            try:
                await asyncio.shield(acquiring)
            except asyncio.CancelledError:
                acquiring.add_done_callback(lambda _: lock.release())
                raise
        try:
            if entry.relay == "chain":
                return await push_chain(entry.addresses, PushPayload(manifest, buffers), deadline,
                                        entry.group.timeout_s, self.options)
            payload = PushPayload(manifest, buffers, receivers=len(entry.addresses))
            return tuple(await asyncio.gather(*(push_weights(a, payload, deadline, self.options)
                                                for a in entry.addresses)))
        finally:
            lock.release()

    async def _send_pipelined(self, entry: _Group, prepared: _Prepared, pack_executor: Executor | None,
                              before_pack: Callable[[], None] | None) -> SyncPhases:
        """Packs on `pack_executor` while the wire thread sends (rlfabric.weight_sync.pipeline)."""
        plan = list(prepared.manifest.buckets)
        lends = entry.group.transport == "cuda_ipc"  # staged on the actor's GPU; otherwise on the host
        entry.staging = staging_buffers(plan, self.device if lends else torch.device("cpu"), reuse=entry.staging)
        clock = PhaseClock(**prepared.phases.as_dict())
        pipeline = Pipeline(entry.staging, entry.group.timeout_s + SLACK_S, clock)
        checksums = entry.group.checksums == "after"
        sending = in_thread(f"weight-sync-send-{entry.group.group_id}", self._send_staged, entry, pipeline,
                            prepared.manifest.version, checksums)
        if pack_executor is None:
            packing = in_thread(f"weight-sync-pack-{entry.group.group_id}", pipeline.pack_all, plan, prepared.state,
                                checksums, before_pack)
        else:
            packing = pack_executor.submit(pipeline.pack_all, plan, prepared.state, checksums, before_pack)
        try:
            outcomes = await self._wait(entry, len(plan), asyncio.gather(
                asyncio.wrap_future(sending), asyncio.wrap_future(packing), return_exceptions=True))
        except BaseException:
            pipeline.stop()  # neither side waits on for the other
            raise
        errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if errors:  # the cause, not the other side's Aborted
            raise next((error for error in errors if not isinstance(error, Aborted)), errors[0])
        return clock.phases()

    def _send_staged(self, entry: _Group, pipeline: Pipeline, version: int, checksums: bool) -> None:
        """The wire thread: each bucket as the packer stages it, then (gloo, nccl) the CRC-32s."""
        transport = self._connected(entry, pipeline)
        if entry.group.transport == "cuda_ipc":
            crcs = pipeline.send_all(lambda staged: transport.lend(version, staged.spec.index, staged.slot,
                                                                   staged.buffer))
        else:
            crcs = pipeline.send_all(lambda staged: transport.broadcast(_on(staged, transport.device)))
        if checksums:
            with pipeline.clock.timing("wire"):
                transport.broadcast(crc_buffer(crcs).to(transport.device))

    def _connected(self, entry: _Group, pipeline: Pipeline | None = None):
        """Rank 0's transport once every receiver has joined (DeadlineExceeded after the group's timeout);
        Aborted as soon as `pipeline` stops (its packer failed: nothing will be sent)."""
        deadline = time.monotonic() + entry.group.timeout_s
        while True:
            try:
                return entry.connecting.result(timeout=0.05 if pipeline is not None else entry.group.timeout_s)
            except concurrent.futures.TimeoutError:
                if pipeline is not None and pipeline.stopped:
                    raise Aborted(f"weight-sync group {entry.group.group_id}: the sync stopped before every "
                                  "receiver joined") from None
                if pipeline is None or time.monotonic() > deadline:
                    raise DeadlineExceeded(f"weight-sync group {entry.group.group_id}: not every receiver joined "
                                           f"within weight_sync.timeout_s={entry.group.timeout_s:g}") from None

    def _send(self, entry: _Group, buffers: list[torch.Tensor], crcs: list[int]) -> None:
        """Every packed bucket, then (gloo, nccl) their CRC-32s, as the pipelined wire sends them."""
        transport = self._connected(entry)
        with entry.buffers_lock:
            for buffer in buffers:
                transport.broadcast(buffer.to(transport.device, non_blocking=True))
            if entry.group.checksums == "after":
                transport.broadcast(crc_buffer(crcs).to(transport.device))

    async def _wait(self, entry: _Group, num_buckets: int, future):
        # The rendezvous and each bucket's collective time out on their own; this is only a backstop.
        timeout = (num_buckets + 1) * entry.group.timeout_s + SLACK_S
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"weight-sync group {entry.group.group_id}: broadcast did not finish within "
                                   f"{timeout:g} s") from None

    def _drop(self, entry: _Group) -> None:
        entry.prepared = entry.last = entry.staging = entry.delta = None
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



def _on(staged: Staged, device: torch.device) -> torch.Tensor:
    """A staged bucket on the transport's device (nccl: copied to the GPU; gloo: as it is)."""
    return staged.buffer if staged.buffer.device == device else staged.buffer.to(device)
