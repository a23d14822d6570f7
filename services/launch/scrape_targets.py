"""The run's services as Prometheus targets: a file_sd file the launchers rewrite with endpoints.json.

RUN_DIR/prometheus_targets.json holds one target group per service: its /metrics address, labelled with its
`role`, its `replica` (0, 1, ... within the role), `pod` (the service's name, which the Grafana dashboard
groups by, as Kubernetes discovery would set it) and `run` (the run's id). A copy goes to the runs folder's
prometheus_targets/<run id>.json, the folder docker/observability-compose.yaml's Prometheus watches; the copy
leaves when the mesh stops, so a finished run's services do not linger there as down targets (and the folder
with the last one).

    scrape_configs:
      - job_name: rlfabric
        honor_labels: true        # a metric's own `role` label (rlfabric_train_*{role="critic"}) stays as it is
        file_sd_configs: [{files: [runs/prometheus_targets/*.json]}]
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

TARGETS_FILE = "prometheus_targets.json"  # in RUN_DIR
SHARED_FOLDER = "prometheus_targets"  # in the runs folder (RUN_DIR's parent): one file per running mesh


def scrape_targets(endpoints: dict[str, list[dict]], run_id: str) -> list[dict]:
    """file_sd target groups of endpoints.json's services (role -> [{name, grpc, metrics, ...}])."""
    return [
        {"targets": [entry["metrics"]],
         "labels": {"role": role, "replica": str(replica), "pod": entry["name"], "run": run_id}}
        for role, entries in endpoints.items()
        for replica, entry in enumerate(entries)
        if entry.get("metrics")
    ]


def shared_targets_path(run_dir: Path) -> Path:
    """RUN_DIR/../prometheus_targets/<run id>.json"""
    return run_dir.resolve().parent / SHARED_FOLDER / f"{run_dir.name}.json"


def write_scrape_targets(run_dir: Path, endpoints: dict[str, list[dict]]) -> Path:
    """Writes RUN_DIR/prometheus_targets.json and its copy in the runs folder (each replaced whole: Prometheus
    rereads a file when it changes); returns the run's."""
    groups = scrape_targets(endpoints, run_dir.name)
    shared = shared_targets_path(run_dir)
    shared.parent.mkdir(exist_ok=True)
    for path in (run_dir / TARGETS_FILE, shared):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(groups, indent=2))
        tmp.replace(path)
    return run_dir / TARGETS_FILE


def remove_shared_targets(run_dir: Path) -> None:
    """The mesh stopped: its services leave the runs folder's targets (RUN_DIR keeps its file), and the folder
    goes when no mesh is left in it, so the runs folder holds only runs."""
    shared = shared_targets_path(run_dir)
    shared.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # another mesh's file is still there, or the folder is gone already
        shared.parent.rmdir()
