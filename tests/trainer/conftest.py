"""Fixtures of the actor/reference/critic tests (tiny_model is tests/conftest.py's)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    """The tiny model loaded directly with transformers in float64, for reference forwards to compare a float64
    service with (tests/numerics.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64).eval()
