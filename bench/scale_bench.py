"""The control plane as the cluster grows: the real coordinator against N = 1, 8, 64, 256 simulated rollout replicas
(rollout.engine sim) and a simulated 7B actor. Writes bench/results/scale.json and scale.png.

    python -m bench.scale_bench                     # the default grid (make bench BENCH=scale)
    python -m bench.scale_bench --replicas 8 256 --prompts 1024 --merge    # more points into scale.json
    python -m bench.scale_bench ... --reference OTHER/scale.json   # plus another checkout's points, dashed

Each point is its own mesh of processes on loopback: `rlfabric serve rollout --replicas N` (every replica in one
process, a port each), `serve actor` (sim), `serve reward` and `serve coordinator`, driven by a CoordinatorClient.
Per step it records:
    coordinator_cpu_s         the coordinator process's CPU seconds (user + system, psutil) from one step's metrics
                              to the next (median); coordinator_cpu_s_run: over the whole run (its start, the
                              first sync and the first step included) / steps
    coordinator_overhead_s    timing_s/step - (gen + old_log_prob + adv + update + update_weights): the loop's own
                              wall time outside the phases that wait on a role
    coordinator_peak_rss_mb   the coordinator process's resident high-water mark (VmHWM)
    router_balance            max / mean of the tokens each replica generated (rlfabric_rollout_generated_tokens_total)
    after_last_sample_s       timing_s/step - gen - update - update_weights: from the step's last sample to the
                              update's start, plus the bookkeeping after the sync
    series_per_replica        sample lines on one replica's /metrics
The simulated generation is ~60 s at 256 replicas and 4,096 x 16 samples of ~512 tokens; sim.time_scale shrinks it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from itertools import pairwise
from pathlib import Path

import psutil

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions, wait_until_serving
from rlfabric.core.config import dump_config, load_config
from rlfabric.data.prep import write_synthetic
from rlfabric.v1 import coordinator_pb2

RESULTS = Path(__file__).parent / "results" / "scale.json"
PLOT = RESULTS.with_suffix(".png")
PHASES = ("gen", "old_log_prob", "adv", "update", "update_weights")
SIM = ["rollout.engine=sim", "actor.engine=sim", "reference.enable=false", "sim.trainer.parameters=7000000000",
       "sim.trainer.gpus=64", "weight_sync.transport=grpc", "trainer.progress_bar=false", "trainer.plot=false",
       "trainer.loggers=[jsonl]", "trainer.save_final=false", "trainer.export_final=false",
       "sim.rollout.response_length_mean=512", "data.max_response_length=1024", "rollout.max_num_seqs=256"]


def log(message: str) -> None:
    print(f"[scale_bench] {message}", flush=True)


def serve(role: str, config_path: Path, run_dir: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    ports = run_dir / "ports" / role
    ports.mkdir(parents=True, exist_ok=True)
    port_file = ports / ("{replica}.json" if "--replicas" in extra else "0.json")
    command = [sys.executable, "-m", "rlfabric", "serve", role, "--config", str(config_path), "--port", "0",
               "--metrics-port", "0", "--port-file", str(port_file), *extra]
    log_file = open(run_dir / f"{role}.log", "ab")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True), ports


def await_ports(process: subprocess.Popen, ports: Path, count: int, timeout: float = 300) -> list[dict]:
    deadline = time.monotonic() + timeout
    while len(list(ports.glob("*.json"))) < count:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{ports.name}: {len(list(ports.glob('*.json')))} of {count} port files "
                               f"(exit {process.poll()})")
        time.sleep(0.1)
    return [json.loads(path.read_text()) for path in sorted(ports.glob("*.json"), key=lambda p: int(p.stem))]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def scrape(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        return [line for line in answer.read().decode().splitlines() if line and not line.startswith("#")]


def generated_tokens(lines: list[str]) -> float:
    return sum(float(line.split()[-1]) for line in lines if line.startswith("rlfabric_rollout_generated_tokens_total"))


async def drive(address: str, options: ChannelOptions, steps: int, mode: str, cpu: psutil.Process) -> list[dict]:
    """The run's metrics, step by step, each with the coordinator's CPU seconds so far (cpu_s)."""
    async with CoordinatorClient(address, dataclasses.replace(options, timeout_s=3600)) as client:
        await client.start_run([f"trainer.total_steps={steps}", f"trainer.mode={mode}", "trainer.resume=disable"])
        records = []
        async for update in client.stream_metrics():
            times = cpu.cpu_times()
            records.append({**update.metrics, "cpu_s": times.user + times.system})
            log(f"  step {update.step}: {update.metrics['timing_s/step']:.2f} s")
        status = await client.run_status()
        if status.state != coordinator_pb2.RUN_STATE_COMPLETED:
            raise RuntimeError(f"run ended {status.state}: {status.error}")
        return records


def point(replicas: int, prompts: int, n: int, steps: int, mode: str, time_scale: float) -> dict:
    """One mesh, one run; the figures of its steps after the first."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"scale-{replicas}-"))
    # The quickstart task as data.builtin_task writes it, but as many rows as the steps take (its 2,048 by default).
    data = write_synthetic(run_dir / "data" / "bench", train_size=max(2048, prompts * steps))
    config = load_config(None, [*SIM, f"data.train_files=[{data['train']}]", f"data.val_files=[{data['val']}]",
                                f"rollout.replicas={replicas}", f"data.train_batch_size={prompts}",
                                f"actor.ppo_mini_batch_size={prompts}", f"rollout.n={n}",
                                f"sim.time_scale={time_scale}", f"trainer.run_dir={run_dir}",
                                f"storage.root={run_dir}"])
    from rlfabric.launch.local import prepare_run_dir

    worker_config = prepare_run_dir(config, run_dir)
    processes = []
    try:
        rollout, rollout_ports = serve("rollout", worker_config, run_dir, "--replicas", str(replicas))
        actor, actor_ports = serve("actor", worker_config, run_dir)
        reward, reward_ports = serve("reward", worker_config, run_dir)
        processes += [rollout, actor, reward]
        replica_ports = await_ports(rollout, rollout_ports, replicas)
        for role, process, ports in (("actor", actor, actor_ports), ("reward", reward, reward_ports)):
            setattr(config.cluster, role, [f"127.0.0.1:{await_ports(process, ports, 1)[0]['grpc']}"])
        config.cluster.rollout = [f"127.0.0.1:{p['grpc']}" for p in replica_ports]
        resolved = run_dir / "config.resolved.yaml"
        dump_config(config, resolved)
        coordinator, coordinator_ports = serve("coordinator", resolved, run_dir)
        processes.append(coordinator)
        address = f"127.0.0.1:{await_ports(coordinator, coordinator_ports, 1)[0]['grpc']}"
        options = ChannelOptions.from_config(config)
        asyncio.run(wait_until_serving(address, options, timeout_s=120))
        cpu = psutil.Process(coordinator.pid)
        before = cpu.cpu_times()
        started = time.perf_counter()
        records = asyncio.run(drive(address, options, steps, mode, cpu))
        wall = time.perf_counter() - started
        after = cpu.cpu_times()
        tokens = [generated_tokens(scrape(p["metrics"])) for p in replica_ports]
        series = len(scrape(replica_ports[0]["metrics"]))
        timed = records[1:] or records
        overhead = [r["timing_s/step"] - sum(r.get(f"timing_s/{p}", 0.0) for p in PHASES) for r in timed]
        after_last = [r["timing_s/step"] - r["timing_s/gen"] - r["timing_s/update"] - r["timing_s/update_weights"]
                      for r in timed]
        return {
            "replicas": replicas, "prompts": prompts, "n": n, "samples": prompts * n, "mode": mode, "steps": steps,
            "time_scale": time_scale, "wall_s": round(wall, 2),
            "step_s_median": statistics.median(r["timing_s/step"] for r in timed),
            "gen_s_median": statistics.median(r["timing_s/gen"] for r in timed),
            "coordinator_cpu_s_per_step": statistics.median(
                later["cpu_s"] - earlier["cpu_s"] for earlier, later in pairwise(records)) if steps > 1
                else after.user + after.system - before.user - before.system,
            "coordinator_cpu_s_run": (after.user + after.system - before.user - before.system) / steps,
            "coordinator_overhead_s_median": statistics.median(overhead),
            "coordinator_peak_rss_mb": peak_rss_mb(coordinator.pid),
            "router_balance": max(tokens) / (sum(tokens) / len(tokens)) if sum(tokens) else 0.0,
            "after_last_sample_s_median": statistics.median(after_last),
            "series_per_replica": series,
            "response_length_mean": statistics.median(r["response_length/mean"] for r in timed),
        }
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def plot(points: list[dict], reference: dict | None = None) -> None:
    """Each figure against the replicas, a line per batch size and mode; `reference`'s points dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("coordinator_cpu_s_per_step", "coordinator_overhead_s_median", "coordinator_peak_rss_mb",
            "router_balance", "after_last_sample_s_median", "series_per_replica")
    figure, axes = plt.subplots(2, 3, figsize=(13, 7))
    series = [(points, "o-", "")]
    if reference:
        series.append((reference["points"], "x--", f" ({reference['label']})"))
    for key, ax in zip(keys, axes.flat, strict=True):
        for these, style, suffix in series:
            for (samples, mode) in sorted({(p["samples"], p["mode"]) for p in these}):
                line = sorted((p for p in these if p["samples"] == samples and p["mode"] == mode),
                              key=lambda p: p["replicas"])
                ax.plot([p["replicas"] for p in line], [p.get(key, float("nan")) for p in line], style,
                        label=f"{samples} samples, {mode}{suffix}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rollout replicas")
        ax.set_title(key, fontsize=9)
    axes.flat[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(PLOT, dpi=90)


def _key(point: dict) -> tuple:
    return point["replicas"], point["samples"], point["mode"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--prompts", type=int, nargs="+", default=[256])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["sync"])
    parser.add_argument("--time-scale", type=float, default=0.01)
    parser.add_argument("--merge", action="store_true",
                        help="add the points to scale.json (replacing those of the same replicas, batch and mode)")
    parser.add_argument("--reference", type=Path, metavar="SCALE_JSON",
                        help="keep another run's points (e.g. an earlier commit's scale.json) beside these, and plot them")
    parser.add_argument("--reference-label", default="before")
    args = parser.parse_args()
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    reference = previous.get("reference")
    if args.reference:
        reference = {"label": args.reference_label, "points": json.loads(args.reference.read_text())["points"]}
    points = []
    for prompts in args.prompts:
        for mode in args.modes:
            for replicas in args.replicas:
                log(f"{replicas} replicas, {prompts} x {args.n} samples, {mode}")
                points.append(point(replicas, prompts, args.n, args.steps, mode, args.time_scale))
                points[-1]["load_average"] = list(os.getloadavg())
                log(f"  {json.dumps(points[-1])}")
    if args.merge and previous:
        ours = {_key(p) for p in points}
        points = sorted([p for p in previous["points"] if _key(p) not in ours] + points,
                        key=lambda p: (p["mode"], p["samples"], p["replicas"]))
    RESULTS.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                                   "points": points, **({"reference": reference} if reference else {})}, indent=1))
    plot(points, reference)
    log(f"wrote {RESULTS} and {PLOT}")


if __name__ == "__main__":
    main()
