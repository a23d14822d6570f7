"""Why a step's samples failed, and when too many failed to train on the step.

A sample fails when it gets no score: the reward function failed on it (ItemResult status error,
timeout or crashed), with rollout.multi_turn its environment did (status env_failed: its Reset or
Step answered an error status, or none in time), or with agent.entrypoint its agent did (status
agent_failed: it raised, ran past agent.timeout_s, returned garbage, or its process exited with an error;
an agent episode is one sample however many segments it recorded). It is left out of training, or trained on with score
0 (algorithm.score_failure). Each gets a SampleFailure: where it failed, the status, and the message
cut to 300 characters (rlfabric.reward.items.short_message). A step counts them by reason in the log
("env UNAVAILABLE: 32"), records each in RUN_DIR/rollouts/step_N.jsonl (trainer.dump_rollouts), and
fails the run when more than algorithm.max_failed_fraction of its samples failed: training on what is
left would teach the policy from a few survivors while the run reports success (an environment nobody
listens at fails every sample).

Generation failing is not a sample's failure: a request whose engine fails is retried on another
replica (trainer.rollout_retries) and then fails the step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from rlfabric.agents.outcome import AGENT_FAILED_STATUS
from rlfabric.coordinator.multi_turn import ENV_FAILED_STATUS
from rlfabric.core.errors import FailedPrecondition
from rlfabric.reward.items import ItemResult, short_message


@dataclass(frozen=True)
class SampleFailure:
    """Why one sample has no score."""

    source: str
    """"env" (the environment failed), "agent" (the agent's episode failed) or "reward" (the reward function
    failed)."""
    status: str
    """env: the gRPC status code name of the failed call (UNAVAILABLE, DEADLINE_EXCEEDED, ...);
    agent: raised, timeout, garbage or exited; reward: the item's status (error, timeout or crashed)."""
    message: str
    """What went wrong, cut to 300 characters."""

    @property
    def reason(self) -> str:
        """What failures are counted by: "env UNAVAILABLE", "reward timeout"."""
        return f"{self.source} {self.status}"

    def record(self) -> dict[str, str]:
        return {"source": self.source, "status": self.status, "message": self.message}


class TooManyFailedSamples(FailedPrecondition):
    """More than algorithm.max_failed_fraction of a step's samples failed: the run fails before training on it."""


def failure_of(result: ItemResult) -> SampleFailure | None:
    """The failure of a sample scored `result`; None when it was scored."""
    if result.ok:
        return None
    message = short_message(result.message)
    if result.status == ENV_FAILED_STATUS:  # "Reset: UNAVAILABLE: env at ...": the call, its code, the words
        parts = message.split(": ", 2)
        code = parts[1] if len(parts) > 2 and parts[1] in grpc.StatusCode.__members__ else "UNKNOWN"
        return SampleFailure("env", code, message)
    if result.status == AGENT_FAILED_STATUS:  # "timeout: the agent ran past ..."
        return SampleFailure("agent", message.split(": ", 1)[0], message)
    return SampleFailure("reward", result.status, message)


def summary(failures: Sequence[SampleFailure | None]) -> str:
    """The failures counted by reason, most first: "env UNAVAILABLE: 30, reward timeout: 2"."""
    counts = Counter(failure.reason for failure in failures if failure is not None)
    return ", ".join(f"{reason}: {count}" for reason, count in counts.most_common())


def describe(step: int, failures: Sequence[SampleFailure | None]) -> str | None:
    """One line saying how many of the step's samples failed and why, with the first failure's message; None
    when none failed."""
    failed = [failure for failure in failures if failure is not None]
    if not failed:
        return None
    return (f"step {step}: {len(failed)} of {len(failures)} samples failed ({summary(failed)}); "
            f"the first: {failed[0].message}")


def check_failed_fraction(step: int, failures: Sequence[SampleFailure | None], max_fraction: float) -> None:
    """TooManyFailedSamples when more than max_fraction of the step's samples failed."""
    failed = sum(failure is not None for failure in failures)
    if failures and failed / len(failures) > max_fraction:
        raise TooManyFailedSamples(f"{describe(step, failures)}. More than algorithm.max_failed_fraction="
                                   f"{max_fraction:g} of the step's samples failed, so the run stops before "
                                   "training on it")
