"""Tensor parallelism in the trainer roles (actor, reference, critic: `<role>.tensor_parallel_size` T).

The role's world_size ranks form a (world_size / T) x T device mesh ("dp", "tp"), rank = dp_index * T + tp_index,
so a TP group is T consecutive ranks (one node's GPUs). Within a TP group torch's DTensor tensor parallelism
splits every decoder layer (`parallelize_module` on mesh["tp"]); across TP groups FSDP2 shards as before
(`fully_shard` on mesh["dp"]). The TP ranks of one group see the same rows: the batch is split over the
data-parallel groups only, and one rank per group reports results.

The plan, for the Llama and Qwen2 families (the same module names; transformers' own base_model_tp_plan):
  self_attn.q_proj / k_proj / v_proj, mlp.gate_proj / up_proj   ColwiseParallel (out-features split)
  self_attn.o_proj, mlp.down_proj                              RowwiseParallel (in-features split, all-reduce)
  lm_head (untied, vocabulary divisible by T)                  ColwiseParallel, logits gathered (Replicate)
Mixture-of-experts families (Qwen3-MoE, Mixtral): the attention is split as above; each sparse MoE block (router
and experts) stays whole on every TP rank, so every rank routes the same tokens to the same experts (transformers'
own plans of both also split each expert's width; here the blocks stay whole for both). Mixtral's router jitter (router_jitter_noise > 0: random noise on the
hidden states while training) would be drawn by each rank apart, so it is refused under TP.
The embeddings, norms, a tied head and the critic's value head stay whole on every TP rank. Heads, KV heads
and the MLP width must divide by T: HF attention reshapes with -1 heads, so each rank runs its own heads, and
DTensor does not replicate KV heads as vLLM does (scale.md section 2).

    check_model_split(config, role)      # ConfigError naming <role>.tensor_parallel_size, before anything loads
    mesh = device_mesh("cpu", world_size, tp); parallelize(model, mesh["tp"])   # then fully_shard on mesh["dp"]
    clip_grad_norm(parameters, max_norm) # torch's clip over the two meshes' parameters
    RankZeroGather().gather(model, ...)  # full weights on rank 0 alone, for weight sync and checkpoints
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rlfabric.core.config import ConfigError, RunConfig
from rlfabric.core.dtypes import at_least_float32
from rlfabric.trainer.roles import TRAINER_ROLES, role_spec

MOE_FAMILIES = ("qwen3_moe", "mixtral")  # attention split, MoE blocks whole
FAMILIES = ("llama", "qwen2", *MOE_FAMILIES)  # model_types whose decoder layers the plan below fits (each tested)
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def key(role: str) -> str:
    return f"{role}.tensor_parallel_size"


def split_problem(model_config: dict, tp: int) -> str:
    """Why a model of this config.json cannot be split over `tp` tensor-parallel ranks here ("" = it can)."""
    model_type = model_config.get("model_type")
    if model_type not in FAMILIES:
        return (f"model_type {model_type!r} has no tensor-parallel plan here (plans: {', '.join(FAMILIES)}); "
                "train it data-parallel only")
    heads = model_config.get("num_attention_heads") or 0
    kv_heads = model_config.get("num_key_value_heads") or heads
    intermediate = model_config.get("intermediate_size") or 0
    if heads % tp:
        return f"the model's {heads} attention heads do not divide by {tp}"
    if kv_heads % tp:
        return (f"the model's {kv_heads} KV heads do not divide by {tp} (DTensor tensor parallelism splits KV heads "
                "and never replicates them)")
    if intermediate % tp and model_type not in MOE_FAMILIES:
        return f"the model's intermediate_size {intermediate} does not divide by {tp}"
    if tp > 1 and model_config.get("router_jitter_noise"):
        return (f"the model's router_jitter_noise {model_config['router_jitter_noise']:g} would draw other noise on "
                "each tensor-parallel rank (set it to 0 in config.json)")
    return ""


def check_model_split(config: RunConfig, role: str) -> None:
    """ConfigError naming <role>.tensor_parallel_size when the role's model cannot be split that many ways.
    Where config.json cannot be read here, the model check of the launcher or service reports it."""
    spec = role_spec(role)
    tp = spec.section(config).tensor_parallel_size
    if tp == 1:
        return
    try:
        path = spec.model_path(config)
        model_config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return
    problem = split_problem(model_config, tp)
    if problem:
        takes = [t for t in range(1, 65) if not split_problem(model_config, t)]
        hint = f"; values this model takes: {', '.join(map(str, takes[:8]))}" if model_config.get(
            "model_type") in FAMILIES else ""
        raise ConfigError(f"{key(role)} {tp}: {problem} ({path}){hint}")


def check_splits(config: RunConfig) -> None:
    """check_model_split for every trainer role the run starts (what a launcher checks before anything starts)."""
    for role in TRAINER_ROLES:
        if role in config.roles_in_use():
            check_model_split(config, role)


def device_mesh(device_type: str, world_size: int, tp: int):
    """The ("dp", "tp") mesh of world_size / tp x tp ranks; needs the process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def parallelize(model: nn.Module, tp_mesh) -> None:
    """Splits every decoder layer (and an untied LM head) over tp_mesh, in place; before fully_shard."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    split = [name for name in (*COLWISE, *ROWWISE)
             if model.config.model_type not in MOE_FAMILIES or name.startswith("self_attn.")]
    layer_plan = {name: ColwiseParallel() if name in COLWISE else RowwiseParallel() for name in split}
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers ({sorted(layer_classes)}) to split")
    for layer in layers:
        parallelize_module(layer, tp_mesh, layer_plan)
    head = getattr(model, "lm_head", None)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if isinstance(head, nn.Linear) and not tied and head.out_features % tp == 0:
        # Each rank computes its slice of the vocabulary; the logits are gathered whole for the log-softmax.
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})


def clip_grad_norm(parameters, max_norm: float) -> float:
    """torch's clip_grad_norm_ for parameters on two meshes: the split weights' 2-D (dp, tp) and FSDP2's 1-D dp
    mesh for the rest. torch's own stacks the per-parameter norms, which DTensor refuses across meshes, so the
    norm is taken per mesh (get_total_norm, made whole) and combined. Returns the total norm (all ranks)."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            grad = parameter.grad
            groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = []
    for grads in groups.values():  # the same order on every rank: the parameters' order
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return 0.0
    wide = at_least_float32(norms[0].dtype)
    total = float(torch.linalg.vector_norm(torch.stack([norm.to(wide).cpu() for norm in norms])))
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:  # as torch: grads scaled down only (a non-finite norm skips the step anyway)
        for grads in groups.values():
            torch._foreach_mul_(grads, coefficient)
    return total


class RankZeroGather:
    """Every weight of a sharded model made whole on rank 0 alone, for a weight sync or a checkpoint.

    torch's full state dict (get_model_state_dict, DTensor.full_tensor) all-gathers every tensor onto every
    rank, and a 2-D (FSDP x TP) tensor takes two sequential all-gathers; nothing in torch gathers a DTensor onto
    one rank. Here each distinct shard is sent once, point to point, by the lowest rank holding it (replicas on
    other TP ranks send nothing) to rank 0, which places it at its offset: rank 0 receives the weights minus its
    own shards, and the other ranks receive nothing. Where each rank's shard lies (DTensor's chunk list, as
    torch.distributed.checkpoint reads it) is exchanged once, on the first gather: the layout never changes.
    """

    def __init__(self):
        self._owners: list[list[tuple[int, tuple[int, ...], tuple[int, ...]]]] | None = None
        self.received_bytes = 0  # rank 0: bytes received by the last gather
        self.messages = 0  # rank 0: point-to-point messages of the last gather

    @staticmethod
    def _chunk(value: torch.Tensor) -> tuple[list[int], list[int]]:
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            chunk = value.__create_chunk_list__()[0]
            return list(chunk.offsets), list(chunk.sizes)
        return [0] * value.dim(), list(value.shape)

    def _layout(self, values: list[torch.Tensor], device: torch.device) -> None:
        """Who sends what: per tensor, (rank, offsets, sizes) of each distinct non-empty shard, lowest rank first."""
        mine = [number for value in values for part in self._chunk(value) for number in part]
        local = torch.tensor(mine, dtype=torch.int64, device=device)
        everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, local)
        rows = [row.tolist() for row in everyone]
        self._owners, start = [], 0
        for value in values:
            ndim = value.dim()
            chunks: dict[tuple, int] = {}
            for rank, row in enumerate(rows):
                offsets, sizes = tuple(row[start:start + ndim]), tuple(row[start + ndim:start + 2 * ndim])
                if all(sizes) and (offsets, sizes) not in chunks:
                    chunks[(offsets, sizes)] = rank
            self._owners.append([(rank, offsets, sizes) for (offsets, sizes), rank in chunks.items()])
            start += 2 * ndim

    def gather(self, model: nn.Module, device: torch.device, to_cpu: bool) -> dict[str, torch.Tensor]:
        """The model's state dict made whole: on rank 0 under its names (tied names share one tensor), on the host
        when to_cpu, else on `device`; {} on the other ranks. A collective: every rank calls it. `device` is the
        process group's (gloo: cpu, NCCL: the rank's GPU), which every message passes through."""
        from torch.distributed.tensor import DTensor

        state = model.state_dict(keep_vars=True)  # the parameters themselves: tied ones are one object
        values = list(state.values())
        if self._owners is None:
            self._layout(values, device)
        rank, full, done = dist.get_rank(), {}, {}
        self.received_bytes = self.messages = 0
        for name, value, owners in zip(state, values, self._owners, strict=True):
            if id(value) in done:
                if rank == 0:
                    full[name] = full[done[id(value)]]
                continue
            done[id(value)] = name
            local = (value.to_local() if isinstance(value, DTensor) else value).detach()
            if rank != 0:
                if any(owner == rank for owner, _, _ in owners):
                    dist.send(local.contiguous().to(device), dst=0)
                continue
            whole = torch.empty(value.shape, dtype=value.dtype, device=device)
            for owner, offsets, sizes in owners:
                region = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                if owner == 0:
                    region.copy_(local)
                    continue
                buffer = region if region.is_contiguous() else torch.empty(sizes, dtype=value.dtype, device=device)
                dist.recv(buffer, src=owner)
                if buffer is not region:
                    region.copy_(buffer)
                self.received_bytes += buffer.numel() * buffer.element_size()
                self.messages += 1
            full[name] = whole.cpu() if to_cpu else whole
        return full
