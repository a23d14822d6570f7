"""RolloutRouter over real rollout servers (hf engine) on loopback, stopping replicas mid-run."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlfabric.core.config import load_config
from rlfabric.core.errors import InvalidArgument, Unavailable
from rlfabric.core.server import ServerOptions
from rlfabric.rollout.router import RolloutRouter
from rlfabric.rollout.servicer import build_service
from rlfabric.rollout.types import SamplingSpec
from tests.conftest import ServerThread
from tests.waiting import wait_until_async

PROMPTS = [[1, 90, 88, 74], [1, 70, 88], [40, 41], [7, 8, 9], [12], [30, 31, 32]]


@pytest.fixture
def replicas(tiny_model):
    """Starts replicas: replicas(k, port=0) -> [ServerThread, ...]; all stopped at the end."""
    started: list[ServerThread] = []

    def start(count: int, port: int = 0):
        config = load_config(None, [f"model.path={tiny_model}"])
        new = [ServerThread(build_service(config), ServerOptions(port=port, metrics_port=None)) for _ in range(count)]
        started.extend(new)
        return new

    yield start
    for server in started:
        stop(server)


def stop(server: ServerThread) -> None:
    """Stops a replica once (a test may already have stopped it)."""
    if not getattr(server, "stopped_by_test", False):
        server.stopped_by_test = True
        server.stop()


def streams_served(server) -> float:
    """GenerateStream calls a replica has started (from its grpc_server_started_total)."""
    value = server.server.service.registry.get_sample_value("grpc_server_started_total", {
        "grpc_type": "server_stream", "grpc_service": "rlfabric.v1.RolloutService", "grpc_method": "GenerateStream"})
    return value or 0.0


def slow_down(server, seconds: float = 0.01) -> None:
    """Each forward of the replica's hf engine takes `seconds` longer."""
    net = server.server.service.engine.net
    forward = net.forward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    net.forward = slow


def route(addresses, coroutine_fn, **router_kwargs):
    """Runs coroutine_fn(router) on a fresh event loop with a router over `addresses`."""

    async def main():
        async with RolloutRouter(addresses, **{"probe_interval_s": 0.2, **router_kwargs}) as router:
            return await coroutine_fn(router)

    return asyncio.run(main())


def test_spreads_requests_and_chunks_over_replicas(replicas):
    servers = replicas(3)

    async def run(router):
        params = SamplingSpec(n=2, max_tokens=6, seed=1)
        batches = await asyncio.gather(*(router.generate(PROMPTS[:2], params) for _ in range(6)))
        chunked = await router.generate(PROMPTS, params, chunk_prompts=2)
        return batches, chunked

    batches, chunked = route([s.address for s in servers], run)
    assert all(len(b) == 4 for b in batches)
    assert [(s.prompt_index, s.sample_index) for s in chunked] == [(p, s) for p in range(6) for s in range(2)]
    assert [streams_served(s) for s in servers] == [3.0, 3.0, 3.0]  # 6 requests + 3 chunks, evenly
    # Same seed and indices -> same samples, whichever replica served them.
    assert [s.token_ids.tolist() for s in batches[0]] == [s.token_ids.tolist() for s in batches[5]]


def test_a_replica_that_is_down_is_taken_out(replicas):
    servers = replicas(2)
    stop(servers[1])

    async def run(router):
        results = [await router.generate(PROMPTS[:2], SamplingSpec(max_tokens=4)) for _ in range(4)]
        return results, [(r.address, r.healthy, r.last_error) for r in router.replicas]

    results, states = route([s.address for s in servers], run, probe_interval_s=60)
    assert all(len(r) == 2 for r in results)
    assert states[0][1] and not states[1][1] and states[1][2].startswith("UNAVAILABLE")
    assert streams_served(servers[0]) == 4


def test_replica_stopped_mid_run_loses_and_repeats_no_sample(replicas):
    servers = replicas(3)
    for server in servers:
        slow_down(server)

    async def run(router):
        received = []
        params = SamplingSpec(n=3, max_tokens=60, temperature=1.0)
        async for sample in router.generate_stream(PROMPTS, params, chunk_prompts=1):
            received.append(sample)
            if len(received) == 1:
                asyncio.get_running_loop().run_in_executor(None, stop, servers[0])
        return received, [r.healthy for r in router.replicas]

    received, healthy = route([s.address for s in servers], run, probe_interval_s=60)
    keys = sorted((s.prompt_index, s.sample_index) for s in received)
    assert keys == [(p, s) for p in range(len(PROMPTS)) for s in range(3)]
    assert healthy == [False, True, True]


def test_a_replica_that_leaves_finishes_what_it_has_and_gets_nothing_new(replicas):
    """remove() (a leaver, rlfabric.coordinator.membership) while a request streams from it, then its drain (what
    SIGTERM does, with a grace period): the request ends on it, whole, and the next one goes to the other replica."""
    leaver, stayer = replicas(2)
    slow_down(leaver, 0.02)

    async def run(router):
        params = SamplingSpec(n=2, max_tokens=40, temperature=1.0)
        router.exclude(stayer.address)  # the first request goes to the leaver
        first = asyncio.create_task(router.generate(PROMPTS[:2], params))
        await wait_until_async(lambda: streams_served(leaver) == 1, 30, "the request on the leaver")
        router.admit(stayer.address)
        router.remove(leaver.address)
        draining = asyncio.get_running_loop().run_in_executor(None, leaver.stop, 30.0)
        second = await router.generate(PROMPTS[:2], params)
        await draining
        return await first, second, router.addresses, router.stats

    first, second, addresses, stats = route([leaver.address, stayer.address], run, probe_interval_s=60)
    assert sorted((s.prompt_index, s.sample_index) for s in first) == [(p, s) for p in range(2) for s in range(2)]
    assert len(second) == 4 and addresses == [stayer.address]
    assert streams_served(leaver) == 1 and streams_served(stayer) == 1
    assert stats.failovers == 0 and stats.duplicate_samples == 0 and stats.delivered_samples == 8


def test_probe_brings_a_restarted_replica_back(replicas):
    first, second = replicas(2)
    port = first.server.port
    stop(first)

    async def run(router):
        await router.generate([[5]], SamplingSpec(max_tokens=2))
        await router.generate([[5]], SamplingSpec(max_tokens=2))
        down = [r.healthy for r in router.replicas]
        restarted = await asyncio.to_thread(replicas, 1, port)
        await wait_until_async(lambda: all(r.healthy for r in router.replicas), 5, "the router to take it back")
        await asyncio.gather(*(router.generate([[5]], SamplingSpec(max_tokens=2)) for _ in range(4)))
        return down, [r.healthy for r in router.replicas], restarted[0]

    down, back, restarted = route([first.address, second.address], run)
    assert down == [False, True] and back == [True, True]
    assert streams_served(restarted) >= 1


def test_all_replicas_down_is_unavailable_and_bad_input_is_not_retried(replicas):
    servers = replicas(2)

    async def bad(router):
        with pytest.raises(InvalidArgument, match="max_tokens must be >= 1"):
            await router.generate([[5]], SamplingSpec(max_tokens=0))
        return [r.healthy for r in router.replicas]

    assert route([s.address for s in servers], bad) == [True, True]
    assert sum(streams_served(s) for s in servers) == 1
    for server in servers:
        stop(server)

    async def down(router):
        with pytest.raises(Unavailable, match="no healthy rollout replica"):
            await router.generate([[5]], SamplingSpec(max_tokens=2))

    route([s.address for s in servers], down)
