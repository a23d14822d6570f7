"""Tensor codec: round trips (hypothesis), validation errors, batches, chunked streams."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfabric.core import codec
from rlfabric.core.errors import InvalidArgument
from rlfabric.v1 import actor_pb2, common_pb2, tensor_pb2

TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


def _random_tensor(dtype: torch.dtype, shape: list[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), shape, generator=generator, dtype=dtype)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(TORCH_DTYPES), shape=shapes, seed=st.integers(0, 2**31))
def test_torch_round_trip_is_exact(dtype, shape, seed):
    value = _random_tensor(dtype, shape, seed)
    message = tensor_pb2.Tensor.FromString(codec.encode(value).SerializeToString())
    decoded = codec.to_torch(message)
    assert decoded.dtype == dtype and tuple(decoded.shape) == tuple(shape)
    assert torch.equal(decoded, value)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(["<f4", "<f2", "<i8", "<i4", "u1", "?", ">f4", ">i8"]), shape=shapes,
       seed=st.integers(0, 2**31))
def test_numpy_round_trip_including_big_endian_input(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    value = (rng.standard_normal(shape) * 100).astype(dtype)
    decoded = codec.to_numpy(codec.encode(value))
    assert decoded.dtype.byteorder in ("<", "=", "|")
    np.testing.assert_array_equal(decoded, value)


def test_non_contiguous_and_sliced_tensors_encode_their_values():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base.t()[1:5, ::2]
    assert torch.equal(codec.to_torch(codec.encode(view)), view)


def test_decode_shares_the_message_bytes_unless_copy():
    message = codec.encode(torch.arange(1000, dtype=torch.int64))
    shared = codec.to_torch(message)
    copied = codec.to_torch(message, copy=True)
    assert shared.data_ptr() != copied.data_ptr()
    # The zero-copy view points into the message's bytes buffer (no per-element decode).
    array = codec.to_numpy(message)
    assert not array.flags.writeable and not array.flags.owndata


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda m: setattr(m, "raw_data", m.raw_data[:-1]), "raw_data has 23 bytes but shape"),
        (lambda m: setattr(m, "dtype", 0), "unknown or unspecified tensor dtype DATA_TYPE_UNSPECIFIED"),
        (lambda m: setattr(m, "dtype", 42), "unknown or unspecified tensor dtype 42"),
        (lambda m: m.shape.__setitem__(0, -2), "negative dimension"),
        (lambda m: m.shape.extend([1 << 30, 1 << 30]), "more than the limit"),
    ],
)
def test_invalid_tensor_messages_raise_invalid_argument(mutate, match):
    message = codec.encode(torch.zeros(2, 3, dtype=torch.float32))
    mutate(message)
    with pytest.raises(InvalidArgument, match=match):
        codec.to_torch(message, name="x")


def test_unsupported_dtypes_are_rejected_on_encode():
    with pytest.raises(InvalidArgument, match="unsupported tensor dtype torch.complex64"):
        codec.encode(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(InvalidArgument, match="unsupported array dtype"):
        codec.encode(np.zeros(2, dtype=np.float64))


def test_bfloat16_has_no_numpy_decode():
    with pytest.raises(InvalidArgument, match="decode it with to_torch"):
        codec.to_numpy(codec.encode(torch.zeros(2, dtype=torch.bfloat16)))


def test_batch_round_trip_and_validation():
    batch = codec.encode_batch(
        {"input_ids": torch.ones(3, 4, dtype=torch.int64), "mask": torch.ones(3, 4, dtype=torch.bool)},
        {"data_source": ["a", "b", "c"]},
    )
    decoded = codec.decode_batch(batch, required=["input_ids"], optional=["mask"])
    assert decoded.num_rows == 3 and decoded.columns["data_source"] == ["a", "b", "c"]
    with pytest.raises(InvalidArgument, match=r"missing tensor\(s\) \['advantages'\]"):
        codec.decode_batch(batch, required=["input_ids", "advantages"])
    with pytest.raises(InvalidArgument, match=r"unexpected tensor\(s\) \['mask'\]"):
        codec.decode_batch(batch, required=["input_ids"])
    batch.columns["data_source"].values.append("d")
    with pytest.raises(InvalidArgument, match="disagree on the row count"):
        codec.decode_batch(batch)
    with pytest.raises(InvalidArgument, match="batch is empty"):
        codec.decode_batch(codec.encode_batch({"x": torch.zeros(0, 2)}))
    with pytest.raises(InvalidArgument, match="scalars"):
        codec.decode_batch(codec.encode_batch({"x": torch.tensor(1.0)}))


@settings(max_examples=30, deadline=None)
@given(dtypes=st.lists(st.sampled_from(TORCH_DTYPES), min_size=0, max_size=4), rows=st.integers(0, 4),
       seed=st.integers(0, 2**31))
def test_a_request_serialized_with_its_batch_parses_as_the_protobuf_built_one(dtypes, rows, seed):
    tensors = {f"t{i}": _random_tensor(dtype, [rows, 3], seed + i) for i, dtype in enumerate(dtypes)}
    tensors["view"] = torch.arange(rows * 6).reshape(rows, 6)[:, ::2]  # not contiguous
    tensors["big_endian"] = np.arange(rows * 2, dtype=">i8").reshape(rows, 2)
    update = actor_pb2.ActorServiceUpdatePolicyRequest(global_step=7)
    built = actor_pb2.ActorServiceUpdatePolicyRequest(global_step=7)
    codec.encode_batch(tensors, out=built.batch)
    assert actor_pb2.ActorServiceUpdatePolicyRequest.FromString(
        codec.serialized_with_batch(update, ("batch",), tensors)) == built
    nested = actor_pb2.ActorServiceComputeLogProbsRequest(input=common_pb2.LogProbsInput(temperature=0.5, base_model=True))
    built = actor_pb2.ActorServiceComputeLogProbsRequest()
    built.input.CopyFrom(nested.input)
    codec.encode_batch(tensors, out=built.input.batch)
    assert actor_pb2.ActorServiceComputeLogProbsRequest.FromString(
        codec.serialized_with_batch(nested, ("input", "batch"), tensors)) == built


@settings(max_examples=30, deadline=None)
@given(numel=st.integers(0, 3000), chunk=st.integers(1, 5000), dtype=st.sampled_from(TORCH_DTYPES))
def test_chunked_stream_round_trip(numel, chunk, dtype):
    value = _random_tensor(dtype, [numel], seed=numel)
    chunks = list(codec.iter_chunks("w", value, chunk_bytes=chunk))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    assert len(chunks) == max(1, -(-numel * itemsize // chunk))
    assert all(len(c.data) <= chunk for c in chunks)
    assembler = codec.ChunkAssembler()
    results = [assembler.feed(c) for c in chunks]
    assert all(r is None for r in results[:-1])
    name, tensor = results[-1]
    assert name == "w" and torch.equal(tensor, value) and assembler.incomplete == []


def test_interleaved_streams_and_chunk_errors():
    a = list(codec.iter_chunks("a", torch.arange(10.0), chunk_bytes=16))
    b = list(codec.iter_chunks("b", torch.arange(6, dtype=torch.int64), chunk_bytes=16))
    assembler = codec.ChunkAssembler()
    done = {}
    for pair in zip(a, b, strict=False):
        for chunk in pair:
            result = assembler.feed(chunk)
            if result:
                done[result[0]] = result[1]
    for chunk in a[len(b):]:
        result = assembler.feed(chunk)
        if result:
            done[result[0]] = result[1]
    assert torch.equal(done["a"], torch.arange(10.0)) and torch.equal(done["b"], torch.arange(6))

    fresh = codec.ChunkAssembler()
    with pytest.raises(InvalidArgument, match="starts at offset 16"):
        fresh.feed(a[1])
    fresh.feed(a[0])
    with pytest.raises(InvalidArgument, match="expected 16"):
        fresh.feed(a[2])
    lying = tensor_pb2.TensorChunk(name="c", dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[4], total_bytes=8, data=b"")
    with pytest.raises(InvalidArgument, match="does not match shape"):
        fresh.feed(lying)
    with pytest.raises(InvalidArgument, match="chunk_bytes must be positive"):
        list(codec.iter_chunks("x", torch.zeros(1), chunk_bytes=0))
