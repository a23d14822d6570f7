"""The pipelined sync (rlfabric.weight_sync.pipeline): bucket k+1 is packed while bucket k is on the wire, with
two staging buffers at most; CRC-32s taken while packing match zlib's over the bytes sent; either side that
fails stops the other at once, and a stuck side fails at the timeout. Then the actor's whole path over a real
gloo group (WeightSender and a WeightReceiver in this process): the bytes, the CRC-32s after the last bucket,
the phases, and a sync refused before anything is sent."""

from __future__ import annotations

import asyncio
import threading
import time
import zlib

import pytest
import torch

from rlfabric.core.errors import Aborted, DeadlineExceeded, FailedPrecondition
from rlfabric.weight_sync.buckets import (
    ChecksumMismatch,
    crc_buffer,
    crcs_of_buffer,
    pack_bucket,
    pack_checksummed,
    plan_buckets,
)
from rlfabric.weight_sync.phases import PhaseClock, SyncPhases
from rlfabric.weight_sync.pipeline import Pipeline, staging_buffers
from rlfabric.weight_sync.receiver import WeightReceiver
from rlfabric.weight_sync.sender import WeightSender

STATE = {f"layer{i}.weight": torch.randn(64, 100 + i, generator=torch.Generator().manual_seed(i)) for i in range(12)}
BUCKET_BYTES = 64 * 110 * 4 * 2  # about two tensors a bucket: 7 buckets


def plan():
    return plan_buckets(STATE, BUCKET_BYTES)


def test_packing_into_a_used_staging_buffer_gives_the_bytes_and_crc_of_a_fresh_pack():
    staging = torch.full((max(b.num_bytes for b in plan()),), 0xAB, dtype=torch.uint8)  # an earlier bucket's bytes
    clock = PhaseClock()
    for spec in plan():
        crc = pack_checksummed(spec, STATE, staging[: spec.num_bytes], clock)
        fresh = pack_bucket(spec, STATE)
        assert torch.equal(staging[: spec.num_bytes], fresh)  # padding zeroed, not left over
        assert crc == zlib.crc32(fresh.numpy().tobytes())
    assert clock.phases().pack > 0 and clock.phases().checksum > 0
    assert pack_checksummed(plan()[0], STATE, staging[: plan()[0].num_bytes], checksums=False) == 0


def test_the_crc32s_after_the_buckets_round_trip():
    crcs = [0, 1, 0xFFFFFFFF, 0x12345678]
    assert crcs_of_buffer(crc_buffer(crcs)) == crcs and crc_buffer(crcs).numel() == 16


def test_bucket_k_plus_1_is_packed_while_k_is_on_the_wire_with_two_buffers_at_most():
    staging = staging_buffers(plan(), torch.device("cpu"))
    pipeline = Pipeline(staging, timeout_s=10)
    wire_holds_bucket_0, release = threading.Event(), threading.Event()
    sent: list[tuple[int, bytes]] = []

    def send(staged):
        if staged.spec.index == 0:
            wire_holds_bucket_0.set()
            release.wait(10)
        sent.append((staged.spec.index, staged.buffer.numpy().tobytes()))

    packer = threading.Thread(target=pipeline.pack_all, args=(plan(), STATE))
    packer.start()
    crcs: list = []
    wire = threading.Thread(target=lambda: crcs.extend(pipeline.send_all(send)))
    wire.start()
    assert wire_holds_bucket_0.wait(10)
    deadline = time.monotonic() + 10
    while pipeline._ready.qsize() < 1 and time.monotonic() < deadline:  # bucket 1 gets packed meanwhile
        time.sleep(0.01)
    time.sleep(0.2)  # ... and nothing more: no third buffer to pack bucket 2 into
    assert pipeline._ready.qsize() == 1 and pipeline._free.empty()
    release.set()
    packer.join(10)
    wire.join(10)
    assert [index for index, _ in sent] == list(range(len(plan())))
    assert all(data == pack_bucket(spec, STATE).numpy().tobytes() for (_, data), spec in zip(sent, plan(), strict=True))
    assert crcs == [zlib.crc32(data) for _, data in sent]


def test_a_failing_wire_stops_the_packer_and_a_failing_packer_stops_the_wire():
    pipeline = Pipeline(staging_buffers(plan(), torch.device("cpu")), timeout_s=30)

    def broken(staged):
        raise ConnectionError("peer gone")

    packer = threading.Thread(target=lambda: pytest.raises(Aborted, pipeline.pack_all, plan(), STATE))
    packer.start()
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        pipeline.send_all(broken)
    packer.join(5)
    assert not packer.is_alive() and time.monotonic() - started < 5  # not the 30 s timeout

    pipeline = Pipeline(staging_buffers(plan(), torch.device("cpu")), timeout_s=30)
    packing = threading.Thread(target=lambda: pytest.raises(KeyError, pipeline.pack_all, plan(), {}))
    packing.start()
    with pytest.raises(Aborted, match="the other side failed"):
        pipeline.send_all(lambda staged: None)
    packing.join(5)
    assert not packing.is_alive() and time.monotonic() - started < 10


def test_a_stuck_wire_fails_the_packer_at_the_timeout():
    pipeline = Pipeline(staging_buffers(plan(), torch.device("cpu")), timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="no a free staging buffer"):
        pipeline.pack_all(plan(), STATE)  # nobody sends: after two buckets there is no free buffer
    assert 1.0 <= time.monotonic() - started < 5


# -- the actor's side over a real gloo group ---------------------------------------------------------------------

def sync_over_gloo(sender: WeightSender, version: int, before_pack=None):
    """One receiver in a thread of this process: (BroadcastResult or its error, the receiver's weights or error,
    the receiver's phases)."""
    group = sender.open("gloo", 1, bucket_bytes=BUCKET_BYTES, timeout_s=5.0)
    joined: list = []
    joining = threading.Thread(target=lambda: joined.append(WeightReceiver(group, 1)))
    joining.start()
    manifest = sender.prepare(group.group_id, version, STATE, gather_s=0.5)
    clock, received = PhaseClock(), []

    def receive():
        joining.join()
        try:
            received.append(dict(joined[0].receive(manifest, clock)))
        except Exception as error:
            received.append(error)

    receiving = threading.Thread(target=receive)
    receiving.start()
    try:
        result = asyncio.run(sender.broadcast(group.group_id, version, before_pack=before_pack))
    except Exception as error:
        result = error
    receiving.join(30)
    joined[0].close()
    return result, received[0], clock.phases(), manifest


def test_a_pipelined_gloo_sync_moves_every_byte_and_checks_the_crc32s_that_follow_the_buckets():
    sender = WeightSender("127.0.0.1", torch.device("cpu"), timeout_s=5.0)
    try:
        result, received, phases, manifest = sync_over_gloo(sender, 1)
    finally:
        sender.close_all()
    assert len(manifest.buckets) == len(plan()) > 2 and all(b.crc32 == 0 for b in manifest.buckets)  # they follow the buckets
    assert all(torch.equal(received[name], STATE[name]) for name in STATE)
    assert result.phases.gather == 0.5 and result.phases.pack > 0 and result.phases.checksum > 0
    assert result.phases.wire > 0 and phases.wire > 0 and phases.checksum > 0 and phases == SyncPhases(
        wire=phases.wire, checksum=phases.checksum)


def test_bytes_that_do_not_match_the_crc32s_sent_after_them_are_rejected(monkeypatch):
    from rlfabric.weight_sync import sender as sender_module

    monkeypatch.setattr(sender_module, "crc_buffer", lambda crcs: crc_buffer([crcs[0] ^ 1, *crcs[1:]]))
    sender = WeightSender("127.0.0.1", torch.device("cpu"), timeout_s=5.0)
    try:
        result, received, _, _ = sync_over_gloo(sender, 1)
    finally:
        sender.close_all()
    assert not isinstance(result, Exception)  # every bucket went out; the receiver refuses them
    assert isinstance(received, ChecksumMismatch) and "weight bucket 0" in str(received)


def test_a_sync_refused_before_packing_stops_at_once_and_sends_nothing():
    sender = WeightSender("127.0.0.1", torch.device("cpu"), timeout_s=5.0)

    def changed():
        raise FailedPrecondition("the actor's weights changed since PrepareWeightSync")

    started = time.monotonic()
    try:
        result, received, _, _ = sync_over_gloo(sender, 1, before_pack=changed)
    finally:
        sender.close_all()
    assert isinstance(result, FailedPrecondition) and "changed since PrepareWeightSync" in str(result)
    assert isinstance(received, Exception)  # its group is broken: the receiver learns it (the sender left)
    assert time.monotonic() - started < 5 + 10
