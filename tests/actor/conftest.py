"""Fixtures of the actor/reference/critic tests: the tiny model, built once per session."""

from __future__ import annotations

import pytest

from rlfabric.actor.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path of a random-weight tiny Qwen2 (~90k parameters) with its char-level tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    """The tiny model loaded directly with transformers, for reference forwards."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()
