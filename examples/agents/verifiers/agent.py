"""One rlfabric episode as one verifiers 0.4 episode (agent.runner command, run by the verifiers venv's python:
see docs/verifiers.md).

    agent:
      runner: command
      command: [/path/to/verifiers-venv/bin/python, examples/agents/verifiers/agent.py]

The task comes as JSON on stdin (rlfabric.agents.runners): its extra_info names the verifiers task set and the
task's index in it (data.builtin_task verifiers writes them); the answer is not in it. The task set's own Task
is loaded here, so verifiers scores the episode with its own reward hooks. verifiers runs its harness program
through its interception server, which relays each model call to OPENAI_BASE_URL with OPENAI_API_KEY (the
episode's gateway key, so every call is recorded for training). The reward printed is verifiers' own: the sum
of `trace.reward` over the episode's traces (each the weighted sum of its rewards).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import verifiers.v1 as vf
from verifiers.v1.utils.loaders import load_taskset


def task_of(taskset_id: str, index: int) -> vf.Task:
    """Task `index` of the task set (its position in load(), the row's extra_info.index)."""
    for task in load_taskset(vf.TasksetConfig(id=taskset_id)).include(idx=[f"{index}:{index + 1}"]):
        return task
    raise IndexError(f"task set {taskset_id!r} has no task {index}")


async def run_episode(taskset_id: str, index: int, base_url: str, model: str) -> vf.Episode:
    config = vf.SingleAgentEnvConfig(
        taskset=vf.TasksetConfig(id=taskset_id), agent=vf.AgentConfig(runtime=vf.SubprocessConfig())
    )
    env = vf.SingleAgentEnv(config)
    context = vf.ModelContext(
        model=model, client=vf.EvalClientConfig(base_url=base_url, api_key_var="OPENAI_API_KEY")
    )
    async with env.serving():
        return await env.run_episode(task_of(taskset_id, index), context)


def main() -> None:
    task = json.load(sys.stdin)
    info = task["extra_info"]
    episode = asyncio.run(
        run_episode(
            info["taskset"], int(info["index"]), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_MODEL"]
        )
    )
    if not episode.ok:  # an episode verifiers could not finish: rlfabric masks and counts it
        errors = [error.message for error in episode.errors] + [
            error.message for trace in episode.traces for error in trace.errors
        ]
        sys.exit(f"verifiers episode failed: {errors}")
    reward = sum(trace.reward for trace in episode.traces)
    print(json.dumps({"reward": reward, "metrics": {"verifiers/traces": len(episode.traces)}}))


if __name__ == "__main__":
    main()
