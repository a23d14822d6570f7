"""`rlfabric data custom`: your own JSONL or CSV with named prompt and answer columns -> VeRL-schema
parquet that RLHFDataset loads; a missing column or a bad value names the file, the line and the column."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from rlfabric.cli import main
from rlfabric.data.dataset import RLHFDataset
from rlfabric.data.prep import DataFormatError, write_custom
from rlfabric.quickstart.tiny_model import build_tokenizer

RECORDS = [{"q": "What is the capital of Peru?", "a": "Lima", "level": 1},
           {"q": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Chile?"}],
            "a": 7, "level": 2}]


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_jsonl_rows_keep_every_other_column_in_extra_info(tmp_path):
    out = write_custom(_jsonl(tmp_path / "quiz.jsonl", RECORDS), tmp_path / "quiz.parquet", "q", "a",
                       instruction="One word.")
    rows = pq.read_table(out).to_pylist()
    assert [row["data_source"] for row in rows] == ["quiz", "quiz"]  # the file's name by default
    assert rows[0]["prompt"] == [{"role": "user", "content": "What is the capital of Peru? One word."}]
    assert rows[1]["prompt"] == RECORDS[1]["q"]  # a whole chat is kept as it is
    assert [row["reward_model"] for row in rows] == [{"style": "rule", "ground_truth": "Lima"},
                                                     {"style": "rule", "ground_truth": "7"}]
    assert rows[0]["extra_info"] == {"split": "train", "index": 0, "a": "Lima", "level": 1}
    assert rows[1]["extra_info"]["a"] == "7"  # the answer as text in every row
    loaded = RLHFDataset([out], build_tokenizer(), max_prompt_length=256).rows
    assert [row.ground_truth for row in loaded] == ["Lima", "7"]


def test_csv_through_the_command_line(tmp_path, capsys):
    source = tmp_path / "quiz.csv"
    source.write_text('\ufeffquestion,answer,topic\n"Capital of Peru, in one word?",Lima,geo\nCapital of Chile?,Santiago,geo\n',
                      encoding="utf-8")  # a byte-order mark first, as spreadsheets save CSV
    out = tmp_path / "data" / "train.parquet"
    with pytest.raises(SystemExit) as done:
        main(["data", "custom", "--input", str(source), "--prompt-column", "question", "--answer-column", "answer",
              "--data-source", "geo_quiz", "--out", str(out)])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == str(out)
    rows = pq.read_table(out).to_pylist()
    assert [(r["data_source"], r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in rows] == [
        ("geo_quiz", "Capital of Peru, in one word?", "Lima"), ("geo_quiz", "Capital of Chile?", "Santiago")]
    assert rows[1]["extra_info"] == {"split": "train", "index": 1, "answer": "Santiago", "topic": "geo"}


@pytest.mark.parametrize(("records", "match"), [
    ([{"q": "x?", "answer": "1"}], r"line 1: a: no such column \(the columns: q, answer\)"),
    ([RECORDS[0], {"q": "", "a": "1"}], "line 2: q: expected non-empty text"),
    ([{"q": "x?", "a": None}], "line 1: a: expected a non-empty text or number"),
    ([{"q": [{"role": "user"}], "a": "1"}], "line 1: q: expected text or a list of {role, content} messages"),
    ([], "the file holds no records"),
])
def test_bad_records_name_the_file_line_and_column(tmp_path, records, match):
    with pytest.raises(DataFormatError, match=match):
        write_custom(_jsonl(tmp_path / "quiz.jsonl", records), tmp_path / "quiz.parquet", "q", "a")


def test_other_problems_are_clear_errors(tmp_path, capsys):
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"q": "x?", "a": "1", "tag": 3}, {"q": "y?", "a": "2", "tag": [1]}])
    with pytest.raises(ValueError, match="a column holds values of different types"):
        write_custom(mixed, tmp_path / "out.parquet", "q", "a")
    (tmp_path / "quiz.txt").write_text("x")
    with pytest.raises(ValueError, match="expected a .jsonl or .csv file"):
        write_custom(tmp_path / "quiz.txt", tmp_path / "out.parquet", "q", "a")
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("q,a\nx?,1,extra\n")
    with pytest.raises(SystemExit) as done:
        main(["data", "custom", "--input", str(ragged), "--prompt-column", "q", "--answer-column", "a",
              "--out", str(tmp_path / "out.parquet")])
    assert done.value.code == 1
    assert f"rlfabric data custom: {ragged}: line 2: record: more values than the header's 2 columns" in capsys.readouterr().err
