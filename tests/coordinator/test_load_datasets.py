"""load_datasets: the run's data, and a warning that says how many prompts were too long to keep."""

from __future__ import annotations

import json
import logging

from rlfabric.coordinator.setup import load_datasets
from rlfabric.core.config import config_from_dict
from rlfabric.data.prep import write_custom
from rlfabric.quickstart.tiny_model import build_tokenizer


def test_prompts_left_out_as_too_long_are_counted_in_a_warning(tmp_path, caplog):
    source = tmp_path / "quiz.jsonl"
    source.write_text("".join(json.dumps({"q": q, "a": "1"}) + "\n" for q in ("short?", "x" * 80, "also short?")))
    train = write_custom(source, tmp_path / "train.parquet", "q", "a")
    config = config_from_dict({"data": {"train_files": [str(train)], "train_batch_size": 2, "max_prompt_length": 48}})
    with caplog.at_level(logging.WARNING, logger="rlfabric.coordinator"):
        dataset, val = load_datasets(config, tmp_path, build_tokenizer())
    assert len(dataset) == 2 and val is None
    assert "data.train_files: 1 of the prompts are longer than data.max_prompt_length 48 tokens and were left out" in caplog.text
