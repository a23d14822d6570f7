"""The hybrid engine's actor side (trainer.colocated on a GPU): between phases the model, its gradients and its
optimizer state wait in host memory, and what torch still holds on the GPU (its cache, cuBLAS's workspaces)
goes back to the driver, so a rollout engine on the same GPU can use it; the update is the same."""

from __future__ import annotations

import gc

import pytest
import torch

from rlfabric.trainer import worker
from rlfabric.trainer.worker import move_optimizer_state, release_device_memory
from tests.trainer.helpers import Served, make_batch, make_config


@pytest.mark.gpu
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
        del served  # the stopped engine of the separate run holds its model on the GPU until it is collected
        gc.collect()
    (separate, _, kept), (colocated, idle, freed) = results[False], results[True]
    assert torch.allclose(separate, colocated, atol=1e-5)
    # Weights, gradients, Adam's moments and step counts, and cuBLAS's workspaces (32 MiB on Hopper for each
    # thread that ran a matmul: the update's and autograd's; 64 MiB were left before) all left the GPU. What
    # may stay is allocator rounding of a stray scalar (blocks are 512 bytes), far below one workspace.
    assert idle < 64 << 10 and freed < 64 << 10, f"{idle} bytes allocated idle, {freed} after the update"
    assert kept > 3 * 4 * 80_000  # separate: the float32 weights and both Adam moments stay on it


@pytest.mark.parametrize("fused", [False, True])
def test_offload_moves_every_optimizer_tensor_and_keeps_a_cpu_step_count_on_the_cpu(fused):
    # "meta" stands in for the GPU here: what matters is which tensors move.
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    move_optimizer_state(optimizer, "meta")
    for state in optimizer.state.values():
        assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
        # fused: the step count lives on the parameters' device and moves with them; else it stays a CPU tensor
        assert state["step"].is_meta == fused


def test_releasing_the_gpu_synchronizes_then_frees_cublas_workspaces_and_the_cache(monkeypatch):
    # A fake of torch's CUDA calls (this host has none): the order is what is checked; the GPU test above
    # checks the effect.
    calls = []
    monkeypatch.setattr(worker.torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(worker.torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear workspaces"),
                        raising=False)
    monkeypatch.setattr(worker.torch.cuda, "empty_cache", lambda: calls.append("empty cache"))
    gpu = torch.device("cuda", 0)
    release_device_memory(gpu)
    assert calls == [("synchronize", gpu), "clear workspaces", "empty cache"]
    calls.clear()
    release_device_memory(torch.device("cpu"))
    assert calls == []
