"""The first-update bench's replay and comparisons (the runs themselves are `make bench`'s: minutes): TRL's
rollout_func hands back each dumped sample once, token for token; samples are matched by their token ids; and
the update comparison tells equal, scaled and different updates apart."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench.first_update_bench import grpo_advantages, per_sample, update_agreement
from bench.trl_grpo import load_replay, replayed


def dumped(prompt: str, index: int, score: float, response: list[int]) -> dict:
    """One line of an rlfabric rollout dump with trainer.dump_rollout_tokens."""
    return {"prompt": prompt, "sample_index": index, "score": score, "prompt_ids": [1, 2, len(prompt)],
            "response_ids": response, "rollout_log_probs": [-0.5] * len(response)}


SAMPLES = [dumped("What is 1 + 1?", i, float(i % 2), [10 + i, 3]) for i in range(4)] + \
          [dumped("What is 2 + 5?", i, 1.0 if i == 0 else 0.0, [20 + i]) for i in range(4)]


def test_the_replay_gives_each_prompt_its_dumped_samples_in_order_whatever_order_trl_draws_them(tmp_path):
    dump = tmp_path / "step_1.jsonl"
    dump.write_text("".join(json.dumps(s) + "\n" for s in reversed(SAMPLES)))  # any order in the file
    replay = load_replay(str(dump))
    assert {p: [s["sample_index"] for s in v] for p, v in replay.items()} == {
        "What is 1 + 1?": [0, 1, 2, 3], "What is 2 + 5?": [0, 1, 2, 3]}
    drawn = [[{"role": "user", "content": p}] for p in ["What is 2 + 5?", "What is 1 + 1?"] * 4]
    out = replayed(replay)(drawn, trainer=None)
    assert out["completion_ids"][:4] == [[20], [10, 3], [21], [11, 3]]
    assert sorted(map(tuple, out["completion_ids"])) == sorted(tuple(s["response_ids"]) for s in SAMPLES)
    assert out["prompt_ids"][0] == [1, 2, len("What is 2 + 5?")] and out["logprobs"][1] == [-0.5, -0.5]
    with pytest.raises(IndexError):  # a fifth draw of a prompt has no sample: never a repeated one
        replayed(replay)(drawn + drawn[:1], trainer=None)


def test_grpo_advantages_are_each_groups_standardised_scores():
    advantages = grpo_advantages(SAMPLES)
    first = [0.0, 1.0, 0.0, 1.0]
    expected = [(s - 0.5) / (statistics.stdev(first) + 1e-6) for s in first]
    assert advantages[:4] == pytest.approx(expected, abs=1e-5)
    assert advantages[4] == pytest.approx(0.75 / (statistics.stdev([1, 0, 0, 0]) + 1e-6), abs=1e-5)


def test_samples_are_matched_by_token_ids_and_a_different_advantage_shows():
    ours = grpo_advantages(SAMPLES)
    trl = {"rewards": [s["score"] for s in reversed(SAMPLES)],
           "advantages": [{"prompt_ids": s["prompt_ids"], "completion_ids": s["response_ids"], "advantage": a}
                          for s, a in reversed(list(zip(SAMPLES, ours, strict=True)))]}
    same = per_sample(SAMPLES, ours, trl)
    assert (same["not_found_in_trl"], same["advantage_max_abs_difference"]) == (0, 0.0)
    trl["advantages"][0]["advantage"] += 0.25
    trl["advantages"].pop()
    different = per_sample(SAMPLES, ours, trl)
    assert different["not_found_in_trl"] == 1 and different["advantage_max_abs_difference"] == pytest.approx(0.25)


def test_the_update_comparison_tells_equal_scaled_and_different_updates_apart(tmp_path):
    g = torch.Generator().manual_seed(0)
    before = {"a.weight": torch.randn(8, 4, generator=g), "b.weight": torch.randn(16, generator=g)}
    step = {name: torch.randn(w.shape, generator=g) * 1e-3 for name, w in before.items()}

    def saved(name: str, weights: dict) -> Path:
        (tmp_path / name).mkdir()
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / name / "model.safetensors")
        return tmp_path / name

    initial = saved("initial", before)
    ours = saved("ours", {k: before[k] + step[k] for k in before})
    equal = update_agreement(initial, ours, saved("equal", {k: before[k] + step[k] for k in before}))
    assert equal["cosine_all_weights"] == pytest.approx(1.0) and equal["norm_ratio_rlfabric_over_trl"] == pytest.approx(1.0)
    halved = update_agreement(initial, ours, saved("halved", {k: before[k] + 2 * step[k] for k in before}))
    assert halved["cosine_all_weights"] == pytest.approx(1.0) and halved["norm_ratio_rlfabric_over_trl"] == pytest.approx(0.5)
    flipped = {"a.weight": before["a.weight"] + step["a.weight"], "b.weight": before["b.weight"] - step["b.weight"]}
    one_wrong = update_agreement(initial, ours, saved("flipped", flipped))
    assert one_wrong["worst_tensor"]["name"] == "b.weight"
    assert one_wrong["worst_tensor"]["cosine"] == pytest.approx(-1.0)
    assert one_wrong["cosine_all_weights"] < 0.9
