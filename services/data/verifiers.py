"""A verifiers 0.4 task set as rows in VeRL's schema (data.builtin_task verifiers; docs/verifiers.md).

verifiers pins openai < 3 and cannot sit beside rlfabric's dev install, so the task set is read by the
interpreter of a venv of its own (data.verifiers.python) running verifiers_rows.py, which prints each task's
opening messages. A row:

    data_source   verifiers/<taskset>
    prompt        the task's system prompt and prompt, as verifiers' chat harness sends them
    ability       verifiers
    reward_model  {style: rule, ground_truth: '{"taskset", "index"}'}
    extra_info    {split, index, taskset}

The ground truth names the task, not its answer: the episode's agent (examples/agents/verifiers/agent.py) loads
the task set's Task by index, and verifiers plays and scores it. No field of the task beyond its messages is in
the row, so none reaches agent code through rlfabric.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlfabric.core.config import ConfigError
from rlfabric.core.config.model import VerifiersConfig

DATA_SOURCE_PREFIX = "verifiers/"
ABILITY = "verifiers"
ROWS_SCRIPT = Path(__file__).with_name("verifiers_rows.py")
READ_TIMEOUT_S = 300  # importing verifiers alone takes ~6 s of CPU here; a task set may build its data


def read_tasks(config: VerifiersConfig) -> list[dict]:
    """The task set's tasks as {index, messages}, through data.verifiers.python; ConfigError naming the key
    when that interpreter or the task set cannot be loaded."""
    stop = config.size + config.val_size if config.size else 0
    # -P: the script's folder (this package, whose verifiers.py is not the library) stays off sys.path
    command = [config.python, "-P", str(ROWS_SCRIPT), config.taskset, "0", str(stop), *config.path]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=READ_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ConfigError(f"data.verifiers.python {config.python!r}: {error}") from None
    if done.returncode != 0:
        raise ConfigError(
            f"data.verifiers: reading task set {config.taskset!r} with {config.python} failed: "
            f"{done.stderr.strip()[-1500:]}"
        )
    tasks = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    if len(tasks) <= config.val_size or (config.size and len(tasks) < stop):
        raise ConfigError(
            f"data.verifiers: task set {config.taskset!r} has {len(tasks)} tasks, fewer than "
            f"data.verifiers.size {config.size} + val_size {config.val_size} (+1 when size is 0)"
        )
    return tasks


def task_row(task: dict, taskset: str, split: str) -> dict:
    """One task as a VeRL-schema row (see the module docstring)."""
    return {
        "data_source": DATA_SOURCE_PREFIX + taskset,
        "prompt": task["messages"],
        "ability": ABILITY,
        "reward_model": {
            "style": "rule",
            "ground_truth": json.dumps({"taskset": taskset, "index": task["index"]}),
        },
        "extra_info": {"split": split, "index": task["index"], "taskset": taskset},
    }


def write_verifiers(out_dir: str | Path, config: VerifiersConfig) -> dict[str, Path]:
    """train.parquet (and val.parquet when val_size > 0) in out_dir; their paths by split."""
    tasks = read_tasks(config)
    cut = config.size or len(tasks) - config.val_size
    splits = {"train": tasks[:cut], "val": tasks[cut : cut + config.val_size]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, chosen in splits.items():
        if chosen:
            paths[split] = out / f"{split}.parquet"
            pq.write_table(
                pa.Table.from_pylist([task_row(task, config.taskset, split) for task in chosen]), paths[split]
            )
    return paths
