"""RolloutRouter's hedging (trainer.rollout_hedge_after) over in-process sim replicas: a replica whose stream stops
moving (a black-holed link, a hung engine) or crawls no longer holds a request; its missing samples go to another
replica and every sample reaches the caller once."""

from __future__ import annotations

import asyncio

import pytest

from rlfabric.core.config import load_config
from rlfabric.rollout.client import LocalRolloutClient
from rlfabric.rollout.router import RolloutRouter
from rlfabric.rollout.sim_engine import SimEngine
from rlfabric.rollout.types import SamplingSpec
from tests.waiting import wait_until_async

PROMPTS = [[1, 2, 3]] * 12
PARAMS = SamplingSpec(n=2, max_tokens=8, seed=3)
EVERY = [(p, k) for p in range(len(PROMPTS)) for k in range(PARAMS.n)]


class Stalling(LocalRolloutClient):
    """Sends `before` samples of each request, then nothing more until `release` is set (never, here): what a
    replica behind a link that stopped moving bytes looks like to the router."""

    def __init__(self, engine, before: int = 1):
        super().__init__(engine)
        self.before, self.release, self.stalled = before, asyncio.Event(), 0

    async def generate_stream(self, prompts, params, timeout_s=None):
        sent = 0
        async for sample in super().generate_stream(prompts, params, timeout_s):
            if sent == self.before:
                self.stalled += 1
                await self.release.wait()
            sent += 1
            yield sample


async def _engines(count: int) -> list[SimEngine]:
    config = load_config(None, ["rollout.engine=sim", "sim.time_scale=0.0001", "sim.rollout.decode_text=false"])
    engines = [SimEngine(config, replica=i) for i in range(count)]
    for engine in engines:
        await engine.start()
    return engines


def test_a_stalled_replica_is_hedged_and_every_sample_arrives_once():
    async def scenario():
        engines = await _engines(3)
        stalling = Stalling(engines[0])
        clients = [stalling, LocalRolloutClient(engines[1]), LocalRolloutClient(engines[2])]
        router = RolloutRouter(["sim-0", "sim-1", "sim-2"], clients=clients, hedge_after=3.0)
        try:
            samples = await asyncio.wait_for(router.generate(PROMPTS, PARAMS, chunk_prompts=2), timeout=60)
        finally:
            for engine in engines:
                await engine.stop()
        return samples, router.stats, stalling

    samples, stats, stalling = asyncio.run(scenario())
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == EVERY
    assert stalling.stalled >= 1  # the stalled replica got parts, and each stopped after one sample
    assert stats.hedges >= stalling.stalled and stats.hedged_samples >= stalling.stalled * (2 * PARAMS.n - 1)
    assert stats.delivered_samples == len(EVERY) and stats.failovers == 0


def test_without_hedging_the_stalled_replica_holds_the_request():
    """The control: the same stall with hedge_after 0 never completes (until a deadline or keepalive ends it)."""

    async def scenario():
        engines = await _engines(2)
        stalling = Stalling(engines[0])
        router = RolloutRouter(["sim-0", "sim-1"], clients=[stalling, LocalRolloutClient(engines[1])])
        task = asyncio.create_task(router.generate(PROMPTS, PARAMS, chunk_prompts=2))
        try:
            # every sample but the stalled parts' missing ones (a part: 2 prompts x 2 samples, 1 sent)
            await wait_until_async(lambda: stalling.stalled and router.stats.delivered_samples
                                   == len(EVERY) - stalling.stalled * (2 * PARAMS.n - 1), 30, "the other parts")
            done, _ = await asyncio.wait({task}, timeout=1.0)  # and then nothing more
        finally:
            task.cancel()
            for engine in engines:
                await engine.stop()
        return done, router.stats

    done, stats = asyncio.run(scenario())
    assert not done and stats.hedges == 0


@pytest.mark.parametrize("hedge_after", [0.0, 3.0])
def test_a_single_part_request_is_never_hedged(hedge_after):
    """Hedging needs finished parts to compare with; an agent's call (one prompt, one part) is left alone."""

    async def scenario():
        engines = await _engines(2)
        router = RolloutRouter(["sim-0", "sim-1"], clients=[LocalRolloutClient(e) for e in engines],
                               hedge_after=hedge_after)
        try:
            return await router.generate([[1, 2, 3]], PARAMS), router.stats
        finally:
            for engine in engines:
                await engine.stop()

    samples, stats = asyncio.run(scenario())
    assert len(samples) == PARAMS.n and stats.hedges == 0
