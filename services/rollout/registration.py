"""A rollout replica that joins and leaves a running mesh by itself (rollout.register_with: the coordinator).

    registration = Registration.of(config)          # None without rollout.register_with
    await registration.ready(port)                  # the server is ready: register (retried until it takes)
    await registration.drain()                      # SIGTERM: deregister, then the server drains

Why deregister before the drain rather than after it: the coordinator lets go of a replica at its next weight sync,
and a weight sync sent to a replica that refuses it can hold the group until weight_sync.timeout_s. Deregistering
first keeps the replica out of the syncs while it finishes what it has in flight; the router's requests to it are
refused from the drain's start (UNAVAILABLE, "rollout service is shutting down") and go to other replicas, and a
stream it does not finish within server.grace_period_s fails over with the samples it still owed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket

from rlfabric.core.client import ChannelOptions, ServiceClient
from rlfabric.core.config import RunConfig
from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("rlfabric.rollout.registration")

RETRY_S = 2.0  # between registrations the coordinator did not take (it may start after the replicas)
DEREGISTER_TIMEOUT_S = 5.0


class _CoordinatorMembership(ServiceClient):
    """The two CoordinatorService calls a replica makes (the coordinator's own client sits a floor above)."""

    role = "coordinator"
    stub_class = coordinator_pb2_grpc.CoordinatorServiceStub

    async def register(self, address: str, timeout_s: float | None = None) -> None:
        request = coordinator_pb2.CoordinatorServiceRegisterRolloutReplicaRequest(address=address)
        await self.call("RegisterRolloutReplica", request, timeout_s)

    async def deregister(self, address: str, timeout_s: float | None = None) -> None:
        request = coordinator_pb2.CoordinatorServiceDeregisterRolloutReplicaRequest(address=address)
        await self.call("DeregisterRolloutReplica", request, timeout_s)


def advertised_host(config: RunConfig) -> str:
    """$POD_IP, else server.host unless it is a wildcard, else this host's address."""
    if os.environ.get("POD_IP"):
        return os.environ["POD_IP"]
    host = config.server.host
    with contextlib.suppress(ValueError):
        if not ipaddress.ip_address(host).is_unspecified:
            return host
        host = ""
    return host or socket.gethostbyname(socket.gethostname())


class Registration:
    """This replica's registration with the coordinator at rollout.register_with."""

    def __init__(self, coordinator: str, advertise_address: str, options: ChannelOptions, host: str):
        self.coordinator, self.options, self.host = coordinator, options, host
        self.address = advertise_address  # "" until ready() knows the port
        self._client: _CoordinatorMembership | None = None
        self._registering: asyncio.Task | None = None
        self.registered = asyncio.Event()

    @classmethod
    def of(cls, config: RunConfig) -> Registration | None:
        rollout = config.rollout
        if not rollout.register_with:
            return None
        host = advertised_host(config) if not rollout.advertise_address else ""
        return cls(rollout.register_with, rollout.advertise_address, ChannelOptions.from_config(config), host)

    async def ready(self, port: int) -> None:
        """Registers in the background, every RETRY_S until the coordinator takes it."""
        self.address = self.address or (f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}")
        self._client = _CoordinatorMembership(self.coordinator, self.options)
        self._registering = asyncio.create_task(self._register(), name="rollout-registration")

    async def _register(self) -> None:
        while True:
            try:
                await self._client.register(self.address)
            except Exception as error:  # the coordinator is not up yet, or restarting
                log.warning("could not register with the coordinator at %s (retrying in %g s): %s",
                            self.coordinator, RETRY_S, error)
                await asyncio.sleep(RETRY_S)
                continue
            log.info("registered with the coordinator", extra={"fields": {
                "coordinator": self.coordinator, "address": self.address}})
            self.registered.set()
            return

    async def drain(self) -> None:
        """Deregisters (one try, DEREGISTER_TIMEOUT_S); a coordinator that does not answer finds the replica gone
        at its next weight sync."""
        if self._client is None:
            return
        if self._registering is not None:
            self._registering.cancel()
        try:
            await self._client.deregister(self.address, DEREGISTER_TIMEOUT_S)
            log.info("deregistered from the coordinator", extra={"fields": {"address": self.address}})
        except Exception as error:
            log.warning("could not deregister from the coordinator at %s: %s", self.coordinator, error)
        finally:
            await self._client.close()
            self._client = None
