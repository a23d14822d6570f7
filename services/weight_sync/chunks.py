"""The wire format of a PushWeights chunk (rlfabric.v1.RolloutServicePushWeightsRequest without a manifest):
encode_chunk writes what protobuf writes with one copy of the data, decode_chunk reads it as protobuf would and
returns the data as a view into the received bytes (rlfabric.weight_sync.grpc_stream)."""

from __future__ import annotations

from rlfabric.core.codec import varint
from rlfabric.core.errors import InvalidArgument

# RolloutServicePushWeightsRequest field numbers and wire types (rollout.proto).
_MANIFEST, _BUCKET_INDEX, _OFFSET, _DATA = 1, 2, 3, 4
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
INVALID_CHUNK = "PushWeights chunk is not a valid RolloutServicePushWeightsRequest"


def encode_chunk(bucket_index: int, offset: int, data) -> bytes:
    """RolloutServicePushWeightsRequest(bucket_index, offset, data).SerializeToString(), byte for byte, with one
    copy of `data` (any buffer: bytes, memoryview, a numpy slice)."""
    view = memoryview(data).cast("B")
    header = bytearray()
    if bucket_index:
        header += varint(_BUCKET_INDEX << 3 | _VARINT) + varint(bucket_index)
    if offset:
        header += varint(_OFFSET << 3 | _VARINT) + varint(offset)
    if len(view):
        header += varint(_DATA << 3 | _LEN) + varint(len(view))
    return b"".join((header, view))


def _read_varint(raw: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(raw) or shift > 63:
            raise InvalidArgument(f"{INVALID_CHUNK}: truncated or overlong varint")
        byte = raw[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _signed(value: int, bits: int) -> int:
    """A varint as protobuf reads an int32 / int64 field (two's complement, truncated)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def decode_chunk(raw: bytes) -> tuple[int, int, memoryview]:
    """(bucket_index, offset, data) of a serialized RolloutServicePushWeightsRequest chunk, as protobuf would read
    it (fields in any order, the last of a repeated scalar wins, unknown fields skipped); data is a
    view into `raw`. InvalidArgument for malformed bytes, or a chunk that carries a manifest."""
    bucket_index = offset = 0
    data = memoryview(b"")
    position, end = 0, len(raw)
    while position < end:
        key, position = _read_varint(raw, position)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise InvalidArgument(f"{INVALID_CHUNK}: field number 0")
        if wire == _VARINT:
            value, position = _read_varint(raw, position)
            if field == _BUCKET_INDEX:
                bucket_index = _signed(value, 32)
            elif field == _OFFSET:
                offset = _signed(value, 64)
        elif wire == _LEN:
            length, position = _read_varint(raw, position)
            if position + length > end:
                raise InvalidArgument(f"{INVALID_CHUNK}: field {field} runs "
                                      f"{position + length - end} bytes past the message")
            if field == _MANIFEST:
                raise InvalidArgument("PushWeights: only the first message of a stream may carry the manifest")
            if field == _DATA:
                data = memoryview(raw)[position : position + length]
            position += length
        elif wire in (_I64, _I32):
            position += 8 if wire == _I64 else 4
        else:
            raise InvalidArgument(f"{INVALID_CHUNK}: wire type {wire}")
    if position != end:
        raise InvalidArgument(f"{INVALID_CHUNK}: truncated field")
    return bucket_index, offset, data
