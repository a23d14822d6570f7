"""The GPU check's plumbing (bench.gpu_check, `make gpu-check`), run for real on this CPU in its small mode:
each phase a process with its own limit and log, what it measured read back into gpu.json, the plot, and the
phases it cannot run here recorded as skipped with the reason. The GPU figures themselves come from a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_the_small_check_runs_every_kind_of_phase_and_writes_its_report(tmp_path):
    out = tmp_path / "results"
    result = gpu_check("--device", "cpu", "--small", "--out", str(out), "--work", str(tmp_path / "work"),
                       "--phases", "environment,gpu_tests,pair_model,pair_rlfabric_hf,pair_trl,pair_rlfabric_vllm")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "gpu.json").read_text())
    phases = report["phases"]
    assert list(phases) == ["environment", "gpu_tests", "pair_model", "pair_rlfabric_hf", "pair_trl",
                            "pair_rlfabric_vllm", "report"]
    assert phases["environment"]["torch"] and phases["environment"]["gpus"] == 0
    # pytest ran in its own process; its closing line was read back (the gpu-marked NCCL test skips on a CPU).
    assert phases["gpu_tests"]["status"] == "ok" and phases["gpu_tests"]["counts"]["skipped"] >= 1
    assert (out / "gpu-logs" / "gpu_tests.log").exists()
    assert phases["pair_model"]["model"]["shape"] == "tiny"
    run = phases["pair_rlfabric_hf"]["run"]
    assert phases["pair_rlfabric_hf"]["status"] == "ok" and run["steps"] == 1 and run["step_s"] > 0
    assert run["median"]["weight_sync/gbytes"] > 0 and "timing_s/gen" in run["median"]
    if phases["pair_trl"]["status"] == "skipped":  # TRL is not a dependency of rlfabric
        assert "make gpu-wheels" in phases["pair_trl"]["reason"]
    assert phases["pair_rlfabric_vllm"] == {"status": "skipped", "reason": "small mode", "seconds": 0.0} or \
        phases["pair_rlfabric_vllm"]["reason"] == "vLLM is not installed"
    assert report["pair"]["pair_rlfabric_hf"]["step_s"] == run["step_s"]
    assert report["plot"] == str(out / "gpu.png") and (out / "gpu.png").stat().st_size > 10_000


def test_phases_past_the_budget_are_skipped_and_an_unknown_phase_is_refused(tmp_path):
    result = gpu_check("--device", "cpu", "--small", "--out", str(tmp_path), "--budget-s", "0",
                       "--phases", "environment,quickstart", timeout=120)
    assert result.returncode == 0, result.stderr
    phases = json.loads((tmp_path / "gpu.json").read_text())["phases"]
    assert phases["environment"] == phases["quickstart"] == {
        "status": "skipped", "reason": "the check's budget of 0 s was spent"}
    refused = gpu_check("--phases", "environment,warp_drive", timeout=60)
    assert refused.returncode == 2 and "unknown phase(s) ['warp_drive']" in refused.stderr


@pytest.mark.parametrize("versions, missing", [
    ({"grpcio": "1.85.1", "protobuf": "7.36.2"}, []),
    ({"grpcio": "1.62.0", "protobuf": "4.25.0"}, ["grpcio", "protobuf"]),  # the GPU machine's older ones
])
def test_the_wheels_are_installed_only_where_rlfabrics_requirements_are_missing(versions, missing, monkeypatch):
    from bench import gpu_check as check

    present = {name: "1.0" for name in ("grpcio-health-checking", "grpcio-status", "pydantic", "isal",
                                         "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc")}
    monkeypatch.setattr(check.importlib.metadata, "version", lambda name: {**present, **versions}[name])
    assert check.missing_requirements() == missing
