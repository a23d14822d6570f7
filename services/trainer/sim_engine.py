"""The simulated trainer (<role>.engine sim): the actor's, reference's or critic's engine without a model.

Requests are validated as the torch engine validates them, then take the time the cost model gives
(rlfabric.sim.trainer_cost: 6 x parameters x tokens FLOPs for an update, 2 x for a forward). Log-probs and values
are placeholders (log-prob -1 and value 0 at every position). Checkpoints are real directories holding the
counters and the tiny payload, written in the modelled time of the virtual state. Weight sync runs the real
protocol (TrainerWeightSync: groups, manifests, buckets, checksums) over the tiny payload of rlfabric.sim.weights,
and adds the modelled gather and transfer of the virtual weights to the actor's phases.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from rlfabric.core.config import RunConfig
from rlfabric.core.errors import InvalidArgument
from rlfabric.core.storage import StorageRoot
from rlfabric.sim.trainer_cost import TrainerCost
from rlfabric.sim.weights import PAYLOAD_NAME, PAYLOAD_SHAPE, SyncCost, payload
from rlfabric.trainer import checkpoint as ckpt
from rlfabric.trainer.batch import SequenceBatch, validate_batch
from rlfabric.trainer.engine import EngineStatus
from rlfabric.trainer.ragged import RaggedBatch
from rlfabric.trainer.roles import role_spec
from rlfabric.trainer.weight_sync import TrainerWeightSync
from rlfabric.weight_sync.sender import BroadcastResult

log = logging.getLogger("rlfabric.trainer.sim")
LOG_PROB = -1.0  # the placeholder log-prob of every token
POLICY_FLOATS = ("old_log_probs", "advantages", "ref_log_probs", "rollout_is_weights")
VALUE_FLOATS = ("values", "returns")
SIM_MAX_LENGTH = 1 << 20  # positions a simulated model takes


@dataclass
class SimWorker:
    """What weight sync and the in-process clients read of rank 0's worker, for a model that is not there."""

    num_parameters: int
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    lora: None = None
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=lambda: {PAYLOAD_NAME: PAYLOAD_SHAPE})
    updates: int = 0
    optimizer_steps: int = 0


class SimTrainerEngine:
    """Rank 0 of a simulated role: the TrainerEngine's interface, its time modelled."""

    def __init__(self, role: str, config: RunConfig, registry: CollectorRegistry | None = None):
        self.role = role
        self.spec = role_spec(role)
        self.config = config
        self.section = self.spec.section(config)
        self.model_path = config.model.path or "sim"
        self.storage = StorageRoot.from_config(config)
        self.cost = TrainerCost.of(config)
        self.sync_cost = SyncCost.of(config)
        self.worker: SimWorker | None = None
        self.weights_changes = 0
        self._lock = asyncio.Lock()  # one request at a time, as the torch engine's one thread
        self.weight_sync = SimWeightSync(self, None, registry or CollectorRegistry())

    async def start(self) -> None:
        self.worker = SimWorker(self.cost.parameters)
        log.info("simulated model ready", extra={"fields": {"role": self.role, "parameters": self.cost.parameters,
                                                            "gpus": self.config.sim.trainer.gpus}})

    async def stop(self) -> None:
        await self.weight_sync.stop()

    async def _take(self, seconds: float) -> float:
        """Holds the engine for `seconds` (modelled); returns the real seconds it took."""
        started = time.perf_counter()
        async with self._lock:
            await asyncio.sleep(seconds)
        return time.perf_counter() - started

    # -- requests ---------------------------------------------------------------------------------

    async def compute(self, tensors: dict[str, torch.Tensor], temperature: float = 1.0,
                      with_entropy: bool = False, base_model: bool = False,
                      with_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        """Placeholder log_probs [+ entropy] [+ sum_pi_squared: that of a uniform distribution over 1 / p tokens,
        p = exp(log_probs)] or values, each [B, T] float32, after a forward's modelled time."""
        if not temperature > 0:
            raise InvalidArgument(f"temperature must be a positive number, got {temperature}")
        batch = self._validate(tensors)
        await self._take(self.cost.forward_seconds(batch.num_tokens()))
        shape = batch["responses"].shape
        if self.spec.value_head:
            return {"values": torch.zeros(shape)}
        outputs = {"log_probs": torch.full(shape, LOG_PROB)}
        if with_entropy:
            outputs["entropy"] = torch.full(shape, -LOG_PROB)
        if with_sum_pi_squared:
            outputs["sum_pi_squared"] = torch.full(shape, math.exp(LOG_PROB))
        return outputs

    async def update(self, tensors: dict[str, torch.Tensor] | RaggedBatch, global_step: int = 0) -> dict[str, float]:
        """One modelled update; VeRL-named metrics (placeholders) and sim/<role>/* (the model's figures). Streamed
        rows are checked as they came, never padded: the model reads only their token count."""
        floats = POLICY_FLOATS if self.spec.trains_policy else VALUE_FLOATS
        required = ("advantages",) if self.spec.trains_policy else VALUE_FLOATS
        if isinstance(tensors, RaggedBatch):
            tensors.check(self._vocab_size(), required, floats, SIM_MAX_LENGTH)
            batch = tensors
        else:
            batch = self._validate(tensors, required, floats)
        rows = self.section.ppo_mini_batch_size * self.config.rollout.n
        if batch.num_rows % rows:
            raise InvalidArgument(f"batch has {batch.num_rows} rows; {self.role} updates need a multiple of the "
                                  f"mini-batch of {rows} rows")
        tokens, epochs = batch.num_tokens(), self.section.ppo_epochs
        modelled = self.cost.update_seconds(tokens, epochs)
        seconds = await self._take(modelled)
        self.worker.updates += 1
        self.worker.optimizer_steps += epochs * batch.num_rows // rows
        self.weights_changes += 1
        role = self.role
        return {f"{role}/grad_norm": 0.0, f"{role}/lr": self.section.lr, f"{role}/update_s": seconds,
                f"sim/{role}/update_modelled_s": modelled, f"sim/{role}/tokens": float(tokens),
                f"sim/{role}/parameters": float(self.cost.parameters), "sim/simulated": 1.0,
                "sim/time_scale": self.config.sim.time_scale}

    def _validate(self, tensors, required: tuple[str, ...] = (), floats: tuple[str, ...] = ()) -> SequenceBatch:
        return validate_batch(dict(tensors), self._vocab_size(), required_floats=required, optional_floats=floats,
                              max_length=SIM_MAX_LENGTH)

    def _vocab_size(self) -> int:
        return self.config.sim.rollout.vocab_size or 1 << 31  # any id the rollout drew

    # -- checkpoints and exports ------------------------------------------------------------------

    async def save_checkpoint(self, path: str) -> int:
        target = self.storage.resolve(path, "checkpoint path")
        await self._take(self.cost.checkpoint_seconds(self.spec.trainable))
        worker = self.worker
        counters = {"updates": worker.updates, "optimizer_steps": worker.optimizer_steps}
        meta = {"role": self.role, "model": self.model_path, "world_size": 1, "simulated": True,
                "virtual_bytes": self.cost.checkpoint_bytes(self.spec.trainable), **counters}
        state = ckpt.Checkpoint(payload(worker.updates), {}, {**counters, "rng": []}, meta)
        return await asyncio.to_thread(ckpt.save_checkpoint, target, state)

    async def load_checkpoint(self, path: str) -> int:
        checkpoint = await asyncio.to_thread(ckpt.load_checkpoint, self.storage.resolve(path, "checkpoint path"),
                                             self.role)
        if not checkpoint.meta.get("simulated"):
            raise InvalidArgument(f"checkpoint {path} holds a real model; the simulated {self.role} reads only "
                                  "simulated checkpoints")
        await self._take(self.cost.checkpoint_seconds(self.spec.trainable))
        self.worker.updates = int(checkpoint.trainer_state["updates"])
        self.worker.optimizer_steps = int(checkpoint.trainer_state["optimizer_steps"])
        self.weights_changes += 1
        return self.worker.optimizer_steps

    async def export_hf(self, path: str) -> int:
        """A directory that says the policy was simulated (there are no weights to export)."""
        target = self.storage.resolve(path, "export path")

        def write(directory: Path) -> None:
            note = {"simulated": True, "role": self.role, "parameters": self.cost.parameters,
                    "updates": self.worker.updates}
            (directory / "simulated.json").write_text(json.dumps(note, indent=2))
            (directory / ckpt.EXPORT_MARKER).write_text(json.dumps({"source": self.model_path}))

        return await asyncio.to_thread(ckpt.write_atomically, target, write, ckpt.is_export)

    def status(self) -> EngineStatus:
        worker = self.worker
        return EngineStatus(model=self.model_path, world_size=1, optimizer_step=worker.optimizer_steps if worker else 0,
                            num_parameters=self.cost.parameters)

    # -- the weights (weight sync, the in-process mesh) -------------------------------------------

    def policy_weights(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        return payload(self.worker.updates)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        return self.policy_weights()

    def check_names(self, tensors: dict[str, torch.Tensor], what: str, expected=None) -> None:
        if set(tensors) != {PAYLOAD_NAME}:
            raise InvalidArgument(f"{what} does not fit the simulated model: {sorted(tensors)[:5]}")

    def load_mixed(self, sent: dict[str, torch.Tensor], alpha: float) -> None:
        self.weights_changes += 1

    async def gather_weights(self) -> dict[str, torch.Tensor]:
        """The payload, after the modelled gather and transfer (the in-process mesh hands it over directly)."""
        await self._take(self.sync_cost.gather_s + self.sync_cost.wire_s)
        return self.policy_weights()

    async def gather_adapter(self) -> dict[str, torch.Tensor]:
        return await self.gather_weights()


class SimWeightSync(TrainerWeightSync):
    """The real weight-sync protocol over the tiny payload, its actor phases lengthened by the modelled gather
    (prepare) and transfer (broadcast) of the virtual weights."""

    async def _on_torch_thread(self, fn, *args):
        return fn(*args)  # nothing heavy: the payload is a few bytes

    async def prepare(self, group_id: str, version: int, delta_base_version: int | None = None):
        await self.engine._take(self.engine.sync_cost.gather_s)
        return await super().prepare(group_id, version, delta_base_version)

    async def broadcast(self, group_id: str, version: int) -> BroadcastResult:
        cost = self.engine.sync_cost
        started = time.perf_counter()
        result = await super().broadcast(group_id, version)
        await asyncio.sleep(max(0.0, cost.wire_s - (time.perf_counter() - started)))
        seconds = time.perf_counter() - started
        return replace(result, seconds=seconds, phases=replace(result.phases, wire=max(result.phases.wire, cost.wire_s)))
