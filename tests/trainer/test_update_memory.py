"""What the actor's update holds in memory: the policy loss keeps the model's logits for backward and no
float32 copy of them (on a GPU they are bf16: a float32 copy would double the largest tensor of the step);
gradient checkpointing's auto setting; the fused optimizer; the peak reported by UpdatePolicy."""

from __future__ import annotations

import torch

from rlfabric.trainer import models
from rlfabric.trainer.batch import validate_batch
from rlfabric.trainer.objectives import MiniBatchCounts, PolicyObjective
from tests.trainer.helpers import Served, make_batch, make_config


def test_the_policy_loss_keeps_no_float32_copy_of_the_logits(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)  # logits in bf16, as on a GPU
    vocab = models.vocab_size(model)
    config = make_config(tiny_model, actor={"entropy_coeff": 0.01})  # the entropy sends a gradient too
    raw = make_batch(rows=4, prompt_len=6, response_len=5)
    batch = validate_batch({**raw, "advantages": torch.randn(4, 5)}, vocab, required_floats=("advantages",))
    objective = PolicyObjective(config.actor, temperature=0.7, keep_logits=models.accepts_logits_to_keep(model))
    saved: list[torch.Tensor] = []
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        # vocabulary-wide activations: the logits, their copies and blocks (not the head's weight)
        if tensor.shape[-1:] == (vocab,) and tensor.untyped_storage().data_ptr() not in weights:
            saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, stats = objective.loss(model, batch, MiniBatchCounts(tokens=20.0, sequences=4.0, response_len=5))
    logits_bytes = 4 * (5 + 1) * vocab * 2  # [B, T + 1, vocab] bf16: what the model returns
    assert {t.dtype for t in saved} == {torch.bfloat16}
    assert sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in saved}.values()) <= logits_bytes
    loss.backward()
    assert model.lm_head.weight.grad is not None and torch.isfinite(model.lm_head.weight.grad).all()
    assert stats["entropy"] > 0


def test_gradient_checkpointing_auto_is_on_for_a_gpu_only(tiny_model):
    for setting, cpu, gpu in (("auto", False, True), (True, True, True), (False, False, False)):
        config = make_config(tiny_model, model={"gradient_checkpointing": setting})
        assert models.uses_gradient_checkpointing(config, torch.device("cpu")) is cpu
        assert models.uses_gradient_checkpointing(config, torch.device("cuda", 0)) is gpu


def test_update_reports_its_peak_and_steps_a_fused_optimizer(tiny_model):
    config = make_config(tiny_model, n=2, actor={"ppo_mini_batch_size": 4})
    batch = make_batch(rows=8)
    with Served("actor", config) as served:
        metrics = served.run(served.client.update_policy({**batch, "advantages": torch.ones(8, 5)}))
        optimizer = served.service.engine.worker.optimizer
    assert optimizer.defaults["fused"] and optimizer.state  # one kernel per step, no parameter-sized temporaries
    before, after = metrics["memory/actor/rss_mb/before_update"], metrics["memory/actor/rss_mb/after_update"]
    peak = metrics["memory/actor/rss_mb/peak_update"]  # VmHWM, reset when the update starts
    assert peak >= 0.99 * max(before, after) and peak > 0


def test_single_gpu_autocast_keeps_no_cast_cache():
    """The cache would hold a bf16 copy of every weight through the forward pass."""
    context = models.autocast(torch.device("cuda", 0), torch.bfloat16, sharded=False)
    assert isinstance(context, torch.autocast) and context.fast_dtype == torch.bfloat16
    assert context._cache_enabled is False  # torch.autocast keeps its cache_enabled argument here
    assert not isinstance(models.autocast(torch.device("cpu"), torch.bfloat16, sharded=False), torch.autocast)
