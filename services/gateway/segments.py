"""An episode's recorded calls joined into training sequences (segments), and advantages shared per episode.

    segments = join_calls(record.calls)     # calls that extend each other: one segment
    samples = [s.to_sample(prompt_index, i, decode) for i, s in enumerate(segments)]

A call extends a segment when its prompt ids start with everything the segment holds (its prompt, then each
call's sampled ids and the tokens between turns): the call's new prompt tokens join the segment with loss mask
0, its sampled tokens with 1. A call that extends nothing still open (the agent rewrote or cut its history, or
branched from an earlier call) starts a new segment whose prompt is all of its prompt ids, so every sampled
token is trained once, in the segment of the call that sampled it.

The episode's reward is one number however many segments it has: advantages are estimated over episodes (one
row each, grouped by prompt) and each segment takes its episode's (episode_advantages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rlfabric.algorithms.registry import get_advantage_estimator
from rlfabric.rollout.routes import join_routes, padded_routes
from rlfabric.rollout.types import Finish, FinishedSample, compact_versions


@dataclass
class RecordedCall:
    """One call as the engine ran it: the ids it consumed and sampled, never re-encoded."""

    number: int
    """Its place in the episode, from 0."""
    call_id: str
    prompt_ids: list[int]  # (P,) what the engine consumed
    token_ids: list[int]  # (L,) what it sampled
    logprobs: list[float]  # (L,)
    token_versions: list[int]  # (L,) the weight version that sampled each token
    finish_reason: Finish
    parent: int | None = None
    """The call whose conversation this one extends (its ids reused verbatim); None = rendered whole."""
    text: str = ""
    """The reply's text (special tokens left out)."""
    message: dict | None = None
    """The assistant message answered (chat calls)."""
    seconds: float = 0.0
    """Seconds from the request taken to the reply parsed (render, wait for a replica, generate, parse)."""
    routes: np.ndarray | None = None
    """(P + L, layers, top_k) the experts the engine chose for each token it ran (actor.router_replay), else None."""


@dataclass
class Segment:
    """One training sequence: a prompt, then the calls' sampled tokens (mask 1) and what came between (mask 0)."""

    calls: list[int]
    prompt_ids: list[int]  # (P,)
    token_ids: list[int] = field(default_factory=list)  # (L,)
    loss_mask: list[int] = field(default_factory=list)  # (L,) 1 = sampled
    logprobs: list[float] = field(default_factory=list)  # (L,) 0.0 where not sampled
    token_versions: list[int] = field(default_factory=list)  # (L,) not-sampled tokens take the version before them
    finish_reason: Finish = Finish.STOP
    routes: np.ndarray | None = None  # (<= P + L, layers, top_k) each token's from the first call that ran it

    def ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add(self, call: RecordedCall) -> None:
        """Appends a call that extends this segment: its new prompt tokens, then its sampled ones."""
        between = call.prompt_ids[len(self.prompt_ids) + len(self.token_ids):]
        version = self.token_versions[-1] if self.token_versions else (call.token_versions or [0])[0]
        self.token_ids += between + call.token_ids
        self.loss_mask += [0] * len(between) + [1] * len(call.token_ids)
        self.logprobs += [0.0] * len(between) + call.logprobs
        self.token_versions += [version] * len(between) + call.token_versions
        self.routes = join_routes(self.routes, call.routes)
        self.calls.append(call.number)
        self.finish_reason = call.finish_reason

    def to_sample(self, prompt_index: int, sample_index: int, decode: Callable[[list[int]], str]) -> FinishedSample:
        """The segment as the coordinator's batches take a multi-turn sample (own prompt ids, loss mask)."""
        spans, last = [], None
        for index, version in enumerate(self.token_versions):
            if version != last:
                spans.append((version, index))
                last = version
        weight_version, version_spans = compact_versions(spans) if spans else (0, [])
        return FinishedSample(prompt_index, sample_index, list(self.token_ids), list(self.logprobs),
                              self.finish_reason, weight_version, text=decode(self.token_ids),
                              prompt_ids=list(self.prompt_ids), loss_mask=list(self.loss_mask),
                              version_spans=version_spans,
                              routed_experts=padded_routes(self.routes, len(self.prompt_ids) + len(self.token_ids)))


def join_calls(calls: Sequence[RecordedCall]) -> list[Segment]:
    """The calls (in the order they were recorded) as segments; see the module's docstring."""
    segments: list[Segment] = []
    for call in calls:
        extended = [s for s in segments if _starts_with(call.prompt_ids, s.ids())]
        if extended:
            max(extended, key=lambda s: len(s.prompt_ids) + len(s.token_ids)).add(call)
            continue
        segment = Segment([], list(call.prompt_ids))
        segment.add(call)
        segments.append(segment)
    return segments


def _starts_with(ids: list[int], prefix: list[int]) -> bool:
    return len(ids) >= len(prefix) and ids[:len(prefix)] == prefix


def episode_advantages(estimator: str, episode_scores: torch.Tensor, episode_groups: torch.Tensor,
                       segment_episodes: torch.Tensor, mask: torch.Tensor, norm_by_std: bool = True) -> torch.Tensor:
    """[B, T] advantages of B segments: the outcome estimator (grpo, rloo, reinforce_plus_plus) over E
    episodes, each one row (episode_scores [E], episode_groups [E]: its prompt), then each segment takes its
    episode's (segment_episodes [B]: index into the episodes) on its sampled tokens (mask [B, T]). norm_by_std:
    GRPO divides by the group's standard deviation (algorithm.norm_adv_by_std_in_grpo)."""
    token_rewards = episode_scores.to(torch.float32).unsqueeze(-1)  # [E, 1]
    ones = torch.ones_like(token_rewards)
    per_episode, _ = get_advantage_estimator(estimator)(token_rewards=token_rewards, mask=ones,
                                                        group_ids=episode_groups, norm_by_std=norm_by_std)  # [E, 1]
    return per_episode[segment_episodes, 0].unsqueeze(-1) * mask.to(torch.float32)  # [B, T]
