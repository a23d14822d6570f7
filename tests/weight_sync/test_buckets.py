"""Bucket planning, packing, checksums, manifests and their limits, the grpc chunk format: the parts
every transport shares."""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest
import torch

from rlfabric.core.errors import InvalidArgument, ResourceExhausted
from rlfabric.v1 import rollout_pb2, weight_sync_pb2
from rlfabric.weight_sync.buckets import (
    ChecksumMismatch,
    checksum,
    crc32,
    crc32_combine,
    dedupe_shared,
    pack,
    plan_buckets,
    unpack,
    verify,
)
from rlfabric.weight_sync.grpc_stream import PushPayload, decode_chunk, encode_chunk, serialize_chunks
from rlfabric.weight_sync.manifest import ALIGNMENT, Manifest, SyncGroup, WeightLimits
from rlfabric.weight_sync.receiver import BucketAssembler

MIB = 1 << 20


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(300, 7, generator=g),  # 8400 bytes
        "b.bias": torch.randn(5, generator=g),  # 20 bytes: the next tensor starts aligned
        "c.weight": torch.randn(100, 100, generator=g),  # 40000 bytes
        "big.weight": torch.randn(200, 200, generator=g),  # 160000 bytes: larger than a bucket
        "steps": torch.arange(3),  # int64: never cast
    }


def test_plan_fills_buckets_in_order_and_gives_a_large_tensor_its_own():
    buckets = plan_buckets(weights(), bucket_bytes=50_000)
    assert [[t.name for t in b.tensors] for b in buckets] == [["a.weight", "b.bias", "c.weight"], ["big.weight"],
                                                              ["steps"]]
    first = buckets[0].tensors
    assert [t.offset for t in first] == [0, 8448, 8512]  # 64-byte aligned starts
    assert all(t.offset % ALIGNMENT == 0 for b in buckets for t in b.tensors)
    assert buckets[1].num_bytes == 160_000 and [b.index for b in buckets] == [0, 1, 2]


def test_pack_unpack_round_trips_and_casts_floats_only():
    state = weights()
    manifest, buffers = pack(state, 50_000, version=3, group_id="g", dtype=torch.bfloat16)
    # bfloat16 halves the floats: a 4200 + b 10 + c 20000 bytes (64-aligned starts), big 80000, steps 24 (int64)
    assert [b.num_bytes for b in manifest.buckets] == [b.numel() for b in buffers] == [24320, 80000, 64]
    received = dict(unpack([b.clone() for b in buffers], manifest))
    for name, value in state.items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert received[name].dtype == expected.dtype and torch.equal(received[name], expected), name


def test_checksum_mismatch_is_rejected():
    manifest, buffers = pack(weights(), MIB, version=1, group_id="g")
    verify(buffers[0], manifest.buckets[0])
    buffers[0][100] ^= 1  # one flipped bit
    with pytest.raises(ChecksumMismatch, match="update rejected") as info:
        verify(buffers[0], manifest.buckets[0])
    assert isinstance(info.value, InvalidArgument)


def test_manifest_proto_round_trip():
    manifest, buffers = pack(weights(), 50_000, version=9, group_id="grp", dtype=torch.float16)
    again = Manifest.from_proto(weight_sync_pb2.WeightManifest.FromString(manifest.to_proto().SerializeToString()))
    assert again == manifest
    assert [b.crc32 for b in again.buckets] == [checksum(b) for b in buffers]


@pytest.mark.parametrize("tamper, phrase", [
    (lambda m: m.buckets[0].tensors[0].__setattr__("offset", 10), "misaligned"),
    (lambda m: m.buckets[0].tensors[1].__setattr__("offset", 1 << 20), "outside the bucket"),
    (lambda m: m.buckets[0].tensors[1].__setattr__("name", "a.weight"), "repeated name"),
    (lambda m: m.buckets[1].__setattr__("index", 5), "has index 5"),
    (lambda m: m.buckets[0].tensors[0].__setattr__("dtype", 0), "unspecified tensor dtype"),
    (lambda m: m.ClearField("buckets"), "no buckets"),
])
def test_a_bad_manifest_is_invalid_argument(tamper, phrase):
    manifest, _ = pack(weights(), 50_000, version=1, group_id="g")
    message = manifest.to_proto()
    tamper(message)
    with pytest.raises(InvalidArgument, match=phrase):
        Manifest.from_proto(message)


def test_group_proto_checks():
    group = SyncGroup("g1", "gloo", 3, 5.0, store_host="127.0.0.1", store_port=1234)
    assert SyncGroup.from_proto(group.to_proto()) == group
    with pytest.raises(InvalidArgument, match="store_host and store_port"):
        SyncGroup.from_proto(SyncGroup("g1", "gloo", 3, 5.0).to_proto())
    with pytest.raises(InvalidArgument, match="nccl_unique_id"):
        SyncGroup.from_proto(SyncGroup("g1", "nccl", 3, 5.0).to_proto())
    with pytest.raises(InvalidArgument, match="rank 3 outside 1..2"):
        group.check_rank(3)


def test_tied_tensors_travel_once():
    embed = torch.randn(10, 4)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "norm.weight": torch.ones(4)}
    assert list(dedupe_shared(state)) == ["model.embed_tokens.weight", "norm.weight"]


def test_assembler_takes_chunks_in_any_order_and_checks_each_bucket_as_it_completes():
    manifest, buffers = pack(weights(), 50_000, version=1, group_id="g")
    pieces = [(index, offset, buffer.numpy().tobytes()[offset : offset + 7000])
              for index, buffer in enumerate(buffers) for offset in range(0, buffer.numel(), 7000)]
    assembler = BucketAssembler(manifest)
    for piece in pieces[1::2] + pieces[::2]:  # as two streams would deliver them, one after the other
        assert not assembler.complete
        assembler.add(*piece)
    assert assembler.complete
    assert torch.equal(dict(assembler.finish())["c.weight"], weights()["c.weight"])

    assembler = BucketAssembler(manifest)
    assembler.add(0, 64, b"x" * 64)  # a gap before it is fine: another stream fills it
    with pytest.raises(InvalidArgument, match="overlapping"):
        assembler.add(0, 0, b"x" * 65)
    with pytest.raises(InvalidArgument, match="overlapping"):
        assembler.add(0, 64, b"x")  # the same bytes twice
    with pytest.raises(InvalidArgument, match="outside the bucket"):
        assembler.add(2, 60, b"x" * 8)
    with pytest.raises(InvalidArgument, match="bucket 7"):
        assembler.add(7, 0, b"x")
    assembler.add(1, 0, buffers[1].numpy().tobytes())
    with pytest.raises(InvalidArgument, match=r"before bucket\(s\) \[0, 2\]"):
        assembler.finish()

    bad = BucketAssembler(manifest)
    bad.add(0, 0, buffers[0].numpy().tobytes())
    raw = bytearray(buffers[1].numpy().tobytes())
    raw[-1] ^= 0xFF
    bad.add(1, 40_000, bytes(raw[40_000:]))
    with pytest.raises(ChecksumMismatch, match="bucket 1"):  # as soon as its last chunk lands
        bad.add(1, 0, bytes(raw[:40_000]))


def test_crc32_combine_matches_zlib():
    rng = random.Random(0)
    for _ in range(50):
        a, b = rng.randbytes(rng.randrange(0, 300)), rng.randbytes(rng.randrange(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        assert crc32(a + b) == zlib.crc32(a + b)  # the fast CRC-32, when installed, is zlib's


def test_chunks_encode_as_protobuf_does_and_decode_as_it_reads():
    for index, offset, data in [(0, 0, b"abc"), (3, 1 << 33, b"\x00" * 300), (0, 5, b""), (2**31 - 1, 0, b"z")]:
        chunk = rollout_pb2.RolloutServicePushWeightsRequest(bucket_index=index, offset=offset, data=data)
        expected = chunk.SerializeToString()
        assert encode_chunk(index, offset, memoryview(data)) == expected
        assert decode_chunk(expected)[:2] == (index, offset) and bytes(decode_chunk(expected)[2]) == data
    # fields in another order, repeated (the last wins), unknown ones skipped, negative int32
    message = rollout_pb2.RolloutServicePushWeightsRequest(data=b"first").SerializeToString() + \
        rollout_pb2.RolloutServicePushWeightsRequest(bucket_index=-2, offset=7, data=b"last").SerializeToString() + \
        b"\x28\x05" + b"\x3a\x02hi" + b"\x45\x00\x00\x00\x00"  # field 5 varint, 7 bytes, 8 fixed32
    parsed = rollout_pb2.RolloutServicePushWeightsRequest.FromString(message)
    index, offset, data = decode_chunk(message)
    assert (index, offset, bytes(data)) == (parsed.bucket_index, parsed.offset, parsed.data) == (-2, 7, b"last")
    manifest, _ = pack(weights(), 50_000, version=1, group_id="g")
    manifest_message = rollout_pb2.RolloutServicePushWeightsRequest(manifest=manifest.to_proto()).SerializeToString()
    for bad, phrase in [(b"\x22\x05ab", "past the message"), (b"\x10", "varint"), (b"\x13", "wire type 3"),
                        (b"\x00\x01", "field number 0"), (b"\x45\x00", "truncated field"),
                        (manifest_message, "manifest")]:
        with pytest.raises(InvalidArgument, match=phrase):
            decode_chunk(bad)


def test_a_bucket_larger_than_its_tensors_is_refused():
    manifest, _ = pack(weights(), 50_000, version=1, group_id="g")
    message = manifest.to_proto()
    message.buckets[2].num_bytes = 2**45  # "steps": 24 bytes, aligned 64
    with pytest.raises(InvalidArgument, match="bucket 2 announces 35184372088832 bytes but its 1 tensor"):
        Manifest.from_proto(message)


def test_weight_limits_hold_a_manifest_to_the_receivers_own_weights():
    state = weights()
    manifest, _ = pack(state, 50_000, version=1, group_id="g", dtype=torch.bfloat16)
    limits = WeightLimits.of(state, "the test model")
    limits.check(manifest)  # floats may arrive cast
    with pytest.raises(InvalidArgument, match="'big.weight': the test model has no weight of that name"):
        WeightLimits.of({k: v for k, v in state.items() if k != "big.weight"}, "the test model").check(manifest)
    with pytest.raises(InvalidArgument, match=r"'c.weight': shape \(100, 100\), the test model's is \(10, 1000\)"):
        WeightLimits.of({**state, "c.weight": torch.zeros(10, 1000)}, "the test model").check(manifest)
    with pytest.raises(InvalidArgument, match="'steps': dtype torch.int64 where the test model has torch.float32"):
        WeightLimits.of({**state, "steps": torch.zeros(3)}, "the test model").check(manifest)
    with pytest.raises(ResourceExhausted, match="weights take at most 416960"):
        WeightLimits({name: tuple(t.shape) for name, t in state.items()}).check(
            dataclasses.replace(manifest, buckets=manifest.buckets * 40))  # the same names again and again
    assert limits.max_bytes >= sum(t.numel() * 8 for t in state.values())


def test_weight_limits_from_a_checkpoint_read_its_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, 3), "n": torch.arange(4)}, str(tmp_path / "model.safetensors"))
    limits = WeightLimits.from_checkpoint(str(tmp_path))
    assert limits.shapes == {"a": (2, 3), "n": (4,)} and limits.dtypes == {"a": torch.float32, "n": torch.int64}
    assert WeightLimits.from_checkpoint(str(tmp_path / "missing")) is None
    assert WeightLimits.from_checkpoint("org/hub-model") is None


def test_a_second_pack_of_the_same_plan_reuses_the_buffers():
    state = weights()
    first, buffers = pack(state, 50_000, version=1, group_id="g")
    state = {name: value + 1 if value.is_floating_point() else value for name, value in state.items()}
    second, again = pack(state, 50_000, version=2, group_id="g", reuse=first, buffers=buffers)
    assert all(a is b for a, b in zip(again, buffers, strict=True))
    assert torch.equal(dict(unpack(again, second))["c.weight"], state["c.weight"])
    assert [b.crc32 for b in second.buckets] != [b.crc32 for b in first.buckets]
    other, fresh = pack({"x": torch.ones(3)}, 50_000, version=3, group_id="g", reuse=second, buffers=again)
    assert fresh[0] is not again[0] and dict(unpack(fresh, other))["x"].tolist() == [1.0, 1.0, 1.0]


def test_a_push_payload_encodes_each_chunk_once_for_all_receivers():
    manifest, buffers = pack(weights(), 50_000, version=1, group_id="g")
    whole = serialize_chunks(manifest, buffers, chunk_bytes=7000)
    assert [decode_chunk(m)[:2] for m in whole[1:3]] == [(0, 0), (0, 7000)]
    payload = PushPayload(manifest, buffers, chunk_bytes=7000, receivers=2)
    first = [list(payload.stream(lane, 3)) for lane in range(3)]  # one receiver's three streams
    assert all(stream[0] == whole[0] for stream in first)
    assert sorted(m for stream in first for m in stream[1:]) == sorted(whole[1:])
    assert len(payload._encoded) == len(whole) - 1  # held for the other receiver
    assert [list(payload.stream(lane, 3)) for lane in range(3)] == first
    assert not payload._encoded  # dropped once both took them


def test_dense_buckets_hold_their_tensors_back_to_back_as_sglang_unpacks_them():
    tensors = {"a": torch.randn(3), "b": torch.randn(2, 5), "c": torch.arange(3, dtype=torch.int64)}
    manifest, buffers = pack(tensors, 1 << 20, 1, "g", dtype=torch.bfloat16, dense=True)
    (bucket,) = manifest.buckets
    # a and b in bfloat16 end at byte 26; c (int64) starts at its element size's next multiple, 32.
    assert [t.offset for t in bucket.tensors] == [0, 6, 32] and bucket.num_bytes == 56
    received = dict(unpack(buffers, manifest))
    assert torch.equal(received["b"], tensors["b"].to(torch.bfloat16)) and torch.equal(received["c"], tensors["c"])


def test_a_torch_group_carries_its_store_and_cannot_be_grpc():
    group = SyncGroup("g", "nccl", 2, 5.0, store_host="10.0.0.2", store_port=4000, torch_group=True)
    assert SyncGroup.from_proto(group.to_proto()) == group  # no nccl_unique_id needed
    with pytest.raises(InvalidArgument, match="cannot be a torch_group"):
        SyncGroup.from_proto(dataclasses.replace(group, transport="grpc").to_proto())
    with pytest.raises(InvalidArgument, match="needs store_host and store_port"):
        SyncGroup.from_proto(dataclasses.replace(group, store_port=0).to_proto())
