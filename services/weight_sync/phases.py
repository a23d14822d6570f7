"""How long each phase of a weight sync took on one side (rlfabric.v1.WeightSyncPhases).

    clock = PhaseClock()
    with clock.timing("pack"):
        ...                                  # from any thread; the seconds of each phase add up
    phases = clock.phases()                  # SyncPhases(gather=0.0, pack=0.21, ...)

The actor reports gather, pack, checksum and wire (BroadcastWeights), a receiver wire, checksum and apply
(ReceiveWeights, PushWeights); the coordinator logs them as timing_s/update_weights/<phase> (the actor's) and
timing_s/update_weights/receive_<phase> (the slowest receiver's; apply keeps its name). A pipelined sync runs
phases at once (bucket k+1 packed while bucket k is on the wire), so they may add up to more than its wall time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass, fields

from rlfabric.v1 import weight_sync_pb2

PHASES = ("gather", "pack", "checksum", "wire", "apply")


@dataclass(frozen=True)
class SyncPhases:
    """Seconds spent in each phase of a sync, on one side."""

    gather: float = 0.0  # actor: the full weights gathered from the shards
    pack: float = 0.0  # actor: cast and copied into buckets
    checksum: float = 0.0  # CRC-32: the actor of what it packed, a receiver of what it received
    wire: float = 0.0  # bytes moving (a receiver's waits for the sender included)
    apply: float = 0.0  # receiver: the switch to the new weights

    def __add__(self, other: SyncPhases) -> SyncPhases:
        return SyncPhases(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def slowest(cls, many: Iterable[SyncPhases]) -> SyncPhases:
        """Each phase's longest time over `many` (the receivers of one sync)."""
        many = list(many)
        return cls(*(max(values) for values in zip(*map(astuple, many), strict=True))) if many else cls()

    def to_proto(self) -> weight_sync_pb2.WeightSyncPhases:
        return weight_sync_pb2.WeightSyncPhases(gather_s=self.gather, pack_s=self.pack, checksum_s=self.checksum,
                                                wire_s=self.wire, apply_s=self.apply)

    @classmethod
    def from_proto(cls, message: weight_sync_pb2.WeightSyncPhases) -> SyncPhases:
        return cls(message.gather_s, message.pack_s, message.checksum_s, message.wire_s, message.apply_s)


class PhaseClock:
    """Adds up the seconds spent in each phase, from any number of threads."""

    def __init__(self, **seconds: float):
        self._seconds = dict.fromkeys(PHASES, 0.0) | seconds
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._seconds[phase] += seconds

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)

    def phases(self) -> SyncPhases:
        with self._lock:
            return SyncPhases(**self._seconds)
