"""The actor trains a mixture-of-experts model (the tiny Qwen3-MoE): FSDP2 over two ranks as one rank does,
with the router's load-balancing loss when actor.router_aux_loss_coef asks for it, and exports per-expert
Hugging Face checkpoints; a coefficient for a dense model is refused naming the key."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlfabric.core.config import ConfigError
from rlfabric.launch.inprocess import InProcessMesh
from rlfabric.trainer import models
from tests.coordinator.meshes import fast_config
from tests.numerics import FLOAT64, assert_same_float32, assert_same_metric, assert_same_update
from tests.trainer.helpers import Served, make_batch, make_config

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # numerics: make test-kernels

FUSED = "model.layers.0.mlp.experts.gate_up_proj"  # transformers 5's in-memory experts: [E, 2I, H]


def _train(served, batch, export_dir):
    old = served.run(served.client.compute_log_probs(batch))["log_probs"]
    advantages = torch.linspace(-1.0, 1.0, batch["responses"].numel()).reshape(batch["responses"].shape)
    metrics = [served.run(served.client.update_policy({**batch, "old_log_probs": old, "advantages": advantages},
                                                      global_step=step)) for step in range(2)]
    served.run(served.client.export_hf(export_dir))
    trained = served.run(served.service.engine.gather_weights())
    return old, metrics, trained


def test_two_ranks_train_the_moe_model_as_one_rank_and_export_per_expert_checkpoints(tiny_moe_model, tmp_path):
    # 16 rows = 2 mini-batches of 4 prompts x n=2, micro-batches of 2 rows: the same micro-batches on one rank
    # and two. (The router loss is one per forward, a product of means over its tokens as transformers computes
    # it: other micro-batches would give another loss, as gradient accumulation in transformers' Trainer does.)
    # In float64, so that the bounds hold on every CPU's kernels (tests/numerics.py).
    common = {"lr": 1e-3, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2, "router_aux_loss_coef": 0.01}
    batch = make_batch(rows=16, prompt_len=8, response_len=6, seed=5)
    with Served("actor", make_config(tiny_moe_model, n=2, actor=common, model=FLOAT64)) as one:
        old_1, metrics_1, weights_1 = _train(one, batch, tmp_path / "one")
    with Served("actor", make_config(tiny_moe_model, n=2, actor={**common, "world_size": 2}, model=FLOAT64)) as two:
        old_2, metrics_2, weights_2 = _train(two, batch, tmp_path / "two")
    assert_same_float32(old_2, old_1)
    for m1, m2 in zip(metrics_1, metrics_2, strict=True):
        for name in ("actor/pg_loss", "actor/router_aux_loss", "actor/grad_norm"):
            assert_same_metric(m2[name], m1[name], name)
    assert metrics_1[0]["actor/router_aux_loss"] > 1.0  # top-2 of 4 experts: 2 when perfectly balanced
    assert weights_1[FUSED].shape == (4, 128, 64)
    for name, value in weights_1.items():  # 2 updates x 2 mini-batches
        assert_same_update(weights_2[name], value, lr=common["lr"], steps=4, name=name)
    # The export holds one matrix per expert, as save_pretrained writes, and loads back into the trained weights.
    exported = load_file(tmp_path / "two" / "model.safetensors")
    assert FUSED not in exported and "model.layers.0.mlp.experts.3.up_proj.weight" in exported
    assert set(load_file(tiny_moe_model / "model.safetensors")) <= set(exported)  # the checkpoint's own names
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "two", dtype=torch.float64).state_dict()
    for name, value in weights_2.items():
        assert torch.equal(reloaded[name], value), name


def test_the_router_loss_is_transformers_aux_loss_over_real_tokens_and_its_gradient_trains(tiny_moe_model):
    """Zero advantages: the policy loss has no gradient, so the update is AdamW's first step on the router
    loss alone, as a plain transformers model takes it (both in float64: tests/numerics.py)."""
    batch = make_batch(rows=8, seed=3)  # left-padded prompts, right-padded responses
    mask = batch["attention_mask"]
    forward = dict(input_ids=batch["input_ids"], position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                   output_router_logits=True, use_cache=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float64, experts_implementation="eager")
    with torch.no_grad():
        with_padding = float(model(**forward).aux_loss)
    real_tokens_only = model(**forward, attention_mask=mask).aux_loss
    real_tokens_only.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0).step()
    config = make_config(tiny_moe_model, n=2, actor={"lr": 1e-4, "ppo_mini_batch_size": 4, "weight_decay": 0.0,
                                                      "ppo_micro_batch_size_per_gpu": 8, "router_aux_loss_coef": 1.0},
                         model=FLOAT64)
    with Served("actor", config) as served:
        before = {k: v.clone() for k, v in served.run(served.service.engine.gather_weights()).items()}
        old = served.run(served.client.compute_log_probs(batch))["log_probs"]
        metrics = served.run(served.client.update_policy({**batch, "old_log_probs": old,
                                                          "advantages": torch.zeros(8, 5)}))
        after = served.run(served.service.engine.gather_weights())
    assert abs(with_padding - float(real_tokens_only)) > 1e-3  # the padding would count
    assert_same_metric(metrics["actor/router_aux_loss"], float(real_tokens_only))  # one mini-batch of 4 prompts x 2
    assert metrics["actor/pg_loss"] == 0.0 and metrics["actor/grad_norm"] > 0
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(after[router], before[router])
    for name, value in model.state_dict().items():
        assert_same_update(after[name], value, lr=1e-4, steps=1, name=name)


def test_a_router_coefficient_for_a_dense_model_is_refused_naming_the_key(tiny_model, tmp_path):
    config = fast_config(tiny_model, "actor.router_aux_loss_coef=0.001")
    message = r"actor.router_aux_loss_coef 0.001: model.path .* is a dense model \(model_type qwen2\)"
    async def start_mesh():
        async with InProcessMesh(config, tmp_path / "run"):
            pass

    with pytest.raises(ConfigError, match=message):  # the launcher, before any service starts
        asyncio.run(start_mesh())
    with pytest.raises(ConfigError, match=message):  # the actor service itself, started on its own
        models.load_model("actor", config, torch.device("cpu"))
