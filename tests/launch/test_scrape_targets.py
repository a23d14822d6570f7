"""The run's Prometheus targets (rlfabric.launch.scrape_targets), written as write_endpoints writes them and read
by promtool (Debian's prometheus package), as the Prometheus of docker/observability-compose.yaml reads them.
A real Prometheus scraping a live mesh through the file: tests/deploy/test_prometheus_scrape.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from rlfabric.launch.local import write_endpoints
from rlfabric.launch.scrape_targets import SHARED_FOLDER, TARGETS_FILE, remove_shared_targets

# endpoints.json of a mesh with two rollout replicas (the shape LocalMesh and RayMesh write).
ENDPOINTS = {
    "actor": [{"name": "actor", "grpc": "127.0.0.1:40001", "metrics": "127.0.0.1:40011", "pid": 11}],
    "rollout": [{"name": "rollout-0", "grpc": "127.0.0.1:40002", "metrics": "127.0.0.1:40012", "pid": 12},
                {"name": "rollout-1", "grpc": "127.0.0.1:40003", "metrics": "127.0.0.1:40013", "pid": 13}],
    "coordinator": [{"name": "coordinator", "grpc": "127.0.0.1:40004", "metrics": "127.0.0.1:40014", "pid": 14}],
}


def promtool(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool not installed: apt-get install prometheus (`make system-deps` does it as root)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout_s)


def scrape_config(files: str, path: Path) -> Path:
    path.write_text(yaml.safe_dump({"scrape_configs": [
        {"job_name": "rlfabric", "honor_labels": True, "file_sd_configs": [{"files": [files]}]}]}))
    return path


def test_write_endpoints_writes_every_service_as_a_target_promtool_accepts(tmp_path):
    run_dir = tmp_path / "runs" / "quickstart-20261202-101500"
    run_dir.mkdir(parents=True)
    write_endpoints(run_dir, ENDPOINTS)

    targets = run_dir / TARGETS_FILE
    shared = tmp_path / "runs" / SHARED_FOLDER / f"{run_dir.name}.json"
    assert json.loads(shared.read_text()) == json.loads(targets.read_text())
    config = scrape_config(str(targets), tmp_path / "prometheus.yml")
    checked = promtool("check", "config", str(config))
    assert checked.returncode == 0 and "WARNING" not in checked.stdout + checked.stderr, checked.stdout + checked.stderr

    # What Prometheus makes of the file: a target per service, with its labels.
    found = promtool("check", "service-discovery", "--timeout=1s", str(config), "rlfabric")
    assert found.returncode == 0, found.stderr
    labels = {t["labels"]["__address__"]: {k: v for k, v in t["labels"].items() if not k.startswith("__")}
              for t in json.loads(found.stdout)}
    run = run_dir.name
    expected = {"127.0.0.1:40011": ("actor", "0", "actor"), "127.0.0.1:40012": ("rollout", "0", "rollout-0"),
                "127.0.0.1:40013": ("rollout", "1", "rollout-1"),
                "127.0.0.1:40014": ("coordinator", "0", "coordinator")}
    assert labels == {address: {"role": role, "replica": replica, "pod": pod, "run": run, "instance": address,
                                "job": "rlfabric"}
                      for address, (role, replica, pod) in expected.items()}


def test_the_runs_folder_copy_leaves_when_the_mesh_stops(tmp_path):
    runs = tmp_path / "runs"
    for name in ("run-a", "run-b"):
        (runs / name).mkdir(parents=True)
        write_endpoints(runs / name, ENDPOINTS)
    remove_shared_targets(runs / "run-a")
    assert sorted(p.name for p in (runs / SHARED_FOLDER).iterdir()) == ["run-b.json"]
    assert (runs / "run-a" / TARGETS_FILE).is_file()  # the run's own record stays
    remove_shared_targets(runs / "run-b")
    assert sorted(p.name for p in runs.iterdir()) == ["run-a", "run-b"]  # with no mesh left, only the runs
