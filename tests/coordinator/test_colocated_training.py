"""The hybrid engine, run as a user runs it (`rlfabric train`): the actor and the rollout in one resource pool,
trainer.colocated. The quickstart learns as with separate devices; every step the rollout sleeps at level 2
after generating (its weights' memory is freed), and wakes its weights, takes the sync and wakes its KV cache
in that order (a sync into freed weights would fail on their empty shapes), then generates with the new
version."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

COLOCATED_RUN = ["trainer.colocated=true", "resource_pools={shared: {}}", "actor.pool=shared", "rollout.pool=shared",
                 "trainer.progress_bar=false", "trainer.plot=false"]


# vLLM's sleep mode needs CUDA: on a GPU the actor and vLLM share it (weights over gloo, NCCL cannot join two
# ranks on one GPU; weight_sync.transport auto picks it for a shared pool).
VLLM_ON_A_GPU = ["rollout.engine=vllm", "rollout.enable_sleep_mode=true", "rollout.gpu_memory_utilization=0.3",
                 "resource_pools={shared: {gpus: 1}}"]
ENGINES = [pytest.param([], id="hf"),
           pytest.param(VLLM_ON_A_GPU, id="vllm", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="vLLM's sleep mode needs a GPU")])]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_quickstart_learns_colocated_and_the_rollout_frees_its_weights_while_the_actor_trains(tmp_path, engine):
    done = subprocess.run([sys.executable, "-m", "rlfabric", "train", *COLOCATED_RUN, *engine], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in records]
    assert scores[0] < 0.3 and sum(scores[-3:]) / 3 > 0.8, scores
    versions = [int(r["rollout/weight_version"]) for r in records]
    assert versions == list(range(versions[0], versions[0] + len(records)))
    for record in records:
        assert record["memory/rollout/rss_mb/asleep"] > 0
        assert record["memory/actor/rss_mb/after_update"] > 0  # the actor's side, from its update
        # On a GPU the colocated actor leaves nothing allocated after its update: weights, gradients, optimizer
        # state and cuBLAS's workspaces (64 MiB before they were freed) are gone (tests/trainer/test_offload.py).
        assert record.get("memory/actor/device_mb/after_update", 0.0) < 1.0
        if engine:
            continue  # vLLM's memory lives in its engine process: the service cannot account for it
        generated, asleep = record["memory/rollout/device_mb/generated"], record["memory/rollout/device_mb/asleep"]
        assert asleep < generated / 100  # level 2: the weights' memory is gone while the actor trains
        assert record["memory/rollout/device_mb/synced"] == generated  # and back, filled by the sync
    for step in (1, len(records)):  # each step generated with the weights synced after the step before
        rollouts = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert {s["weight_version"] for s in rollouts} == {versions[step - 1] - 1}
