"""A real pretrained model through the services: SmolLM2-135M-Instruct (Llama architecture, tied
embeddings, 49,152-token vocabulary, ChatML template with a default system prompt), float32 on CPU.

One actor, one hf rollout and one vLLM rollout for the module, each a real gRPC server on loopback.
The vLLM replica is started from the actor's ExportHF output, so the export is proven to load in
vLLM; later tests move the actor's weights and sync them to both replicas over gloo.

Order matters: the tests before the update check the initial weights.
"""

from __future__ import annotations

import tempfile

import grpc
import pytest
import torch

from rlfabric.actor.client import ActorClient
from rlfabric.coordinator.weight_sync import WeightSyncPlane
from rlfabric.core.config import load_config
from rlfabric.core.host import load_tokenizer
from rlfabric.data.dataset import RLHFDataset
from rlfabric.data.prep import write_arithmetic
from rlfabric.reward import arithmetic
from rlfabric.rollout.servicer import build_service as build_rollout
from rlfabric.serve import build_service as build_trainer
from tests.numerics import engine_logprob_gap
from tests.rollout.conftest import require_vllm
from tests.rollout.helpers import environment_restored, generate, sampled_log_probs
from tests.rollout.test_actor_agreement import actor_batch
from tests.weight_sync.helpers import Loop, serve

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2 + 3? Answer with just the number.", "What is 7 + 6? Answer with just the number.",
             "Name a primary colour.", "What is the capital of France?"]
# Float32 engines of the same weights, SmolLM2's sampled |log p| < 32: tests/numerics.py derives 2^-11. Measured
# here: the largest |rollout - actor| log-prob over ~170 sampled tokens 5.0e-5 (hf) and 6.7e-5 (vLLM), mean 1.7e-5
# for both; after an update and a gloo sync 3.4e-5 and 5.7e-5.
LOGPROB_BOUND = engine_logprob_gap(32.0)


def config(model_path, *overrides: str):
    return load_config(None, [f"model.path={model_path}", "actor.lr=1e-4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                              "actor.ppo_micro_batch_size_per_gpu=8", "actor.log_prob_micro_batch_size_per_gpu=16",
                              "rollout.max_num_seqs=16", "rollout.kv_cache_space_gb=1", "weight_sync.timeout_s=60",
                              "weight_sync.transport=gloo", f"storage.root={tempfile.gettempdir()}", *overrides])


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return load_tokenizer(str(smollm2))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


class RealModelMesh:
    """The actor on SmolLM2, its first export, an hf replica on the original directory and a vLLM
    replica on the export."""

    def __init__(self, model_path, workdir):
        require_vllm()
        self.loop = Loop()
        self.actor = serve(build_trainer("actor", config(model_path)))
        self.client = self.loop.run(self._client())
        self.export0 = workdir / "export-initial"
        self.loop.run(self.client.export_hf(str(self.export0)), timeout=300)
        self.hf_service = build_rollout(config(model_path))
        self.rollouts = {"hf": serve(self.hf_service),
                         "vllm": serve(build_rollout(config(self.export0, "rollout.engine=vllm")))}

    async def _client(self) -> ActorClient:
        return ActorClient(self.actor.address)

    def channel(self, engine: str) -> grpc.Channel:
        return grpc.insecure_channel(self.rollouts[engine].address)

    def stop(self) -> None:
        self.loop.run(self.client.close())
        for server in (*self.rollouts.values(), self.actor):
            server.stop()
        self.loop.stop()


@pytest.fixture(scope="module")
def mesh(smollm2, tmp_path_factory):
    with environment_restored():  # vLLM's CPU platform sets LD_PRELOAD here
        mesh = RealModelMesh(smollm2, tmp_path_factory.mktemp("smollm2"))
        try:
            yield mesh
        finally:
            mesh.stop()


def sample(mesh: RealModelMesh, engine: str, prompts, **params):
    with mesh.channel(engine) as channel:
        return generate(channel, prompts, timeout=300, **params)


def logprob_gaps(mesh: RealModelMesh, engine: str, prompts, seed: int) -> torch.Tensor:
    """|rollout sampled log-prob - actor log-prob| of every sampled token (temperature 1)."""
    samples = sample(mesh, engine, prompts, n=2, max_tokens=24, temperature=1.0, seed=seed)
    batch = actor_batch(samples, prompts)
    actor_log_probs = mesh.loop.run(mesh.client.compute_log_probs(batch, temperature=1.0), timeout=300)["log_probs"]
    rollout_log_probs = sampled_log_probs(samples, batch)
    mask = batch["response_mask"].bool()
    assert mask.sum() > 20
    return (actor_log_probs[mask] - rollout_log_probs[mask]).abs()


def greedy_texts(mesh: RealModelMesh, engine: str, prompts) -> list[str]:
    samples = sorted(sample(mesh, engine, prompts, max_tokens=24, temperature=0.0), key=lambda s: s.prompt_index)
    return [s.text for s in samples]


def transformers_greedy(model_dir, tokenizer, prompts) -> list[str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    texts = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            texts.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    return texts


# -- prompts and responses ------------------------------------------------------------------------


def test_the_coordinator_builds_the_chat_template_prompt(tokenizer, tmp_path):
    paths = write_arithmetic(tmp_path, train_size=16, val_size=1)
    data = RLHFDataset([paths["train"]], tokenizer, max_prompt_length=96)
    assert len(data) == 16
    for row in data.rows:
        assert row.prompt_ids == tokenizer.apply_chat_template(row.messages, add_generation_prompt=True,
                                                               tokenize=True, return_dict=False)
        # SmolLM2's template: its default system prompt, the user's turn, then the assistant's header.
        text = tokenizer.decode(row.prompt_ids)
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
        assert text.endswith(f"<|im_start|>user\n{row.messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n")
        assert row.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_generation_ends_at_the_end_of_turn_and_the_text_is_what_the_reward_reads(mesh, tokenizer, prompts, engine):
    samples = sample(mesh, engine, prompts, n=2, max_tokens=48, temperature=0.0)
    assert len(samples) == 2 * len(prompts)
    stopped = [s for s in samples if s.finish_reason.name.lower() == "stop"]
    assert len(stopped) >= len(prompts)  # greedy replies to these questions are short
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == end_of_turn
    for s in stopped:
        assert s.token_ids[-1] == end_of_turn and end_of_turn not in s.token_ids[:-1]
    for s in samples:
        assert s.text == tokenizer.decode(s.token_ids, skip_special_tokens=True)
        assert "<|im_end|>" not in s.text and "<|im_start|>" not in s.text
    # What the reward scores: the first question's greedy reply states 5 plainly.
    first = next(s for s in samples if s.prompt_index == 0)
    assert arithmetic.compute_score(first.text, "5") == 1.0, first.text


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_sampled_log_probs_agree_with_the_actor(mesh, prompts, engine):
    gaps = logprob_gaps(mesh, engine, prompts, seed=1)
    print(f"{engine}: |rollout - actor| log-prob max {gaps.max():.2e} mean {gaps.mean():.2e} over {gaps.numel()} tokens")
    assert gaps.max() <= LOGPROB_BOUND


def test_the_export_loads_in_transformers_and_vllm_with_the_same_greedy_text(mesh, smollm2, tokenizer, prompts):
    # The vLLM replica serves the actor's export; transformers loads the export and the original.
    from_export = transformers_greedy(mesh.export0, tokenizer, prompts)
    assert from_export == transformers_greedy(smollm2, tokenizer, prompts)
    assert greedy_texts(mesh, "vllm", prompts) == from_export
    assert greedy_texts(mesh, "hf", prompts) == from_export
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (mesh.export0 / name).read_bytes() == (smollm2 / name).read_bytes()


# -- an update, a weight sync, and the trained policy exported ---------------------------------------


def test_after_an_update_and_a_weight_sync_both_engines_serve_the_new_policy(mesh, tokenizer, prompts, tmp_path):
    # A PPO update on the replies the policy sampled, every one rewarded: the weights move.
    samples = sample(mesh, "hf", prompts, n=2, max_tokens=16, temperature=1.0, seed=7)
    batch = actor_batch(samples, prompts)
    old = mesh.loop.run(mesh.client.compute_log_probs(batch, temperature=1.0), timeout=300)["log_probs"]
    advantages = torch.ones_like(old) * batch["response_mask"]
    mesh.loop.run(mesh.client.update_policy({**batch, "old_log_probs": old, "advantages": advantages}), timeout=600)
    for engine in ("hf", "vllm"):
        assert logprob_gaps(mesh, engine, prompts, seed=2).max() > 10 * LOGPROB_BOUND  # stale before the sync

    plane = WeightSyncPlane(mesh.client, {name: s.address for name, s in mesh.rollouts.items()},
                            config(mesh.export0))
    try:
        report = mesh.loop.run(plane.sync(1), timeout=300)
        assert report.ok, report.failed
    finally:
        mesh.loop.run(plane.close())
    for engine in ("hf", "vllm"):
        gaps = logprob_gaps(mesh, engine, prompts, seed=3)
        print(f"{engine} after sync: max {gaps.max():.2e} mean {gaps.mean():.2e}")
        assert gaps.max() <= LOGPROB_BOUND
    # The tied head is the synced embedding, not a stale copy of the old one.
    model = mesh.hf_service.engine.net
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # The trained policy, exported: transformers generates what both synced replicas generate.
    trained = tmp_path / "trained"
    mesh.loop.run(mesh.client.export_hf(str(trained)), timeout=300)
    from_export = transformers_greedy(trained, tokenizer, prompts)
    from safetensors.torch import load_file

    before, after = load_file(mesh.export0 / "model.safetensors"), load_file(trained / "model.safetensors")
    assert set(before) == set(after) and "lm_head.weight" not in after  # tied: saved once, as save_pretrained does
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert greedy_texts(mesh, "hf", prompts) == from_export
    assert greedy_texts(mesh, "vllm", prompts) == from_export
