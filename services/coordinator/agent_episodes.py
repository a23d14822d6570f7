"""Agent episodes as the sampler's samples (agent.entrypoint / agent.command; docs/agents-gateway.md).

    episodes = AgentEpisodes(config, gateway, runner_of(config.agent), score=peers.score)
    async for chunk in episodes.generate_and_score(rows, params):   # as Sampler.generate_and_score
        ...

Each (prompt, sample index) is one episode: a gateway episode is opened (its key is the agent's API key), the
agent runs on the row's task, the episode is closed, and its recorded calls, joined into segments, become that
(prompt, sample)'s FinishedSamples: zero (no call), one, or several (the agent rewrote its history). The
episode's outcome is its one result: the agent's reward, or its answer scored by the reward service. A prompt's
n episodes form its GRPO group; the step shares each episode's advantage over its segments
(rollout_batch.build_episode_batch, StepRunner._advantages).

An agent that raises, runs past agent.timeout_s or returns garbage fails its episode: result status
agent_failed (message "<reason>: ..."), so the step leaves it out of training and counts it
(sample_failures.py), and the run goes on, unless more than algorithm.max_failed_fraction of a step's episodes
fail: then the run fails.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rlfabric.agents.llm import LLM, AgentRunner
from rlfabric.agents.outcome import AGENT_FAILED_STATUS, RAISED, TIMEOUT, AgentFailed, AgentOutcome
from rlfabric.core.config import RunConfig
from rlfabric.data.dataset import PromptRow
from rlfabric.reward.items import ItemResult, ScoreItem, failed
from rlfabric.rollout.types import FinishedSample, SamplingSpec, row_seed

if TYPE_CHECKING:
    from rlfabric.gateway.server import Gateway

log = logging.getLogger("rlfabric.coordinator.agents")

Score = Callable[[list[ScoreItem]], Awaitable[list[ItemResult]]]
# A prompt's episodes: (prompt index, their segments, their results by sample index), as sampler.ScoredPrompt.
ScoredEpisodes = tuple[int, list[FinishedSample], dict[int, ItemResult]]


def agent_task(row: PromptRow) -> dict[str, Any]:
    """What the agent gets of a row: its prompt messages and public fields, never reward_model.ground_truth."""
    return {"messages": [dict(message) for message in row.messages], "data_source": row.data_source,
            "ability": row.ability, "uid": row.uid, "extra_info": json.loads(row.extra_info_json or "{}")}


def concurrent_episodes(config: RunConfig) -> int:
    """How many episodes run at once: agent.max_concurrent_episodes, at most what the gateway opens and, as an
    episode has one call in flight at a time, what the replicas admit (rollout.max_pending_requests each):
    calls past that would be 429s, which the SDKs retry only twice before the agent sees an error."""
    bounds = [config.agent.max_concurrent_episodes, config.agent.gateway.max_concurrent_episodes]
    if config.rollout.max_pending_requests:
        bounds.append(config.rollout.max_pending_requests * config.rollout.replicas)
    return min(bounds)


class AgentEpisodes:
    """Runs the agent once per (prompt, sample) through `gateway`, at most concurrent_episodes(config) at once;
    counts what agent/episodes, agent/segments and agent/failed/<reason> report."""

    def __init__(self, config: RunConfig, gateway: Gateway, runner: AgentRunner, score: Score):
        self.config = config
        self.gateway = gateway
        self.runner = runner
        self.score = score
        self.timeout_s = config.agent.timeout_s
        self.slots = asyncio.Semaphore(concurrent_episodes(config))
        self.counts: Counter[str] = Counter()
        self.seconds: list[float] = []

    async def generate_and_score(self, rows: list[PromptRow], params: SamplingSpec,
                                 on_sample: Callable[[FinishedSample], None] | None = None,
                                 ) -> AsyncIterator[list[ScoredEpisodes]]:
        """params.n episodes of each row: yields each prompt as (prompt index, its episodes' segments, their
        results by sample index) once all its episodes are scored, in the order they finish."""
        prompts = [asyncio.create_task(self._prompt(index, row, params)) for index, row in enumerate(rows)]
        try:
            for next_done in asyncio.as_completed(prompts):
                scored = await next_done
                if on_sample is not None:
                    for sample in scored[1]:
                        on_sample(sample)
                yield [scored]
        finally:
            for task in prompts:
                task.cancel()
            await asyncio.gather(*prompts, return_exceptions=True)

    async def _prompt(self, index: int, row: PromptRow, params: SamplingSpec) -> ScoredEpisodes:
        episodes = await asyncio.gather(*(self._episode(index, sample, row, params) for sample in range(params.n)))
        results: dict[int, ItemResult] = {}
        to_score: list[tuple[int, str]] = []
        for sample, (_, outcome) in enumerate(episodes):
            if isinstance(outcome, AgentFailed):
                results[sample] = failed(AGENT_FAILED_STATUS, str(outcome))
            elif outcome.reward is not None:
                results[sample] = ItemResult(outcome.reward, metrics=dict(outcome.metrics))
            else:
                to_score.append((sample, outcome.answer))
        if to_score:
            items = [self._score_item(row, answer) for _, answer in to_score]
            for (sample, _), result in zip(to_score, await self.score(items), strict=True):
                result.metrics = {**result.metrics, **episodes[sample][1].metrics}
                results[sample] = result
        segments = [segment for samples, _ in episodes for segment in samples]
        return index, segments, {sample: results[sample] for sample in range(params.n)}

    async def _episode(self, index: int, sample: int, row: PromptRow, params: SamplingSpec,
                       ) -> tuple[list[FinishedSample], AgentOutcome | AgentFailed]:
        """One episode: its segments as samples of (index, sample), and its outcome or why it failed."""
        seed = row_seed(params.seed, index, sample) if params.seed is not None else None
        async with self.slots:
            started = time.monotonic()
            episode = self.gateway.episodes.open(seed=seed, info={"uid": row.uid, "sample": sample},
                                                 temperature=params.temperature)
            llm = LLM(self.gateway.base_url, episode.key, self.gateway.model)
            try:
                outcome = await asyncio.wait_for(self.runner.run(agent_task(row), llm), self.timeout_s)
            except TimeoutError:
                outcome = AgentFailed(TIMEOUT, f"the agent ran past agent.timeout_s ({self.timeout_s:g} s)")
            except AgentFailed as error:
                outcome = error
            except Exception as error:  # a runner's own error (a process that could not start, ...)
                outcome = AgentFailed(RAISED, f"{type(error).__name__}: {error}")
            finally:
                record = self.gateway.episodes.close(episode.key)
            self.seconds.append(time.monotonic() - started)
        decode = self.gateway.calls.renderer.text
        samples = [segment.to_sample(index, sample, decode) for segment in record.segments]
        self.counts["episodes"] += 1
        self.counts["segments"] += len(samples)
        if isinstance(outcome, AgentFailed):
            self.counts[f"failed/{outcome.reason}"] += 1
            log.debug("agent episode of %s failed: %s", row.uid, outcome)
        return samples, outcome

    @staticmethod
    def _score_item(row: PromptRow, answer: str) -> ScoreItem:
        return ScoreItem(data_source=row.data_source, response=answer, ground_truth=row.ground_truth,
                         extra_info=json.loads(row.extra_info_json or "{}"),
                         prompt=row.messages[-1]["content"] if row.messages else "", prompt_messages=row.messages)

    def take_metrics(self) -> dict[str, float]:
        """agent/episodes, agent/segments, agent/failed/<reason> and agent/episode_seconds/{mean,max} since the
        last take."""
        metrics = {f"agent/{name}": float(count) for name, count in sorted(self.counts.items())}
        if self.seconds:
            metrics["agent/episode_seconds/mean"] = sum(self.seconds) / len(self.seconds)
            metrics["agent/episode_seconds/max"] = max(self.seconds)
        self.counts.clear()
        self.seconds.clear()
        return metrics
