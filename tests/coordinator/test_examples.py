"""The example configs for GPU users load and validate, and describe the runs they claim to."""

from pathlib import Path

import pytest

from rlfabric.core.config import load_config
from rlfabric.launch.local import service_names
from rlfabric.launch.placement import plan_placement

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
    # On two GPUs the trainers and the rollout get different devices, so NCCL can connect them.
    placements = plan_placement(config, service_names(config), gpu_count=2)
    trainers = {placements[role].gpus for role in ("actor", "reference", "critic") if role in placements}
    assert trainers == {(0,)} and placements["rollout-0"].gpus == (1,)


def test_math_example_scores_with_the_math_rule():
    from rlfabric.reward.engine import RULES, ScorerRouter
    from rlfabric.reward.registry import MATH_DATA_SOURCES

    config = load_config(EXAMPLES / "math_grpo.yaml")
    assert config.algorithm.adv_estimator == "grpo" and config.data.train_files == ["data/math/train.parquet"]
    assert "lighteval/MATH" in MATH_DATA_SOURCES  # the data_source `rlfabric data math` writes
    assert ScorerRouter.from_config(config.reward).route("lighteval/MATH") == RULES


def test_hh_rlhf_example_scores_dialogues_with_its_reward_model():
    from rlfabric.reward.engine import MODEL, RULES, ScorerRouter

    config = load_config(EXAMPLES / "hh_rlhf_ppo.yaml")
    assert config.algorithm.adv_estimator == "gae" and config.algorithm.use_kl_in_reward
    assert config.data.train_files == ["data/hh_rlhf/train.parquet"]
    router = ScorerRouter.from_config(config.reward)
    assert router.route("Anthropic/hh-rlhf") == MODEL and router.route("openai/gsm8k") == RULES


@pytest.mark.parametrize("name, environment", [("lookup_multi_turn.yaml", "calculator"),
                                               ("smollm2_calculator.yaml", "calculator")])
def test_multi_turn_examples_validate_as_runs(name, environment):
    from rlfabric.core.config import load_run_config

    config = load_run_config(EXAMPLES / name)
    assert config.rollout.multi_turn.enable and config.env.enable
    assert config.env.name == environment  # lookup rows name their environment themselves (extra_info)
    assert config.rollout.multi_turn.max_total_tokens <= config.data.max_response_length


def test_the_agent_example_validates_as_a_run():
    from rlfabric.core.config import load_run_config

    config = load_run_config(EXAMPLES / "agents" / "lookup.yaml")
    assert config.agent.runs_agents() and config.agent.runner == "subprocess"
    assert config.agent.entrypoint == "examples/agents/lookup_agent.py:run"
    assert not config.rollout.multi_turn.enable and not config.env.enable  # the agent runs its own tool


def test_reasoning_gym_example_generates_chain_sum_rows_the_rules_score():
    pytest.importorskip("reasoning_gym")
    from rlfabric.core.config import load_run_config
    from rlfabric.reward.engine import RULES, ScorerRouter, unscored_sources

    config = load_run_config(EXAMPLES / "reasoning_gym_chain_sum.yaml")
    assert config.data.builtin_task == "reasoning_gym" and not config.data.train_files
    assert list(config.data.reasoning_gym.datasets) == ["chain_sum"]
    assert ScorerRouter.from_config(config.reward).route("reasoning_gym/chain_sum") == RULES
    assert unscored_sources(config.reward, ["reasoning_gym/chain_sum"]) == []
