"""rlfabric.rollout.registration: the address a replica registers with, and no registration without
rollout.register_with (the run test, tests/coordinator/test_elastic_run.py, registers and deregisters a real process)."""

from __future__ import annotations

import socket

from rlfabric.core.config import load_config
from rlfabric.rollout.registration import Registration, advertised_host


def config(*overrides: str):
    return load_config(None, ["model.path=unused", *overrides])


def test_the_advertised_host_is_the_pods_ip_else_a_host_others_reach(monkeypatch):
    monkeypatch.delenv("POD_IP", raising=False)
    assert advertised_host(config("server.host=127.0.0.1")) == "127.0.0.1"
    assert advertised_host(config("server.host=0.0.0.0")) == socket.gethostbyname(socket.gethostname())
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert advertised_host(config("server.host=0.0.0.0")) == "10.1.2.3"


def test_registration_is_off_without_a_coordinator_and_takes_a_given_address():
    assert Registration.of(config()) is None
    registration = Registration.of(config("rollout.register_with=127.0.0.1:1",
                                          "rollout.advertise_address=rollout-3.svc:50051"))
    assert registration.coordinator == "127.0.0.1:1" and registration.address == "rollout-3.svc:50051"
