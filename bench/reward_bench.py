"""Rule-based GSM8K scoring throughput through RewardService, next to the in-process library rate
measured in the same run. Writes bench/results/reward.json.

    python -m bench.reward_bench

"Worker processes" are reward service replicas: N `rlfabric serve reward` processes, and the
coordinator's ShardedRewardClient cutting each step's batch into requests of REQUEST_ITEMS items,
dealt round-robin over the replicas, all in flight at once. Rule-based scorers are microseconds per
item, so a process pool inside one service would spend more on moving items between processes
than on scoring them; replicas scale the whole path (parse, score, reply) and are what a
deployment runs (cluster.reward lists them). The client runs in this process, on the same cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlfabric.core.client import wait_until_serving
from rlfabric.reward import ScoreItem, score_items
from rlfabric.reward.client import ShardedRewardClient

RESULTS = Path(__file__).parent / "results" / "reward.json"
STEP_ITEMS = 4096  # one PPO step's responses, e.g. 1024 prompts x 4 samples
REQUEST_ITEMS = (256, 1024)
REPLICAS = (1, 2)
PHASE_SECONDS = 4.0
SENTENCES = [
    "Natalia sold {a} clips in April and half as many in May.",
    "She earns ${a} an hour, so for {b} minutes she earns {a} * {b} / 60.",
    "First find the total: {a} + {b} = {c}.",
    "Then subtract what was left: {c} - {b} = {a}.",
    "Each box holds {b} items, so {a} boxes hold {c} items.",
]


def make_items(count: int, seed: int = 0) -> list[ScoreItem]:
    """GSM8K-like responses (~6 reasoning sentences, then "#### answer"); about half are correct."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        numbers = {key: rng.randint(1, 500) for key in "abc"}
        body = " ".join(rng.choice(SENTENCES).format(**numbers) for _ in range(6))
        answer = rng.randint(1, 2000)
        truth = answer if rng.random() < 0.5 else answer + 1
        items.append(ScoreItem("openai/gsm8k", f"{body}\n#### {answer:,}", str(truth)))
    return items


def rate(fn, seconds: float) -> float:
    """Items per second of fn() (which returns how many items it did), run for about `seconds`."""
    fn()  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += fn()
    return done / (time.perf_counter() - start)


class Replicas:
    """N reward service processes on loopback, stopped with SIGTERM on exit."""

    def __init__(self, count: int, workdir: Path):
        self.processes, self.addresses = [], []
        config = workdir / "reward.yaml"
        config.write_text("server: {log_level: WARNING}\n")
        for index in range(count):
            port_file = workdir / f"reward-{count}-{index}.json"
            command = [
                sys.executable,
                "-m",
                "rlfabric",
                "serve",
                "reward",
                "--config",
                str(config),
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--port-file",
                str(port_file),
            ]
            self.processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
            while not port_file.exists():
                if self.processes[-1].poll() is not None:
                    raise RuntimeError(f"reward replica {index} exited {self.processes[-1].returncode}")
                time.sleep(0.05)
            self.addresses.append(f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}")

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            process.wait(timeout=30)


async def service_rates(
    addresses: list[str], items: list[ScoreItem], expected: list[float]
) -> dict[int, float]:
    """Items/s through the service for each request size, steps of STEP_ITEMS items back to back."""
    for address in addresses:
        await wait_until_serving(address, timeout_s=60)
    rates = {}
    for request_items in REQUEST_ITEMS:
        async with ShardedRewardClient.connect(addresses, request_items=request_items) as client:
            results = await client.score(items)  # warm-up, and the service scores as the library does
            assert [r.score for r in results] == expected, "service and library scores differ"
            done, start = 0, time.perf_counter()
            while time.perf_counter() - start < PHASE_SECONDS:
                done += len(await client.score(items))
            rates[request_items] = done / (time.perf_counter() - start)
    return rates


def main() -> None:
    items = make_items(STEP_ITEMS)

    # 1. The library in this process: the ceiling for one core.
    library = {}
    for request_items in REQUEST_ITEMS:
        batches = [items[i : i + request_items] for i in range(0, len(items), request_items)]
        library[request_items] = rate(
            lambda b=batches: sum(len(score_items(batch)) for batch in b), PHASE_SECONDS
        )
        print(
            f"reward library in-process, batches of {request_items}: {library[request_items]:,.0f} items/s",
            flush=True,
        )
    expected = [r.score for r in score_items(items)]

    # 2. Through the service: 1 and 2 replicas, client in this process.
    service = {}
    with tempfile.TemporaryDirectory() as workdir:
        for replicas in REPLICAS:
            with Replicas(replicas, Path(workdir)) as mesh:
                service[replicas] = asyncio.run(service_rates(mesh.addresses, items, expected))
            for request_items, items_per_s in service[replicas].items():
                print(
                    f"reward service, {replicas} replica(s), requests of {request_items}: "
                    f"{items_per_s:,.0f} items/s ({items_per_s / library[request_items]:.0%} of the library)",
                    flush=True,
                )

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "workload": f"GSM8K strict scoring, steps of {STEP_ITEMS} items (~{len(items[0].response)} chars each), "
                f"{PHASE_SECONDS:g} s per figure",
                "worker_processes": "reward service replicas behind ShardedRewardClient (client in the bench process)",
                "library_items_per_s": {str(k): round(v) for k, v in library.items()},
                "service_items_per_s": [
                    {
                        "replicas": replicas,
                        "request_items": request_items,
                        "items_per_s": round(value),
                        "vs_library": round(value / library[request_items], 3),
                    }
                    for replicas, rates in service.items()
                    for request_items, value in rates.items()
                ],
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}", flush=True)


if __name__ == "__main__":
    main()
