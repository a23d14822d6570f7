"""A step's metrics with VeRL's names: data statistics, timings and throughput."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from contextlib import contextmanager
from typing import TypeVar

import torch

from rlfabric.coordinator.rollout_batch import RolloutBatch
from rlfabric.core import tracing
from rlfabric.reward.judge import JUDGE_FAILED

T = TypeVar("T")


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.to(torch.float32)
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values[mask] (CPU), by numpy's boolean index: torch's builds an int64 index of every true cell first
    (~0.4 GB more at 4,096 x 16 samples, the step's peak RSS)."""
    return torch.from_numpy(values.numpy()[mask.numpy()])


def data_metrics(batch: RolloutBatch, max_response_length: int) -> dict[str, float]:
    """critic/score, critic/rewards, critic/advantages, critic/returns, critic/values, response and
    prompt lengths: per-sequence values for scores/rewards, per-token values (masked) for the rest;
    reward/score_failed/{count,fraction}: samples whose scoring failed; reward/judge_failures/{count,fraction}: of
    the samples the generative judge scored, those it gave no score (masked like any failed sample); reward_extra/<name>/{mean,max,min}: each
    other output of the scorer (a compute_score dict's numbers besides "score"), over the samples that gave it."""
    mask = batch.response_mask.bool()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", batch.scores))
    if batch.score_failed is not None:  # samples the reward service could not score (see algorithm.score_failure)
        failed = batch.score_failed.to(torch.float32)
        metrics["reward/score_failed/count"] = failed.sum().item()
        metrics["reward/score_failed/fraction"] = failed.mean().item() if failed.numel() else 0.0
    judge_failed = batch.reward_extra_info.get(JUDGE_FAILED)
    if judge_failed:  # the samples a generative judge scored (reward.judge), 1.0 where it gave no score
        metrics["reward/judge_failures/count"] = float(sum(judge_failed))
        metrics["reward/judge_failures/fraction"] = sum(judge_failed) / len(judge_failed)
    for name, values in sorted(batch.reward_extra_info.items()):
        if name != JUDGE_FAILED:
            metrics.update(_stats(f"reward_extra/{name}", torch.tensor(values)))
    if batch.token_rewards is not None:
        metrics.update(_stats("critic/rewards", batch.token_rewards.sum(-1)))
    done: dict[int, str] = {}  # the outcome estimators' returns are their advantages: one pass over [B, T]
    for name in ("advantages", "returns", "values"):
        tensor = getattr(batch, name)
        if tensor is not None and id(tensor) in done:
            metrics.update({f"critic/{name}/{stat}": metrics[f"critic/{done[id(tensor)]}/{stat}"]
                            for stat in ("mean", "max", "min") if f"critic/{done[id(tensor)]}/{stat}" in metrics})
        elif tensor is not None:
            metrics.update(_stats(f"critic/{name}", _masked(tensor, mask)))
            done[id(tensor)] = name
    if batch.values is not None and batch.returns is not None:
        returns, values = _masked(batch.returns, mask), _masked(batch.values, mask)
        variance = returns.var(unbiased=False)
        metrics["critic/vf_explained_var"] = (1.0 - (returns - values).var(unbiased=False) / (variance + 1e-8)).item()
    response_lengths = batch.response_lengths()
    metrics.update(_stats("response_length", response_lengths))
    metrics["response_length/clip_ratio"] = (response_lengths >= max_response_length).float().mean().item()
    metrics.update(_stats("prompt_length", batch.prompt_lengths()))
    return metrics


class StepTimer:
    """Wall time of named phases of one step: `with timer("gen"): ...` -> timing_s/gen.

    With tracing on (rlfabric.core.tracing) the timer of step `step` is also the step's trace: a root
    span from the timer's creation to `metrics` (or `end`), and a child span per phase, current while
    the phase runs, so the RPCs of a phase are its children and a phase's span and timing are one
    measurement."""

    def __init__(self, step: int | None = None):
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()
        self.trace = tracing.StepSpan(step)  # does nothing when tracing is off or step is None

    @contextmanager
    def __call__(self, phase: str):
        started = time.perf_counter()
        try:
            with tracing.phase_span(self.trace, phase):
                yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started

    async def timed(self, phase: str, call: Awaitable[T]) -> T:
        """Awaits `call` under timer `phase`: calls gathered at once each get their own time (and span)."""
        with self(phase):
            return await call

    @property
    def trace_id(self) -> str:
        """The step's trace id (hex); "" when tracing is off or the step's trace is not sampled."""
        return self.trace.trace_id

    def end(self, error: BaseException | None = None) -> None:
        """Ends the step's span (marked failed with `error`); `metrics` ends it on success."""
        self.trace.end(error)

    def metrics(self, batch: RolloutBatch | None, previous_step_end: float | None = None) -> dict[str, float]:
        """timing_s/<phase>, timing_s/step, throughput over the step's tokens, and the step's samples.

        timing_s/step is wall time between step ends: from the previous step's end (or this step's
        start, if later) to now. In async mode a batch's generation starts while the previous step
        trains; counting from there would count the overlapped time twice. Ends the step's span."""
        started = max(self.started, previous_step_end or 0.0)
        step_seconds = time.perf_counter() - started
        metrics = {f"timing_s/{phase}": seconds for phase, seconds in self.seconds.items()}
        metrics["timing_s/step"] = step_seconds
        if batch is not None:
            tokens = float(batch.tensors["attention_mask"].sum())
            metrics["perf/total_num_tokens"] = tokens
            metrics["perf/time_per_step"] = step_seconds
            metrics["perf/throughput"] = tokens / step_seconds if step_seconds > 0 else 0.0
            metrics["rollout/samples"] = float(len(batch.samples))
            if self.trace.recording:
                versions = batch.weight_versions()
                self.trace.set(samples=len(batch.samples), tokens=int(tokens),
                               weight_version=int(versions.max()) if versions.numel() else None)
        self.end()
        return metrics
