"""ModelBatcher: concurrent Score calls share reward-model forward passes; a caller that goes away
takes its queued items out; a failing forward fails only its items. And through the service: the
scores of concurrent calls equal the scorer's called directly."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rlfabric.reward import STATUS_ERROR, STATUS_OK, ItemResult, ScoreItem
from rlfabric.reward.model_batcher import ModelBatcher
from rlfabric.reward.model_reward import RewardModelScorer

from .test_model_reward import CHAT_TEMPLATE, PROMPTS, RESPONSES, save_qwen2


class RecordingModel:
    """Scores len(response); the first forward (`started`) waits for `release`, so later calls queue
    up behind it."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.started, self.release = threading.Event(), threading.Event()

    def score_batch(self, items):
        self.batches.append([item.response for item in items])
        if len(self.batches) == 1:
            self.started.set()
            assert self.release.wait(30)
        if any(item.response == "boom" for item in items):
            raise RuntimeError("CUDA out of memory")
        return [ItemResult(score=float(len(item.response))) for item in items]


def items(*responses: str) -> list[ScoreItem]:
    return [ScoreItem("Anthropic/hh-rlhf", response, "") for response in responses]


async def queued(batcher: ModelBatcher, count: int) -> None:
    """Yield to the loop until `count` items wait (each call queues in its first step: no timing involved)."""
    while batcher.queued < count:
        await asyncio.sleep(0)


def test_concurrent_calls_share_forward_passes():
    async def run():
        model = RecordingModel()
        batcher = ModelBatcher(model.score_batch, batch_size=4)
        first = asyncio.create_task(batcher.score(items("a")))
        assert await asyncio.to_thread(model.started.wait, 30)  # the first forward runs (until release)
        second = asyncio.create_task(batcher.score(items("bb", "ccc")))
        third = asyncio.create_task(batcher.score(items("dddd", "eeeee", "ffffff")))
        await queued(batcher, 5)
        model.release.set()
        return model, await first, await second, await third

    model, first, second, third = asyncio.run(run())
    # Items of two calls in one forward (batch_size 4), the rest in the next; results back in order.
    assert model.batches == [["a"], ["bb", "ccc", "dddd", "eeeee"], ["ffffff"]]
    assert [r.score for r in first + second + third] == [1, 2, 3, 4, 5, 6]


def test_a_cancelled_call_is_not_scored_and_a_failing_forward_fails_its_items_only():
    async def run():
        model = RecordingModel()
        batcher = ModelBatcher(model.score_batch, batch_size=2)
        first = asyncio.create_task(batcher.score(items("a")))
        assert await asyncio.to_thread(model.started.wait, 30)
        gone = asyncio.create_task(batcher.score(items("never", "scored")))
        failing = asyncio.create_task(batcher.score(items("boom", "x")))
        last = asyncio.create_task(batcher.score(items("yy")))
        await queued(batcher, 5)
        gone.cancel()
        model.release.set()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return model, await first, await failing, await last

    model, first, failing, last = asyncio.run(run())
    assert model.batches == [["a"], ["boom", "x"], ["yy"]]  # the cancelled call's items were dropped
    assert [(r.status, r.score) for r in failing] == [(STATUS_ERROR, 0.0)] * 2
    assert "RuntimeError: CUDA out of memory" in failing[0].message
    assert [(r.status, r.score) for r in first + last] == [(STATUS_OK, 1.0), (STATUS_OK, 2.0)]


def test_concurrent_calls_through_the_service_score_as_the_direct_scorer(reward_server, tmp_path):
    model = save_qwen2(tmp_path, chat_template=CHAT_TEMPLATE)
    expected = RewardModelScorer(model).score(PROMPTS, RESPONSES)
    server = reward_server(model_path=model.model_path, model_tokenizer_path=model.tokenizer_path,
                           model_batch_size=8)
    calls = [[ScoreItem("any/source", response, "", prompt=prompt)]
             for prompt, response in zip(PROMPTS, RESPONSES, strict=True)]

    async def score_all():
        from rlfabric.reward.client import RewardClient

        async with RewardClient(server.address) as client:
            return await asyncio.gather(*(client.score(call) for call in calls))

    results = [result for call in asyncio.run(score_all()) for result in call]
    assert [r.status for r in results] == [STATUS_OK] * len(calls)
    assert [r.score for r in results] == pytest.approx(expected, abs=1e-5)
