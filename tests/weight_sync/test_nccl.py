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
from rlfabric.weight_sync.buckets import pack, unpack, verify
from rlfabric.weight_sync.manifest import SyncGroup
from rlfabric.weight_sync.nccl import (
    UNIQUE_ID_BYTES,
    NcclTransport,
    c_char_is_signed,
    cupy_unique_id,
    encode_unique_id,
)
from rlfabric.weight_sync.sender import WeightSender

HAS_CUPY = importlib.util.find_spec("cupy") is not None


# What cupy's get_unique_id returns: cupy 13 (cupy_backends/cuda/libs/nccl.pyx) a tuple of the 128 C
# chars as ints, negative above 127 where char is signed (x86); cupy 14 the 128 bytes themselves.
ID_BYTES = bytes((i * 37 + 5) % 256 for i in range(UNIQUE_ID_BYTES))  # every byte value class, >127 included
CUPY13_X86 = tuple(b - 256 if b > 127 else b for b in ID_BYTES)
CUPY13_ARM = tuple(ID_BYTES)


def over_the_wire(unique_id) -> bytes:
    group = SyncGroup("g", "nccl", 3, 10.0, nccl_unique_id=encode_unique_id(unique_id))
    wire = weight_sync_pb2.WeightSyncGroup.FromString(group.to_proto().SerializeToString())
    return SyncGroup.from_proto(wire).nccl_unique_id


@pytest.mark.parametrize("made_by", [ID_BYTES, CUPY13_X86, CUPY13_ARM], ids=["cupy14", "cupy13-x86", "cupy13-arm"])
def test_the_unique_id_reaches_each_cupy_in_the_form_its_communicator_takes(made_by):
    data = over_the_wire(made_by)  # the proto's bytes field carries all 128 bytes, zeros and high bytes alike
    assert data == ID_BYTES
    for version in ("14.0.1", "14.2.0", "15.0.0rc1"):  # NcclCommunicator(int ndev, bytes commId, int rank)
        as_taken = cupy_unique_id(data, version)
        assert type(as_taken) is bytes and as_taken == ID_BYTES
    for version in ("13.6.0", "12.3.0"):  # NcclCommunicator(int ndev, tuple commId, int rank), C chars
        assert cupy_unique_id(data, version, char_signed=True) == CUPY13_X86
        assert cupy_unique_id(data, version, char_signed=False) == CUPY13_ARM
        assert all(-128 <= v <= 127 for v in cupy_unique_id(data, version, char_signed=True))
        assert all(0 <= v <= 255 for v in cupy_unique_id(data, version, char_signed=False))


def test_c_char_signedness_follows_the_abi():
    assert c_char_is_signed("x86_64") and c_char_is_signed("AMD64") and c_char_is_signed("i686")
    assert not c_char_is_signed("aarch64") and not c_char_is_signed("ppc64le") and not c_char_is_signed("s390x")


def test_a_unique_id_of_the_wrong_length_is_refused():
    with pytest.raises(FailedPrecondition, match="expected 128"):
        cupy_unique_id(b"short", "14.0.0")
    with pytest.raises(ValueError, match="has 128 bytes, got 5"):
        encode_unique_id(b"short")


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
