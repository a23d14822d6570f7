"""Relay between replicas (weight_sync.relay chain, grpc): actor -> 3 bfloat16 hf replicas on loopback, real
services, the coordinator's plane driving. The actor sends one copy of the model where a direct sync sends one per
replica, every replica ends bit for bit on the actor's weights, and a replica stopped mid-relay is routed around,
reported, and caught up from a peer when it is back."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.config import load_config
from rlfabric.rollout.servicer import build_service as build_rollout

from .helpers import Mesh, mesh_config, serve

REPLICAS = ("r0", "r1", "r2")
EVENT_S = 60  # bound on waiting for an event the sync itself causes


@pytest.fixture(scope="module")
def mesh(tiny_model):
    # bucket_mb=1: several buckets, so a replica stopped after its first chunk is stopped mid-relay
    config = mesh_config(tiny_model, "weight_sync.transport=grpc", "weight_sync.relay=chain", "weight_sync.delta=true",
                         "weight_sync.bucket_mb=1", "rollout.dtype=bfloat16", "actor.lr=1e-6")
    mesh = Mesh(config, dict.fromkeys(REPLICAS, config))
    plane = mesh.open_plane()
    yield mesh, plane
    mesh.run(plane.close())
    mesh.stop()


def test_the_actor_sends_one_copy_and_every_replica_gets_the_actors_weights(mesh):
    mesh, plane = mesh
    relayed = mesh.run(plane.sync(1, full=True))
    assert relayed.ok, relayed.failed
    assert all(mesh.serves_the_actors_weights(name) for name in REPLICAS)
    # One copy plus the messages' framing: the manifest once per stream, a few bytes per chunk (the issue's 1.25).
    assert relayed.num_bytes <= relayed.egress_bytes <= 1.25 * relayed.num_bytes
    assert relayed.hop_seconds.keys() == set(REPLICAS)
    direct_config = load_config(None, [f"{key}={value}" for key, value in (
        ("model.path", mesh.config.model.path), ("weight_sync.transport", "grpc"), ("rollout.dtype", "bfloat16"))])
    direct = mesh.run(_plane(mesh, direct_config))
    try:
        assert mesh.run(direct.open()) == {}
        report = mesh.run(direct.sync(2))
    finally:
        mesh.run(direct.close())
    assert report.ok and report.num_bytes == relayed.num_bytes
    assert report.egress_bytes >= len(REPLICAS) * report.num_bytes  # a copy per replica
    mesh.train_step(seed=3)
    delta = mesh.run(plane.sync(3))  # every replica holds what the plane last sent: a delta, relayed
    assert delta.ok and delta.delta, delta.failed
    assert all(mesh.serves_the_actors_weights(name) for name in REPLICAS)


async def _plane(mesh: Mesh, config) -> WeightSyncPlane:
    return WeightSyncPlane(mesh.actor_client, mesh.addresses, config)


@pytest.mark.parametrize("victim", ["r0", "r1"])  # the actor routes around r0, r0 around r1
def test_a_replica_stopped_mid_relay_is_routed_around_and_synced_in_full_when_back(mesh, victim):
    mesh, plane = mesh
    assert mesh.run(plane.sync(10, full=True)).ok
    mesh.train_step(seed=11)
    stalled = _stall_after_first_chunk(mesh, victim)
    syncing = asyncio.run_coroutine_threadsafe(plane.sync(11), mesh.loop.loop)
    assert stalled.wait(EVENT_S), f"{victim} never received a chunk"
    mesh.rollouts[victim].stop()
    stopped = time.monotonic()
    report = syncing.result(EVENT_S)
    # A stopped server drops its connections: its upstream sees that at once, well within a hop's timeout.
    assert time.monotonic() - stopped < mesh.config.weight_sync.timeout_s
    assert report.failed.keys() == {victim}, report.failed
    assert all(mesh.serves_the_actors_weights(name) for name in REPLICAS if name != victim)

    mesh.rollouts[victim] = serve(build_rollout(mesh.config))  # back, at another port
    plane.add_receiver(victim, mesh.rollouts[victim].address)
    mesh.train_step(seed=12)
    back = mesh.run(plane.sync(12))
    # A new group that keeps the bases: the returning replica catches up from a peer, then the change goes down the chain
    assert back.ok and back.delta and (back.catchup_from_peer, back.fallback_full) == (1, 0), back.failed
    assert all(mesh.serves_the_actors_weights(name) for name in REPLICAS)
    mesh.train_step(seed=13)
    assert mesh.run(plane.sync(13)).delta  # in step again


def _stall_after_first_chunk(mesh: Mesh, replica: str) -> threading.Event:
    """`replica` takes the manifest and one chunk of its next push, then nothing more; the event is set then."""
    pushes = mesh.rollouts[replica].server.service.bindings[0].servicer._pushes
    receive = pushes.receive
    reached = threading.Event()

    async def stalled(requests):
        messages = aiter(requests)
        yield await anext(messages)  # the manifest
        yield await anext(messages)
        reached.set()
        await asyncio.Event().wait()  # until the server stops and cancels the call

    async def stalling(requests, *args):
        return await receive(stalled(requests), *args)

    pushes.receive = stalling
    return reached


@pytest.mark.parametrize(("chain", "hop_timeout_s", "match"), [
    (("127.0.0.1:1", ""), 5.0, "comma-separated addresses, none empty"),
    (("127.0.0.1:1",), 0.0, "must be a number of seconds > 0"),
])
def test_a_malformed_relay_chain_is_refused_before_anything_is_received(mesh, chain, hop_timeout_s, match):
    from rlfabric.weight_sync.buckets import pack
    from rlfabric.weight_sync.grpc_stream import push_weights, serialize_chunks

    mesh, _ = mesh
    weights = mesh.rollouts["r2"].server.service.engine._base_weights()
    manifest, buffers = pack(weights, 1 << 20, 99, "ws-not-a-group")
    result = mesh.run(push_weights(mesh.addresses["r2"], serialize_chunks(manifest, buffers), 10,
                                   relay=(chain, hop_timeout_s)))
    assert result.error.startswith("INVALID_ARGUMENT") and match in result.error, result.error


def test_relay_runs_over_the_grpc_transport_only():
    import torch

    from rlfabric.core.errors import InvalidArgument
    from rlfabric.weight_sync.sender import WeightSender

    with pytest.raises(ValueError, match="relay chain runs over weight_sync.transport grpc"):
        load_config(None, ["weight_sync.transport=gloo", "weight_sync.relay=chain"])
    sender = WeightSender("127.0.0.1", torch.device("cpu"))
    with pytest.raises(InvalidArgument, match="runs over the grpc transport, not gloo"):
        sender.open("gloo", 2, relay="chain")
    with pytest.raises(InvalidArgument, match="unknown weight-sync relay 'tree'"):
        sender.open("grpc", 1, addresses=("127.0.0.1:1",), relay="tree")
