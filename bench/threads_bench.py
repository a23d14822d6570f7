"""Torch threads per service: the local launcher's old default (each service takes every core: torch's own
default) against the new one (the cores shared by the torch services, launcher.threads_per_service=0), side
by side on the quickstart. Writes bench/results/threads.json.

    python -m bench.threads_bench

Per setting and round: a fresh mesh, one quickstart run (15 steps, sync), the median step time
(timing_s/step, step 1 left out: warm-up) and the actor's update time. The settings alternate over the rounds
so machine noise hits them alike; the load average is recorded, since other work on the machine skews both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench.async_bench import run
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import load_config
from rlfabric.launch.local import LocalMesh

RESULTS = Path(__file__).parent / "results" / "threads.json"
SETTINGS = {"old: every core per service": len(os.sched_getaffinity(0)), "new: cores shared (auto)": 0}
STEPS, ROUNDS = 15, 2


def measure_once(threads: int, root: Path) -> dict:
    config = load_config(None, [f"launcher.threads_per_service={threads}", "trainer.progress_bar=false",
                                "trainer.plot=false", "trainer.export_final=false", "trainer.save_final=false"])
    with LocalMesh(config, root) as mesh:
        omp = {proc.name: _omp_threads(proc.process.pid) for proc in mesh.processes}
        options = dataclasses.replace(ChannelOptions.from_config(config), timeout_s=1800)
        wall, steps = asyncio.run(run(mesh.endpoints["coordinator"][0]["grpc"], options, "threads", "sync", 0, STEPS))
    timed = steps[1:]
    return {"omp_num_threads": omp, "wall_s": wall, "load_average": os.getloadavg(),
            "median_step_s": statistics.median(s["timing_s/step"] for s in timed),
            "median_update_s": statistics.median(s.get("timing_s/update", 0.0) for s in timed)}


def _omp_threads(pid: int) -> str:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in entries if e.startswith(b"OMP_NUM_THREADS=")), "unset")


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="threads-bench-"))
    rounds: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for index in range(ROUNDS):
        for name, threads in SETTINGS.items():
            rounds[name].append(measure_once(threads, root / f"{index}-{threads}"))
            print(f"[threads_bench] round {index + 1} {name}: {rounds[name][-1]}", flush=True)
    results = {"cpus": len(os.sched_getaffinity(0)), "steps": STEPS, "settings": {
        name: {"median_step_s": statistics.median(r["median_step_s"] for r in runs),
               "median_update_s": statistics.median(r["median_update_s"] for r in runs), "rounds": runs}
        for name, runs in rounds.items()}}
    old, new = (results["settings"][name] for name in SETTINGS)
    results["step_speedup_new_vs_old"] = old["median_step_s"] / new["median_step_s"]
    results["update_speedup_new_vs_old"] = old["median_update_s"] / new["median_update_s"]
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"[threads_bench] step {old['median_step_s']:.3f} s -> {new['median_step_s']:.3f} s "
          f"({results['step_speedup_new_vs_old']:.2f}x); update {results['update_speedup_new_vs_old']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
