"""A real Prometheus scrapes a live local mesh during a short training run.

One mesh and one Prometheus per module (Debian's `prometheus` package; `make system-deps` installs it):

1. LocalMesh starts the six services on loopback and writes RUN_DIR/endpoints.json and the services as
   Prometheus targets, RUN_DIR/prometheus_targets.json (rlfabric.launch.scrape_targets: each service's
   /metrics address labelled with its `role`, `replica`, `pod` = the service name, which the Grafana
   dashboard groups by as Kubernetes discovery would set it, and `run`).
2. Prometheus runs docker/observability-compose.yaml's prometheus.yml, reading that file (file_sd) and
   scraping every second; promtool checks the config and the file.
3. One deliberately failing RPC (Score with an unknown data_source -> INVALID_ARGUMENT) gives the
   dashboard's error panels data, then a short training run.
4. Once every target has been scraped after the run ended, the tests query Prometheus at that time:
   the targets are up; reward, step timing and the gRPC metrics have plausible values; every PromQL
   expression of helm/rlfabric/dashboards/rlfabric.json parses and returns at least one series.
5. rlfabric.connect(RUN_DIR) reaches every service of the live mesh, the coordinator's run status included.
6. The mesh traces to an OTLP receiver (tests.otlp_receiver) and Prometheus keeps exemplars: the
   step-time histogram's exemplars name the steps' traces; a step's spans form one tree (the tracing
   module's checks, here on weights synced over gloo). The dashboard and one step's trace are
   drawn as PNGs (rlfabric.tools.render_dashboard, render_trace); with RLFABRIC_DOCS_IMG=docs/img the
   README's pictures are written there:
       RLFABRIC_DOCS_IMG=docs/img pytest tests/deploy/test_prometheus_scrape.py -k render
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import rlfabric
from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions, check_health
from rlfabric.core.config import TracingConfig, load_config
from rlfabric.core.errors import InvalidArgument
from rlfabric.launch.local import LocalMesh
from rlfabric.launch.scrape_targets import TARGETS_FILE
from rlfabric.reward.client import RewardClient
from rlfabric.reward.items import ScoreItem
from rlfabric.tools.render_dashboard import PrometheusApi, render_dashboard
from rlfabric.tools.render_trace import TraceSpan, render_trace
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.traces import (
    check_a_steps_spans_form_one_tree_under_its_root,
    check_each_step_is_a_trace_of_its_own,
)
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "rlfabric" / "dashboards" / "rlfabric.json"
COMPOSE_PROMETHEUS = Path(__file__).resolve().parents[2] / "docker" / "observability" / "prometheus.yml"
STEPS = 6
# The quickstart as PPO with a critic (GAE) and a KL loss against the reference: every role serves RPCs;
# the old log-probs take their own forward pass, so the rollout/trainer mismatch metrics exist.
MESH_OVERRIDES = ["trainer.progress_bar=false", "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
                  "algorithm.old_log_prob_source=actor", "weight_sync.transport=gloo"]
SCRAPE_INTERVAL = "1s"
SPAN_PREFIX = TracingConfig().service_name_prefix  # the services' names in their spans: SPAN_PREFIX + role
# The gRPC service each role serves (besides grpc.health.v1.Health).
GRPC_SERVICES = {
    "actor": "rlfabric.v1.ActorService",
    "reference": "rlfabric.v1.ReferenceService",
    "critic": "rlfabric.v1.CriticService",
    "rollout": "rlfabric.v1.RolloutService",
    "reward": "rlfabric.v1.RewardService",
    "coordinator": "rlfabric.v1.CoordinatorService",
}


# --- a Prometheus process ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape_config(targets_file: Path) -> dict[str, Any]:
    """docker/observability-compose.yaml's prometheus.yml, reading the mesh's own targets file, every second."""
    config = yaml.safe_load(COMPOSE_PROMETHEUS.read_text())
    config["global"] = {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL}
    [job] = config["scrape_configs"]
    job["file_sd_configs"] = [{"files": [str(targets_file)]}]
    return config


class Prometheus:
    """A prometheus process on a free loopback port, with its own TSDB directory."""

    def __init__(self, config: dict[str, Any], workdir: Path):
        binary = shutil.which("prometheus")
        assert binary, "prometheus not installed: apt-get install prometheus (`make system-deps` does it as root)"
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(
                [binary, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}",
                 "--enable-feature=exemplar-storage"],  # the step-time histogram's links to traces
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_until_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited:\n{self.log_tail()}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:  # not listening yet, or 503 while the TSDB opens
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout_s} s:\n{self.log_tail()}")

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/PATH; the `data` of a success, or AssertionError with Prometheus's error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:  # 400 bad_data (a parse error), 422 execution error
            body = json.load(error)
        assert body["status"] == "success", f"{path} {params}: {body.get('errorType')}: {body.get('error')}"
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict]:
        """Instant query at time `at`: [{"metric": {labels}, "value": [time, "value"]}, ...]."""
        data = self.api("query", query=expr, time=at)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def values(result: list[dict], label: str) -> dict[str, float]:
    """{label value: sample value} of an instant query's result."""
    return {series["metric"].get(label, ""): float(series["value"][1]) for series in result}


def single(result: list[dict]) -> float:
    """The value of an instant query's only series."""
    assert len(result) == 1, result
    return float(result[0]["value"][1])


# --- the mesh, the run and the scrapes -----------------------------------------------------------


@dataclass
class Scraped:
    prometheus: Prometheus
    endpoints: dict[str, list[dict]]
    status: coordinator_pb2.CoordinatorServiceGetRunStatusResponse
    last_record: dict  # the run's last line of metrics.jsonl
    began: float  # a time after the first scrapes, before the first RPC of the test
    at: float  # a time after the run when every target had been scraped: the queries' evaluation time
    records: list[dict]  # the run's metrics.jsonl
    spans: list[ReceivedSpan]  # every span the mesh exported, each step's root span included
    connected: tuple[int, dict[str, int]]  # through rlfabric.connect: the run's state, each service's readiness

    def query(self, expr: str) -> list[dict]:
        return self.prometheus.query(expr, self.at)


async def fail_one_score(address: str, options: ChannelOptions) -> None:
    """A Score the reward service refuses (INVALID_ARGUMENT), for the dashboard's error panels."""
    async with RewardClient(address, options) as reward:
        with pytest.raises(InvalidArgument, match="unknown data_source"):
            await reward.score([ScoreItem("no-such/data-source", "42", "42")])


async def train(address: str, options: ChannelOptions) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
    async with CoordinatorClient(address, options) as client:
        await client.start_run([f"trainer.total_steps={STEPS}"])
        async with asyncio.timeout(400):
            async for _ in client.stream_metrics(timeout_s=400):
                pass
        return await client.run_status()


async def ask_through_connect(run_dir: Path) -> tuple[int, dict[str, int]]:
    """rlfabric.connect's clients of the live mesh: the coordinator's run state, and each client's service's
    readiness by address."""
    async with rlfabric.connect(run_dir) as mesh:
        status = await mesh.coordinator.run_status()
        return status.state, {client.address: await check_health(client.channel) for client in mesh.clients()}


def wait_for_scrapes_after(prometheus: Prometheus, since: float, targets: int, timeout_s: float = 60) -> float:
    """Waits until every target has a scrape later than `since`; returns a time after those scrapes."""
    deadline, scraped_at = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        now = time.time()
        scraped_at = values(prometheus.query("timestamp(up)", now), "pod")
        if len(scraped_at) == targets and min(scraped_at.values()) > since:
            return now
        time.sleep(0.5)
    raise TimeoutError(f"not every target scraped after {since} within {timeout_s} s: {scraped_at}")


def step_roots(receiver: OtlpReceiver) -> dict[int, ReceivedSpan]:
    return {s.attributes["rlfabric.step"]: s for s in receiver.spans() if s.name == "train_step"}


def services_traced_after(receiver: OtlpReceiver, step: int) -> set[str]:
    later = {root.trace_id for number, root in step_roots(receiver).items() if number > step}
    return {s.service for s in receiver.spans() if s.trace_id in later}


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> Scraped:
    workdir = tmp_path_factory.mktemp("prometheus_scrape")
    with contextlib.ExitStack() as stack:
        receiver = stack.enter_context(OtlpReceiver())
        config = load_config(None, [*MESH_OVERRIDES, f"tracing.endpoint={receiver.endpoint}"])
        mesh = stack.enter_context(LocalMesh(config, workdir / "mesh"))
        endpoints = json.loads((mesh.run_dir / "endpoints.json").read_text())
        prometheus = Prometheus(scrape_config(mesh.run_dir / TARGETS_FILE), workdir / "prometheus")
        try:
            prometheus.wait_until_ready()
            targets = sum(len(services) for services in endpoints.values())
            # Scrapes from before the first RPC: counters then have a baseline for rate() and increase().
            began = wait_for_scrapes_after(prometheus, time.time(), targets)
            options = dataclasses.replace(ChannelOptions.from_config(mesh.config), timeout_s=300)
            asyncio.run(fail_one_score(endpoints["reward"][0]["grpc"], options))
            status = asyncio.run(train(endpoints["coordinator"][0]["grpc"], options))
            ended = time.time()
            connected = asyncio.run(ask_through_connect(mesh.run_dir))
            at = wait_for_scrapes_after(prometheus, ended, targets)
            records = [json.loads(line) for line in (mesh.run_dir / "metrics.jsonl").read_text().splitlines()]
            # The coordinator exports a step's spans in batches, at most a few seconds after the step.
            wait_until(lambda: len(step_roots(receiver)) == STEPS, 30, f"the root spans of {STEPS} steps")
            # Each service exports its spans in the order they end (a BatchSpanProcessor's queue): once every
            # service's spans of a later step arrived, those of steps 1 and 2 are whole, which the trace checks read.
            wait_until(lambda: services_traced_after(receiver, step=2) >= {SPAN_PREFIX + role for role in GRPC_SERVICES}, 30,
                       "every service's spans of the steps after step 2")
            yield Scraped(prometheus, endpoints, status, records[-1], began, at, records, receiver.spans(), connected)
        finally:
            prometheus.stop()


# --- the tests -------------------------------------------------------------------------------------


def test_the_run_completed(scraped):
    assert scraped.status.state == coordinator_pb2.RUN_STATE_COMPLETED, scraped.status.error
    assert scraped.last_record["step"] == STEPS


def test_every_service_is_a_target_and_up(scraped):
    services = {service["name"]: role for role, entries in scraped.endpoints.items() for service in entries}
    assert set(scraped.endpoints) == set(GRPC_SERVICES)  # the six roles
    targets = scraped.prometheus.api("targets", state="active")["activeTargets"]
    assert {t["labels"]["pod"]: t["labels"]["role"] for t in targets} == services
    assert {t["labels"]["pod"]: t["health"] for t in targets} == dict.fromkeys(services, "up"), \
        {t["labels"]["pod"]: t["lastError"] for t in targets}
    assert values(scraped.query("up"), "pod") == dict.fromkeys(services, 1.0)
    # Discovered from RUN_DIR/prometheus_targets.json: each replica of a role numbered, every target of this run.
    replicas = {service["name"]: str(i) for entries in scraped.endpoints.values() for i, service in enumerate(entries)}
    assert {t["labels"]["pod"]: t["labels"]["replica"] for t in targets} == replicas
    assert {t["labels"]["run"] for t in targets} == {"mesh"}  # the run folder's name
    assert {Path(t["discoveredLabels"]["__meta_filepath"]).relative_to(scraped.prometheus.config_path.parents[1])
            for t in targets} == {Path("mesh") / TARGETS_FILE}


def test_promtool_accepts_the_config_and_the_runs_targets_file(scraped):
    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed: apt-get install prometheus (`make system-deps` does it as root)"
    checked = subprocess.run([promtool, "check", "config", str(scraped.prometheus.config_path)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "WARNING" not in checked.stdout + checked.stderr, \
        checked.stdout + checked.stderr


def test_connect_reaches_every_service_of_the_live_mesh(scraped):
    from grpc_health.v1 import health_pb2

    state, readiness = scraped.connected
    assert state == coordinator_pb2.RUN_STATE_COMPLETED
    addresses = {service["grpc"] for entries in scraped.endpoints.values() for service in entries}
    assert readiness == dict.fromkeys(addresses, health_pb2.HealthCheckResponse.SERVING)


def test_reward_and_step_timing_match_the_run(scraped):
    last = scraped.last_record
    assert values(scraped.query("rlfabric_coordinator_step"), "pod") == {"coordinator": STEPS}
    assert values(scraped.query("rlfabric_coordinator_total_steps"), "pod") == {"coordinator": STEPS}
    score = single(scraped.query("rlfabric_coordinator_score_mean"))
    assert score == pytest.approx(last["critic/score/mean"])
    assert 0.0 <= score <= 1.0
    kl = single(scraped.query("rlfabric_coordinator_kl"))
    assert kl == pytest.approx(last["actor/kl_loss"])
    step_seconds = single(scraped.query('rlfabric_coordinator_phase_seconds{phase="step"}'))
    assert step_seconds == pytest.approx(last["timing_s/step"])
    assert step_seconds > 0
    phases = values(scraped.query('rlfabric_coordinator_phase_seconds{phase!="step"}'), "phase")
    assert {"gen", "update"} <= set(phases), phases
    # The last step's own phases: not the run's start (start/*, the first step's), nor a phase's parts
    # (update_weights/gather, ...), which the phase's own time holds already.
    phases = {phase: seconds for phase, seconds in phases.items() if "/" not in phase and f"timing_s/{phase}" in last}
    # The step's phases run one after another, except the reference, old-policy and critic forward passes,
    # which run at once (each with a timer of its own): those count once, by the longest.
    together = [phases.pop(phase) for phase in ("old_log_prob", "ref", "values") if phase in phases]
    assert 0 < sum(phases.values()) + max(together, default=0.0) <= step_seconds * 1.01 + 0.01, (phases, step_seconds)


def test_grpc_metrics_of_every_service(scraped):
    handled = scraped.query("sum by (role, grpc_service) (grpc_server_handled_total)")
    by_role: dict[str, set[str]] = {}
    for series in handled:
        if float(series["value"][1]) > 0:
            by_role.setdefault(series["metric"]["role"], set()).add(series["metric"]["grpc_service"])
    # Every service answered the launcher's readiness checks and RPCs of its own service.
    for role, grpc_service in GRPC_SERVICES.items():
        assert {"grpc.health.v1.Health", grpc_service} <= by_role.get(role, set()), (role, by_role)
    # The run's RPCs: one StartRun, and at least one successful reward Score per step.
    started = values(scraped.query('grpc_server_started_total{grpc_method="StartRun"}'), "grpc_type")
    assert started == {"unary": 1.0}
    scores = single(scraped.query('sum(grpc_server_handled_total{pod="reward",grpc_method="Score",grpc_code="OK"})'))
    assert scores >= STEPS
    # The deliberate failure, and nothing else failed.
    errors = scraped.query('grpc_server_handled_total{grpc_code!="OK"} > 0')
    assert [(e["metric"]["pod"], e["metric"]["grpc_method"], e["metric"]["grpc_code"], e["value"][1])
            for e in errors] == [("reward", "Score", "INVALID_ARGUMENT", "1")]
    score_count = single(scraped.query('sum(grpc_server_handling_seconds_count{pod="reward",grpc_method="Score"})'))
    assert score_count == scores + 1  # the latency histogram counts the failed Score too


def dashboard_exprs(panels: list[dict]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target, rows' nested panels included."""
    found = []
    for panel in panels:
        found += [(panel.get("title", ""), target["expr"]) for target in panel.get("targets", []) if "expr" in target]
        found += dashboard_exprs(panel.get("panels", []))
    return found


def test_every_dashboard_expression_returns_series(scraped):
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text())["panels"])
    assert len(exprs) >= 30
    empty, only_nan = [], []
    for title, expr in exprs:
        result = scraped.query(expr)  # a parse error fails here, with Prometheus's message
        if not result:
            empty.append(f"{title}: {expr}")
        elif all(math.isnan(float(series["value"][1])) for series in result):
            only_nan.append(f"{title}: {expr}")  # Grafana would draw nothing
    # Which metrics of the empty expressions no service exports at all (a producer to fix).
    used = {name for entry in empty for name in re.findall(r"\b(?:rlfabric|grpc_server)_[a-z_]+\b", entry)}
    never_exported = sorted(name for name in used if not scraped.query(f'count({{__name__="{name}"}})'))
    assert not empty and not only_nan, (
        f"metrics no service exports: {never_exported}\n"
        "expressions with no series:\n  " + "\n  ".join(empty) + "\n"
        "expressions whose every series is NaN:\n  " + "\n  ".join(only_nan)
    )


def test_rate_and_increase_see_the_first_rpc_of_a_method(scraped):
    """The dashboard's request and error panels use rate() and increase(), which only see a counter grow
    between two scrapes: a series created by the first RPC of its method, code included, would be 1 at
    its first scrape and add nothing. The gRPC metrics must exist at 0 before the first RPC (as
    go-grpc-prometheus's InitializeMetrics does for every registered method)."""
    window = f"{math.ceil(scraped.at - scraped.began) + 5}s"  # from before the failed Score to now
    errors = values(scraped.query(
        f'sum by (grpc_method) (increase(grpc_server_handled_total{{grpc_code!="OK"}}[{window}]))'), "grpc_method")
    start_runs = values(scraped.query(
        f'sum by (grpc_code) (increase(grpc_server_handled_total{{grpc_method="StartRun"}}[{window}]))'), "grpc_code")
    assert errors.get("Score", 0) > 0.5 and start_runs.get("OK", 0) > 0.5, (
        "increase() over the whole test misses the failed Score or the StartRun "
        f"(errors by method {errors}, StartRun by code {start_runs}): grpc_server_* children are created "
        "by the first RPC; services/core should initialise them to 0 when the server starts, for every "
        "method (and, for grpc_server_handled_total, every status code)"
    )


# --- traces: a step's tree, exemplars, and the pictures of the README ---------------------------------


def test_a_steps_spans_from_every_service_form_one_tree_under_its_root(scraped):
    """The tracing checks (tests/coordinator/traces.py) on this run, whose weights go over gloo; the tracing
    module runs them on a run over grpc."""
    check_a_steps_spans_form_one_tree_under_its_root(scraped.spans, "gloo", prefix=SPAN_PREFIX)


def test_each_step_is_a_trace_of_its_own(scraped):
    check_each_step_is_a_trace_of_its_own(scraped.spans, prefix=SPAN_PREFIX)


def test_step_time_exemplars_name_the_steps_traces(scraped):
    """Each step's observation of rlfabric_coordinator_step_seconds carries its trace id (OpenMetrics
    exemplar): the dashboard's link from a step's point to its trace."""
    exemplars = PrometheusApi(scraped.prometheus.url).exemplars(
        "rlfabric_coordinator_step_seconds_bucket", scraped.began, scraped.at)
    roots = {s.trace_id: s for s in scraped.spans if s.name == "train_step"}
    step_seconds = {r["step"]: r["timing_s/step"] for r in scraped.records}
    assert len(exemplars) >= 2, exemplars
    for _, value, labels in exemplars:
        root = roots.get(labels["trace_id"])
        assert root is not None, f"exemplar {labels} names no step's trace"
        assert value == pytest.approx(step_seconds[root.attributes["rlfabric.step"]])


def test_the_dashboard_and_a_steps_trace_render_from_the_run(scraped, tmp_path):
    """The README's pictures: the dashboard drawn from this Prometheus (every panel with data) and step 2's
    trace; written to $RLFABRIC_DOCS_IMG too when it is set."""
    prometheus = PrometheusApi(scraped.prometheus.url)
    start, end = scraped.began - 5, scraped.at + 5
    drawn = render_dashboard(prometheus, start, end, tmp_path / "dashboard-full.png")
    assert len(drawn) >= 30 and all(drawn.values()), [title for title, n in drawn.items() if not n]
    readme = render_dashboard(prometheus, start, end, tmp_path / "dashboard.png", rows=["Run", "Step time"])
    assert "Step time (p50 / p95), a step's trace per exemplar" in readme and "Rollout queue depth" not in readme

    root = next(s for s in scraped.spans if s.name == "train_step" and s.attributes["rlfabric.step"] == 2)
    spans = [TraceSpan(s.service, s.name, s.span_id, s.parent_span_id, s.start_ns, s.end_ns)
             for s in scraped.spans if s.trace_id == root.trace_id]
    assert len(spans) > 10 and all(s.end_ns > s.start_ns > 0 for s in spans)
    (tmp_path / "trace.json").write_text(json.dumps([dataclasses.asdict(s) for s in spans]))  # to redraw it
    render_trace(spans, tmp_path / "trace.png", f"step 2: trace {root.trace_id}")

    import matplotlib.image

    for name in ("dashboard-full.png", "dashboard.png", "trace.png"):
        height, width, _ = matplotlib.image.imread(tmp_path / name).shape
        assert width >= 1200 and height >= 400, (name, width, height)
    if os.environ.get("RLFABRIC_DOCS_IMG"):
        target = Path(os.environ["RLFABRIC_DOCS_IMG"])
        for name in ("dashboard.png", "trace.png"):
            shutil.copyfile(tmp_path / name, target / name)
