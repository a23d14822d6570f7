"""Load test: many concurrent clients against a real RewardService and a real RolloutService, each
served by its own `rlfabric serve` process on loopback. Writes bench/results/load.json.

    python -m bench.load_bench [--clients 8,32,64] [--seconds 10]

For each service and each client count, CLIENTS tasks (each with its own channel, i.e. its own
connection) send requests back to back for SECONDS seconds; every call has a deadline. Recorded per
phase: requests, throughput, latency p50/p99/max, answers by status code, and the latency of a
health check sent every 0.2 s meanwhile (probes must not starve under load).

- Score: 64 GSM8K items per request (the rule-based scorer).
- Generate: the tiny model (hf engine), one 16-token prompt, n=1, 8 new tokens.
These run with the default limits (server.max_concurrent_rpcs, rollout.max_pending_requests).

Overload: the same workloads with OVERLOAD_CLIENTS clients against services whose limits are set
low, so they are driven past them: the reward with server.max_concurrent_rpcs=REWARD_LIMIT, the
rollout with rollout.max_pending_requests=ROLLOUT_LIMIT. The surplus must be refused with
RESOURCE_EXHAUSTED (counted per phase, with other errors counted apart: expected none), and the
health probe must keep answering. A refused client waits REFUSED_BACKOFF_S before its next call,
as a client honouring back-pressure does.

Any status other than OK and RESOURCE_EXHAUSTED (deliberate back-pressure) fails the bench, after
the results are written; so does an overload phase without any RESOURCE_EXHAUSTED. The clients run
in this process, on the same cores as the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.reward_bench import make_items
from rlfabric.core.client import wait_until_serving
from rlfabric.quickstart.tiny_model import make_tiny_model
from rlfabric.reward.wire import request_from_items
from rlfabric.v1 import reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc

RESULTS = Path(__file__).parent / "results" / "load.json"
CLIENTS = (8, 32, 64)
SECONDS = 10.0
CALL_DEADLINE_S = 60.0
SCORE_ITEMS = 64
PROMPT = [1 + (j * 7) % 90 for j in range(16)]
GENERATE = rollout_pb2.RolloutServiceGenerateRequest(
    prompts=[rollout_pb2.Prompt(token_ids=PROMPT)],
    sampling_params=rollout_pb2.SamplingParams(n=1, max_tokens=8, temperature=1.0, top_p=1.0, logprobs=True),
)
ACCEPTED = {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
OVERLOAD_CLIENTS = 64
REWARD_LIMIT = 8  # server.max_concurrent_rpcs of the overloaded reward service
ROLLOUT_LIMIT = 8  # rollout.max_pending_requests of the overloaded rollout service
# A refused client waits this long before its next call (client.retry_initial_backoff_s's default). Without it
# the refusals churn: a rollout refusing ~700 calls/s (20 ms back-off) spent its event loop and the GIL on them
# and generated 5x fewer samples than with 0.2 s.
REFUSED_BACKOFF_S = 0.2


def progress(message: str) -> None:
    print(f"[load_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


@contextmanager
def serve(name: str, config_text: str, workdir: Path, role: str | None = None):
    """`rlfabric serve ROLE` (ROLE = role or name) on free ports; yields its gRPC address once it reports readiness."""
    role = role or name
    config = workdir / f"{name}.yaml"
    config.write_text(config_text)
    port_file = workdir / f"{name}.ports.json"
    command = [sys.executable, "-m", "rlfabric", "serve", role, "--config", str(config), "--port", "0",
               "--metrics-port", "0", "--port-file", str(port_file)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    try:
        while not port_file.exists():
            if process.poll() is not None:
                raise RuntimeError(f"{role} service exited with code {process.returncode} while starting")
            time.sleep(0.05)
        address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"
        asyncio.run(wait_until_serving(address, timeout_s=120))
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def phase(address: str, call: Callable[[aio.Channel], object], clients: int, seconds: float) -> dict:
    """`clients` tasks calling back to back for `seconds`; latencies (ms) of the OK calls, codes of every call."""
    latencies: list[float] = []
    codes: Counter[str] = Counter()
    details: dict[str, str] = {}  # one message per error code
    health_ms: list[float] = []
    health_codes: Counter[str] = Counter()
    deadline = time.monotonic() + seconds

    async def client() -> None:
        async with aio.insecure_channel(address) as channel:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    await call(channel)
                    codes["OK"] += 1
                    latencies.append((time.perf_counter() - started) * 1000)
                except grpc.RpcError as error:
                    codes[error.code().name] += 1
                    details.setdefault(error.code().name, error.details() or "")
                    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        await asyncio.sleep(REFUSED_BACKOFF_S)

    async def probe() -> None:
        async with aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"),
                                             timeout=CALL_DEADLINE_S)
                    health_codes[health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)] += 1
                except grpc.RpcError as error:
                    health_codes[error.code().name] += 1
                health_ms.append((time.perf_counter() - started) * 1000)
                await asyncio.sleep(0.2)

    started = time.perf_counter()
    await asyncio.gather(probe(), *(client() for _ in range(clients)))
    wall = time.perf_counter() - started
    requests = sum(codes.values())
    return {
        "clients": clients,
        "seconds": round(wall, 2),
        "requests": requests,
        "requests_per_s": round(codes["OK"] / wall, 2),
        "latency_ms": {"p50": round(percentile(latencies, 50), 1), "p99": round(percentile(latencies, 99), 1),
                       "max": round(max(latencies, default=0.0), 1),
                       "mean": round(statistics.fmean(latencies), 1) if latencies else 0.0},
        "codes": dict(sorted(codes.items())),
        "resource_exhausted": codes["RESOURCE_EXHAUSTED"],
        "other_errors": requests - codes["OK"] - codes["RESOURCE_EXHAUSTED"],
        "error_details": details,
        "error_rate": round(1 - codes["OK"] / requests, 4) if requests else 0.0,
        "health_check_ms": {"p50": round(percentile(health_ms, 50), 1), "p99": round(percentile(health_ms, 99), 1)},
        "health_answers": dict(sorted(health_codes.items())),
    }


def run_service(name: str, address: str, call, unit: str, per_request: int, clients: tuple[int, ...],
                seconds: float) -> list[dict]:
    asyncio.run(phase(address, call, 2, 1.0))  # warm-up: connections, first forward pass
    results = []
    for count in clients:
        result = asyncio.run(phase(address, call, count, seconds))
        result[f"{unit}_per_s"] = round(result["requests_per_s"] * per_request, 1)
        latency = result["latency_ms"]
        progress(f"{name}, {count} clients: {result['requests_per_s']:.1f} req/s ({result[f'{unit}_per_s']:.0f} "
                 f"{unit}/s), p50 {latency['p50']} ms, p99 {latency['p99']} ms, codes {result['codes']}, "
                 f"health p99 {result['health_check_ms']['p99']} ms {result['health_answers']}")
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default=",".join(map(str, CLIENTS)), help="client counts, e.g. 8,32,64")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="length of each phase")
    parser.add_argument("--overload-clients", type=int, default=OVERLOAD_CLIENTS,
                        help="clients of the overload phases (0 = skip them)")
    args = parser.parse_args(argv)
    clients = tuple(int(c) for c in args.clients.split(","))

    score_request = request_from_items(make_items(SCORE_ITEMS))

    async def score(channel):
        response = await reward_pb2_grpc.RewardServiceStub(channel).Score(score_request, timeout=CALL_DEADLINE_S)
        assert len(response.results) == SCORE_ITEMS

    async def generate(channel):
        response = await rollout_pb2_grpc.RolloutServiceStub(channel).Generate(GENERATE, timeout=CALL_DEADLINE_S)
        assert len(response.samples) == 1 and len(response.samples[0].token_ids) >= 1

    report = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
              "seconds_per_phase": args.seconds, "call_deadline_s": CALL_DEADLINE_S,
              "note": "servers are `rlfabric serve` processes on loopback; the clients share their cores"}
    with tempfile.TemporaryDirectory() as workdir:
        workdir = Path(workdir)
        progress("reward: starting `rlfabric serve reward`")
        with serve("reward", "server: {log_level: WARNING}\n", workdir) as address:
            report["reward_score"] = {
                "workload": f"Score with {SCORE_ITEMS} GSM8K items per request (rule-based scorer)",
                "phases": run_service("reward Score", address, score, "items", SCORE_ITEMS, clients, args.seconds)}
        overload = (args.overload_clients,) if args.overload_clients else ()
        if overload:
            progress(f"reward: starting `rlfabric serve reward` with server.max_concurrent_rpcs={REWARD_LIMIT}")
            config = f"server: {{log_level: WARNING, max_concurrent_rpcs: {REWARD_LIMIT}}}\n"
            with serve("reward-overload", config, workdir, role="reward") as address:
                report["reward_score_overload"] = {
                    "workload": f"Score with {SCORE_ITEMS} GSM8K items per request, past "
                                f"server.max_concurrent_rpcs={REWARD_LIMIT}",
                    "limit": {"server.max_concurrent_rpcs": REWARD_LIMIT},
                    "phases": run_service("reward Score overload", address, score, "items", SCORE_ITEMS, overload,
                                          args.seconds)}
        model = make_tiny_model(workdir / "tiny")
        progress("rollout: starting `rlfabric serve rollout` (hf engine, tiny model)")
        config = f"server: {{log_level: WARNING}}\nmodel: {{path: {model}}}\nrollout: {{engine: hf}}\n"
        with serve("rollout", config, workdir) as address:
            report["rollout_generate"] = {
                "workload": f"Generate: 1 prompt of {len(PROMPT)} tokens, n=1, max_tokens 8 (tiny model, hf engine)",
                "phases": run_service("rollout Generate", address, generate, "samples", 1, clients, args.seconds)}
        if overload:
            progress(f"rollout: starting `rlfabric serve rollout` with rollout.max_pending_requests={ROLLOUT_LIMIT}")
            config = (f"server: {{log_level: WARNING}}\nmodel: {{path: {model}}}\n"
                      f"rollout: {{engine: hf, max_pending_requests: {ROLLOUT_LIMIT}}}\n")
            with serve("rollout-overload", config, workdir, role="rollout") as address:
                report["rollout_generate_overload"] = {
                    "workload": f"Generate: 1 prompt of {len(PROMPT)} tokens, n=1, max_tokens 8, past "
                                f"rollout.max_pending_requests={ROLLOUT_LIMIT}",
                    "limit": {"rollout.max_pending_requests": ROLLOUT_LIMIT},
                    "phases": run_service("rollout Generate overload", address, generate, "samples", 1, overload,
                                          args.seconds)}

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    progress(f"wrote {RESULTS}")
    services = [name for name in ("reward_score", "rollout_generate", "reward_score_overload",
                                  "rollout_generate_overload") if name in report]
    unexpected = {f"{service} x{p['clients']}": p["codes"] for service in services
                  for p in report[service]["phases"] if set(p["codes"]) - {c.name for c in ACCEPTED}}
    if unexpected:
        raise RuntimeError(f"errors other than RESOURCE_EXHAUSTED back-pressure under load: {unexpected}")
    unrefused = [service for service in services if service.endswith("_overload")
                 for p in report[service]["phases"] if not p["resource_exhausted"]]
    if unrefused:
        raise RuntimeError(f"driven past their limits, these got no RESOURCE_EXHAUSTED: {unrefused}")
    starved = {f"{service} x{p['clients']}": p["health_answers"] for service in services
               for p in report[service]["phases"] if set(p["health_answers"]) != {"SERVING"}}
    if starved:
        raise RuntimeError(f"health probes did not all answer SERVING under load: {starved}")


if __name__ == "__main__":
    main()
