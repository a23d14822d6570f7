"""Relay between rollout replicas over the grpc transport (weight_sync.relay: chain): the actor pushes to the first
replica alone, and every replica forwards each chunk to the next one as soon as it has taken it, so the actor
sends one copy of the model whatever the number of replicas, and a sync takes about one wire time plus a chunk
per hop.

    push_weights(first, payload, deadline, options, relay=(rest_of_chain, hop_timeout_s))   # the actor
    forward = ChainForward(chain, streams, manifest_message, buffers, hop_timeout_s, deadline, options)  # a replica
    forward.add(lane, bucket_index, offset, length)   # each chunk once it is in the replica's bucket buffer
    forward.close(lane)                               # the lane's upstream stream ended
    relayed = await forward.outcomes()                # how the push went on every replica downstream
    results, sent = await push_held(receiver, joiners, version, hop_timeout_s, options)  # a peer catches joiners up

The request metadata says what follows the receiver: `rlfabric-relay-chain`, the addresses after it in order, and
`rlfabric-relay-hop-timeout`, how long a forward may stall (the group's timeout_s). A replica forwards lane i of
its push (the i-th stream that joined it) on lane i of its own push to the next replica: each chunk's message as
it came (no copy), once it is in the bucket buffer; a resend encodes the chunks again from the buffer.

Routing around a dead replica: a forward that fails (the connection drops, the replica refuses the push, or it
takes nothing for hop_timeout_s) is given up, and the replica after it gets the whole push again from the start
(its partial push from the dead one failed with its upstream stream); the dead one is reported with its error.
Each replica answers its upstream HOP_SLACK_S before its own deadline, so a hang deep in the chain is reported
by its upstream, never waited out by everyone.

Catch-up from a peer (push_held, RolloutService.PushHeldWeights): a replica that holds the current version as its
delta base (weight_sync.delta) pushes it to joiners exactly as the actor pushes a full sync, relayed along them,
so a joiner reaches the current version without the actor; each bucket's CRC-32 is the actor's, checked on arrival.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import torch

from rlfabric.core.client import ChannelOptions
from rlfabric.core.errors import InvalidArgument
from rlfabric.core.interceptors import bearer_metadata
from rlfabric.v1 import rollout_pb2
from rlfabric.weight_sync.chunks import encode_chunk
from rlfabric.weight_sync.grpc_stream import (
    PUSH_METHOD,
    PushPayload,
    PushReceiver,
    PushResult,
    _describe,
    _first_cause,
    _push_channel,
    push_weights,
)
from rlfabric.weight_sync.phases import SyncPhases
from rlfabric.weight_sync.push_metadata import HOP_SLACK_S, MAX_CHAIN, STREAMS_METADATA, relay_metadata

RELAYS = ("none", "chain")


async def push_chain(addresses: tuple[str, ...], payload: PushPayload, timeout_s: float, hop_timeout_s: float,
                     options: ChannelOptions) -> tuple[PushResult, ...]:
    """The actor's side: one push to the first address, which forwards it along the others; a first receiver that
    fails is routed around like any other (the next one gets the push from the actor). One result per address, in
    address order; sent_bytes is the actor's egress to the ones it pushed to."""
    results: dict[str, PushResult] = {}
    chain = addresses
    while chain:
        target, chain = chain[0], chain[1:]
        # every hop answers HOP_SLACK_S before its own deadline
        push = await push_weights(target, payload, timeout_s + HOP_SLACK_S * len(chain), options,
                                  relay=(chain, hop_timeout_s))
        results[target] = push
        if not push.error:
            results.update((relayed.address, relayed) for relayed in push.relayed)
            break
    return tuple(results.get(address, PushResult(address, error="UNKNOWN: the relay reported nothing for it"))
                 for address in addresses)


async def push_held(receiver: PushReceiver, targets: tuple[str, ...], version: int, hop_timeout_s: float,
                    options: ChannelOptions, max_hop_timeout_s: float) -> tuple[tuple[PushResult, ...], int]:
    """A replica's side of a catch-up (PushHeldWeights): the weights `receiver` holds as `version` pushed to
    `targets` as a chain, as the actor pushes a relayed sync; (one result per target in order, the bytes this replica
    sent). Its base does not change until the push is over. `max_hop_timeout_s`: weight_sync.max_timeout_s."""
    if not targets or len(targets) > MAX_CHAIN or not all(targets):
        raise InvalidArgument(f"PushHeldWeights: 1..{MAX_CHAIN} target addresses, none empty (got {len(targets)})")
    if not (math.isfinite(hop_timeout_s) and 0 < hop_timeout_s <= max_hop_timeout_s):
        raise InvalidArgument(f"PushHeldWeights: hop_timeout_s must be a number of seconds > 0 and at most "
                              f"weight_sync.max_timeout_s={max_hop_timeout_s:g}, got {hop_timeout_s}")
    async with receiver.held(version, hop_timeout_s) as (manifest, buffers):
        results = await push_chain(targets, PushPayload(manifest, buffers), hop_timeout_s * max(1, len(buffers)),
                                   hop_timeout_s, options)
    return results, sum(result.sent_bytes for result in results)


@dataclass
class _Lane:
    """What one upstream stream brought so far: (bucket_index, offset, length) of each chunk, in order."""

    chunks: list[tuple[int, int, int]] = field(default_factory=list)
    raw: list[bytes | None] = field(default_factory=list)  # each chunk's message until it was forwarded once
    closed: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    blocked_since: float | None = None  # the forward handed a message on and waits for downstream to take it


class ChainForward:
    """One push's forward down the chain; every target tried in turn until one takes the whole push. What a
    relaying replica gives its PushReceiver (grpc_stream.Forwarder)."""

    def __init__(self, chain: tuple[str, ...], streams: int, manifest_message: bytes, buffers: list[torch.Tensor],
                 hop_timeout_s: float, deadline: float, options: ChannelOptions):
        """`deadline`: time.monotonic() by which this replica answers its upstream; `buffers`: the push's bucket
        buffers, which hold each chunk once add() names it and do not change until the push is over."""
        self.chain, self.hop_timeout_s, self.deadline, self.options = chain, hop_timeout_s, deadline, options
        self._manifest_message = manifest_message
        self._views = [memoryview(buffer.numpy()) for buffer in buffers]
        self._lanes = [_Lane() for _ in range(streams)]
        self._task = asyncio.ensure_future(self._run())
        self._task.add_done_callback(lambda task: task.cancelled() or task.exception())

    def add(self, lane: int, bucket_index: int, offset: int, length: int, raw: bytes | None = None) -> None:
        """A chunk is in its bucket buffer; `raw`: the message that carried it, forwarded as it is (no copy) by
        the first attempt; a resend encodes the chunk again from the buffer."""
        self._lanes[lane].chunks.append((bucket_index, offset, length))
        self._lanes[lane].raw.append(raw)
        self._lanes[lane].changed.set()

    def close(self, lane: int) -> None:
        self._lanes[lane].closed = True
        self._lanes[lane].changed.set()

    def cancel(self) -> None:
        """This replica's push failed: downstream gets nothing more (its upstream routes around this one)."""
        self._task.cancel()

    @property
    def done(self) -> bool:
        return self._task.done()

    async def outcomes(self) -> tuple:
        """How the push went on each replica downstream (PushResults in chain order), once the forward ends."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._task), max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            self.cancel()
            return tuple(PushResult(address, error="DEADLINE_EXCEEDED: the relay did not finish before this "
                                    "replica's deadline") for address in self.chain)

    async def _run(self) -> tuple:
        results = []
        chain = self.chain
        while chain:
            target, chain = chain[0], chain[1:]
            result, relayed = await self._attempt(target, chain)
            results.append(result)
            if not result.error:
                return (*results, *relayed)
        return tuple(results)

    async def _attempt(self, target: str, rest: tuple[str, ...]):
        """The whole push, from its first chunk, to `target` with `rest` after it: (its PushResult, the relayed)."""
        remaining = self.deadline - HOP_SLACK_S - time.monotonic()
        if remaining <= 0:
            return PushResult(target, error="DEADLINE_EXCEEDED: no time left to relay the push to it"), ()
        metadata = (*bearer_metadata(self.options.auth_token), (STREAMS_METADATA, str(len(self._lanes))),
                    *relay_metadata(rest, self.hop_timeout_s))
        channels = [_push_channel(target, self.options) for _ in self._lanes]
        try:
            calls = [channel.stream_unary(PUSH_METHOD, request_serializer=None,
                                          response_deserializer=rollout_pb2.RolloutServicePushWeightsResponse.FromString)
                     for channel in channels]
            pushing = asyncio.gather(*(call(self._messages(lane), timeout=remaining, metadata=metadata)
                                       for lane, call in zip(self._lanes, calls, strict=True)), return_exceptions=True)
            while not (await asyncio.wait({pushing}, timeout=self.hop_timeout_s))[0]:
                now = time.monotonic()
                if any(lane.blocked_since is not None and now - lane.blocked_since > self.hop_timeout_s
                       for lane in self._lanes):
                    pushing.cancel()
                    return PushResult(target, error=f"DEADLINE_EXCEEDED: took no chunk for "
                                      f"{self.hop_timeout_s:g} s (weight_sync.timeout_s)"), ()
            outcomes = pushing.result()
            errors = [o for o in outcomes if isinstance(o, BaseException)]
            if errors:
                cause = _first_cause(errors)
                if not isinstance(cause, grpc.RpcError | OSError):
                    raise cause
                return PushResult(target, error=_describe(cause)), ()
            response = outcomes[0]
            relayed = tuple(PushResult(r.address, r.version, r.paused_seconds, r.error, SyncPhases.from_proto(r.phases))
                            for r in response.relayed)
            return PushResult(target, response.version, response.paused_seconds, "",
                              SyncPhases.from_proto(response.phases)), relayed
        finally:
            for channel in channels:
                await channel.close()

    async def _messages(self, lane: _Lane) -> AsyncIterator[bytes]:
        """Lane `lane` of the push from its start: the manifest, then each chunk as the upstream brings it."""
        sent = 0
        message = self._manifest_message
        while True:
            lane.blocked_since = time.monotonic()
            yield message
            lane.blocked_since = None
            while sent == len(lane.chunks) and not lane.closed:
                lane.changed.clear()
                await lane.changed.wait()
            if sent == len(lane.chunks):
                return
            bucket_index, offset, length = lane.chunks[sent]
            message, lane.raw[sent] = lane.raw[sent], None
            if message is None:
                message = encode_chunk(bucket_index, offset, self._views[bucket_index][offset : offset + length])
            sent += 1
