"""GRPO on reasoning-gym's chain_sum raises the reward the library's scorer gives, end to end: rows from
data.builtin_task reasoning_gym, rollouts, the reward service scoring reasoning_gym/chain_sum by regenerating each
entry, and the actor's updates, on the in-process mesh with the tiny model.

The issue asks for SmolLM2; here a SmolLM2 run on 2 CPU cores costs minutes a step (docs/reasoning-gym.md), so
the tiny model stands in. It plays a pretrained model that knows the sums but answers in the format the scorer
reads (<answer>...</answer>, reasoning_gym.utils.extract_answer) one time in TAGGED_SHARE: a warm start on the
training questions' answers, TAGGED_SHARE of the targets in tags and the rest bare. Bare answers score 0, so the
first steps score about TAGGED_SHARE; RL has to find out that the tags pay.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from importlib import metadata
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

pytest.importorskip("reasoning_gym")  # the extra rlfabric[reasoning-gym]; in the dev install

import reasoning_gym  # noqa: E402

from rlfabric.core.config import load_config  # noqa: E402
from rlfabric.core.config.loading import default_config_path  # noqa: E402
from rlfabric.core.model_cache import built_once  # noqa: E402
from rlfabric.data.reasoning_gym import write_reasoning_gym  # noqa: E402
from rlfabric.quickstart.tiny_model import make_tiny_model  # noqa: E402
from rlfabric.quickstart.warm_start import QUICKSTART_INIT_RANGE, fine_tune  # noqa: E402
from rlfabric.v1 import coordinator_pb2  # noqa: E402
from tests.coordinator.meshes import in_process, run_to_end  # noqa: E402

pytestmark = pytest.mark.slow

SERVICES = Path(__file__).resolve().parents[2] / "services"
WEIGHT_SOURCES = ("quickstart/tiny_model.py", "quickstart/warm_start.py", "data/reasoning_gym.py")
TAGGED_SHARE = 0.25  # of the warm start's targets: the rest are the bare answer
ROWS = 32
STEPS = 10
CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
DATA = {
    "builtin_task": "reasoning_gym",
    "reasoning_gym": {
        "datasets": {"chain_sum": {"config": CHAIN_SUM}},
        "seed": 0,
        "size": ROWS,
        "val_size": 0,
        "system_prompt": "",
    },  # the tiny model reads characters: a short prompt
    "train_batch_size": ROWS,
    "max_prompt_length": 96,
    "max_response_length": 24,
}


def answers_of(rows: list[dict]) -> list[str]:
    out = []
    for row in rows:
        truth = json.loads(row["reward_model"]["ground_truth"])
        dataset = reasoning_gym.create_dataset(
            truth["dataset"], seed=truth["seed"], size=truth["size"], **truth["config"]
        )
        out.append(dataset[truth["index"]]["answer"])
    return out


def warm_start(model_dir: Path, rows: list[dict], steps: int = 300, seed: int = 0) -> None:
    """Every training question with its answer, once in tags and (1 - TAGGED_SHARE) / TAGGED_SHARE times bare: the
    loss is the cross-entropy to that mixture, so the model learns the share without sampling noise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    bare_copies = round((1 - TAGGED_SHARE) / TAGGED_SHARE)
    examples = []
    for row, answer in zip(rows, answers_of(rows), strict=True):
        prompt = list(
            tokenizer.apply_chat_template(
                [dict(m) for m in row["prompt"]], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for target in [f"<answer>{answer}</answer>"] + [answer] * bare_copies:
            examples.append(
                (prompt, tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id])
            )
    rng = random.Random(seed)
    per_batch = 16 * (1 + bare_copies)

    def next_batch():
        picked = rng.sample(range(len(rows)), 16)
        batch = [examples[i * (1 + bare_copies) + k] for i in picked for k in range(1 + bare_copies)]
        assert len(batch) == per_batch
        width = max(len(p) + len(a) for p, a in batch)
        ids, labels, mask = [], [], []
        for prompt, answer in batch:
            pad = width - len(prompt) - len(answer)
            ids.append([tokenizer.pad_token_id] * pad + prompt + answer)
            labels.append([-100] * (pad + len(prompt)) + answer)
            mask.append([0] * pad + [1] * (len(prompt) + len(answer)))
        attention = torch.tensor(mask)  # [B, S]
        return {
            "input_ids": torch.tensor(ids),
            "labels": torch.tensor(labels),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        }

    fine_tune(model, next_batch, steps, lr=3e-3, seed=seed)
    model.save_pretrained(model_dir)


def build_model(directory: Path) -> None:
    make_tiny_model(directory, initializer_range=QUICKSTART_INIT_RANGE, seed=0)
    rows_path = write_reasoning_gym(directory / "rows", load_config({"data": DATA}).data.reasoning_gym)[
        "train"
    ]
    warm_start(directory, pq.read_table(rows_path).to_pylist())
    shutil.rmtree(directory / "rows")


@pytest.fixture(scope="module")
def knows_the_sums() -> Path:
    """The warm-started model (about a minute of CPU), built once per machine in the model cache: its name carries
    a digest of what decides its weights (this file, the tiny model, the warm start's loop, the rows' writer, and
    the libraries' versions)."""
    digest = hashlib.sha256()
    for path in (Path(__file__), *(SERVICES / name for name in WEIGHT_SOURCES)):
        digest.update(path.read_bytes())
    for library in ("torch", "transformers", "reasoning_gym"):
        digest.update(f"{library}=={metadata.version(library)}".encode())
    return built_once(
        f"chain-sum-tagged-{digest.hexdigest()[:16]}",
        build_model,
        about={"built_by": f"{__name__}.build_model", "tagged_share": TAGGED_SHARE},
    )


def test_grpo_raises_the_chain_sum_reward(knows_the_sums, tmp_path):
    tree = yaml.safe_load(default_config_path().read_text())  # the quickstart's settings for the tiny model
    tree["data"] = {**tree["data"], **DATA}
    config = load_config(
        tree,
        [
            f"model.path={knows_the_sums}",
            f"trainer.total_steps={STEPS}",
            "rollout.n=8",
            f"actor.ppo_mini_batch_size={ROWS}",
            "rollout.seed=0",
            "trainer.progress_bar=false",
            "trainer.plot=false",
            "trainer.loggers=[jsonl]",
        ],
    )

    metrics, status = run_to_end(in_process, config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    scores = [metrics[step]["critic/score/mean"] for step in sorted(metrics)]
    print("critic/score/mean by step:", [round(score, 3) for score in scores])
    assert len(scores) == STEPS
    assert scores[0] <= TAGGED_SHARE + 0.15  # a tagged share of right answers at most, plus sampling noise
    assert sum(scores[-3:]) / 3 >= scores[0] + 0.3
