"""The trainer's end of weight sync (rlfabric.weight_sync): the actor is rank 0 of every group it opens and sends
its weights; the reference joins one group and mixes what arrives into its own. Each TrainerEngine keeps one
TrainerWeightSync (engine.weight_sync), which refuses what its role's RoleSpec does not do.

The actor's side of one sync: open a group (once, kept across steps), prepare a version (gather the weights on
the torch thread, plan or pack their buckets), broadcast it (refused if an update or a load changed the weights
since prepare), close the group when the coordinator rebuilds it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch
from prometheus_client import CollectorRegistry

from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import RunConfig
from rlfabric.core.errors import FailedPrecondition
from rlfabric.core.metrics import service_counter, service_histogram
from rlfabric.weight_sync.manifest import AdapterSpec, Manifest, SyncGroup, WeightLimits
from rlfabric.weight_sync.receiver import Membership, WeightSwap
from rlfabric.weight_sync.sender import BroadcastResult, WeightSender

if TYPE_CHECKING:
    from rlfabric.trainer.roles import RoleSpec
    from rlfabric.trainer.worker import RankWorker

log = logging.getLogger("rlfabric.actor")


class SyncedEngine(Protocol):
    """What weight sync asks of its trainer engine (rlfabric.trainer.engine.TrainerEngine is the one): the role,
    rank 0's worker (None until started), how many commands changed the weights so far, and the weights as rank 0
    gathers, checks and loads them (gathering and loading on the torch thread)."""

    config: RunConfig
    role: str
    spec: RoleSpec
    model_path: str
    worker: RankWorker | None
    weights_changes: int

    def policy_weights(self, on_device: bool = False) -> dict[str, torch.Tensor]: ...

    def adapter_weights(self) -> dict[str, torch.Tensor]: ...

    def check_names(self, tensors: dict[str, torch.Tensor], what: str) -> None: ...

    def load_mixed(self, sent: dict[str, torch.Tensor], alpha: float) -> None: ...


class TrainerWeightSync:
    """One trainer engine's weight-sync end: the actor's groups (made on first use), the reference's membership,
    and the metrics of every sync on this service."""

    def __init__(self, engine: SyncedEngine, torch_thread: ThreadPoolExecutor, registry: CollectorRegistry):
        self.engine = engine
        self._torch_thread = torch_thread  # the engine's: gathering, packing and loading weights run there
        self.weight_version = 0  # the reference's: bumped by each weight sync it receives
        self._sender: WeightSender | None = None  # the actor's weight-sync groups, made on first use
        # the reference's weight-sync group; the bytes land on rank 0's device
        self._membership = Membership(device=self._receive_device, limits=self._weight_limits)
        self._prepared_at: dict[str, int] = {}  # weight-sync group -> engine.weights_changes when its sync was prepared
        role = engine.role
        self._seconds = service_histogram(
            registry, "rlfabric_weight_sync_seconds", "Wall time of one weight sync on this service "
            "(actor: broadcast; reference: receive and load).", ("role",))
        self._bytes = service_counter(
            registry, "rlfabric_weight_sync_bytes_total", "Weight bytes moved by weight sync (actor: sent per "
            "receiver; reference: received).", ("role",))
        self._bytes.labels(role)
        self._phases = service_histogram(
            registry, "rlfabric_weight_sync_phase_seconds", "Seconds of each phase of one weight sync on this service "
            "(actor: gather, pack, checksum, wire; reference: wire, checksum, apply). Phases of a pipelined sync "
            "overlap.", ("role", "phase"))

    async def stop(self) -> None:
        if self._sender is not None:
            self._sender.close_all()
        await self._membership.leave()

    async def _on_torch_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._torch_thread, fn, *args)

    # -- the actor: rank 0 of each group it opens -------------------------------------------------

    def _weight_sender(self) -> WeightSender:
        engine = self.engine
        if not engine.spec.sends_weights:
            raise FailedPrecondition(f"the {engine.role} does not send weights; only the actor does")
        if self._sender is None:
            sync = engine.config.weight_sync
            self._sender = WeightSender(sync_host(engine.config), engine.worker.device,
                                        ChannelOptions.from_config(engine.config), timeout_s=sync.timeout_s,
                                        bucket_bytes=sync.bucket_mb << 20, max_timeout_s=sync.max_timeout_s,
                                        max_open_groups=sync.max_open_groups)
        return self._sender

    async def open(self, transport: str, num_receivers: int, bucket_bytes: int = 0,
                   dtype: torch.dtype | None = None, timeout_s: float = 0.0,
                   addresses: tuple[str, ...] = (), delta: bool = False, relay: str = "",
                   delta_base_from: str = "") -> SyncGroup:
        """A new group with this actor as rank 0 (dtype None = the actor's compute dtype). With SGLang
        rollout servers, a torch.distributed group built as theirs is, so they can join it. `delta`: the group
        keeps what it last sent and may send only the change (weight_sync.delta); `relay` (grpc): "chain" = the
        receivers forward the push along `addresses` (weight_sync.relay); `delta_base_from`: an open group whose
        delta base the new one takes over (WeightSender.open)."""
        torch_group = self.engine.config.rollout.engine == "sglang" and transport != "grpc"
        return self._weight_sender().open(transport, num_receivers, bucket_bytes, dtype or self.engine.worker.dtype,
                                          timeout_s, addresses, torch_group, delta, relay, delta_base_from)

    async def prepare(self, group_id: str, version: int, delta_base_version: int | None = None) -> Manifest:
        """Gathers the full weights for `group_id` and plans their buckets (grpc, torch and delta groups: packs
        them; delta groups also encode the change against `delta_base_version` where they can), on the torch
        thread, so no update changes them half-way."""
        sender = self._weight_sender()
        return await self._on_torch_thread(self._prepare, sender, group_id, version, delta_base_version)

    def _prepare(self, sender: WeightSender, group_id: str, version: int, delta_base_version: int | None) -> Manifest:
        engine = self.engine
        started = time.perf_counter()
        if engine.config.syncs_lora_adapters():  # weight_sync.lora: the adapters alone, peft names
            settings = engine.worker.lora
            adapter = AdapterSpec.of(settings.rank, settings.alpha, settings.target_modules)
            state = engine.adapter_weights()
        else:  # read where they are (unsharded): packing copies them once, straight into the buckets
            adapter, state = None, engine.policy_weights(on_device=True)
        manifest = sender.prepare(group_id, version, state, adapter, gather_s=time.perf_counter() - started,
                                  delta_base_version=delta_base_version)
        self._prepared_at[group_id] = engine.weights_changes
        return manifest

    async def broadcast(self, group_id: str, version: int) -> BroadcastResult:
        """Sends the prepared weights; pipelined transports pack them on the torch thread meanwhile (nothing
        else runs there until they are packed), after checking that no update or load changed them since
        PrepareWeightSync (FailedPrecondition: prepare again)."""
        prepared_at = self._prepared_at.get(group_id)

        def unchanged() -> None:
            if prepared_at != self.engine.weights_changes:
                raise FailedPrecondition(f"the actor's weights changed since PrepareWeightSync of group {group_id} "
                                         f"(an update or a load ran in between): prepare version {version} again")

        result = await self._weight_sender().broadcast(group_id, version, self._torch_thread, unchanged)
        role = self.engine.role
        self._seconds.labels(role).observe(result.seconds)
        self._bytes.labels(role).inc(result.num_bytes)
        for phase in ("gather", "pack", "checksum", "wire"):
            self._phases.labels(role, phase).observe(getattr(result.phases, phase))
        log.info("weights sent", extra={"fields": {"group_id": group_id, "version": version, "bytes": result.num_bytes,
                                                   "seconds": round(result.seconds, 3), **{
                                                       f"{k}_s": round(v, 3) for k, v in result.phases.as_dict().items()
                                                       if k != "apply"}}})
        return result

    async def close(self, group_id: str) -> None:
        self._weight_sender().close(group_id)

    # -- the reference: a member of one group -----------------------------------------------------

    def _receive_device(self) -> torch.device:
        worker = self.engine.worker
        return worker.device if worker else torch.device("cpu")

    def _weight_limits(self) -> WeightLimits | None:
        """The model's own weights, which a manifest must fit before its buckets are allocated."""
        worker = self.engine.worker
        return WeightLimits(worker.param_shapes, what=f"model {self.engine.model_path}") if worker else None

    async def join(self, group: SyncGroup, rank: int) -> None:
        if not self.engine.spec.receives_weights:
            raise FailedPrecondition(f"the {self.engine.role} does not receive weights; the reference and rollout do")
        await self._membership.join(group, rank)

    async def receive(self, manifest: Manifest) -> WeightSwap:
        """Receives and loads one manifest's weights (mixed in by reference.ref_model_mixup_alpha): the version
        now served, how long the load held the torch thread, and this side's phases."""
        engine = self.engine
        started = time.perf_counter()

        async def load(weights) -> float:
            named = dict(weights)
            engine.check_names(named, f"weight manifest version {manifest.version}")
            loading = time.perf_counter()
            await self._on_torch_thread(engine.load_mixed, named, engine.config.reference.ref_model_mixup_alpha)
            return time.perf_counter() - loading

        paused, phases = await self._membership.receive(manifest, load)
        self.weight_version = manifest.version
        self._seconds.labels(engine.role).observe(time.perf_counter() - started)
        self._bytes.labels(engine.role).inc(manifest.num_bytes)
        for phase in ("wire", "checksum", "apply"):
            self._phases.labels(engine.role, phase).observe(getattr(phases, phase))
        return WeightSwap(self.weight_version, paused, phases)


def sync_host(config: RunConfig) -> str:
    """The address receivers reach the actor's weight-sync store at (weight_sync.host, else server.host,
    else this machine's hostname when the server binds a wildcard)."""
    host = config.weight_sync.host or config.server.host
    return socket.gethostname() if host in ("", "0.0.0.0", "::", "[::]") else host
