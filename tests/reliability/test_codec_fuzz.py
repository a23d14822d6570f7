"""The tensor codec under arbitrary input (tests/core/test_codec.py has the round trips and the
named error cases; this adds what a hostile or broken peer can send):

- random bytes as a Tensor / Batch message;
- arbitrary dtype values, shapes (negative, huge, zero next to huge) and raw bytes;
- chunk streams with chunks dropped, repeated, reordered, cut short or with changed headers.

Decoding either gives exactly what the message describes or raises InvalidArgument; no other
exception, and a chunk stream never reassembles into a tensor other than the one that was sent.
"""

from __future__ import annotations

import math

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfabric.core import codec
from rlfabric.core.errors import InvalidArgument
from rlfabric.v1 import tensor_pb2

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None)

ITEMSIZE = {tensor_pb2.DATA_TYPE_FLOAT32: 4, tensor_pb2.DATA_TYPE_FLOAT16: 2, tensor_pb2.DATA_TYPE_BFLOAT16: 2,
            tensor_pb2.DATA_TYPE_INT64: 8, tensor_pb2.DATA_TYPE_INT32: 4, tensor_pb2.DATA_TYPE_UINT8: 1,
            tensor_pb2.DATA_TYPE_BOOL: 1}
dims = st.one_of(st.integers(0, 4), st.integers(-3, -1), st.sampled_from([2**31, 2**40, 2**40 + 1, 2**62, 2**63 - 1]))
wire_dtypes = st.one_of(st.sampled_from(list(tensor_pb2.DataType.values())), st.integers(-(2**31), 2**31 - 1))


def assert_decodes_as_described(message: tensor_pb2.Tensor) -> None:
    """to_torch / to_numpy give a tensor of the message's dtype and shape, or raise InvalidArgument."""
    try:
        tensor = codec.to_torch(message, name="t")
    except InvalidArgument as error:
        assert str(error).startswith("t: "), error  # the message names the tensor
        return
    shape = tuple(message.shape)
    assert tuple(tensor.shape) == shape
    assert math.prod(shape) * ITEMSIZE[message.dtype] == len(message.raw_data)
    assert codec.wire_dtype(tensor.dtype) == message.dtype
    if message.dtype != tensor_pb2.DATA_TYPE_BFLOAT16:
        assert codec.to_numpy(message).shape == shape


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_as_a_tensor_message(data):
    try:
        message = tensor_pb2.Tensor.FromString(data)
    except DecodeError:
        return  # the gRPC layer answers these with INVALID_ARGUMENT (tests/reliability/test_fuzz_rpcs.py)
    assert_decodes_as_described(message)


@FUZZ
@given(dtype=wire_dtypes, shape=st.lists(dims, max_size=4), raw=st.binary(max_size=64))
def test_arbitrary_tensor_messages(dtype, shape, raw):
    assert_decodes_as_described(tensor_pb2.Tensor(dtype=dtype, shape=shape, raw_data=raw))


@pytest.mark.parametrize("shape", [[0, 2**62], [2**63 - 1, 0], [0, 2**40 + 1, 3], [0, 2**31, 2**31]])
def test_zero_sized_tensor_with_huge_dimensions_is_refused(shape):
    # The element count is 0, yet numpy cannot reshape to [0, 2**31, 2**31] (ValueError, which a
    # service would answer with INTERNAL), and a row count of 2**62 reaching a service is nonsense.
    message = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=shape)
    with pytest.raises(InvalidArgument, match="non-zero dimensions multiply to more than the limit"):
        codec.to_torch(message, name="x")
    batch = tensor_pb2.Batch()
    batch.tensors["x"].CopyFrom(message)
    with pytest.raises(InvalidArgument, match="x: shape"):
        codec.decode_batch(batch, allow_empty=True)
    with pytest.raises(InvalidArgument, match="x: shape"):
        codec.to_numpy(message, name="x")


batches = st.builds(
    lambda tensors, columns: tensor_pb2.Batch(tensors=tensors, columns=columns),
    st.dictionaries(st.text(max_size=8), st.builds(tensor_pb2.Tensor, dtype=wire_dtypes, shape=st.lists(dims, max_size=3),
                                                   raw_data=st.binary(max_size=32)), max_size=3),
    st.dictionaries(st.text(max_size=8), st.builds(tensor_pb2.StringColumn, values=st.lists(st.text(max_size=5), max_size=3)),
                    max_size=2),
)


@FUZZ
@given(batch=st.one_of(batches, st.binary(max_size=200)), allow_empty=st.booleans())
def test_arbitrary_batches(batch, allow_empty):
    if isinstance(batch, bytes):
        try:
            batch = tensor_pb2.Batch.FromString(batch)
        except DecodeError:
            return
    try:
        decoded = codec.decode_batch(batch, allow_empty=allow_empty)
    except InvalidArgument:
        return
    rows = {t.shape[0] for t in decoded.tensors.values()} | {len(c) for c in decoded.columns.values()}
    assert rows <= {decoded.num_rows}
    assert decoded.num_rows > 0 or allow_empty


# --- chunk streams -----------------------------------------------------------------------------------


def _stream(numel: int, chunk_bytes: int) -> tuple[torch.Tensor, list[tensor_pb2.TensorChunk]]:
    value = torch.arange(numel, dtype=torch.float32)  # (numel,)
    return value, list(codec.iter_chunks("w", value, chunk_bytes=chunk_bytes))


def _mutate(chunks: list[tensor_pb2.TensorChunk], edit) -> list[tensor_pb2.TensorChunk]:
    kind, where, amount = edit
    chunks = [tensor_pb2.TensorChunk.FromString(c.SerializeToString()) for c in chunks]
    if not chunks:
        return chunks
    i = where % len(chunks)
    if kind == "drop":
        del chunks[i]
    elif kind == "repeat":
        chunks.insert(i, chunks[i])
    elif kind == "swap":
        j = (i + 1 + amount) % len(chunks)
        chunks[i], chunks[j] = chunks[j], chunks[i]
    elif kind == "cut":
        chunks[i].data = chunks[i].data[: max(0, len(chunks[i].data) - 1 - amount)]
    elif kind == "offset":
        chunks[i].offset += amount - 8
    elif kind == "total":
        chunks[i].total_bytes += amount - 8
    elif kind == "shape":
        chunks[i].shape[0] += amount - 8
    elif kind == "dtype":
        chunks[i].dtype = amount % 9
    elif kind == "name":
        chunks[i].name = "v"
    return chunks


chunk_edits = st.tuples(st.sampled_from(["drop", "repeat", "swap", "cut", "offset", "total", "shape", "dtype", "name"]),
                        st.integers(0, 50), st.integers(0, 16))


@FUZZ
@given(numel=st.integers(0, 40), chunk_bytes=st.integers(1, 48), edits=st.lists(chunk_edits, min_size=1, max_size=3))
def test_inconsistent_chunk_streams_never_assemble_a_wrong_tensor(numel, chunk_bytes, edits):
    value, chunks = _stream(numel, chunk_bytes)
    for edit in edits:
        chunks = _mutate(chunks, edit)
    assembler = codec.ChunkAssembler()
    try:
        done = [result for chunk in chunks if (result := assembler.feed(chunk)) is not None]
    except InvalidArgument:
        return
    # What did assemble holds exactly the bytes that were sent, in order, whatever its headers now say
    # (an edit can leave a valid stream: a one-chunk stream renamed, or relabelled int32).
    sent = value.view(torch.uint8)
    for _, tensor in done:
        assert torch.equal(tensor.contiguous().reshape(-1).view(torch.uint8), sent), (edits, tensor)


def test_a_stream_announcing_more_than_the_limit_is_refused():
    assembler = codec.ChunkAssembler(max_total_bytes=1024)
    chunk = tensor_pb2.TensorChunk(name="w", dtype=tensor_pb2.DATA_TYPE_UINT8, shape=[2048], total_bytes=2048, data=b"")
    with pytest.raises(InvalidArgument, match="announces 2048 bytes"):
        assembler.feed(chunk)
    huge = tensor_pb2.TensorChunk(name="w", dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[2**62, 0], total_bytes=0)
    with pytest.raises(InvalidArgument):  # a zero-byte stream cannot smuggle a 2**62-row shape either
        codec.ChunkAssembler().feed(huge)
