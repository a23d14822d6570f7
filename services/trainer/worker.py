"""One rank of the actor, reference or critic: its model (FSDP2-sharded when the role has more than one
rank, and split over tensor-parallel ranks with <role>.tensor_parallel_size, tensor_parallel.py), optimizer and
LR schedule, and what it computes on its shard of a batch.

The same code runs on every rank, so every FSDP2 collective (parameter all-gathers in each forward,
gradient reduce-scatters in each backward) lines up: ranks agree on micro-batch counts first.
Rank 0's RankWorker lives in the service process; the others in the processes dist.py starts.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlfabric.algorithms.plugins import load_plugin_modules, policy_loss_sections
from rlfabric.core import lora
from rlfabric.core.config import RunConfig
from rlfabric.core.dtypes import torch_dtype
from rlfabric.core.router_replay import replay_routes
from rlfabric.trainer import models, tensor_parallel
from rlfabric.trainer.batch import (
    ROUTES,
    SequenceBatch,
    equalize_micro_batches,
    pad_columns,
    padding_batch,
    plan_micro_batches,
    trim_padding,
)
from rlfabric.trainer.objectives import (
    MiniBatchCounts,
    PolicyObjective,
    ValueObjective,
    forward_log_probs,
    forward_values,
    packed_routes,
)
from rlfabric.trainer.roles import role_spec


def warmup_factor(updates: int, warmup_steps: int) -> float:
    """Linear warmup then constant: update k (from 0) runs at lr * min(1, (k + 1) / warmup_steps)."""
    return 1.0 if warmup_steps <= 0 else min(1.0, (updates + 1) / warmup_steps)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Every tensor of the optimizer's state to `device`, but a step count that lives on the CPU: Adam keeps
    it there unless the group is fused or capturable (then on the parameters' device, and it moves too)."""
    for group in optimizer.param_groups:
        steps_follow = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and (key != "step" or steps_follow):
                    state[key] = value.to(device, non_blocking=True)


def release_device_memory(device: torch.device) -> None:
    """Hands back to the driver what this process's torch still holds on `device` once nothing of the model is
    there: torch's cache of freed blocks (empty_cache), and cuBLAS's workspaces. cuBLAS keeps one workspace per
    (handle, stream) that ran a matmul -- a handle per thread: the phase's own and autograd's backward thread
    -- of 32 MiB on Hopper and Blackwell (CUBLAS_WORKSPACE_CONFIG; cuBLASLt shares it), allocated through
    torch's caching allocator, so they count in memory_allocated and empty_cache() cannot free them: they were
    the colocated actor's 64 MiB left on the GPU after every update. torch frees them only through
    torch._C._cuda_clearCublasWorkspaces (no public API; its CUDA-graph trees call it to drop the same
    workspaces), after a synchronize so no kernel still uses one; the next matmul allocates a new one."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)  # the non-blocking copies to the host have landed; no kernel uses a workspace
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


class RankWorker:
    """The model and training state of one rank, and the per-rank steps of each command."""

    def __init__(self, role: str, config: RunConfig, rank: int, world_size: int, device: torch.device):
        self.role, self.config, self.rank, self.world_size, self.device = role, config, rank, world_size, device
        self.spec = role_spec(role)
        self.section = self.spec.section(config)
        self.trainable = self.spec.trainable
        self.dtype = torch_dtype(config.model.dtype, device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # a new value head is initialised identically on every rank and run
            model = models.load_model(role, config, device)
        base = lora.base_of(model)
        self.lora = config.actor.lora if lora.is_lora_model(model) else None
        self.vocab_size = models.vocab_size(base)
        self.max_length = getattr(getattr(base, "config", None), "max_position_embeddings", None)  # longest input
        self.num_parameters = models.num_parameters(model)
        self.param_shapes = {name: tuple(t.shape) for name, t in base.state_dict().items()}  # Hugging Face names
        # What a checkpoint holds: every weight, or with LoRA the adapters only (under PeftModel's names).
        self.checkpoint_shapes = self.param_shapes if self.lora is None else {
            name: tuple(t.shape) for name, t in model.named_parameters() if t.requires_grad}
        self.keep_logits = not self.spec.value_head and models.accepts_logits_to_keep(base)
        self.hf_config = model.config
        self.sharded = world_size > 1
        # A shared prompt's one pass serves its rows on one rank (sharded, the ranks' passes would differ in
        # count); while training, gradient checkpointing turns the model's key/value cache off.
        self.share_prompts = self.section.share_prompt_forward and not self.sharded
        # tensor_parallel_size T: a (world_size / T) x T mesh; the T ranks of a TP group compute on the same rows.
        self.tensor_parallel_size = self.section.tensor_parallel_size
        self.data_parallel_size = world_size // self.tensor_parallel_size
        self.result_ranks = range(0, world_size, self.tensor_parallel_size)  # one rank per TP group reports
        self.data_group = None  # the process group gradients and batch statistics are summed over (None: all)
        self._gather = tensor_parallel.RankZeroGather() if self.tensor_parallel_size > 1 else None
        # trainer.colocated on a GPU (the hybrid engine): between phases the model, its gradients and its
        # optimizer state wait in host memory, so the rollout sharing the GPU can use it. Sharded, FSDP2's CPU
        # offload does it; one rank moves them itself (onload before a phase, offload after).
        offload = config.trainer.colocated and device.type == "cuda"
        self.offloads = offload and not self.sharded
        self.frees_gpu = offload  # between phases nothing of this rank stays allocated on the GPU
        self.model = self._shard(model, offload) if self.sharded else model.to("cpu" if self.offloads else device)
        self.objective = None
        self.optimizer = None
        self.updates = 0  # UpdatePolicy / UpdateValues calls: the LR schedule's clock
        self.optimizer_steps = 0
        if self.spec.trains_policy:
            load_plugin_modules(config.algorithm.plugin_modules)  # a policy loss may be a plugin's (every rank)
            # The rollout samples from softmax(logits / T); PPO's ratios must use the same distribution.
            temperature = config.rollout.temperature or 1.0
            self.objective = PolicyObjective(
                self.section, temperature, self.keep_logits,
                share_prompts=self.share_prompts and not models.uses_gradient_checkpointing(config, device),
                sections=policy_loss_sections(config))
        elif self.trainable:
            self.objective = ValueObjective(self.section)
        if self.trainable:
            trained = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapters
            # fused: one kernel updates every parameter in place. The default (foreach on a GPU) builds
            # temporaries the size of all parameters, in float32, at every step (transformers' Trainer fuses too).
            self.optimizer = torch.optim.AdamW(trained, lr=self.section.lr, betas=(0.9, 0.999),
                                               weight_decay=self.section.weight_decay, fused=True)
        # VeRL's ppo_mini_batch_size counts prompts; the batch has rollout.n rows per prompt.
        self.mini_batch_rows = self.section.ppo_mini_batch_size * config.rollout.n if self.trainable else 0
        if self.frees_gpu:  # the GPU starts as free as between phases (loading may have left blocks behind)
            release_device_memory(device)

    # -- helpers ----------------------------------------------------------------------------------

    def _shard(self, model: torch.nn.Module, offload: bool) -> torch.nn.Module:
        """FSDP2 over all ranks, or with tensor parallelism: split within each TP group, FSDP2 across them."""
        if self.tensor_parallel_size == 1:
            return models.shard_model(model, self.world_size, self.device, self.dtype, offload)
        mesh = tensor_parallel.device_mesh(self.device.type, self.world_size, self.tensor_parallel_size)
        tensor_parallel.parallelize(model, mesh["tp"])
        self.data_group = mesh["dp"].get_group()
        return models.shard_model(model, self.world_size, self.device, self.dtype, offload, mesh=mesh["dp"])

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """Over the data-parallel ranks (a TP group's ranks hold the same rows: summing them would count twice)."""
        if not self.sharded:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op, group=self.data_group)
        return tensor.tolist()

    def _plan(self, batch: SequenceBatch, max_rows: int) -> list[torch.Tensor]:
        plan = plan_micro_batches(batch, max_rows, self.section.max_tokens_per_micro_batch)
        count = int(self._all_reduce([float(len(plan))], op=dist.ReduceOp.MAX)[0])
        return equalize_micro_batches(plan, count)

    def _micro(self, batch: SequenceBatch, rows: torch.Tensor, float_names=()) -> SequenceBatch:
        micro = trim_padding(batch.select(rows)) if len(rows) else padding_batch(float_names)
        return micro.to(self.device)

    def _replay(self, micro: SequenceBatch):
        """MoE routing replay over the micro-batch's forward (and backward) when it brings the rollout's routes
        (the actor's; actor.router_replay): a context that yields its Agreement, else None."""
        if ROUTES not in micro or not self.spec.trains_policy:
            return contextlib.nullcontext()
        if self.section.use_remove_padding:  # the routes follow their tokens into the packed rows
            return replay_routes(self.model, packed_routes(micro))
        return replay_routes(self.model, micro[ROUTES].flatten(0, 1))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _move(self, device: torch.device | str) -> None:
        """The model and the optimizer's state to `device` (the hybrid engine's onload and offload)."""
        self.model.to(device)
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, device)

    def onload(self) -> None:
        """Before a phase: the model (and optimizer state) to the GPU, when the hybrid engine offloads them."""
        if self.offloads:
            self._move(self.device)

    def offload(self) -> None:
        """After a phase: the model (and optimizer state) to host memory, when the hybrid engine offloads them
        (FSDP2's CPU offload does it for a sharded model), and what torch still holds on the GPU back to the
        driver, for the rollout engine that shares it."""
        if self.offloads:
            self._move("cpu")
        if self.frees_gpu:
            release_device_memory(self.device)

    # -- inference --------------------------------------------------------------------------------

    @torch.no_grad()
    def compute(self, shard: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False,
                base_model: bool = False, with_sum_pi_squared: bool = False) -> dict:
        """log_probs (+ entropy, + sum_pi_squared) for the actor and reference, values for the critic: [rows, T],
        0 on padding. base_model: with LoRA, the base model's (the adapters off): the reference policy's."""
        if base_model:
            with self.model.disable_adapter():
                return self.compute(shard, temperature, with_entropy, with_sum_pi_squared=with_sum_pi_squared)
        rows, response_len = shard.num_rows, shard.response_len
        names = self.spec.outputs(with_entropy, with_sum_pi_squared)
        outputs = {name: torch.zeros(rows, response_len) for name in names}
        max_rows = self.spec.forward_micro_rows(self.config)
        packed = self.section.use_remove_padding
        self.onload()
        self.model.eval()
        try:
            for index in self._plan(shard, max_rows):
                micro = self._micro(shard, index)
                with models.autocast(self.device, self.dtype, self.sharded), self._replay(micro):
                    if self.spec.value_head:
                        results = {"values": forward_values(self.model, micro, packed=packed)}
                    else:
                        log_probs, entropy, _, squares = forward_log_probs(
                            self.model, micro, temperature, with_entropy, self.keep_logits, packed=packed,
                            share_prompts=self.share_prompts, with_sum_pi_squared=with_sum_pi_squared)
                        results = {"log_probs": log_probs, "entropy": entropy, "sum_pi_squared": squares}
                if len(index):
                    real = micro["response_mask"].bool()
                    for name in names:  # where(), not *: a NaN on padding must not survive
                        value = torch.where(real, results[name], 0.0)
                        outputs[name][index] = pad_columns(value, response_len).cpu().float()  # the wire's
        finally:
            self.model.train(self.trainable)
            if not self.trainable:  # the reference's one phase of the step is over (trainers: after update)
                self.offload()
        return outputs

    # -- training ---------------------------------------------------------------------------------

    def update(self, shard: SequenceBatch) -> dict[str, float]:
        """ppo_epochs passes over the shard's mini-batches, one optimizer step each. Metrics are the
        mini-batch values averaged over the steps, identical on every rank."""
        section = self.section
        local_rows = self.mini_batch_rows // self.data_parallel_size
        lr = section.lr * warmup_factor(self.updates, section.lr_warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        totals: dict[str, float] = {}
        grad_norms: list[float] = []
        timings = {"fwd_bwd_s": 0.0, "optimizer_s": 0.0}
        if ROUTES in shard:  # the same names on every rank, for the all-reduce
            totals.update(router_matched=0.0, router_recorded=0.0)
        self.onload()
        try:
            for _epoch in range(section.ppo_epochs):
                for start in range(0, shard.num_rows, local_rows):
                    self._accumulate_gradients(shard.select(slice(start, start + local_rows)), totals, timings)
                    started = time.perf_counter()
                    grad_norms.append(self._optimizer_step())
                    self._sync()
                    timings["optimizer_s"] += time.perf_counter() - started
        finally:
            self.offload()  # gradients are freed by zero_grad; the weights and optimizer state go to the host
        self.updates += 1
        names = sorted(totals)
        summed = self._all_reduce([totals[name] for name in names])
        steps = len(grad_norms)
        sums = dict(zip(names, summed, strict=True))
        routes = sums.pop("router_matched", None), sums.pop("router_recorded", None)  # counts, not means
        metrics = {f"{self.role}/{name}": value / steps for name, value in sums.items()}
        if routes[1]:  # the fraction of recorded (token, layer) routes the trainer would have chosen itself
            metrics[f"{self.role}/router_agreement"] = routes[0] / routes[1]
        metrics[f"{self.role}/grad_norm"] = sum(grad_norms) / steps
        metrics[f"{self.role}/lr"] = lr
        metrics.update({f"{self.role}/{name}": seconds for name, seconds in timings.items()})  # rank 0's
        return metrics

    def _accumulate_gradients(self, mini: SequenceBatch, totals: dict[str, float], timings: dict[str, float]) -> None:
        """Forward and backward over the micro-batches of one mini-batch; adds their stats to totals."""
        mask = mini["response_mask"]
        tokens, sequences = self._all_reduce([float(mask.sum()), float((mask.sum(1) > 0).sum())])
        counts = MiniBatchCounts(tokens=tokens, sequences=sequences, response_len=mini.response_len)
        for index in self._plan(mini, self.section.ppo_micro_batch_size_per_gpu):
            micro = self._micro(mini, index, self.objective.float_names)
            started = time.perf_counter()
            with self._replay(micro) as agreement:  # open over the backward: checkpointing runs forwards there
                with models.autocast(self.device, self.dtype, self.sharded):
                    loss, stats = self.objective.loss(self.model, micro, counts)
                # FSDP2 averages gradients over the data-parallel ranks; each rank's loss is already its share
                # of the mini-batch total, so scale back up to get the sum.
                (loss * self.data_parallel_size).backward()
                self._sync()
            if agreement is not None:
                stats = {**stats, **dict(zip(("router_matched", "router_recorded"), agreement.totals(), strict=True))}
            timings["fwd_bwd_s"] += time.perf_counter() - started
            for name, value in stats.items():
                totals[name] = totals.get(name, 0.0) + float(value)

    def _optimizer_step(self) -> float:
        """Clips the gradient norm and steps; a non-finite norm (same on every rank) skips the step."""
        if self.tensor_parallel_size > 1:  # parameters on two meshes, which torch's clip cannot stack
            grad_norm = tensor_parallel.clip_grad_norm(self.model.parameters(), self.section.grad_clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.section.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
                grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.optimizer_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # -- state ------------------------------------------------------------------------------------

    def full_state(self, with_optimizer: bool = True, trained_only: bool = False,
                   on_device: bool = False) -> tuple[dict, dict]:
        """Full (unsharded) model and optimizer state dicts on rank 0, on CPU; empty on other ranks.
        A collective: every rank calls it. Keys are Hugging Face parameter names (PeftModel's with LoRA,
        merged by lora.merged_state). trained_only: the parameters that train (with LoRA, the adapters).
        on_device: an unsharded model's tensors stay where they are (a same-GPU weight sync packs them on
        the GPU: no copy to the host and back); a sharded one's still gather to the host, but a tensor-parallel
        one's, gathered onto rank 0 alone (tensor_parallel.RankZeroGather), stay on rank 0's device."""
        cpu_offload = self.sharded or not on_device
        options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, ignore_frozen_params=trained_only)
        if not cpu_offload and not trained_only:  # the module's own tensors: the same names, without the
            model_state = self.model.state_dict()  # ~0.15 s get_model_state_dict spends on an unsharded model
        elif self._gather is not None:  # tensor parallel: onto rank 0 alone, each shard sent once
            self.model.reshard()  # FSDP2 keeps the root's parameters unsharded after a forward (compute)
            model_state = self._gather.gather(self.model, self.device, to_cpu=not on_device)
        else:
            model_state = get_model_state_dict(self.model, options=options)
        if trained_only:  # a frozen weight tied to another (lm_head) can slip through ignore_frozen_params
            model_state = {name: tensor for name, tensor in model_state.items() if name in self.checkpoint_shapes}
        optimizer_state = {}
        if with_optimizer and self.optimizer is not None:
            never_stepped = not self.optimizer.state
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
            if never_stepped:
                # torch builds a never-stepped optimizer's state by a step with zero gradients at lr 0, which
                # AdamW counts: the first real update would then be bias-corrected as step 2 (~0.74 of its
                # size). Drop that state and save it as "no step taken yet".
                self.optimizer.state.clear()
                optimizer_state = _without_steps(optimizer_state)
        return model_state, optimizer_state

    def load_full_state(self, model_state: dict, optimizer_state: dict, progress: tuple[int, int]) -> None:
        """Loads rank 0's full state dicts into every rank's shards (a collective)."""
        if self.sharded:  # FSDP2 keeps the root's parameters unsharded after a forward (compute)
            self.model.reshard()
        # With LoRA a checkpoint holds the adapters only; the frozen base stays as loaded.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.sharded, strict=self.lora is None)
        set_model_state_dict(self.model, model_state, options=options)
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)
        self.updates, self.optimizer_steps = progress

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Loads rank 0's named tensors into every rank (a collective). A weight sync sends tied weights
        once (e.g. the embeddings, not lm_head), so rank 0 fills in the other names of each shared
        parameter first: the sharded load wants every name."""
        if self.rank == 0:
            named = dict(named)
            aliases: dict[int, list[str]] = {}
            for name, parameter in self.model.named_parameters(remove_duplicate=False):
                aliases.setdefault(id(parameter), []).append(name)
            for names in aliases.values():
                source = next((name for name in names if name in named), None)
                for name in names if source else ():
                    named.setdefault(name, named[source])
        if self.sharded:  # FSDP2 keeps the root's parameters unsharded after a forward (compute)
            self.model.reshard()
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.sharded)
        set_model_state_dict(self.model, named, options=options)

    def rng_state(self) -> dict[str, torch.Tensor]:
        state = {"cpu_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu_rng"].cpu())
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)


def _without_steps(optimizer_state: dict) -> dict:
    """An optimizer state dict whose per-parameter step counts are zero (moments are zero already)."""
    for state in optimizer_state.get("state", {}).values():
        if "step" in state:
            step = state["step"]
            state["step"] = torch.zeros_like(step) if isinstance(step, torch.Tensor) else 0
    return optimizer_state
