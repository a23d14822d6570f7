"""What a PushWeights call's request metadata says (rlfabric.weight_sync.grpc_stream): how many streams carry the
push, how long a stream waits for the others, and, with relay (rlfabric.weight_sync.chain), the replicas after
the receiver and how long a forward may stall. Malformed values are InvalidArgument."""

from __future__ import annotations

import math

from rlfabric.core.errors import InvalidArgument

MAX_STREAMS = 16
STREAMS_METADATA = "rlfabric-push-streams"
DEFAULT_WAIT_S = 120.0  # how long a stream waits for the rest of its push when the client set no deadline

CHAIN_METADATA = "rlfabric-relay-chain"
HOP_TIMEOUT_METADATA = "rlfabric-relay-hop-timeout"
MAX_CHAIN = 1024  # replicas after the receiver; a chain that long is already 1,024 hops of latency
HOP_SLACK_S = 2.0  # a replica answers its upstream this long before its own deadline


def streams_of(context) -> int:
    """How many streams carry this push (1..MAX_STREAMS; 1 when the metadata says nothing)."""
    for key, value in context.invocation_metadata() or ():
        if key == STREAMS_METADATA:
            try:
                streams = int(value)
            except ValueError:
                streams = 0
            if not 1 <= streams <= MAX_STREAMS:
                raise InvalidArgument(f"PushWeights metadata {STREAMS_METADATA}={value!r}: must be 1..{MAX_STREAMS}")
            return streams
    return 1


def stream_wait_s(context) -> float:
    """How long this stream may wait for the rest of its push: the call's deadline, else DEFAULT_WAIT_S."""
    remaining = context.time_remaining()
    return DEFAULT_WAIT_S if remaining is None or not math.isfinite(remaining) else max(0.0, remaining)


def relay_metadata(chain: tuple[str, ...], hop_timeout_s: float) -> tuple[tuple[str, str], ...]:
    """The request metadata of a push whose receiver forwards it along `chain` (none for an empty chain)."""
    if not chain:
        return ()
    return ((CHAIN_METADATA, ",".join(chain)), (HOP_TIMEOUT_METADATA, f"{hop_timeout_s:g}"))


def chain_of(context) -> tuple[tuple[str, ...], float]:
    """The chain after this receiver and the hop timeout, from a push's metadata; ((), 0) when it relays nothing.
    InvalidArgument for a malformed chain."""
    values = dict(context.invocation_metadata() or ())
    raw = values.get(CHAIN_METADATA, "")
    if not raw:
        return (), 0.0
    chain = tuple(raw.split(","))
    if len(chain) > MAX_CHAIN or not all(chain):
        raise InvalidArgument(f"PushWeights metadata {CHAIN_METADATA}: 1..{MAX_CHAIN} comma-separated addresses, "
                              f"none empty (got {len(chain)})")
    try:
        hop_timeout_s = float(values.get(HOP_TIMEOUT_METADATA, ""))
    except ValueError:
        hop_timeout_s = math.nan
    if not (math.isfinite(hop_timeout_s) and hop_timeout_s > 0):
        raise InvalidArgument(f"PushWeights metadata {HOP_TIMEOUT_METADATA} must be a number of seconds > 0 with "
                              f"{CHAIN_METADATA}")
    return chain, hop_timeout_s
