"""The quickstart with LoRA (actor.lora) and a KL loss, run as a user runs it (`rlfabric train`): it learns
the task, the reference log-probs come from the actor's base model (no reference service starts), every
step syncs the adapter alone into the rollout (weight_sync.lora auto: adapter with the hf engine), the
checkpoint holds the adapters only and the final model is the merged policy with the adapter beside it.
The in-process mesh (`rlfabric train --in-process`) hands the rollout the adapter alone too."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlfabric.launch.inprocess import InProcessMesh
from tests.coordinator.meshes import fast_config

pytestmark = pytest.mark.slow

LORA_RUN = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.lr=1e-2", "actor.use_kl_loss=true",
            "trainer.progress_bar=false", "trainer.plot=false"]


def test_the_quickstart_learns_with_lora_and_the_reference_for_free(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rlfabric", "train", *LORA_RUN], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "actor.log", "coordinator.log", "reward.log", "rollout-0.log"]  # no reference service
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in records]
    assert scores[0] < 0.3 and sum(scores[-3:]) / 3 > 0.8, scores
    assert max(r["actor/kl_loss"] for r in records) > 0  # the policy moved away from the base model
    versions = [int(r["rollout/weight_version"]) for r in records]
    assert versions == list(range(versions[0], versions[0] + len(records)))  # a new adapter version every step
    syncs = [json.loads(line) for line in (run_dir / "logs" / "coordinator.log").read_text().splitlines()
             if '"weights synced"' in line]
    assert syncs and {s["bytes"] for s in syncs} == {69_632}  # rank 8 on all 14 linear layers, float32: the adapter
    checkpoint = run_dir / "checkpoints" / f"global_step_{len(records)}" / "actor"
    assert all(".lora_" in name for name in load_file(checkpoint / "model.safetensors"))
    final = run_dir / "final_model"
    assert (final / "adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)
    moved = [name for name, tensor in merged.state_dict().items() if not torch.equal(tensor, base.state_dict()[name])]
    assert any("q_proj" in name for name in moved)  # the merged adapters changed the attention weights
    assert Path(final / "adapter" / "adapter_model.safetensors").stat().st_size < (final / "model.safetensors").stat().st_size


def test_in_process_the_rollout_gets_the_adapter_alone(tiny_model, tmp_path):
    """weight_sync.lora auto with the hf engine is adapter: the in-process handoff gives the rollout engine
    the actor's adapters (its peft layers), never merged weights in its base layers."""
    config = fast_config(tiny_model, "actor.lora.rank=8", "actor.lora.alpha=16", "actor.lr=1e-2",
                         "trainer.export_final=false")
    assert config.syncs_lora_adapters()

    async def scenario():
        async with InProcessMesh(config, tmp_path / "run") as mesh:
            rollout = mesh.engine("rollout-0")
            base_before = {name: t.detach().clone() for name, t in rollout._base_weights().items()}
            await mesh.coordinator.start_run()
            metrics = {update.step: dict(update.metrics) async for update in mesh.coordinator.stream_metrics()}
            status = await mesh.coordinator.run_status()
            trained = await mesh.engine("actor").gather_adapter()
            return status, metrics, base_before, rollout._base_weights(), rollout._adapter_weights(), trained

    status, metrics, base_before, base_after, served, trained = asyncio.run(scenario())
    assert status.error == "" and sorted(metrics) == [1, 2]
    for name, tensor in base_after.items():  # the base model as loaded: nothing merged into it
        assert torch.equal(tensor, base_before[name]), name
    assert set(served) == set(trained)
    for name, tensor in served.items():
        torch.testing.assert_close(tensor.detach(), trained[name].to(tensor.dtype))
    assert any(".lora_B." in name and tensor.abs().max() > 0 for name, tensor in served.items())  # trained
    for step in (1, 2):  # the adapter's bytes, rank 8 on the tiny model's 14 linear layers, float32
        assert round(metrics[step]["weight_sync/gbytes"] * 1e9) == 69_632


@pytest.mark.parametrize(("setting", "message"), [
    ("actor.lora.target_modules=[no_such_layer]", r"actor.lora.target_modules \['no_such_layer'\] match no layer"),
    ("actor.lora.rank=100", r"actor.lora.rank 100 exceeds layer .* \(64 -> 64\)"),
    ("rollout.engine=sglang", r"weight_sync.lora: adapter needs a rollout engine that loads LoRA adapters"),
])
def test_bad_lora_settings_stop_rlfabric_train_at_start_naming_the_key(tiny_model, tmp_path, setting, message):
    overrides = [f"model.path={tiny_model}", "actor.lora.rank=8", setting]
    if "sglang" in setting:  # auto picks merged for SGLang; adapter is what SGLang cannot do
        overrides.append("weight_sync.lora=adapter")
    done = subprocess.run([sys.executable, "-m", "rlfabric", "train", *overrides, "trainer.progress_bar=false"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert re.search(message, done.stdout + done.stderr), done.stdout[-3000:] + done.stderr[-3000:]
    if "lora." in setting:  # the launcher's check on the model's skeleton: no service ever started
        assert not list(tmp_path.rglob("ports/*.json")), done.stdout[-3000:] + done.stderr[-3000:]
