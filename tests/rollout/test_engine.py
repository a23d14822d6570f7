"""What RolloutEngine does for every engine (admission, the pause/sleep gate, the request deadline, the
drain), tested once on the base class: each test runs on a minimal subclass (ScriptedEngine, which only
says how one sample is made) and on the hf engine, and must pass the same way on both.

The engines run in this process on a fresh event loop per test; no gRPC here (test_hf_service.py and
the other service tests cover the wire).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import pytest

from rlfabric.core.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, Unimplemented
from rlfabric.rollout.engine import Generation, RolloutEngine
from rlfabric.rollout.types import EngineLimits, Finish, FinishedSample, MultiTurnSpec, SamplingSpec

from .helpers import rollout_config


class ScriptedEngine(RolloutEngine):
    """The smallest engine: each sample is one token, the prompt's last + 1, made once `release` is set
    (set from the start), so a test decides when rows in flight finish."""

    name = "scripted"

    def __init__(self, config):
        super().__init__(config)
        self.release = asyncio.Event()
        self.release.set()
        self.rows_started = 0

    async def start(self) -> None:
        self.limits = EngineLimits(vocab_size=100, max_model_len=512)

    async def stop(self) -> None:
        pass

    async def _generate_row(self, generation: Generation, prompt_index: int, sample_index: int) -> FinishedSample:
        self.rows_started += 1
        await self.release.wait()
        reason = Finish.ABORT if generation.aborted else Finish.LENGTH
        token = generation.prompts[prompt_index][-1] + 1
        return FinishedSample(prompt_index, sample_index, [token], [-0.5], reason, self.weight_version)

    async def _hold(self, abort: bool) -> None:
        if abort:  # rows in flight end now, as ABORT
            self.release.set()
        await self._drain()

    async def _sleep(self, level: int) -> None:
        if level != 1:
            raise Unimplemented("level 1 only")
        await self._drain()

    async def _wake_up(self, tags: Sequence[str]) -> bool:
        return True

    async def load_weights(self, weights, version=None) -> int:
        self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version


@pytest.fixture(params=["scripted", "hf"])
def make_engine(request, tiny_model):
    """make_engine(*overrides) -> an engine of this run's kind (not started yet)."""

    def make(*overrides: str) -> RolloutEngine:
        config = rollout_config(tiny_model, *overrides)
        if request.param == "scripted":
            return ScriptedEngine(config)
        from rlfabric.rollout.hf_engine import HFEngine

        return HFEngine(config)

    return make


def run(engine: RolloutEngine, scenario) -> None:
    """Starts the engine on a fresh event loop, runs scenario(engine), stops the engine."""

    async def main():
        await engine.start()
        try:
            await scenario(engine)
        finally:
            await engine.stop()

    asyncio.run(main())


async def collect(engine: RolloutEngine, prompts, **params) -> list[FinishedSample]:
    spec = SamplingSpec(**{"max_tokens": 4, "seed": 0, **params})
    return [sample async for sample in engine.generate(prompts, spec)]


async def until(condition, timeout: float = 30) -> None:
    """Lets the loop run until condition() holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.001)


def held_and_not_started(engine: RolloutEngine, count: int) -> bool:
    return engine.status().queue_depth == count and not any(g.started for g in engine._requests)


def test_requests_are_held_while_paused_and_start_on_resume(make_engine):
    async def scenario(engine):
        assert await engine.pause(abort=False) == 0
        held = asyncio.create_task(collect(engine, [[5, 6]], n=2))
        await until(lambda: held_and_not_started(engine, 1))
        assert engine.status().paused and not held.done()
        await engine.resume()
        samples = await asyncio.wait_for(held, 60)
        assert sorted(s.sample_index for s in samples) == [0, 1]
        assert all(s.finish_reason != Finish.ABORT and s.token_ids for s in samples)
        assert engine.status().queue_depth == 0 and not engine.status().paused

    run(make_engine(), scenario)


def test_requests_are_held_while_asleep_and_a_failed_sleep_leaves_the_engine_awake(make_engine):
    async def scenario(engine):
        with pytest.raises(InvalidArgument, match="sleep level must be 1 or 2"):
            await engine.sleep(3)
        engine_sleep = engine._sleep

        async def failing_sleep(level):  # the engine's part fails (an allocator error, say)
            raise Unimplemented("simulated sleep failure")

        engine._sleep = failing_sleep
        with pytest.raises(Unimplemented, match="simulated"):
            await engine.sleep(1)
        engine._sleep = engine_sleep
        assert not engine.status().sleeping
        assert len(await collect(engine, [[5, 6]])) == 1
        await engine.sleep(1)
        held = asyncio.create_task(collect(engine, [[5, 6]]))
        await until(lambda: held_and_not_started(engine, 1))
        assert engine.status().sleeping
        await engine.wake_up([])
        assert len(await asyncio.wait_for(held, 60)) == 1 and not engine.status().sleeping

    run(make_engine(), scenario)


def test_pause_abort_ends_held_requests_with_empty_abort_samples(make_engine):
    async def scenario(engine):
        await engine.pause(abort=False)
        held = asyncio.create_task(collect(engine, [[5, 6], [7]], n=2))
        await until(lambda: held_and_not_started(engine, 1))
        assert await engine.pause(abort=True) == 1
        samples = await asyncio.wait_for(held, 10)
        assert sorted((s.prompt_index, s.sample_index) for s in samples) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(s.finish_reason == Finish.ABORT and s.token_ids == [] for s in samples)
        assert engine.status().queue_depth == 0
        await engine.resume()
        assert len(await collect(engine, [[5, 6]])) == 1

    run(make_engine(), scenario)


def test_the_request_deadline_counts_the_time_held_at_the_gate(make_engine):
    async def scenario(engine):
        await engine.pause(abort=False)
        with pytest.raises(DeadlineExceeded, match=r"rollout.request_timeout_s=0.2 \(held while the engine was paused"):
            await collect(engine, [[5, 6]])
        assert engine.status().queue_depth == 0

    run(make_engine("rollout.request_timeout_s=0.2"), scenario)


def test_admission_refuses_past_the_pending_and_row_limits(make_engine):
    async def scenario(engine):
        with pytest.raises(ResourceExhausted, match=r"= 6 samples in one request.*rollout.max_rows_per_request"):
            await collect(engine, [[5], [6]], n=3)
        await engine.pause(abort=False)
        held = asyncio.create_task(collect(engine, [[5, 6]]))
        await until(lambda: held_and_not_started(engine, 1))
        with pytest.raises(ResourceExhausted, match=r"rollout.max_pending_requests=1"):
            await collect(engine, [[5, 6]])
        await engine.resume()
        assert len(await asyncio.wait_for(held, 60)) == 1
        with pytest.raises(InvalidArgument, match="prompt 0 is empty"):
            await collect(engine, [[]])
        # Multi-turn is served above the engine (rlfabric.rollout.agent_rollout), never by it.
        with pytest.raises(InvalidArgument, match="the engine generates single turns"):
            await collect(engine, [[5, 6]], multi_turn=MultiTurnSpec())
        assert engine.status().queue_depth == 0

    run(make_engine("rollout.max_pending_requests=1", "rollout.max_rows_per_request=5"), scenario)


# --- the drain, with rows in flight (the scripted engine decides when they finish) -------------------


def test_pause_returns_once_started_requests_finish_and_abort_ends_them_early(tiny_model):
    async def scenario(engine):
        engine.release.clear()
        running = asyncio.create_task(collect(engine, [[5, 6]], n=3))
        await until(lambda: engine.rows_started == 3)
        pausing = asyncio.create_task(engine.pause(abort=False))
        for _ in range(50):  # the loop runs freely, but rows in flight hold Pause
            await asyncio.sleep(0)
        assert not pausing.done() and engine.status().paused
        engine.release.set()
        assert await asyncio.wait_for(pausing, 10) == 0
        assert engine._requests and all(g.undelivered == 0 for g in engine._requests)  # all handed over
        assert [s.finish_reason for s in await running] == [Finish.LENGTH] * 3
        await engine.resume()

        engine.release.clear()
        running = asyncio.create_task(collect(engine, [[5, 6]], n=2))
        await until(lambda: engine.rows_started == 5)
        assert await engine.pause(abort=True) == 1
        assert [s.finish_reason for s in await running] == [Finish.ABORT] * 2

    run(ScriptedEngine(rollout_config(tiny_model)), scenario)


def test_pause_that_cannot_drain_is_deadline_exceeded_and_stays_paused(tiny_model):
    async def scenario(engine):
        engine.release.clear()
        running = asyncio.create_task(collect(engine, [[5, 6]]))
        await until(lambda: engine.rows_started == 1)
        with pytest.raises(DeadlineExceeded, match="rollout.drain_timeout_s=0.1"):
            await engine.pause(abort=False)
        assert engine.status().paused
        engine.release.set()
        assert len(await running) == 1

    run(ScriptedEngine(rollout_config(tiny_model, "rollout.drain_timeout_s=0.1")), scenario)


def test_a_row_that_fails_fails_its_request_with_a_domain_error(tiny_model):
    """Domain errors keep their class; anything else is the engine failing: UNAVAILABLE with the cause."""

    class Failing(ScriptedEngine):
        error: Exception = RuntimeError("kernel fault")

        async def _generate_row(self, generation, prompt_index, sample_index):
            raise self.error

    async def scenario(engine):
        with pytest.raises(Exception) as info:
            await collect(engine, [[5]])
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert str(info.value) == "scripted engine failed: RuntimeError: kernel fault"
        engine.error = NotFound("no such adapter")
        with pytest.raises(NotFound, match="no such adapter"):
            await collect(engine, [[5]])
        assert engine.status().queue_depth == 0

    run(Failing(rollout_config(tiny_model)), scenario)


def test_vllm_worker_outcomes_map_through_the_domain_errors():
    """One table: core.errors.error_for_code (NOT_FOUND used to arrive as UNAVAILABLE)."""
    from rlfabric.rollout.vllm_weights import raise_first_failure

    def raised(code: str) -> Exception:
        with pytest.raises(Exception) as info:
            raise_first_failure([{"state": "done", "code": "OK", "message": ""},
                                 {"state": "error", "code": code, "message": "it broke"}])
        return info.value

    assert isinstance(raised("NOT_FOUND"), NotFound) and str(raised("NOT_FOUND")) == "vllm worker: it broke"
    assert raised("INVALID_ARGUMENT").code == grpc.StatusCode.INVALID_ARGUMENT
    assert raised("ABORTED").code == grpc.StatusCode.ABORTED
    assert raised("NO_SUCH_CODE").code == grpc.StatusCode.UNAVAILABLE
