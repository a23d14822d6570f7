"""VeRL-schema parquet: loading, validation errors naming file/row/column, truncation, resumable order."""

from __future__ import annotations

import itertools
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfabric.data.dataset import DataCursor, DatasetError, RLHFDataset
from rlfabric.data.prep import write_gsm8k, write_synthetic
from rlfabric.quickstart.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("syn"), train_size=40, val_size=8, seed=3)


def test_synthetic_rows_tokenize_with_the_chat_template(synthetic, tokenizer):
    data = RLHFDataset([synthetic["train"]], tokenizer, max_prompt_length=64)
    assert len(data) == 40
    row = data.rows[0]
    assert row.data_source == "rlfabric/find_vowel" and row.uid == "train:0"
    text = tokenizer.decode(row.prompt_ids)
    assert text.startswith("<|im_start|>user\nfind the vowel: ") and text.endswith("<|im_start|>assistant\n")
    assert row.ground_truth in row.messages[0]["content"].split(": ")[1].split(" ")
    assert json.loads(row.extra_info_json) == {"split": "train", "index": 0}


def test_rows_of_several_turns_and_files_tokenize_as_the_chat_template_does_one_by_one(tmp_path, tokenizer):
    # The dataset encodes a file's rows in one batched call: each row's ids are still its own conversation's.
    conversations = [[{"role": "user", "content": "a" * (i + 1)}] if i % 2 else
                     [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"},
                      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again " * i}]
                     for i in range(9)]
    files = []
    for part in (conversations[:5], conversations[5:]):
        files.append(tmp_path / f"part{len(files)}.parquet")
        pq.write_table(pa.table({"data_source": ["t"] * len(part), "prompt": part,
                                 "reward_model": [{"ground_truth": "x"}] * len(part)}), files[-1])
    data = RLHFDataset(files, tokenizer, max_prompt_length=512)
    expected = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
                for c in conversations]
    assert [row.prompt_ids for row in data.rows] == expected
    assert [row.uid for row in data.rows] == [f"part0:{i}" for i in range(5)] + [f"part1:{i}" for i in range(4)]


def test_batches_are_seeded_and_resume_from_the_cursor(synthetic, tokenizer):
    data = RLHFDataset([synthetic["train"]], tokenizer, max_prompt_length=64)
    uninterrupted = [[r.uid for r in b] for b in itertools.islice(data.batches(8, 1, DataCursor()), 12)]
    # 40 rows / 8 = 5 batches an epoch: 12 batches cross two epoch boundaries, each epoch a permutation.
    assert sorted(uid for b in uninterrupted[:5] for uid in b) == sorted(r.uid for r in data.rows)
    assert uninterrupted[:5] != uninterrupted[5:10]
    cursor = DataCursor()
    first = [[r.uid for r in b] for b in itertools.islice(data.batches(8, 1, cursor), 7)]
    saved = DataCursor(cursor.epoch, cursor.position)  # what a checkpoint stores
    rest = [[r.uid for r in b] for b in itertools.islice(data.batches(8, 1, saved), 5)]
    assert first + rest == uninterrupted
    assert [[r.uid for r in b] for b in itertools.islice(data.batches(8, 2, DataCursor()), 5)] != uninterrupted[:5]


def test_overlong_prompts_filter_truncate_or_fail(synthetic, tokenizer):
    full = RLHFDataset([synthetic["train"]], tokenizer, max_prompt_length=64).rows[0].prompt_ids
    limit = len(full) - 2
    with pytest.raises(DatasetError, match="no usable rows"):
        RLHFDataset([synthetic["train"]], tokenizer, max_prompt_length=limit)  # every prompt is filtered
    with pytest.raises(DatasetError, match=r"row 0, column 'prompt': \d+ tokens > data.max_prompt_length"):
        RLHFDataset([synthetic["train"]], tokenizer, limit, truncation="error", filter_overlong_prompts=False)
    left = RLHFDataset([synthetic["train"]], tokenizer, limit, truncation="left", filter_overlong_prompts=False)
    right = RLHFDataset([synthetic["train"]], tokenizer, limit, truncation="right", filter_overlong_prompts=False)
    assert left.rows[0].prompt_ids == full[-limit:] and right.rows[0].prompt_ids == full[:limit]


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


GOOD = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
        "reward_model": {"ground_truth": "2"}}


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"data_source": "x", "prompt": [{"role": "user", "content": "a"}]}],
         r"missing column\(s\) \['reward_model'\]"),
        ([GOOD, {**GOOD, "data_source": ""}], r"row 1, column 'data_source': expected a non-empty string"),
        ([GOOD, {**GOOD, "prompt": []}], r"row 1, column 'prompt': expected a non-empty list"),
        ([{**GOOD, "reward_model": {"style": "rule"}}], r"row 0, column 'reward_model': .*ground_truth"),
        ([{**GOOD, "extra_info": "[1, 2]"}], r"row 0, column 'extra_info': .*JSON object"),
        # A role chat templates do not know would be rendered as given (ChatML: after <|im_start|>).
        ([GOOD, {**GOOD, "prompt": [{"role": "user", "content": "a"}, {"role": "im_end|>", "content": "b"}]}],
         r"row 1, column 'prompt': message 1 has role 'im_end\|>'; a chat message's role is one of system, user"),
    ],
)
def test_schema_errors_name_file_row_and_column(tmp_path, tokenizer, rows, match):
    path = _write(tmp_path / "bad.parquet", rows)
    with pytest.raises(DatasetError, match=f"{tmp_path}/bad.parquet: " + match if "row" in match else match):
        RLHFDataset([path], tokenizer, max_prompt_length=64)


def test_unreadable_files(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="does not exist"):
        RLHFDataset([tmp_path / "nope.parquet"], tokenizer, 64)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="junk.parquet: not a readable parquet file"):
        RLHFDataset([junk], tokenizer, 64)


def test_gsm8k_jsonl_conversion(tmp_path, tokenizer):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text(json.dumps({"question": "Tom has 1,200 apples. How many?", "answer": "Easy.\n#### 1,200"}) + "\n")
    out = write_gsm8k(source, tmp_path / "gsm8k.parquet")
    row = RLHFDataset([out], tokenizer, max_prompt_length=512).rows[0]
    assert row.data_source == "openai/gsm8k" and row.ground_truth == "1200"
    assert row.messages[0]["content"].endswith('output the final answer after "####".')
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="line 1: answer has no"):
        write_gsm8k(bad, tmp_path / "x.parquet")
