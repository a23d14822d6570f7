"""The grpc transport, both ends: the actor's PushWeights client streams and the rollout's handler.
It runs over the mesh's ordinary channels (TLS and auth included), so it works wherever gRPC does,
across clusters too.

The wire contract is rlfabric.v1.RolloutServicePushWeightsRequest, unchanged: the first message of a stream
carries the manifest, every later one a chunk (bucket_index, offset, data). What this module adds:

- Several streams per push. One HTTP/2 connection moves about a third of what a raw TCP socket does
  on loopback (one connection's reads and writes run on one transport thread); the actor splits a
  push over STREAMS_PER_RECEIVER streams, each on its own connection, and says how many in the
  request metadata `rlfabric-push-streams` (absent = 1). Each stream carries the whole manifest, then
  every STREAMS-th chunk; chunks of a bucket may therefore arrive in any order, and the receiver
  takes each exactly once (no gap, no overlap, checked) and checks every bucket's CRC-32 from its
  chunks' CRC-32s as they land. The streams of a push share one outcome: the receiver swaps the
  weights in once, when every bucket is complete and checked, and every stream answers with it.
- Chunks as raw bytes. The receiver's PushWeights handler takes the serialized messages (no
  request deserializer): the first is parsed with protobuf, the chunks by decode_chunk (chunks), a
  reader of protobuf's wire format for this one message that returns `data` as a view into the
  received bytes, so a chunk is copied once, into its bucket. encode_chunk writes what protobuf writes.
- Chunks encoded on demand (PushPayload): each once for all receivers, while their streams ask for
  it, and dropped when the last one took it; the packed buffers are the only copy of the weights.
- The manifest is checked against the receiver's own weights (WeightLimits) before any bucket is
  allocated.
- 4 MiB messages stay in the heap on both ends (_keep_message_memory) instead of being page-faulted
  in afresh for every message.

The whole push has one deadline (the group's timeout per bucket); a stream that ended waits for
the others of its push at most until its own deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import platform
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import torch
from google.protobuf.message import DecodeError
from grpc import aio

from rlfabric.core import tracing
from rlfabric.core.client import ChannelOptions, channel_credentials
from rlfabric.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    RlfabricError,
    Unavailable,
)
from rlfabric.core.interceptors import bearer_metadata
from rlfabric.v1 import rollout_pb2
from rlfabric.weight_sync.chunks import decode_chunk, encode_chunk
from rlfabric.weight_sync.delta import DeltaBase
from rlfabric.weight_sync.manifest import Manifest, WeightLimits
from rlfabric.weight_sync.phases import PhaseClock, SyncPhases
from rlfabric.weight_sync.push_metadata import (
    CHAIN_METADATA,
    MAX_STREAMS,
    STREAMS_METADATA,
    chain_of,
    relay_metadata,
    stream_wait_s,
    streams_of,
)
from rlfabric.weight_sync.receiver import BucketAssembler, Weights, WeightSwap

# 4 MiB chunks: large enough that per-message costs vanish, small enough that a message is a
# reused heap block on both sides (16 MiB and larger ones are fresh mappings, page-faulted per message).
CHUNK_BYTES = 4 << 20
STREAMS_PER_RECEIVER = 4
SERVICE = "rlfabric.v1.RolloutService"
PUSH_METHOD = f"/{SERVICE}/PushWeights"

@dataclass(frozen=True)
class PushResult:
    """How one receiver's PushWeights went: version and paused_seconds, or the error."""

    address: str
    version: int = -1
    paused_seconds: float = 0.0
    error: str = ""
    phases: SyncPhases = field(default_factory=SyncPhases)  # the receiver's: wire, checksum, apply
    sent_bytes: int = 0  # bytes of messages this push sent (the caller's egress to this receiver)
    relayed: tuple[PushResult, ...] = ()  # relay: how the push went on each replica after this one (chain order)

    def swap_or_error(self) -> WeightSwap | BaseException:
        """The receiver's WeightSwap, or its error as a RuntimeError."""
        return RuntimeError(self.error) if self.error else WeightSwap(self.version, self.paused_seconds, self.phases)


class PushPayload:
    """One push's messages, encoded as the streams ask for them: message 0 is the manifest, then every
    bucket in chunks of `chunk_bytes` (CPU uint8 buffers, which must not change until the push is
    over). A chunk is encoded once for all `receivers` and dropped when the last of them took it, so
    the pushes hold a few chunks at a time, not a second copy of the weights."""

    def __init__(self, manifest: Manifest, buffers: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES,
                 receivers: int = 1):
        manifest_message = rollout_pb2.RolloutServicePushWeightsRequest(manifest=manifest.to_proto())
        self.manifest_message = manifest_message.SerializeToString()
        self._views = [memoryview(buffer.numpy()) for buffer in buffers]
        self._chunks = [(index, offset, min(chunk_bytes, len(view) - offset))
                        for index, view in enumerate(self._views) for offset in range(0, len(view), chunk_bytes)]
        self._receivers = receivers
        self._encoded: dict[int, list] = {}  # chunk -> [message, receivers that have not taken it yet]

    def __len__(self) -> int:
        """Messages in one receiver's push: the manifest and every chunk."""
        return 1 + len(self._chunks)

    def message(self, number: int) -> bytes:
        """Message `number` (0: the manifest); each receiver takes each message once."""
        if number == 0:
            return self.manifest_message
        held = self._encoded.get(number)
        if held is None:
            index, offset, length = self._chunks[number - 1]
            held = [encode_chunk(index, offset, self._views[index][offset : offset + length]), self._receivers]
            self._encoded[number] = held
        held[1] -= 1
        if held[1] <= 0:
            del self._encoded[number]
        return held[0]

    def stream(self, lane: int, streams: int) -> Iterator[bytes]:
        """The messages of stream `lane` of `streams`: the manifest, then every `streams`-th chunk."""
        yield self.message(0)
        for number in range(1 + lane, len(self), streams):
            yield self.message(number)


def serialize_chunks(manifest: Manifest, buffers: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> list[bytes]:
    """The whole push as a list of serialized messages: the manifest, then every bucket in chunks."""
    payload = PushPayload(manifest, buffers, chunk_bytes)
    return [payload.message(number) for number in range(len(payload))]


_malloc_tuned = False


def _keep_message_memory() -> None:
    """gRPC Python copies every message it sends into a new block, and hands every message it
    receives over as a new bytes object. glibc serves a 4 MiB block from a fresh mapping, or from
    heap memory it gave back to the kernel when the previous one was freed: either way every page of
    every chunk is faulted in again (about 0.3 s of system time per GiB on each side). A fixed mmap
    threshold above the chunk size and a trim threshold of 64 MiB keep those blocks in the heap for
    the next messages. Done once per process, by its first push (glibc only)."""
    global _malloc_tuned
    if _malloc_tuned:
        return
    _malloc_tuned = True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    mallopt(m_mmap_threshold, 2 * CHUNK_BYTES)
    mallopt(m_trim_threshold, 64 << 20)


# -- the sending side -----------------------------------------------------------------------------------

def _push_channel(address: str, options: ChannelOptions) -> aio.Channel:
    """A channel with a connection of its own (a local subchannel pool: channels to one address
    otherwise share one TCP connection)."""
    args = [*options.grpc_options(), ("grpc.use_local_subchannel_pool", 1)]
    traced = tracing.client_interceptors(address) or None  # None while tracing is off
    if options.tls.ca_file or options.tls.cert_file:
        return aio.secure_channel(address, channel_credentials(options.tls), options=args, interceptors=traced)
    return aio.insecure_channel(address, options=args, interceptors=traced)


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def _first_cause(errors: list[BaseException]) -> BaseException:
    """The error that says what went wrong: a stream cut short because another one failed reports
    CANCELLED or UNAVAILABLE, so any other code comes first."""
    secondary = (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    for error in errors:
        if not (isinstance(error, grpc.RpcError) and error.code() in secondary):
            return error
    return errors[0]


async def push_weights(address: str, chunks: PushPayload | list[bytes], timeout_s: float,
                       options: ChannelOptions | None = None, streams: int = STREAMS_PER_RECEIVER,
                       relay: tuple[tuple[str, ...], float] = ((), 0.0)) -> PushResult:
    """Streams a push (a PushPayload, or serialized PushWeights messages, the manifest first) to one
    RolloutService over `streams` connections; never raises for a failed push: failures come back in
    PushResult.error. `relay`: the replicas the receiver forwards the push to, in order, and the hop timeout
    (rlfabric.weight_sync.chain); their outcomes come back in PushResult.relayed."""
    _keep_message_memory()  # gRPC copies every message it sends into a new block too
    options = options or ChannelOptions()
    streams = max(1, min(streams, MAX_STREAMS, len(chunks) - 1))
    if isinstance(chunks, PushPayload):
        lanes = [chunks.stream(lane, streams) for lane in range(streams)]
    else:
        lanes = [iter([chunks[0], *chunks[1 + lane :: streams]]) for lane in range(streams)]
    sent = [0]
    lanes = [_counted(lane, sent) for lane in lanes]
    metadata = (*bearer_metadata(options.auth_token), (STREAMS_METADATA, str(streams)), *relay_metadata(*relay))
    channels = [_push_channel(address, options) for _ in range(streams)]
    try:
        calls = [channel.stream_unary(PUSH_METHOD, request_serializer=None,  # already bytes
                                      response_deserializer=rollout_pb2.RolloutServicePushWeightsResponse.FromString)
                 for channel in channels]
        outcomes = await asyncio.gather(*(call(lane, timeout=timeout_s, metadata=metadata)
                                          for lane, call in zip(lanes, calls, strict=True)), return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            cause = _first_cause(errors)
            if not isinstance(cause, grpc.RpcError | RlfabricError | OSError):
                raise cause
            return PushResult(address, error=_describe(cause), sent_bytes=sent[0])
        relayed = tuple(PushResult(r.address, r.version, r.paused_seconds, r.error, SyncPhases.from_proto(r.phases))
                        for r in outcomes[0].relayed)
        return PushResult(address, outcomes[0].version, outcomes[0].paused_seconds, "",
                          SyncPhases.from_proto(outcomes[0].phases), sent[0], relayed)
    finally:
        for channel in channels:
            await channel.close()


def _counted(messages: Iterator[bytes], sent: list[int]) -> Iterator[bytes]:
    for message in messages:
        sent[0] += len(message)
        yield message


# -- the receiving side ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PushOutcome:
    """What one PushWeights stream reports: the push's manifest and swap; `applied_here` is true for
    the one stream of the push that ran the swap (so it is counted once)."""

    manifest: Manifest
    swap: WeightSwap
    applied_here: bool
    relayed: tuple[PushResult, ...] = ()  # relay: the outcome on each replica downstream (chain order)


class _Push:
    """One push in progress: its manifest, its buckets, and the streams that carry it."""

    def __init__(self, manifest: Manifest, streams: int, assembler: BucketAssembler):
        self.manifest, self.streams, self.assembler = manifest, streams, assembler
        self.started = time.perf_counter()  # wire time: from here until every bucket is in
        self.joined = self.attached = self.ended = 0
        self.applying = False
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" log
        self.forward: Forwarder | None = None  # relay: the push on its way to the next replica

    def accepts(self, manifest: Manifest, streams: int) -> bool:
        return (not self.done.done() and self.joined < self.streams and streams == self.streams
                and manifest == self.manifest)

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        if self.forward is not None:  # downstream gets nothing more; its upstream routes around this replica
            self.forward.cancel()

    def raise_if_failed(self) -> None:
        if self.done.done() and not self.done.cancelled() and self.done.exception() is not None:
            raise self.done.exception()


class Forwarder(Protocol):
    """A push on its way to the next replica (rlfabric.weight_sync.chain.ChainForward)."""

    done: bool

    def add(self, lane: int, bucket_index: int, offset: int, length: int, raw: bytes | None = None) -> None: ...
    def close(self, lane: int) -> None: ...
    def cancel(self) -> None: ...
    async def outcomes(self) -> tuple[PushResult, ...]: ...


class PushReceiver:
    """The receiving end of PushWeights: assembles every push from its streams, one push at a time
    (they share the bucket buffers, which the next push of the same sizes reuses)."""

    def __init__(self, options: Callable[[], ChannelOptions] = ChannelOptions,
                 forwarder: Callable[..., Forwarder] | None = None):
        """`forwarder` (ChainForward's signature): how a push that names a relay chain is forwarded, over the
        channel options `options()` makes (TLS, auth), called at the first relayed push: a replica that never
        relays never reads the mesh's credentials (a pod may mount none); None = this receiver refuses to relay."""
        self._make_options, self.forwarder = options, forwarder
        self._options: ChannelOptions | None = None
        self._push: _Push | None = None
        self._changed: asyncio.Condition | None = None
        self._buffers: list[torch.Tensor] = []
        self.base = DeltaBase()  # what the last keep_base push brought, for the next delta (weight_sync.delta)
        self._lending = 0  # pushes of the base to peers under way (held()): no push may overwrite it meanwhile

    @property
    def options(self) -> ChannelOptions:
        if self._options is None:
            self._options = self._make_options()
        return self._options

    async def receive(self, requests: AsyncIterator[bytes], context, limits: WeightLimits | None,
                      apply: Callable[[Weights, Manifest], Awaitable[WeightSwap]]) -> PushOutcome:
        """Takes one stream (raw messages); returns once its push is swapped in (by `apply(weights,
        manifest)`, run once per push) or failed. Raises InvalidArgument for a bad manifest, chunk or
        checksum, ResourceExhausted for a manifest beyond this receiver's weights."""
        started = time.monotonic()
        _keep_message_memory()
        wait_s = stream_wait_s(context)
        streams = streams_of(context)
        chain, hop_timeout_s = chain_of(context)
        if chain and self.forwarder is None:
            raise FailedPrecondition("PushWeights: this receiver does not relay pushes (metadata "
                                     f"{CHAIN_METADATA})")
        first = await anext(aiter(requests), None)
        try:
            message = rollout_pb2.RolloutServicePushWeightsRequest.FromString(first) if first is not None else None
        except DecodeError as error:
            raise InvalidArgument(f"PushWeights: the first message is not a valid RolloutServicePushWeightsRequest: "
                                  f"{error}") from None
        if message is None or not message.HasField("manifest"):
            raise InvalidArgument("PushWeights: the first message must carry the manifest")
        manifest = Manifest.from_proto(message.manifest)
        if limits is not None:
            limits.check(manifest)  # before a single byte is allocated for it
        relay = (chain, hop_timeout_s, started + wait_s, first)
        push, lane = await self._join(manifest, streams, wait_s - (time.monotonic() - started), relay)
        try:
            try:  # this stream's chunks; any failure here fails the whole push
                async for raw in requests:
                    push.raise_if_failed()
                    bucket_index, offset, data = decode_chunk(raw)
                    push.assembler.add(bucket_index, offset, data)
                    if push.forward is not None:
                        push.forward.add(lane, bucket_index, offset, len(data), raw)
                push.raise_if_failed()
                if push.forward is not None:
                    push.forward.close(lane)
                push.ended += 1
                if push.ended == push.streams and not push.assembler.complete:
                    push.assembler.finish()  # raises, naming the incomplete buckets
            except asyncio.CancelledError:
                push.fail(Unavailable(f"PushWeights: a stream of version {manifest.version} was cancelled"))
                raise
            except BaseException as error:
                push.fail(error)
                raise
            if push.assembler.complete and not push.applying:  # the first stream to end on a complete push
                push.applying = True
                clock = push.assembler.clock
                clock.add("wire", time.perf_counter() - push.started)
                try:
                    weights = await self._weights(push.assembler, manifest)
                    with clock.timing("apply"):
                        swap = await apply(weights, manifest)
                    swap = dataclasses.replace(swap, phases=clock.phases())
                except asyncio.CancelledError:
                    push.fail(Unavailable(f"PushWeights: the stream switching to version {manifest.version} was "
                                          "cancelled"))
                    raise
                except BaseException as error:
                    push.fail(error)
                    raise
                if not push.done.done():
                    push.done.set_result(swap)
                return PushOutcome(manifest, swap, True, await self._relayed(push))
            remaining = wait_s - (time.monotonic() - started)
            try:
                swap = await asyncio.wait_for(asyncio.shield(push.done), max(0.0, remaining))
            except TimeoutError:
                raise DeadlineExceeded(f"PushWeights: the other stream(s) of version {manifest.version} did not "
                                       "finish within the deadline") from None
            return PushOutcome(manifest, swap, False, await self._relayed(push))
        finally:
            await self._leave(push)

    @staticmethod
    async def _relayed(push: _Push) -> tuple[PushResult, ...]:
        """Relay: how the push went downstream, once the forward ended (bounded by this replica's deadline)."""
        return await push.forward.outcomes() if push.forward is not None else ()

    async def _weights(self, assembler: BucketAssembler, manifest: Manifest) -> Weights:
        """The push's weights: its buckets, or (a delta) the base rebuilt from them, off the event loop."""
        if manifest.delta is not None:
            return await asyncio.to_thread(self.base.apply, manifest, assembler.finish(), assembler.clock)
        if manifest.keep_base:
            self.base.keep(manifest, assembler.buffers)
        return assembler.finish()

    @contextlib.asynccontextmanager
    async def held(self, version: int, wait_s: float) -> AsyncIterator[tuple[Manifest, list[torch.Tensor]]]:
        """The base as a push of it (manifest, bucket buffers), unchanged until the block ends: a push that arrives
        meanwhile waits. FailedPrecondition when the base is not `version`; DeadlineExceeded when a push was
        still being received after `wait_s`."""
        changed = self._condition()
        async with changed:
            try:
                await asyncio.wait_for(changed.wait_for(lambda: self._push is None), wait_s)
            except TimeoutError:
                raise DeadlineExceeded("a push was still being received") from None
            manifest = self.base.manifest
            if manifest is None or manifest.version != version:
                held = "no weights of a delta sync" if manifest is None else f"version {manifest.version}"
                raise FailedPrecondition(f"this replica holds {held}, not version {version}")
            self._lending += 1
        try:
            yield manifest, self.base.buffers
        finally:
            async with changed:
                self._lending -= 1
                changed.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _join(self, manifest: Manifest, streams: int, wait_s: float, relay: tuple) -> tuple[_Push, int]:
        """Joins the push in progress when this stream is one of its streams, else waits for it to end
        (bounded by the stream's deadline) and starts a new one, which forwards itself along `relay`'s chain
        (chain, hop timeout, deadline, the raw manifest message); the push and this stream's lane (join order)."""
        changed = self._condition()
        async with changed:
            try:
                await asyncio.wait_for(changed.wait_for(lambda: not self._lending and (
                    self._push is None or self._push.accepts(manifest, streams))), max(0.0, wait_s))
            except TimeoutError:
                raise DeadlineExceeded(f"PushWeights version {manifest.version}: another push was still being "
                                       "received at the deadline") from None
            if self._push is None:
                sizes = [b.num_bytes for b in manifest.buckets]
                keeps = manifest.keep_base and manifest.delta is None  # the buffers become the base
                reuse = self._buffers if [b.numel() for b in self._buffers] == sizes else None
                self._buffers = []  # the old buffers go before new ones are mapped
                if keeps:
                    reuse = self.base.recycle(sizes, torch.device("cpu"))
                assembler = BucketAssembler(manifest, reuse, PhaseClock())
                self._buffers = [] if keeps else assembler.buffers
                self._push = _Push(manifest, streams, assembler)
                chain, hop_timeout_s, deadline, manifest_message = relay
                if chain:
                    self._push.forward = self.forwarder(chain, streams, manifest_message, assembler.buffers,
                                                        hop_timeout_s, deadline, self.options)
            push = self._push
            push.joined += 1
            push.attached += 1
            return push, push.joined - 1

    async def _leave(self, push: _Push) -> None:
        changed = self._condition()
        async with changed:
            push.attached -= 1
            if push.attached == 0:
                if not push.done.done():
                    push.fail(InvalidArgument("PushWeights: every stream of the push ended before it was complete"))
                if push.forward is not None and not push.forward.done:
                    push.forward.cancel()
                if self._push is push:
                    self._push = None
                changed.notify_all()


def add_rollout_service(servicer, server: aio.Server) -> None:
    """Registers a RolloutServiceServicer like the generated add_RolloutServiceServicer_to_server,
    except that PushWeights gets the raw request bytes (see the module doc). A registered method
    handler takes precedence over the generated generic one of the same method."""
    from rlfabric.v1 import rollout_pb2_grpc

    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    server.add_registered_method_handlers(SERVICE, {"PushWeights": grpc.stream_unary_rpc_method_handler(
        servicer.PushWeights, request_deserializer=None,
        response_serializer=rollout_pb2.RolloutServicePushWeightsResponse.SerializeToString)})

