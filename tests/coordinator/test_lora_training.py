"""The quickstart with LoRA (actor.lora) and a KL loss, run as a user runs it (`rlfabric train`): it learns
the task, the reference log-probs come from the actor's base model (no reference service starts), every
step syncs the adapter alone into the rollout (weight_sync.lora auto: adapter with the hf engine), the checkpoint holds the adapters only and the final model
is the merged policy with the adapter beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

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
