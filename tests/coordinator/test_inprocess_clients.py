"""The in-process clients answer as the gRPC ones do: the same results for the same request, the same
domain error for a bad one (the servicers' request checks are shared, not skipped), and the in-process
weight handoff leaves the rollout serving the actor's weights."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from rlfabric.actor.client import ActorClient, LocalActorClient
from rlfabric.core.errors import InvalidArgument
from rlfabric.core.server import ServerOptions
from rlfabric.critic.client import CriticClient, LocalCriticClient
from rlfabric.launch.inprocess import InProcessMesh
from rlfabric.reward.client import LocalRewardClient, RewardClient
from rlfabric.reward.items import ScoreItem
from rlfabric.rollout.client import LocalRolloutClient, RolloutClient
from rlfabric.rollout.types import SamplingSpec
from rlfabric.serve import build_service
from tests.conftest import ServerThread
from tests.coordinator.meshes import fast_config
from tests.trainer.helpers import make_batch

GRPC_CLIENTS = {"actor": ActorClient, "critic": CriticClient, "rollout": RolloutClient, "reward": RewardClient}
LOCAL_CLIENTS = {"actor": LocalActorClient, "critic": LocalCriticClient, "rollout": LocalRolloutClient,
                 "reward": LocalRewardClient}



@contextlib.asynccontextmanager
async def client_of(role: str, kind: str, config):
    """A client of `role` over a fresh engine: in process, or through its service on loopback."""
    service = build_service(role, config)
    if kind == "grpc":
        server = ServerThread(service, ServerOptions(port=0, metrics_port=None))
        try:
            async with GRPC_CLIENTS[role](server.address) as client:
                yield client
        finally:
            server.stop()
        return
    await service.engine.start()
    try:
        yield LOCAL_CLIENTS[role](service.engine)
    finally:
        await service.engine.stop()


def both(role: str, config, call):
    """call(client) with an in-process and a gRPC client of `role`: {kind: result or the error raised}."""

    async def one(kind):
        async with client_of(role, kind, config) as client:
            try:
                return await call(client)
            except Exception as error:
                return error

    return {kind: asyncio.run(one(kind)) for kind in ("in-process", "grpc")}


def test_log_probs_are_the_same_in_process_and_over_grpc(tiny_model):
    batch = make_batch(rows=4)
    out = both("actor", fast_config(tiny_model), lambda actor: actor.compute_log_probs(batch, temperature=0.0))
    # temperature 0 is the proto's default: 1.0 on both paths
    torch.testing.assert_close(out["in-process"]["log_probs"], out["grpc"]["log_probs"])


@pytest.mark.parametrize("fault, message", [
    (lambda batch: batch.pop("advantages"), "batch is missing tensor(s) ['advantages']"),
    (lambda batch: batch.update(rewards=batch["advantages"]), "batch has unexpected tensor(s) ['rewards']"),
    (lambda batch: batch.update(advantages=batch["advantages"][:1]), "batch entries disagree on the row count"),
], ids=["missing", "unexpected", "row-count"])
def test_a_bad_update_batch_is_the_same_invalid_argument(tiny_model, fault, message):
    batch = make_batch(rows=8)
    batch["advantages"] = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    fault(batch)
    out = both("actor", fast_config(tiny_model, "rollout.n=1"), lambda actor: actor.update_policy(batch))
    for kind, error in out.items():
        assert isinstance(error, InvalidArgument), (kind, error)
        assert message in str(error), (kind, error)


def test_a_bad_value_batch_is_the_same_invalid_argument(tiny_model):
    batch = make_batch(rows=4)  # no values, no returns
    out = both("critic", fast_config(tiny_model, "algorithm.adv_estimator=gae"), lambda critic: critic.update_values(batch))
    for kind, error in out.items():
        assert isinstance(error, InvalidArgument) and "missing tensor(s) ['values', 'returns']" in str(error), kind


def test_rollout_requests_are_checked_as_the_service_sees_them(tiny_model):
    config = fast_config(tiny_model)
    # top_p 0 is the proto's "unset" (1.0): accepted on both paths; n 0 is refused on both.
    unset_top_p = SamplingSpec(n=2, max_tokens=3, top_p=0.0, seed=1, temperature=0.0)
    out = both("rollout", config, lambda rollout: rollout.generate([[5, 6, 7]], unset_top_p))
    assert [s.token_ids.tolist() for s in out["in-process"]] == [s.token_ids.tolist() for s in out["grpc"]]
    assert [(s.prompt_index, s.sample_index) for s in out["in-process"]] == [(0, 0), (0, 1)]
    out = both("rollout", config, lambda rollout: rollout.generate([[5, 6, 7]], SamplingSpec(n=0, max_tokens=3)))
    for kind, error in out.items():
        assert isinstance(error, InvalidArgument) and "sampling_params.n must be >= 1" in str(error), kind


def test_reward_items_are_checked_as_the_wire_checks_them(tiny_model):
    """A ground truth that is not a string cannot go on the wire: the in-process client refuses it too."""
    items = [ScoreItem("synthetic", "a", "a"), ScoreItem("synthetic", "a", 1)]
    out = both("reward", fast_config(tiny_model), lambda reward: reward.score(items))
    for kind, error in out.items():
        assert isinstance(error, InvalidArgument) and "item 1: ground_truth must be a string" in str(error), kind


def test_weight_handoff_gives_the_rollout_the_actors_trained_weights(tiny_model, tmp_path):
    config = fast_config(tiny_model, "trainer.total_steps=1", "trainer.export_final=false")

    async def scenario():
        async with InProcessMesh(config, tmp_path / "run") as mesh:
            rollout = mesh.engine("rollout-0")
            before = {name: p.detach().clone() for name, p in rollout.net.named_parameters()}
            await mesh.coordinator.start_run()
            [_ async for _ in mesh.coordinator.stream_metrics()]
            status = await mesh.coordinator.run_status()
            trained = await mesh.engine("actor").gather_weights()
            served = dict(rollout.net.named_parameters())
            return status, before, trained, served, rollout.weight_version

    status, before, trained, served, version = asyncio.run(scenario())
    assert status.error == "" and version == status.weight_version
    changed = [name for name in served if not torch.equal(served[name], before[name])]
    assert changed, "the rollout still serves its starting weights"
    for name, tensor in served.items():
        torch.testing.assert_close(tensor.detach(), trained[name].to(tensor.dtype))
