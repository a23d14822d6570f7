"""The actor's side of a pipelined sync: bucket k+1 is packed (and checksummed) while bucket k is on the wire.

    pipeline = Pipeline(staging, timeout_s, clock)        # staging: two buffers the size of the largest bucket
    packing = executor.submit(pipeline.pack_all, plan, state, checksums=True)   # the packer's thread
    crcs = pipeline.send_all(send)                        # the wire's thread: send(staged) per bucket, in order
    packing.result()

The packer fills a free staging buffer and hands it to the wire, which sends it and frees it again: at most
len(staging) buckets are staged at once (double buffering with two), so the actor holds two buckets, not a
second copy of the whole model. For CUDA IPC `send` returns once every receiver has copied the bucket out
(its acknowledgement), so a buffer is never refilled while a receiver still reads it.

Either side that fails stops the other at once (no thread waits on a queue nobody feeds), and every wait is
bounded by the group's timeout: a stuck wire or packer gives DeadlineExceeded, never a hang.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rlfabric.core.errors import Aborted, DeadlineExceeded
from rlfabric.weight_sync.buckets import pack_checksummed
from rlfabric.weight_sync.manifest import BucketSpec
from rlfabric.weight_sync.phases import PhaseClock

STAGING_BUFFERS = 2  # double buffering: one bucket on the wire while the next is packed
_DONE = object()
_POLL_S = 0.05  # how often a waiting side looks whether the other one failed


@dataclass(frozen=True)
class Staged:
    """One packed bucket in its staging buffer, ready for the wire."""

    spec: BucketSpec  # crc32 filled in (0 without checksums)
    slot: int  # which staging buffer
    buffer: torch.Tensor  # the bucket's bytes: a view of the first spec.num_bytes of that buffer


def staging_buffers(plan: list[BucketSpec], device: torch.device, count: int = STAGING_BUFFERS,
                    reuse: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """`count` uint8 buffers as large as the plan's largest bucket (the previous sync's when they fit)."""
    size = max(spec.num_bytes for spec in plan)
    if reuse and len(reuse) == count and all(b.numel() >= size and b.device == device for b in reuse):
        return reuse
    reuse = None  # freed before the new ones are allocated
    return [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]


@contextmanager
def one_thread_on_the_host(device: torch.device) -> Iterator[None]:
    """Packing into host memory is a memory copy, which one thread does at memory speed. With torch's usual
    intra-op threads each copy is an OpenMP parallel region that waits for all of them, and while the wire and
    the receivers keep the other cores busy that wait dominates: 10x slower on a busy 2-core machine (2.6 s
    against 0.27 s for SmolLM2's 538 MB). The calling thread packs alone meanwhile; restored after."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Pipeline:
    """Moves buckets from the packer to the wire through a fixed set of staging buffers."""

    def __init__(self, staging: list[torch.Tensor], timeout_s: float, clock: PhaseClock | None = None):
        self.staging, self.timeout_s = staging, timeout_s
        self.clock = clock or PhaseClock()
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(len(staging)):
            self._free.put(slot)
        self._ready: queue.Queue = queue.Queue()
        self._failed = threading.Event()

    def pack_all(self, plan: list[BucketSpec], tensors: Mapping[str, torch.Tensor], checksums: bool = True,
                 before: Callable[[], None] | None = None) -> None:
        """The packer: every bucket of `plan`, in order, each into the next free staging buffer. `before` runs
        first (it may raise: the caller's check that `tensors` are still the weights it prepared)."""
        try:
            if before is not None:
                before()
            with one_thread_on_the_host(self.staging[0].device):
                for spec in plan:
                    slot = self._take(self._free, "a free staging buffer (the wire did not send the one before)")
                    buffer = self.staging[slot][: spec.num_bytes]
                    crc = pack_checksummed(spec, tensors, buffer, self.clock, checksums)
                    if buffer.is_cuda:  # the wire (or a receiver's copy) must see every byte of it
                        torch.cuda.current_stream(buffer.device).synchronize()
                    self._ready.put(Staged(BucketSpec(spec.index, spec.num_bytes, spec.tensors, crc), slot, buffer))
            self._ready.put(_DONE)
        except BaseException:
            self._failed.set()
            raise

    def send_all(self, send: Callable[[Staged], None]) -> list[int]:
        """The wire: send(staged) for every bucket as the packer stages it; their CRC-32s, in bucket order."""
        crcs = []
        try:
            while (staged := self._take(self._ready, "the next packed bucket")) is not _DONE:
                with self.clock.timing("wire"):
                    send(staged)
                crcs.append(staged.spec.crc32)
                self._free.put(staged.slot)
        except BaseException:
            self._failed.set()
            raise
        return crcs

    @property
    def stopped(self) -> bool:
        """Either side failed, or the sync was given up."""
        return self._failed.is_set()

    def stop(self) -> None:
        """Makes both sides stop at their next wait (Aborted): the sync was given up."""
        self._failed.set()

    def _take(self, source: queue.Queue, what: str):
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return source.get(timeout=_POLL_S)
            except queue.Empty:
                if self._failed.is_set():
                    raise Aborted(f"weight-sync pipeline stopped: the other side failed while this one waited for "
                                  f"{what}") from None
                if time.monotonic() > deadline:
                    self._failed.set()
                    raise DeadlineExceeded(f"weight-sync pipeline: no {what} within weight_sync.timeout_s="
                                           f"{self.timeout_s:g}") from None
