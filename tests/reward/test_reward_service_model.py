"""A reward model behind RewardService scores as the scorer called directly does."""

from __future__ import annotations

import pytest

from rlfabric.reward import STATUS_OK, ScoreItem
from rlfabric.reward.model_reward import RewardModelScorer

from .test_model_reward import CHAT_TEMPLATE, PROMPTS, RESPONSES, save_qwen2


def test_reward_model_through_the_service_equals_the_direct_scorer(reward_server, tmp_path):
    model = save_qwen2(tmp_path, chat_template=CHAT_TEMPLATE)
    model.batch_size = 2
    expected = RewardModelScorer(model).score(PROMPTS, RESPONSES)

    server = reward_server(
        model_path=model.model_path, model_tokenizer_path=model.tokenizer_path, model_batch_size=2
    )
    items = [
        ScoreItem("any/source", response, "", prompt=prompt)
        for prompt, response in zip(PROMPTS, RESPONSES, strict=True)
    ]
    results = server.score(items)
    assert [r.status for r in results] == [STATUS_OK] * len(items)
    assert [r.score for r in results] == pytest.approx(expected, abs=1e-6)
    assert len({round(r.score, 4) for r in results}) > 1  # a real signal
    assert server.status().items_scored == len(items)
