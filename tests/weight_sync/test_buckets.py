"""Bucket planning, packing, checksums and manifests: the parts every transport shares."""

from __future__ import annotations

import pytest
import torch

from rlfabric.core.errors import InvalidArgument
from rlfabric.core.weight_sync import BucketAssembler, ChecksumMismatch, Manifest, pack, plan_buckets, unpack
from rlfabric.core.weight_sync.buckets import checksum, dedupe_shared, verify
from rlfabric.core.weight_sync.manifest import ALIGNMENT, SyncGroup
from rlfabric.v1 import weight_sync_pb2

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


def test_assembler_takes_ordered_chunks_and_checks_the_result():
    manifest, buffers = pack(weights(), 50_000, version=1, group_id="g")
    assembler = BucketAssembler(manifest)
    for index, buffer in enumerate(buffers):
        raw = buffer.numpy().tobytes()
        for offset in range(0, len(raw), 7000):
            assembler.add(index, offset, raw[offset : offset + 7000])
    assert torch.equal(dict(assembler.finish())["c.weight"], weights()["c.weight"])

    assembler = BucketAssembler(manifest)
    with pytest.raises(InvalidArgument, match="expected the next"):
        assembler.add(0, 64, b"x" * 64)  # a gap
    with pytest.raises(InvalidArgument, match="bucket 7"):
        assembler.add(7, 0, b"x")
    assembler.add(0, 0, buffers[0].numpy().tobytes())
    with pytest.raises(InvalidArgument, match=r"before bucket\(s\) \[1, 2\]"):
        assembler.finish()

    bad = BucketAssembler(manifest)
    for index, buffer in enumerate(buffers):
        raw = bytearray(buffer.numpy().tobytes())
        raw[-1] ^= 0xFF if index == 1 else 0
        bad.add(index, 0, bytes(raw))
    with pytest.raises(ChecksumMismatch, match="bucket 1"):
        bad.finish()


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
