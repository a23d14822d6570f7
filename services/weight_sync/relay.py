"""Weight sync into a tensor-parallel replica: the actor sends each bucket once per replica, and the replica's
TP rank 0 forwards it to its TP peers.

    local = relay_group(group, tp, store_port)          # the replica's own group: same id and transport, tp ranks
    head = ReplicaRelay(WeightReceiver(group, rank).transport, open_transport(local, 0, device))   # TP rank 0
    peer = WeightReceiver(local, tp_rank, device)        # TP ranks 1..tp-1: their head is their sender

Why not every TP rank in the actor's group (vLLM's RLHF example): the actor's broadcast would then reach T ranks
per replica, and gloo's broadcast tree sends from the actor's sockets once per child, so the bytes leaving the
actor grow with T. TP ranks share a node (vLLM's "mp" executor), where the forward stays on loopback or
shared memory (CPU) or NVLink (GPU); the actor's link carries one copy per replica.

Why not vLLM's own TP group: the receive runs on a thread while the engine steps, and the engine's forward
passes use that group; a second collective on it from another thread could interleave with theirs. The
replica's own group is used by the sync alone.

Every broadcast the receiver makes (buckets, then the actor's CRC-32s) goes through ReplicaRelay, so the peers
run the receiver's protocol unchanged and check their copies against the actor's CRC-32s.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rlfabric.core.errors import FailedPrecondition
from rlfabric.weight_sync.manifest import SyncGroup

RELAYED_TRANSPORTS = ("gloo", "nccl")  # groups a TP replica relays (a torch group or cuda_ipc it cannot)


def relay_group(group: SyncGroup, tensor_parallel_size: int, store_host: str = "", store_port: int = 0,
                nccl_unique_id: bytes = b"") -> SyncGroup:
    """The replica's own group: the actor's group id (manifests name it) and transport, its TP ranks as ranks
    (TP rank 0, which receives from the actor, is its sender); a store of the replica's (gloo) or a new NCCL id."""
    if group.transport not in RELAYED_TRANSPORTS or group.torch_group:
        kind = "a torch group" if group.torch_group else f"the {group.transport} transport"
        raise FailedPrecondition(f"weight-sync group {group.group_id} uses {kind}, which a tensor-parallel replica "
                                 f"cannot relay to its TP ranks (rollout.tensor_parallel_size {tensor_parallel_size}): "
                                 f"use weight_sync.transport {', '.join(RELAYED_TRANSPORTS)} or grpc")
    return dataclasses.replace(group, world_size=tensor_parallel_size, store_host=store_host, store_port=store_port,
                               nccl_unique_id=nccl_unique_id)


class ReplicaRelay:
    """TP rank 0's transport: each broadcast is received from the actor's group, then forwarded to the TP peers
    over the replica's group on a thread of its own, while the next one arrives. flush() waits for the last."""

    def __init__(self, upstream, local):
        self.upstream, self.local = upstream, local
        self.device = upstream.device
        self._forwarder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-relay")
        self._forwards: list[Future] = []

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Receives `buffer` from the actor; its forward to the peers starts at once (the buffer is not
        written again before flush: the receiver gives each broadcast a buffer of its own)."""
        self._raise_failed_forward()
        self.upstream.broadcast(buffer)
        self._forwards.append(self._forwarder.submit(self.local.broadcast, buffer))

    def flush(self) -> None:
        """Waits until the peers hold every buffer received so far; raises the first forward's failure."""
        forwards, self._forwards = self._forwards, []
        for forward in forwards:
            forward.result()

    def _raise_failed_forward(self) -> None:
        for forward in self._forwards:
            if forward.done() and forward.exception() is not None:
                self.flush()

    def close(self) -> None:
        self._forwarder.shutdown(wait=False, cancel_futures=True)
        self.upstream.close()
        self.local.close()
