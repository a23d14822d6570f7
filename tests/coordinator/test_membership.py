"""Rollout membership (rlfabric.coordinator.membership): registration, deregistration and discovery, applied to a
real router and weight-sync plane; the coordinator's RPCs for it over gRPC, bad addresses refused."""

from __future__ import annotations

import asyncio
import socket

import pytest

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.coordinator.membership import RolloutMembership, checked_address, resolve
from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import load_config
from rlfabric.core.errors import InvalidArgument
from rlfabric.core.server import ServerOptions
from rlfabric.launch.inprocess import LocalWeightSync
from rlfabric.rollout.router import RolloutRouter
from rlfabric.serve import build_service
from tests.conftest import ServerThread, closed_port

A, B, C, D = (f"127.0.0.{i}:{closed_port()}" for i in (1, 2, 3, 4))


def config(*overrides: str):
    return load_config(None, ["model.path=unused", *overrides])


def apply(membership: RolloutMembership, members: list[str]):
    """membership.apply to a router over `members` and a plane over the router's replicas: (metrics, router
    addresses, excluded, plane receivers)."""

    async def scenario():
        router = RolloutRouter(members)
        plane = WeightSyncPlane(None, {a: a for a in members}, config(), serving=router)
        try:
            metrics = await membership.apply(router, plane)
            return metrics, router.addresses, router.excluded(), plane.receivers
        finally:
            await router.close()

    return asyncio.run(scenario())


def test_a_registered_replica_joins_excluded_until_a_sync_reaches_it():
    membership = RolloutMembership(config())
    membership.register(C)
    metrics, addresses, excluded, receivers = apply(membership, [A, B])
    assert addresses == [A, B, C] and excluded == [C]  # no request before it holds the weights
    assert receivers == {A: A, B: B, C: C}  # the coming sync sends them
    assert metrics == {"rollout/replicas": 3.0, "rollout/joined": 1.0, "rollout/left": 0.0}
    assert apply(membership, [A, B, C])[0]["rollout/joined"] == 0  # a member already: nothing to do


def test_a_deregistered_replica_leaves_router_and_sync():
    membership = RolloutMembership(config())
    membership.register(C)
    membership.deregister(C)  # registered and gone before a sync: it never joins
    membership.deregister(A)
    metrics, addresses, _, receivers = apply(membership, [A, B])
    assert addresses == [B] and receivers == {B: B}
    assert metrics == {"rollout/replicas": 1.0, "rollout/joined": 0.0, "rollout/left": 1.0}
    membership.register(A)  # it comes back
    assert apply(membership, [B])[1] == [B, A]


def test_the_last_replica_is_kept():
    membership = RolloutMembership(config())
    for address in (A, B):
        membership.deregister(address)
    metrics, addresses, _, _ = apply(membership, [A, B])
    assert len(addresses) == 1 and metrics["rollout/left"] == 1


def test_engines_in_this_process_are_a_fixed_set():
    """The in-process mesh's weight sync cannot reach a replica of another process: nobody is taken in or let go."""
    membership = RolloutMembership(config())
    membership.register(C)
    membership.deregister(A)

    async def scenario():
        router = RolloutRouter([A, B])
        try:
            return await membership.apply(router, LocalWeightSync(None, {A: None, B: None}, config(), serving=router)), \
                router.addresses
        finally:
            await router.close()

    metrics, addresses = asyncio.run(scenario())
    assert addresses == [A, B] and metrics == {"rollout/replicas": 2.0, "rollout/joined": 0.0, "rollout/left": 0.0}
    assert C not in membership.registered


def test_discovery_takes_in_what_appears_and_lets_go_of_what_vanished():
    membership = RolloutMembership(config(f"rollout.discovery={A}"))
    membership.discovered = {A, C, D}  # as a resolution of the headless Service found them
    metrics, addresses, excluded, _ = apply(membership, [A, B])
    assert addresses == [A, C, D] and excluded == [C, D]
    assert metrics["rollout/joined"] == 2 and metrics["rollout/left"] == 1
    membership.deregister(D)  # draining, still in DNS: not taken back
    assert apply(membership, [A, C, D])[1] == [A, C]
    assert apply(membership, [A, C])[1] == [A, C]


def test_discovery_resolves_every_record_of_a_name():
    port = closed_port()
    expected = {f"[{info[4][0]}]:{port}" if ":" in info[4][0] else f"{info[4][0]}:{port}"
                for info in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)}
    assert asyncio.run(resolve(f"localhost:{port}")) == expected
    assert asyncio.run(resolve(f"127.0.0.9:{port}")) == {f"127.0.0.9:{port}"}

    async def discovered():
        membership = RolloutMembership(config(f"rollout.discovery=localhost:{port}", "rollout.discovery_interval_s=60"))
        await membership.start()
        await membership.close()
        return membership.discovered

    assert asyncio.run(discovered()) == expected


def test_a_name_that_does_not_resolve_changes_nothing():
    async def scenario():
        membership = RolloutMembership(config("rollout.discovery=no-such-host.invalid:50051"))
        await membership.discover()
        return membership.discovered

    assert asyncio.run(scenario()) is None


@pytest.mark.parametrize("address", ["", "host", "host:", "host:0", "host:70000", ":50051", "a b:1", "host:x"])
def test_bad_addresses_are_refused(address):
    with pytest.raises(InvalidArgument, match="host:port"):
        checked_address(address)


def test_the_coordinator_takes_registrations_over_grpc(tiny_model):
    run_config = load_config(None, [f"model.path={tiny_model}"])
    server = ServerThread(build_service("coordinator", run_config), ServerOptions(port=0, metrics_port=None))
    try:
        async def scenario():
            async with CoordinatorClient(server.address, ChannelOptions.from_config(run_config)) as client:
                await client.register_rollout_replica(C)
                await client.deregister_rollout_replica(A)
                with pytest.raises(InvalidArgument, match="host:port"):
                    await client.register_rollout_replica("no-port")

        asyncio.run(scenario())
        membership = server.server.service.engine.membership
        assert list(membership.registered) == [C] and membership.leaving == {A}
    finally:
        server.stop()
