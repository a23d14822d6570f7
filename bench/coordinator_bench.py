"""The coordinator loop: step-time breakdown, the coordinator's own overhead, and async vs sync wall
time for the same steps. Writes bench/results/coordinator.json.

    python -m bench.coordinator_bench

One local mesh (the quickstart config: tiny model, hf rollout, every role its own process) runs the
same number of steps in `sync` and in `async` mode, alternated over ROUNDS rounds in one run (medians). Per step:
    overhead  = timing_s/step - (gen + old_log_prob + adv + update + update_weights)
                (the loop's own bookkeeping: batch assembly, metrics, run control)
    rpc_share = timing_s/update - actor/update_s
                (gRPC, codec and validation around the actor's update, as the actor reports it)
Step 1 is left out of the medians (first-call warm-up). The load average is recorded: other work on
the machine skews every figure.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.coordinator.tracking import read_metrics
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import load_config
from rlfabric.launch.local import LocalMesh
from rlfabric.v1 import coordinator_pb2

RESULTS = Path(__file__).parent / "results" / "coordinator.json"
STEPS = 8
ROUNDS = 2
PHASES = ("gen", "old_log_prob", "adv", "update", "update_weights")


def log(message: str) -> None:
    print(f"[coordinator_bench] {message}", flush=True)


async def run(address: str, experiment: str, mode: str) -> float:
    """One run on the mesh, its files in the mesh's RUN_DIR/experiments/<experiment> (StartRun may not set
    trainer.run_dir)."""
    async with CoordinatorClient(address, ChannelOptions(timeout_s=1800)) as client:
        started = time.perf_counter()
        await client.start_run([f"trainer.experiment_name={experiment}", f"trainer.total_steps={STEPS}",
                                f"trainer.mode={mode}", "trainer.resume=disable"])
        async for update in client.stream_metrics():
            log(f"{mode} step {update.step}: {update.metrics['timing_s/step']:.2f} s")
        status = await client.run_status()
        if status.state != coordinator_pb2.RUN_STATE_COMPLETED:
            raise RuntimeError(f"{mode} run ended {status.state}: {status.error}")
        return time.perf_counter() - started


def summarize(records: list[dict]) -> dict:
    timed = records[1:]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in timed)

    overhead = [r["timing_s/step"] - sum(r.get(f"timing_s/{p}", 0.0) for p in PHASES) for r in timed]
    rpc = [r["timing_s/update"] - r["actor/update_s"] for r in timed]
    return {
        "median_step_s": median("timing_s/step"),
        "breakdown_median_s": {p: median(f"timing_s/{p}") for p in PHASES},
        "coordinator_overhead_median_s": statistics.median(overhead),
        "coordinator_overhead_share": statistics.median(o / r["timing_s/step"] for o, r in zip(overhead, timed, strict=True)),
        "update_rpc_overhead_median_s": statistics.median(rpc),
        "actor_update_s_median": median("actor/update_s"),
        "staleness_max": max(r.get("rollout/staleness/max", 0.0) for r in records),
    }


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="coordinator-bench-"))
    config = load_config(None, ["trainer.progress_bar=false", "trainer.plot=false"])
    results: dict = {"steps": STEPS, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    with LocalMesh(config, root / "mesh") as mesh:
        address = mesh.endpoints["coordinator"][0]["grpc"]
        walls: dict[str, list[float]] = {"sync": [], "async": []}
        for round_index in range(ROUNDS):  # alternated, so machine noise hits both modes alike
            for mode in ("sync", "async"):
                experiment = f"{mode}-{round_index}"
                wall = asyncio.run(run(address, experiment, mode))
                run_dir = mesh.run_dir / "experiments" / experiment
                walls[mode].append(wall)
                results[mode] = {"wall_s": statistics.median(walls[mode]), "wall_s_per_round": walls[mode],
                                 **summarize(read_metrics(run_dir / "metrics.jsonl"))}
                log(f"{mode} round {round_index + 1}/{ROUNDS}: {wall:.1f} s for {STEPS} steps")
    results["async_speedup"] = results["sync"]["wall_s"] / results["async"]["wall_s"]
    results["load_average"] = os.getloadavg()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    log(f"async/sync speed-up {results['async_speedup']:.2f}x; wrote {RESULTS}")


if __name__ == "__main__":
    main()
