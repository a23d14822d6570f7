"""The NCCL transport. Without a GPU (CI): the unique-id plumbing through the control plane and the
errors a CPU-only or cupy-less host gives. On a GPU machine (`gpu` marker): a real cupy NCCL
communicator moving packed buckets; NCCL refuses two ranks on one GPU, so a 2-rank group needs 2 GPUs,
and with one GPU the test runs a 1-rank communicator through the same bucket path."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from rlfabric.core.errors import FailedPrecondition
from rlfabric.v1 import weight_sync_pb2
from rlfabric.weight_sync import SyncGroup, pack, unpack
from rlfabric.weight_sync.buckets import verify
from rlfabric.weight_sync.nccl import UNIQUE_ID_BYTES, NcclTransport, decode_unique_id, encode_unique_id
from rlfabric.weight_sync.sender import WeightSender

HAS_CUPY = importlib.util.find_spec("cupy") is not None


def test_unique_id_round_trips_through_the_group_proto():
    unique_id = tuple((i * 37) % 256 - 128 for i in range(UNIQUE_ID_BYTES))  # cupy's signed chars
    group = SyncGroup("g", "nccl", 3, 10.0, nccl_unique_id=encode_unique_id(unique_id))
    wire = weight_sync_pb2.WeightSyncGroup.FromString(group.to_proto().SerializeToString())
    assert decode_unique_id(SyncGroup.from_proto(wire).nccl_unique_id) == unique_id
    with pytest.raises(FailedPrecondition, match="expected 128"):
        decode_unique_id(b"short")


def test_a_cpu_rank_cannot_join_an_nccl_group():
    group = SyncGroup("g", "nccl", 2, 1.0, nccl_unique_id=bytes(UNIQUE_ID_BYTES))
    with pytest.raises(FailedPrecondition, match="needs a CUDA device"):
        NcclTransport(group, 1, torch.device("cpu"))
    with pytest.raises(FailedPrecondition, match="needs the actor on a CUDA device"):
        WeightSender("127.0.0.1", torch.device("cpu")).open("nccl", 1)


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed here")
def test_without_cupy_the_error_says_what_to_install():
    group = SyncGroup("g", "nccl", 2, 1.0, nccl_unique_id=bytes(UNIQUE_ID_BYTES))
    with pytest.raises(FailedPrecondition, match="needs cupy"):
        NcclTransport(group, 1, torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_CUPY), reason="needs a CUDA GPU and cupy")
def test_nccl_broadcast_of_packed_buckets():
    from rlfabric.weight_sync.nccl import new_unique_id

    world = min(torch.cuda.device_count(), 2)
    state = {"w": torch.randn(1000, 100), "b": torch.randn(100)}
    manifest, buffers = pack(state, 100_000, version=1, group_id="g", dtype=torch.bfloat16)
    group = SyncGroup("g", "nccl", world, 30.0, nccl_unique_id=new_unique_id())
    received: dict[int, list[torch.Tensor]] = {}

    def rank(r: int) -> None:
        device = torch.device("cuda", r)
        transport = NcclTransport(group, r, device)
        out = []
        for buffer, bucket in zip(buffers, manifest.buckets, strict=True):
            data = buffer.to(device) if r == 0 else torch.empty(bucket.num_bytes, dtype=torch.uint8, device=device)
            transport.broadcast(data)
            verify(data, bucket)
            out.append(data)
        received[r] = out
        transport.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(received) == list(range(world))
    weights = dict(unpack(received[world - 1], manifest))
    assert torch.equal(weights["w"].cpu(), state["w"].to(torch.bfloat16))
