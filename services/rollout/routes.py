"""A sample's MoE routes (actor.router_replay) as they travel: [tokens, layers, top_k] expert ids of the prompt's
and the response's tokens, small unsigned ints (uint8 for at most 255 experts, else uint16), the largest value of
the type where a token has none (a response's last token). numpy only: the rollout router and the coordinator
read samples without torch. What records and replays them: rlfabric.core.router_replay."""

from __future__ import annotations

import numpy as np

from rlfabric.core.errors import InvalidArgument


def route_dtype(num_experts: int) -> np.dtype:
    """uint8 for at most 255 experts (255 = UNRECORDED), else uint16."""
    return np.dtype(np.uint8) if num_experts <= 255 else np.dtype("<u2")


def unrecorded(dtype: np.dtype) -> int:
    """The value that marks a token whose routes are not known."""
    return int(np.iinfo(dtype).max)


def encode_routes(routes: np.ndarray) -> tuple[bytes, int, int, int]:
    """(ids, layers, top_k, id_bytes) of routes [tokens, layers, top_k] uint8/uint16, for the wire."""
    if routes.ndim != 3 or routes.dtype not in (np.uint8, np.dtype("<u2")):
        raise ValueError(f"routes must be [tokens, layers, top_k] uint8 or uint16, got {routes.shape} {routes.dtype}")
    return routes.tobytes(), routes.shape[1], routes.shape[2], routes.dtype.itemsize


def decode_routes(ids: bytes, layers: int, top_k: int, id_bytes: int) -> np.ndarray:
    """routes [tokens, layers, top_k] from the wire's fields; InvalidArgument naming what does not fit."""
    if id_bytes not in (1, 2):
        raise InvalidArgument(f"routed_experts.id_bytes must be 1 or 2, got {id_bytes}")
    if layers <= 0 or top_k <= 0:
        raise InvalidArgument(f"routed_experts needs layers and top_k >= 1, got {layers} and {top_k}")
    per_token = layers * top_k * id_bytes
    if len(ids) % per_token:
        raise InvalidArgument(f"routed_experts.ids has {len(ids)} bytes, not a multiple of layers x top_k x "
                              f"id_bytes = {per_token}")
    dtype = np.dtype(np.uint8) if id_bytes == 1 else np.dtype("<u2")
    return np.frombuffer(ids, dtype=dtype).reshape(-1, layers, top_k)


def join_routes(joined: np.ndarray | None, routes: np.ndarray | None) -> np.ndarray | None:
    """A sequence built by several engine calls, each consuming the sequence so far and sampling more (the turns
    of a multi-turn sample, an agent segment's calls, an aborted call's pieces): `joined` [tokens, layers, top_k]
    holds the routes of its first tokens, and a later call's `routes` cover the same tokens and more. Each token
    keeps the routes of the first call that ran it through the model: a sampled token those of the call that
    sampled it, except a call's last sampled token (never run by its call) and the tokens put in between calls,
    which take the next call's (its prompt pass). So the call's rows past `joined` are added up to its last
    recorded one. None routes add nothing."""
    if routes is None:
        return joined
    if joined is not None and joined.dtype != routes.dtype:
        raise ValueError(f"routes of {routes.dtype} cannot join routes of {joined.dtype} (another model's experts)")
    known = 0 if joined is None else len(joined)
    new = routes[known:]
    recorded = np.flatnonzero((new != unrecorded(routes.dtype)).any(axis=(1, 2)))
    added = new[: recorded[-1] + 1] if len(recorded) else new[:0]
    return added.copy() if joined is None else np.concatenate([joined, added])


def padded_routes(joined: np.ndarray | None, tokens: int) -> np.ndarray | None:
    """`joined` [<= tokens, layers, top_k] as a sample's routes of `tokens` tokens: unrecorded past its end."""
    if joined is None:
        return None
    if len(joined) > tokens:
        raise ValueError(f"routes for {len(joined)} tokens but the sample has {tokens}")
    tail = np.full((tokens - len(joined), *joined.shape[1:]), unrecorded(joined.dtype), dtype=joined.dtype)
    return np.concatenate([joined, tail])
