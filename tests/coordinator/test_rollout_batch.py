"""Assembling rollouts into the actor's batch layout, and the per-token score layout."""

import pytest
import torch

from rlfabric.coordinator.rollout_batch import build_rollout_batch, token_level_scores
from rlfabric.coordinator.sampler import reward_components
from rlfabric.coordinator.step_metrics import data_metrics
from rlfabric.core.errors import FailedPrecondition
from rlfabric.data.dataset import PromptRow
from rlfabric.reward.items import ItemResult, failed
from rlfabric.rollout.types import Finish, FinishedSample
from rlfabric.trainer.batch import validate_batch

PAD = 0


def row(uid: str, ids: list[int]) -> PromptRow:
    return PromptRow(uid, "src", [{"role": "user", "content": uid}], ids, "a", "x", "{}")


def sample(p: int, i: int, tokens: list[int], version: int = 0) -> FinishedSample:
    finish = Finish.LENGTH if len(tokens) == 3 else Finish.STOP
    return FinishedSample(p, i, tokens, [-0.5] * len(tokens), finish, version, text="t")


ROWS = [row("a", [5, 6, 7]), row("b", [8])]
SAMPLES = [sample(1, 1, [9]), sample(0, 0, [10, 11, 12]), sample(1, 0, [13, 14]), sample(0, 1, [])]


def test_layout_left_pads_prompts_right_pads_responses_and_orders_rows_by_prompt():
    batch = build_rollout_batch(ROWS, SAMPLES, n=2, pad_token_id=PAD)
    t = batch.tensors
    assert t["input_ids"].tolist() == [
        [5, 6, 7, 10, 11, 12],
        [5, 6, 7, PAD, PAD, PAD],
        [PAD, PAD, 8, 13, 14, PAD],
        [PAD, PAD, 8, 9, PAD, PAD],
    ]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0],
                                            [0, 0, 1, 1, 0, 0]]
    assert torch.equal(t["responses"], t["input_ids"][:, -3:])
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert [r.uid for r in batch.rows] == ["a", "a", "b", "b"]
    assert batch.response_lengths().tolist() == [3, 0, 2, 1]
    assert batch.prompt_lengths().tolist() == [3, 3, 1, 1]
    assert batch.truncated().tolist() == [True, False, False, False]
    validate_batch(dict(t), vocab_size=100)  # the actor accepts it as is


@pytest.mark.parametrize("samples, problem", [
    (SAMPLES[:3], "missing"),
    (SAMPLES + [sample(0, 0, [1])], "duplicates 1"),
])
def test_missing_or_repeated_samples_are_refused(samples, problem):
    with pytest.raises(ValueError, match=problem):
        build_rollout_batch(ROWS, samples, n=2, pad_token_id=PAD)


def test_score_sits_on_the_last_real_response_token():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 0, 0]])
    out = token_level_scores(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 0, 1.0], [0, 0, 0], [0, 3.0, 0], [4.0, 0, 0]]


def test_data_metrics_use_verl_names_and_masked_statistics():
    batch = build_rollout_batch(ROWS, SAMPLES, n=2, pad_token_id=PAD)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    batch.scores = scores
    batch.token_rewards = token_level_scores(scores, batch.response_mask)
    batch.advantages = torch.where(batch.response_mask.bool(), 2.0, 100.0)  # padding must not count
    metrics = data_metrics(batch, max_response_length=3)
    assert metrics["critic/score/mean"] == pytest.approx(0.5)
    assert metrics["critic/score/max"] == 1.0
    assert metrics["critic/advantages/max"] == 2.0
    assert metrics["response_length/mean"] == pytest.approx(1.5)
    assert metrics["response_length/clip_ratio"] == pytest.approx(0.25)
    assert metrics["prompt_length/max"] == 3
    assert not any(key.startswith("reward_extra/") for key in metrics)  # the scorer gave no other outputs


def test_a_scorers_extra_outputs_are_logged_over_the_samples_that_gave_them():
    batch = build_rollout_batch(ROWS, SAMPLES, n=2, pad_token_id=PAD)
    batch.scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    batch.reward_extra_info = {"exact_match": [1.0, 0.0, 0.0], "words": [3.0]}  # one sample's scoring failed
    metrics = data_metrics(batch, max_response_length=3)
    assert metrics["reward_extra/exact_match/mean"] == pytest.approx(1 / 3)
    assert metrics["reward_extra/exact_match/max"] == 1.0 and metrics["reward_extra/words/min"] == 3.0


def test_gdpos_reward_components_are_the_scorers_outputs_a_row_each():
    results = [ItemResult(1.0, metrics={"fmt": 1.0, "acc": 0.5}), failed("error", "it raised"),
               ItemResult(0.0, metrics={"acc": 0.0, "fmt": 0.25, "other": 9.0})]
    assert reward_components(results, ["fmt", "acc"]).tolist() == [[1.0, 0.5], [0.0, 0.0], [0.25, 0.0]]
    with pytest.raises(FailedPrecondition, match=r"algorithm.gdpo_reward_keys: the scorer gave no \['acc'\] for a "
                                                 r"sample \(its outputs: the score alone\)"):
        reward_components([ItemResult(1.0)], ["fmt", "acc"][1:])


# Multi-turn: a sample brings its prompt (rendered with the tools) and a loss mask with the
# environment's tokens at 0; the outcome score goes to the model's last token.

def agent_sample(p: int, i: int, prompt: list[int], tokens: list[int], mask: list[int]) -> FinishedSample:
    logprobs = [-0.5 if m else 0.0 for m in mask]
    return FinishedSample(p, i, tokens, logprobs, Finish.STOP, 0, text="t", prompt_ids=prompt, loss_mask=mask,
                          agent_status="max_turns")


def test_a_multi_turn_sample_brings_its_prompt_and_its_environment_tokens_are_masked_out():
    samples = [agent_sample(0, 0, [1, 2, 3, 4], [10, 11, 20, 21, 12, 22], [1, 1, 0, 0, 1, 0]), sample(0, 1, [13])]
    batch = build_rollout_batch([row("a", [5, 6])], samples, n=2, pad_token_id=PAD)
    t = batch.tensors
    assert t["input_ids"].tolist() == [[1, 2, 3, 4, 10, 11, 20, 21, 12, 22],
                                       [PAD, PAD, 5, 6, 13, PAD, PAD, PAD, PAD, PAD]]
    assert t["attention_mask"][0].tolist() == [1] * 10  # the model attends to the environment's tokens
    assert t["response_mask"].tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert batch.rollout_log_probs[0].tolist() == [-0.5, -0.5, 0, 0, -0.5, 0]
    assert batch.response_lengths().tolist() == [6, 1] and batch.prompt_lengths().tolist() == [4, 2]
    validate_batch(dict(t), vocab_size=100)  # the actor takes it
    scores = token_level_scores(torch.tensor([1.0, 2.0]), batch.response_mask)
    assert scores.tolist() == [[0, 0, 0, 0, 1.0, 0], [2.0, 0, 0, 0, 0, 0]]  # the model's last token, not the env's
