"""`rlfabric data math|hellaswag|hh-rlhf`: small files in each data set's published form -> VeRL-schema
parquet that RLHFDataset loads; malformed records name the file, the line and the field."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from rlfabric.cli import main
from rlfabric.data.dataset import RLHFDataset
from rlfabric.data.prep import (
    DataFormatError,
    parse_hh_transcript,
    write_hellaswag,
    write_hh_rlhf,
    write_math,
)
from rlfabric.quickstart.tiny_model import build_tokenizer
from rlfabric.reward.registry import get_scorer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _rows(path):
    return pq.read_table(path).to_pylist()


# --- MATH ---

PROBLEM = {"problem": "What is $1+1$?", "level": "Level 1", "type": "Algebra",
           "solution": "We add: $1+1=\\boxed{2}$. Check $\\boxed{\\frac{4}{2}}$ too."}


def test_math_directory_of_problem_files(tmp_path, tokenizer):
    (tmp_path / "math" / "train" / "algebra").mkdir(parents=True)
    (tmp_path / "math" / "train" / "algebra" / "1.json").write_text(json.dumps(PROBLEM, indent=2))
    (tmp_path / "math" / "train" / "algebra" / "2.json").write_text(json.dumps({**PROBLEM, "solution": "$\\boxed{7}$"}))
    out = write_math(tmp_path / "math", tmp_path / "math.parquet")
    rows = _rows(out)
    assert [row["reward_model"] for row in rows] == [{"style": "rule", "ground_truth": "\\frac{4}{2}"},
                                                     {"style": "rule", "ground_truth": "7"}]
    first = rows[0]
    assert first["data_source"] == "lighteval/MATH" and first["ability"] == "math"
    assert first["prompt"] == [{"role": "user", "content": "What is $1+1$? Let's think step by step and output "
                                                           "the final answer within \\boxed{}."}]
    assert first["extra_info"]["level"] == "Level 1" and first["extra_info"]["index"] == 0
    # The rows load, and the MATH scorer (the last \boxed{} of a response) grades against their truth.
    row = RLHFDataset([out], tokenizer, max_prompt_length=512).rows[0]
    score = get_scorer(row.data_source)
    assert score("so \\boxed{\\frac{4}{2}}", row.ground_truth, None) == 1.0
    assert score("so \\boxed{3}", row.ground_truth, None) == 0.0


def test_math_jsonl_and_errors(tmp_path):
    out = write_math(_jsonl(tmp_path / "math.jsonl", [PROBLEM, PROBLEM]), tmp_path / "m.parquet")
    assert len(_rows(out)) == 2
    bad = _jsonl(tmp_path / "bad.jsonl", [PROBLEM, {**PROBLEM, "solution": "it is 2"}])
    with pytest.raises(DataFormatError, match=rf"{bad}: line 2: solution: has no \\boxed"):
        write_math(bad, tmp_path / "x.parquet")
    missing = tmp_path / "3.json"
    missing.write_text(json.dumps({"solution": "\\boxed{1}"}))
    with pytest.raises(DataFormatError, match=rf"{missing}: line 1: problem: expected a non-empty string"):
        write_math(missing, tmp_path / "x.parquet")
    broken = tmp_path / "4.json"
    broken.write_text('{\n  "problem": "x",\n  oops\n}')
    with pytest.raises(DataFormatError, match=rf"{broken}: line 3: record: not valid JSON"):
        write_math(broken, tmp_path / "x.parquet")


# --- HellaSwag ---

SWAG = {"activity_label": "Baking cookies", "ctx": "A woman puts a tray in the oven. She",
        "endings": ["waits and then takes out golden cookies.", "eats the oven.",
                    "swims across the [title] lake.", "paints the tray blue."], "label": 0}


def test_hellaswag_rows(tmp_path, tokenizer):
    out = write_hellaswag(_jsonl(tmp_path / "hs.jsonl", [SWAG, {**SWAG, "label": "2"}]), tmp_path / "hs.parquet")
    rows = _rows(out)
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["0", "2"]
    content = rows[0]["prompt"][0]["content"]
    assert content.startswith("Baking cookies: A woman puts a tray in the oven. She\n")
    assert "\nA. waits and then takes out golden cookies.\nB. eats the oven.\nC. swims across the. lake." in content
    assert content.endswith("Answer with the letter of the best ending.")
    assert rows[0]["data_source"] == "Rowan/hellaswag"
    assert rows[1]["extra_info"]["endings"][2] == "swims across the. lake."
    row = RLHFDataset([out], tokenizer, max_prompt_length=1024).rows[1]
    score = get_scorer(row.data_source)
    extra = json.loads(row.extra_info_json)
    assert score("The answer is C.", row.ground_truth, extra) == 1.0
    assert score("The answer is A.", row.ground_truth, extra) == 0.0


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({**SWAG, "ctx": ""}, "line 2: ctx: expected a non-empty string"),
        ({**SWAG, "endings": "one"}, "line 2: endings: expected a list of 2 to 8"),
        ({**SWAG, "endings": ["a", 3]}, "line 2: endings: expected a list"),
        ({**SWAG, "label": 4}, r"line 2: label: expected an ending index 0..3, got 4"),
        ({k: v for k, v in SWAG.items() if k != "label"}, "line 2: label: .*got None"),
        ("{not json", "line 2: record: not valid JSON"),
        ("[1, 2]", "line 2: record: expected a JSON object"),
    ],
)
def test_hellaswag_errors_name_file_line_and_field(tmp_path, record, match):
    bad = _jsonl(tmp_path / "hs.jsonl", [SWAG, record])
    with pytest.raises(DataFormatError, match=f"{bad}: {match}"):
        write_hellaswag(bad, tmp_path / "x.parquet")


# --- HH-RLHF ---

PROMPT = "\n\nHuman: How do I boil an egg?\n\nAssistant: Put it in boiling water.\n\nHuman: For how long?"
HH = {"chosen": PROMPT + "\n\nAssistant: About nine minutes for a hard yolk.",
      "rejected": PROMPT + "\n\nAssistant: Figure it out."}


def test_hh_rlhf_rows_are_multi_turn_prompts(tmp_path, tokenizer):
    out = write_hh_rlhf(_jsonl(tmp_path / "hh.jsonl", [HH]), tmp_path / "hh.parquet")
    row = _rows(out)[0]
    assert row["data_source"] == "Anthropic/hh-rlhf" and row["ability"] == "alignment"
    assert row["prompt"] == [
        {"role": "user", "content": "How do I boil an egg?"},
        {"role": "assistant", "content": "Put it in boiling water."},
        {"role": "user", "content": "For how long?"},
    ]
    assert row["reward_model"] == {"style": "model", "ground_truth": "About nine minutes for a hard yolk."}
    assert row["extra_info"]["chosen"] == "About nine minutes for a hard yolk."
    assert row["extra_info"]["rejected"] == "Figure it out."
    loaded = RLHFDataset([out], tokenizer, max_prompt_length=1024).rows[0]
    assert [message["role"] for message in loaded.messages] == ["user", "assistant", "user"]


def test_hh_transcript_parsing():
    assert parse_hh_transcript("Human: hi\n\nAssistant: hello") == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(ValueError, match="two Human turns in a row"):
        parse_hh_transcript("\n\nHuman: a\n\nHuman: b")
    with pytest.raises(ValueError, match="starting with"):
        parse_hh_transcript("hello there")


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({**HH, "rejected": None}, "line 2: rejected: expected a non-empty string, got nothing"),
        ({**HH, "chosen": "no speakers here"}, "line 2: chosen: expected a transcript starting with"),
        ({**HH, "chosen": PROMPT}, "line 2: chosen: expected the transcript to end with an Assistant turn"),
        ({**HH, "chosen": "\n\nAssistant: hi"}, "line 2: chosen: expected the first turn to be Human's"),
    ],
)
def test_hh_rlhf_errors_name_file_line_and_field(tmp_path, record, match):
    bad = _jsonl(tmp_path / "hh.jsonl", [HH, record])
    with pytest.raises(DataFormatError) as error:
        write_hh_rlhf(bad, tmp_path / "x.parquet")
    assert str(error.value).startswith(f"{bad}: {match}"), str(error.value)
    assert str(error.value).count("line 2") == 1, str(error.value)  # once, not "file: line: field: file: line: ..."


def test_a_transcript_ending_in_an_empty_assistant_turn_is_a_dialogue_with_an_empty_response(tmp_path):
    """Some HH-RLHF records end in "Assistant:" and nothing; the converter said the transcript did not end
    with an Assistant turn. The turn is there, empty."""
    assert parse_hh_transcript("\n\nHuman: hi\n\nAssistant:") == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    assert parse_hh_transcript("Human: hi\n\nAssistant:\n\nHuman: still there?\n\nAssistant: yes")[1:3] == [
        {"role": "assistant", "content": ""}, {"role": "user", "content": "still there?"}]
    out = write_hh_rlhf(_jsonl(tmp_path / "hh.jsonl", [{**HH, "rejected": PROMPT + "\n\nAssistant:"}]),
                        tmp_path / "hh.parquet")
    row = _rows(out)[0]
    assert row["extra_info"]["rejected"] == "" and row["reward_model"]["ground_truth"] == HH["chosen"].rsplit(": ", 1)[1]


def test_cli_converts_and_reports_bad_records(tmp_path, capsys):
    source = _jsonl(tmp_path / "hh.jsonl", [HH])
    with pytest.raises(SystemExit) as done:
        main(["data", "hh-rlhf", "--input", str(source), "--out", str(tmp_path / "hh.parquet"), "--split", "test"])
    assert done.value.code == 0 and _rows(tmp_path / "hh.parquet")[0]["extra_info"]["split"] == "test"
    bad = _jsonl(tmp_path / "hs.jsonl", [{**SWAG, "label": 9}])
    with pytest.raises(SystemExit) as done:
        main(["data", "hellaswag", "--input", str(bad), "--out", str(tmp_path / "hs.parquet")])
    assert done.value.code == 1
    assert f"rlfabric data hellaswag: {bad}: line 1: label:" in capsys.readouterr().err
