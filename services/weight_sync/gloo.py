"""The gloo transport: a torch.distributed ProcessGroupGloo over TCP, built directly on a TCPStore.

The group is stateless with respect to torch.distributed: it is not the default process group (the
actor's FSDP ranks already use that), so any number of them can come and go in one process, and a
vLLM worker can join one from a worker-extension method. Rank 0 (the sender) hosts the TCPStore;
every rank, rank 0 included, connects to it, then gloo connects every pair of ranks. Closing the
store ends a rendezvous still waiting for a rank: its joins fail at once.

Every operation is bounded by the group's timeout: a peer that dies makes the others fail with an
error (at once for the sender, which sees the connection close; within the timeout for the others).
A group that failed once is broken for good: close it and open a new one.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from rlfabric.core.errors import DeadlineExceeded, Unavailable
from rlfabric.core.host import is_loopback
from rlfabric.weight_sync.manifest import SyncGroup

CHUNK_BYTES = 64 << 20


def _device(host: str):
    """The gloo device (the address this rank's sockets bind and advertise)."""
    from torch.distributed import ProcessGroupGloo

    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return ProcessGroupGloo.create_device(interface=interface.split(",")[0])
    try:
        address = socket.gethostbyname(host)  # a host name that resolves to loopback counts too
    except OSError:
        address = ""
    if is_loopback(address):  # everyone is on this machine: stay on loopback whatever the hostname says
        return ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return ProcessGroupGloo.create_default_device()


def master_store(host: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore server listening on `host` only (port 0 = a free one).

    TCPStore's own socket listens on every interface whatever host it is given (torch 2.13, both
    backends), so the store would take connections on any network the machine is on. Here the socket
    is bound to `host` and handed over (the store owns and closes it)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.create_server(address, family=family)
    except OSError as error:
        raise OSError(error.errno, f"cannot listen on {host}:{port} for a TCPStore ({error.strerror}); "
                                   "the host must name an address of this machine") from error
    return dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
                         timeout=timeout, master_listen_fd=listener.detach())


def collective_error(error: Exception, what: str, timeout_s: float) -> Exception:
    """A gloo RuntimeError as the domain error a caller can act on."""
    text = str(error).split("\n")[0]
    if "Timed out" in text or "timeout" in text.lower():
        return DeadlineExceeded(f"{what}: no progress within weight_sync.timeout_s={timeout_s:g} ({text})")
    return Unavailable(f"{what}: a peer of the weight-sync group failed ({text})")


class GlooTransport:
    """One rank of a gloo weight-sync group; `broadcast` moves a CPU buffer from rank 0 to all."""

    device = torch.device("cpu")

    def __init__(self, group: SyncGroup, rank: int, store: dist.TCPStore | None = None):
        """Joins the group: blocks until every rank has joined, or fails after group.timeout_s.
        `store`: this rank's connection to the group's store, if made already (else made here)."""
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self.group, self.rank = group, rank
        timeout = timedelta(seconds=group.timeout_s)
        try:
            self._store = store or self.connect_store(group)
            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [_device(group.store_host)]
            self._pg = ProcessGroupGloo(PrefixStore(group.group_id, self._store), rank, group.world_size, options)
        except RuntimeError as error:
            raise collective_error(error, f"joining weight-sync group {group.group_id} as rank {rank}",
                                   group.timeout_s) from error

    @staticmethod
    def connect_store(group: SyncGroup) -> dist.TCPStore:
        """A client connection to the group's store (rank 0's server included)."""
        return dist.TCPStore(group.store_host, group.store_port, group.world_size, is_master=False,
                             timeout=timedelta(seconds=group.timeout_s))

    @classmethod
    def host_store(cls, host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's store on a free port of `host` (it does not wait for the receivers here)."""
        return master_store(host, 0, world_size, timedelta(seconds=timeout_s))

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Rank 0 sends `buffer`; every other rank receives into its `buffer` (same size). Blocking.

        The buffer goes as CHUNK_BYTES slices, all issued before waiting: gloo works on several at
        once, so with two or more receivers one slice travels down the broadcast tree while the next
        leaves the root (about 1.6x faster to 2 receivers on loopback than one whole-bucket broadcast)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            works = [self._pg.broadcast([buffer[start : start + CHUNK_BYTES]], options)
                     for start in range(0, buffer.numel(), CHUNK_BYTES)]
            for work in works:
                work.wait()
        except RuntimeError as error:
            raise collective_error(error, f"weight-sync group {self.group.group_id} rank {self.rank} broadcast",
                                   self.group.timeout_s) from error

    def broadcast_message(self, message: bytes, size: int) -> bytes:
        """Rank 0's `message` to every rank, as one broadcast of `size` bytes (a 4-byte length, the message,
        padding): what every rank returns. Unavailable on rank 0 for a message too long, on the others for
        a length that does not fit (a sender that is not ours)."""
        buffer = torch.zeros(size, dtype=torch.uint8)
        if self.rank == 0:
            if len(message) > size - 4:
                raise Unavailable(f"weight-sync group {self.group.group_id}: a control message of {len(message)} "
                                  f"bytes exceeds {size - 4}")
            buffer[:4] = torch.frombuffer(bytearray(len(message).to_bytes(4, "little")), dtype=torch.uint8)
            buffer[4 : 4 + len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        self.broadcast(buffer)
        data = buffer.numpy().tobytes()
        length = int.from_bytes(data[:4], "little")
        if length > size - 4:
            raise Unavailable(f"weight-sync group {self.group.group_id}: a control message announces {length} "
                              f"bytes in a buffer of {size}")
        return data[4 : 4 + length]

    def all_sum(self, value: int) -> int:
        """The sum of every rank's `value` (blocking): how the ranks of a group tell each other, in step,
        how many of them failed."""
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        try:
            self._pg.allreduce([tensor], options).wait()
        except RuntimeError as error:
            raise collective_error(error, f"weight-sync group {self.group.group_id} rank {self.rank} all-reduce",
                                   self.group.timeout_s) from error
        return int(tensor)

    def close(self) -> None:
        """Drops the process group and the store connection (the sockets close with them)."""
        self._pg = None
        self._store = None
