"""Bounded resources: no caller can use up the actor's weight-sync groups or the reward service's
scorers, and no TCPStore listens beyond the address it advertises.

- weight sync: a capped timeout, at most max_open_groups open (the one unused for longest is evicted,
  its rendezvous abandoned), RESOURCE_EXHAUSTED only while every group is mid-sync;
- TCPStores (weight sync, the actor's ranks) listen on their host only, never on a wildcard;
- reward: a Score whose caller went away stops scoring, and a hung in-process scorer costs its item
  a "timeout", not the service.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import socket
import tempfile
import textwrap
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from rlfabric.actor.client import ActorClient
from rlfabric.core.config import RunConfig, config_from_dict
from rlfabric.core.errors import InvalidArgument, NotFound, ResourceExhausted
from rlfabric.core.server import ServerOptions
from rlfabric.reward import register_scorer
from rlfabric.reward.servicer import build_service as build_reward
from rlfabric.serve import build_service as build_trainer
from rlfabric.trainer.dist import WorkerGroup
from rlfabric.v1 import reward_pb2, reward_pb2_grpc
from rlfabric.weight_sync.manifest import SyncGroup
from rlfabric.weight_sync.receiver import WeightReceiver
from rlfabric.weight_sync.sender import WeightSender

from .helpers import trainer_config

pytestmark = pytest.mark.slow

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


# --- reward: a Score whose caller went away stops ------------------------------------------------------


SLOW_FUNCTION = textwrap.dedent(
    """
    import os
    import time


    def compute_score(data_source, solution_str, ground_truth, extra_info, log="", fifo="", hold_s=0.0):
        if data_source == "slow":
            with open(log, "a") as f:
                f.write(solution_str + "\\n")
            fd = os.open(fifo, os.O_WRONLY)
            os.write(fd, b"s")  # tells the test this item started
            os.close(fd)
            time.sleep(hold_s)
        return 1.0
    """
)
HOLD_S = 2.0  # how long each slow item scores; a request of 20 would take 40 s


def serve_reward(serve_in_thread, **reward):
    return serve_in_thread(build_reward(config_from_dict({"reward": reward})),
                           ServerOptions(port=0, metrics_port=None))


def score_stub(server):
    channel = grpc.insecure_channel(server.address)
    return channel, reward_pb2_grpc.RewardServiceStub(channel)


def request(data_source: str, count: int) -> reward_pb2.RewardServiceScoreRequest:
    return reward_pb2.RewardServiceScoreRequest(items=[
        reward_pb2.ScoreItem(data_source=data_source, response=str(i), ground_truth="") for i in range(count)])


@pytest.fixture
def shared_dir():
    """A folder the reward sandbox's uid may write to (pytest's are root's alone, mode 0700), outside its
    private /tmp."""
    directory = Path(tempfile.mkdtemp(prefix="rlfabric-bounded-", dir="/run"))
    directory.chmod(0o1777)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("give_up", ["cancel", "deadline"])
def test_a_score_whose_caller_went_away_stops_and_frees_the_workers(give_up, serve_in_thread, shared_dir):
    path, log, fifo = shared_dir / "slow.py", shared_dir / "started.log", shared_dir / "started.fifo"
    path.write_text(SLOW_FUNCTION)
    log.touch(mode=0o666)
    log.chmod(0o666)
    os.mkfifo(fifo, 0o666)
    fifo.chmod(0o666)
    started = os.open(fifo, os.O_RDWR)  # read end held open: the workers' writes never block
    server = serve_reward(serve_in_thread, custom_path=str(path), num_workers=1, timeout_s=30.0,
                          custom_kwargs={"log": str(log), "fifo": str(fifo), "hold_s": HOLD_S})
    channel, stub = score_stub(server)
    try:
        if give_up == "cancel":
            call = stub.Score.future(request("slow", 20), timeout=60)
            assert os.read(started, 1) == b"s"  # the first item is being scored
            call.cancel()
            assert call.cancelled()
        else:
            with pytest.raises(grpc.RpcError) as error:
                stub.Score(request("slow", 20), timeout=HOLD_S / 4)
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        began = time.monotonic()
        answer = stub.Score(request("fast", 1), timeout=HOLD_S * 5)  # waits for the item in flight only
        assert time.monotonic() - began < HOLD_S + 5
        assert [r.score for r in answer.results] == [1.0]
        assert log.read_text().split() == ["0"]  # items 1..19 never started
        assert server.server.service.engine.items_scored == 1  # the given-up batch is not counted
    finally:
        channel.close()
        os.close(started)


class _Heard(logging.Handler):
    """Sets `event` when a log record's message contains `text`."""

    def __init__(self, text: str):
        super().__init__()
        self.text, self.event = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@pytest.fixture
def heard_cancel():
    handler = _Heard("Score cancelled")
    logger = logging.getLogger("rlfabric.reward")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.event
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_cancelled_score_of_in_process_scorers_stops_after_the_current_item(serve_in_thread, heard_cancel):
    source = f"test/gate-{time.monotonic_ns()}"
    entered, release, calls = threading.Event(), threading.Event(), []

    def gated(solution_str, ground_truth, extra_info=None, **kwargs):
        calls.append(solution_str)
        entered.set()
        release.wait(30)
        return 1.0

    register_scorer(source, gated)
    server = serve_reward(serve_in_thread)
    channel, stub = score_stub(server)
    try:
        call = stub.Score.future(request(source, 50), timeout=60)
        assert entered.wait(30)
        call.cancel()
        assert heard_cancel.wait(30)  # the engine was told before the first item returns
        release.set()
        answer = stub.Score(request("openai/gsm8k", 1), timeout=30)
        assert len(answer.results) == 1
        assert calls == ["0"]
    finally:
        release.set()
        channel.close()


# --- reward: a hung in-process scorer times out -------------------------------------------------------


def mixed(*data_sources: str) -> reward_pb2.RewardServiceScoreRequest:
    return reward_pb2.RewardServiceScoreRequest(
        items=[reward_pb2.ScoreItem(data_source=s, response="x", ground_truth="") for s in data_sources])


def test_a_hung_in_process_scorer_times_out_its_item_and_later_requests_go_on(serve_in_thread):
    hang, fast = f"test/hang-{time.monotonic_ns()}", f"test/fast-{time.monotonic_ns()}"
    release = threading.Event()
    register_scorer(hang, lambda *args, **kwargs: release.wait(60) and 1.0)
    register_scorer(fast, lambda *args, **kwargs: 1.0)
    server = serve_reward(serve_in_thread, timeout_s=0.5, max_stuck_scorer_threads=2)
    channel, stub = score_stub(server)
    before = {t for t in threading.enumerate() if t.name.startswith("scorer-")}
    try:
        began = time.monotonic()
        answer = stub.Score(mixed(hang, fast, fast), timeout=30)  # leaves one thread stuck in `hang`
        assert time.monotonic() - began < 5
        assert [r.status for r in answer.results] == [TIMEOUT, OK, OK]
        assert "timeout_s=0.5" in answer.results[0].message

        # A second stuck thread reaches reward.max_stuck_scorer_threads: from then on every item
        # fails at once, the fast one after it included, instead of queueing behind them.
        answer = stub.Score(mixed(hang, fast), timeout=30)
        assert [r.status for r in answer.results] == [TIMEOUT, TIMEOUT]
        began = time.monotonic()
        answer = stub.Score(mixed(fast, fast, fast), timeout=30)
        assert time.monotonic() - began < 1
        assert {r.status for r in answer.results} == {TIMEOUT}
        assert "max_stuck_scorer_threads" in answer.results[0].message

        release.set()  # the stuck scorers return; their threads end and are counted free again
        for thread in {t for t in threading.enumerate() if t.name.startswith("scorer-")} - before:
            thread.join(30)
        answer = stub.Score(mixed(fast, fast, fast), timeout=30)
        assert [r.status for r in answer.results] == [OK] * 3
    finally:
        release.set()
        channel.close()
