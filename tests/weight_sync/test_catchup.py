"""Issue 49's joiner: a rollout replica that joins a running delta sync (grpc, bfloat16 hf replicas on loopback, real
services, the coordinator's plane driving) catches up from a peer at the current version, not from the actor: the
group rebuilt for it keeps the delta bases, the actor sends only the change to everyone, and the joiner ends bit for
bit on the others' and the actor's weights. Where no peer can, the actor's full weights reach it, counted."""

from __future__ import annotations

import pytest
import torch

from rlfabric.core.errors import FailedPrecondition, InvalidArgument
from rlfabric.core.server import ServerOptions
from rlfabric.rollout.client import RolloutClient
from rlfabric.rollout.servicer import build_service as build_rollout
from rlfabric.weight_sync.buckets import crc32
from tests.conftest import ServerThread

from .helpers import Mesh, mesh_config, serve


@pytest.fixture(scope="module")
def mesh(tiny_model):
    # relay none: the actor pushes to each replica itself, so its egress says what each one got from it
    config = mesh_config(tiny_model, "weight_sync.transport=grpc", "weight_sync.delta=true", "weight_sync.bucket_mb=1",
                         "rollout.dtype=bfloat16", "actor.lr=1e-6")
    mesh = Mesh(config, dict.fromkeys(("r0", "r1"), config))
    plane = mesh.open_plane()
    yield mesh, plane
    mesh.run(plane.close())
    mesh.stop()


def checksums(mesh: Mesh, replica: str) -> dict[str, int]:
    """The CRC-32 of every weight replica `replica` serves, over its bytes."""
    weights = mesh.rollouts[replica].server.service.engine._base_weights()
    return {name: crc32(tensor.detach().cpu().contiguous().view(torch.uint8).numpy()) for name, tensor in weights.items()}


def join(mesh: Mesh, plane, name: str) -> None:
    mesh.rollouts[name] = serve(build_rollout(mesh.config))
    plane.add_receiver(name, mesh.rollouts[name].address)


def pushes_of(mesh: Mesh, name: str):
    return mesh.rollouts[name].server.service.bindings[0].servicer._pushes


def test_a_joiner_catches_up_from_a_peer_and_the_next_sync_is_still_a_delta(mesh):
    mesh, plane = mesh
    assert mesh.run(plane.sync(1, full=True)).ok
    mesh.train_step(seed=1)
    before = mesh.run(plane.sync(2))
    assert before.ok and before.delta, before.failed

    join(mesh, plane, "r2")
    mesh.train_step(seed=2)
    report = mesh.run(plane.sync(3))

    assert report.ok, report.failed
    assert (report.catchup_from_peer, report.catchup_from_actor, report.fallback_full) == (1, 0, 0)
    assert report.delta  # the rebuilt group kept the bases: the change alone, to all three
    # The actor's egress for the whole sync, three receivers, is below one copy of the full weights: it sent the
    # joiner the change alone (framing included), never the version it caught up to.
    print(f"joiner's sync: actor egress {report.egress_bytes} B to 3 replicas, delta {report.num_bytes} B each, "
          f"full weights {report.full_bytes} B; catch-up from a peer {report.catchup_seconds:.3f} s")
    assert report.egress_bytes < report.full_bytes, (report.egress_bytes, report.full_bytes)
    assert 3 * report.num_bytes <= report.egress_bytes
    sums = {name: checksums(mesh, name) for name in ("r0", "r1", "r2")}
    assert sums["r2"] == sums["r0"] == sums["r1"]
    assert all(mesh.serves_the_actors_weights(name) for name in ("r0", "r1", "r2"))
    assert report.delta_metrics()["weight_sync/catchup_from_peer"] == 1.0

    mesh.train_step(seed=3)
    after = mesh.run(plane.sync(4))  # no membership change: a plain delta, nobody to catch up
    assert after.ok and after.delta and (after.catchup_from_peer, after.fallback_full) == (0, 0)
    assert all(mesh.serves_the_actors_weights(name) for name in ("r0", "r1", "r2"))


def test_a_replica_restarted_at_its_address_catches_up_from_a_peer_instead_of_rejecting_a_delta(mesh):
    """Its connection dropped, so the sync probes it: it serves another version than the plane recorded, so it
    holds no base, and a peer brings it to the version last sent before the delta goes out."""
    mesh, plane = mesh
    assert mesh.run(plane.sync(20, full=True)).ok
    mesh.train_step(seed=21)
    assert mesh.run(plane.sync(21)).delta
    port = int(mesh.rollouts["r1"].address.rsplit(":", 1)[1])
    mesh.rollouts["r1"].stop()
    mesh.rollouts["r1"] = ServerThread(build_rollout(mesh.config), ServerOptions(port=port, metrics_port=None))
    mesh.train_step(seed=22)
    report = mesh.run(plane.sync(22))
    assert report.ok, report.failed
    assert report.delta and (report.catchup_from_peer, report.fallback_full) == (1, 0)
    assert all(mesh.serves_the_actors_weights(name) for name in plane.receivers)


def test_a_joiner_no_peer_can_catch_up_gets_the_actors_full_weights_counted(mesh):
    mesh, plane = mesh
    assert mesh.run(plane.sync(30, full=True)).ok
    for name in plane.receivers:
        pushes_of(mesh, name).base.clear()  # as a rejected delta leaves a replica: it holds nothing to lend
    join(mesh, plane, "r3")
    mesh.train_step(seed=31)
    report = mesh.run(plane.sync(31))
    assert report.ok, report.failed
    assert (report.catchup_from_peer, report.catchup_from_actor) == (0, 1)
    assert not report.delta and report.fallback_full == 1  # the joiner held no base: full weights to every member
    assert all(mesh.serves_the_actors_weights(name) for name in plane.receivers)
    mesh.train_step(seed=32)
    assert mesh.run(plane.sync(32)).delta  # in step again


def test_push_held_weights_refuses_another_version_and_bad_targets(mesh):
    mesh, plane = mesh
    assert mesh.run(plane.sync(40, full=True)).ok
    held = pushes_of(mesh, "r0").base.version
    assert held == 40

    async def ask(targets, version, hop_timeout_s=5.0):
        async with RolloutClient(mesh.addresses["r0"]) as client:
            return await client.push_held_weights(targets, version, hop_timeout_s, timeout_s=30)

    with pytest.raises(FailedPrecondition, match=f"holds version {held}, not version {held + 1}"):
        mesh.run(ask([mesh.addresses["r1"]], held + 1))
    with pytest.raises(InvalidArgument, match="1..1024 target addresses"):
        mesh.run(ask([], held))
    for hop_timeout_s in (0.0, float("nan"), 1e300):
        with pytest.raises(InvalidArgument, match="hop_timeout_s must be a number of seconds > 0 and at most"):
            mesh.run(ask([mesh.addresses["r1"]], held, hop_timeout_s=hop_timeout_s))
