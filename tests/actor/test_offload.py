"""The hybrid engine's actor side (trainer.colocated on a GPU): between phases the model, its gradients and its
optimizer state wait in host memory, so a rollout engine on the same GPU can use it; the update is the same."""

from __future__ import annotations

import pytest
import torch

from tests.actor.helpers import Served, make_batch, make_config

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_colocated_actor_frees_the_gpu_between_phases_and_trains_the_same(tiny_model):
    batch = make_batch(rows=8)
    results = {}
    for colocated in (False, True):
        config = make_config(tiny_model, n=2, actor={"lr": 1e-2, "ppo_mini_batch_size": 4},
                             trainer={"colocated": colocated})
        with Served("actor", config) as served:
            torch.cuda.synchronize()
            idle = torch.cuda.memory_allocated()
            old = served.run(served.client.compute_log_probs(batch))["log_probs"]
            served.run(served.client.update_policy({**batch, "old_log_probs": old, "advantages": torch.ones(8, 5)},
                                                   global_step=1))
            torch.cuda.synchronize()
            after_update = torch.cuda.memory_allocated()
            results[colocated] = (served.run(served.client.compute_log_probs(batch))["log_probs"], idle, after_update)
    (separate, _, kept), (colocated, idle, freed) = results[False], results[True]
    assert torch.allclose(separate, colocated, atol=1e-5)
    assert idle < 1 << 20 and freed < 1 << 20  # weights, gradients and Adam's moments left the GPU
    assert kept > 3 * 4 * 80_000  # separate: the float32 weights and both Adam moments stay on it
