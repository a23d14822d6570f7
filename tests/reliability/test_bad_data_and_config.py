"""Bad training data and bad config values fail early with a message naming where the problem is.

Data (tests/coordinator/test_dataset.py has the basic schema cases; these add the rest): malformed
parquet files, missing columns and wrongly typed values through RLHFDataset and through a real
coordinator's StartRun -> DatasetError / INVALID_ARGUMENT naming the file, the row and the column.

Config: bad values through the real CLI (`rlfabric up bad.yaml`, `rlfabric train actor.lr=-1`,
`rlfabric serve ...`) -> a non-zero exit with a message naming the key, and no service started.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfabric.core.config import config_from_dict
from rlfabric.data.dataset import REQUIRED_COLUMNS, DatasetError, RLHFDataset
from rlfabric.quickstart.tiny_model import build_tokenizer
from rlfabric.serve import build_service as build_role_service
from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc

pytestmark = pytest.mark.slow

GOOD = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
        "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 0}}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write_rows(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def load(path: Path, tokenizer) -> RLHFDataset:
    return RLHFDataset([path], tokenizer, max_prompt_length=256)


# --- files that are not (whole) parquet files --------------------------------------------------------


def test_unreadable_files_name_the_file(tmp_path, tokenizer):
    whole = write_rows(tmp_path / "whole.parquet", [GOOD] * 20)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    folder = tmp_path / "folder.parquet"
    folder.mkdir()
    for path in (cut, empty, folder):
        with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}: "):
            load(path, tokenizer)
    with pytest.raises(DatasetError, match="no data files given"):
        RLHFDataset([], tokenizer, max_prompt_length=256)


# --- schema problems: file, row and column named ------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_row", "column"),
    [
        ({**GOOD, "prompt": "1+1?"}, "prompt"),  # a plain string, not chat messages
        ({**GOOD, "prompt": ["1+1?"]}, "prompt"),  # a list of strings
        ({**GOOD, "prompt": [{"role": "user", "content": 7}]}, "prompt"),  # content of the wrong type
        ({**GOOD, "prompt": [{"role": "user"}]}, "prompt"),  # no content
        ({**GOOD, "data_source": 7}, "data_source"),
        ({**GOOD, "reward_model": "2"}, "reward_model"),  # not a struct
        # no ground_truth: next to rows that have one, parquet stores it as null
        ({**GOOD, "reward_model": {"style": "rule"}}, "reward_model"),
        ({**GOOD, "extra_info": 3}, "extra_info"),
        ({**GOOD, "extra_info": "not json"}, "extra_info"),
    ],
)
def test_wrong_types_name_file_row_and_column(tmp_path, tokenizer, bad_row, column):
    # Each column holds one type in a parquet file, so the bad value is the only row of its own file
    # (row 0) or, where the type matches the good rows', row 2 of three.
    path = tmp_path / "bad.parquet"
    try:
        write_rows(path, [GOOD, GOOD, bad_row])
        row = 2
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        write_rows(path, [bad_row])
        row = 0
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}: row {row}, column '{column}': "):
        load(path, tokenizer)


def test_missing_prompt_column_is_named(tmp_path, tokenizer):
    path = write_rows(tmp_path / "noprompt.parquet", [{k: v for k, v in GOOD.items() if k != "prompt"}])
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}: missing column\(s\) \['prompt'\]"):
        load(path, tokenizer)


def test_the_second_file_is_named_when_it_is_the_bad_one(tmp_path, tokenizer):
    good = write_rows(tmp_path / "good.parquet", [GOOD] * 3)
    bad = write_rows(tmp_path / "bad.parquet", [GOOD, {**GOOD, "data_source": ""}])
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(bad))}: row 1, column 'data_source'"):
        RLHFDataset([good, bad], tokenizer, max_prompt_length=256)


# Any column of any of a few arrow types: the loader accepts the rows or names the file, row and column.
values_of_a_type = {
    "string": st.text(max_size=8),
    "int": st.integers(-5, 5),
    "float": st.floats(allow_nan=True),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=8)}),
                         max_size=2),
    "strings": st.lists(st.text(max_size=4), max_size=2),
    "truth": st.fixed_dictionaries({"ground_truth": st.text(max_size=4)}),
    "style": st.fixed_dictionaries({"style": st.text(max_size=4)}),
    "none": st.none(),
}


@st.composite
def tables(draw):
    """1-3 rows; each column (the required ones, possibly missing, plus optional ones) has one type."""
    columns = [c for c in (*REQUIRED_COLUMNS, "extra_info", "ability") if draw(st.booleans()) or c in REQUIRED_COLUMNS[:1]]
    kinds = {c: draw(st.sampled_from(sorted(values_of_a_type))) for c in columns}
    rows = draw(st.integers(1, 3))
    return [{c: draw(values_of_a_type[kinds[c]]) for c in columns} for _ in range(rows)]


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=tables())
def test_arbitrary_tables_load_or_name_the_problem(tmp_path, tokenizer, rows):
    path = tmp_path / "fuzz.parquet"
    try:
        write_rows(path, rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return  # not a table pyarrow can write; nothing to load
    try:
        data = load(path, tokenizer)
    except DatasetError as error:
        message = str(error)
        assert message.startswith(f"{path}: "), message
        assert re.search(r": (row \d+, column '\w+': |missing column\(s\) |no usable rows)", message) or \
            message.startswith(f"no usable rows in ['{path}']"), message
        return
    assert 1 <= len(data) <= len(rows)
    for row in data.rows:
        assert row.data_source and row.prompt_ids and isinstance(row.ground_truth, str)


def test_start_run_with_bad_data_is_invalid_argument_naming_file_row_and_column(serve_in_thread, tiny_model, tmp_path):
    bad = write_rows(tmp_path / "bad.parquet", [GOOD, {**GOOD, "prompt": [{"role": "user"}]}])  # no content
    good = write_rows(tmp_path / "good.parquet", [GOOD] * 8)
    config = config_from_dict({"model": {"path": str(tiny_model)}, "rollout": {"n": 2},
                               "trainer": {"run_dir": str(tmp_path / "run")}})
    server = serve_in_thread(build_role_service("coordinator", config))
    with grpc.insecure_channel(server.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            request = coordinator_pb2.CoordinatorServiceStartRunRequest(overrides=[f"data.train_files=[{bad}]"])
            stub.StartRun(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{bad}: row 1, column 'prompt'" in refused.value.details()
        # Good data gets past loading; the run then stops at the missing services, before any step.
        with pytest.raises(grpc.RpcError) as no_services:
            stub.StartRun(coordinator_pb2.CoordinatorServiceStartRunRequest(
                overrides=[f"data.train_files=[{good}]", "data.train_batch_size=8"]), timeout=60)
        assert no_services.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "cluster.actor" in no_services.value.details()


# --- bad config values through the CLI ------------------------------------------------------------------


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfabric", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (a service started for the run would)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


BAD_FILES = {
    "negative lr": ("actor:\n  lr: -1\n", "actor.lr: Input should be greater than 0"),
    "unknown key": ("rollout:\n  temprature: 0.7\n", "rollout.temprature: unknown key"),
    "wrong type": ("trainer:\n  total_steps: many\n", "trainer.total_steps: Input should be a valid integer"),
    "zero message size": ("server:\n  max_receive_message_mb: 0\n", "server.max_receive_message_mb"),
    "not yaml": ("actor: [unclosed\n", "is not valid YAML"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_up_with_a_bad_config_file_names_the_key_and_starts_nothing(tmp_path, case):
    text, message = BAD_FILES[case]
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    run_dir = tmp_path / "run"
    result = run_cli("up", str(config), "--run-dir", str(run_dir), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not run_dir.exists()  # no ports, logs or model were made
    assert processes_mentioning(str(run_dir)) == []


BAD_OVERRIDES = {
    "actor.lr=-1": "actor.lr: Input should be greater than 0",
    "actor.lr=[": "actor.lr is not valid YAML",
    "rollout.engine=tgi": "rollout.engine: Input should be 'hf', 'vllm', 'sglang' or 'sim'",
    "trainer.total_steps=0": "trainer.total_steps: Input should be greater than or equal to 1",
    "reward.timeout_s=-.inf": "reward.timeout_s: Input should be greater than 0",
    "rollout.top_p=.nan": "rollout.top_p",
    "trainer.mode=turbo": "trainer.mode: Input should be 'sync' or 'async'",
    "algorithm.gamma.x=1": "algorithm.gamma",
    "rollout.n=1": "algorithm.adv_estimator=grpo compares samples of a prompt: set rollout.n >= 2",  # across keys
}


@pytest.mark.parametrize("override", BAD_OVERRIDES)
def test_train_with_a_bad_override_names_the_key_and_starts_nothing(tmp_path, override):
    run_dir = tmp_path / "run"
    result = run_cli("train", override, "--run-dir", str(run_dir), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert BAD_OVERRIDES[override] in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not run_dir.exists()
    assert processes_mentioning(str(run_dir)) == []


def test_a_config_error_is_said_before_torch_loads(tmp_path):
    # The CLI checks the config before it imports torch (seconds on a small machine): a typo costs no wait.
    probe = ("import runpy, sys\nsys.argv = ['rlfabric', 'train', 'rollout.n=1']\n"
             "try:\n    runpy.run_module('rlfabric', run_name='__main__')\n"
             "except SystemExit as stop:\n    print('exit', stop.code, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["exit", "2", "False"], done.stdout + done.stderr


def test_up_with_a_missing_config_file(tmp_path):
    result = run_cli("up", str(tmp_path / "nope.yaml"), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and "nope.yaml does not exist" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("server.auth_token_file={missing}", "server.auth_token_file: cannot read"),
        ("server.auth_token_file={empty}", "server.auth_token_file: {empty} is empty"),
        ("server.tls.cert_file={missing}", "server.tls.cert_file: cannot read"),
        ("server.tls.cert_file={empty}", "server.tls.key_file is empty"),
    ],
)
def test_serve_with_an_unreadable_secret_file_names_the_key(tmp_path, override, message):
    # A service refuses to start (exit 2, no port file) rather than serve without the auth or TLS the
    # config asks for; an empty token file would otherwise silently turn authentication off.
    files = {"missing": tmp_path / "missing", "empty": tmp_path / "empty-token"}
    files["empty"].write_text("\n")
    port_file = tmp_path / "ports.json"
    result = run_cli("serve", "reward", "--port", "0", "--metrics-port", "0", "--port-file", str(port_file),
                     override.format(**files), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message.format(**files) in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not port_file.exists()
