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
