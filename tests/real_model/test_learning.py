"""GRPO on a real pretrained model learns, end to end through the CLI a user runs:
`rlfabric train examples/smollm2_arithmetic.yaml` (SmolLM2-135M-Instruct, vLLM rollout, gloo weight
sync, 10 steps of 8 prompts x 4 samples x 48 tokens; ~6 min on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rollout.conftest import require_vllm

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2_arithmetic.yaml"


@pytest.mark.timeout(1200)
def test_grpo_teaches_smollm2_to_answer_the_sum(smollm2, tmp_path):
    require_vllm()
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rlfabric", "train", str(EXAMPLE), "--run-dir", str(run_dir),
                           "trainer.progress_bar=false", "rollout.seed=0"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in records]
    print("critic/score/mean by step:", [round(s, 3) for s in scores])
    assert len(scores) == 10
    assert 0.05 <= scores[0] <= 0.6, scores  # the pretrained model's own start: it rarely states the sum
    last3 = sum(scores[-3:]) / 3
    assert last3 >= scores[0] + 0.3 and last3 >= 0.6, scores
    # Shorter, plainer answers are what is learned.
    assert records[-1]["response_length/mean"] < records[0]["response_length/mean"]
    assert (run_dir / "checkpoints" / "global_step_10" / "actor" / "model.safetensors").exists()
    assert (run_dir / "final_model" / "chat_template.jinja").exists()
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
