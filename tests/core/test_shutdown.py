"""SIGTERM during an in-flight RPC: health flips to NOT_SERVING, the RPC finishes, exit code 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from rlfabric.v1 import reward_pb2, reward_pb2_grpc
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # a service process

REPO_ROOT = Path(__file__).resolve().parents[2]


def scores_started(metrics_url: str) -> float:
    """Score calls the server has started (grpc_server_started_total), from its /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
    return sum(sample.value for family in families for sample in family.samples
               if sample.name == "grpc_server_started_total" and sample.labels.get("grpc_method") == "Score")


def test_sigterm_drains_in_flight_rpc_and_exits_zero(tmp_path):
    port_file = tmp_path / "ports.json"
    log = open(tmp_path / "server.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "tests.core.slow_service", str(port_file)], cwd=REPO_ROOT,
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            health = health_pb2_grpc.HealthStub(channel)
            ready = health_pb2.HealthCheckRequest(service="readiness")
            while health.Check(ready, timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
                time.sleep(0.05)
            slow = reward_pb2.RewardServiceScoreRequest(items=[reward_pb2.ScoreItem(data_source="sleep:2")])
            in_flight = reward_pb2_grpc.RewardServiceStub(channel).Score.future(slow, timeout=30)
            metrics = f"http://127.0.0.1:{json.loads(port_file.read_text())['metrics']}/metrics"
            wait_until(lambda: scores_started(metrics) == 1, 30, "the server to start the Score call")
            process.send_signal(signal.SIGTERM)
            # The in-flight call completes normally during the drain.
            assert in_flight.result(timeout=20).results[0].score == 1.0
        assert process.wait(timeout=20) == 0
        lines = [json.loads(line) for line in (tmp_path / "server.log").read_text().splitlines() if line.startswith("{")]
        events = [line["event"] for line in lines]
        assert events.index("draining") < events.index("stopped")
        assert all(line["role"] == "probe" and line["run_id"] == "shutdown-test" for line in lines)
    finally:
        if process.poll() is None:
            process.kill()
