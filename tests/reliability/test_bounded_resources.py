"""No TCPStore listens beyond the address it advertises: the weight-sync groups' stores and the store
of the actor's ranks listen on their host only, never on a wildcard address."""

from __future__ import annotations

import psutil
import torch

from rlfabric.actor.dist import WorkerGroup
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
