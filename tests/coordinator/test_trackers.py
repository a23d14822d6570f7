"""The experiment trackers of trainer.loggers on a real run: the quickstart's task on the tiny model
(in-process mesh, validation at step 2 for the val-core/...@1 names) with loggers [jsonl, mlflow, wandb].
mlflow is read back from its local sqlite store with mlflow's own client; wandb ran offline and is read
back from its run file (RUN_DIR/wandb/offline-run-*/run-*.wandb), record by record."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from pathlib import Path

import pytest

from rlfabric.coordinator import trackers
from rlfabric.coordinator.run_controller import RunController
from rlfabric.coordinator.trackers import check_tracker_packages, flat_config, mlflow_metric_name
from rlfabric.coordinator.tracking import RunTracker, read_metrics
from rlfabric.core.config import ConfigError, config_from_dict, load_config
from rlfabric.core.errors import FailedPrecondition
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config, in_process, over_grpc

mlflow = pytest.importorskip("mlflow", reason="the extra `trackers` is not installed")
wandb = pytest.importorskip("wandb", reason="the extra `trackers` is not installed")


def test_mlflow_names_keep_verl_names_but_for_the_characters_mlflow_refuses():
    assert mlflow_metric_name("critic/score/mean") == "critic/score/mean"
    assert mlflow_metric_name("timing_s/update_weights") == "timing_s/update_weights"
    assert mlflow_metric_name("val-core/synthetic/reward/mean@1") == "val-core/synthetic/reward/mean_at_1"
    assert mlflow_metric_name("a(b)=c") == "a_b__c"


def test_a_missing_tracker_package_is_an_error_naming_trainer_loggers(monkeypatch):
    monkeypatch.setitem(trackers.TRACKER_PACKAGES, "mlflow", "no_such_mlflow_module")
    check_tracker_packages(["jsonl", "wandb"])  # mlflow not selected: not needed
    with pytest.raises(ConfigError, match=r"trainer.loggers: mlflow \(module no_such_mlflow_module\) is not "
                                          r"installed.*rlfabric\[trackers\]"):
        check_tracker_packages(["jsonl", "mlflow"])


def test_start_run_with_a_tracker_not_installed_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setitem(trackers.TRACKER_PACKAGES, "wandb", "no_such_wandb_module")
    # Addresses nothing listens on: the check comes before any connection.
    config = load_config(None, ["cluster.reference=[127.0.0.1:1]", "cluster.critic=[127.0.0.1:1]"])
    controller = RunController(config)
    with pytest.raises(FailedPrecondition, match=r"trainer.loggers: wandb \(module no_such_wandb_module\)"):
        asyncio.run(controller.start_run(["trainer.loggers=[jsonl,wandb]"]))
    assert controller.state == coordinator_pb2.RUN_STATE_UNSPECIFIED


def test_a_resumed_run_continues_its_mlflow_run(tmp_path):
    config = config_from_dict({"trainer": {"loggers": ["mlflow"], "plot": False, "project_name": "resume"}})
    first = RunTracker(tmp_path, config, None, total_steps=3)
    for step in (1, 2):
        first.log(step, {"critic/score/mean": float(step)})
    first.close(outcome="stopped")
    resumed = RunTracker(tmp_path, config, None, total_steps=3, start_step=2)
    resumed.log(3, {"critic/score/mean": 3.0})
    resumed.close()

    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0), (3, 3.0)]


# -- a real run with both trackers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tracked_run(tiny_model, tmp_path_factory):
    """A two-step run logging to mlflow (its default store, RUN_DIR/mlflow.db) and wandb (offline)."""
    run_dir = tmp_path_factory.mktemp("trackers") / "run"
    config = fast_config(tiny_model, "trainer.loggers=[jsonl,mlflow,wandb]", "trainer.plot=true",
                         "trainer.test_freq=2", "trainer.project_name=rlf-test", "trainer.experiment_name=tracked")

    async def scenario():
        async with in_process(config, run_dir) as client:
            await client.start_run()
            async for _ in client.stream_metrics(from_step=1):
                pass
            return await client.run_status()

    status = asyncio.run(scenario())
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    # The run dir of an experiment_name'd run is RUN_DIR/experiments/<name>.
    (experiment_dir,) = {path.parent for path in run_dir.rglob("metrics.jsonl")}
    return config, experiment_dir, read_metrics(experiment_dir / "metrics.jsonl")


@pytest.mark.slow  # a training run into mlflow
def test_mlflow_has_the_metrics_by_step_the_config_and_the_artifacts(tracked_run):
    config, run_dir, records = tracked_run
    client = mlflow.tracking.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rlf-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"

    # Every metric of metrics.jsonl, by its (mapped) VeRL name, at its step, with its value.
    for record in records:
        for key, value in record.items():
            if key in ("step", "timestamp") or value is None:
                continue
            history = client.get_metric_history(run.info.run_id, mlflow_metric_name(key))
            assert (record["step"], pytest.approx(value)) in [(m.step, m.value) for m in history], key
    assert [r["step"] for r in records] == [1, 2]
    assert any(k.startswith("val-core/") and "@" in k for k in records[-1])  # a name mlflow had to map
    assert "actor/pg_loss" in run.data.metrics and "timing_s/step" in run.data.metrics

    # The config as parameters, flattened.
    params = run.data.params
    assert params["actor.lr"] == str(config.actor.lr) and params["trainer.total_steps"] == "2"
    assert params == flat_config(config)

    # curves.png and the final model's path.
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"curves.png", "final_model.txt"}
    local = Path(client.download_artifacts(run.info.run_id, "curves.png", str(run_dir / "downloaded")))
    assert local.read_bytes() == (run_dir / "curves.png").read_bytes()
    final_model = run_dir / "final_model"
    assert (final_model / "config.json").exists()
    assert run.data.tags["rlfabric.final_model"] == str(final_model)
    text = Path(client.download_artifacts(run.info.run_id, "final_model.txt", str(run_dir / "downloaded")))
    assert text.read_text().strip() == str(final_model)


def wandb_records(run_file: Path) -> list:
    """The records of a wandb run file: LevelDB's log format (32 KiB blocks of chunks, each with a 7-byte
    header: crc32, length, type full/first/middle/last) after a 7-byte ":W&B" file header, each record a
    wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, position, parts, records = 32768, 7, [], []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        parts.append(data[position + 7:position + 7 + length])
        position += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
        elif kind == 0:  # zero padding at the end of the file
            break
    return records


@pytest.mark.slow  # the training run mlflow's test shares
def test_wandb_offline_run_has_the_metrics_the_config_and_the_artifacts(tracked_run):
    config, run_dir, records = tracked_run
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    by_kind: dict[str, list] = {}
    for record in wandb_records(run_file):
        by_kind.setdefault(record.WhichOneof("record_type"), []).append(record)

    (run,) = by_kind["run"]
    assert (run.run.project, run.run.display_name) == ("rlf-test", "tracked")
    logged_config = {item.key: json.loads(item.value_json) for item in run.run.config.update}
    expected = flat_config(config)
    assert {key: logged_config[key] for key in expected} == expected

    history = {}
    for record in by_kind["history"]:
        # wandb files a name as `key`, or as `nested_key` (one element, here) when it is not an identifier
        items = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        history[items["_step"]] = items
    assert sorted(history) == [1, 2]
    for record in records:
        logged = history[record["step"]]
        for key, value in record.items():
            if key not in ("step", "timestamp") and value is not None:
                assert logged[key] == pytest.approx(value), key  # VeRL's names as they are, "@" included

    artifacts = {r.artifact.name: r.artifact for r in by_kind["artifact"]}
    assert artifacts["curves"].type == "plot"
    assert [entry.path for entry in artifacts["curves"].manifest.contents] == ["curves.png"]
    model = artifacts["final_model"]
    assert model.type == "model"
    # A reference to the model's files, not a copy of them.
    files = {path.resolve().as_uri() for path in (run_dir / "final_model").rglob("*") if path.is_file()}
    assert "config.json" in {Path(uri).name for uri in files}
    assert {entry.ref for entry in model.manifest.contents} == files
    summary = {item.key: item.value_json for r in by_kind["summary"] for item in r.summary.update if item.key}
    assert json.loads(summary["final_model"]) == str(run_dir / "final_model")
    assert by_kind["exit"][0].exit.exit_code == 0


def test_a_tracker_that_cannot_start_fails_start_run_naming_it(tiny_model, tmp_path, monkeypatch):
    """The mesh's mlflow store is an address nothing answers at. StartRun answered INTERNAL; it is
    FAILED_PRECONDITION naming the tracker and its store, no run starts, and the mesh takes the next run."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once, not after mlflow's backoff
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        store = f"http://127.0.0.1:{unused.getsockname()[1]}"
    config = fast_config(tiny_model, "trainer.loggers=[jsonl,mlflow]", f"trainer.mlflow.tracking_uri={store}",
                         "trainer.total_steps=1")

    async def scenario():
        async with over_grpc(config, tmp_path / "run") as client:
            with pytest.raises(FailedPrecondition, match=rf"trainer.loggers: the mlflow tracker could not start "
                                                         rf"\(tracking store {store}\): MlflowException"):
                await client.start_run()
            assert (await client.run_status()).state == coordinator_pb2.RUN_STATE_UNSPECIFIED
            await client.start_run(["trainer.loggers=[jsonl]"])
            async for _ in client.stream_metrics(from_step=1):
                pass
            return await client.run_status()

    status = asyncio.run(scenario())
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
