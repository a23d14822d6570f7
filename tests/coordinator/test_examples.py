"""The example configs for GPU users load and validate, and describe the runs they claim to."""

from pathlib import Path

import pytest

from rlfabric.core.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name, estimator, needs_critic", [
    ("gsm8k_qwen2.5_0.5b.yaml", "grpo", False),
    ("gsm8k_qwen2.5_0.5b_ppo.yaml", "gae", True),
])
def test_gsm8k_examples_validate(name, estimator, needs_critic):
    config = load_config(EXAMPLES / name)
    assert config.algorithm.adv_estimator == estimator
    assert config.model.dtype == "bfloat16" and config.rollout.engine == "vllm"
    assert config.data.train_files == ["data/gsm8k/train.parquet"]
    if estimator == "grpo":
        assert config.rollout.n > 1 and config.actor.use_kl_loss
    else:
        assert config.algorithm.use_kl_in_reward and config.critic.lr > config.actor.lr
