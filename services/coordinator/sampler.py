"""The sampler: samples generated over the rollout replicas and scored, for whatever samples in a run.

    sampler = Sampler(config, peers)
    async for chunk in sampler.generate_and_score(rows, sampler.training_params(gen_batch)):
        ...                                  # prompts whose samples are all scored, as they complete
    metrics = await sampler.validate(val_rows)
    baselines = await sampler.greedy_baselines(rows)   # ReMax

Training draws its batches through the RolloutStream (rollout_stream.py), which takes the sampler, and the
sampler turns the groups a step takes into its RolloutBatch (scored_batch); validation and ReMax's greedy
baselines call it directly. With agent.entrypoint (or agent.command) the samples are agent episodes run
through the gateway (AgentEpisodes, agent_episodes.py): an episode may record several segments, all of them
its sample index's. The sampler also holds the run's weight versions (WeightVersions): which one the rollout
serves, and which one holds the policy after a step.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlfabric.coordinator.multi_turn import agent_prompt, combined_result, env_result, multi_turn_spec
from rlfabric.coordinator.peers import Peers
from rlfabric.coordinator.rollout_batch import RolloutBatch, build_episode_batch, build_rollout_batch
from rlfabric.coordinator.sample_failures import failure_of
from rlfabric.core.config import RunConfig
from rlfabric.core.errors import FailedPrecondition
from rlfabric.data.dataset import PromptRow
from rlfabric.reward.items import ItemResult, ScoreItem
from rlfabric.rollout.types import FinishedSample, SamplingSpec

if TYPE_CHECKING:
    from rlfabric.coordinator.agent_episodes import AgentEpisodes

SCORE_CHUNK = 64  # samples per Score request while generation is still streaming

# A prompt's samples (in sample order; an agent episode's segments share its sample index) and their scores by
# sample index: (prompt index, samples, results).
ScoredPrompt = tuple[int, list[FinishedSample], dict[int, ItemResult]]


@dataclass
class WeightVersions:
    """The policy's weight versions in one run. Versions only grow on a replica, so a run's versions start
    above what the replicas serve when it starts (the run's prepare sets `base`)."""

    base: int = 0  # the version of the policy at step 0 of this run
    served: int = 0  # the version the rollout serves now (each weight sync sets it)

    def after(self, step: int) -> int:
        """The weight version that holds the policy after `step` steps of this run."""
        return self.base + step


class Sampler:
    """Generates over `peers.rollout` and scores with `peers.reward` (or the environment's rewards); with
    `agents`, runs agent episodes instead."""

    def __init__(self, config: RunConfig, peers: Peers, versions: WeightVersions | None = None,
                 agents: AgentEpisodes | None = None):
        self.config = config
        self.peers = peers
        self.versions = versions or WeightVersions()
        self.agents = agents

    # -- what samples ---------------------------------------------------------------------------------

    def training_params(self, gen_batch: int) -> SamplingSpec:
        """The sampling settings of training's gen batch `gen_batch` (seeded by its index; multi-turn ones
        included when rollout.multi_turn is on)."""
        rollout, max_tokens = self.config.rollout, self.max_tokens()
        return SamplingSpec(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                            max_tokens=max_tokens, seed=self._step_seed(gen_batch),
                            multi_turn=multi_turn_spec(self.config, max_tokens))

    async def validate(self, rows: list[PromptRow]) -> dict[str, float]:
        """Mean score on `rows` (data.val_files): val/score/mean and val-core/<data_source>/reward/mean@<n>."""
        rollout = self.config.rollout
        params = SamplingSpec(n=rollout.val_n, temperature=rollout.val_temperature, top_p=rollout.top_p,
                              top_k=rollout.top_k, max_tokens=self.max_tokens(), seed=self._step_seed(-1),
                              multi_turn=multi_turn_spec(self.config, self.max_tokens()))
        size = self.config.data.val_batch_size
        by_source: dict[str, list[float]] = {}
        for start in range(0, len(rows), size):
            part = rows[start : start + size]
            async for chunk in self.generate_and_score(part, params):
                for prompt_index, _, results in chunk:
                    by_source.setdefault(part[prompt_index].data_source, []).extend(r.score for r in results.values())
        metrics = {f"val-core/{source}/reward/mean@{rollout.val_n}": sum(s) / len(s) for source, s in by_source.items()}
        every = [score for scores in by_source.values() for score in scores]
        metrics["val/score/mean"] = sum(every) / len(every)
        return metrics

    async def greedy_baselines(self, rows: list[PromptRow]) -> torch.Tensor:
        """ReMax's baseline: the score of each prompt's greedy response, repeated for its n samples."""
        max_tokens = self.max_tokens()
        greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=max_tokens,
                              multi_turn=multi_turn_spec(self.config, max_tokens))
        by_prompt = {index: results[0].score async for chunk in self.generate_and_score(rows, greedy)
                     for index, _, results in chunk}
        return torch.tensor([by_prompt[p] for p in range(len(rows))]).repeat_interleave(self.config.rollout.n)

    # -- generation and scoring -----------------------------------------------------------------------

    async def generate_and_score(self, rows: list[PromptRow], params: SamplingSpec,
                                 on_sample: Callable[[FinishedSample], None] | None = None,
                                 ) -> AsyncIterator[list[ScoredPrompt]]:
        """params.n samples of each row over the rollout replicas, scored: yields the prompts whose samples
        are all scored, a chunk at a time, as (prompt index, samples, results), both by sample index. Score
        requests go out while generation still streams, once SCORE_CHUNK samples of complete prompts are in.
        on_sample sees each sample as it arrives (raising stops it all). Training (RolloutStream), validation
        and ReMax's baselines all generate through here; with agents, each sample is an agent episode."""
        if self.agents is not None:
            async for chunk in self.agents.generate_and_score(rows, params, on_sample):
                yield chunk
            return
        prompts = [self.prompt_of(row) for row in rows]
        finished: asyncio.Queue[asyncio.Task] = asyncio.Queue()
        scoring: set[asyncio.Task] = set()

        async def score(chunk: list[tuple[int, dict[int, FinishedSample]]]) -> list[ScoredPrompt]:
            pairs = [(rows[index], samples[k]) for index, samples in chunk for k in sorted(samples)]
            results = iter(await self.score_samples(pairs))
            return [(index, [samples[k] for k in sorted(samples)], {k: next(results) for k in sorted(samples)})
                    for index, samples in chunk]

        def score_later(chunk: list[tuple[int, dict[int, FinishedSample]]]) -> None:
            task = asyncio.create_task(score(chunk))
            scoring.add(task)
            task.add_done_callback(finished.put_nowait)

        async def generate() -> None:
            pending: dict[int, dict[int, FinishedSample]] = {}
            chunk: list[tuple[int, dict[int, FinishedSample]]] = []
            async for sample in self.peers.rollout.generate_stream(prompts, params,
                                                                   chunk_prompts=self._chunk_prompts()):
                if on_sample is not None:
                    on_sample(sample)
                samples = pending.setdefault(sample.prompt_index, {})
                samples[sample.sample_index] = sample
                if len(samples) == params.n:
                    chunk.append((sample.prompt_index, pending.pop(sample.prompt_index)))
                    if len(chunk) * params.n >= SCORE_CHUNK:
                        score_later(chunk)
                        chunk = []
            if chunk:
                score_later(chunk)

        generating = asyncio.create_task(generate())
        generating.add_done_callback(finished.put_nowait)
        try:
            while not generating.done() or scoring:
                task = await finished.get()
                if task is generating:
                    task.result()  # generation's error ends it all
                    continue
                scoring.discard(task)
                yield task.result()
            generating.result()
        finally:
            for task in (generating, *scoring):
                task.cancel()
            await asyncio.gather(generating, *scoring, return_exceptions=True)

    def scored_batch(self, rows: list[PromptRow], samples: list[FinishedSample],
                     results: dict[tuple[int, int], ItemResult], pad_token_id: int) -> RolloutBatch:
        """The groups a step took (rollout_stream.TakenGroups: its rows, samples and their results by (prompt,
        sample)) as its RolloutBatch, with their scores (failed samples: score_failed, and why). Agent episodes:
        a row per segment, each episode's result on all of its rows (build_episode_batch)."""
        n = self.config.rollout.n
        build = build_episode_batch if self.agents is not None else build_rollout_batch
        batch = build(rows, samples, n, pad_token_id)
        row_results = [results[(s.prompt_index, s.sample_index)] for s in batch.samples]
        batch.scores = torch.tensor([result.score for result in row_results])
        batch.score_failed = torch.tensor([not result.ok for result in row_results], dtype=torch.bool)
        batch.failures = [failure_of(result) for result in row_results]
        for result in row_results:
            for name, value in result.metrics.items():
                batch.reward_extra_info.setdefault(name, []).append(value)
        if self.config.algorithm.gdpo_reward_keys:
            batch.reward_components = reward_components(row_results, self.config.algorithm.gdpo_reward_keys)
        if batch.episode_ids is not None:
            episodes = [results[(p, i)] for p in range(len(rows)) for i in range(n)]
            batch.episode_scores = torch.tensor([result.score for result in episodes], dtype=torch.float32)
            batch.episode_failed = torch.tensor([not result.ok for result in episodes], dtype=torch.bool)
        return batch

    async def score_samples(self, pairs: list[tuple[PromptRow, FinishedSample]]) -> list[ItemResult]:
        """The score of each (row, sample): the reward service's, and with rollout.multi_turn the
        environment's rewards instead or added (rollout.multi_turn.reward)."""
        multi_turn = self.config.rollout.multi_turn
        if multi_turn.enable and multi_turn.reward == "env":  # the environment's rewards alone: no Score call
            return [env_result(sample) for _, sample in pairs]
        extra_infos: dict[int, dict] = {}  # a row's extra_info by id(row), parsed once for its n samples
        items = [self._score_item(row, sample, extra_infos) for row, sample in pairs]
        results = await self.peers.score(items, self.config.trainer.reward_retry_window_s)
        if multi_turn.enable:
            results = [combined_result(sample, result, multi_turn.reward)
                       for (_, sample), result in zip(pairs, results, strict=True)]
        return results

    def prompt_of(self, row: PromptRow):
        """What the rollout gets for a row: its token ids, or with rollout.multi_turn its agent task."""
        return agent_prompt(row) if self.config.rollout.multi_turn.enable else row.prompt_ids

    def max_tokens(self) -> int:
        """A response's token budget: rollout.response_length, else data.max_response_length."""
        return self.config.rollout.response_length or self.config.data.max_response_length

    # -- helpers --------------------------------------------------------------------------------------

    @staticmethod
    def _score_item(row: PromptRow, sample: FinishedSample, extra_infos: dict[int, dict]) -> ScoreItem:
        if id(row) not in extra_infos:
            extra_infos[id(row)] = json.loads(row.extra_info_json or "{}")
        return ScoreItem(data_source=row.data_source, response=sample.text, ground_truth=row.ground_truth,
                         extra_info=dict(extra_infos[id(row)]),  # a copy each: a scorer may change its own
                         prompt=row.messages[-1]["content"] if row.messages else "",
                         prompt_messages=row.messages, response_length=len(sample.token_ids))

    def _chunk_prompts(self) -> int:
        """Prompts per generate request: enough requests to spread over every replica."""
        replicas = max(1, len(self.peers.rollout.healthy()))
        return max(1, -(-self.config.data.train_batch_size // (2 * replicas)))

    def _step_seed(self, step: int) -> int | None:
        seed = self.config.rollout.seed
        return None if seed is None else random.Random(f"{seed}:{step}").randrange(2**31)


def reward_components(results: list[ItemResult], keys: list[str]) -> torch.Tensor:
    """[B, K] the scorer outputs `keys` (algorithm.gdpo_reward_keys) of each sample, 0 for a sample whose scoring
    failed (it trains on nothing); FailedPrecondition naming the key when a scored sample lacks one."""
    rows = []
    for result in results:
        missing = [key for key in keys if key not in result.metrics]
        if result.ok and missing:
            raise FailedPrecondition(f"algorithm.gdpo_reward_keys: the scorer gave no {missing} for a sample (its "
                                     f"outputs: {sorted(result.metrics) or 'the score alone'}); return them in "
                                     "compute_score's dict")
        rows.append([float(result.metrics[key]) if result.ok else 0.0 for key in keys])
    return torch.tensor(rows, dtype=torch.float32).reshape(len(results), len(keys))
