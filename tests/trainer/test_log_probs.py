"""ComputeLogProbs (actor, reference) and ComputeValues (critic) through the real gRPC path. The log-probs are
compared with a plain transformers forward, both in float64 (tests/numerics.py)."""

from __future__ import annotations

import pytest
import torch

from tests.numerics import FLOAT64, assert_same_float32
from tests.trainer.helpers import Served, hf_log_probs, make_batch, make_config

pytestmark = pytest.mark.numerics  # make test-kernels runs it under every CPU kernel family


@pytest.fixture(scope="module")
def actor(tiny_model):
    # Small micro-batches so a request spans several of them, each trimmed differently.
    config = make_config(tiny_model, actor={"log_prob_micro_batch_size_per_gpu": 3}, model=FLOAT64)
    with Served("actor", config) as served:
        yield served


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_a_direct_transformers_forward(actor, hf_model, temperature):
    batch = make_batch(rows=8, prompt_len=7, response_len=5)
    assert (batch["attention_mask"][:, 0] == 0).any() and (batch["response_mask"][:, -1] == 0).any()
    out = actor.run(actor.client.compute_log_probs(batch, temperature=temperature, compute_entropy=True))
    expected = hf_log_probs(hf_model, batch, temperature)
    assert_same_float32(out["log_probs"], expected)
    assert out["entropy"].shape == (8, 5)
    assert (out["entropy"][batch["response_mask"] == 0] == 0).all()
    assert (out["entropy"][batch["response_mask"] == 1] > 0).all()


def test_sum_pi_squared_equals_a_direct_transformers_forward(actor, hf_model):
    """The optimal token baselines' input: sum_v pi(v)^2 of each predicting distribution, asked of the same pass."""
    batch = make_batch(rows=8, prompt_len=7, response_len=5, seed=4)
    out = actor.run(actor.client.compute_log_probs(batch, temperature=0.7, compute_sum_pi_squared=True))
    mask = batch["attention_mask"]
    with torch.no_grad():
        logits = hf_model(input_ids=batch["input_ids"], attention_mask=mask,
                          position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -6:-1]
    expected = torch.softmax(logits.double() / 0.7, dim=-1).square().sum(-1) * batch["response_mask"]
    assert_same_float32(out["sum_pi_squared"], expected)
    assert_same_float32(out["log_probs"], hf_log_probs(hf_model, batch, 0.7))
    assert "sum_pi_squared" not in actor.run(actor.client.compute_log_probs(batch, temperature=0.7))


def test_token_budget_micro_batching_gives_the_same_log_probs(tiny_model, hf_model):
    batch = make_batch(rows=9, prompt_len=9, response_len=6, seed=3)
    config = make_config(tiny_model, actor={"max_tokens_per_micro_batch": 30}, model=FLOAT64)
    with Served("actor", config) as served:
        out = served.run(served.client.compute_log_probs(batch, temperature=0.9))
    assert_same_float32(out["log_probs"], hf_log_probs(hf_model, batch, 0.9))


def test_reference_serves_the_frozen_weights(tiny_model, hf_model):
    batch = make_batch(rows=5, seed=1)
    with Served("reference", make_config(tiny_model, model=FLOAT64)) as served:
        out = served.run(served.client.compute_log_probs(batch, temperature=0.5))
        status = served.run(served.client.get_status())
        worker = served.service.engine.worker
        assert not any(p.requires_grad for p in worker.model.parameters())
        assert not worker.model.training and worker.optimizer is None
    assert_same_float32(out["log_probs"], hf_log_probs(hf_model, batch, 0.5))
    assert status.model == str(tiny_model) and status.weight_version == 0


def test_critic_values_are_zero_on_padding(tiny_model):
    batch = make_batch(rows=6, seed=2)
    with Served("critic", make_config(tiny_model)) as served:
        values = served.run(served.client.compute_values(batch))["values"]
        status = served.run(served.client.get_status())
    assert values.shape == (6, 5) and values.dtype == torch.float32
    assert (values[batch["response_mask"] == 0] == 0).all()
    assert values[batch["response_mask"] == 1].abs().sum() > 0
    assert status.world_size == 1 and status.optimizer_step == 0
