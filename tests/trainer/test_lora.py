"""LoRA in the actor (actor.lora): only the adapters train, the base model is the reference, checkpoints
hold the adapters, ExportHF writes the merged model and the adapter, and bad settings fail at start."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlfabric.core.config import config_from_dict
from rlfabric.core.errors import FailedPrecondition, InvalidArgument
from rlfabric.trainer.engine import TrainerEngine
from tests.numerics import FLOAT64, assert_same_float32
from tests.trainer.helpers import Served, hf_log_probs, make_batch, make_config

pytestmark = pytest.mark.numerics  # make test-kernels runs it under every CPU kernel family

LORA = {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}
ACTOR = {"lr": 1e-2, "ppo_mini_batch_size": 4, "lora": LORA}


def update(served, batch, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    old = served.run(served.client.compute_log_probs(batch))["log_probs"]
    advantages = torch.randn(batch["responses"].shape, generator=g)
    return served.run(served.client.update_policy({**batch, "old_log_probs": old, "advantages": advantages}))


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """An actor with LoRA after two updates, its checkpoint and export, and the log-probs along the way; in
    float64, as everything it is compared with (tests/numerics.py)."""
    out = tmp_path_factory.mktemp("lora")
    batch = make_batch(rows=8)
    with Served("actor", make_config(tiny_model, actor=ACTOR, model=FLOAT64)) as served:
        before = served.run(served.client.compute_log_probs(batch))["log_probs"]
        base_before = served.run(served.client.compute_log_probs(batch, base_model=True))["log_probs"]
        metrics = [update(served, batch, seed) for seed in (0, 1)]
        after = served.run(served.client.compute_log_probs(batch))["log_probs"]
        base_after = served.run(served.client.compute_log_probs(batch, base_model=True))["log_probs"]
        served.run(served.client.save_checkpoint(str(out / "checkpoint")))
        served.run(served.client.export_hf(str(out / "export")))
        synced = served.service.engine.policy_weights()
    return {"dir": out, "batch": batch, "before": before, "base_before": base_before, "after": after,
            "base_after": base_after, "metrics": metrics, "synced": synced}


def test_only_the_adapters_train(trained):
    assert torch.equal(trained["before"], trained["base_before"])  # B starts at 0: no change yet
    assert not torch.allclose(trained["after"], trained["before"], atol=1e-3)  # the policy moved
    assert torch.equal(trained["base_after"], trained["base_before"])  # the base model did not
    assert all(m["actor/grad_norm"] > 0 for m in trained["metrics"])


def test_the_base_model_gives_the_reference_services_log_probs(tiny_model, trained):
    """The reference for free: the actor's base_model log-probs equal a reference service's on the model."""
    with Served("reference", make_config(tiny_model, model=FLOAT64)) as reference:
        expected = reference.run(reference.client.compute_log_probs(trained["batch"]))["log_probs"]
    assert_same_float32(trained["base_after"], expected)


def test_the_checkpoint_holds_the_adapters_and_resumes(tiny_model, trained):
    checkpoint = trained["dir"] / "checkpoint"
    weights = load_file(checkpoint / "model.safetensors")
    assert weights and all(".lora_A." in name or ".lora_B." in name for name in weights)
    assert json.loads((checkpoint / "meta.json").read_text())["lora"] == {
        "rank": 4, "alpha": 8.0, "target_modules": "all-linear"}
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(weights)  # AdamW moments for the adapters only
    with Served("actor", make_config(tiny_model, actor=ACTOR, model=FLOAT64)) as resumed:
        assert resumed.run(resumed.client.load_checkpoint(str(checkpoint))) == 2
        again = resumed.run(resumed.client.compute_log_probs(trained["batch"]))["log_probs"]
    assert torch.equal(again, trained["after"])  # the same weights, computed the same way
    # A full-weight actor refuses the adapter checkpoint, naming what each holds.
    with Served("actor", make_config(tiny_model, actor={"ppo_mini_batch_size": 4})) as full:
        with pytest.raises(InvalidArgument, match="holds LoRA .* but this actor trains full weights"):
            full.run(full.client.load_checkpoint(str(checkpoint)))
        with pytest.raises(FailedPrecondition, match="need LoRA adapters"):
            full.run(full.client.compute_log_probs(trained["batch"], base_model=True))


def test_export_is_the_merged_policy_and_the_adapter_in_peft_format(tiny_model, trained):
    """AutoModelForCausalLM on the export and PeftModel on base + adapter/ both give the actor's log-probs;
    the merged weights are what a weight sync sends, under the base model's names."""
    from peft import PeftModel

    export = trained["dir"] / "export"
    merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float64)
    assert_same_float32(hf_log_probs(merged, trained["batch"]), trained["after"], "merged export")
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    adapted = PeftModel.from_pretrained(base, export / "adapter")
    assert_same_float32(hf_log_probs(adapted, trained["batch"]), trained["after"], "base + adapter")
    # peft's own merge of the adapter equals ours (what the sync sends) weight for weight.
    peft_merged = adapted.merge_and_unload().state_dict()
    synced = trained["synced"]
    assert set(synced) == set(peft_merged)  # the base model's own names, lm_head included
    for name, tensor in synced.items():
        assert_same_float32(tensor, peft_merged[name], name)


@pytest.mark.parametrize(("lora", "message"), [
    ({"rank": 4, "target_modules": ["no_such_layer"]}, r"actor.lora.target_modules \['no_such_layer'\] match no "
                                                       r"layer of the model; its linear layers: .*q_proj"),
    ({"rank": 65, "target_modules": ["q_proj"]}, r"actor.lora.rank 65 exceeds layer .*q_proj \(64 -> 64\)"),
])
def test_bad_settings_fail_at_start_naming_the_key(tiny_model, lora, message):
    engine = TrainerEngine("actor", make_config(tiny_model, actor={"lora": lora, "ppo_mini_batch_size": 4}))
    with pytest.raises(ValueError, match=message):
        asyncio.run(engine.start())
    asyncio.run(engine.stop())


def test_no_reference_service_runs_with_lora():
    kl = {"actor": {"use_kl_loss": True}}
    assert "reference" in config_from_dict(kl).roles_in_use()
    with_lora = config_from_dict({"actor": {"use_kl_loss": True, "lora": {"rank": 8}}})
    assert "reference" not in with_lora.roles_in_use() and with_lora.needs_reference_log_probs()
