"""Sequence packing (<role>.use_remove_padding): a micro-batch's real tokens go through the model as one row.
Log-probs, entropies, values, the loss and its gradient equal the padded path's; the services trained with it
equal those trained without; a backend that cannot keep packed sequences apart is refused naming the key."""

from __future__ import annotations

import pytest
import torch

from rlfabric.core.config import ConfigError, load_config
from rlfabric.trainer import models
from rlfabric.trainer.batch import validate_batch
from rlfabric.trainer.objectives import MiniBatchCounts, PolicyObjective, _packed_inputs, forward_log_probs
from tests.numerics import FLOAT64, assert_same_float32, assert_same_gradient, assert_same_metric
from tests.trainer.helpers import Served, make_batch, make_config

pytestmark = pytest.mark.numerics  # make test-kernels runs it under every CPU kernel family

TRAIN = {"lr": 1e-3, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 8}


@pytest.fixture(scope="module")
def policy(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)  # tests/numerics.py


def _batch(model, rows=8, prompt_len=9, response_len=6, seed=1):
    raw = make_batch(rows=rows, prompt_len=prompt_len, response_len=response_len, seed=seed)
    advantages = torch.randn(rows, response_len, generator=torch.Generator().manual_seed(seed))
    return validate_batch({**raw, "advantages": advantages}, models.vocab_size(model), required_floats=("advantages",))


def test_packed_rows_hold_the_real_tokens_with_positions_restarting_per_sequence(policy):
    batch = _batch(policy, rows=8, prompt_len=9, response_len=6)
    inputs, predicting = _packed_inputs(batch)
    lengths = batch["attention_mask"].sum(1)
    rows, capacity = inputs["input_ids"].shape
    assert capacity == int(lengths.max()) and rows < batch.num_rows  # shorter sequences share rows
    assert rows * capacity < batch["attention_mask"].numel()  # less than the padded batch
    assert inputs["attention_mask"] is None and inputs["use_cache"] is False  # a cache: sdpa attends across
    flat_ids, flat_positions = inputs["input_ids"].flatten(), inputs["position_ids"].flatten()
    # The predicting position of each real response token holds the token before it, at its position.
    real_response = batch["response_mask"].bool()
    before = batch["input_ids"][:, -batch.response_len - 1 : -1]
    assert torch.equal(flat_ids[predicting[real_response]], before[real_response])
    positions_before = batch["position_ids"][:, -batch.response_len - 1 : -1]
    assert torch.equal(flat_positions[predicting[real_response]], positions_before[real_response])
    assert int((flat_positions == 0).sum()) >= batch.num_rows  # a start per sequence (and per row's tail)


@pytest.mark.parametrize("keep_logits", [True, False])
def test_packed_log_probs_entropy_loss_and_gradient_equal_the_padded_path(policy, keep_logits):
    batch = _batch(policy)
    real = batch["response_mask"].bool()
    padded = forward_log_probs(policy, batch, 0.7, True, keep_logits, with_sum_pi_squared=True)
    packed = forward_log_probs(policy, batch, 0.7, True, keep_logits, packed=True, with_sum_pi_squared=True)
    for a, b, name in zip((*padded[:2], padded[3]), (*packed[:2], packed[3]), ("log-probs", "entropy",
                                                                              "sum_pi_squared"), strict=True):
        assert_same_float32(b[real], a[real], name)
    config = make_config(policy.name_or_path, actor={"use_remove_padding": False})
    counts = MiniBatchCounts(tokens=float(real.sum()), sequences=float(batch.num_rows), response_len=batch.response_len)
    grads = {}
    for name, packing in (("padded", False), ("packed", True)):
        objective = PolicyObjective(config.actor.model_copy(update={"use_remove_padding": packing}), 0.7, keep_logits)
        policy.zero_grad()
        loss, _ = objective.loss(policy, batch, counts)
        loss.backward()
        grads[name] = (loss.detach(), torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
    assert_same_metric(float(grads["packed"][0]), float(grads["padded"][0]), "loss")
    assert_same_gradient(grads["packed"][1], grads["padded"][1], "gradient")
    policy.zero_grad()


def test_packed_rows_send_only_the_response_positions_through_the_lm_head(policy):
    # The LM head and its log-softmax over the vocabulary cost as much as several layers: over every packed
    # prompt token they would eat what packing saves (bench/packing_bench.py).
    batch = _batch(policy)
    seen = []
    hook = policy.get_output_embeddings().register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape))
    try:
        forward_log_probs(policy, batch, 1.0, True, True, packed=True)
    finally:
        hook.remove()
    assert seen == [torch.Size([1, int(batch["response_mask"].sum()), policy.config.hidden_size])]


def test_services_with_packing_compute_and_train_as_without(tiny_model):
    batch = make_batch(rows=8, prompt_len=9, response_len=6, seed=3)
    real = batch["response_mask"].bool()
    advantages = torch.linspace(-1.0, 1.0, batch["responses"].numel()).reshape(batch["responses"].shape)
    results = {}
    for packing in (False, True):
        actor = {**TRAIN, "use_remove_padding": packing}
        critic = {**TRAIN, "use_remove_padding": packing}
        with Served("actor", make_config(tiny_model, actor=actor, model=FLOAT64)) as served:
            old = served.run(served.client.compute_log_probs(batch, temperature=0.8))["log_probs"]
            metrics = served.run(served.client.update_policy({**batch, "old_log_probs": old, "advantages": advantages}))
        with Served("critic", make_config(tiny_model, critic=critic, model=FLOAT64)) as served:
            values = served.run(served.client.compute_values(batch))["values"]
            value_metrics = served.run(served.client.update_values({**batch, "values": values, "returns": values + 1}))
        results[packing] = old, metrics, values, value_metrics
    (old, metrics, values, value_metrics), (old_p, metrics_p, values_p, value_metrics_p) = results[False], results[True]
    assert_same_float32(old_p[real], old[real], "log-probs")
    assert_same_float32(values_p[real], values[real], "values")
    assert not old_p[~real].any() and not values_p[~real].any()  # 0 on padding, as the padded path gives
    for name in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert_same_metric(metrics_p[name], metrics[name], name)
    for name in ("critic/vf_loss", "critic/grad_norm"):
        assert_same_metric(value_metrics_p[name], value_metrics[name], name)


@pytest.mark.parametrize("role", ["actor", "reference", "critic"])
def test_packing_with_a_backend_that_cannot_keep_sequences_apart_is_refused_naming_the_key(role):
    with pytest.raises(ConfigError, match=rf"{role}.use_remove_padding with model.attn_implementation "
                                          r"'flex_attention'.*sdpa, eager"):
        load_config(None, [f"{role}.use_remove_padding=true", "model.attn_implementation=flex_attention"])
    assert load_config(None, [f"{role}.use_remove_padding=true"]).model.attn_implementation == "sdpa"
