"""A run's start, phase by phase: every phase from StartRun to the first Generate logs its seconds, the
first step's metrics carry them (timing_s/start/<phase>) and RUN_DIR/run_start.json records where each
began; together they cover the wall time from StartRun to the first Generate (no silent gap), and what
need not wait for each other runs side by side: the connections beside the data, the weight-sync group
beside the trainers' status, the initial save beside the first step's generation."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time

import pytest

from rlfabric.coordinator.run_controller import RunController
from rlfabric.core.errors import FailedPrecondition, Unavailable
from rlfabric.core.start_phases import METRIC_PREFIX, Phase, StartPhases
from rlfabric.rollout.engine import RolloutEngine
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config, in_process, over_grpc

# A fresh run's phases up to its first Generate, as they begin; then the initial save, beside generation.
RUN_PHASES = ["config", "tokenizer", "data", "connect", "initial_weights", "weight_sync_group", "rollout_status",
              "trackers", "wake", "first_sync"]


def test_overlapping_phases_count_once_and_a_gap_is_unaccounted():
    phases = StartPhases("run")
    phases.started -= 10.0  # a start that began 10 s ago, with phases recorded where they began
    phases.phases = [Phase("a", 0.0, 4.0), Phase("b", 1.0, 2.0), Phase("c", 3.0, 3.0), Phase("d", 8.0, 1.0)]
    total = phases.finish()
    assert total == pytest.approx(10.0, abs=0.5)
    assert phases.unaccounted_s() == pytest.approx(total - 7.0)  # covered: [0, 6] and [8, 9]
    assert phases.metrics() == {f"{METRIC_PREFIX}a": 4.0, f"{METRIC_PREFIX}b": 2.0, f"{METRIC_PREFIX}c": 3.0,
                                f"{METRIC_PREFIX}d": 1.0, f"{METRIC_PREFIX}total": total}


def test_a_failed_phase_is_logged_as_failed(caplog):
    phases = StartPhases("run")
    with caplog.at_level(logging.INFO, logger="rlfabric.start"), pytest.raises(ValueError):
        with phases.phase("data"):
            raise ValueError("bad file")
    [record] = [r for r in caplog.records if getattr(r, "fields", {}).get("phase") == "data"]
    assert record.fields["failed"] is True and record.fields["seconds"] >= 0


def test_a_run_logs_each_start_phase_and_they_account_for_the_time_to_the_first_generate(
        tiny_model, tmp_path, monkeypatch, caplog):
    first_generate: list[float] = []
    original = RolloutEngine.generate

    def recording(self, prompts, params):  # the rollout service's engine: when the first Generate arrives
        first_generate.append(time.perf_counter())
        return original(self, prompts, params)

    monkeypatch.setattr(RolloutEngine, "generate", recording)
    config = fast_config(tiny_model, "trainer.total_steps=1", "weight_sync.transport=gloo")

    async def scenario():
        async with over_grpc(config, tmp_path / "run") as client:
            asked = time.perf_counter()
            await client.start_run()
            metrics = {update.step: dict(update.metrics) async for update in client.stream_metrics(from_step=1)}
            return asked, metrics, await client.run_status()

    with caplog.at_level(logging.INFO):
        asked, metrics, status = asyncio.run(scenario())
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    record = json.loads((tmp_path / "run" / "run_start.json").read_text())
    started = {phase["name"]: phase for phase in record["phases"]}

    # Present, one log line each, and the first step's metrics carry the same seconds.
    assert sorted(started) == sorted([*RUN_PHASES, "initial_save"])
    logged = [r.fields["phase"] for r in caplog.records if r.getMessage().startswith("run start:")]
    assert sorted(logged) == sorted(started)
    for name, seconds in record["phases_s"].items():
        assert metrics[1][METRIC_PREFIX + name] == pytest.approx(seconds)
    assert metrics[1][METRIC_PREFIX + "total"] == pytest.approx(record["total_s"])
    assert metrics[1]["timing_s/initial_save"] >= 0  # what the first step's update waited for the save
    assert (tmp_path / "run" / "initial_weights" / "actor" / "meta.json").exists()
    assert record["weight_transfer_s"] > 0 and record["weight_gbytes"] > 0
    # The coordinator checked the model and loaded its tokenizer when it started, not in StartRun.
    preloaded = [r.fields["phase"] for r in caplog.records if r.getMessage().startswith("coordinator start:")]
    assert preloaded == ["model_check", "tokenizer"]

    # Ordered: each phase begins once what it needs has ended; the independent ones overlap.
    def begin(name):
        return started[name]["start_s"]

    def end(name):
        return started[name]["start_s"] + started[name]["seconds"]

    assert begin("config") == min(p["start_s"] for p in record["phases"])
    assert end("config") <= begin("tokenizer") <= end("tokenizer") <= begin("data")
    assert end("config") <= begin("connect") < end("data")  # the connections are made while the data load
    for name in ("initial_weights", "weight_sync_group", "rollout_status"):
        assert max(end("data"), end("connect")) <= begin(name) < end("initial_weights")
        assert end(name) <= begin("trackers")
    assert end("trackers") <= begin("wake") <= end("wake") <= begin("first_sync") <= end("first_sync")
    assert end("first_sync") <= record["total_s"] <= begin("initial_save")  # after the first Generate left

    # They add up: no part of the start is without a phase, and the start is the wall time from the
    # StartRun call to the first Generate but for the two hops (StartRun in, Generate out).
    assert len(first_generate) >= 1
    wall = first_generate[0] - asked
    total = record["total_s"]
    assert total <= wall
    assert wall - total < max(1.0, 0.2 * wall)
    assert record["unaccounted_s"] < max(0.25, 0.1 * total)


class GatedActor:
    """The run's actor client, its SaveCheckpoint held until generation has begun (or failing, `fail`), and
    a record of the order of saves and updates; every other call passes through."""

    def __init__(self, actor, generating: asyncio.Event, fail: bool = False):
        self.actor, self.generating, self.fail = actor, generating, fail
        self.calls: list[str] = []

    def __getattr__(self, name):
        return getattr(self.actor, name)

    async def save_checkpoint(self, path: str, timeout_s: float | None = None) -> int:
        self.calls.append("save")
        # Before the initial save ran beside generation, StartRun waited here for a Generate that never came.
        await asyncio.wait_for(self.generating.wait(), timeout=30)
        if self.fail:
            raise OSError(28, "No space left on device")
        written = await self.actor.save_checkpoint(path, timeout_s)
        self.calls.append("saved")
        return written

    async def update_policy(self, *args, **kwargs):
        self.calls.append("update")
        return await self.actor.update_policy(*args, **kwargs)


class SignallingRollout:
    """The run's rollout router; sets `generating` when the first generation request goes out."""

    def __init__(self, router, generating: asyncio.Event):
        self.router, self.generating = router, generating

    def __getattr__(self, name):
        return getattr(self.router, name)

    def generate_stream(self, *args, **kwargs):
        self.generating.set()
        return self.router.generate_stream(*args, **kwargs)


def gated_run(tiny_model, run_dir, fail: bool = False):
    """One step on the in-process mesh with the gated actor; (actor, final status, metrics by step)."""
    config = fast_config(tiny_model, "trainer.total_steps=1")
    actors: list[GatedActor] = []

    def wrap(peers):
        generating = asyncio.Event()
        actors.append(GatedActor(peers.actor, generating, fail))
        return dataclasses.replace(peers, actor=actors[-1], rollout=SignallingRollout(peers.rollout, generating))

    async def scenario():
        async with in_process(config, run_dir, wrap_peers=wrap) as client:
            await client.start_run()
            metrics = {update.step: dict(update.metrics) async for update in client.stream_metrics(from_step=1)}
            return metrics, await client.run_status()

    metrics, status = asyncio.run(scenario())
    return actors[0], status, metrics


def test_the_initial_save_runs_beside_the_first_generation_and_the_first_update_waits_for_it(tiny_model, tmp_path):
    actor, status, metrics = gated_run(tiny_model, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert actor.calls[:3] == ["save", "saved", "update"]
    assert (tmp_path / "run" / "initial_weights" / "actor" / "meta.json").exists()
    assert metrics[1]["timing_s/initial_save"] >= 0


def test_a_failed_initial_save_fails_the_run_before_its_first_update(tiny_model, tmp_path):
    actor, status, _ = gated_run(tiny_model, tmp_path / "run", fail=True)
    assert status.state == coordinator_pb2.RUN_STATE_FAILED
    assert "No space left on device" in status.error and status.step == 0
    assert "update" not in actor.calls
    assert not (tmp_path / "run" / "initial_weights" / "actor" / "meta.json").exists()


def test_an_unusable_model_fails_start_run_not_the_coordinator_and_a_fixed_one_is_loaded_again(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config_file = model / "config.json"
    good = config_file.read_text()
    config_file.write_text(json.dumps({**json.loads(good), "architectures": ["Qwen2ForTokenClassification"]}))

    async def no_services(config):  # a fake mesh: this test never gets as far as the services
        raise Unavailable("no services in this test")

    async def scenario():
        controller = RunController(fast_config(model, f"storage.root={tmp_path}"), connect=no_services)
        await controller.start()  # the coordinator starts (and is ready) with a model it cannot use
        with pytest.raises(FailedPrecondition, match=rf"model.path {model} holds a Qwen2ForTokenClassification"):
            await controller.start_run([])
        config_file.write_text(good)  # fixed: the next StartRun loads it and goes on to the services
        with pytest.raises(Unavailable, match="no services in this test"):
            await controller.start_run([])

    asyncio.run(scenario())
