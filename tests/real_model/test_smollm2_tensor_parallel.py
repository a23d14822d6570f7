"""SmolLM2-135M-Instruct in a tensor-parallel vLLM replica. Its 9 attention heads (3 KV heads) do not split over
2 ranks, so TP=2 is refused before vLLM starts (tests/rollout/test_tensor_parallel.py); TP=3 splits them 3 ways,
run here as three vLLM CPU workers sharing this host's two cores (slow, but the numerics are what is tested).
The replica's sampled log-probs are the actor's within the bound of the TP=1 engine (tests/real_model/
test_smollm2.py), before and after an update synced over gloo (TP rank 0 receives, its two peers get its copy).
Order matters: the first test checks the initial weights."""

from __future__ import annotations

import pytest
import torch

from rlfabric.actor.client import ActorClient
from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.client import wait_until_serving
from rlfabric.core.host import load_tokenizer
from rlfabric.core.server import ServerOptions
from rlfabric.rollout.servicer import build_service as build_rollout
from rlfabric.serve import build_service as build_trainer
from tests.conftest import ServerThread
from tests.rollout.conftest import require_vllm
from tests.rollout.helpers import environment_restored, generate, sampled_log_probs
from tests.rollout.test_actor_agreement import actor_batch
from tests.weight_sync.helpers import Loop, serve

from .test_smollm2 import LOGPROB_BOUND, QUESTIONS, config

pytestmark = pytest.mark.slow
TP = 3


class TensorParallelMesh:
    def __init__(self, model_path):
        require_vllm()
        self.loop = Loop()
        self.actor = serve(build_trainer("actor", config(model_path)))
        self.client = self.loop.run(self._client())
        # three vLLM processes on two cores take longer to start than ServerThread waits
        self.rollout = ServerThread(build_rollout(config(model_path, "rollout.engine=vllm",
                                                         f"rollout.tensor_parallel_size={TP}")),
                                    ServerOptions(port=0, metrics_port=None), wait_ready=False)
        self.loop.run(wait_until_serving(self.rollout.address, timeout_s=1800), timeout=1810)
        tokenizer = load_tokenizer(str(model_path))
        self.prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=False) for q in QUESTIONS]

    async def _client(self) -> ActorClient:
        return ActorClient(self.actor.address)

    def sample(self, seed: int, max_tokens: int = 24):
        import grpc

        with grpc.insecure_channel(self.rollout.address) as channel:
            return generate(channel, self.prompts, n=2, max_tokens=max_tokens, temperature=1.0, seed=seed, timeout=600)

    def gaps(self, seed: int) -> torch.Tensor:
        """|rollout sampled log-prob - actor log-prob| of every sampled token (temperature 1)."""
        samples = self.sample(seed)
        batch = actor_batch(samples, self.prompts)
        actor = self.loop.run(self.client.compute_log_probs(batch, temperature=1.0), timeout=300)["log_probs"]
        rollout = sampled_log_probs(samples, batch)
        mask = batch["response_mask"].bool()
        assert mask.sum() > 20
        return (actor[mask] - rollout[mask]).abs()

    def stop(self) -> None:
        self.loop.run(self.client.close())
        self.rollout.stop()
        self.actor.stop()
        self.loop.stop()


@pytest.fixture(scope="module")
def mesh(smollm2):
    with environment_restored():  # vLLM's CPU platform sets LD_PRELOAD here
        mesh = TensorParallelMesh(smollm2)
        try:
            yield mesh
        finally:
            mesh.stop()


def test_tp3_log_probs_are_the_actors_within_the_tp1_bound(mesh):
    gaps = mesh.gaps(seed=1)
    print(f"TP={TP}: |rollout - actor| log-prob max {gaps.max():.2e} mean {gaps.mean():.2e} over {gaps.numel()} tokens")
    assert gaps.max() <= LOGPROB_BOUND


def test_after_an_update_a_gloo_sync_reaches_all_three_tp_ranks(mesh, smollm2):
    samples = mesh.sample(seed=7, max_tokens=16)
    batch = actor_batch(samples, mesh.prompts)
    old = mesh.loop.run(mesh.client.compute_log_probs(batch, temperature=1.0), timeout=300)["log_probs"]
    advantages = torch.ones_like(old) * batch["response_mask"]
    mesh.loop.run(mesh.client.update_policy({**batch, "old_log_probs": old, "advantages": advantages}), timeout=600)
    assert mesh.gaps(seed=2).max() > 10 * LOGPROB_BOUND  # stale before the sync

    plane = WeightSyncPlane(mesh.client, {"rollout-0": mesh.rollout.address}, config(smollm2))
    try:
        report = mesh.loop.run(plane.sync(1), timeout=600)
        assert report.ok, report.failed
        assert plane.group.world_size == 2  # one rank per replica
    finally:
        mesh.loop.run(plane.close())
    gaps = mesh.gaps(seed=3)
    print(f"TP={TP} after a sync of {report.num_bytes} bytes in {report.seconds:.1f} s: max {gaps.max():.2e} "
          f"mean {gaps.mean():.2e}")
    assert gaps.max() <= LOGPROB_BOUND
