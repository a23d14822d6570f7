"""Writes training data in VeRL's parquet schema: `rlfabric data synthetic|arithmetic|gsm8k`."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlfabric.reward import arithmetic, synthetic

# VeRL's GSM8K preprocessing appends this instruction to every question.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def _write(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _row(source: str, content: str, truth: str, ability: str, split: str, index: int, **extra) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def write_synthetic(out_dir: str | Path, train_size: int = 2048, val_size: int = 128, seed: int = 0) -> dict:
    """The quickstart task (see rlfabric.reward.synthetic) as train.parquet and val.parquet."""
    rng = random.Random(seed)
    paths = {}
    for split, size in (("train", train_size), ("val", val_size)):
        rows = []
        for index in range(size):
            prompt, answer = synthetic.make_example(rng)
            rows.append(_row(synthetic.DATA_SOURCE, prompt, answer, "letters", split, index))
        paths[split] = _write(rows, Path(out_dir) / f"{split}.parquet")
    return paths


def write_arithmetic(out_dir: str | Path, train_size: int = 1024, val_size: int = 64, seed: int = 0) -> dict:
    """The real-model task (see rlfabric.reward.arithmetic) as train.parquet and val.parquet."""
    rng = random.Random(seed)
    paths = {}
    for split, size in (("train", train_size), ("val", val_size)):
        rows = [_row(arithmetic.DATA_SOURCE, *arithmetic.make_example(rng), "math", split, index)
                for index in range(size)]
        paths[split] = _write(rows, Path(out_dir) / f"{split}.parquet")
    return paths


def write_gsm8k(input_jsonl: str | Path, out_path: str | Path, split: str = "train") -> Path:
    """A local GSM8K jsonl (question/answer per line) as VeRL-schema parquet."""
    rows = []
    for index, line in enumerate(Path(input_jsonl).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            question, answer = record["question"], record["answer"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{input_jsonl}: line {index + 1}: expected JSON with question and answer ({error})") from None
        match = _GSM8K_ANSWER.search(answer)
        if match is None:
            raise ValueError(f"{input_jsonl}: line {index + 1}: answer has no '#### <number>'")
        truth = match.group(1).replace(",", "")
        rows.append(_row("openai/gsm8k", f"{question} {GSM8K_INSTRUCTION}", truth, "math", split, index,
                         answer=answer, question=question))
    return _write(rows, Path(out_path))
