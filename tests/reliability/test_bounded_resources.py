"""Bounded resources: no caller can use up the actor's weight-sync groups, and no TCPStore listens
beyond the address it advertises.

- TCPStores (weight sync, the actor's ranks) listen on their host only, never on a wildcard;
- weight sync: a capped timeout, at most max_open_groups open (the one unused for longest is evicted,
  its rendezvous abandoned), RESOURCE_EXHAUSTED only while every group is mid-sync.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections.abc import Mapping

import psutil
import pytest
import torch

from rlfabric.actor.client import ActorClient
from rlfabric.actor.dist import WorkerGroup
from rlfabric.actor.service import build_service as build_trainer
from rlfabric.core.config import RunConfig, config_from_dict
from rlfabric.core.errors import InvalidArgument, NotFound, ResourceExhausted
from rlfabric.core.weight_sync.manifest import SyncGroup
from rlfabric.core.weight_sync.receiver import WeightReceiver
from rlfabric.core.weight_sync.sender import WeightSender
from rlfabric.v1 import reward_pb2

from .helpers import trainer_config

HOST = "127.0.0.1"
OK, TIMEOUT = reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_TIMEOUT
STATE = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7)}
WILDCARDS = {"0.0.0.0", "::", ""}


def listening() -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket this process listens on."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


# --- TCPStores: the advertised address only ------------------------------------------------------------


def test_weight_sync_store_and_gloo_listen_on_the_advertised_address_only():
    sender = WeightSender(HOST, torch.device("cpu"), timeout_s=5.0)
    before = listening()
    try:
        group = sender.open("gloo", 1)
        receiver = WeightReceiver(group, 1)  # returns once rank 0's gloo pairs are up too
        opened = listening() - before
        receiver.close()
    finally:
        sender.close_all()
    assert (HOST, group.store_port) in opened
    assert {ip for ip, _ in opened} == {HOST}, opened


def test_the_actor_ranks_store_listens_on_loopback_only(tiny_model):
    config = trainer_config(tiny_model)
    before = listening()
    group = WorkerGroup("actor", config, 2, torch.device("cpu"))
    try:
        group.start()  # returns once rank 1 (a new process) joined through the store
        opened = listening() - before
    finally:
        group.stop()
    ips = {ip for ip, _ in opened}
    assert HOST in ips and not ips & WILDCARDS, opened  # the store; gloo's own sockets on the hostname's address


# --- weight sync: caps and eviction -------------------------------------------------------------------


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def rendezvous_thread(group_id: str) -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == f"weight-sync-{group_id}"), None)


def sync_once(sender: WeightSender, group: SyncGroup, version: int) -> dict[str, torch.Tensor]:
    """Joins the group as its one receiver, prepares and broadcasts STATE; what the receiver got."""
    group_id = group.group_id
    joined: list = []
    joining = threading.Thread(target=lambda: joined.append(WeightReceiver(group, 1)))
    joining.start()
    manifest = sender.prepare(group_id, version, STATE)
    received: list = []

    def receive():
        joining.join()
        received.append(dict(joined[0].receive(manifest)))

    receiving = threading.Thread(target=receive)
    receiving.start()
    asyncio.run(sender.broadcast(group_id, version))
    receiving.join(30)
    joined[0].close()
    return received[0]


@pytest.fixture
def sender():
    sender = WeightSender(HOST, torch.device("cpu"), timeout_s=5.0, max_timeout_s=600.0, max_open_groups=4)
    yield sender
    sender.close_all()


def test_groups_stuck_connecting_are_evicted_and_a_later_group_syncs(sender):
    """Eight opens at the largest timeout, no receiver ever joining, then a real sync."""
    stuck = [sender.open("gloo", 1, timeout_s=600.0) for _ in range(8)]
    evicted, kept = stuck[:4], stuck[4:]

    for group in evicted:  # rendezvous abandoned: store closed, rank 0's thread gone
        thread = rendezvous_thread(group.group_id)
        if thread is not None:
            thread.join(10)
            assert not thread.is_alive(), group.group_id
        assert refuses_connections(group.store_port)
        with pytest.raises(NotFound, match="evicted to make room .*max_open_groups=4"):
            sender.prepare(group.group_id, 1, STATE)
    assert all(rendezvous_thread(g.group_id) is not None for g in kept)

    started = time.monotonic()
    latest = sender.open("gloo", 1, timeout_s=5.0)  # evicts kept[0]
    received = sync_once(sender, latest, 1)
    assert time.monotonic() - started < 15
    assert all(torch.equal(received[name], STATE[name]) for name in STATE)
    with pytest.raises(NotFound, match="evicted"):
        sender.prepare(kept[0].group_id, 1, STATE)


class _PackGate(Mapping):
    """Weights whose packing waits for `release` (a prepare still packing, deterministically)."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def __getitem__(self, name):
        return STATE[name]

    def __iter__(self):
        return iter(STATE)

    def __len__(self):
        return len(STATE)

    def items(self):
        self.entered.set()
        self.release.wait(30)
        return STATE.items()


def test_open_is_resource_exhausted_only_while_every_group_is_mid_sync():
    sender = WeightSender(HOST, torch.device("cpu"), max_open_groups=1)
    try:
        busy = sender.open("grpc", 1, addresses=("127.0.0.1:1",))
        gate = _PackGate()
        packing = threading.Thread(target=sender.prepare, args=(busy.group_id, 1, gate))
        packing.start()
        assert gate.entered.wait(30)
        with pytest.raises(ResourceExhausted, match="all are mid-sync .*max_open_groups=1"):
            sender.open("grpc", 1, addresses=("127.0.0.1:1",))

        gate.release.set()
        packing.join(30)
        newer = sender.open("grpc", 1, addresses=("127.0.0.1:1",))  # the idle one makes room
        assert sender.prepare(newer.group_id, 1, STATE).version == 1
        with pytest.raises(NotFound, match="evicted"):
            sender.prepare(busy.group_id, 2, STATE)
    finally:
        sender.close_all()


@pytest.fixture(scope="module")
def capped_actor(tiny_model, serve_module):
    config = trainer_config(tiny_model, weight_sync={"max_timeout_s": 30.0, "max_open_groups": 2,
                                                     "timeout_s": 5.0})
    return serve_module(build_trainer("actor", config))


def test_the_actor_caps_the_timeout_and_evicts_through_its_rpcs(capped_actor):
    async def calls():
        async with ActorClient(capped_actor.address) as actor:
            for timeout_s in (1e9, math.inf, math.nan, -1.0):
                with pytest.raises(InvalidArgument, match="at most weight_sync.max_timeout_s=30"):
                    await actor.open_weight_sync_group("gloo", 1, timeout_s=timeout_s)
            groups = [await actor.open_weight_sync_group("gloo", 1, timeout_s=30.0) for _ in range(3)]
            with pytest.raises(NotFound, match="evicted .*max_open_groups=2"):
                await actor.prepare_weight_sync(groups[0].group_id, 1)
            for group in groups:
                await actor.close_weight_sync_group(group.group_id)
            return groups

    groups = asyncio.run(calls())
    assert refuses_connections(groups[0].store_port)


def test_the_config_keeps_max_timeout_at_least_the_timeout():
    with pytest.raises(ValueError, match="max_timeout_s: .*must be >= weight_sync.timeout_s"):
        config_from_dict({"weight_sync": {"timeout_s": 700}})
    assert RunConfig().weight_sync.max_timeout_s >= RunConfig().weight_sync.timeout_s
