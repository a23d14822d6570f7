"""Actor -> 2 rollout replicas (hf engine) over gloo and grpc, through the coordinator's plane, with
real services on loopback: after a sync the rollout's sampled log-probs equal the actor's, versions
advance, bad checksums are rejected while the old weights keep serving. The reference rides along
on the gloo mesh."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch
from grpc import aio
from prometheus_client import generate_latest

from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.errors import FailedPrecondition, InvalidArgument, NotFound
from rlfabric.reference.client import ReferenceClient
from rlfabric.rollout.client import RolloutClient
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
from rlfabric.weight_sync import sender as sender_module
from rlfabric.weight_sync.buckets import crc_buffer, pack
from rlfabric.weight_sync.grpc_stream import PUSH_METHOD, push_weights, serialize_chunks
from rlfabric.weight_sync.push_metadata import STREAMS_METADATA
from tests.numerics import ENGINE_LOGPROB_GAP
from tests.rollout.helpers import generate, original_weights
from tests.trainer.helpers import make_batch

from .helpers import PROMPTS, Mesh, mesh_config


@pytest.fixture(scope="module", params=["gloo", "grpc"])
def mesh(request, tiny_model):
    config = mesh_config(tiny_model, f"weight_sync.transport={request.param}", "reference.ref_model_mixup_alpha=1.0")
    mesh = Mesh(config, {"r0": config, "r1": config}, reference=request.param == "gloo")
    reference = mesh.reference.address if mesh.reference else None
    plane = mesh.run(_plane(mesh, reference))
    assert mesh.run(plane.open()) == {}
    yield mesh, plane
    mesh.run(plane.close())
    mesh.stop()


async def _plane(mesh: Mesh, reference: str | None) -> WeightSyncPlane:
    return WeightSyncPlane(mesh.actor_client, mesh.addresses, mesh.config, reference=reference)


def rollout_version(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=10).weight_version


@pytest.mark.numerics
def test_sync_makes_every_replica_serve_the_actors_weights(mesh):
    mesh, plane = mesh
    for version, seed in ((1, 11), (2, 12)):
        mesh.train_step(seed)
        assert not any(mesh.serves_the_actors_weights(name) for name in mesh.rollouts)  # stale before the sync
        report = mesh.run(plane.sync(version))
        assert report.ok, report.failed
        assert set(report.paused_seconds) == set(plane.ranks) and report.num_bytes > 150_000  # bfloat16 on a GPU
        for address in mesh.addresses.values():
            assert rollout_version(address) == version
        assert all(mesh.serves_the_actors_weights(name) for name in mesh.rollouts)
        if not torch.cuda.is_available():  # float32 on the host: their log-probs agree as well
            assert all(mesh.logprob_gap(address) <= ENGINE_LOGPROB_GAP for address in mesh.addresses.values())
    exposition = generate_latest(mesh.rollouts["r0"].server.service.registry).decode()
    assert 'rlfabric_weight_sync_seconds_count{role="rollout"} 2.0' in exposition
    assert "rlfabric_rollout_paused_seconds_count 2.0" in exposition and "rlfabric_rollout_weight_version 2.0" in exposition
    assert 'rlfabric_weight_sync_phase_seconds_count{phase="apply",role="rollout"} 2.0' in exposition
    actor_metrics = generate_latest(mesh.actor.server.service.registry).decode()
    assert 'rlfabric_weight_sync_seconds_count{role="actor"} 2.0' in actor_metrics
    assert all(f'rlfabric_weight_sync_phase_seconds_count{{phase="{phase}",role="actor"}} 2.0' in actor_metrics
               for phase in ("gather", "pack", "checksum", "wire"))
    phases = report.phase_metrics()  # the last sync's, as the step metrics carry them
    assert phases["timing_s/update_weights/wire"] > 0 and phases["timing_s/update_weights/apply"] > 0
    assert (phases["timing_s/update_weights/checksum"] > 0) == (phases["timing_s/update_weights/receive_checksum"] > 0)
    if mesh.reference is not None:  # the reference loaded the same weights
        status, ours, theirs = mesh.run(_reference_and_actor_log_probs(mesh))
        assert status.weight_version == 2 and float((ours - theirs).abs().max()) <= ENGINE_LOGPROB_GAP


async def _reference_and_actor_log_probs(mesh: Mesh):
    batch = make_batch()
    async with ReferenceClient(mesh.reference.address) as reference:
        status = await reference.get_status()
        ours = (await reference.compute_log_probs(batch))["log_probs"]
    return status, ours, (await mesh.actor_client.compute_log_probs(batch))["log_probs"]


def _samples(address: str):
    with grpc.insecure_channel(address) as channel:
        return [(s.token_ids, s.logprobs, s.weight_version) for s in generate(channel, PROMPTS, max_tokens=8, seed=3)]


def test_a_checksum_mismatch_is_rejected_and_the_old_weights_keep_serving(mesh, tiny_model, monkeypatch):
    mesh, plane = mesh
    mesh.run(plane.sync(3))
    before = {name: _samples(address) for name, address in mesh.addresses.items()}
    mesh.train_step(13)
    if plane.group.transport == "grpc":
        # A stream whose bytes do not match its manifest's CRC-32, straight at replica r0.
        manifest, buffers = pack(original_weights(tiny_model), 1 << 20, version=4, group_id=plane.group.group_id)
        bad = dataclasses.replace(manifest, buckets=(dataclasses.replace(manifest.buckets[0], crc32=12345),))
        result = mesh.run(push_weights(mesh.addresses["r0"], serialize_chunks(bad, buffers), timeout_s=10))
        assert result.error.startswith("INVALID_ARGUMENT") and "CRC-32" in result.error
        short = mesh.run(push_weights(mesh.addresses["r0"], serialize_chunks(manifest, [buffers[0][:1000]]),
                                      timeout_s=10))
        assert short.error.startswith("INVALID_ARGUMENT") and "ended before" in short.error
    else:
        # gloo: the CRC-32s follow the buckets on the collective. The actor (in this process) announces CRC-32s
        # its bytes do not have, as when bytes change on the way: every member rejects the update.
        monkeypatch.setattr(sender_module, "crc_buffer", lambda crcs: crc_buffer([crc ^ 1 for crc in crcs]))
        manifest = mesh.run(mesh.actor_client.prepare_weight_sync(plane.group.group_id, 4))
        broadcast, *received = mesh.run(receive_all(
            mesh.actor_client, plane.group.group_id, manifest, list(mesh.addresses.values()),
            mesh.reference.address if mesh.reference else None))
        monkeypatch.undo()
        assert not isinstance(broadcast, BaseException)
        assert len(received) == 3 and all(isinstance(r, InvalidArgument) and "CRC-32" in str(r) and
                                          "old weights keep serving" in str(r) for r in received), received
    assert rollout_version(mesh.addresses["r0"]) == rollout_version(mesh.addresses["r1"]) == 3
    assert _samples(mesh.addresses["r0"]) == before["r0"]  # same seed, same old weights, same samples
    report = mesh.run(plane.sync(5))  # the group survived the rejected update
    assert report.ok, report.failed
    assert all(rollout_version(a) == 5 for a in mesh.addresses.values())
    assert all(mesh.serves_the_actors_weights(name) for name in mesh.rollouts)


async def receive_all(actor, group_id: str, manifest, addresses, reference: str | None = None):
    """The actor's broadcast while every member receives `manifest`: [broadcast result, each receiver's]."""
    clients = [RolloutClient(a) for a in addresses]
    if reference is not None:  # a member too: the broadcast waits for every rank
        clients.append(ReferenceClient(reference))
    try:
        return await asyncio.gather(actor.broadcast_weights(group_id, manifest.version),
                                    *(c.receive_weights(manifest) for c in clients), return_exceptions=True)
    finally:
        for client in clients:
            await client.close()


def test_a_replica_serves_the_received_buffers_themselves_and_they_are_never_written_again(mesh):
    """gloo to a replica on the host: the hf replica adopts the received tensors as its parameters (no copy),
    and the next sync lands in new buffers: what it serves meanwhile never changes under it. grpc pushes, and
    gloo to a replica on a GPU (the bytes land on the host), copy into the parameters."""
    mesh, plane = mesh
    engine = mesh.rollouts["r0"].server.service.engine
    parameter = engine.net.get_parameter("model.layers.0.mlp.up_proj.weight")
    before = parameter.data_ptr()
    mesh.train_step(31)
    assert mesh.run(plane.sync(30)).ok
    adopted = plane.group.transport != "grpc" and engine.device.type == "cpu"
    assert (parameter.data_ptr() != before) == adopted
    served, values = parameter.data, parameter.detach().clone()
    mesh.train_step(32)
    assert mesh.run(plane.sync(31)).ok
    assert (parameter.data_ptr() != served.data_ptr()) == adopted
    if adopted:  # the tensors served until this sync were not written by it
        assert torch.equal(served, values)
    assert not torch.equal(parameter.detach(), values)  # the new version is served


def test_misuse_is_a_clear_error(mesh):
    mesh, plane = mesh
    client = mesh.actor_client
    with pytest.raises(FailedPrecondition, match="not version 99"):
        mesh.run(client.broadcast_weights(plane.group.group_id, 99))
    with pytest.raises(NotFound, match="no weight-sync group 'no-such-group'"):
        mesh.run(client.prepare_weight_sync("no-such-group", 1))
    with pytest.raises(InvalidArgument, match="num_receivers"):
        mesh.run(client.open_weight_sync_group("gloo", 0))
    if torch.cuda.is_available():  # an actor on a GPU opens nccl groups; on CPU it cannot
        return
    with pytest.raises(FailedPrecondition, match="needs the actor on a CUDA device"):
        mesh.run(client.open_weight_sync_group("nccl", 1))


def test_a_manifest_that_does_not_fit_the_replica_is_refused_before_anything_is_allocated(mesh, tiny_model):
    mesh, plane = mesh
    assert mesh.run(plane.sync(6)).ok
    manifest, buffers = pack(original_weights(tiny_model), 1 << 20, version=7, group_id=plane.group.group_id)
    first = manifest.buckets[0]
    renamed = dataclasses.replace(first.tensors[0], name="not.a.weight")
    alien = dataclasses.replace(manifest, buckets=(dataclasses.replace(first, tensors=(renamed, *first.tensors[1:])),
                                                   *manifest.buckets[1:]))
    if plane.group.transport == "grpc":
        result = mesh.run(push_weights(mesh.addresses["r0"], serialize_chunks(alien, buffers), timeout_s=10))
        assert result.error.startswith("INVALID_ARGUMENT") and "'not.a.weight'" in result.error, result.error
    else:  # refused before the receiver allocates its buckets or joins the collective: no broadcast needed
        with pytest.raises(InvalidArgument, match="'not.a.weight': model .* has no weight of that name"):
            mesh.run(_receive(mesh.addresses["r0"], alien))
    assert rollout_version(mesh.addresses["r0"]) == 6
    assert mesh.run(plane.sync(8)).ok  # the group and the service are fine


async def _receive(address: str, manifest):
    async with RolloutClient(address) as client:
        return await client.receive_weights(manifest, 10)


def test_a_push_whose_other_streams_never_come_fails_at_its_deadline(mesh, tiny_model):
    mesh, plane = mesh
    if plane.group.transport != "grpc":
        pytest.skip("PushWeights streams: the grpc transport")
    manifest, buffers = pack(original_weights(tiny_model), 1 << 20, version=9, group_id=plane.group.group_id)
    chunks = serialize_chunks(manifest, buffers, chunk_bytes=64 << 10)
    code, elapsed = mesh.run(_first_of_two_streams(mesh.addresses["r0"], chunks, timeout_s=2.0))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and elapsed < 6
    assert mesh.run(plane.sync(10)).ok  # the half push was dropped; the next one goes through


async def _first_of_two_streams(address: str, chunks: list[bytes], timeout_s: float):
    started = asyncio.get_running_loop().time()
    async with aio.insecure_channel(address) as channel:
        call = channel.stream_unary(PUSH_METHOD, request_serializer=None,
                                    response_deserializer=rollout_pb2.RolloutServicePushWeightsResponse.FromString)
        try:
            await call(iter([chunks[0], *chunks[1::2]]), timeout=timeout_s, metadata=((STREAMS_METADATA, "2"),))
        except grpc.RpcError as error:
            return error.code(), asyncio.get_running_loop().time() - started
    return grpc.StatusCode.OK, asyncio.get_running_loop().time() - started
