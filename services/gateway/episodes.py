"""Episodes: who may call (a key per episode), what each has recorded, and its limits.

    episode = store.open(seed=7)              # its key is the agent's API key
    store.get(key)                            # 401 unknown key, 410 closed or timed out
    record = store.close(key)                 # its calls and their segments; later calls get 410

A closed episode's key is remembered (agent.gateway.closed_episodes_remembered, oldest forgotten first) so
its calls are told 410, which the SDKs do not retry, rather than 401.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlfabric.core.config.agent import GatewayConfig
from rlfabric.core.errors import NotFound, ResourceExhausted
from rlfabric.gateway.openai_api import OpenAIError
from rlfabric.gateway.segments import RecordedCall, Segment, join_calls

OPEN, CLOSED, TIMED_OUT = "open", "closed", "timed_out"
KEY_PREFIX = "rlf-ep-"


@dataclass(eq=False)
class Episode:
    """One agent episode: its key, its calls, and what it has used of its limits."""

    key: str
    deadline: float  # time.monotonic() past which it times out
    seed: int | None = None
    """Seeds its calls (call i: row_seed(seed, i, 0)); None = the agent's seed, else random."""
    info: dict[str, Any] = field(default_factory=dict)
    """Whatever its opener attaches (the row, the sample index)."""
    temperature: float | None = None
    """Samples its calls at this temperature instead of the run's (validation's rollout.val_temperature)."""
    status: str = OPEN
    calls: list[RecordedCall] = field(default_factory=list)
    started_calls: int = 0  # recorded and in flight: what max_calls_per_episode bounds
    sampled_tokens: int = 0
    by_request: dict[str, asyncio.Future] = field(default_factory=dict)
    """Request hash -> its call: a retried request is answered from here."""
    conversations: dict[tuple, int] = field(default_factory=dict)
    """(tools, messages + reply) of each chat call -> its number, for calls that extend it."""

    def is_open(self) -> bool:
        return self.status == OPEN


@dataclass
class EpisodeRecord:
    """What a closed episode leaves: its calls and the segments they join into."""

    key: str
    status: str  # closed or timed_out
    calls: list[RecordedCall]
    segments: list[Segment]
    info: dict[str, Any]


class EpisodeStore:
    def __init__(self, settings: GatewayConfig, on_close: Callable[[str], None] = lambda key: None,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.on_close = on_close
        self.clock = clock
        self._open: dict[str, Episode] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()  # key -> how it ended

    def __len__(self) -> int:
        return len(self._open)

    def open(self, seed: int | None = None, info: dict[str, Any] | None = None,
             temperature: float | None = None) -> Episode:
        """A new episode with a fresh key; ResourceExhausted past agent.gateway.max_concurrent_episodes."""
        if len(self._open) >= self.settings.max_concurrent_episodes:
            raise ResourceExhausted(f"{len(self._open)} agent episodes are open, the most "
                                    "agent.gateway.max_concurrent_episodes allows: close one first")
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        episode = Episode(key, self.clock() + self.settings.episode_timeout_s, seed, dict(info or {}),
                          temperature)
        self._open[key] = episode
        return episode

    def get(self, key: str) -> Episode:
        """The open episode of `key`; 401 for a key never given, 410 for a closed or timed-out episode."""
        episode = self._open.get(key)
        if episode is not None and episode.is_open() and self.clock() > episode.deadline:
            self.time_out(episode)
        if episode is not None and episode.is_open():
            return episode
        ended = episode.status if episode is not None else self._closed.get(key)
        if ended == TIMED_OUT:
            raise OpenAIError(410, f"this episode timed out after agent.gateway.episode_timeout_s "
                                   f"({self.settings.episode_timeout_s:g} s)", "episode_timed_out")
        if ended is not None:
            raise OpenAIError(410, "this episode is closed: its calls are recorded no more", "episode_closed")
        raise OpenAIError(401, "unknown API key: each episode has its own (given when it opens)",
                          "invalid_api_key")

    def time_out(self, episode: Episode) -> None:
        """Marks an episode timed out: its calls get 410 from now on; close() still collects its record."""
        episode.status = TIMED_OUT

    def seconds_left(self, episode: Episode) -> float:
        return episode.deadline - self.clock()

    def close(self, key: str) -> EpisodeRecord:
        """Ends an episode (its calls in flight are not recorded; later ones get 410) and returns its record."""
        episode = self._open.pop(key, None)
        if episode is None:
            raise NotFound(f"no open agent episode has key {key[:16]}...")
        status = episode.status if episode.status == TIMED_OUT else CLOSED
        episode.status = status
        self._closed[key] = status
        while len(self._closed) > self.settings.closed_episodes_remembered:
            self._closed.popitem(last=False)
        self.on_close(key)
        return EpisodeRecord(key, status, list(episode.calls), join_calls(episode.calls), episode.info)
