"""The generative judge's pieces without a model: its prompt, its parse rule, its config checks, its route, its
failures when no judge answers, and the step metric counting them (the judge itself: tests/real_model/test_judge.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rlfabric.coordinator.rollout_batch import build_rollout_batch
from rlfabric.coordinator.step_metrics import data_metrics
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import JudgeConfig, RewardConfig, load_config
from rlfabric.reward.engine import JUDGE, RULES, RewardEngine, ScorerRouter
from rlfabric.reward.items import STATUS_ERROR, STATUS_OK, ScoreItem
from rlfabric.reward.judge import JUDGE_FAILED, JudgeFailure, JudgeScorer, parse_score, render
from tests.conftest import closed_port
from tests.coordinator.test_rollout_batch import PAD, ROWS, SAMPLES


def test_render_fills_the_three_fields_once_and_keeps_other_braces():
    item = ScoreItem("s", response="{prompt} and {x}", ground_truth="42", prompt="What is {6 * 7}?")
    template = 'Q: {prompt}\nA: {response}\nRef: {ground_truth}\nReply as {"score": N}'
    assert render(template, item) == 'Q: What is {6 * 7}?\nA: {prompt} and {x}\nRef: 42\nReply as {"score": N}'


@pytest.mark.parametrize(
    ("verdict", "overrides", "score"),
    [
        ("Score: 7", {}, 7.0),
        ("I think... Score: 3.5 overall", {}, 3.5),
        ("Score: 12", {}, 10.0),  # clamped to max_score
        ("Score: -2", {}, 0.0),
        ('Verdict {"reason": "ok", "score": 4}', {"parse": "json"}, 4.0),
        ('{"score": "6"} then {"score": 9}', {"parse": "json"}, 6.0),
        ("x {bad json} {\"grade\": 2}", {"parse": "json", "json_field": "grade"}, 2.0),
    ],
)
def test_parse_reads_the_score_and_clamps_it(verdict, overrides, score):
    assert parse_score(verdict, JudgeConfig(**overrides)) == score


@pytest.mark.parametrize(
    ("verdict", "overrides", "reason"),
    [
        ("It is correct.", {}, "unparseable"),
        ("Score: none", {}, "unparseable"),
        ('{"score": true}', {"parse": "json"}, "unparseable"),
        ('{"score": "nan"}', {"parse": "json"}, "unparseable"),
        ("Score: 12", {"out_of_range": "fail"}, "out_of_range"),
    ],
)
def test_parse_fails_with_a_reason(verdict, overrides, reason):
    with pytest.raises(JudgeFailure) as info:
        parse_score(verdict, JudgeConfig(**overrides))
    assert info.value.reason == reason
    assert verdict in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["reward.judge.regex=(a)(b)"], "has 2 groups"),
        (["reward.judge.prompt_template=Rate it"], "has no {response}"),
        (["reward.judge.min_score=5", "reward.judge.max_score=5"], "must be below max_score"),
        (["reward.judge.data_sources=[x]"], "there is no judge"),
        (["judge.model_path=j", "reward.model_path=m"], "would both score every item"),
        (["judge.model_path=j", "reward.judge.addresses=[h:1]"], "not both"),
        (["reward.judge.addresses=[h:1]", "reward.model_path=m"], "would both score every item"),
        (["reward.judge.addresses=[h:1]", "reward.judge.data_sources=[a]", "reward.model_path=m",
          "reward.model_sources=[a]"], "share ['a']"),
        (["reward.judge.addresses=[h:1]", "cluster.rollout=[h:1]"], "shares ['h:1'] with cluster.rollout"),
    ],
)
def test_bad_judge_config_is_refused_naming_the_key(overrides, words):
    with pytest.raises(ValueError, match="reward.judge") as info:
        load_config(None, overrides)
    assert words in str(info.value)


def test_a_judge_pool_takes_the_judge_keys_and_needs_vllm_for_tensor_parallel():
    pool = load_config(None, ["judge.model_path=j", "reward.judge.data_sources=[chat]"])
    assert pool.has_judge() and pool.roles_in_use() == ["actor", "rollout", "judge", "reward", "coordinator"]
    filled = load_config(None, ["judge.model_path=j", "cluster.judge=[h:1]", "reward.judge.addresses=[h:1]"])
    assert filled.reward.judge.addresses == ["h:1"]  # as the launchers write it: the pool's own addresses
    with pytest.raises(ValueError, match="judge.tensor_parallel_size 2 needs judge.engine vllm"):
        load_config(None, ["judge.model_path=j", "judge.tensor_parallel_size=2"])


def test_the_judge_takes_its_sources_and_the_rules_the_rest():
    router = ScorerRouter.from_config(RewardConfig(judge={"addresses": ["h:1"], "data_sources": ["chat"]}))
    assert [router.route(source) for source in ("chat", "openai/gsm8k")] == [JUDGE, RULES]
    everything = ScorerRouter.from_config(RewardConfig(judge={"addresses": ["h:1"]}))
    assert everything.route("anything") == JUDGE


def test_no_judge_listening_fails_its_items_fast_and_counts_them():
    """A judge nobody listens at: its items fail (error, judge_failed 1, counted unavailable), the rule item
    of the same request is scored, and the call returns well inside the judge's timeout."""
    config = RewardConfig(judge={"addresses": [f"127.0.0.1:{closed_port()}"], "data_sources": ["chat"],
                                 "batch_size": 2, "timeout_s": 30})
    engine = RewardEngine(config, judge_options=ChannelOptions(retry_max_attempts=1))
    items = [ScoreItem("chat", "an answer", "", prompt="a question") for _ in range(3)]
    items.append(ScoreItem("openai/gsm8k", "so #### 72", "72"))

    async def run():
        await engine.start()
        try:
            return await engine.score(items)
        finally:
            await engine.stop()

    started = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - started < 10
    assert [r.status for r in results] == [STATUS_ERROR] * 3 + [STATUS_OK]
    assert results[3].score == 1.0
    assert all("judge" in r.message and "UNAVAILABLE" in r.message for r in results[:3])
    assert [r.metrics.get(JUDGE_FAILED) for r in results] == [1.0, 1.0, 1.0, None]
    counter = engine._judge_failures_total.labels(reason="unavailable")._value.get()
    assert counter == 3
    assert engine.status().items_failed == 3


def test_judge_scorer_batches_queued_items_and_bounds_concurrency():
    """Items of concurrent calls share requests of batch_size, with at most max_concurrency in flight."""
    config = JudgeConfig(addresses=["unused:1"], batch_size=3, max_concurrency=2)
    sizes, in_flight, most = [], 0, 0

    async def fake_generate(conversations):
        nonlocal in_flight, most
        sizes.append(len(conversations))
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0)  # let the other calls queue
        in_flight -= 1
        return ["Score: 5"] * len(conversations)

    async def run():
        scorer = JudgeScorer(config)  # its channels need the running loop
        scorer._generate = fake_generate
        calls = [scorer.score([ScoreItem("s", f"r{i}{j}", "") for j in range(4)]) for i in range(3)]
        results = await asyncio.gather(*calls)
        await scorer.close()
        return results

    results = asyncio.run(run())
    assert [[r.score for r in call] for call in results] == [[5.0] * 4] * 3
    assert sorted(sizes, reverse=True)[:3] == [3, 3, 3] and sum(sizes) == 12
    assert most == 2


def test_step_metrics_count_judge_failures_among_the_judged_samples():
    batch = build_rollout_batch(ROWS, SAMPLES, n=2, pad_token_id=PAD)
    batch.scores = torch.tensor([0.0, 5.0, 5.0, 0.0])
    batch.score_failed = torch.tensor([True, False, False, True])
    batch.reward_extra_info[JUDGE_FAILED] = [1.0, 0.0, 0.0]  # three judged samples, one failed
    metrics = data_metrics(batch, max_response_length=3)
    assert metrics["reward/judge_failures/count"] == 1.0
    assert metrics["reward/judge_failures/fraction"] == pytest.approx(1 / 3)
    assert metrics["reward/score_failed/count"] == 2.0
    assert not any(key.startswith("reward_extra/judge_failed") for key in metrics)
