"""Prompts from parquet files in VeRL's schema, tokenized with the model's chat template.

Columns (as VeRL's data preprocessing writes them):
    data_source   string                          selects the reward scorer
    prompt        list<struct<role, content>>     chat messages
    ability       string                          (optional) task family
    reward_model  struct<ground_truth, style?>    the answer the scorer compares against
    extra_info    struct / map / JSON string      (optional) passed to the scorer as JSON

Bad files are errors that name the file, the row and the column. Batches come from a seeded
shuffle per epoch; `DataCursor` (epoch, position) goes into checkpoints so a resumed run continues
with the next unseen batch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow.parquet as pq

from rlfabric.rollout.types import CHAT_ROLES

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")


class DatasetError(ValueError):
    """A data file is unreadable or does not follow the schema; the message names file, row, column."""


@dataclass
class PromptRow:
    """One training prompt."""

    uid: str  # "<file stem>:<row>", stable across runs
    data_source: str
    messages: list[dict[str, str]]
    prompt_ids: list[int]
    ground_truth: str
    ability: str
    extra_info_json: str


@dataclass
class DataCursor:
    """Where the dataloader is: saved in checkpoints."""

    epoch: int = 0
    position: int = 0  # prompts of this epoch's order already handed out

    def copy(self) -> DataCursor:
        """A cursor at the same place that the batches drawn from this one do not move."""
        return DataCursor(self.epoch, self.position)


def _row_error(path: Path, row: int, column: str, problem: str) -> DatasetError:
    return DatasetError(f"{path}: row {row}, column {column!r}: {problem}")


def _read_parquet(read, path: Path):
    """read(path) (pyarrow's), its errors as a DatasetError naming the file."""
    try:
        return read(path)
    except FileNotFoundError:
        raise DatasetError(f"{path}: file does not exist") from None
    except Exception as error:  # pyarrow raises several types for corrupt files
        raise DatasetError(f"{path}: not a readable parquet file ({type(error).__name__}: {error})") from None


def check_columns(path: str | Path) -> list[str]:
    """The column names of a data file that exists, is parquet and has every REQUIRED_COLUMNS; DatasetError
    naming the file otherwise. Reads the file's footer only: fast on any size."""
    names = _read_parquet(pq.read_schema, Path(path)).names
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise DatasetError(f"{path}: missing column(s) {missing}; it has {names}")
    return names


def data_sources(path: str | Path) -> set[str]:
    """The data_source values of a data file (check_columns first): the scorers a run with it needs."""
    column = _read_parquet(lambda p: pq.read_table(p, columns=["data_source"]), Path(path)).column("data_source")
    return {source for source in column.unique().to_pylist() if isinstance(source, str)}


def _read_rows(path: Path) -> list[dict]:
    check_columns(path)
    return _read_parquet(pq.read_table, path).to_pylist()


def _parse_row(path: Path, index: int, row: dict) -> tuple[str, list[dict[str, str]], str, str, str]:
    source = row["data_source"]
    if not isinstance(source, str) or not source:
        raise _row_error(path, index, "data_source", f"expected a non-empty string, got {source!r}")
    prompt = row["prompt"]
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt:
        raise _row_error(path, index, "prompt", f"expected a non-empty list of chat messages, got {type(prompt).__name__}")
    messages = []
    for message in prompt:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise _row_error(path, index, "prompt", f"each message needs string 'role' and 'content', got {message!r}")
        if message["role"] not in CHAT_ROLES:
            raise _row_error(path, index, "prompt", f"message {len(messages)} has role {message['role']!r}; a chat "
                                               f"message's role is one of {', '.join(CHAT_ROLES)}")
        messages.append({"role": message["role"], "content": message["content"]})
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise _row_error(path, index, "reward_model", "expected a struct with a 'ground_truth' field")
    truth = reward_model["ground_truth"]
    truth = truth if isinstance(truth, str) else json.dumps(truth)
    extra = row.get("extra_info")
    if extra is None:
        extra_json = "{}"
    elif isinstance(extra, str):
        try:
            if not isinstance(json.loads(extra), dict):
                raise ValueError
        except ValueError:
            raise _row_error(path, index, "extra_info", "a string extra_info must hold a JSON object") from None
        extra_json = extra
    elif isinstance(extra, dict):
        extra_json = json.dumps(extra, default=str)
    elif isinstance(extra, list):  # a parquet map arrives as a list of (key, value) pairs
        extra_json = json.dumps(dict(extra), default=str)
    else:
        raise _row_error(path, index, "extra_info", f"expected a struct, map or JSON string, got {type(extra).__name__}")
    ability = row.get("ability") or ""
    return source, messages, truth, str(ability), extra_json


class RLHFDataset:
    """All rows of the given parquet files, tokenized and length-checked up front."""

    def __init__(
        self,
        files: list[str | Path],
        tokenizer,
        max_prompt_length: int,
        truncation: Literal["error", "left", "right"] = "error",
        filter_overlong_prompts: bool = True,
    ):
        if not files:
            raise DatasetError("no data files given")
        self.rows: list[PromptRow] = []
        self.num_filtered = 0
        for file in files:
            path = Path(file)
            parsed = [_parse_row(path, index, raw) for index, raw in enumerate(_read_rows(path))]
            # One call for the file's rows: the tokenizer encodes them as a batch (3x faster than row by row).
            encoded = tokenizer.apply_chat_template([row[1] for row in parsed], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False) if parsed else []
            for index, ((source, messages, truth, ability, extra), ids) in enumerate(zip(parsed, encoded, strict=True)):
                ids = list(ids)
                if len(ids) > max_prompt_length:
                    if filter_overlong_prompts:
                        self.num_filtered += 1
                        continue
                    if truncation == "error":
                        raise _row_error(path, index, "prompt", f"{len(ids)} tokens > data.max_prompt_length "
                                                           f"{max_prompt_length} (set data.truncation or "
                                                           "data.filter_overlong_prompts)")
                    ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
                self.rows.append(PromptRow(f"{path.stem}:{index}", source, messages, ids, truth, ability, extra))
        if not self.rows:
            raise DatasetError(f"no usable rows in {[str(f) for f in files]} ({self.num_filtered} too long)")

    def __len__(self) -> int:
        return len(self.rows)

    def epoch_order(self, epoch: int, seed: int) -> np.ndarray:
        """The shuffled row order of an epoch (same seed and epoch -> same order)."""
        return np.random.default_rng([seed, epoch]).permutation(len(self.rows))

    def batches(self, batch_size: int, seed: int, cursor: DataCursor) -> Iterator[list[PromptRow]]:
        """Endless batches from `cursor` on; the cursor advances as batches are handed out.

        An epoch's tail shorter than batch_size is dropped (as VeRL's drop_last), so every batch is full.
        """
        if batch_size > len(self.rows):
            raise DatasetError(f"data.train_batch_size {batch_size} > {len(self.rows)} rows in the dataset")
        while True:
            order = self.epoch_order(cursor.epoch, seed)
            while cursor.position + batch_size <= len(order):
                picked = order[cursor.position : cursor.position + batch_size]
                cursor.position += batch_size
                yield [self.rows[i] for i in picked]
            cursor.epoch += 1
            cursor.position = 0
