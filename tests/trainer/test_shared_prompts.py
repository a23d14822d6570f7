"""Rows that share their prompt (GRPO's n samples of a prompt) send it through the model once
(<role>.share_prompt_forward): the log-probs, entropies, loss and gradient equal those of every row whole, the
model sees each distinct prompt's tokens once, and the services compute and train as without it."""

from __future__ import annotations

import pytest
import torch

from rlfabric.trainer import models
from rlfabric.trainer.batch import validate_batch
from rlfabric.trainer.objectives import MiniBatchCounts, PolicyObjective, forward_log_probs, shared_prompts
from tests.numerics import FLOAT64, assert_same_float32, assert_same_gradient, assert_same_metric
from tests.trainer.helpers import Served, make_batch, make_config

pytestmark = pytest.mark.numerics  # make test-kernels runs it under every CPU kernel family

GROUP = 4  # samples of each prompt
TRAIN = {"lr": 1e-3, "ppo_mini_batch_size": 3, "ppo_micro_batch_size_per_gpu": 12}


@pytest.fixture(scope="module")
def policy(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)  # tests/numerics.py


def grouped_batch(prompts: int = 3, response_len: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    """GROUP rows per prompt, as the coordinator lays a GRPO step out: the prompts left-padded to different
    lengths, each row's own response right-padded to its own length (one row of the last group empty)."""
    distinct = make_batch(rows=prompts, prompt_len=7, response_len=response_len, seed=seed)
    prompt_len = distinct["input_ids"].shape[1] - response_len
    rows = make_batch(rows=prompts * GROUP, prompt_len=7, response_len=response_len, seed=seed + 1)
    rows["response_mask"][-1] = 0
    rows["responses"] = rows["responses"] * rows["response_mask"]
    for name in ("input_ids", "attention_mask"):
        rows[name] = torch.cat([distinct[name][:, :prompt_len].repeat_interleave(GROUP, 0),
                                rows["responses"] if name == "input_ids" else rows["response_mask"]], dim=1)
    return rows


def _validated(model, raw: dict[str, torch.Tensor], seed: int = 0):
    advantages = torch.randn(raw["responses"].shape, generator=torch.Generator().manual_seed(seed))
    return validate_batch({**raw, "advantages": advantages}, models.vocab_size(model), required_floats=("advantages",))


def test_rows_of_one_prompt_are_found_and_rows_of_their_own_are_not(policy):
    batch = _validated(policy, grouped_batch(prompts=3))
    first_rows, prompt_of_row = shared_prompts(batch)
    assert first_rows.tolist() == [0, 4, 8]
    assert prompt_of_row.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert shared_prompts(_validated(policy, make_batch(rows=6, seed=2))) is None  # every prompt its own


@pytest.mark.parametrize("response_len", [5, 1])
def test_shared_prompt_log_probs_entropy_loss_and_gradient_equal_the_whole_rows(policy, response_len):
    batch = _validated(policy, grouped_batch(response_len=response_len))
    real = batch["response_mask"].bool()
    whole = forward_log_probs(policy, batch, 0.7, True, keep_logits=True, with_sum_pi_squared=True)
    shared = forward_log_probs(policy, batch, 0.7, True, keep_logits=True, share_prompts=True,
                               with_sum_pi_squared=True)
    for a, b, name in zip((*whole[:2], whole[3]), (*shared[:2], shared[3]), ("log-probs", "entropy",
                                                                            "sum_pi_squared"), strict=True):
        assert_same_float32(b[real], a[real], name)
    config = make_config(policy.name_or_path, actor={"entropy_coeff": 0.01})
    counts = MiniBatchCounts(tokens=float(real.sum()), sequences=float(real.any(1).sum()), response_len=response_len)
    results = {}
    for share in (False, True):
        policy.zero_grad()
        loss, _ = PolicyObjective(config.actor, 0.7, True, share_prompts=share).loss(policy, batch, counts)
        loss.backward()
        results[share] = loss.detach(), torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
    policy.zero_grad()
    assert_same_metric(float(results[True][0]), float(results[False][0]), "loss")
    assert_same_gradient(results[True][1], results[False][1], "gradient")


def test_each_distinct_prompt_goes_through_the_model_once(policy):
    batch = _validated(policy, grouped_batch(prompts=3, response_len=5))
    seen = []
    hook = policy.get_input_embeddings().register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))
    try:
        forward_log_probs(policy, batch, 1.0, False, keep_logits=True, share_prompts=True)
    finally:
        hook.remove()
    prompt_len = batch["input_ids"].shape[1] - 5
    # 3 prompts once each, then each row's response tokens but its last (the last predicts nothing)
    assert seen == [3 * prompt_len, batch.num_rows * 4]
    assert sum(seen) < batch["input_ids"].numel() / 2


def test_services_sharing_prompts_compute_and_train_as_without(tiny_model):
    batch = grouped_batch(prompts=3, response_len=5, seed=4)
    real = batch["response_mask"].bool()
    advantages = torch.linspace(-1.0, 1.0, batch["responses"].numel()).reshape(batch["responses"].shape)
    results = {}
    for share in (False, True):
        config = make_config(tiny_model, actor={**TRAIN, "share_prompt_forward": share}, rollout={"n": GROUP},
                             model=FLOAT64)
        with Served("actor", config) as served:
            old = served.run(served.client.compute_log_probs(batch, temperature=0.8))["log_probs"]
            metrics = served.run(served.client.update_policy({**batch, "old_log_probs": old, "advantages": advantages}))
            after = served.run(served.client.compute_log_probs(batch, temperature=0.8))["log_probs"]
        results[share] = old, metrics, after
    (old, metrics, after), (old_s, metrics_s, after_s) = results[False], results[True]
    assert_same_float32(old_s[real], old[real], "log-probs")
    assert not old_s[~real].any()  # 0 on padding, as every row whole gives
    assert not torch.allclose(after[real], old[real])  # the update moved the policy...
    assert_same_float32(after_s[real], after[real], "log-probs after the update")  # ...the same way
    for name in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert_same_metric(metrics_s[name], metrics[name], name)
