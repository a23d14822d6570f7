"""bench.hf_generate_bench, the figure the GPU check quotes for the hf engine against model.generate, runs
on tiny work: every side generates every row to max_tokens, and the entry holds the figures."""

from __future__ import annotations

from bench.hf_generate_bench import compare_with_generate


def test_the_engine_and_generate_run_the_same_rows(tiny_model):
    entry = compare_with_generate(tiny_model, prompts=2, samples=3, max_tokens=5, repeats=1, steps_per_sync=[4],
                                  dtype="float32")
    sides = {"hf_engine", "hf_engine_2_requests", "hf_engine_sync_4", "generate"}  # defaults: 1 (CPU), 8 (GPU)
    assert entry["tokens_per_run"] == dict.fromkeys(sides, 2 * 3 * 5)
    assert set(entry["tokens_per_s"]) == sides and all(value > 0 for value in entry["tokens_per_s"].values())
    assert entry["rows"] == 6 and entry["engine_vs_generate"] > 0
