"""The judge role (rlfabric.rollout.judge, `rlfabric serve judge`): a rollout service over judge.model_path, not
model.path, with the judge section's engine settings and no multi-turn or LoRA of the policy's; it generates, and
refuses every weight sync (FAILED_PRECONDITION), so the policy's weights never reach the judge."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rlfabric.core.config import load_config
from rlfabric.core.server import ServerOptions
from rlfabric.rollout.client import RolloutClient
from rlfabric.rollout.judge import judge_config
from rlfabric.rollout.types import SamplingSpec
from rlfabric.serve import build_service
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
from tests.conftest import ServerThread


def test_the_judge_config_is_the_judge_sections():
    config = load_config(
        None,
        [
            "model.path=/models/policy",
            "judge.model_path=/models/judge",
            "judge.dtype=float32",
            "judge.max_num_seqs=7",
            "judge.replicas=3",
            "actor.lora.rank=8",
            "rollout.multi_turn.enable=true",
            "rollout.engine=sim",
        ],
    )
    served = judge_config(config)
    assert (
        served.model.path == "/models/judge" and config.model.path == "/models/policy"
    )  # the run's is untouched
    rollout = served.rollout
    assert (rollout.engine, rollout.dtype, rollout.max_num_seqs, rollout.replicas) == ("hf", "float32", 7, 3)
    assert not rollout.multi_turn.enable and not served.actor.lora.enabled


@pytest.fixture(scope="module")
def judge(tiny_model):
    config = load_config(None, ["model.path=/models/policy", f"judge.model_path={tiny_model}"])
    server = ServerThread(build_service("judge", config), ServerOptions(port=0, metrics_port=None))
    yield server
    server.stop()


def test_a_judge_replica_serves_the_judge_model_and_generates(judge, tiny_model):
    async def talk():
        async with RolloutClient(judge.address) as replica:
            samples = await replica.generate(
                [[{"role": "user", "content": "hi"}]], SamplingSpec(max_tokens=3, seed=0)
            )
            return samples, await replica.status()

    samples, status = asyncio.run(talk())
    assert len(samples) == 1 and 1 <= len(samples[0].token_ids) <= 3
    assert (status.engine, status.model, status.weight_version) == ("hf", str(tiny_model), 0)


def test_a_judge_replica_refuses_every_weight_sync(judge):
    with grpc.insecure_channel(judge.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        calls = {
            "JoinWeightSyncGroup": lambda: stub.JoinWeightSyncGroup(
                rollout_pb2.RolloutServiceJoinWeightSyncGroupRequest(), timeout=10
            ),
            "ReceiveWeights": lambda: stub.ReceiveWeights(
                rollout_pb2.RolloutServiceReceiveWeightsRequest(), timeout=10
            ),
            "PushWeights": lambda: stub.PushWeights(
                iter([rollout_pb2.RolloutServicePushWeightsRequest()]), timeout=10
            ),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
            assert "never takes the policy's weights" in refused.value.details(), name
