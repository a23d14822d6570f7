"""The torch-group transport: a torch.distributed process group built the way SGLang builds its
weight-update group, so an SGLang server can be one of the receivers.

SGLang's POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
group_name, backend} makes each of the server's ranks join a process group through torch's tcp://
rendezvous at master_address:master_port, with the group's keys under PrefixStore(group_name); its
/update_weights_from_distributed then receives broadcasts from rank 0 of that group. The actor is that
rank 0: it hosts the TCPStore (listening on its weight-sync host only, as for the gloo transport) and
builds its side the same way. Our own receivers (hf, vLLM workers, the reference) join the same way too,
so one group serves a mesh that mixes engines. The actor opens such groups (SyncGroup.torch_group)
when rollout.engine is sglang.

Backend: NCCL for a group whose transport is nccl (buffers on the GPU), gloo otherwise (CPU buffers).
A collective that fails or passes the group's timeout breaks the group, as with the other transports.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from rlfabric.weight_sync.gloo import collective_error, master_store
from rlfabric.weight_sync.manifest import SyncGroup


def join_process_group(backend: str, host: str, port: int, world_size: int, rank: int, group_name: str,
                       timeout_s: float, store: dist.Store | None = None):
    """This process's rank of the group `group_name` (SGLang's construction): through the tcp:// rendezvous
    at host:port, or over `store` (rank 0's own connection to the store it hosts)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    return group


def host_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCPStore on a free port of `host` (the rendezvous address the receivers are given)."""
    return master_store(host, 0, world_size, timedelta(seconds=timeout_s))


class TorchGroupTransport:
    """One rank of a torch-group weight-sync group; `broadcast` moves a buffer from rank 0 to all."""

    def __init__(self, group: SyncGroup, rank: int, device: torch.device, store: dist.Store | None = None):
        """Joins: blocks until every rank has joined, or fails after group.timeout_s. Rank 0 passes the
        store it hosts; the others reach it through the rendezvous at group.store_host:store_port."""
        self.group, self.rank = group, rank
        self.backend = "nccl" if group.transport == "nccl" else "gloo"
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        self._store = store
        try:
            self._pg = join_process_group(self.backend, group.store_host, group.store_port, group.world_size, rank,
                                          group.group_id, group.timeout_s, store)
        except (RuntimeError, ValueError) as error:
            raise collective_error(error, f"joining weight-sync group {group.group_id} as rank {rank}",
                                   group.timeout_s) from error

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Rank 0 sends `buffer`; every other rank receives into its `buffer` (same size). Blocking."""
        try:
            dist.broadcast(buffer, group_src=0, group=self._pg)
        except RuntimeError as error:
            raise collective_error(error, f"weight-sync group {self.group.group_id} rank {self.rank} broadcast",
                                   self.group.timeout_s) from error

    def close(self) -> None:
        """Leaves the group (torch forgets its name) and drops the store connection."""
        if self._pg is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._pg)
        self._pg = None
        self._store = None
