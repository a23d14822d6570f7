"""The peer bench's own arithmetic and its check that both sides run the same settings (the runs themselves are
`make bench`'s: minutes each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.peer_trl_bench import WORKLOADS, summarize, time_to_reward, trl_spec
from rlfabric.core.config import load_config


def steps(rewards: list[float], seconds: float = 2.0) -> list[dict]:
    return [{"step": i + 1, "reward": r, "seconds": seconds, "t": seconds * (i + 1)} for i, r in enumerate(rewards)]


def test_time_to_reward_waits_for_the_three_step_moving_average():
    # One lucky step (0.9 at step 2) is not enough: the average of steps 4-6 is the first to reach 0.6.
    assert time_to_reward(steps([0.1, 0.9, 0.5, 0.2, 0.7, 1.0])) == 12.0
    assert time_to_reward(steps([0.1, 0.9, 0.5, 0.3])) is None


def test_summarize_gives_the_mean_and_spread_per_step_and_the_mean_time_of_the_seeds_that_reach_it():
    runs = [{"seed": 0, "steps": steps([0.2, 0.6, 0.8, 1.0]), "startup_s": 5.0},
            {"seed": 1, "steps": steps([0.4, 0.4, 0.4, 0.4], seconds=3.0), "startup_s": 7.0}]
    for run in runs:
        run["time_to_reward_s"] = time_to_reward(run["steps"])
    summary = summarize(runs)
    assert summary["mean_reward_per_step"] == pytest.approx([0.3, 0.5, 0.6, 0.7])
    assert summary["std_reward_per_step"] == pytest.approx([0.1, 0.1, 0.2, 0.3])
    assert summary["time_to_reward_s_per_seed"] == [8.0, None]  # steps 2-4 average 0.8
    assert (summary["mean_time_to_reward_s"], summary["seeds_reaching_reward"]) == (8.0, 1)
    assert summary["median_step_s"] == 2.5  # steps 2-4 of both seeds
    assert summary["mean_t_per_step"][0] == 2.5


def test_trl_runs_the_quickstarts_settings_and_a_setting_trl_does_not_share_is_refused(tmp_path):
    config = load_config(None).model_dump(mode="json")
    config["model"]["path"] = "/models/tiny"
    spec = trl_spec(config, WORKLOADS["quickstart"], tmp_path, seed=3, out_dir=tmp_path / "trl")
    assert spec["train_parquet"] == str(tmp_path / "data" / "find_vowel" / "train.parquet")
    assert {k: spec[k] for k in ("prompts_per_step", "n", "max_tokens", "lr", "entropy_coef", "top_k", "seed")} == {
        "prompts_per_step": 64, "n": 8, "max_tokens": 4, "lr": 2e-3, "entropy_coef": 0.02, "top_k": 0, "seed": 3}
    assert Path(spec["reward_file"]).is_file() and Path(spec["reward_file"]).name == "find_vowel.py"
    config["actor"]["loss_agg_mode"] = "seq-mean-token-mean"
    config["actor"]["ppo_mini_batch_size"] = 32
    with pytest.raises(ValueError, match="actor.loss_agg_mode.*actor.ppo_mini_batch_size"):
        trl_spec(config, WORKLOADS["quickstart"], tmp_path, seed=3, out_dir=tmp_path / "trl")
