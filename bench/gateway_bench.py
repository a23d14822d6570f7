"""What the agent gateway adds to a call, laid out as a run is: the rollout replica (hf engine, tiny model) in
a process of its own (`rlfabric serve rollout`), the gateway and the router in this one (the coordinator's),
the agents in a third. The same one-token chat call through the gateway (loopback HTTP, render, record) and
straight through the router (token ids over gRPC); and calls per second with 64 agents calling at once
(aiohttp: with httpx's connection pool the agents' own process was the limit, at ~66 calls/s here).
Writes bench/results/gateway.json.

    python -m bench.gateway_bench
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.load_bench import serve
from rlfabric.core.config import load_config
from rlfabric.core.host import load_tokenizer
from rlfabric.gateway.calls import RouterGenerator
from rlfabric.gateway.server import Gateway
from rlfabric.quickstart.tiny_model import make_tiny_model
from rlfabric.rollout.router import RolloutRouter
from rlfabric.rollout.types import SamplingSpec

RESULTS = Path(__file__).parent / "results" / "gateway.json"
MESSAGES = [{"role": "user", "content": "how far is it?"}]
AGENTS, CALLS_EACH = 64, 8
# The agents of the throughput phase, in a process of their own: argv = base URL, keys, calls each.
AGENTS_SCRIPT = """
import asyncio, sys, time, aiohttp
base, keys, calls = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
body = {"model": "m", "messages": [{"role": "user", "content": "how far is it?"}], "max_tokens": 1}

async def agent(session, key):
    for _ in range(calls):
        async with session.post(base + "/chat/completions", json=body, headers={"Authorization": "Bearer " + key}) as answer:
            answer.raise_for_status()
            await answer.read()

async def agents():
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(keys) + 8)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(agent(session, key) for key in keys))
        print(len(keys) * calls / (time.perf_counter() - start))

asyncio.run(agents())
"""


class Served:
    """The router over the replica and the gateway, on an event loop in a thread of their own."""

    def __init__(self, model_path: Path, rollout_address: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        config = load_config(None, [f"model.path={model_path}", "agent.gateway.enable=true",
                                    "agent.gateway.max_calls_per_episode=100000",
                                    "agent.gateway.max_tokens_per_episode=1000000"])
        tokenizer = load_tokenizer(str(model_path))

        async def build() -> tuple[RolloutRouter, Gateway]:  # gRPC's aio channels belong to the loop they start on
            router = RolloutRouter([rollout_address])
            gateway = Gateway(config, tokenizer, RouterGenerator(router))
            await gateway.start()
            return router, gateway

        self.router, self.gateway = self.run(build())

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=600)

    def open_key(self) -> str:
        async def on_loop():
            return self.gateway.episodes.open().key

        return self.run(on_loop())

    def stop(self) -> None:
        self.run(self.gateway.close())
        self.run(self.router.close())
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
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "logprobs": True}
    seconds = []
    with httpx.Client(base_url=served.gateway.base_url, headers={"Authorization": f"Bearer {served.open_key()}"},
                      timeout=60) as client:
        for _ in range(calls):
            start = time.perf_counter()
            client.post("/chat/completions", json=body).raise_for_status()
            seconds.append(time.perf_counter() - start)
    return seconds


def direct_calls_per_second(served: Served) -> float:
    """AGENTS tasks calling the router back to back (CALLS_EACH calls each), from this process."""
    prompt_ids = served.gateway.calls.renderer.prompt_ids(MESSAGES, None)

    async def agents() -> float:
        async def agent(index: int) -> None:
            for _ in range(CALLS_EACH):
                await served.router.generate([prompt_ids], SamplingSpec(max_tokens=1), routing_key=str(index))

        start = time.perf_counter()
        await asyncio.gather(*(agent(index) for index in range(AGENTS)))
        return AGENTS * CALLS_EACH / (time.perf_counter() - start)

    return served.run(agents())


def gateway_calls_per_second(served: Served) -> float:
    """The same load through the gateway, AGENTS agents in another process, each with its episode's key."""
    keys = ",".join(served.open_key() for _ in range(AGENTS))
    out = subprocess.run([sys.executable, "-c", AGENTS_SCRIPT, served.gateway.base_url, keys, str(CALLS_EACH)],
                         capture_output=True, text=True, check=True, timeout=600)
    return float(out.stdout.strip())


def main(calls: int = 200) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "tiny")
        rollout_yaml = f"model:\n  path: {model}\nrollout:\n  max_num_seqs: 64\n  max_pending_requests: 0\n"
        with serve("rollout", rollout_yaml, Path(folder)) as address:
            served = Served(model, address)
            try:
                direct_seconds(served, 20), gateway_seconds(served, 20)  # warm up both paths
                direct = direct_seconds(served, calls)
                through = gateway_seconds(served, calls)
                direct_rate = direct_calls_per_second(served)
                rate = gateway_calls_per_second(served)
            finally:
                served.stop()
    result = {
        "what": "one-token chat call; rollout = `rlfabric serve rollout` (hf, tiny model) in its own process, "
                "gateway + router in this one, agents in a third; loopback",
        "calls": calls,
        "direct_median_ms": 1e3 * statistics.median(direct),
        "gateway_median_ms": 1e3 * statistics.median(through),
        "added_median_ms": 1e3 * (statistics.median(through) - statistics.median(direct)),
        f"direct_calls_per_s_{AGENTS}_agents": direct_rate,
        f"gateway_calls_per_s_{AGENTS}_agents": rate,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
