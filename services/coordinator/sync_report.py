"""What one weight sync did (SyncReport): the receivers that serve its version and those that do not, the bytes,
the phases, delta sync's fallbacks and the catch-ups of joiners; and the step metrics made of it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlfabric.weight_sync.phases import SyncPhases
from rlfabric.weight_sync.receiver import WeightSwap


@dataclass
class SyncReport:
    """What one sync did. `failed` names every member that does not serve `version` now."""

    version: int
    num_bytes: int = 0  # per receiver
    seconds: float = 0.0  # the whole sync: rebuild (if any), gather, pack, transfer, switch
    broadcast_seconds: float = 0.0  # the actor's BroadcastWeights (pipelined: packing and the wire)
    paused_seconds: dict[str, float] = field(default_factory=dict)  # per receiver that switched
    failed: dict[str, str] = field(default_factory=dict)  # receiver -> reason
    actor_error: str = ""  # the actor's side of a failed broadcast (gloo, nccl), if it failed
    phases: SyncPhases = field(default_factory=SyncPhases)  # the actor's: gather, pack, checksum, wire
    receiver_phases: SyncPhases = field(default_factory=SyncPhases)  # the slowest receiver's: wire, checksum, apply
    full_bytes: int = 0  # per receiver: what the full weights take (num_bytes when the sync sent them)
    delta: bool = False  # the sync sent the change against the replicas' base (weight_sync.delta)
    fallback_full: int = 0  # receivers that got the full weights where a delta was due (another base, or rejected)
    egress_bytes: int = 0  # grpc: what the actor sent (relay chain: about one copy, whatever the replicas)
    hop_seconds: dict[str, float] = field(default_factory=dict)  # grpc: each receiver's receive (wire) seconds
    catchup_from_peer: int = 0  # joiners a peer brought to the current version before the sync (no actor bytes)
    catchup_from_actor: int = 0  # joiners no peer could: the actor's full weights reach them (fallback_full too)
    catchup_seconds: float = 0.0  # the peers' pushes to the joiners

    @property
    def ok(self) -> bool:
        return not self.failed

    def record(self, outcomes: Mapping[str, WeightSwap | BaseException]) -> None:
        """Each receiver's outcome: serving `version` (how long it paused), or failed with the reason; and the
        slowest receiver's phases."""
        for name, outcome in outcomes.items():
            if isinstance(outcome, BaseException):
                self.failed[name] = f"{type(outcome).__name__}: {outcome}"
            elif outcome.version != self.version:
                self.failed[name] = f"serves version {outcome.version}, not {self.version}"
            else:
                self.paused_seconds[name] = outcome.paused_seconds
        self.receiver_phases = SyncPhases.slowest(o.phases for o in outcomes.values() if isinstance(o, WeightSwap))

    def phase_metrics(self) -> dict[str, float]:
        """timing_s/update_weights/<phase>: the actor's gather, pack, checksum and wire; receive_wire,
        receive_checksum, apply and (grpc) relay_hop_max, the receive wire time: the slowest receiver's."""
        prefix = "timing_s/update_weights/"
        metrics = {f"{prefix}{phase}": getattr(self.phases, phase) for phase in ("gather", "pack", "checksum", "wire")}
        metrics.update({f"{prefix}receive_{phase}": getattr(self.receiver_phases, phase) for phase in ("wire", "checksum")})
        metrics[f"{prefix}apply"] = self.receiver_phases.apply
        metrics.update({f"{prefix}relay_hop_max": max(self.hop_seconds.values())} if self.hop_seconds else {})
        return metrics

    def delta_metrics(self) -> dict[str, float]:
        """weight_sync/delta_bytes (what went per receiver), weight_sync/full_bytes (what the full weights take),
        their ratio, weight_sync/delta_fallback_full: receivers that got the full weights instead of a delta, and the
        joiners' catch-ups: weight_sync/catchup_from_peer, catchup_from_actor, timing_s/update_weights/catchup."""
        full = self.full_bytes or self.num_bytes
        return {"weight_sync/delta_bytes": float(self.num_bytes), "weight_sync/full_bytes": float(full),
                "weight_sync/delta_ratio": self.num_bytes / full if full else 1.0,
                "weight_sync/delta_fallback_full": float(self.fallback_full),
                "weight_sync/catchup_from_peer": float(self.catchup_from_peer),
                "weight_sync/catchup_from_actor": float(self.catchup_from_actor),
                "timing_s/update_weights/catchup": self.catchup_seconds}
