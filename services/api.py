"""The Python API: `rlfabric.train(...)` runs training as `rlfabric train` does (the same function,
rlfabric.cli.train.train_run) and returns what the run left; `rlfabric.connect(run_dir)` gives typed clients
of a running mesh.

    import rlfabric

    result = rlfabric.train("my_run.yaml", overrides=["trainer.total_steps=20"])
    result.state, result.final_step, result.final_model    # "COMPLETED", 20, runs/<name>-<time>/final_model
    result.metrics()[-1]["critic/score/mean"]              # metrics.jsonl, a dict per step

Everything heavy (torch, gRPC, the engines) is imported inside the functions, so `import rlfabric` stays cheap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlfabric.launch.mesh_clients import MeshClients


@dataclass
class TrainResult:
    """What a training run left when it ended."""

    state: str
    """How it ended: COMPLETED, STOPPED (stopped before trainer.total_steps) or FAILED (see `error`)."""
    final_step: int
    """The last step that finished."""
    total_steps: int
    """trainer.total_steps of the run."""
    run_id: str
    """The run's id, as in its logs and trackers."""
    run_dir: Path
    """The run's folder: metrics.jsonl, checkpoints/, tensorboard/, logs/, final_model/."""
    final_model: Path | None
    """The trained policy as a Hugging Face model directory (run_dir/final_model); None when none was exported."""
    last_metrics: dict[str, float] = field(default_factory=dict)
    """The metrics of the last finished step (VeRL names: critic/score/mean, actor/pg_loss, ...)."""
    error: str = ""
    """Why the run failed; empty otherwise."""

    @property
    def metrics_path(self) -> Path:
        """run_dir/metrics.jsonl: one JSON object per step."""
        return self.run_dir / "metrics.jsonl"

    def metrics(self) -> list[dict[str, Any]]:
        """Every step's metrics from metrics.jsonl, in step order."""
        from rlfabric.coordinator.tracking import read_metrics

        return read_metrics(self.metrics_path)


def train(config: str | Path | Mapping[str, Any] | None = None, overrides: Sequence[str] = (),
          launcher: str = "local", run_dir: str | Path | None = None) -> TrainResult:
    """Runs one training run to its end, as `rlfabric train CONFIG OVERRIDES` does, with its progress bar.

    config: a YAML file, a dict holding what such a file holds, or None for the built-in quickstart.
    overrides: dotted `key=value` strings applied on top (`trainer.total_steps=20`).
    launcher: "local" (a process per service on this machine), "in-process" (every role in this process:
        breakpoints work anywhere) or "ray" (a Ray actor per service, on the cluster at RAY_ADDRESS or a new one).
    run_dir: the run's folder; default runs/<name>-<timestamp> under the current directory.

    A bad config raises rlfabric.core.config.ConfigError naming the key before anything starts; a run the
    coordinator refuses raises rlfabric.cli.train.RunRefused. A run that fails returns state FAILED with its
    error. Ctrl-C stops the run (with a checkpoint on a mesh) and raises KeyboardInterrupt. Called where an
    event loop runs (a Jupyter notebook), the run goes in a thread of its own; interrupting the wait leaves
    it running (stop it through connect(run_dir)).
    """
    from rlfabric.cli.train import train_run
    from rlfabric.core.config import load_run_config
    from rlfabric.launch.local import default_run_dir
    from rlfabric.v1 import coordinator_pb2

    run_config = load_run_config(config, list(overrides))
    folder = Path(run_dir) if run_dir is not None else default_run_dir(run_config)
    if _event_loop_running():  # a notebook's: the run's own event loops go to a thread of their own
        pool = ThreadPoolExecutor(1, thread_name_prefix="rlfabric-train")
        try:
            finished = pool.submit(train_run, run_config, folder, launcher).result()
        finally:
            pool.shutdown(wait=False)  # an interrupted wait returns at once; stop the run with connect(run_dir)
    else:
        finished = train_run(run_config, folder, launcher)
    status = finished.status
    final_model = finished.run_dir / "final_model"
    return TrainResult(
        state=coordinator_pb2.RunState.Name(status.state).removeprefix("RUN_STATE_"),
        final_step=status.step,
        total_steps=status.total_steps,
        run_id=status.run_id,
        run_dir=finished.run_dir,
        final_model=final_model if final_model.is_dir() else None,
        last_metrics=dict(status.last_metrics),
        error=status.error,
    )


def _event_loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def connect(run_dir: str | Path) -> MeshClients:
    """Typed gRPC clients of the running mesh whose folder is run_dir (`rlfabric up`, or a `rlfabric.train`
    in progress), with its token and TLS settings:

        async with rlfabric.connect("runs/quickstart-20261202-101500") as mesh:
            status = await mesh.coordinator.run_status()
            await mesh.coordinator.stop_run()

    ConfigError when run_dir holds no running mesh's endpoints.json.
    """
    from rlfabric.launch.mesh_clients import connect_to_run

    return connect_to_run(Path(run_dir))
