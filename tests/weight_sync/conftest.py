"""Weight-sync test fixtures: the tiny model, built once per session."""

from __future__ import annotations

import pytest

from rlfabric.actor.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen2 (vocab 100, head_dim 32, tied embeddings) with its char-level tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("weight-sync-model") / "tiny")
