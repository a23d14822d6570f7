"""A reward model inside the training loop, on CPU: a live local mesh whose reward service routes
HH-style dialogue prompts (Anthropic/hh-rlhf, written by `rlfabric data hh-rlhf`) to a small
sequence-classification reward model and the quickstart's find-the-vowel prompts to their rule.

The reward model is a hand-set one-layer LlamaForSequenceClassification that prefers a recognisable
property: a response that ends in a capital vowel scores 1, anything else 0. The dialogues end with
"any letter of: K B E D C H", which the warm-started tiny policy answers with any one of the shown
letters alike (a vowel about 1 time in 6): GRPO has to learn from the reward model alone that vowels pay.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import load_config
from rlfabric.data.prep import HH_RLHF_DATA_SOURCE, write_hh_rlhf, write_synthetic
from rlfabric.launch.local import LocalMesh
from rlfabric.quickstart.tiny_model import build_tokenizer
from rlfabric.reward import find_vowel
from rlfabric.reward.model_reward import ModelRewardConfig, RewardModelScorer
from rlfabric.v1 import coordinator_pb2

pytestmark = pytest.mark.slow

# The reward model's own chat template: every turn as "role: content", the response last, so the
# position the model reads its score from (the last token) is the response's last character.
RM_CHAT_TEMPLATE = ("{% for message in messages %}{% if not loop.first %}\n{% endif %}"
                    "{{ message['role'] }}: {{ message['content'] }}{% endfor %}")
VOWELS = "AEIOU"


def build_vowel_reward_model(out: Path) -> ModelRewardConfig:
    """The reward model (see the module docstring): its one decoder layer adds nothing to the residual
    stream, so the last position holds its token's embedding, which has a 1 in dimension 0 for a vowel."""
    tokenizer = build_tokenizer()  # the tiny policy's character-level vocabulary
    tokenizer.chat_template = RM_CHAT_TEMPLATE
    tokenizer.save_pretrained(out / "tokenizer")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight  # (V, 64)
        embed.zero_()
        embed[:, 1] = 1.0
        for vowel in VOWELS:
            embed[tokenizer.convert_tokens_to_ids(vowel), 0] = 1.0
        # The final RMSNorm scales a vowel's [1, 1, 0, ...] by sqrt(64 / 2): undo that in the head.
        model.score.weight.zero_()
        model.score.weight[0, 0] = (2 / 64) ** 0.5
    model.save_pretrained(out / "model")
    return ModelRewardConfig(model_path=str(out / "model"), tokenizer_path=str(out / "tokenizer"))


def write_dialogues(out: Path, count: int, seed: int) -> Path:
    """HH-RLHF-format jsonl (chosen/rejected transcripts) whose last Human turn asks for any letter
    of a find-the-vowel letter set, converted with `rlfabric data hh-rlhf`'s writer."""
    rng = random.Random(seed)
    openers = [("hello", "hi, how can I help?"), ("are you there?", "yes."), ("good morning", "morning!")]
    lines = []
    for _ in range(count):
        letters = find_vowel.make_example(rng)[0].removeprefix(find_vowel.INSTRUCTION)
        human, assistant = rng.choice(openers)
        dialogue = f"\n\nHuman: {human}\n\nAssistant: {assistant}\n\nHuman: {find_vowel.WARM_START_INSTRUCTION}{letters}"
        vowel = next(letter for letter in letters.split() if letter in VOWELS)
        consonant = next(letter for letter in letters.split() if letter not in VOWELS)
        lines.append(json.dumps({"chosen": f"{dialogue}\n\nAssistant: {vowel}",
                                 "rejected": f"{dialogue}\n\nAssistant: {consonant}"}))
    source = out / "hh.jsonl"
    source.write_text("\n".join(lines) + "\n")
    return write_hh_rlhf(source, out / "hh.parquet")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The storage root: the mesh's run dir and the data (services read only under it)."""
    return tmp_path_factory.mktemp("rm-loop")


@pytest.fixture(scope="module")
def data(base):
    out = base / "data"
    return {"model": build_vowel_reward_model(out), "dialogues": write_dialogues(out, 256, seed=5),
            "rules": write_synthetic(out / "rules", train_size=256, val_size=8, seed=6)["train"]}


@pytest.fixture(scope="module")
def mesh(data, base):
    """The quickstart mesh (tiny warm-started policy, GRPO) with a reward service that sends
    Anthropic/hh-rlhf items to the reward model and every other item to its rule."""
    model = data["model"]
    config = load_config(None, [
        "trainer.progress_bar=false", "trainer.plot=false", "data.max_prompt_length=128",
        f"reward.model_path={model.model_path}", f"reward.model_tokenizer_path={model.tokenizer_path}",
        f"reward.model_sources=[{HH_RLHF_DATA_SOURCE}]", "reward.model_batch_size=64",
    ])
    with LocalMesh(config, base / "mesh") as mesh:
        yield mesh


async def run_to_end(mesh, overrides: list[str],
                     timeout_s: float = 300) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
    options = dataclasses.replace(ChannelOptions.from_config(mesh.config), timeout_s=300)
    async with CoordinatorClient(mesh.endpoints["coordinator"][0]["grpc"], options) as client:
        await client.start_run(overrides)
        async with asyncio.timeout(timeout_s):
            request = coordinator_pb2.CoordinatorServiceStreamMetricsRequest()
            async for _ in client.stream("StreamMetrics", request, timeout_s):
                pass
        return await client.run_status()


def rollouts_of(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def test_a_mixed_batch_scores_each_prompt_by_its_own_scorer(mesh, data, experiment_dir):
    """Rule prompts and dialogue prompts in one batch, one Score request per step: each sample's score
    is what its own scorer gives it (the reward model reading the whole dialogue, or the rule)."""
    status = asyncio.run(run_to_end(mesh, [
        f"trainer.experiment_name={experiment_dir.name}", "trainer.total_steps=2",
        f"data.train_files=[{data['rules']},{data['dialogues']}]"]))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    dialogues = {f"hh:{index}": row["prompt"] for index, row in enumerate(pq.read_table(data["dialogues"]).to_pylist())}
    reward_model = RewardModelScorer(data["model"])
    for step in (1, 2):
        samples = rollouts_of(experiment_dir, step)
        by_source = {sample["data_source"] for sample in samples}
        assert by_source == {find_vowel.DATA_SOURCE, HH_RLHF_DATA_SOURCE}, by_source  # both kinds in one batch
        rules = [s for s in samples if s["data_source"] == find_vowel.DATA_SOURCE]
        assert [s["score"] for s in rules] == [find_vowel.compute_score(s["response"], s["ground_truth"]) for s in rules]
        talks = [s for s in samples if s["data_source"] == HH_RLHF_DATA_SOURCE]
        expected = reward_model.score([dialogues[s["uid"]] for s in talks], [s["response"] for s in talks])
        assert [s["score"] for s in talks] == pytest.approx(expected, abs=1e-5)
        assert {round(s["score"]) for s in talks} <= {0, 1}


def test_grpo_on_dialogue_prompts_raises_the_reward_model_score(mesh, data, experiment_dir):
    steps = 6  # the score passes 0.95 by step 3 or 4 (from ~0.2)
    status = asyncio.run(run_to_end(mesh, [
        f"trainer.experiment_name={experiment_dir.name}", f"trainer.total_steps={steps}",
        f"data.train_files=[{data['dialogues']}]"]))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    records = [json.loads(line) for line in (experiment_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [record["critic/score/mean"] for record in records]
    assert len(scores) == steps
    assert scores[0] < 0.4, scores  # a copied letter: a vowel about 1 time in 6
    assert sum(scores[-3:]) / 3 > 0.7, scores
