"""The Python API (rlfabric.api): `rlfabric.train` runs the quickstart in process to a result, as issue 45 asks;
`rlfabric.connect` refuses a folder that is no running mesh's. (connect against a live mesh:
tests/deploy/test_prometheus_scrape.py, which has one.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import pytest

import rlfabric
from rlfabric.core.config import ConfigError, load_run_config
from tests.coordinator.meshes import FAST

# Issue 45's target, as written, then the result's other fields for the test to check.
TRAIN_SCRIPT = textwrap.dedent("""
    import rlfabric; r = rlfabric.train(overrides=['trainer.total_steps=2'], launcher='in-process'); assert r.state == 'COMPLETED' and r.final_model.is_dir()
    import json
    print("RESULT " + json.dumps({"final_step": r.final_step, "total_steps": r.total_steps, "run_id": r.run_id,
                                  "run_dir": str(r.run_dir), "final_model": str(r.final_model),
                                  "last_metrics": r.last_metrics, "metrics": r.metrics()}))
""")


@pytest.mark.slow  # a training run
def test_train_in_process_returns_the_runs_result(tmp_path):
    # Runs go to runs/<name>-<timestamp> under the current directory: here, tmp_path.
    done = subprocess.run([sys.executable, "-c", TRAIN_SCRIPT], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    run_dir = tmp_path / "runs" / result["run_id"]
    assert result["run_dir"] == str(run_dir.resolve())
    assert (result["final_step"], result["total_steps"]) == (2, 2)
    assert result["final_model"] == str(run_dir.resolve() / "final_model")
    assert (run_dir / "final_model" / "config.json").is_file()
    assert [record["step"] for record in result["metrics"]] == [1, 2]
    last = result["metrics"][-1]
    assert result["last_metrics"]["critic/score/mean"] == pytest.approx(last["critic/score/mean"])
    assert "2/2" in done.stderr  # the CLI's progress bar (rlfabric.coordinator.watch), drawn to the end


def test_import_rlfabric_loads_no_heavy_module():
    code = "import sys, rlfabric; print(sorted(m for m in ('torch', 'grpc', 'transformers', 'rlfabric.cli') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


def test_train_refuses_an_unknown_launcher_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="launcher 'docker': choose one of local, ray, in-process"):
        rlfabric.train(overrides=["trainer.total_steps=2"], launcher="docker", run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_config_given_as_a_dict_is_what_a_file_holds(tmp_path):
    tree = {"trainer": {"total_steps": 7}, "rollout": {"n": 4}}
    config = load_run_config(tree, ["trainer.total_steps=3"])
    assert (config.trainer.total_steps, config.rollout.n) == (3, 4)
    assert tree["trainer"]["total_steps"] == 7  # the caller's dict is left as it was
    with pytest.raises(ConfigError, match="trainer.total_stepz"):
        load_run_config({"trainer": {"total_stepz": 3}})


def test_connect_to_a_folder_without_a_mesh_says_so(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path} is not a running mesh's folder: it has no endpoints.json"):
        rlfabric.connect(tmp_path)


def test_train_from_a_running_event_loop_as_in_a_notebook(tiny_model, tmp_path):
    """Jupyter runs cells inside an event loop, where the launchers' own asyncio.run would fail: the run goes to
    a thread of its own."""
    async def cell() -> rlfabric.TrainResult:
        return rlfabric.train(overrides=[f"model.path={tiny_model}", *FAST], launcher="in-process",
                              run_dir=tmp_path / "run")

    result = asyncio.run(cell())
    assert (result.state, result.final_step, result.run_dir) == ("COMPLETED", 2, (tmp_path / "run").resolve())
    assert [record["step"] for record in result.metrics()] == [1, 2]
