"""Where a run's metrics go.

    tracker = RunTracker(run_dir, config, server_registry, total_steps=20, start_step=0)
    tracker.log(step, metrics, trace_id)  # after every step; VeRL names ("critic/score/mean", "timing_s/gen", ...)
    tracker.close(final_model)            # -> RUN_DIR/curves.png when trainer.plot

Sinks (trainer.loggers): "console" (one compact log line per step), "jsonl" (RUN_DIR/metrics.jsonl),
"tensorboard" (RUN_DIR/tensorboard), the experiment trackers "mlflow" and "wandb" (rlfabric.coordinator.
trackers); Prometheus gauges, and the step-time histogram whose exemplars carry each step's trace id,
whenever a registry is given.

This module runs in the coordinator; the progress bar the user sees is drawn on the client side
(rlfabric.coordinator.watch).
"""

from __future__ import annotations

import json
import logging
import math
import time
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TextIO

from prometheus_client import CollectorRegistry

from rlfabric.coordinator.trackers import Tracker, open_trackers
from rlfabric.core.config import RunConfig
from rlfabric.core.logs import log_event
from rlfabric.core.metrics import service_gauge, service_histogram

log = logging.getLogger("rlfabric.coordinator")

# The few metrics of the per-step console line (the rest are in metrics.jsonl and TensorBoard).
CONSOLE_KEYS = (
    "critic/score/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/entropy",
    "response_length/mean",
    "timing_s/step",
)
# KL between the actor and the reference policy: the KL loss, or the KL in the reward (VeRL's
# current and older name). The first one a step reports is what the dashboard's KL panel shows.
REFERENCE_KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty", "critic/kl")
# Gauges of the Grafana dashboard (helm/rlfabric/dashboards/rlfabric.json) <- the step metric they show.
DASHBOARD_GAUGES = {
    "rlfabric_coordinator_score_mean": ("Mean sequence score of the last step.", ("critic/score/mean",)),
    "rlfabric_coordinator_kl": ("KL between the actor and the reference policy, last step.", REFERENCE_KL_KEYS),
    "rlfabric_coordinator_response_length_mean": ("Mean response length of the last step, in tokens.",
                                                  ("response_length/mean",)),
    "rlfabric_coordinator_weight_version": ("Weight version the coordinator last synced to the rollout.",
                                            ("rollout/weight_version",)),
    "rlfabric_coordinator_staleness": ("Most weight versions a sample of the last step lagged the actor.",
                                       ("rollout/staleness/max",)),
}
# Buckets of the step-time histogram: a tiny model's sub-second steps to an hour.
STEP_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
# Curves of RUN_DIR/curves.png: (panel title, keys); validation scores join the reward panel.
PLOT_PANELS = (
    ("reward (critic/score/mean)", ("critic/score/mean",)),
    ("KL", ("actor/ppo_kl", *REFERENCE_KL_KEYS)),
    ("response length (mean)", ("response_length/mean",)),
)


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, in file order; a torn last line (a crash mid-write) is skipped."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _finite_or_none(value: float) -> float | None:
    # metrics.jsonl stays strict JSON: NaN and infinities become null.
    return value if math.isfinite(value) else None


class _PrometheusGauges:
    """The coordinator's gauges; created once per registry (a coordinator may run several runs)."""

    _by_registry: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, registry: CollectorRegistry):
        self.step = service_gauge(registry, "rlfabric_coordinator_step", "Last finished step of the run.")
        self.total_steps = service_gauge(registry, "rlfabric_coordinator_total_steps", "Steps the run will take.")
        self.phase_seconds = service_gauge(
            registry, "rlfabric_coordinator_phase_seconds", "Wall time of each phase of the last step (timing_s/*).",
            ("phase",),
        )
        self.metric = service_gauge(
            registry, "rlfabric_coordinator_metric", "Every metric of the last step, by its VeRL name.", ("name",)
        )
        self.dashboard = {name: service_gauge(registry, name, doc) for name, (doc, _) in DASHBOARD_GAUGES.items()}
        # The dashboard links a step's point to its trace through this histogram's exemplars (OpenMetrics).
        self.step_seconds = service_histogram(
            registry, "rlfabric_coordinator_step_seconds",
            "Wall time of each training step (timing_s/step); an exemplar carries the step's trace_id.",
            buckets=STEP_SECONDS_BUCKETS,
        )

    @classmethod
    def of(cls, registry: CollectorRegistry) -> _PrometheusGauges:
        if registry not in cls._by_registry:
            cls._by_registry[registry] = cls(registry)
        return cls._by_registry[registry]

    def start_run(self, total_steps: int, start_step: int) -> None:
        self.total_steps.set(total_steps)
        self.step.set(start_step)
        self.phase_seconds.clear()  # no label values left over from a previous run
        self.metric.clear()

    def log(self, step: int, metrics: dict[str, float], trace_id: str = "") -> None:
        self.step.set(step)
        if "timing_s/step" in metrics:
            self.step_seconds.observe(metrics["timing_s/step"], exemplar={"trace_id": trace_id} if trace_id else None)
        for key, value in metrics.items():
            self.metric.labels(name=key).set(value)
            if key.startswith("timing_s/"):
                self.phase_seconds.labels(phase=key.removeprefix("timing_s/")).set(value)
        for name, (_, keys) in DASHBOARD_GAUGES.items():
            present = [metrics[k] for k in keys if k in metrics]
            if present:
                self.dashboard[name].set(present[0])


class RunTracker:
    """Sends each step's metrics to the sinks in trainer.loggers (and to Prometheus)."""

    def __init__(
        self,
        run_dir: Path,
        config: RunConfig,
        registry: CollectorRegistry | None,
        total_steps: int,
        start_step: int = 0,
    ):
        trainer = config.trainer
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.plot = trainer.plot
        self.title = f"{trainer.project_name} / {trainer.experiment_name or self.run_dir.name}"
        self.console = "console" in trainer.loggers
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.history: list[dict] = []  # this process's steps: what the plot uses without metrics.jsonl
        self._closed = False

        self._jsonl: TextIO | None = None
        if "jsonl" in trainer.loggers:
            self._drop_steps_after(start_step)
            self._jsonl = self.jsonl_path.open("a")

        self._tensorboard = None
        if "tensorboard" in trainer.loggers:
            from torch.utils.tensorboard import SummaryWriter  # torch is slow to import: only when used

            # purge_step hides the events of steps a resumed run is about to take again.
            self._tensorboard = SummaryWriter(
                str(self.run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None
            )

        try:
            self._trackers = open_trackers(self.run_dir, config, start_step)
        except BaseException:  # a tracker that cannot start: the run does not start, nothing stays open
            self._closed = True
            for sink in (self._jsonl, self._tensorboard):
                if sink is not None:
                    sink.close()
            raise
        self._gauges = _PrometheusGauges.of(registry) if registry is not None else None
        if self._gauges:
            self._gauges.start_run(total_steps, start_step)
        if self.console:
            log_event(log, f"run {self.title}: steps {start_step + 1}..{total_steps}",
                      start_step=start_step, total_steps=total_steps, run_dir=str(self.run_dir))

    def _drop_steps_after(self, start_step: int) -> None:
        """A resumed run continues metrics.jsonl: steps after the checkpoint are about to be redone."""
        if not self.jsonl_path.exists():
            return
        kept = [r for r in read_metrics(self.jsonl_path) if r.get("step", 0) <= start_step]
        tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.jsonl_path)

    def log(self, step: int, metrics: dict[str, float], trace_id: str = "") -> None:
        """One finished step's metrics to every enabled sink; trace_id: the step's trace, if traced."""
        metrics = {key: float(value) for key, value in metrics.items()}
        record = {"step": step, "timestamp": time.time(), **metrics}
        self.history.append(record)
        if self.console:
            log_event(log, self.console_line(step, metrics), step=step)
        if self._jsonl:
            strict = {key: _finite_or_none(v) if isinstance(v, float) else v for key, v in record.items()}
            self._jsonl.write(json.dumps(strict, allow_nan=False) + "\n")
            self._jsonl.flush()
        if self._tensorboard:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        for tracker in self._trackers:
            _guarded(tracker, "log", partial(tracker.log, step, metrics, record["timestamp"]))
        if self._gauges:
            self._gauges.log(step, metrics, trace_id)

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        """"step 3/20 critic/score/mean=0.412 actor/pg_loss=-0.0131 ..." (CONSOLE_KEYS and validation)."""
        keys = [k for k in CONSOLE_KEYS if k in metrics] + sorted(k for k in metrics if k.startswith("val-core/"))
        return " ".join([f"step {step}/{self.total_steps}", *(f"{k}={metrics[k]:.4g}" for k in keys)])

    def close(self, final_model: Path | None = None, outcome: str = "completed") -> Path | None:
        """Flushes and closes the sinks; writes RUN_DIR/curves.png when trainer.plot (returns its path).
        The trackers get the PNG, the final model's directory (when it exists) and the run's outcome
        (completed, stopped or failed)."""
        if self._closed:
            return None
        self._closed = True
        if self._jsonl:
            self._jsonl.close()
        if self._tensorboard:
            self._tensorboard.close()
        records = self.run_records()
        png = plot_curves(records, self.run_dir / "curves.png", self.title) if self.plot and records else None
        final_model = final_model if final_model is not None and final_model.exists() else None
        for tracker in self._trackers:
            _guarded(tracker, "finish", partial(tracker.finish, [png] if png else [], final_model, outcome))
        return png

    def run_records(self) -> list[dict]:
        """Every step of the run so far: from metrics.jsonl when enabled (so a resumed run's earlier
        steps are included), else the steps logged by this process."""
        return read_metrics(self.jsonl_path) if self._jsonl is not None else list(self.history)


def _guarded(tracker: Tracker, what: str, call: Callable[[], None]) -> None:
    """A tracker's server failing mid-run costs its records, not the run: logged, and the run goes on."""
    try:
        call()
    except Exception:
        log.exception("%s logger: %s failed", tracker.name, what)


def plot_curves(records: list[dict], path: Path, title: str = "") -> Path:
    """Reward, KL and response length against step, one panel each, as a PNG."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg
    from matplotlib.ticker import MaxNLocator

    all_keys = {key for record in records for key in record}
    figure = Figure(figsize=(15, 4.2), layout="constrained")
    axes = figure.subplots(1, len(PLOT_PANELS))
    for ax, (panel_title, keys) in zip(axes, PLOT_PANELS, strict=True):
        if panel_title.startswith("reward"):
            keys = (*keys, *sorted(k for k in all_keys if k.startswith("val-core/")))
        drawn = 0
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 50 else None, label=key)
                drawn += 1
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not reported", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=100)
    return path
