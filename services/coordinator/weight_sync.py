"""The coordinator's side of weight sync: one group from the actor to every rollout replica, kept across steps and
rebuilt when membership changes or a sync fails; and the reference resets (sync_ref_model), a group of their own.

    plane = WeightSyncPlane(actor, {"rollout-0": "127.0.0.1:50061", "rollout-1": ...}, config)
    await plane.open()
    report = await plane.sync(version=step)     # every live replica serves `step` afterwards
    if report.failed: ...                       # {name: reason}; the group is rebuilt next time
    await plane.close()

One sync: 1. the actor packs its weights (PrepareWeightSync -> manifest); 2. BroadcastWeights on the actor and
ReceiveWeights on every member run together (grpc: the actor streams to each replica itself); 3. each member
switches to the new version on its own, so a failed member does not stop the others. Every RPC has a deadline.

Which replicas serve: the rollout router owns the replicas. The plane reaches them through the router's clients,
and after each sync takes a replica that missed the version out of the router and puts back one that holds it
(WeightSync.serve_synced): no request is ever served by stale weights.

Elastic membership (rlfabric.coordinator.membership calls add_receiver / remove_receiver): a change takes effect at
the next sync, which rebuilds the group first. Members that do not answer a probe are left out (SyncReport.failed)
and taken back as soon as they answer; a group's first sync sends the full weights, so a (re)joined replica is
current after it.

Delta sync (weight_sync.delta, rlfabric.weight_sync.delta): the plane records the version each member of the
group kept as its base (`held`) and the version the actor last sent. When every member holds the latter, the
actor sends only the change against it; otherwise the full weights, and the members that did not hold it count
in SyncReport.fallback_full. Members that reject a delta (another base, or a tensor whose CRC-32 does not check
out: INVALID_ARGUMENT, the group stays in step) get the full weights in the same sync, counted too. Over the
grpc transport a rebuilt group keeps the bases (the actor's delta_base_from; the members that stay keep theirs),
and a joiner first catches up from a peer that holds the version last sent (rlfabric.coordinator.catchup), so
the sync after a join is still a delta; a joiner no peer reaches gets the actor's full weights (catchup_from_actor).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
import torch

from rlfabric.actor.client import ActorInterface
from rlfabric.coordinator.catchup import catch_up
from rlfabric.coordinator.sync_report import SyncReport
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import RunConfig
from rlfabric.core.dtypes import rollout_dtype, torch_dtype
from rlfabric.core.errors import FailedPrecondition, InvalidArgument
from rlfabric.reference.client import ReferenceClient, ReferenceInterface
from rlfabric.rollout.client import RolloutClient
from rlfabric.rollout.router import RolloutRouter
from rlfabric.weight_sync.devices import DeviceReport, TransportChoice, choose_transport
from rlfabric.weight_sync.manifest import Manifest, SyncGroup
from rlfabric.weight_sync.push_metadata import HOP_SLACK_S
from rlfabric.weight_sync.receiver import SLACK_S, WeightSwap

log = logging.getLogger("rlfabric.coordinator.weight_sync")

PROBE_TIMEOUT_S = 3.0  # a member that does not answer GetStatus this fast is left out of the group


def shares_gpus(config: RunConfig, role: str, other: str) -> bool:
    """Both roles run in one resource pool that has GPUs (the hybrid engine's): the same devices. What auto
    falls back on for a member that does not report its GPU."""
    pool = config.pool_of(role)
    return bool(pool) and pool == config.pool_of(other) and config.resource_pools[pool].total_gpus > 0


@dataclass
class _Member:
    name: str
    address: str
    is_reference: bool
    options: ChannelOptions
    _client: RolloutClient | ReferenceInterface | None = None
    owned: bool = True  # False: the router's client of the replica (or the run's of the reference), closed by them

    @property
    def client(self) -> RolloutClient | ReferenceInterface:
        """Made on first use, on the loop that uses it (a gRPC aio channel belongs to one loop)."""
        if self._client is None:
            self._client = (ReferenceClient(self.address, self.options) if self.is_reference
                            else RolloutClient(self.address, self.options))
        return self._client

    def connected(self) -> bool:
        """The channel to the member is up (no RPC needed: a dead peer's connection is gone)."""
        return self._client is not None and (
            self._client.channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY)

    async def close(self) -> None:
        if self._client is not None and self.owned:
            await self._client.close()
            self._client = None


def target_dtype(config: RunConfig) -> torch.dtype | None:
    """The receivers' dtype: rollout.dtype, else model.dtype; None (auto) lets the actor pick its own."""
    name = rollout_dtype(config)
    return None if name == "auto" else torch_dtype(name)


class WeightSync(abc.ABC):
    """What the loop asks of weight sync, whichever the mesh: WeightSyncPlane over the services' groups, or
    LocalWeightSync (rlfabric.launch.inprocess) straight into engines in this process.

    serving: the router whose replicas are receivers (the same addresses); after every sync it serves exactly
    those that hold the new version (serve_synced). None: nobody serves from the receivers (tests, benches)."""

    serving: RolloutRouter | None = None

    def serve_synced(self, report: SyncReport) -> None:
        """A replica of `serving` that missed report.version leaves it until a later sync reaches it; one
        that holds it serves (again)."""
        if self.serving is None:
            return
        for name, address in self.receivers.items():
            if address in self.serving.addresses:
                if name in report.failed:
                    self.serving.exclude(address)
                else:
                    self.serving.admit(address)

    def add_receiver(self, name: str, address: str) -> None:
        """A rollout replica that joined: the next sync reaches it. (Engines in this process are a fixed set.)"""
        raise FailedPrecondition(f"{type(self).__name__}: rollout replicas join a mesh of services only")

    def remove_receiver(self, name: str) -> None:
        """A rollout replica that left: the next sync goes to the others."""
        raise FailedPrecondition(f"{type(self).__name__}: rollout replicas leave a mesh of services only")

    @property
    @abc.abstractmethod
    def receivers(self) -> dict[str, str]:
        """Each receiver's name and address."""

    @property
    @abc.abstractmethod
    def stale(self) -> bool:
        """Whether a failed sync may be retried at once (the group is rebuilt without the dead members)."""

    @abc.abstractmethod
    async def open(self) -> dict[str, str]:
        """Gets ready to sync; returns {name: reason} of the receivers left out."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases what open() and the syncs hold."""

    @abc.abstractmethod
    async def sync(self, version: int) -> SyncReport:
        """The actor's weights as `version` to every receiver it can reach; the others in report.failed.
        Raises for the actor's own failures."""


class WeightSyncPlane(WeightSync):
    """Drives weight sync from the actor to named receivers ("host:port" of RolloutService)."""

    def __init__(self, actor: ActorInterface, receivers: Mapping[str, str], config: RunConfig,
                 options: ChannelOptions | None = None, reference: str | None = None,
                 serving: RolloutRouter | None = None):
        """receivers: {name: address}; with `serving`, the plane reaches the router's replicas through the
        router's clients, and after each sync the router serves those that hold the version (WeightSync)."""
        self.actor = actor
        self.serving = serving
        self.config = config
        # No channel-level retries towards receivers: the plane decides what a failure means.
        self.options = dataclasses.replace(options or ChannelOptions.from_config(config), retry_max_attempts=1)
        # weight_sync.transport; auto is decided from the devices the members report (choose_transport), again
        # at every rebuild, since a replica that (re)joins may hold another GPU. "" = the actor's own default.
        self.configured = config.weight_sync.transport
        self.transport = "" if self.configured == "auto" else self.configured
        self.choice: TransportChoice | None = None
        self.timeout_s = config.weight_sync.timeout_s
        self._members: dict[str, _Member] = {}
        self._retired: list[_Member] = []  # removed members whose channels close at the next rebuild
        # weight_sync.delta: the version each member of the group kept as its base, and the one the actor last sent
        self.held: dict[str, int] = {}
        self._sent: int | None = None
        for name, address in receivers.items():
            self.add_receiver(name, address)
        if reference:
            self.add_receiver("reference", reference, kind="reference")
        self.group: SyncGroup | None = None
        self.ranks: dict[str, int] = {}  # members of the current group -> rank
        self._stale = True  # the group must be (re)built before the next sync
        self.serving_versions: dict[str, int] = {}  # what each rollout replica served at its last probe or sync
        self._delta_group = False  # the group was opened with delta
        self._buckets = 0  # the full weights' buckets at the last sync (a catch-up's deadline is per bucket)

    # -- membership -------------------------------------------------------------------------------

    def add_receiver(self, name: str, address: str, kind: str = "rollout",
                     client: ReferenceInterface | None = None) -> None:
        """Adds (or re-addresses) a receiver; it joins at the next sync. kind: "rollout" | "reference";
        client: the run's own client of that reference (which the run closes), else the plane makes one."""
        if kind not in ("rollout", "reference"):
            raise ValueError(f"receiver kind must be 'rollout' or 'reference', got {kind!r}")
        if name in self._members:
            self.remove_receiver(name)
        self.held.pop(name, None)  # whatever it holds, the plane knows nothing of it
        shared = self.serving.client_of(address) if self.serving is not None and kind == "rollout" else client
        self._members[name] = _Member(name, address, kind == "reference", self.options, shared, owned=shared is None)
        self._stale = True

    def remove_receiver(self, name: str) -> None:
        """Drops a receiver; the group is rebuilt without it at the next sync."""
        self._retired.append(self._members.pop(name))
        self._stale = True

    @property
    def receivers(self) -> dict[str, str]:
        return {name: m.address for name, m in self._members.items()}

    @property
    def stale(self) -> bool:
        """True when the group must be rebuilt before the next sync (membership changed, or a member of
        the group or the actor failed); a member that stays unreachable outside the group leaves it False."""
        return self._stale or self.group is None

    # -- lifecycle --------------------------------------------------------------------------------

    async def open(self) -> dict[str, str]:
        """Opens the group and joins every reachable receiver; returns {name: reason} of those left out."""
        return await self._rebuild()

    async def close(self) -> None:
        """Closes the actor's group and the receivers' channels."""
        await self._close_group()
        for member in [*self._members.values(), *self._retired]:
            await member.close()
        self._retired = []

    async def _close_group(self, group_id: str | None = None) -> None:
        """Closes the group and forgets it and its bases; or, given, the actor's group `group_id` alone."""
        if group_id is None:
            group_id = self.group.group_id if self.group is not None else ""
            self.group, self.ranks, self.held, self._sent = None, {}, {}, None
        if group_id:
            with contextlib.suppress(Exception):
                await self.actor.close_weight_sync_group(group_id, timeout_s=PROBE_TIMEOUT_S + SLACK_S)

    async def _probe(self, member: _Member) -> str:
        """"" when the member answers, else why not."""
        return (await self._probe_device(member))[0]

    async def _probe_device(self, member: _Member) -> tuple[str, DeviceReport]:
        """("", the device it reports) when the member answers, else (why not, an empty report). A rollout replica's
        weight version goes to serving_versions."""
        try:
            call = member.client.get_status() if member.is_reference else member.client.status()
            status = await asyncio.wait_for(call, PROBE_TIMEOUT_S)
        except Exception as error:
            return f"unreachable: {type(error).__name__}: {error}", DeviceReport()
        if not member.is_reference:
            self.serving_versions[member.name] = status.weight_version
        return "", (DeviceReport.from_proto(status.device) if member.is_reference else status.device)

    async def choose_transport(self) -> TransportChoice:
        """Asks the actor and every receiver that answers which device they hold and decides the transport
        (weight_sync.transport auto) from it; FailedPrecondition, naming the key, when weight_sync.transport
        nccl cannot run on those devices. Runs before a run starts, so such a run never starts."""
        members = list(self._members.values())
        probes = await asyncio.gather(*map(self._probe_device, members))
        return await self._choose({m.name: report for m, (reason, report) in zip(members, probes, strict=True)
                                   if not reason})

    async def _choose(self, receivers: dict[str, DeviceReport]) -> TransportChoice:
        status = await asyncio.wait_for(self.actor.get_status(), PROBE_TIMEOUT_S)
        choice = choose_transport(self.configured, DeviceReport.from_proto(status.device), receivers,
                                  shares_gpus(self.config, "actor", "rollout"),
                                  cuda_ipc=self.config.rollout.engine != "sglang")
        if choice != self.choice:
            log.info("weight-sync transport chosen", extra={"fields": {
                "transport": choice.transport or "the actor's default", "why": choice.reason}})
        self.transport, self.choice = choice.transport, choice
        return choice

    async def _rebuild(self) -> dict[str, str]:
        """A new group of the members that answer; every one of them joined (or reported failed). A grpc delta
        group takes over the old group's base (the actor's delta_base_from), and the members that stay keep theirs:
        the next sync is a delta once the joiners caught up."""
        previous, held, sent = self.group.group_id if self.group else "", self.held, self._sent
        self.group, self.ranks, self.held, self._sent = None, {}, {}, None
        try:
            failed = await self._build(previous)
        finally:  # a no-op where the new group took its base over
            await self._close_group(previous)
        if self.group is not None and self.group.transport == "grpc" and previous and self._delta_group:
            self.held = {name: version for name, version in held.items() if name in self.ranks and name not in failed}
            self._sent = sent
        return failed

    async def _build(self, previous: str) -> dict[str, str]:
        """_rebuild's group, whose base is `previous`'s where both are grpc delta groups."""
        for member in self._retired:
            await member.close()
        self._retired = []
        members = list(self._members.values())
        probes = dict(zip([m.name for m in members], await asyncio.gather(*map(self._probe_device, members)),
                          strict=True))
        reasons = {name: reason for name, (reason, _) in probes.items()}
        live = [m for m in members if not reasons[m.name]]
        if live and self.configured in ("auto", "nccl", "cuda_ipc"):
            try:
                await self._choose({m.name: probes[m.name][1] for m in live})
            except FailedPrecondition as error:  # forced nccl on devices that cannot run it: nobody joins
                return {**{name: reason for name, reason in reasons.items() if reason},
                        **{m.name: str(error) for m in live}}
        if self.transport == "grpc":
            for m in [m for m in live if m.is_reference]:
                reasons[m.name] = "the grpc transport reaches rollout replicas only (PushWeights)"
                live.remove(m)
        failed = {name: reason for name, reason in reasons.items() if reason}
        if not live:
            return failed
        group = await self.actor.open_weight_sync_group(
            self.transport, len(live), self.config.weight_sync.bucket_mb << 20, target_dtype(self.config),
            self.timeout_s, tuple(m.address for m in live), delta=(delta := self._sends_deltas(live)),
            relay=self.config.weight_sync.relay if self.transport == "grpc" else "",
            delta_base_from=previous if self.transport == "grpc" else "")
        ranks = {m.name: rank for rank, m in enumerate(live, start=1)}
        joins = await asyncio.gather(*(m.client.join_weight_sync_group(group, ranks[m.name], self.timeout_s + SLACK_S)
                                       for m in live), return_exceptions=True)
        for member, outcome in zip(live, joins, strict=True):
            if isinstance(outcome, BaseException):
                failed[member.name] = f"join failed: {outcome}"
        self.group, self.ranks, self._delta_group = group, ranks, delta
        self._stale = any(name in failed for name in ranks)  # a failed join leaves the group unusable
        log.info("weight-sync group built", extra={"fields": {
            "group_id": group.group_id, "transport": group.transport, "members": list(ranks), "failed": failed}})
        return failed

    def _sends_deltas(self, members: list[_Member]) -> bool:
        """weight_sync.delta, where it applies: rollout replicas alone, full weights, a transport that moves bytes
        (not cuda_ipc), engines that take our buckets (not SGLang's torch groups)."""
        config = self.config
        return (config.weight_sync.delta and not any(m.is_reference for m in members)
                and self.transport in ("", "gloo", "nccl", "grpc") and config.rollout.engine != "sglang"
                and not config.syncs_lora_adapters())

    async def _needs_rebuild(self) -> bool:
        """True when membership changed, the last sync failed, a left-out member answers again, or a
        member's connection dropped since the last sync and it does not answer (a killed replica: a
        collective would wait for it until weight_sync.timeout_s; a rebuild leaves it out at once)."""
        if self._stale or self.group is None:
            return True
        suspects = [m for m in self._members.values() if m.name not in self.ranks or not m.connected()]
        reasons = await asyncio.gather(*map(self._probe, suspects))
        return any(bool(reason) == (m.name in self.ranks) for m, reason in zip(suspects, reasons, strict=True))

    # -- one sync ---------------------------------------------------------------------------------

    async def sync(self, version: int, full: bool = False) -> SyncReport:
        """Sends the actor's current weights as `version` to every member; never raises for a failed
        receiver (see SyncReport.failed). Raises when the actor itself cannot prepare the weights. With
        weight_sync.delta, only the change when every member holds the version last sent (unless `full`); members
        that reject it get the full weights at once."""
        started = time.perf_counter()
        report = SyncReport(version)
        if await self._needs_rebuild():
            report.failed.update(await self._rebuild())
        for name in self._members:
            if name not in self.ranks and name not in report.failed:
                report.failed[name] = "not in the weight-sync group"
        if self.group is None:
            report.seconds = time.perf_counter() - started
            self._stale = True
            self.serve_synced(report)
            return report
        if not full and self._sent is not None and self.group.transport == "grpc" and self._delta_group:
            # one that a probe found serving another version than it held restarted: no base, a joiner now
            self.held = {name: v for name, v in self.held.items() if self.serving_versions.get(name, v) == v}
            members = {name: (self._members[name].address, self._members[name].client) for name in self.ranks}
            report.catchup_from_peer, report.catchup_from_actor, report.catchup_seconds = await catch_up(
                members, self.held, self._sent, self.timeout_s, self._buckets)  # joiners from a peer, not the actor
        base = None if full else self._common_base()
        if not full and base is None and self._sent is not None:  # a delta was due: who does not hold its base
            report.fallback_full += sum(self.held.get(name) != self._sent for name in self.ranks)
        outcomes = await self._prepare_and_transfer(version, base, report)
        rejected = [name for name, outcome in outcomes.items() if report.delta and _rejected(outcome)]
        if rejected and not report.actor_error:  # the group is in step: the full weights to every member
            log.warning("delta weight sync rejected; sending the full weights", extra={"fields": {
                "version": version, "members": rejected, "reasons": {n: str(outcomes[n]) for n in rejected}}})
            report.fallback_full += len(rejected)
            sent, phases = report.num_bytes, report.phases
            outcomes = await self._prepare_and_transfer(version, None, report)
            report.num_bytes, report.phases = report.num_bytes + sent, report.phases + phases
        report.record(outcomes)
        self.held = {name: version for name, outcome in outcomes.items() if name not in report.failed}
        self.serving_versions.update(self.held)
        if report.actor_error or any(name in report.failed for name in self.ranks):
            self._stale = True  # gloo/nccl groups do not survive a lost peer; rebuild before the next sync
        report.seconds = time.perf_counter() - started
        log.info("weights synced", extra={"fields": {
            "version": version, "bytes": report.num_bytes, "seconds": round(report.seconds, 3),
            "broadcast_seconds": round(report.broadcast_seconds, 3), "failed": report.failed,
            **{key.rsplit("/", 1)[1] + "_s": round(value, 3) for key, value in report.phase_metrics().items()}}})
        self.serve_synced(report)
        return report

    def _common_base(self) -> int | None:
        """The version every member of the group kept, when it is the one the actor last sent (a delta applies)."""
        held = {self.held.get(name) for name in self.ranks}
        return self._sent if self._sent is not None and held == {self._sent} else None

    async def _prepare_and_transfer(self, version: int, base: int | None,
                                    report: SyncReport) -> dict[str, WeightSwap | BaseException]:
        """PrepareWeightSync (the change against `base` where the actor can) and the transfer; the report takes
        what was sent."""
        try:
            manifest = await self.actor.prepare_weight_sync(self.group.group_id, version, delta_base_version=base)
        except Exception:
            self._stale = True  # e.g. the actor restarted and lost the group: rebuild next time
            raise
        report.num_bytes, report.full_bytes, report.delta = manifest.num_bytes, manifest.full_bytes, bool(manifest.delta)
        self._buckets = len(manifest.delta.layout if manifest.delta else manifest.buckets)
        outcomes = await self._transfer(manifest, report)
        if manifest.keep_base:
            self._sent = version
        return outcomes

    async def _transfer(self, manifest: Manifest, report: SyncReport) -> dict[str, WeightSwap | BaseException]:
        """Runs the broadcast and every receive together; {member: its WeightSwap or the error}."""
        group = self.group
        deadline = self.timeout_s * (len(manifest.buckets) + 1) + SLACK_S  # a backstop: collectives time out first
        members = [self._members[name] for name in self.ranks]
        if group.transport == "grpc":
            try:
                deadline += HOP_SLACK_S * len(members) if self.config.weight_sync.relay != "none" else 0.0
                result = await self.actor.broadcast_weights(group.group_id, manifest.version, deadline)
            except Exception as error:
                return {m.name: error for m in members}
            report.broadcast_seconds, report.phases = result.seconds, result.phases
            report.egress_bytes += result.egress_bytes  # a rejected delta, then the full weights: both count
            pushes = {p.address: p for p in result.pushes}
            report.hop_seconds = {m.name: pushes[m.address].phases.wire for m in members}
            return {m.name: pushes[m.address].swap_or_error() for m in members}
        broadcast, *receives = await asyncio.gather(
            self.actor.broadcast_weights(group.group_id, manifest.version, deadline),
            *(m.client.receive_weights(manifest, deadline) for m in members), return_exceptions=True)
        if not isinstance(broadcast, BaseException):
            report.broadcast_seconds, report.phases = broadcast.seconds, broadcast.phases
        outcomes = dict(zip([m.name for m in members], receives, strict=True))
        if isinstance(broadcast, BaseException):
            report.actor_error = f"{type(broadcast).__name__}: {broadcast}"
        return outcomes


async def sync_ref_model(actor: ActorInterface, reference: ReferenceInterface | None, config: RunConfig, step: int,
                         version: int) -> dict[str, float]:
    """The reference reset of a step (reference.sync_ref_model, TRL's name for TR-DPO's): every
    reference.ref_model_sync_steps steps the actor's weights go to the reference as `version`, which mixes them in
    by reference.ref_model_mixup_alpha. A group of their own, opened for the reset and closed after it: the
    rollout's group is not rebuilt, and no group holds the actor's staging memory for the hundreds of steps
    between two resets. {"timing_s/sync_ref_model": seconds} on a reset step, else {}. Raises when the reference
    did not take the weights: the rest of the run would be trained against another reference than configured."""
    settings = config.reference
    if not settings.sync_ref_model or step % settings.ref_model_sync_steps:
        return {}
    started = time.perf_counter()
    plane = WeightSyncPlane(actor, {}, config)
    plane.add_receiver("reference", config.cluster.reference[0], kind="reference", client=reference)
    try:
        report = await plane.sync(version)
    finally:
        await plane.close()
    if report.failed:
        raise FailedPrecondition(f"the reference reset of step {step} failed: {report.failed['reference']}")
    return {"timing_s/sync_ref_model": time.perf_counter() - started}


def _rejected(outcome: WeightSwap | BaseException) -> bool:
    """A member refused a delta (another base, or bytes that do not check out: INVALID_ARGUMENT), and stayed in
    step with its group; a full sync reaches it."""
    return isinstance(outcome, InvalidArgument) or (isinstance(outcome, RuntimeError) and str(outcome).startswith(
        "INVALID_ARGUMENT"))
