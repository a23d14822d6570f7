"""Rollout replicas that come and go during a run (issue 49, item 4).

    membership = RolloutMembership(config)       # the coordinator's, across runs
    membership.register("10.0.0.7:50051")       # CoordinatorService.RegisterRolloutReplica
    membership.deregister("10.0.0.5:50051")      # CoordinatorService.DeregisterRolloutReplica (a draining replica)
    await membership.start()                     # rollout.discovery: resolves it every discovery_interval_s
    metrics = await membership.apply(router, weight_sync)   # at a weight sync: joiners in, leavers out

Changes are applied at a weight sync only (StepRunner.sync_weights), never mid-step: that is where the served version
moves on. A joiner enters the router excluded and the weight sync as a receiver, so the sync about to run brings it
to the current version, and the sync's serve_synced admits it: it takes requests from then on, never with stale
weights; one that is not ready yet stays out and is tried again at each sync. A leaver leaves the weight sync and
the router: it gets no new request, and the requests in flight on it go on (a draining replica finishes them; a
dead one's fail over to the others, rlfabric.rollout.router), so no sample is lost or counted twice.

Discovery (rollout.discovery, "host:port"): every A record of the host is a replica at that port; one that appears is
a joiner, a member whose address (resolved, for a name) is no longer among them is a leaver. A failed or empty
resolution changes nothing: a DNS hiccup does not empty the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket

from rlfabric.coordinator.weight_sync import WeightSync
from rlfabric.core.config import RunConfig
from rlfabric.core.errors import FailedPrecondition, InvalidArgument
from rlfabric.rollout.router import RolloutRouter

log = logging.getLogger("rlfabric.coordinator.membership")

RESOLVE_TIMEOUT_S = 5.0


def checked_address(address: str) -> str:
    """`address` when it is host:port with a port in 1..65535 (IPv6 hosts in brackets), else InvalidArgument."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c.isspace() for c in address):
        raise InvalidArgument(f"a rollout replica's address must be host:port (port 1..65535), got {address!r}")
    return address


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(address: str) -> set[str]:
    """Every address ("ip:port") the host of `address` resolves to; an IP literal is itself. Raises OSError or
    TimeoutError when the name does not resolve."""
    host, port = _split(address)
    with contextlib.suppress(ValueError):
        return {_join(str(ipaddress.ip_address(host)), port)}
    infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM),
                                   RESOLVE_TIMEOUT_S)
    return {_join(info[4][0], port) for info in infos}


class RolloutMembership:
    """Which rollout replicas should serve the run: the config's, those registered, those discovery finds;
    applied to the run's router and weight sync at each weight sync."""

    def __init__(self, config: RunConfig):
        self.discovery = checked_address(config.rollout.discovery) if config.rollout.discovery else ""
        self.interval_s = config.rollout.discovery_interval_s
        self.registered: dict[str, None] = {}  # registered and not deregistered since (in order)
        self.leaving: set[str] = set()  # deregistered: let go of at the next weight sync, not rediscovered
        self.discovered: set[str] | None = None  # the last resolution that found replicas ("ip:port")
        self._aliases: dict[str, set[str]] = {}  # a member's address -> what it resolves to (discovery compares)
        self._task: asyncio.Task | None = None
        self.joined_total = 0
        self.left_total = 0

    def register(self, address: str) -> None:
        """A replica asks to serve: it joins at the next weight sync."""
        address = checked_address(address)
        self.leaving.discard(address)
        self.registered[address] = None
        log.info("rollout replica registered", extra={"fields": {"address": address}})

    def deregister(self, address: str) -> None:
        """A replica leaves (it drains): it gets no new request from the next weight sync on, and discovery does
        not take its address back until it registers again."""
        address = checked_address(address)
        self.registered.pop(address, None)
        self.leaving.add(address)
        log.info("rollout replica deregistered", extra={"fields": {"address": address}})

    # -- discovery ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolves rollout.discovery now and then every discovery_interval_s (nothing without it)."""
        if self.discovery and self._task is None:
            await self.discover()
            self._task = asyncio.create_task(self._discover_forever(), name="rollout-discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def discover(self) -> None:
        """One resolution of rollout.discovery; a failed or empty one keeps the last."""
        try:
            found = await resolve(self.discovery)
        except (OSError, TimeoutError) as error:
            log.warning("rollout.discovery %s did not resolve: %s", self.discovery, error)
            return
        if found and found != self.discovered:
            log.info("rollout replicas discovered", extra={"fields": {"name": self.discovery, "found": sorted(found)}})
            self.discovered = found

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.discover()

    async def _resolved(self, address: str) -> set[str]:
        """What a member's address resolves to (kept: a replica keeps its name's address while it is a member)."""
        if address not in self._aliases:
            try:
                self._aliases[address] = await resolve(address)
            except (OSError, TimeoutError):
                return set()  # tried again at the next sync
        return self._aliases[address]

    # -- at a weight sync -----------------------------------------------------------------------

    async def changes(self, members: list[str]) -> tuple[list[str], list[str]]:
        """(joiners, leavers) against the current `members`."""
        joiners = [a for a in self.registered if a not in members]
        leavers = [a for a in members if a in self.leaving]
        if self.discovered is not None:
            resolved = {a: await self._resolved(a) for a in members}
            covered = set().union(*resolved.values())
            joiners += sorted(a for a in self.discovered - covered if a not in joiners and a not in self.leaving)
            leavers += [a for a, ips in resolved.items()
                        if ips and not ips & self.discovered and a not in leavers and a not in self.registered]
        return joiners, leavers

    def _take_in(self, address: str, router: RolloutRouter, weight_sync: WeightSync) -> bool:
        """A joiner into the router (excluded) and the weight sync; False, forgotten, where the weight sync has a
        fixed set of replicas (engines in this process)."""
        router.add(address)
        try:
            weight_sync.add_receiver(address, address)
        except FailedPrecondition as error:
            router.remove(address)
            self.registered.pop(address, None)
            log.warning("rollout replica %s not taken in: %s", address, error)
            return False
        return True

    def _let_go(self, address: str, router: RolloutRouter, weight_sync: WeightSync) -> bool:
        """A leaver out of the weight sync and the router; False, kept, where the weight sync has a fixed set."""
        names = {member: name for name, member in weight_sync.receivers.items()}
        try:
            if address in names:
                weight_sync.remove_receiver(names[address])
        except FailedPrecondition as error:
            log.warning("rollout replica %s kept: %s", address, error)
            return False
        router.remove(address)
        self._aliases.pop(address, None)
        return True

    async def apply(self, router: RolloutRouter, weight_sync: WeightSync) -> dict[str, float]:
        """Joiners into the router (excluded until the coming sync reaches them) and the weight sync; leavers out of
        both. The last replica is never let go of (the run would have none). rollout/replicas, joined, left."""
        joiners, leavers = await self.changes(router.addresses)
        joiners = [address for address in joiners if self._take_in(address, router, weight_sync)]
        if leavers and len(leavers) >= len(router.addresses):
            log.warning("keeping rollout replica %s: every replica is leaving", leavers[-1])
            leavers = leavers[:-1]
        leavers = [address for address in leavers if self._let_go(address, router, weight_sync)]
        self.joined_total += len(joiners)
        self.left_total += len(leavers)
        if joiners or leavers:
            log.info("rollout membership changed", extra={"fields": {"joined": joiners, "left": leavers,
                                                                     "replicas": router.addresses}})
        return {"rollout/replicas": float(len(router.addresses)), "rollout/joined": float(len(joiners)),
                "rollout/left": float(len(leavers))}
