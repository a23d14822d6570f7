"""How new weights reach the vLLM engine's worker processes; the engine (rlfabric.rollout.vllm_engine) then
switches generation to them.

- A load (swap_weights) is staged in shared memory as a safetensors file (stage_weights), which every worker
  reads (rlfabric_load_weights_file, rlfabric.rollout.vllm_worker).
- A LoRA adapter version is staged as a peft directory (vllm_worker.stage_adapter, its settings from
  adapter_config), which vLLM's LoRA API adds.
- A weight sync over gloo or nccl lands in the worker process itself (WorkerSync): the worker joins the actor's
  group (rlfabric_sync_join) and receives on a thread of its own (rlfabric_sync_start / _poll) while generation
  goes on; this process drives it through vLLM's collective_rpc. With tensor parallelism TP rank 0 forwards each
  bucket to its peers over the replica's own group (rlfabric.weight_sync.relay), whose store this process hosts.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path

import grpc
import torch

from rlfabric.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    RlfabricError,
    Unavailable,
    error_for_code,
)
from rlfabric.core.storage import create_private_file
from rlfabric.weight_sync.gloo import master_store
from rlfabric.weight_sync.manifest import AdapterSpec, Manifest, SyncGroup, parse_adapter_tensor_name
from rlfabric.weight_sync.phases import SyncPhases
from rlfabric.weight_sync.receiver import SLACK_S
from rlfabric.weight_sync.relay import relay_group

RELAY_HOST = "127.0.0.1"  # a TP replica's workers are processes of this node
SYNC_POLL_S = 0.02


def staging_path(directory: str, kind: str, suffix: str = "") -> Path:
    """A new name in rollout.weight_staging_dir for what this process stages ("weights", "lora")."""
    return Path(directory) / f"rlfabric-{kind}-{os.getpid()}-{uuid.uuid4().hex}{suffix}"


def stage_weights(named: dict[str, torch.Tensor], path: Path) -> None:
    """Writes the tensors to a new file only this user can read (create_private_file): /dev/shm is shared
    by every user of the machine, and the weights are the policy being trained."""
    from safetensors.torch import save_file

    create_private_file(path)
    save_file(named, str(path))  # truncates and writes the file just made, keeping its mode


def adapter_config(adapter: AdapterSpec, model: str, names: Iterable[str]) -> dict:
    """adapter_config.json of a staged version: peft's fields vLLM reads, with the layers it adapts."""
    modules = sorted({parse_adapter_tensor_name(name)[0].rsplit(".", 1)[-1] for name in names})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.rank,
            "lora_alpha": adapter.alpha, "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None,
            "base_model_name_or_path": model}


class WorkerSync:
    """The actor's weight-sync group as vLLM's workers hold it (gloo, nccl), driven from the engine's process.
    `group` is the one they joined; None when none is (or the group is grpc: its bytes arrive in this process)."""

    def __init__(self, tensor_parallel_size: int):
        self.tensor_parallel_size = tensor_parallel_size
        self.group: SyncGroup | None = None
        self._relay_store = None  # tensor parallelism over gloo: the store of the replica's own group

    async def join(self, llm, group: SyncGroup, rank: int) -> None:
        """The workers join `group` as `rank` (with tensor parallelism TP rank 0 does, and relays to its peers)."""
        self.group = None
        relay = b""
        if self.tensor_parallel_size > 1:
            relay = (await asyncio.to_thread(self._open_relay_group, group)).to_proto().SerializeToString()
        try:
            raise_first_failure(await worker_call(llm, group.timeout_s, "rlfabric_sync_join",
                                                  group.to_proto().SerializeToString(), rank, relay))
        except BaseException:
            self._relay_store = None
            raise
        self.group = group

    def _open_relay_group(self, group: SyncGroup) -> SyncGroup:
        """The replica's own group over which TP rank 0 forwards the actor's buckets to its TP peers
        (rlfabric.weight_sync.relay): gloo on a store this process hosts on loopback (vLLM's "mp" workers are
        on this node), nccl with a new unique id."""
        tp = self.tensor_parallel_size
        self._relay_store = None  # an earlier group's
        if group.transport == "nccl":
            from rlfabric.weight_sync.nccl import new_unique_id

            return relay_group(group, tp, nccl_unique_id=new_unique_id())
        relay_group(group, tp)  # FailedPrecondition for a transport a TP replica cannot relay
        self._relay_store = master_store(RELAY_HOST, 0, tp, timedelta(seconds=group.timeout_s))
        return relay_group(group, tp, RELAY_HOST, self._relay_store.port)

    def check_group(self, manifest: Manifest) -> None:
        if manifest.group_id != self.group.group_id:
            raise FailedPrecondition(f"manifest is for weight-sync group {manifest.group_id!r}, this replica "
                                     f"joined {self.group.group_id!r}")

    async def receive(self, llm, manifest: Manifest) -> SyncPhases:
        """The workers receive the manifest's buckets on their own threads (generation goes on meanwhile);
        returns once all have them, with the slowest worker's phases. A failed collective leaves the group."""
        group = self.group
        raise_first_failure(await worker_call(llm, group.timeout_s, "rlfabric_sync_start",
                                              manifest.to_proto().SerializeToString()))
        deadline = time.monotonic() + group.timeout_s + SLACK_S
        while True:
            outcomes = await worker_call(llm, group.timeout_s, "rlfabric_sync_poll")
            if all(o["state"] == "done" for o in outcomes):
                break
            if any(o["state"] == "error" for o in outcomes):
                if any(o["code"] != "INVALID_ARGUMENT" for o in outcomes if o["state"] == "error"):
                    self.group = None  # a failed collective: the worker left the group
                raise_first_failure(outcomes)
            if time.monotonic() > deadline:
                self.group = None
                raise DeadlineExceeded(f"weights did not arrive within weight_sync.timeout_s={group.timeout_s:g}")
            await asyncio.sleep(SYNC_POLL_S)
        return SyncPhases.slowest(SyncPhases(**o.get("phases", {})) for o in outcomes)

    async def leave(self, llm) -> None:
        if self.group is not None and llm is not None:
            self.group = None
            await worker_call(llm, 30.0, "rlfabric_sync_leave")
        self._relay_store = None


def raise_first_failure(outcomes: list[dict]) -> None:
    """Raises the domain error of the first worker outcome that failed (rlfabric.rollout.vllm_worker)."""
    for outcome in outcomes:
        if outcome["state"] == "error":
            code = getattr(grpc.StatusCode, outcome["code"], grpc.StatusCode.UNAVAILABLE)
            raise error_for_code(code, f"vllm worker: {outcome['message']}")


async def worker_call(llm, timeout_s: float, method: str, *args):
    """One RlfabricWorkerExtension method on every worker, within the sync's timeout (plus slack)."""
    try:
        return await asyncio.wait_for(llm.collective_rpc(method, args=args), timeout_s + SLACK_S)
    except TimeoutError:
        raise DeadlineExceeded(f"vllm worker call {method} took longer than {timeout_s + SLACK_S:g} s") from None
    except RlfabricError:
        raise
    except Exception as error:
        raise Unavailable(f"vllm worker call {method} failed: {type(error).__name__}: {error}") from error
