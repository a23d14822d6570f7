"""Writes training data in VeRL's parquet schema: `rlfabric data synthetic|arithmetic|gsm8k|math|hellaswag|hh-rlhf|custom`.

Each converter reads a data set's files in their published form and writes one row per record:
data_source (VeRL's name, which picks the scorer), prompt (chat messages), ability,
reward_model {style, ground_truth} and extra_info {split, index, ...}. A malformed record is a
DataFormatError naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import json
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlfabric.reward import arithmetic, find_vowel, hellaswag
from rlfabric.reward.math_equiv import last_boxed_only_string, remove_boxed

# VeRL's GSM8K preprocessing appends this instruction to every question.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
# VeRL's MATH preprocessing appends this one; the ground truth is the solution's last \boxed{} answer.
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
MATH_DATA_SOURCE = "lighteval/MATH"
HH_RLHF_DATA_SOURCE = "Anthropic/hh-rlhf"
# A speaker's turn: its name, a colon and a space, or nothing more (an empty turn: "Assistant:" at the end).
_HH_TURN = re.compile(r"\n\n(Human|Assistant):(?: |(?=\n)|$)")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


class DataFormatError(ValueError):
    """A record of an input file is malformed; the message names the file, the line and the field."""

    def __init__(self, path: str | Path, line: int, field: str, problem: str):
        super().__init__(f"{path}: line {line}: {field}: {problem}")


def _write(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _row(source: str, content: str | list[dict], truth: str, ability: str, split: str, index: int,
         style: str = "rule", **extra) -> dict:
    """One row of VeRL's schema; content is the user message, or the whole chat."""
    prompt = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return {
        "data_source": source,
        "prompt": prompt,
        "ability": ability,
        "reward_model": {"style": style, "ground_truth": truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def _jsonl_records(path: Path):
    """(line number, JSON object) for every non-blank line; DataFormatError for a line that is not one."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise DataFormatError(path, number, "record", f"not valid JSON ({error})") from None
        if not isinstance(record, dict):
            raise DataFormatError(path, number, "record", f"expected a JSON object, got {type(record).__name__}")
        yield number, record


def _text_field(path: Path, line: int, record: dict, field: str) -> str:
    value = record.get(field)
    if not isinstance(value, str) or not value.strip():
        got = "nothing" if value is None else repr(value)[:60]
        raise DataFormatError(path, line, field, f"expected a non-empty string, got {got}")
    return value


def write_synthetic(out_dir: str | Path, train_size: int = 2048, val_size: int = 128, seed: int = 0) -> dict:
    """The quickstart task (see rlfabric.reward.find_vowel) as train.parquet and val.parquet."""
    rng = random.Random(seed)
    paths = {}
    for split, size in (("train", train_size), ("val", val_size)):
        rows = []
        for index in range(size):
            prompt, answer = find_vowel.make_example(rng)
            rows.append(_row(find_vowel.DATA_SOURCE, prompt, answer, "letters", split, index))
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


def write_lookup(out_dir: str | Path, train_size: int = 1024, val_size: int = 64, seed: int = 0) -> dict:
    """The multi-turn toy task (see rlfabric.env.lookup) as train.parquet and val.parquet; each row's
    extra_info names its environment (extra_info.environment: lookup) and holds its table."""
    from rlfabric.env.lookup import make_row

    rng = random.Random(seed)
    paths = {}
    for split, size in (("train", train_size), ("val", val_size)):
        rows = [{**row, "ability": "tool", "extra_info": {**row["extra_info"], "environment": "lookup",
                                                          "split": split, "index": index}}
                for index, row in enumerate(make_row(rng) for _ in range(size))]
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


def _math_records(source: Path):
    """(file, line, record) of MATH's per-problem JSON files: one file, a directory searched
    recursively for *.json (as the MATH archive is laid out), or a jsonl file with one per line."""
    if source.is_dir():
        files = sorted(source.rglob("*.json"))
        if not files:
            raise DataFormatError(source, 0, "files", "no *.json problem files in this directory")
    else:
        files = [source]
    for path in files:
        if path.suffix == ".jsonl":
            for line, record in _jsonl_records(path):
                yield path, line, record
            continue
        try:
            record = json.loads(path.read_text())
        except ValueError as error:
            raise DataFormatError(path, getattr(error, "lineno", 1), "record", f"not valid JSON ({error})") from None
        if not isinstance(record, dict):
            raise DataFormatError(path, 1, "record", f"expected a JSON object, got {type(record).__name__}")
        yield path, 1, record


def write_math(source: str | Path, out_path: str | Path, split: str = "train") -> Path:
    """MATH problems (problem, solution with a \\boxed{} answer; level and type kept) as VeRL-schema
    parquet: the problem plus VeRL's instruction, the boxed answer as ground truth."""
    rows = []
    for index, (path, line, record) in enumerate(_math_records(Path(source))):
        problem = _text_field(path, line, record, "problem")
        solution = _text_field(path, line, record, "solution")
        boxed = last_boxed_only_string(solution)
        answer = remove_boxed(boxed) if boxed is not None else None
        if answer is None:
            raise DataFormatError(path, line, "solution", "has no \\boxed{...} answer")
        extra = {key: str(record[key]) for key in ("level", "type") if key in record}
        rows.append(_row(MATH_DATA_SOURCE, f"{problem} {MATH_INSTRUCTION}", answer, "math", split, index,
                         solution=solution, **extra))
    return _write(rows, Path(out_path))


def write_hellaswag(input_jsonl: str | Path, out_path: str | Path, split: str = "train") -> Path:
    """HellaSwag jsonl (ctx, endings, label; activity_label optional) as VeRL-schema parquet: the
    context and the lettered endings as the prompt (rlfabric.reward.hellaswag), the label index as
    ground truth, the endings in extra_info."""
    path = Path(input_jsonl)
    rows = []
    for index, (line, record) in enumerate(_jsonl_records(path)):
        context = _text_field(path, line, record, "ctx")
        endings = record.get("endings")
        if not (isinstance(endings, list) and 2 <= len(endings) <= len(hellaswag.LETTERS)
                and all(isinstance(ending, str) and ending.strip() for ending in endings)):
            raise DataFormatError(path, line, "endings",
                                  f"expected a list of 2 to {len(hellaswag.LETTERS)} non-empty strings")
        label = record.get("label")
        if isinstance(label, str) and label.strip().isdigit():
            label = int(label)
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
            raise DataFormatError(path, line, "label", f"expected an ending index 0..{len(endings) - 1}, got {label!r}")
        activity = record.get("activity_label")
        context = hellaswag.clean(f"{activity}: {context}" if isinstance(activity, str) and activity else context)
        endings = [hellaswag.clean(ending) for ending in endings]
        rows.append(_row(hellaswag.DATA_SOURCE, hellaswag.make_prompt(context, endings), str(label), "nlp",
                         split, index, endings=endings))
    return _write(rows, Path(out_path))


def parse_hh_transcript(transcript: str) -> list[dict[str, str]]:
    """An HH-RLHF transcript ("\\n\\nHuman: ...\\n\\nAssistant: ...") as chat messages; a turn may be
    empty (some records end in "Assistant:" and nothing). ValueError if it does not start with a Human turn
    or two turns of one speaker follow each other."""
    parts = _HH_TURN.split("\n\n" + transcript.strip())  # some records drop the leading blank line
    if parts[0].strip() or len(parts) < 3:
        raise ValueError("expected a transcript starting with '\\n\\nHuman: '")
    messages = []
    for speaker, content in zip(parts[1::2], parts[2::2], strict=True):
        role = _HH_ROLES[speaker]
        if messages and messages[-1]["role"] == role:
            raise ValueError(f"two {speaker} turns in a row (turn {len(messages) + 1})")
        messages.append({"role": role, "content": content.strip()})
    if messages[0]["role"] != "user":
        raise ValueError("expected the first turn to be Human's")
    return messages


def _hh_dialogue(path: Path, line: int, record: dict, field: str) -> list[dict[str, str]]:
    transcript = _text_field(path, line, record, field)  # its DataFormatError names file, line and field already
    try:
        messages = parse_hh_transcript(transcript)
    except ValueError as error:
        raise DataFormatError(path, line, field, str(error)) from None
    if messages[-1]["role"] != "assistant":
        raise DataFormatError(path, line, field, "expected the transcript to end with an Assistant turn")
    return messages


def write_hh_rlhf(input_jsonl: str | Path, out_path: str | Path, split: str = "train") -> Path:
    """Anthropic's HH-RLHF jsonl (chosen, rejected: whole transcripts) as VeRL-schema parquet: the
    dialogue up to the final Assistant turn as a multi-turn prompt, scored by a reward model
    (style "model"); the chosen response is the ground truth, and both responses are in extra_info."""
    path = Path(input_jsonl)
    rows = []
    for index, (line, record) in enumerate(_jsonl_records(path)):
        chosen = _hh_dialogue(path, line, record, "chosen")
        rejected = _hh_dialogue(path, line, record, "rejected")
        prompt = chosen[:-1]
        if not prompt:
            raise DataFormatError(path, line, "chosen", "expected a Human turn before the final Assistant turn")
        rows.append(_row(HH_RLHF_DATA_SOURCE, prompt, chosen[-1]["content"], "alignment", split, index,
                         style="model", chosen=chosen[-1]["content"], rejected=rejected[-1]["content"]))
    return _write(rows, Path(out_path))


def _csv_records(path: Path):
    """(line number, record) for every row of a CSV file with a header line; every value a string."""
    with path.open(newline="", encoding="utf-8-sig") as file:  # (-sig: the byte-order mark spreadsheets write)
        reader = csv.DictReader(file)
        if not reader.fieldnames:
            raise DataFormatError(path, 1, "header", "expected a header line naming the columns")
        for record in reader:
            if None in record:  # more values than the header names
                raise DataFormatError(path, reader.line_num, "record", f"more values than the header's "
                                                                        f"{len(reader.fieldnames)} columns")
            yield reader.line_num, record


def _column(path: Path, line: int, record: dict, column: str) -> object:
    if column not in record:
        raise DataFormatError(path, line, column, f"no such column (the columns: {', '.join(map(str, record))})")
    return record[column]


def _prompt_of(path: Path, line: int, record: dict, column: str, instruction: str) -> str | list[dict]:
    """A user message (the column's text, plus the instruction), or a JSONL record's whole chat."""
    value = _column(path, line, record, column)
    if isinstance(value, list):
        if not value or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                and isinstance(m.get("content"), str) for m in value):
            raise DataFormatError(path, line, column, "expected text or a list of {role, content} messages")
        return value
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(path, line, column, f"expected non-empty text, got {repr(value)[:60]}")
    return f"{value} {instruction}" if instruction else value


def _answer_of(path: Path, line: int, record: dict, column: str) -> str:
    value = _column(path, line, record, column)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise DataFormatError(path, line, column, f"expected a non-empty text or number, got {repr(value)[:60]}")
    return str(value)


def write_custom(input_path: str | Path, out_path: str | Path, prompt_column: str, answer_column: str,
                 data_source: str = "", split: str = "train", instruction: str = "") -> Path:
    """A JSONL or CSV file of your own as VeRL-schema parquet: the prompt column's text as the user message
    (a JSONL value may be a whole chat), the answer column as reward_model.ground_truth, and every column
    but the prompt's in extra_info under its own name (what a custom reward function reads; a trl one gets
    each as a keyword argument). data_source defaults to the file's name without its suffix."""
    path = Path(input_path)
    if path.suffix.lower() == ".csv":
        records = _csv_records(path)
    elif path.suffix.lower() in (".jsonl", ".json"):
        records = _jsonl_records(path)
    else:
        raise ValueError(f"{path}: expected a .jsonl or .csv file")
    source = data_source or path.stem
    rows = []
    for index, (line, record) in enumerate(records):
        prompt = _prompt_of(path, line, record, prompt_column, instruction)
        answer = _answer_of(path, line, record, answer_column)
        columns = {key: value for key, value in record.items() if key not in (prompt_column, "split", "index")}
        columns[answer_column] = answer  # as text in every row, as ground_truth (a number in some rows is common)
        rows.append(_row(source, prompt, answer, "custom", split, index, **columns))
    if not rows:
        raise DataFormatError(path, 0, "records", "the file holds no records")
    try:
        return _write(rows, Path(out_path))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise ValueError(f"{path}: a column holds values of different types in different rows ({error})") from None
