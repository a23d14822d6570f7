"""Generation streaming ahead of training (rlfabric.coordinator.rollout_stream) on the in-process mesh: the
staleness bound per sample and per token, dynamic sampling filling a batch and hitting its cap, and
timing_s/step against the wall clock; and, over stand-in services, a gen batch dropped for staleness."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import zlib
from pathlib import Path

import pytest

from rlfabric.coordinator.driver import NoHooks
from rlfabric.coordinator.sampler import WeightVersions
from rlfabric.reward.items import ItemResult
from rlfabric.rollout.router import RouterStats
from rlfabric.rollout.types import Finish, FinishedSample
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config, in_process
from tests.coordinator.test_loop import PROMPTS, ModelService, config, driver_over
from tests.coordinator.test_loop_control import run_wrapped


def dumped(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def token_versions(sample: dict) -> list[tuple[int, int]]:
    """[(version, first token index)] of a dumped sample: its spans, or its one version from token 0."""
    return [tuple(span) for span in sample["version_spans"]] or [(sample["weight_version"], 0)]


def test_with_staleness_two_no_sample_or_token_is_more_than_two_versions_behind(tiny_model, tmp_path):
    steps = 5
    metrics, status = run_wrapped(tiny_model, tmp_path / "run", None, "trainer.mode=async", "trainer.max_staleness=2",
                                  f"trainer.total_steps={steps}")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert sorted(metrics) == list(range(1, steps + 1))
    most = 0
    for step in range(1, steps + 1):
        policy = metrics[step]["rollout/weight_version"] - 1  # the version trained on: the one before this step's sync
        samples = dumped(tmp_path / "run", step)
        assert len(samples) == 8 * 4
        for sample in samples:
            spans = token_versions(sample)
            assert spans[0] == (sample["weight_version"], 0)  # weight_version is the oldest token's
            assert [first for _, first in spans] == sorted({first for _, first in spans})  # boundaries in order
            assert [v for v, _ in spans] == sorted({v for v, _ in spans})  # each span newer than the one before
            assert 0 <= policy - spans[-1][0] <= policy - spans[0][0] <= 2
            most = max(most, policy - spans[0][0])
        assert metrics[step]["rollout/staleness/max"] <= 2
    assert most >= 1  # generation did run ahead of training
    assert metrics[1]["rollout/staleness/max"] == 0  # step 1: the starting weights


class ScoredByPrompt:
    """A reward client: prompts whose text hashes even get the same score for every response (a group
    dynamic sampling drops), the others a score that varies with the response; the score of every
    prompt is the same otherwise. `constant` makes every group constant."""

    def __init__(self, inner, constant: bool = False):
        self.inner, self.constant = inner, constant
        self.role = inner.role

    def score_of(self, item) -> float:
        if self.constant or zlib.crc32(item.prompt.encode()) % 2 == 0:
            return 1.0
        return float(zlib.crc32(f"{item.response}|{item.response_length}".encode()) % 3)

    async def score(self, items, timeout_s=None):
        return [ItemResult(self.score_of(item)) for item in items]

    async def status(self, timeout_s=None):
        return await self.inner.status(timeout_s)

    async def close(self):
        await self.inner.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dynamic_sampling_fills_every_batch_with_groups_that_vary(tiny_model, tmp_path, mode):
    def wrap(peers):
        return dataclasses.replace(peers, reward=ScoredByPrompt(peers.reward))

    metrics, status = run_wrapped(tiny_model, tmp_path / "run", wrap, f"trainer.mode={mode}", "trainer.total_steps=3",
                                  "algorithm.filter_groups.enable=true", "rollout.temperature=2.0")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    for step in (1, 2, 3):
        samples = dumped(tmp_path / "run", step)
        groups: dict[str, list[float]] = {}
        for sample in samples:
            groups.setdefault(sample["uid"], []).append(sample["score"])
        assert len(groups) == 8 and all(len(scores) == 4 for scores in groups.values())  # a full batch
        assert all(max(scores) > min(scores) for scores in groups.values())  # none without spread
        assert metrics[step]["dynamic_sampling/gen_batches"] >= 1
    assert sum(metrics[step]["dynamic_sampling/dropped_groups"] for step in metrics) > 0
    assert sum(metrics[step]["dynamic_sampling/gen_batches"] for step in metrics) > 3  # extra prompts were drawn
    if mode == "sync":
        assert all(metrics[step]["rollout/staleness/max"] == 0 for step in metrics)


def test_dynamic_sampling_that_reaches_its_cap_short_of_a_batch_fails_the_step(tiny_model, tmp_path):
    def wrap(peers):
        return dataclasses.replace(peers, reward=ScoredByPrompt(peers.reward, constant=True))

    metrics, status = run_wrapped(tiny_model, tmp_path / "run", wrap, "algorithm.filter_groups.enable=true",
                                  "algorithm.filter_groups.max_num_gen_batches=2")
    assert status.state == coordinator_pb2.RUN_STATE_FAILED and metrics == {}
    assert "max_num_gen_batches=2" in status.error and "kept 0 of the 8 groups" in status.error


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_step_time_is_the_wall_clock_between_steps(tiny_model, tmp_path, mode):
    """timing_s/step is wall time per step in every mode: generation hidden behind training
    (timing_s/gen_overlapped) is not counted again."""
    config = fast_config(tiny_model, f"trainer.mode={mode}", "trainer.max_staleness=1", "trainer.total_steps=5")

    async def scenario():
        arrivals: dict[int, tuple[float, dict[str, float]]] = {}
        async with in_process(config, tmp_path / "run") as client:
            await client.start_run()
            async for update in client.stream_metrics(from_step=1):
                arrivals[update.step] = (time.perf_counter(), dict(update.metrics))
        return arrivals

    arrivals = asyncio.run(scenario())
    assert sorted(arrivals) == [1, 2, 3, 4, 5]
    for step in (3, 4, 5):  # steps 1-2: warm-up of the services
        wall = arrivals[step][0] - arrivals[step - 1][0]
        reported = arrivals[step][1]
        assert reported["timing_s/step"] == pytest.approx(wall, rel=0.25, abs=0.05), (step, wall, reported)
        assert reported["perf/throughput"] == pytest.approx(reported["perf/total_num_tokens"] / reported["timing_s/step"])
        assert reported["timing_s/gen"] <= reported["timing_s/step"]
        assert reported["timing_s/gen_overlapped"] >= 0


class Rollout:
    """Stands in for the rollout router: each request's samples carry the weight version the rollout serves
    when they finish, and the request's number in their last token; request `stuck` never finishes."""

    def __init__(self, stuck: int):
        self.stuck, self.requests = stuck, []
        self.versions = WeightVersions()  # the run's, once it is built
        self.stats = RouterStats()  # the loop reads its counts each step

    def healthy(self):
        return [self]

    async def status(self, timeout_s=None):
        return {}  # no replica to wake at the run's start

    async def generate_stream(self, prompts, params, chunk_prompts=None):
        self.requests.append(asyncio.current_task())
        number = len(self.requests)
        if number == self.stuck:
            await asyncio.Event().wait()
        for p in range(len(prompts)):
            for i in range(params.n):
                yield FinishedSample(p, i, [4, number], [], Finish.STOP, self.versions.served)


class RecordedMetrics(NoHooks):
    """The run's hooks: each step's metrics, by step."""

    def __init__(self):
        self.metrics: dict[int, dict[str, float]] = {}

    def on_metrics(self, step: int, metrics: dict[str, float], trace_id: str) -> None:
        self.metrics[step] = metrics


class Reward:
    async def score(self, items, timeout_s=None):
        return [ItemResult(float(i % 2)) for i in range(len(items))]


def test_a_gen_batch_that_falls_behind_the_staleness_bound_is_dropped_never_trained_on(tmp_path):
    """k = 1: gen batches 1 and 2 start on the first weights; 2 hangs, so step 2 trains on gen batch 3
    (started after step 1's sync). Once step 2 is taken, gen batch 2 could only train at step 3, two
    versions behind: it is cancelled and its groups counted in rollout/stale_groups."""
    actor = ModelService("actor")
    run_config = config("trainer.mode=async", "trainer.max_staleness=1", "trainer.save_final=false",
                        "trainer.export_final=false")
    rollout = Rollout(stuck=2)
    hooks = RecordedMetrics()
    driver = driver_over(run_config, tmp_path, actor, rollout=rollout, reward=Reward(), hooks=hooks)
    rollout.versions = driver.versions
    asyncio.run(driver.run())
    metrics = hooks.metrics
    trained_on = [int(update["responses"][0, 1]) for update in actor.updates]  # the request of each step's batch
    assert trained_on == [1, 3, 4]
    assert rollout.requests[1].cancelled()
    assert [metrics[step]["rollout/stale_groups"] for step in (1, 2, 3)] == [0, 0, PROMPTS]
    assert all(metrics[step]["rollout/staleness/max"] <= 1 for step in (1, 2, 3))
