"""The grpc transport's sending side: one PushWeights client stream per receiver, over the mesh's
ordinary channels (TLS and auth included), so it works wherever gRPC does, across clusters too.

The stream is the manifest, then every bucket in chunks of CHUNK_BYTES; the whole stream has one
deadline (the group's timeout per bucket). The receiver assembles and checks the buckets
(BucketAssembler) and answers with the version it now serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from rlfabric.core.client import ChannelOptions, open_channel
from rlfabric.core.interceptors import bearer_metadata
from rlfabric.core.weight_sync.manifest import Manifest
from rlfabric.v1 import rollout_pb2

CHUNK_BYTES = 16 * 1024 * 1024
PUSH_METHOD = "/rlfabric.v1.RolloutService/PushWeights"


@dataclass(frozen=True)
class PushResult:
    """How one receiver's PushWeights went: version and paused_seconds, or the error."""

    address: str
    version: int = -1
    paused_seconds: float = 0.0
    error: str = ""


def serialize_chunks(manifest: Manifest, buffers: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> list[bytes]:
    """The whole PushWeights stream as serialized messages: the manifest, then every bucket in chunks.
    Serialized once per sync, then written as-is to every receiver's stream, so a second receiver
    costs no second serialization."""
    chunks = [rollout_pb2.PushWeightsRequest(manifest=manifest.to_proto()).SerializeToString()]
    for index, buffer in enumerate(buffers):
        data = buffer.numpy()
        for offset in range(0, len(data), chunk_bytes):
            message = rollout_pb2.PushWeightsRequest(bucket_index=index, offset=offset,
                                                     data=data[offset : offset + chunk_bytes].tobytes())
            chunks.append(message.SerializeToString())
    return chunks


async def push_weights(address: str, chunks: list[bytes], timeout_s: float,
                       options: ChannelOptions | None = None) -> PushResult:
    """Streams serialized PushWeights messages to one RolloutService; never raises: failures come
    back in PushResult.error."""
    options = options or ChannelOptions()
    try:
        async with open_channel(address, options) as channel:
            push = channel.stream_unary(PUSH_METHOD, request_serializer=None,  # already bytes
                                        response_deserializer=rollout_pb2.PushWeightsResponse.FromString)
            response = await push(iter(chunks), timeout=timeout_s, metadata=bearer_metadata(options.auth_token))
        return PushResult(address, response.version, response.paused_seconds)
    except grpc.RpcError as error:
        return PushResult(address, error=f"{error.code().name}: {error.details()}")
