"""The run's metric sinks (metrics.jsonl, TensorBoard, Prometheus, console, curves.png) and watch_run's
progress bar against a real gRPC server streaming a run's metrics."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import re
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.coordinator.tracking import RunTracker, read_metrics
from rlfabric.coordinator.watch import watch_run
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import config_from_dict
from rlfabric.core.errors import Unavailable
from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc

DASHBOARD = Path(__file__).parents[2] / "helm" / "rlfabric" / "dashboards" / "rlfabric.json"


def make_config(loggers=("jsonl",), plot=False):
    return config_from_dict({"trainer": {"loggers": list(loggers), "plot": plot, "project_name": "proj",
                                         "experiment_name": "exp"}})


def step_metrics(step: int) -> dict[str, float]:
    """A step's worth of VeRL-named metrics (values depend on the step so mix-ups show)."""
    return {
        "critic/score/mean": 0.1 * step,
        "critic/rewards/mean": 0.1 * step - 0.01,
        "actor/pg_loss": -0.01 * step,
        "actor/ppo_kl": 0.001 * step,
        "actor/kl_loss": 0.002 * step,
        "actor/entropy": 2.5 - 0.1 * step,
        "response_length/mean": 30.0 + step,
        "timing_s/gen": 1.5 * step,
        "timing_s/update_actor": 0.5,
        "timing_s/step": 2.0 * step + 0.5,
        "perf/throughput": 100.0 * step,
        "rollout/weight_version": float(step),
        "rollout/staleness/max": 1.0,
    }


# --- metrics.jsonl ---------------------------------------------------------------------------


def test_jsonl_has_one_strict_json_record_per_step(tmp_path):
    tracker = RunTracker(tmp_path, make_config(), None, total_steps=3)
    for step in (1, 2, 3):
        metrics = step_metrics(step)
        if step == 3:
            metrics["actor/grad_norm"] = math.nan
        tracker.log(step, metrics)
    assert tracker.close() is None  # plot off
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["critic/score/mean"] == pytest.approx(0.2)
    assert records[1].keys() == {"step", "timestamp", *step_metrics(2)}
    assert records[0]["timestamp"] <= records[2]["timestamp"]
    assert records[2]["actor/grad_norm"] is None  # NaN is written as null


def test_resumed_run_drops_steps_after_the_checkpoint(tmp_path):
    first = RunTracker(tmp_path, make_config(), None, total_steps=5)
    for step in range(1, 6):
        first.log(step, step_metrics(step))
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "critic/sco')  # torn line of a crash mid-write

    resumed = RunTracker(tmp_path, make_config(), None, total_steps=5, start_step=3)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    resumed.log(4, {"critic/score/mean": 9.0})
    resumed.log(5, {"critic/score/mean": 10.0})
    resumed.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["critic/score/mean"] for r in records[3:]] == [9.0, 10.0]


# --- TensorBoard ------------------------------------------------------------------------------


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


def test_tensorboard_events_hold_every_scalar(tmp_path):
    tracker = RunTracker(tmp_path, make_config(["tensorboard"]), None, total_steps=3)
    for step in (1, 2, 3):
        tracker.log(step, step_metrics(step))
    tracker.close()
    log_dir = tmp_path / "tensorboard"
    assert list(log_dir.glob("events.out.tfevents.*"))
    assert not (tmp_path / "metrics.jsonl").exists()  # jsonl not enabled
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    assert set(accumulator.Tags()["scalars"]) == set(step_metrics(1))
    got = scalars(log_dir, "critic/score/mean")
    assert [s for s, _ in got] == [1, 2, 3]
    assert [v for _, v in got] == pytest.approx([0.1, 0.2, 0.3], rel=1e-6)
    assert scalars(log_dir, "timing_s/gen")[-1][1] == pytest.approx(4.5)


def test_tensorboard_resume_replaces_the_redone_steps(tmp_path):
    first = RunTracker(tmp_path, make_config(["tensorboard"]), None, total_steps=3)
    for step in (1, 2, 3):
        first.log(step, {"critic/score/mean": float(step)})
    first.close()
    resumed = RunTracker(tmp_path, make_config(["tensorboard"]), None, total_steps=3, start_step=1)
    resumed.log(2, {"critic/score/mean": 20.0})
    resumed.close()
    assert scalars(tmp_path / "tensorboard", "critic/score/mean") == [(1, 1.0), (2, 20.0)]


# --- Prometheus -------------------------------------------------------------------------------


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_prometheus_gauges_follow_the_last_step(tmp_path):
    registry = CollectorRegistry()
    tracker = RunTracker(tmp_path, make_config([]), registry, total_steps=10, start_step=0)
    assert samples(registry)[("rlfabric_coordinator_total_steps", ())] == 10
    tracker.log(1, step_metrics(1))
    tracker.log(2, step_metrics(2))
    got = samples(registry)
    assert got[("rlfabric_coordinator_step", ())] == 2
    assert got[("rlfabric_coordinator_score_mean", ())] == pytest.approx(0.2)
    assert got[("rlfabric_coordinator_kl", ())] == pytest.approx(0.004)  # actor/kl_loss, not ppo_kl
    assert got[("rlfabric_coordinator_response_length_mean", ())] == 32.0
    assert got[("rlfabric_coordinator_weight_version", ())] == 2
    assert got[("rlfabric_coordinator_staleness", ())] == 1
    assert got[("rlfabric_coordinator_phase_seconds", (("phase", "gen"),))] == pytest.approx(3.0)
    assert got[("rlfabric_coordinator_phase_seconds", (("phase", "step"),))] == pytest.approx(4.5)
    assert got[("rlfabric_coordinator_metric", (("name", "actor/pg_loss"),))] == pytest.approx(-0.02)
    tracker.close()


def test_step_time_histogram_carries_the_steps_trace_id_as_exemplar(tmp_path):
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

    registry = CollectorRegistry()
    tracker = RunTracker(tmp_path, make_config([]), registry, total_steps=3)
    tracker.log(1, step_metrics(1), trace_id="0af7651916cd43dd8448eb211c80319c")  # timing_s/step 2.5
    tracker.log(2, step_metrics(2))  # not traced: observed, no exemplar
    tracker.close()
    (family,) = [f for f in parse_openmetrics(openmetrics_latest(registry).decode())
                 if f.name == "rlfabric_coordinator_step_seconds"]
    buckets = {s.labels["le"]: s for s in family.samples if s.name.endswith("_bucket")}
    assert buckets["+Inf"].value == 2
    assert buckets["2.5"].exemplar.labels == {"trace_id": "0af7651916cd43dd8448eb211c80319c"}
    assert buckets["2.5"].exemplar.value == 2.5
    assert [le for le, s in buckets.items() if s.exemplar] == ["2.5"]


def test_every_coordinator_metric_the_dashboard_queries_is_exported(tmp_path):
    registry = CollectorRegistry()
    RunTracker(tmp_path, make_config([]), registry, total_steps=2).log(1, step_metrics(1))
    families = {family.name for family in text_string_to_metric_families(generate_latest(registry).decode())}
    exported = {name for name, _ in samples(registry)} | families  # a histogram's name and its _bucket series
    queried = set(re.findall(r"\brlfabric_coordinator_[a-z_]+", DASHBOARD.read_text()))
    assert len(queried) >= 7
    assert queried <= exported, queried - exported
    assert {labels for name, labels in samples(registry) if name == "rlfabric_coordinator_phase_seconds"} >= {
        (("phase", "step"),), (("phase", "gen"),)}  # the dashboard splits phase="step" from the others


def test_a_second_run_on_the_same_registry_starts_clean(tmp_path):
    registry = CollectorRegistry()
    first = RunTracker(tmp_path / "a", make_config([]), registry, total_steps=2)
    first.log(1, {"timing_s/testing": 3.0, "critic/score/mean": 0.5})
    first.close()
    RunTracker(tmp_path / "b", make_config([]), registry, total_steps=7, start_step=0)  # no duplicate-gauge error
    got = samples(registry)
    assert got[("rlfabric_coordinator_total_steps", ())] == 7
    assert got[("rlfabric_coordinator_step", ())] == 0
    assert ("rlfabric_coordinator_phase_seconds", (("phase", "testing"),)) not in got


# --- console ----------------------------------------------------------------------------------


def test_console_line_is_compact_and_uses_verl_names(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rlfabric.coordinator")
    tracker = RunTracker(tmp_path, make_config(["console"]), None, total_steps=20)
    many = {f"critic/values/extra_{i}": float(i) for i in range(50)}
    tracker.log(3, {**step_metrics(3), **many, "val-core/synthetic/reward/mean@1": 0.75})
    tracker.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "rlfabric.coordinator"]
    assert lines[0] == "run proj / exp: steps 1..20"
    assert lines[-1] == (
        "step 3/20 critic/score/mean=0.3 actor/pg_loss=-0.03 actor/ppo_kl=0.003 actor/entropy=2.2 "
        "response_length/mean=33 timing_s/step=6.5 val-core/synthetic/reward/mean@1=0.75"
    )
    assert caplog.records[-1].fields == {"step": 3}  # lands as a top-level key of the JSON log line
    assert not (tmp_path / "metrics.jsonl").exists()


# --- curves.png -------------------------------------------------------------------------------


def test_curves_png_covers_the_whole_resumed_run(tmp_path):
    first = RunTracker(tmp_path, make_config(["jsonl"], plot=True), None, total_steps=6)
    for step in (1, 2, 3):
        first.log(step, step_metrics(step))
    first_png = first.close()
    assert first_png == tmp_path / "curves.png"
    resumed = RunTracker(tmp_path, make_config(["jsonl"], plot=True), None, total_steps=6, start_step=3)
    for step in (4, 5, 6):
        metrics = step_metrics(step)
        if step == 6:
            metrics["val-core/synthetic/reward/mean@1"] = 0.8
        resumed.log(step, metrics)
    assert [r["step"] for r in resumed.history] == [4, 5, 6]
    assert [r["step"] for r in resumed.run_records()] == [1, 2, 3, 4, 5, 6]  # what the plot draws
    png = resumed.close()
    assert png == tmp_path / "curves.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # three panels of axes, curves and text, not an empty canvas
    import matplotlib.image

    height, width, _channels = matplotlib.image.imread(png).shape
    assert (width, height) == (1500, 420)


def test_no_png_when_plot_is_off_or_no_step_finished(tmp_path):
    assert RunTracker(tmp_path / "off", make_config(["jsonl"], plot=False), None, 3).close() is None
    assert RunTracker(tmp_path / "empty", make_config(["jsonl"], plot=True), None, 3).close() is None
    assert not list(tmp_path.rglob("*.png"))


# --- watch_run against a real gRPC server ----------------------------------------------------


class StreamingCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Streams steps 1..3 (one every `delay` s) and reports the run COMPLETED once step 3 is out."""

    def __init__(self, delay: float = 0.0, steps: int = 3):
        self.delay = delay
        self.steps = steps
        self.from_steps: list[int] = []
        self.done = False

    async def StreamMetrics(self, request, context):
        self.from_steps.append(request.from_step)
        for step in range(max(request.from_step, 1), self.steps + 1):
            await asyncio.sleep(self.delay)
            yield coordinator_pb2.CoordinatorServiceStreamMetricsResponse(
                step=step, metrics={"critic/score/mean": 0.25 * step}, timestamp=1.0)
        self.done = True

    async def GetRunStatus(self, request, context):
        state = coordinator_pb2.RUN_STATE_COMPLETED if self.done else coordinator_pb2.RUN_STATE_RUNNING
        return coordinator_pb2.CoordinatorServiceGetRunStatusResponse(run_id="r1", state=state, step=self.steps,
                                                                      total_steps=self.steps)


async def watch(servicer, options: ChannelOptions | None = None, **kwargs):
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with CoordinatorClient(f"127.0.0.1:{port}", options) as client:
            return await watch_run(client, **kwargs)
    finally:
        await server.stop(0)


def test_watch_run_draws_step_reward_and_eta_until_the_run_ends():
    servicer = StreamingCoordinator()
    out = io.StringIO()
    status = asyncio.run(watch(servicer, total_steps=3, file=out))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED and status.run_id == "r1"
    assert servicer.from_steps == [1]
    final = out.getvalue().split("\r")[-1]
    assert re.search(r"training: 100%.*\| 3/3 \[\d\d:\d\d<00:00, .*reward=0\.750\]", final), final


def test_watch_run_resumes_the_bar_and_reopens_a_stream_past_its_deadline():
    # Each stream may live 1 s; steps come every 0.6 s, so the stream is reopened at least once.
    servicer = StreamingCoordinator(delay=0.6, steps=4)
    out = io.StringIO()
    status = asyncio.run(watch(servicer, ChannelOptions(timeout_s=1.0), total_steps=4, start_step=1, file=out))
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED
    assert servicer.from_steps[0] == 2 and len(servicer.from_steps) >= 2
    assert servicer.from_steps == sorted(servicer.from_steps)  # reopened from the next step, never back
    assert "4/4" in out.getvalue().split("\r")[-1] and "reward=1.000" in out.getvalue()


def test_watch_run_without_bar_prints_nothing_and_surfaces_errors():
    out = io.StringIO()
    asyncio.run(watch(StreamingCoordinator(), total_steps=3, progress_bar=False, file=out))
    assert out.getvalue() == ""

    async def unreachable():
        options = ChannelOptions(retry_max_attempts=1, timeout_s=5)
        async with CoordinatorClient("127.0.0.1:1", options) as client:
            await watch_run(client, 3, file=io.StringIO())

    with pytest.raises(Unavailable, match="coordinator at 127.0.0.1:1"):
        asyncio.run(unreachable())
