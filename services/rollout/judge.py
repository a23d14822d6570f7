"""build_service for the judge role (the generative judge's pool, reward.judge), which rlfabric.serve calls: a
RolloutService serving judge.model_path with the judge section's engine, which the reward service calls for
verdicts. It only generates: it is no policy replica (not cluster.rollout), so weight syncs are refused
(FAILED_PRECONDITION) rather than swapping the policy's weights into the judge.

    rlfabric serve judge --config run.yaml judge.model_path=/models/judge
"""

from __future__ import annotations

from rlfabric.core.config import MultiTurnConfig, RunConfig
from rlfabric.core.errors import FailedPrecondition
from rlfabric.core.server import ServiceDefinition
from rlfabric.rollout import servicer as rollout

_NO_WEIGHTS = (
    "a judge replica serves judge.model_path and never takes the policy's weights: it is not in "
    "cluster.rollout"
)


def judge_config(config: RunConfig) -> RunConfig:
    """The config a judge replica serves: the run's, with judge.model_path as model.path and the judge section's
    engine settings as rollout.*; no multi-turn and no LoRA adapters (those are the policy's), and it never
    registers with the coordinator as a policy replica (rollout.register_with, rollout.discovery)."""
    judge = config.judge
    served = config.model_copy(deep=True)
    served.model.path = judge.model_path
    served.actor.lora.rank = 0
    served.actor.router_replay = False
    served.rollout = served.rollout.model_copy(
        update={
            "engine": judge.engine,
            "replicas": judge.replicas,
            "pool": judge.pool,
            "tensor_parallel_size": judge.tensor_parallel_size,
            "dtype": judge.dtype,
            "max_num_seqs": judge.max_num_seqs,
            "multi_turn": MultiTurnConfig(),
            "register_with": "",
            "discovery": "",
        }
    )
    return served


class JudgeServicer(rollout.RolloutServicer):
    """The rollout servicer, refusing every weight sync."""

    async def JoinWeightSyncGroup(self, request, context):
        raise FailedPrecondition(_NO_WEIGHTS)

    async def ReceiveWeights(self, request, context):
        raise FailedPrecondition(_NO_WEIGHTS)

    async def PushWeights(self, request_iterator, context):
        raise FailedPrecondition(_NO_WEIGHTS)


def build_service(config: RunConfig, replica: int = 0) -> ServiceDefinition:
    """The judge role: JudgeServicer over the judge model's rollout engine (replica number `replica`)."""
    return rollout.build_service(
        judge_config(config), replica=replica, servicer_class=JudgeServicer, role="judge"
    )
