"""bench/distill_real_bench.py's figures: the goal is the teacher's (GRPO's last steps) reward less the margin, and
each side reaches it when its moving average does."""

from __future__ import annotations

import json

import pytest

from bench import distill_real_bench as bench


def _run(rewards: list[float], step_s: float) -> dict:
    return {"steps": [{"step": i + 1, "reward": r, "seconds": step_s, "t": step_s * (i + 1)}
                      for i, r in enumerate(rewards)]}


def test_the_goal_and_when_each_side_reaches_it():
    grpo = _run([0.2, 0.3, 0.5, 0.8, 0.9, 0.9, 0.9], step_s=10)  # teacher: 0.9, goal 0.8
    distill = _run([0.2, 0.7, 0.9, 0.9, 0.9, 0.9, 0.9], step_s=20)
    summary = bench.summarize(grpo, distill)
    assert summary["teacher_reward"] == pytest.approx(0.9) and summary["goal"] == pytest.approx(0.8)
    assert summary["grpo_steps_to_goal"] == 6  # (0.5 + 0.8 + 0.9) / 3 < 0.8 <= (0.8 + 0.9 + 0.9) / 3
    assert summary["distill_steps_to_goal"] == 4  # (0.2 + 0.7 + 0.9) / 3 < 0.8 <= (0.7 + 0.9 + 0.9) / 3
    assert summary["grpo_time_to_goal_s"] == 60 and summary["distill_time_to_goal_s"] == 80
    assert summary["distill_over_grpo"] == pytest.approx(80 / 60)


def test_a_side_that_never_gets_there_has_no_ratio():
    summary = bench.summarize(_run([0.9] * 5, 1), _run([0.1] * 5, 1))
    assert summary["distill_steps_to_goal"] is None and summary["distill_over_grpo"] is None


def test_the_recorded_run_is_summarized_as_the_bench_does():
    recorded = json.loads((bench.RESULTS / "distill_real.json").read_text())
    assert recorded["summary"] == bench.summarize(recorded["grpo"], recorded["distill"])
    assert [s["step"] for s in recorded["distill"]["steps"]] == list(range(1, len(recorded["grpo"]["steps"]) + 1))
