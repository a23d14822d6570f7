"""bench.judge_bench, the judge throughput figure of `make bench`, runs on tiny work: the real reward service
sends every item to the tiny model's hf rollout service, one per Generate request unbatched and batch_size per
request batched, and the results file keeps one entry per judge model."""

from __future__ import annotations

import json
import math

from bench.judge_bench import make_items, measure, summarize


def test_each_mode_judges_every_item_in_requests_of_its_batch_size(tiny_model):
    items = make_items(4)
    runs = measure(tiny_model, items, {"unbatched": (1, 1), "batched": (2, 2)}, max_tokens=2, repeats=1)
    # Warm-up first (2 items in both modes), then the 4 items: 1 + 1 per item, or batch_size per request.
    assert runs["unbatched"]["generate_requests"] == 2 + 4
    assert runs["batched"]["generate_requests"] == 1 + math.ceil(4 / 2)
    for run in runs.values():
        assert len(run["scores"]) == 4 and run["items_per_s"] > 0 and len(run["seconds"]) == 1
    summary = summarize(runs)
    assert summary["same_scores"]  # greedy: the same verdicts whatever the batch
    assert summary["batched_vs_unbatched"] == round(
        runs["batched"]["items_per_s"] / runs["unbatched"]["items_per_s"], 2
    )


def test_main_writes_its_models_entry_and_keeps_the_others(tmp_path):
    from bench.judge_bench import main

    out = tmp_path / "judge.json"
    out.write_text(json.dumps({"models": {"smollm2": {"batched_vs_unbatched": 3.5}}}))
    main(["--model", "tiny", "--items", "2", "--max-tokens", "2", "--repeats", "1", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["models"]["smollm2"] == {"batched_vs_unbatched": 3.5}
    tiny = written["models"]["tiny"]
    assert set(tiny["modes"]) == {"unbatched", "batched"} and tiny["batched_vs_unbatched"] > 0
