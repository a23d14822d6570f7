"""What an agent gives back, and the ways an episode fails.

An agent returns one of:
    0.7                                        a reward
    "#### 7"                                   an answer, scored by the reward service (the row's data_source)
    {"reward": 1.0, "metrics": {"turns": 2}}   a dict: reward and/or answer, and numeric metrics
Anything else (None, a list, a dict with neither, a reward that is not a finite number) is garbage: the
episode fails (AgentFailed "garbage").
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

RAISED, TIMEOUT, GARBAGE, EXITED = "raised", "timeout", "garbage", "exited"
AGENT_FAILED_STATUS = "agent_failed"  # the reward ItemResult status of an episode whose agent failed


class AgentFailed(Exception):
    """An episode that gave no usable outcome: its agent raised, ran past agent.timeout_s, returned garbage, or
    (subprocess, command) exited with an error."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass
class AgentOutcome:
    """One episode's result: a reward, or an answer for the reward service to score (or both: the reward wins)."""

    reward: float | None = None
    answer: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def parse_outcome(value: Any) -> AgentOutcome:
    """The outcome an agent returned; AgentFailed("garbage") for anything but a reward, an answer or such a dict."""
    if isinstance(value, str):
        return AgentOutcome(answer=value)
    if _a_number(value):
        return AgentOutcome(reward=_reward(value))
    if not isinstance(value, dict):
        raise AgentFailed(GARBAGE, f"the agent returned {_shown(value)}: return a reward (a number), an answer "
                                   "(a string) or a dict with reward and/or answer")
    reward, answer, metrics = value.get("reward"), value.get("answer"), value.get("metrics") or {}
    if reward is None and answer is None:
        raise AgentFailed(GARBAGE, f"the agent returned a dict with neither reward nor answer: {_shown(value)}")
    if reward is not None and not _a_number(reward):
        raise AgentFailed(GARBAGE, f"the agent's reward is {_shown(reward)}, not a number")
    if answer is not None and not isinstance(answer, str):
        raise AgentFailed(GARBAGE, f"the agent's answer is {_shown(answer)}, not a string")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and _a_number(v) for k, v in metrics.items()):
        raise AgentFailed(GARBAGE, f"the agent's metrics are {_shown(metrics)}, not names to numbers")
    return AgentOutcome(None if reward is None else _reward(reward), answer,
                        {name: float(number) for name, number in metrics.items()})


def _a_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _reward(value: numbers.Real) -> float:
    if not math.isfinite(value):
        raise AgentFailed(GARBAGE, f"the agent's reward is {value}, not a finite number")
    return float(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
