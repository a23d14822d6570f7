"""Mixing scorers by data_source: one Score request scores each item with its own scorer (rules,
the custom function of reward.custom_sources, the reward model of reward.model_sources), the reward
model reads the whole conversation, and the config refuses routes that overlap."""

from __future__ import annotations

import asyncio
import textwrap

import grpc
import pytest

from rlfabric.core.config import ConfigError, RewardConfig, config_from_dict
from rlfabric.core.errors import InvalidArgument
from rlfabric.reward import STATUS_ERROR, STATUS_OK, ScoreItem
from rlfabric.reward.engine import CUSTOM, MODEL, RULES, RewardEngine, ScorerRouter
from rlfabric.reward.model_reward import RewardModelScorer
from rlfabric.reward.wire import items_from_request, request_from_items

from .test_model_reward import CHAT_TEMPLATE, save_qwen2

CUSTOM_FILE = textwrap.dedent(
    """
    def length_reward(data_source, solution_str, ground_truth, extra_info):
        return {"score": float(len(solution_str)), "custom": 1.0}
    """
)
DIALOGUE = [
    {"role": "user", "content": "how many apples does she have left"},
    {"role": "assistant", "content": "three"},
    {"role": "user", "content": "what is two plus two"},
]
HH = "Anthropic/hh-rlhf"


# --- the config: which combinations are allowed ---


@pytest.mark.parametrize(
    ("reward", "match"),
    [
        ({"custom_path": "f.py", "model_path": "rm"}, "would both score every item"),
        ({"custom_path": "f.py", "model_path": "rm", "custom_sources": ["a", "b"], "model_sources": ["b"]},
         r"share \['b'\]"),
        ({"custom_sources": ["a"]}, "reward.custom_sources is set but reward.custom_path is empty"),
        ({"model_sources": ["a"]}, "reward.model_sources is set but reward.model_path is empty"),
    ],
)
def test_overlapping_routes_are_config_errors_naming_the_keys(reward, match):
    with pytest.raises(ConfigError, match=f"reward.model_sources: .*{match}"):
        config_from_dict({"reward": reward})


@pytest.mark.parametrize(
    "reward",
    [
        {"custom_path": "f.py", "model_path": "rm", "model_sources": [HH]},  # the custom function takes the rest
        {"custom_path": "f.py", "model_path": "rm", "custom_sources": ["a"]},  # the model takes the rest
        {"custom_path": "f.py", "model_path": "rm", "custom_sources": ["a"], "model_sources": [HH]},  # rules too
    ],
)
def test_disjoint_routes_load(reward):
    assert config_from_dict({"reward": reward}).reward.model_path == "rm"


def test_router_sends_listed_sources_first_then_the_catch_all():
    both = ScorerRouter.from_config(RewardConfig(custom_path="f.py", model_path="rm", model_sources=[HH]))
    assert [both.route(source) for source in (HH, "openai/gsm8k", "x")] == [MODEL, CUSTOM, CUSTOM]
    lists = ScorerRouter.from_config(
        RewardConfig(custom_path="f.py", model_path="rm", custom_sources=["x"], model_sources=[HH]))
    assert [lists.route(source) for source in (HH, "openai/gsm8k", "x")] == [MODEL, RULES, CUSTOM]
    model_only = ScorerRouter.from_config(RewardConfig(model_path="rm"))
    assert model_only.route("openai/gsm8k") == MODEL  # VeRL's default: the model scores every item
    assert ScorerRouter.from_config(RewardConfig()).route(HH) == RULES


# --- the wire and the reward model: the whole conversation ---


def test_prompt_messages_cross_the_wire():
    item = ScoreItem(HH, "four", "", prompt="what is two plus two", prompt_messages=DIALOGUE)
    assert items_from_request(request_from_items([item]))[0].prompt_messages == DIALOGUE
    with pytest.raises(InvalidArgument, match=r"item 0: prompt_messages\[1\] must be a dict"):
        request_from_items([ScoreItem(HH, "four", "", prompt_messages=[DIALOGUE[0], {"role": "user"}])])


def test_reward_model_renders_every_turn_with_its_chat_template(tmp_path):
    scorer = RewardModelScorer(save_qwen2(tmp_path, chat_template=CHAT_TEMPLATE))
    text = scorer.format(DIALOGUE, "four")
    assert text == ("user : how many apples does she have left [EOS] assistant : three [EOS] "
                    "user : what is two plus two [EOS] assistant : four [EOS] ")
    whole, last_only = scorer.score_items([ScoreItem(HH, "four", "", prompt="what is two plus two",
                                                     prompt_messages=DIALOGUE),
                                           ScoreItem(HH, "four", "", prompt="what is two plus two")])
    assert whole.score == pytest.approx(scorer.score([DIALOGUE], ["four"])[0])
    assert whole.score != pytest.approx(last_only.score)  # the earlier turns change what the model reads


# --- one request, three scorers ---


@pytest.fixture
def mixed(reward_server, tmp_path):
    custom_file = tmp_path / "length_reward.py"
    custom_file.write_text(CUSTOM_FILE)
    model = save_qwen2(tmp_path, chat_template=CHAT_TEMPLATE)
    server = reward_server(model_path=model.model_path, model_tokenizer_path=model.tokenizer_path,
                           model_sources=[HH], custom_path=str(custom_file), custom_name="length_reward",
                           custom_sources=["my/custom"])
    return server, RewardModelScorer(model)


def test_one_request_scores_each_item_with_its_own_scorer(mixed):
    server, direct_model = mixed
    items = [
        ScoreItem("openai/gsm8k", "so #### 72", "72"),
        ScoreItem(HH, "four", "", prompt_messages=DIALOGUE),
        ScoreItem("my/custom", "abcde", ""),
        ScoreItem("Rowan/hellaswag", "Answer: C", "2"),
        ScoreItem(HH, "the answer is four", "", prompt="what is two plus two"),
        ScoreItem("openai/gsm8k", "so #### 71", "72"),
    ]
    results = server.score(items)
    assert [r.status for r in results] == [STATUS_OK] * len(items)
    expected_model = direct_model.score([DIALOGUE, "what is two plus two"], ["four", "the answer is four"])
    assert results[0].score == 1.0 and results[5].score == 0.0  # the GSM8K rule
    assert [results[1].score, results[4].score] == pytest.approx(expected_model, abs=1e-6)  # the model
    assert (results[2].score, results[2].metrics) == (5.0, {"custom": 1.0})  # the custom function
    assert results[3].score == 1.0  # the HellaSwag rule
    assert server.status().items_scored == len(items)


def test_an_unknown_source_for_the_rules_names_the_source_lists(mixed):
    server, _ = mixed
    error = server.raw_error(request_from_items([ScoreItem(HH, "x", ""), ScoreItem("nobody/data", "x", "")]).items)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "item 1: unknown data_source 'nobody/data'" in error.details()
    assert "reward.model_sources" in error.details() and "reward.custom_sources" in error.details()


def test_a_failing_reward_model_fails_only_its_items(tmp_path):
    model = save_qwen2(tmp_path, chat_template=CHAT_TEMPLATE)

    class BrokenModel:
        def score_items(self, items):
            raise RuntimeError("CUDA out of memory")

    async def run():
        engine = RewardEngine(RewardConfig(model_path=model.model_path, model_sources=[HH]))
        engine._started, engine.reward_model = True, BrokenModel()  # no load: the forward is what fails
        return await engine.score([ScoreItem(HH, "x", ""), ScoreItem("openai/gsm8k", "#### 1", "1")])

    dialogue, rule = asyncio.run(run())
    assert (dialogue.status, dialogue.score) == (STATUS_ERROR, 0.0)
    assert "RuntimeError: CUDA out of memory" in dialogue.message
    assert (rule.status, rule.score) == (STATUS_OK, 1.0)
