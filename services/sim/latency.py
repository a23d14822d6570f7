"""The rollout replica's latency model (sim.rollout), as pure functions of the config.

A replica decodes its running rows together, continuous-batching style: every running row gains one token per
decode step, and a step of b rows takes

    step(b) = (1 + (b - 1) / batch_knee) / decode_tokens_per_s          (simulated seconds)

so one row alone decodes at decode_tokens_per_s and the replica's throughput b / step(b) saturates at
batch_knee x decode_tokens_per_s. A row joining the batch first holds every running row for its prompt's prefill,
prompt_tokens / prefill_tokens_per_s (once per prompt of a request: its n samples share it). A straggler replica
takes straggler_slowdown times longer for both; every duration is multiplied by sim.time_scale to give real
seconds.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlfabric.core.config import ConfigError, RunConfig


@dataclass(frozen=True)
class RolloutLatency:
    """Real seconds of a replica's decode steps and prefills."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    batch_knee: float
    seconds_per_sim_second: float  # sim.time_scale, times straggler_slowdown on a straggler

    @classmethod
    def of(cls, config: RunConfig, straggler: bool = False) -> RolloutLatency:
        model = config.sim.rollout
        slowdown = model.straggler_slowdown if straggler else 1.0
        return cls(model.prefill_tokens_per_s, model.decode_tokens_per_s, model.batch_knee,
                   config.sim.time_scale * slowdown)

    def step_seconds(self, batch: int) -> float:
        """One decode step of `batch` rows."""
        return (1 + (max(batch, 1) - 1) / self.batch_knee) / self.decode_tokens_per_s * self.seconds_per_sim_second

    def prefill_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s * self.seconds_per_sim_second

    def batch_seconds(self, prompt_tokens: int, rows: int, length: int) -> float:
        """A request of `rows` rows (prompts with prompt_tokens between them), every one `length` tokens long,
        alone on an idle replica that runs them all at once: prefill, then `length` steps of `rows` rows."""
        return self.prefill_seconds(prompt_tokens) + length * self.step_seconds(rows)


def stragglers(config: RunConfig) -> frozenset[int]:
    """The replica indices that are stragglers: round(straggler_fraction x rollout.replicas) of them, drawn by
    sim.seed (the same set in every process of the run)."""
    count = round(config.sim.rollout.straggler_fraction * config.rollout.replicas)
    return frozenset(random.Random(config.sim.seed).sample(range(config.rollout.replicas), count))


def jitter_factor(rng: np.random.Generator, cv: float) -> float:
    """A lognormal factor of mean 1 and coefficient of variation `cv` (1 when cv is 0)."""
    if cv <= 0:
        return 1.0
    sigma = math.sqrt(math.log1p(cv * cv))
    return float(rng.lognormal(-sigma * sigma / 2, sigma))


class LengthModel:
    """Response lengths (sim.rollout.response_length): lognormal, max_tokens, or drawn from a file's lengths."""

    def __init__(self, config: RunConfig):
        model = config.sim.rollout
        self.kind = model.response_length
        self.mean = model.response_length_mean
        self.sigma = math.sqrt(math.log1p(model.response_length_cv ** 2))
        self.lengths = read_lengths(model.response_lengths_file) if self.kind == "file" else None

    def draw(self, rng: np.random.Generator, max_tokens: int) -> tuple[int, bool]:
        """(length, whether the response ended by itself: an EOS, not max_tokens)."""
        if self.kind == "max":
            return max_tokens, False
        if self.kind == "file":
            wanted = int(self.lengths[rng.integers(len(self.lengths))])
        else:
            mean = self.mean or max_tokens / 2
            wanted = round(rng.lognormal(math.log(mean) - self.sigma * self.sigma / 2, self.sigma))
        wanted = max(1, wanted)
        return (max_tokens, False) if wanted >= max_tokens else (wanted, True)


def read_lengths(path: str) -> np.ndarray:
    """The response lengths of sim.rollout.response_lengths_file (a JSON list of positive integers)."""
    if not path:
        raise ConfigError("sim.rollout.response_length file needs sim.rollout.response_lengths_file")
    try:
        lengths = np.asarray(json.loads(Path(path).read_text()), dtype=np.int64)
    except (OSError, ValueError, TypeError) as error:
        raise ConfigError(f"sim.rollout.response_lengths_file {path}: not a readable JSON list of lengths "
                          f"({error})") from None
    if lengths.ndim != 1 or not len(lengths) or lengths.min() < 1:
        raise ConfigError(f"sim.rollout.response_lengths_file {path}: needs a non-empty list of positive lengths")
    return lengths
