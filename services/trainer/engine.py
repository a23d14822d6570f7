"""The engine behind the actor, reference and critic services: rank 0 of the role's process group.

It validates each request into a SequenceBatch, cuts it into one shard per data-parallel rank (the T ranks
of a tensor-parallel group share one), sends the shards to ranks 1..N-1 (dist.WorkerGroup) and runs its own. All torch work runs on one dedicated thread:
the event loop keeps answering health checks during a long update, and commands never interleave
(their collectives must reach every rank in the same order). Its end of weight sync is
rlfabric.trainer.weight_sync (engine.weight_sync).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from rlfabric.algorithms.plugins import check_algorithm_names
from rlfabric.core import lora
from rlfabric.core.config import RunConfig
from rlfabric.core.errors import FailedPrecondition, InvalidArgument
from rlfabric.core.host import cpu_thread_budget, current_rss_bytes
from rlfabric.core.metrics import service_counter, service_gauge, service_histogram
from rlfabric.core.storage import StorageRoot
from rlfabric.trainer import checkpoint as ckpt
from rlfabric.trainer import tensor_parallel
from rlfabric.trainer.batch import SequenceBatch, shard_rows, validate_batch
from rlfabric.trainer.dist import Command, WorkerGroup, run_command
from rlfabric.trainer.models import rank_device
from rlfabric.trainer.ragged import RaggedBatch
from rlfabric.trainer.roles import role_spec
from rlfabric.trainer.weight_sync import TrainerWeightSync
from rlfabric.trainer.worker import RankWorker
from rlfabric.weight_sync.devices import DeviceReport, report_of

log = logging.getLogger("rlfabric.actor")
MB = 1 << 20
WEIGHT_CHANGES = (Command.UPDATE, Command.SCATTER_STATE, Command.LOAD_WEIGHTS)  # commands that change the weights


@dataclass
class EngineStatus:
    model: str
    world_size: int
    optimizer_step: int
    num_parameters: int
    device: DeviceReport = DeviceReport()  # rank 0's: where weight syncs start (actor) or land (reference)


class TrainerEngine:
    """Rank 0 of one role ("actor", "reference" or "critic")."""

    def __init__(self, role: str, config: RunConfig, registry: CollectorRegistry | None = None):
        self.role = role
        self.spec = role_spec(role)
        self.config = config
        self.section = self.spec.section(config)
        self.world_size = self.section.world_size
        self.tensor_parallel_size = self.section.tensor_parallel_size
        self.data_parallel_size = self.world_size // self.tensor_parallel_size
        self.model_path = self.spec.model_path(config)
        self.storage = StorageRoot.from_config(config)  # where RPC-given checkpoint and export paths may point
        self.worker: RankWorker | None = None
        self.group: WorkerGroup | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{role}-engine")
        self._threads_before: int | None = None
        self._rss_peak_reset = False  # whether the resident high-water mark was reset before this update
        self.weights_changes = 0  # commands that changed the weights so far (updates, loads)
        registry = registry or CollectorRegistry()
        # the actor sends its weights, the reference receives them
        self.weight_sync = TrainerWeightSync(self, self._executor, registry)
        if self.spec.trainable:
            self._update_seconds = service_histogram(
                registry, "rlfabric_train_update_seconds", "Wall time of one update RPC inside the service.", ("role",))
            self._tokens = service_counter(
                registry, "rlfabric_train_tokens_total", "Real tokens (prompt + response) of the batches trained on.",
                ("role",))
            self._grad_norm = service_gauge(
                registry, "rlfabric_train_grad_norm", "Gradient norm of the last update (mean over its steps).",
                ("role",))

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        self._check_config()
        await self._run(self._start)

    def _check_config(self) -> None:
        tensor_parallel.check_model_split(self.config, self.role)  # ConfigError naming <role>.tensor_parallel_size
        if not self.spec.trainable:
            return
        rows = self.section.ppo_mini_batch_size * self.config.rollout.n
        if rows % self.data_parallel_size:
            raise ValueError(f"{self.role}: a mini-batch of {rows} rows (ppo_mini_batch_size "
                             f"{self.section.ppo_mini_batch_size} x rollout.n {self.config.rollout.n}) does not "
                             f"split over {self.data_parallel_size} data-parallel ranks (world_size "
                             f"{self.world_size} / tensor_parallel_size {self.tensor_parallel_size})")
        if self.spec.trains_policy:
            check_algorithm_names(self.config)  # after its plugin modules: actor.loss_mode, actor.kl_loss_type

    def _start(self) -> None:
        device = rank_device(0)
        if device.type == "cpu" and self.world_size > 1:  # the ranks share this machine's cores
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, cpu_thread_budget() // self.world_size))
        started = time.perf_counter()
        self.group = WorkerGroup(self.role, self.config, self.world_size, device)
        self.group.start()
        self.worker = RankWorker(self.role, self.config, 0, self.world_size, device)
        log.info("model loaded", extra={"fields": {
            "role": self.role, "model": self.model_path, "world_size": self.world_size, "device": str(device),
            "parameters": self.worker.num_parameters, "seconds": round(time.perf_counter() - started, 2)}})

    async def stop(self) -> None:
        await self.weight_sync.stop()
        if self.group is not None:
            await self._run(self.group.stop)
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        self._executor.shutdown(wait=False)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _command(self, command: Command, params: list[float], shards: list[SequenceBatch | None], state=None):
        dead = self.group.dead_ranks()
        if dead:
            raise FailedPrecondition(f"{self.role}: rank(s) {', '.join(dead)} died; restart the service")
        if command in WEIGHT_CHANGES:
            self.weights_changes += 1
        self.group.send(command, params, shards)
        return run_command(self.worker, self.group.channel, command, params, shards[0], state)

    # -- requests ---------------------------------------------------------------------------------

    async def compute(self, tensors: dict[str, torch.Tensor], temperature: float = 1.0,
                      with_entropy: bool = False, base_model: bool = False,
                      with_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        """log_probs [+ entropy] [+ sum_pi_squared] (actor, reference) or values (critic), each [B, T] float32.
        base_model: the actor's base model with its LoRA adapters off (the reference policy)."""
        if not (math.isfinite(temperature) and temperature > 0):
            raise InvalidArgument(f"temperature must be a positive number, got {temperature}")
        if base_model and (self.worker is None or self.worker.lora is None):
            raise FailedPrecondition(f"{self.role}: base-model log-probs need LoRA adapters (actor.lora.rank > 0); "
                                     "this service trains every weight")
        return await self._run(self._compute, tensors, temperature, with_entropy, base_model, with_sum_pi_squared)

    def _compute(self, tensors, temperature, with_entropy, base_model, with_sum_pi_squared):
        batch = validate_batch(tensors, self.worker.vocab_size, max_length=self.worker.max_length)
        shards = self._rank_shards(batch, shard_rows(batch.num_rows, self.data_parallel_size))
        return self._command(Command.COMPUTE, [temperature, float(with_entropy), float(base_model),
                                               float(with_sum_pi_squared)], shards)

    async def update(self, tensors: dict[str, torch.Tensor] | RaggedBatch, global_step: int = 0) -> dict[str, float]:
        """One UpdatePolicy / UpdateValues (an UpdatePolicyStream's rows are padded back here): VeRL-named metrics."""
        return await self._run(self._update, tensors, global_step)

    def _update(self, tensors, global_step):
        started = time.perf_counter()
        if isinstance(tensors, RaggedBatch):
            tensors = tensors.padded()
        objective = self.worker.objective
        batch = validate_batch(tensors, self.worker.vocab_size, max_length=self.worker.max_length,
                               required_floats=objective.required_floats(),
                               optional_floats=objective.float_names)
        rows = self.worker.mini_batch_rows
        if batch.num_rows % rows:
            raise InvalidArgument(
                f"batch has {batch.num_rows} rows; {self.role} updates need a multiple of the mini-batch of {rows} "
                f"rows ({self.role}.ppo_mini_batch_size {self.section.ppo_mini_batch_size} x rollout.n "
                f"{self.config.rollout.n})")
        if self.spec.trains_policy and "old_log_probs" not in batch and (batch.num_rows > rows or self.section.ppo_epochs > 1):
            raise InvalidArgument(
                f"old_log_probs is missing; it may be left out only when the update is one optimizer step "
                f"(one mini-batch of {rows} rows and actor.ppo_epochs 1), not {batch.num_rows} rows x "
                f"{self.section.ppo_epochs} epochs")
        shards = self._rank_shards(batch, shard_rows(batch.num_rows, self.data_parallel_size, rows))
        memory = self._memory_metrics("before_update")
        metrics = self._command(Command.UPDATE, [], shards)
        seconds = time.perf_counter() - started
        metrics[f"{self.role}/update_s"] = seconds
        metrics.update(memory)
        metrics.update(self._memory_metrics("after_update"))
        self._update_seconds.labels(self.role).observe(seconds)
        self._tokens.labels(self.role).inc(batch.num_tokens())
        self._grad_norm.labels(self.role).set(metrics[f"{self.role}/grad_norm"])
        log.info("update", extra={"fields": {"global_step": global_step, "rows": batch.num_rows,
                                             **{k: round(v, 6) for k, v in metrics.items()}}})
        return metrics

    def _rank_shards(self, batch: SequenceBatch, rows: list[torch.Tensor]) -> list[SequenceBatch]:
        """Rank r's shard: data-parallel rank r // T's rows (the T ranks of a tensor-parallel group share them)."""
        shards = [batch.select(index) for index in rows]
        return [shards[rank // self.tensor_parallel_size] for rank in range(self.world_size)]

    def _memory_metrics(self, phase: str) -> dict[str, float]:
        """Rank 0's memory now: memory/<role>/rss_mb/<phase> (the process's resident memory) and on a GPU
        memory/<role>/device_mb/<phase> (what torch holds allocated); after the update also the update's peaks
        (rss_mb/peak_update on Linux, device_mb/peak_update), the figures that decide whether a colocated
        rollout fits beside it."""
        metrics = {f"memory/{self.role}/rss_mb/{phase}": current_rss_bytes() / MB}
        if phase == "before_update":
            self._rss_peak_reset = reset_peak_rss()
        elif self._rss_peak_reset:  # rank 0's resident high-water mark during the update
            metrics[f"memory/{self.role}/rss_mb/peak_update"] = peak_rss_bytes() / MB
        device = rank_device(0)
        if device.type == "cuda":
            metrics[f"memory/{self.role}/device_mb/{phase}"] = torch.cuda.memory_allocated(device) / MB
            if phase == "before_update":
                torch.cuda.reset_peak_memory_stats(device)
            else:
                metrics[f"memory/{self.role}/device_mb/peak_update"] = torch.cuda.max_memory_allocated(device) / MB
        return metrics

    async def save_checkpoint(self, path: str) -> int:
        """Bytes written."""
        return await self._run(self._save_checkpoint, self.storage.resolve(path, "checkpoint path"))

    def _save_checkpoint(self, path):
        lora_config = self.worker.lora
        model_state, optimizer_state, rng = self._command(
            Command.GATHER_STATE, [1.0, float(lora_config is not None)], [None] * self.world_size)
        counters = {"updates": self.worker.updates, "optimizer_steps": self.worker.optimizer_steps}
        meta = {"role": self.role, "model": self.model_path, "world_size": self.world_size, **counters}
        if lora_config is not None:
            meta["lora"] = lora.adapter_settings(lora_config)  # the model state is the adapters only
        return ckpt.save_checkpoint(path, ckpt.Checkpoint(model_state, optimizer_state, {**counters, "rng": rng}, meta))

    async def load_checkpoint(self, path: str) -> int:
        """The optimizer step count restored."""
        return await self._run(self._load_checkpoint, self.storage.resolve(path, "checkpoint path"))

    def _load_checkpoint(self, path):
        checkpoint = ckpt.load_checkpoint(path, self.role)  # every check before any collective
        self._check_lora(checkpoint.meta, path)
        self._check_fits(checkpoint.model_state, path)
        trainer_state = checkpoint.trainer_state
        rng = trainer_state["rng"]
        restore_rng = len(rng) == self.world_size
        if not restore_rng:
            log.warning("checkpoint RNG states not restored", extra={"fields": {
                "saved_world_size": len(rng), "world_size": self.world_size}})
        params = [float(trainer_state["updates"]), float(trainer_state["optimizer_steps"]), float(restore_rng)]
        state = (checkpoint.model_state, checkpoint.optimizer_state, rng)
        self._command(Command.SCATTER_STATE, params, [None] * self.world_size, state=state)
        return self.worker.optimizer_steps

    def _check_lora(self, meta: dict, path: str) -> None:
        """A checkpoint's adapters (or their absence) must be this service's."""
        saved = meta.get("lora")
        current = lora.adapter_settings(self.worker.lora) if self.worker.lora is not None else None
        if saved != current:
            said = f"LoRA {saved}" if saved else "full weights"
            wanted = f"LoRA {current}" if current else "full weights (actor.lora.rank 0)"
            raise InvalidArgument(f"checkpoint {path} holds {said}, but this {self.role} trains {wanted}")

    def _check_fits(self, model_state: dict[str, torch.Tensor], path: str) -> None:
        expected = self.worker.checkpoint_shapes
        missing = sorted(set(expected) - set(model_state))
        if missing:
            raise InvalidArgument(f"checkpoint {path} does not fit {self.model_path}: missing {missing[:5]}")
        self.check_names(model_state, f"checkpoint {path}", expected)

    def check_names(self, tensors: dict[str, torch.Tensor], what: str,
                    expected: dict[str, tuple] | None = None) -> None:
        """InvalidArgument unless each tensor is a weight of the model (or of `expected`) in its shape."""
        expected = expected if expected is not None else self.worker.param_shapes
        unexpected = sorted(set(tensors) - set(expected))
        wrong = sorted(n for n in set(expected) & set(tensors) if tuple(tensors[n].shape) != expected[n])
        if unexpected or wrong:
            raise InvalidArgument(f"{what} does not fit {self.model_path}: unexpected {unexpected[:5]}, "
                                  f"wrong shape {wrong[:5]}")

    async def export_hf(self, path: str) -> int:
        """Bytes written."""
        return await self._run(self._export_hf, self.storage.resolve(path, "export path"))

    def _export_hf(self, path):
        """The policy as a Hugging Face model; with LoRA the merged weights, and the adapter alone in adapter/."""
        full = self._full_weights()
        lora_config = self.worker.lora
        if lora_config is None:
            return ckpt.export_hf(path, full, self.worker.hf_config, source=self.model_path)

        def write_adapter(directory):
            lora.write_adapter(directory / lora.ADAPTER_DIR, full, lora_config, self.model_path)

        merged = lora.merged_state(full, lora.scaling(lora_config))
        return ckpt.export_hf(path, merged, self.worker.hf_config, source=self.model_path, also=write_adapter)

    def status(self) -> EngineStatus:
        worker = self.worker
        return EngineStatus(model=self.model_path, world_size=self.world_size,
                            optimizer_step=worker.optimizer_steps if worker else 0,
                            num_parameters=worker.num_parameters if worker else 0,
                            device=self._device_report if worker else DeviceReport())

    @functools.cached_property
    def _device_report(self) -> DeviceReport:  # asked once the worker exists: a GPU's UUID does not change
        return report_of(self.worker.device)

    # -- the weights, as rank 0 gathers and loads them (weight sync, exports, the in-process mesh) ----

    def _full_weights(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """Every weight, gathered on rank 0 (with LoRA: PeftModel's names, adapters included); on_device: an
        unsharded model's stay on its device (worker.full_state)."""
        model_state, _, _ = self._command(Command.GATHER_STATE, [0.0, 0.0, float(on_device)], [None] * self.world_size)
        return model_state

    def policy_weights(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The policy's weights under the base model's names (with LoRA: merged), as rollouts load them."""
        model_state = self._full_weights(on_device)
        if self.worker.lora is not None:
            model_state = lora.merged_state(model_state, lora.scaling(self.worker.lora))
        return model_state

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters alone under peft's file names: what an adapter-only weight sync sends."""
        if self.worker.lora is None:
            raise FailedPrecondition(f"{self.role}: there are no LoRA adapters to send (actor.lora.rank is 0)")
        trained, _, _ = self._command(Command.GATHER_STATE, [0.0, 1.0], [None] * self.world_size)
        return lora.adapter_state(trained)

    async def gather_weights(self) -> dict[str, torch.Tensor]:
        """policy_weights on the torch thread: what a weight sync sends, and what the in-process mesh
        hands its rollout engines directly (rlfabric.launch.inprocess)."""
        return await self._run(self.policy_weights)

    async def gather_adapter(self) -> dict[str, torch.Tensor]:
        """adapter_weights on the torch thread: what the in-process mesh hands its rollout engines when
        weight_sync.lora resolves to adapter."""
        return await self._run(self.adapter_weights)

    def load_mixed(self, sent: dict[str, torch.Tensor], alpha: float) -> None:
        """Loads alpha * sent + (1 - alpha) * current into every rank (TR-DPO's reference update); alpha 1 loads
        the sent weights as they are."""
        if alpha < 1:
            current = self._full_weights()  # on the host: no second copy of the model on the device
            sent = {name: torch.lerp(current[name], tensor.to(current[name].device, current[name].dtype), alpha)
                    for name, tensor in sent.items()}
        self._command(Command.LOAD_WEIGHTS, [], [None] * self.world_size, sent)


def reset_peak_rss() -> bool:
    """Starts a new resident-memory high-water mark for this process (Linux: writing 5 to clear_refs
    resets VmHWM); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (VmHWM) since start or the last reset_peak_rss; 0 if unknown."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0
