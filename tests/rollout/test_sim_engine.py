"""The simulated engine (rollout.engine sim) against its latency model: measured generation time within the bounds
the model gives, stragglers, valid tokens, aborts, partial rollouts across a weight swap, and injected failures
that the router retries so that every sample arrives exactly once."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlfabric.core.config import load_config
from rlfabric.core.errors import Unavailable
from rlfabric.rollout.client import LocalRolloutClient
from rlfabric.rollout.router import RolloutRouter
from rlfabric.rollout.sim_engine import SimEngine
from rlfabric.rollout.types import Finish, SamplingSpec
from rlfabric.sim.latency import RolloutLatency, stragglers
from rlfabric.sim.weights import SyncCost, payload

# No noise and every response max_tokens long: a request's time is the model's, exactly.
EXACT = ["rollout.engine=sim", "actor.engine=sim", "sim.rollout.jitter_cv=0", "sim.rollout.response_length=max"]
# A late timer is all that can make a request slower than the model: the event loop's scheduling lag, bounded here
# by a quarter of a prediction of >= 0.2 s (and early it cannot be, but for the clock's resolution).
LATE = 0.25
CLOCK = 0.002


def sim_config(*overrides: str):
    return load_config(None, [*EXACT, *overrides])


async def started(config, replica: int = 0) -> SimEngine:
    engine = SimEngine(config, replica)
    await engine.start()
    return engine


async def timed_generation(engine: SimEngine, prompts, params: SamplingSpec):
    began = time.monotonic()
    samples = [sample async for sample in engine.generate(prompts, params)]
    return samples, time.monotonic() - began


def within_model(measured: float, predicted: float) -> bool:
    return predicted - CLOCK <= measured <= predicted * (1 + LATE)


def test_one_batch_takes_prefill_plus_length_decode_steps():
    config = sim_config("sim.time_scale=0.1", "rollout.max_num_seqs=16")

    async def scenario():
        engine = await started(config)
        prompts = [[1, 2, 3, 4, 5]] * 2 + [[6, 7, 8]] * 2  # 16 prompt tokens, 4 prompts x n 4 = 16 rows
        samples, seconds = await timed_generation(engine, prompts, SamplingSpec(n=4, max_tokens=200))
        await engine.stop()
        return engine.latency, samples, seconds

    latency, samples, seconds = asyncio.run(scenario())
    predicted = latency.batch_seconds(16, 16, 200)
    assert predicted > 0.2
    assert within_model(seconds, predicted), (seconds, predicted)
    assert len(samples) == 16 and all(len(s.token_ids) == 200 and s.finish_reason is Finish.LENGTH for s in samples)


def test_rows_past_max_num_seqs_wait_for_a_second_wave():
    config = sim_config("sim.time_scale=0.1", "rollout.max_num_seqs=4")

    async def scenario():
        engine = await started(config)
        samples, seconds = await timed_generation(engine, [[1, 2, 3, 4]], SamplingSpec(n=8, max_tokens=100))
        await engine.stop()
        return engine.latency, samples, seconds

    latency, samples, seconds = asyncio.run(scenario())
    # two waves of 4 rows, each its own prefill of the 4-token prompt and 100 steps of 4 rows
    predicted = 2 * latency.batch_seconds(4, 4, 100)
    assert predicted > 0.2
    assert within_model(seconds, predicted), (seconds, predicted)
    assert len(samples) == 8


def test_a_straggler_replica_is_slower_by_its_slowdown():
    config = sim_config("sim.time_scale=0.15", "rollout.replicas=4", "sim.rollout.straggler_fraction=0.25",
                        "sim.rollout.straggler_slowdown=4")
    slow = stragglers(config)
    assert len(slow) == 1
    fast = next(i for i in range(4) if i not in slow)

    async def scenario():
        results = {}
        for replica in (fast, *slow):
            engine = await started(config, replica)
            results[replica] = await timed_generation(engine, [[1, 2, 3]], SamplingSpec(n=8, max_tokens=100))
            await engine.stop()
        return results

    results = asyncio.run(scenario())
    normal = RolloutLatency.of(config).batch_seconds(3, 8, 100)
    assert within_model(results[fast][1], normal), (results[fast][1], normal)
    assert normal > 0.2
    assert within_model(results[next(iter(slow))][1], 4 * normal), (results[next(iter(slow))][1], 4 * normal)


def test_tokens_are_vocabulary_ids_and_a_stopped_response_ends_with_its_eos():
    config = sim_config("sim.time_scale=0.0001", "sim.rollout.response_length=lognormal", "sim.rollout.vocab_size=50",
                        "sim.rollout.response_length_mean=20")

    async def scenario():
        engine = await started(config)
        engine.limits.eos_token_ids = (7,)
        params = SamplingSpec(n=16, max_tokens=40, seed=3)
        first = [s async for s in engine.generate([[1, 2], [3]], params)]
        again = [s async for s in engine.generate([[1, 2], [3]], params)]
        await engine.stop()
        return first, again

    first, again = asyncio.run(scenario())
    assert all(0 <= token < 50 for s in first for token in s.token_ids)
    stopped = [s for s in first if s.finish_reason is Finish.STOP]
    capped = [s for s in first if s.finish_reason is Finish.LENGTH]
    assert stopped and capped  # lognormal around 20 with a cap at 40: both happen among 32
    assert all(s.token_ids[-1] == 7 and 7 not in s.token_ids[:-1] for s in stopped)
    assert all(len(s.token_ids) == 40 and 7 not in s.token_ids for s in capped)
    assert all(len(s.logprobs) == len(s.token_ids) and max(s.logprobs) <= 0 for s in first)
    key = lambda s: (s.prompt_index, s.sample_index)  # noqa: E731
    assert [s.token_ids for s in sorted(first, key=key)] == [s.token_ids for s in sorted(again, key=key)]


def test_pause_with_abort_ends_rows_in_flight_with_what_they_generated():
    config = sim_config("sim.time_scale=0.01")

    async def scenario():
        engine = await started(config)
        generation = asyncio.create_task(timed_generation(engine, [[1, 2, 3]], SamplingSpec(n=4, max_tokens=1000)))
        await asyncio.sleep(1000 * engine.latency.step_seconds(4) / 3)  # about a third of the way
        aborted = await engine.pause(abort=True)
        samples, _ = await generation
        await engine.stop()
        return aborted, samples

    aborted, samples = asyncio.run(scenario())
    assert aborted == 1
    assert len(samples) == 4 and all(s.finish_reason is Finish.ABORT for s in samples)
    assert all(0 < len(s.token_ids) < 1000 for s in samples)


@pytest.mark.parametrize("partial", [True, False])
def test_a_weight_swap_mid_generation(partial):
    """Partial rollouts: the rows in flight go on under the new version from the token they reached; without, the
    swap waits for them and they hold one version."""
    config = sim_config("sim.time_scale=0.01", f"rollout.partial_rollouts={str(partial).lower()}")

    async def scenario():
        engine = await started(config)
        generation = asyncio.create_task(timed_generation(engine, [[1, 2, 3]], SamplingSpec(n=4, max_tokens=500)))
        await asyncio.sleep(500 * engine.latency.step_seconds(4) / 2)
        swap = await engine.swap_weights(list(payload(1).items()), version=1)
        samples, _ = await generation
        await engine.stop()
        return swap, samples

    swap, samples = asyncio.run(scenario())
    assert swap.version == 1
    assert swap.paused_seconds >= SyncCost.of(config).apply_s - CLOCK
    for sample in samples:
        if partial:
            assert sample.weight_version == 0 and [v for v, _ in sample.version_spans] == [0, 1]
            assert 0 < sample.version_spans[1][1] < 500
        else:
            assert sample.weight_version == 0 and sample.version_spans == []


def test_injected_failures_are_retried_on_other_replicas_and_no_sample_is_lost_or_doubled():
    config = sim_config("sim.time_scale=0.0001", "sim.rollout.failure_rate=0.3", "rollout.replicas=4", "sim.seed=1")

    async def scenario():
        engines = [await started(config, replica) for replica in range(4)]
        router = RolloutRouter([f"sim-{i}" for i in range(4)], max_attempts=8,
                               clients=[LocalRolloutClient(engine) for engine in engines])
        prompts = [[i + 1, i + 2] for i in range(64)]
        samples = [s async for s in router.generate_stream(prompts, SamplingSpec(n=4, max_tokens=50), chunk_prompts=4)]
        for engine in engines:
            await engine.stop()
        return samples, sum(engine.injected_failures for engine in engines)

    samples, failures = asyncio.run(scenario())
    keys = [(s.prompt_index, s.sample_index) for s in samples]
    assert sorted(keys) == [(p, s) for p in range(64) for s in range(4)]  # each once
    assert failures > 0  # 16 requests at 0.3, retries included: none failing has probability < 0.7^16 = 0.3%


def test_a_request_that_always_fails_reaches_the_caller_as_unavailable():
    config = sim_config("sim.time_scale=0.0001", "sim.rollout.failure_rate=1")

    async def scenario():
        engine = await started(config)
        with pytest.raises(Unavailable, match="injected failure"):
            async for _ in engine.generate([[1, 2]], SamplingSpec(n=4, max_tokens=20)):
                pass
        await engine.stop()
        return engine.injected_failures

    assert asyncio.run(scenario()) == 1
