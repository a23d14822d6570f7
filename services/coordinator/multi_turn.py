"""What the coordinator does differently with rollout.multi_turn on: how samples are asked for (chat
messages and the row's environment task, MultiTurnSpec in the sampling parameters), where their score
comes from (the environment's rewards, the reward service, or both), and the agent/* step metrics.

A sample whose environment failed (agent_status env_failed) scores as failed: like a sample the reward
service could not score, it is left out of training (algorithm.score_failure: mask) or scored 0, and
counts towards algorithm.max_failed_fraction (sample_failures.py). The run waits for the environment to
be ready before it starts (Peers.wait_until_ready).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from rlfabric.core.config import RunConfig
from rlfabric.data.dataset import PromptRow
from rlfabric.reward.items import ItemResult
from rlfabric.rollout.agent_loop import ENV_FAILED
from rlfabric.rollout.types import AgentPrompt, AgentTask, FinishedSample, MultiTurnSpec

ENV_FAILED_STATUS = "env_failed"  # the ItemResult status of a sample whose environment failed


def multi_turn_spec(config: RunConfig, max_tokens: int) -> MultiTurnSpec | None:
    """rollout.multi_turn as the sampling parameters carry it (None when off); max_tokens is the
    response budget when max_total_tokens is 0. The replicas resolve an empty env_address themselves."""
    multi_turn = config.rollout.multi_turn
    if not multi_turn.enable:
        return None
    address, _ = env_address_of(config)
    return MultiTurnSpec(env_address=address, max_turns=multi_turn.max_turns,
                         max_total_tokens=multi_turn.max_total_tokens or max_tokens,
                         tool_call_format=multi_turn.tool_call_format, env_timeout_s=multi_turn.env_timeout_s)


def env_address_of(config: RunConfig) -> tuple[str, str]:
    """(address, the key that names it) of the environment service a multi-turn run's replicas call:
    rollout.multi_turn.env_address, else the first of cluster.env; ("", "") when the config names none."""
    if config.rollout.multi_turn.env_address:
        return config.rollout.multi_turn.env_address, "rollout.multi_turn.env_address"
    if config.cluster.env:
        return config.cluster.env[0], "cluster.env"
    return "", ""


def agent_prompt(row: PromptRow) -> AgentPrompt:
    """A row as a multi-turn prompt: its messages, and its task (extra_info.environment names the environment)."""
    extra_info = json.loads(row.extra_info_json or "{}")
    environment = extra_info.get("environment", "") if isinstance(extra_info, dict) else ""
    return AgentPrompt(row.messages, AgentTask(str(environment), row.ground_truth, extra_info))


def env_result(sample: FinishedSample) -> ItemResult:
    """The score the environment gave a sample (the sum of its step rewards), failed when the environment failed."""
    if sample.agent_status == ENV_FAILED:
        return ItemResult(0.0, ENV_FAILED_STATUS, sample.agent_error[:300])
    return ItemResult(sample.env_reward)


def combined_result(sample: FinishedSample, scored: ItemResult | None, source: str) -> ItemResult:
    """The sample's score for rollout.multi_turn.reward: env, reward (the reward service's `scored`) or both."""
    from_env = env_result(sample)
    if source == "env" or not from_env.ok:
        return from_env
    if source == "reward" or not scored.ok:
        return scored
    return ItemResult(from_env.score + scored.score, metrics=scored.metrics)


def agent_metrics(samples: Sequence[FinishedSample]) -> dict[str, float]:
    """agent/* of one step's multi-turn samples (none for single-turn ones): turns and tool calls per
    sample, tool calls the environment refused, environment latency and failures, how trajectories ended."""
    agents = [s for s in samples if s.agent_status]
    if not agents:
        return {}
    turns = [t for s in agents for t in s.turns]
    steps = [t.env_seconds for t in turns if t.step_status]
    calls = sum(len(t.tool_calls) for t in turns)
    bad_calls = sum(len(t.tool_calls) for t in turns if t.step_status not in ("", "ok"))
    metrics = {
        "agent/turns/mean": len(turns) / len(agents),
        "agent/tool_calls/mean": calls / len(agents),
        "agent/tool_calls/failed_fraction": bad_calls / calls if calls else 0.0,
        "agent/env_failed/count": float(sum(s.agent_status == ENV_FAILED for s in agents)),
        "agent/env_seconds/mean": sum(steps) / len(steps) if steps else 0.0,
        "agent/env_seconds/max": max(steps, default=0.0),
        "agent/env_reward/mean": sum(s.env_reward for s in agents) / len(agents),
        "agent/model_token_fraction": (sum(int(np.sum(s.loss_mask, dtype=np.int64)) for s in agents)
                                       / max(1, sum(len(s.token_ids) for s in agents))),
    }
    for status in sorted({s.agent_status for s in agents}):
        metrics[f"agent/status/{status}/fraction"] = sum(s.agent_status == status for s in agents) / len(agents)
    return metrics
