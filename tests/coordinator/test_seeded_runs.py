"""A seeded run repeats itself (issue 34, item 1): two runs of one config with rollout.seed set, each on a mesh
of its own with a fresh vLLM engine, generate the same samples (RUN_DIR/rollouts, every response and score)
and train the same curve (the step metrics that do not measure time), bit for bit."""

from __future__ import annotations

import pytest

from rlfabric.core.config import load_config
from tests.coordinator.meshes import FAST, in_process, run_to_end
from tests.rollout.conftest import require_vllm

pytestmark = pytest.mark.slow

CURVE = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
         "actor/pg_clipfrac")


def seeded_run(model_path, run_dir) -> tuple[dict[int, dict[str, float]], dict[str, str]]:
    """(step -> its CURVE metrics, rollouts file -> its text) of a two-step vLLM run with rollout.seed 0."""
    config = load_config(None, [f"model.path={model_path}", *FAST, "rollout.engine=vllm", "rollout.seed=0",
                                "rollout.kv_cache_space_gb=1"])
    metrics, _ = run_to_end(in_process, config, run_dir)
    curve = {step: {key: step_metrics[key] for key in CURVE} for step, step_metrics in metrics.items()}
    return curve, {path.name: path.read_text() for path in sorted((run_dir / "rollouts").glob("*.jsonl"))}


def test_two_runs_with_one_seed_give_the_same_samples_and_curve(tiny_model, tmp_path):
    require_vllm()
    first_curve, first_samples = seeded_run(tiny_model, tmp_path / "first")
    second_curve, second_samples = seeded_run(tiny_model, tmp_path / "second")
    assert sorted(first_samples) == ["step_1.jsonl", "step_2.jsonl"] and len(first_curve) == 2
    assert second_samples == first_samples
    assert second_curve == first_curve
