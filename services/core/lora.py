"""LoRA for the actor (actor.lora): low-rank adapters from peft on a frozen base model. In core because the
hf rollout engine puts the same adapters on its copy of the model (weight_sync.lora adapter).

    model = apply_lora(base_model, config.actor.lora)     # a peft PeftModel; only adapters train
    merged = merged_state(gathered, scaling(config.actor.lora))   # Hugging Face names, W + s * B @ A

What changes for the actor when LoRA is on:
- only adapter parameters train and hold optimizer state; checkpoints hold just those (and their optimizer);
- the reference policy is the base model, so its log-probs come from the actor with the adapters off
  (ComputeLogProbs base_model=true) and no reference service runs;
- weight sync and ExportHF send the merged weights under the base model's names, so every rollout engine
  loads them as it loads a full model; ExportHF also writes the adapter alone in peft's format (adapter/).

The merge is done here, on the gathered (unsharded) state dict, instead of with peft's merge_adapter(): the
live model may be sharded by FSDP2, and merging in place would change the weights being trained. It is
LoRA's definition, W + (alpha / r) * B @ A; a test checks it against peft's merge_and_unload.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from rlfabric.core.config import LoraConfig
from rlfabric.core.dtypes import at_least_float32

PREFIX = "base_model.model."  # what PeftModel puts before the base model's parameter names
ADAPTER_NAME = "default"
ADAPTER_DIR = "adapter"  # in an ExportHF directory: the adapter alone, as peft saves it
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config(lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.target_modules, task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """The model with adapters on lora.target_modules (a PeftModel); ValueError names the key at fault."""
    from peft import get_peft_model

    try:
        adapted = get_peft_model(model, peft_config(lora))
    except ValueError as error:
        if "not found in the base model" in str(error) or "No modules were targeted" in str(error):
            raise ValueError(f"actor.lora.target_modules {lora.target_modules!r} match no layer of the model; "
                             f"its linear layers: {', '.join(linear_layer_names(model))}") from None
        raise
    check_rank(adapted, lora.rank)
    return adapted


def check_lora_fits(model_path: str, lora: LoraConfig, trust_remote_code: bool = False) -> None:
    """apply_lora's checks on the model's skeleton, built on the meta device (no weight is read), so that a
    target or rank the model cannot take stops a run at its start, before any service loads the model.
    ValueError names the key, as apply_lora does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    apply_lora(skeleton, lora)


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what target_modules usually lists)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)})


def check_rank(adapted: nn.Module, rank: int) -> None:
    """A rank above an adapted layer's smaller dimension adds nothing a full update would not: refuse it.
    The layers are the ones peft adapted, so target_modules is matched once, by peft."""
    from peft.tuners.lora import LoraLayer

    for name, module in adapted.named_modules():
        if isinstance(module, LoraLayer):
            smaller = min(module.in_features, module.out_features)
            if rank > smaller:
                raise ValueError(f"actor.lora.rank {rank} exceeds layer {name.removeprefix(PREFIX)} ({module.in_features} "
                                 f"-> {module.out_features}): a rank is at most the layer's smaller dimension ({smaller})")


def scaling(lora: LoraConfig) -> float:
    return lora.alpha / lora.rank


def is_lora_model(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def base_of(model: nn.Module) -> nn.Module:
    """The Hugging Face model under the adapters (the model itself without LoRA)."""
    return model.get_base_model() if is_lora_model(model) else model


def hf_name(peft_name: str) -> str:
    """base_model.model.X.q_proj.base_layer.weight -> X.q_proj.weight (the base model's own name)."""
    return peft_name.removeprefix(PREFIX).replace(".base_layer.", ".")


def _adapter_part(name: str) -> tuple[str, str] | None:
    """(module name, "A" or "B") of a lora_A / lora_B weight, else None."""
    for part in ("A", "B"):
        marker = f".lora_{part}.{ADAPTER_NAME}.weight"
        if name.endswith(marker):
            return name[: -len(marker)], part
    return None


def merged_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Full PeftModel state (base weights and adapters, gathered) -> the merged model under Hugging Face
    names: each adapted layer's weight becomes W + scale * B @ A (in W's dtype)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        part = _adapter_part(name)
        if part is not None:
            pairs.setdefault(part[0], {})[part[1]] = tensor
        elif ".lora_" not in name:  # lora_dropout etc. hold no tensors; lora_embedding_* is not used
            merged[hf_name(name)] = tensor
    for module, pair in pairs.items():
        weight_name = hf_name(f"{module}.base_layer.weight")
        weight = merged[weight_name]
        wide = at_least_float32(weight.dtype)
        delta = (pair["B"].to(wide) @ pair["A"].to(wide)) * scale
        merged[weight_name] = (weight.to(wide) + delta).to(weight.dtype)
    return merged


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PeftModel state dict under peft's file names (adapter name dropped),
    as adapter_model.safetensors holds them."""
    return {name.replace(f".{ADAPTER_NAME}.weight", ".weight"): tensor
            for name, tensor in state.items() if _adapter_part(name) is not None}


def write_adapter(directory: Path, state: dict[str, torch.Tensor], lora: LoraConfig, base_model_path: str) -> None:
    """directory/adapter_config.json and adapter_model.safetensors, which peft's
    PeftModel.from_pretrained(base, directory) and vLLM's LoRA loader read."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = peft_config(lora)
    config.base_model_name_or_path = base_model_path
    config.save_pretrained(str(directory))
    tensors = {name: tensor.contiguous() for name, tensor in adapter_state(state).items()}
    save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})


def adapter_settings(lora: LoraConfig) -> dict:
    """The adapter settings a checkpoint records (a resume with other settings is refused)."""
    return json.loads(json.dumps({"rank": lora.rank, "alpha": lora.alpha, "target_modules": lora.target_modules}))
