"""The package's one table of config dtype names (rlfabric.core.dtypes)."""

from __future__ import annotations

import pytest
import torch

from rlfabric.core.config import load_config
from rlfabric.core.dtypes import rollout_dtype, torch_dtype


def test_names_and_auto_by_device():
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("float16", "cuda:0") is torch.float16
    assert torch_dtype("auto", "cpu") is torch.float32 and torch_dtype("auto", torch.device("cuda", 1)) is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        torch_dtype("int8")


def test_rollout_dtype_falls_back_to_model_dtype():
    assert rollout_dtype(load_config(None, ["model.dtype=bfloat16"])) == "bfloat16"
    assert rollout_dtype(load_config(None, ["model.dtype=bfloat16", "rollout.dtype=float16"])) == "float16"
    assert rollout_dtype(load_config(None, [])) == "auto"
