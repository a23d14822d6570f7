"""The dtype names of the config (model.dtype, rollout.dtype, reward.model_dtype, a reward model's dtype)
and the torch dtypes they stand for: the package's one table of them."""

from __future__ import annotations

import torch

from rlfabric.core.config import RunConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The torch dtype of a config name; "auto" is bfloat16 on a GPU and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute a reduction or a merge of `dtype` values in: float32 for the half types, float64 kept."""
    return torch.promote_types(dtype, torch.float32)


def rollout_dtype(config: RunConfig) -> str:
    """The dtype name the rollout engines serve (and weight sync sends): rollout.dtype, or model.dtype
    when rollout.dtype is auto (which may itself be auto). A float64 trainer (model.dtype float64, for numerical
    checks) feeds a float32 rollout: no engine serves float64 and the weight-sync wire carries at most float32."""
    if config.rollout.dtype != "auto":
        return config.rollout.dtype
    return "float32" if config.model.dtype == "float64" else config.model.dtype
