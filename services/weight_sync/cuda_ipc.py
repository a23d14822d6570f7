"""Same-GPU weight sync by CUDA IPC (transport cuda_ipc): the actor lends its packed buckets' GPU memory to
receivers on the same GPU, as colocated hybrid engines do; no byte leaves the GPU.

    sender:   transport = CudaIpcTransport(group, 0, device, store)
              transport.lend(version, bucket_index, slot, buffer)   # returns once every receiver copied it
    receiver: transport = CudaIpcTransport(group, rank, device)
              transport.take(version, bucket_index, out)            # copies the lent bucket into `out`

Per bucket, the actor packs into one of its two staging buffers (rlfabric.weight_sync.pipeline), waits for the
GPU to finish writing it, and broadcasts a CudaIpcBucket message over the group's gloo collective (a gloo group
like the gloo transport's, for control only): which buffer, how many bytes, and for each receiver an export of
that buffer of its own (torch's CUDA storage sharing: the cudaIpcMemHandle, offsets and a reference counter,
sent field by field, never pickled). Each receiver maps the buffer (once per group: a mapping is costly, and CUDA
maps an allocation once per process), copies the bucket into its own memory, waits for the copy, and
acknowledges it in an all-reduce where a receiver that failed counts 1. The actor packs the next bucket into the
other buffer meanwhile, and refills a buffer only after that all-reduce. A receiver that fails makes every rank
fail at once (Unavailable); one that is stuck makes the all-reduce fail after the group's timeout
(DeadlineExceeded); either way the group is broken and the coordinator opens a new one. A buffer the actor frees
while a receiver still maps it is kept by torch until that receiver lets go (the reference counter).

There is no CRC-32: the receivers read the actor's own memory on their own GPU, so no byte travels that could
change on the way; the message's group, version and bucket number are checked instead.

How memory is shared is pluggable (sharing_for): CudaIpcSharing on a GPU. The CPU tests put FakeIpcSharing in
its place, which lends CPU tensors within one process under random tokens, to run the protocol, its messages
and its failure paths where there is no GPU.
"""

from __future__ import annotations

import os
import threading

import torch

from rlfabric.core.errors import FailedPrecondition, Unavailable
from rlfabric.v1 import weight_sync_pb2
from rlfabric.weight_sync.devices import normalize_uuid, report_of
from rlfabric.weight_sync.gloo import GlooTransport
from rlfabric.weight_sync.manifest import SyncGroup

HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE: a cudaIpcEventHandle_t (and the fake's memory handles)
MAX_MEMORY_HANDLE_BYTES = 1024  # torch serializes a memory handle with how its block was allocated: opaque here
_MESSAGE_BYTES = 1024  # a CudaIpcBucket without handles, and room to spare
_HANDLE_MESSAGE_BYTES = 512  # one CudaIpcHandle (its fields take about 200 bytes)


def control_message_bytes(world_size: int) -> int:
    """The fixed size of one CudaIpcBucket broadcast in a group of `world_size` ranks."""
    return _MESSAGE_BYTES + _HANDLE_MESSAGE_BYTES * (world_size - 1)


class CudaIpcSharing:
    """torch's CUDA tensor sharing (what torch.multiprocessing does for CUDA tensors), without pickle."""

    def identity(self, device: torch.device) -> str:
        """The GPU of `device` as every process names it: its UUID."""
        return report_of(device).gpu

    def export(self, buffer: torch.Tensor) -> weight_sync_pb2.CudaIpcHandle:
        """A new export of `buffer`'s storage, with a reference count of its own (one per receiver)."""
        (_, mem_handle, storage_size, storage_offset, ref_counter, ref_counter_offset, event_handle,
         event_sync_required) = buffer.untyped_storage()._share_cuda_()
        return weight_sync_pb2.CudaIpcHandle(
            mem_handle=mem_handle, storage_offset=storage_offset, storage_size=storage_size,
            ref_counter_handle=ref_counter, ref_counter_offset=ref_counter_offset, event_handle=event_handle,
            event_sync_required=bool(event_sync_required))

    def open(self, handle: weight_sync_pb2.CudaIpcHandle, device: torch.device) -> torch.Tensor:
        """The exported buffer, mapped into this process on `device` (this process's index of that GPU)."""
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index if device.index is not None else torch.cuda.current_device(), handle.mem_handle,
            handle.storage_size, handle.storage_offset, handle.ref_counter_handle, handle.ref_counter_offset,
            handle.event_handle, handle.event_sync_required)
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (handle.storage_size,))

    def release_freed(self) -> None:
        """Frees the actor's buffers that receivers no longer map (torch keeps them until then)."""
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()


class FakeIpcSharing:
    """A FAKE of CudaIpcSharing for CPU tests: `export` registers a CPU buffer under a random 64-byte token and
    `open` returns that very buffer, in this process only (no memory is shared between processes). It lets the
    CPU tests run the transport's protocol, messages and failure paths; the real mapping needs a GPU."""

    def __init__(self):
        self._lent: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    def identity(self, device: torch.device) -> str:
        return f"fake-{os.getpid()}"

    def export(self, buffer: torch.Tensor) -> weight_sync_pb2.CudaIpcHandle:
        token = os.urandom(HANDLE_BYTES)
        storage = buffer.untyped_storage()  # all of it, as CUDA IPC lends the whole allocation
        whole = torch.empty(0, dtype=torch.uint8, device=buffer.device).set_(storage)
        with self._lock:
            self._lent[token] = whole
        return weight_sync_pb2.CudaIpcHandle(mem_handle=token, storage_size=storage.nbytes(),
                                             ref_counter_handle=b"/fake", event_handle=bytes(HANDLE_BYTES))

    def open(self, handle: weight_sync_pb2.CudaIpcHandle, device: torch.device) -> torch.Tensor:
        with self._lock:
            buffer = self._lent.get(handle.mem_handle)
        if buffer is None:
            raise Unavailable("fake CUDA IPC: no buffer was lent under this handle")
        return buffer

    def release_freed(self) -> None:
        pass


def sharing_for(device: torch.device):
    """How buffers on `device` are lent: CUDA IPC on a GPU; FailedPrecondition elsewhere (the CPU tests
    replace this function to put FakeIpcSharing in)."""
    if device.type != "cuda":
        raise FailedPrecondition(f"the cuda_ipc weight-sync transport needs a CUDA device, this rank has {device} "
                                 "(use weight_sync.transport auto or gloo)")
    return CudaIpcSharing()


def check_handle(handle: weight_sync_pb2.CudaIpcHandle, num_bytes: int) -> None:
    """Unavailable unless `handle` describes a buffer that holds `num_bytes`."""
    if not 0 < len(handle.mem_handle) <= MAX_MEMORY_HANDLE_BYTES:
        raise Unavailable(f"CudaIpcBucket: a memory handle of {len(handle.mem_handle)} bytes (1..{MAX_MEMORY_HANDLE_BYTES})")
    if handle.event_sync_required and len(handle.event_handle) != HANDLE_BYTES:
        raise Unavailable(f"CudaIpcBucket: an event handle of {len(handle.event_handle)} bytes, not {HANDLE_BYTES}")
    if handle.storage_offset < 0 or handle.storage_size < num_bytes or not handle.ref_counter_handle:
        raise Unavailable(f"CudaIpcBucket: a buffer of {handle.storage_size} bytes at offset {handle.storage_offset} "
                          f"cannot hold the bucket's {num_bytes}, or it has no reference counter")


class CudaIpcTransport:
    """One rank of a cuda_ipc weight-sync group: rank 0 lends buckets, the others take them."""

    def __init__(self, group: SyncGroup, rank: int, device: torch.device, store=None, sharing=None):
        """Joins the group's gloo control group (blocks until every rank has joined, or fails after the
        group's timeout). A receiver whose GPU is not the sender's cannot join (FailedPrecondition)."""
        self.group, self.rank, self.device = group, rank, device
        self.sharing = sharing or sharing_for(device)
        if rank > 0 and self.sharing.identity(device) != normalize_uuid(group.device_uuid):
            raise FailedPrecondition(f"weight-sync group {group.group_id} lends buckets by CUDA IPC on GPU "
                                     f"{group.device_uuid}; this rank's {device} is another device")
        self._control = GlooTransport(group, rank, store)
        self._message_bytes = control_message_bytes(group.world_size)
        self._exports: dict[int, tuple[int, list]] = {}  # sender: slot -> (storage address, one export per rank)
        self._mapped: dict[int, tuple[bytes, torch.Tensor]] = {}  # receiver: slot -> (memory handle, buffer)

    def lend(self, version: int, bucket_index: int, slot: int, buffer: torch.Tensor) -> None:
        """Rank 0: lends the bucket in staging buffer `slot` (`buffer`: its first bytes, written and synced)
        and returns once every receiver has copied it; Unavailable when one could not."""
        message = weight_sync_pb2.CudaIpcBucket(
            group_id=self.group.group_id, version=version, bucket_index=bucket_index, slot=slot,
            num_bytes=buffer.numel(), device_uuid=self.group.device_uuid, handles=self._exports_of(slot, buffer))
        self._control.broadcast_message(message.SerializeToString(), self._message_bytes)
        failed = self._control.all_sum(0)
        if failed:
            raise Unavailable(f"weight-sync group {self.group.group_id}: {failed} receiver(s) could not take bucket "
                              f"{bucket_index} of version {version} by CUDA IPC (see their logs)")

    def _exports_of(self, slot: int, buffer: torch.Tensor) -> list:
        """The slot's exports, one per receiver, made once per staging buffer."""
        address = buffer.untyped_storage().data_ptr()
        made = self._exports.get(slot)
        if made is None or made[0] != address:
            made = (address, [self.sharing.export(buffer) for _ in range(self.group.world_size - 1)])
            self._exports[slot] = made
        return made[1]

    def take(self, version: int, bucket_index: int, out: torch.Tensor) -> None:
        """A receiver: copies the bucket the sender lends next (which must be `bucket_index` of `version`,
        out.numel() bytes) into `out`, then acknowledges it. Every rank fails (Unavailable) when any did."""
        message = self._control.broadcast_message(b"", self._message_bytes)
        try:
            lent = weight_sync_pb2.CudaIpcBucket.FromString(message)
            self._check(lent, version, bucket_index, out.numel())
            out.copy_(self._map(lent)[: lent.num_bytes])
            if out.is_cuda:  # copied before the sender may refill the buffer
                torch.cuda.current_stream(out.device).synchronize()
        except Exception:
            self._control.all_sum(1)  # the others learn it now, not at the timeout
            raise
        failed = self._control.all_sum(0)
        if failed:
            raise Unavailable(f"weight-sync group {self.group.group_id}: {failed} other receiver(s) could not take "
                              f"bucket {bucket_index} of version {version} by CUDA IPC; the sync is abandoned")

    def _check(self, lent: weight_sync_pb2.CudaIpcBucket, version: int, bucket_index: int, num_bytes: int) -> None:
        expected = (self.group.group_id, version, bucket_index, num_bytes, normalize_uuid(self.group.device_uuid))
        got = (lent.group_id, lent.version, lent.bucket_index, lent.num_bytes, normalize_uuid(lent.device_uuid))
        if got != expected:
            raise Unavailable(f"CudaIpcBucket out of step: (group, version, bucket, bytes, GPU) {got}, expected "
                              f"{expected}")
        if len(lent.handles) != self.group.world_size - 1:
            raise Unavailable(f"CudaIpcBucket carries {len(lent.handles)} handles for {self.group.world_size - 1} "
                              "receivers")
        check_handle(lent.handles[self.rank - 1], num_bytes)

    def _map(self, lent: weight_sync_pb2.CudaIpcBucket) -> torch.Tensor:
        """The sender's staging buffer `lent.slot`, mapped once per buffer (a new one replaces the old)."""
        handle = lent.handles[self.rank - 1]
        mapped = self._mapped.get(lent.slot)
        if mapped is None or mapped[0] != handle.mem_handle:
            self._mapped.pop(lent.slot, None)  # unmapped (its reference released) before the new one is mapped
            try:
                buffer = self.sharing.open(handle, self.device)
            except Unavailable:
                raise
            except Exception as error:  # CUDA refused the handle
                raise Unavailable(f"cannot map the sender's staging buffer {lent.slot} by CUDA IPC: "
                                  f"{type(error).__name__}: {error}") from error
            mapped = (handle.mem_handle, buffer)
            self._mapped[lent.slot] = mapped
        return mapped[1]

    def close(self) -> None:
        """Unmaps the sender's buffers (a receiver) or drops the exports (the sender), then the control group."""
        self._mapped.clear()
        self._exports.clear()
        self.sharing.release_freed()
        self._control.close()
