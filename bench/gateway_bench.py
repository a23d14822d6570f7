"""What the agent gateway adds to a call: the same one-token chat call through the gateway (loopback HTTP,
render, record) and straight through the rollout router (token ids in), on the hf engine with the tiny
model; and calls per second with many at once. Writes bench/results/gateway.json.

    python -m bench.gateway_bench
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from rlfabric.core.config import load_config
from rlfabric.core.host import load_tokenizer
from rlfabric.gateway.calls import RouterGenerator
from rlfabric.gateway.server import Gateway
from rlfabric.quickstart.tiny_model import make_tiny_model
from rlfabric.rollout.client import LocalRolloutClient
from rlfabric.rollout.hf_engine import HFEngine
from rlfabric.rollout.router import RolloutRouter
from rlfabric.rollout.types import SamplingSpec

RESULTS = Path(__file__).parent / "results" / "gateway.json"
MESSAGES = [{"role": "user", "content": "how far is it?"}]


class Served:
    """The engine, router and gateway on an event loop in a thread of their own (as in the coordinator)."""

    def __init__(self, model_path: Path):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.config = load_config(None, [f"model.path={model_path}", "agent.gateway.enable=true",
                                         "rollout.max_num_seqs=64", "rollout.max_pending_requests=0",
                                         "agent.gateway.max_calls_per_episode=100000",
                                         "agent.gateway.max_tokens_per_episode=1000000"])
        self.tokenizer = load_tokenizer(str(model_path))
        self.engine = HFEngine(self.config)
        self.run(self.engine.start())
        self.router = RolloutRouter(["local"], clients=[LocalRolloutClient(self.engine)])
        self.gateway = Gateway(self.config, self.tokenizer, RouterGenerator(self.router))
        self.run(self.gateway.start())

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=600)

    def stop(self) -> None:
        self.run(self.gateway.close())
        self.run(self.engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def direct_seconds(served: Served, calls: int) -> list[float]:
    """Each call's time straight through the router, timed on the loop (no HTTP, no rendering)."""
    prompt_ids = served.gateway.calls.renderer.prompt_ids(MESSAGES, None)
    params = SamplingSpec(max_tokens=1, logprobs=True)

    async def timed() -> list[float]:
        seconds = []
        for _ in range(calls):
            start = time.perf_counter()
            await served.router.generate([prompt_ids], params, routing_key="bench")
            seconds.append(time.perf_counter() - start)
        return seconds

    return served.run(timed())


def gateway_seconds(served: Served, calls: int) -> list[float]:
    """Each call's time through the gateway, from a client in another thread (keep-alive HTTP)."""
    episode = served.run(_open(served))
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "logprobs": True}
    seconds = []
    with httpx.Client(base_url=served.gateway.base_url, headers={"Authorization": f"Bearer {episode.key}"},
                      timeout=60) as client:
        for _ in range(calls):
            start = time.perf_counter()
            client.post("/chat/completions", json=body).raise_for_status()
            seconds.append(time.perf_counter() - start)
    return seconds


async def _open(served: Served):
    return served.gateway.episodes.open()


def calls_per_second(served: Served, episodes: int, calls_each: int) -> float:
    """Calls per second with `episodes` agents calling at once, each `calls_each` times in turn."""
    keys = [served.run(_open(served)).key for _ in range(episodes)]
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1}

    async def agent(client: httpx.AsyncClient, key: str) -> None:
        for _ in range(calls_each):
            answer = await client.post("/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            answer.raise_for_status()

    async def all_agents() -> float:
        async with httpx.AsyncClient(base_url=served.gateway.base_url, timeout=120,
                                     limits=httpx.Limits(max_connections=episodes + 8)) as client:
            start = time.perf_counter()
            await asyncio.gather(*(agent(client, key) for key in keys))
            return episodes * calls_each / (time.perf_counter() - start)

    return asyncio.run(all_agents())


def main(calls: int = 200) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        served = Served(make_tiny_model(Path(folder) / "tiny"))
        try:
            direct_seconds(served, 20), gateway_seconds(served, 20)  # warm up both paths
            direct = direct_seconds(served, calls)
            through = gateway_seconds(served, calls)
            throughput = calls_per_second(served, episodes=64, calls_each=8)
        finally:
            served.stop()
    result = {
        "what": "one-token chat call, hf engine on the tiny model, one replica, loopback HTTP",
        "calls": calls,
        "direct_median_ms": 1e3 * statistics.median(direct),
        "gateway_median_ms": 1e3 * statistics.median(through),
        "added_median_ms": 1e3 * (statistics.median(through) - statistics.median(direct)),
        "gateway_calls_per_s_64_agents": throughput,
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
