"""The experiment trackers of trainer.loggers: "mlflow" and "wandb" (the optional extra `trackers`).

Each gets what the other sinks get, every step's metrics by VeRL's names, plus the run config as
parameters (flattened: actor.lr, trainer.total_steps, ...) when the run starts, and at its end
RUN_DIR/curves.png and the final model's path (RUN_DIR/final_model, not its weights: a model is GBs).

- mlflow: experiment = trainer.project_name, run name = trainer.experiment_name (else the run dir's
  name), store = trainer.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db.
  Metric names may only hold letters, digits, `_ - . : /` and spaces: "@" (val-core/.../mean@1) becomes
  "_at_", as VeRL's mlflow logger does, any other character "_". The final model's path is the tag
  rlfabric.final_model and the artifact final_model.txt.
- wandb: project = trainer.project_name, run name as above, files under RUN_DIR/wandb; mode
  trainer.wandb.mode (offline by default: `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later).
  curves.png is the artifact "curves" (type plot); the final model is the artifact "final_model" (type
  model) holding a reference to its directory, and the summary's final_model.

The packages are imported only when their logger is selected. A resumed run continues its tracker
runs: their ids are kept in RUN_DIR/trackers.json.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Protocol

from rlfabric.core.config import ConfigError, RunConfig
from rlfabric.core.errors import FailedPrecondition

log = logging.getLogger("rlfabric.coordinator")

# logger name -> the module it needs
TRACKER_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}
# mlflow's limits on one log_batch call
MLFLOW_MAX_METRICS, MLFLOW_MAX_PARAMS = 1000, 100
MLFLOW_STATUS = {"completed": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


class Tracker(Protocol):
    name: str

    def log(self, step: int, metrics: dict[str, float], timestamp: float) -> None: ...

    def finish(self, files: list[Path], final_model: Path | None, outcome: str) -> None:
        """files: the run's PNGs; outcome: completed, stopped or failed."""


def check_tracker_packages(loggers: list[str]) -> None:
    """ConfigError naming trainer.loggers when a selected tracker's package is not installed."""
    missing = [f"{name} (module {module})" for name, module in TRACKER_PACKAGES.items()
               if name in loggers and importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"trainer.loggers: {', '.join(missing)} is not installed; install the extra: "
                          "pip install 'rlfabric[trackers]'")


def open_trackers(run_dir: Path, config: RunConfig, start_step: int) -> list[Tracker]:
    """The trackers trainer.loggers selects, each with a run started (or continued, for a resumed run);
    FailedPrecondition naming the tracker and where it sends the run when one cannot start."""
    loggers = config.trainer.loggers
    check_tracker_packages(loggers)
    ids_path = run_dir / "trackers.json"
    ids = json.loads(ids_path.read_text()) if start_step and ids_path.exists() else {}
    trackers: list[Tracker] = []
    for name, start in (("mlflow", MlflowTracker), ("wandb", WandbTracker)):
        if name not in loggers:
            continue
        try:
            trackers.append(start(run_dir, config, ids.get(name)))
        except Exception as error:  # its server unreachable, its store unwritable, ...
            _end_as_failed(trackers)  # the run will not start: those opened before it end
            raise FailedPrecondition(f"trainer.loggers: the {name} tracker could not start "
                                     f"({_destination(name, run_dir, config)}): {type(error).__name__}: {error}") from None
    if trackers:
        ids_path.write_text(json.dumps({t.name: t.run_id for t in trackers}))
    return trackers


def _end_as_failed(trackers: list[Tracker]) -> None:
    for tracker in trackers:
        try:
            tracker.finish([], None, "failed")
        except Exception:
            log.exception("%s logger: finish failed", tracker.name)


def flat_config(config: RunConfig) -> dict[str, str]:
    """{"actor.lr": "1e-05", "trainer.loggers": '["jsonl", "mlflow"]', ...}: the config as tracker parameters."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
        else:
            flat[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("", config.model_dump(mode="json"))
    return flat


def mlflow_metric_name(name: str) -> str:
    """val-core/x/reward/mean@1 -> val-core/x/reward/mean_at_1 (see the module docstring)."""
    return re.sub(r"[^\w\-. :/]", "_", name.replace("@", "_at_"))


def _run_name(run_dir: Path, config: RunConfig) -> str:
    return config.trainer.experiment_name or run_dir.name


class MlflowTracker:
    name = "mlflow"

    def __init__(self, run_dir: Path, config: RunConfig, resume_id: str | None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = mlflow_tracking_uri(run_dir, config)
        self.client = MlflowClient(tracking_uri=uri)
        if resume_id:
            self.run_id = resume_id
            self.client.update_run(resume_id, status="RUNNING")
            return
        project = config.trainer.project_name
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            project, artifact_location=_local_artifact_location(uri))
        run = self.client.create_run(experiment_id, run_name=_run_name(run_dir, config),
                                     tags={"rlfabric.run_dir": str(run_dir.resolve())})
        self.run_id = run.info.run_id
        params = [Param(key, value) for key, value in flat_config(config).items()]
        for start in range(0, len(params), MLFLOW_MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[start:start + MLFLOW_MAX_PARAMS])
        log.info("mlflow run %s in experiment %s at %s", self.run_id, project, uri)

    def log(self, step: int, metrics: dict[str, float], timestamp: float) -> None:
        from mlflow.entities import Metric

        entries = [Metric(mlflow_metric_name(key), value, int(timestamp * 1000), step) for key, value in metrics.items()]
        for start in range(0, len(entries), MLFLOW_MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=entries[start:start + MLFLOW_MAX_METRICS])

    def finish(self, files: list[Path], final_model: Path | None, outcome: str) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path))
        if final_model is not None:
            self.client.set_tag(self.run_id, "rlfabric.final_model", str(final_model))
            self.client.log_text(self.run_id, f"{final_model}\n", "final_model.txt")
        self.client.set_terminated(self.run_id, status=MLFLOW_STATUS[outcome])


def mlflow_tracking_uri(run_dir: Path, config: RunConfig) -> str:
    """trainer.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db."""
    return (config.trainer.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")


def _destination(name: str, run_dir: Path, config: RunConfig) -> str:
    """Where a tracker sends the run, for its error message."""
    if name == "mlflow":
        return f"tracking store {mlflow_tracking_uri(run_dir, config)}"
    return f"mode {config.trainer.wandb.mode}, files in {run_dir / 'wandb'}"


def _local_artifact_location(uri: str) -> str | None:
    """A local sqlite store keeps its artifacts beside it (mlflow's default is ./mlruns of the working dir)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, config: RunConfig, resume_id: str | None):
        import wandb

        settings = config.trainer.wandb
        self.run = wandb.init(
            project=config.trainer.project_name, entity=settings.entity or None, name=_run_name(run_dir, config),
            dir=str(run_dir), mode=settings.mode, config=flat_config(config), id=resume_id,
            resume="allow" if resume_id else None, job_type="train",
            # Several runs may live in one coordinator process; wandb must not touch its stdout.
            reinit="create_new", settings=wandb.Settings(console="off", silent=True, save_code=False),
        )
        self.run_id = self.run.id
        log.info("wandb run %s (%s) in %s", self.run_id, settings.mode, self.run.dir)

    def log(self, step: int, metrics: dict[str, float], timestamp: float) -> None:
        self.run.log(metrics, step=step)

    def finish(self, files: list[Path], final_model: Path | None, outcome: str) -> None:
        import wandb

        for path in files:
            artifact = wandb.Artifact(path.stem, type="plot")
            artifact.add_file(str(path))
            self.run.log_artifact(artifact)
        if final_model is not None:
            artifact = wandb.Artifact("final_model", type="model", metadata={"path": str(final_model)})
            artifact.add_reference(final_model.resolve().as_uri(), checksum=False)
            self.run.log_artifact(artifact)
            self.run.summary["final_model"] = str(final_model)
        self.run.finish(exit_code=0 if outcome != "failed" else 1)
