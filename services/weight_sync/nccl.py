"""The NCCL transport: a cupy.cuda.nccl communicator over GPU buffers.

Rank 0 (the actor) makes the NCCL unique id; it travels to the receivers inside WeightSyncGroup
(bytes) through the gRPC control plane, and every rank builds one communicator from it, handing cupy
the id in the form its version takes (bytes from cupy 14 on, a tuple of C chars before). cupy is
imported lazily: nothing here needs it until a GPU group is opened.

NCCL has no timeout of its own, so each operation is watched: the communicator's creation runs on a
helper thread that is given up after the group's timeout, and a broadcast is polled on its CUDA
stream and aborted (ncclCommAbort) when the timeout passes, so a dead peer gives an error, not a hang.
"""

from __future__ import annotations

import platform
import threading
import time

import torch

from rlfabric.core.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from rlfabric.weight_sync.manifest import SyncGroup

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


def cupy_nccl():
    """cupy's NCCL module; FailedPrecondition when cupy is not installed."""
    try:
        from cupy.cuda import nccl
    except ImportError as error:
        raise FailedPrecondition("the nccl weight-sync transport needs cupy with NCCL "
                                 "(pip install cupy-cuda12x); use weight_sync.transport=gloo or grpc") from error
    return nccl


def encode_unique_id(unique_id: bytes | tuple[int, ...]) -> bytes:
    """cupy's unique id -> the 128 bytes WeightSyncGroup.nccl_unique_id carries. cupy >= 14 returns
    bytes already; cupy 13 a tuple of 128 C chars as ints (signed where C's char is)."""
    values = list(unique_id)
    if len(values) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(values)}")
    return bytes(v & 0xFF for v in values)


def c_char_is_signed(machine: str | None = None) -> bool:
    """Whether C's plain `char` is signed on this machine's ABI: on x86 it is; on Arm, POWER and
    IBM Z it is unsigned. cupy 13's NcclCommunicator converts each int of the id to a char and
    refuses one out of that char's range (OverflowError)."""
    machine = (machine or platform.machine()).lower()
    return not machine.startswith(("aarch64", "arm", "ppc", "s390"))


def cupy_unique_id(data: bytes, cupy_version: str, char_signed: bool | None = None) -> bytes | tuple[int, ...]:
    """The wire's 128 bytes as the installed cupy's NcclCommunicator takes them: bytes from cupy 14
    on (`bytes commId`), a tuple of C chars as ints before (`tuple commId`)."""
    if len(data) != UNIQUE_ID_BYTES:
        raise FailedPrecondition(f"nccl_unique_id has {len(data)} bytes, expected {UNIQUE_ID_BYTES}")
    if int(cupy_version.split(".")[0]) >= 14:
        return bytes(data)
    signed = c_char_is_signed() if char_signed is None else char_signed
    return tuple(b - 256 if signed and b > 127 else b for b in data)


def new_unique_id() -> bytes:
    """A fresh NCCL unique id (rank 0 only), ready for WeightSyncGroup.nccl_unique_id."""
    return encode_unique_id(cupy_nccl().get_unique_id())


class NcclTransport:
    """One rank of an NCCL weight-sync group on `device`; buffers must live on that GPU."""

    def __init__(self, group: SyncGroup, rank: int, device: torch.device):
        """Builds the communicator: blocks until every rank has joined, or fails after the timeout."""
        if device.type != "cuda":
            raise FailedPrecondition(f"the nccl weight-sync transport needs a CUDA device, this rank has {device}")
        nccl = cupy_nccl()
        import cupy  # loaded by cupy_nccl()

        self.group, self.rank, self.device = group, rank, device
        self._nccl = nccl
        unique_id = cupy_unique_id(group.nccl_unique_id, cupy.__version__)
        made: list = []

        def init():
            with cupy.cuda.Device(device.index or 0):
                try:
                    made.append(nccl.NcclCommunicator(group.world_size, unique_id, rank))
                except Exception as error:  # handed to the waiting thread
                    made.append(error)

        thread = threading.Thread(target=init, name=f"nccl-join-{group.group_id}", daemon=True)
        thread.start()
        thread.join(group.timeout_s)
        if not made:  # the thread stays blocked inside NCCL; it holds no lock of ours
            raise DeadlineExceeded(f"joining NCCL weight-sync group {group.group_id} as rank {rank}: not every "
                                   f"rank joined within weight_sync.timeout_s={group.timeout_s:g}")
        if isinstance(made[0], Exception):
            raise Unavailable(f"joining NCCL weight-sync group {group.group_id}: {made[0]}") from made[0]
        self._comm = made[0]
        self._stream = torch.cuda.Stream(device)

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Rank 0 sends `buffer` (uint8, on this GPU); the others receive into theirs. Blocking."""
        if buffer.device != self.device:
            raise ValueError(f"NCCL buffer on {buffer.device}, the group's device is {self.device}")
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the buffer's writes come first
        with torch.cuda.device(self.device):
            self._comm.bcast(buffer.data_ptr(), buffer.numel(), self._nccl.NCCL_UINT8, 0, self._stream.cuda_stream)
        deadline = time.monotonic() + self.group.timeout_s
        while not self._stream.query():
            self._check_async_error()
            if time.monotonic() > deadline:
                self._comm.abort()
                self._comm = None
                raise DeadlineExceeded(f"NCCL weight-sync group {self.group.group_id} rank {self.rank}: broadcast "
                                       f"made no progress within weight_sync.timeout_s={self.group.timeout_s:g}")
            time.sleep(0.001)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _check_async_error(self) -> None:
        try:
            self._comm.check_async_error()
        except self._nccl.NcclError as error:  # a peer died or the network failed
            self._comm.abort()
            self._comm = None
            raise Unavailable(f"NCCL weight-sync group {self.group.group_id} rank {self.rank}: {error}") from error

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
