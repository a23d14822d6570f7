"""Where a weight sync's time goes, before and after pipelining: SmolLM2-135M (float32, 538 MB) from an actor
to one hf rollout replica over gloo on loopback, each a process of its own (`rlfabric serve`), the coordinator's
WeightSyncPlane driving the syncs. Writes bench/results/weight_sync_phases.json and weight_sync_phases.png.

    python -m bench.weight_sync_phases_bench [--syncs 5] [--rounds 2] [--old-source /tmp/old-ws/services]
                                             [--set weight_sync.bucket_mb=512 ...]   # config for both sides

Two sides, measured in turn in one run (old, new, old, new ... so both see the same machine load):
- old: the code before pipelining (an older checkout's services/ as `rlfabric`, --old-source; without it the
  side is skipped): PrepareWeightSync gathers, packs and checksums every bucket, then BroadcastWeights sends them.
- new: this checkout: PrepareWeightSync gathers and plans, BroadcastWeights packs bucket k+1 (and takes its
  CRC-32) while bucket k is on the wire, and the CRC-32s follow the last bucket.
Each sync reports the whole plane.sync (what timing_s/update_weights measures: gather, pack, checksum,
transfer, the replica's checks and switch) and the wire time: the actor's seconds inside the collective
(old: BroadcastWeights, which is only the collective; new: the wire phase it reports). The target (issue 31):
whole <= 1.5 x wire. The new side also reports every phase (gather, pack, checksum, wire on the actor; wire,
checksum, apply on the replica); the old side has no phase timers, so its PrepareWeightSync and ReceiveWeights
are timed from outside (the driver wraps the two client calls), and its switch is the replica's paused_seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "weight_sync_phases.json"
PLOT = RESULTS.with_suffix(".png")
TARGET = 1.5  # whole sync / wire time (issue 31)
DEFAULT_OLD_SOURCE = "/tmp/old-ws/services"  # `git worktree add /tmp/old-ws 8304435`


def log(message: str) -> None:
    print(f"[weight_sync_phases_bench] {message}", flush=True)


# -- one side, in a process whose `rlfabric` is that side's code --------------------------------------------

def serve(role: str, config_path: Path, workdir: Path, name: str, env: dict) -> tuple[subprocess.Popen, str]:
    port_file = workdir / f"{name}.ports.json"
    output = (workdir / f"{name}.log").open("ab")
    process = subprocess.Popen([sys.executable, "-m", "rlfabric", "serve", role, "--config", str(config_path),
                                "--port", "0", "--metrics-port", "0", "--port-file", str(port_file)],
                               stdout=output, stderr=output, env=env, cwd=workdir)
    while not port_file.exists():
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited; see {workdir / f'{name}.log'}")
        time.sleep(0.2)
    return process, f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"


class CallTimer:
    """Wall seconds of the last call of a client method, timed from outside (the old side has no phases)."""

    def __init__(self, cls, name: str):
        self.seconds = 0.0
        original = getattr(cls, name)

        async def timed(client, *args, **kwargs):
            started = time.perf_counter()
            try:
                return await original(client, *args, **kwargs)
            finally:
                self.seconds = time.perf_counter() - started

        setattr(cls, name, timed)


async def measure(actor_address: str, rollout_address: str, config, syncs: int) -> list[dict]:
    from rlfabric.actor.client import ActorClient
    from rlfabric.coordinator.weight_sync import WeightSyncPlane
    from rlfabric.core.client import wait_until_serving
    from rlfabric.rollout.client import RolloutClient

    for address in (actor_address, rollout_address):
        await wait_until_serving(address, timeout_s=600)
    prepare, receive = CallTimer(ActorClient, "prepare_weight_sync"), CallTimer(RolloutClient, "receive_weights")
    rows = []
    async with ActorClient(actor_address) as actor:
        plane = WeightSyncPlane(actor, {"rollout-0": rollout_address}, config)
        if await plane.open():
            raise RuntimeError("the replica did not join")
        for version in range(syncs + 1):  # version 0 warms up: first touch of every buffer
            report = await plane.sync(version)
            if not report.ok:
                raise RuntimeError(f"sync failed: {report.failed} {report.actor_error}")
            phases = getattr(report, "phases", None)  # the new side's
            row = {"whole_s": report.seconds, "bytes": report.num_bytes, "prepare_s": prepare.seconds,
                   "broadcast_s": report.broadcast_seconds, "receive_s": receive.seconds,
                   "paused_s": max(report.paused_seconds.values())}
            if phases is None:
                row["wire_s"] = report.broadcast_seconds
            else:
                row["wire_s"] = phases.wire
                row["phases"] = {**{k: v for k, v in report.phase_metrics().items()}}
            if version:
                rows.append(row)
        await plane.close()
    return rows


def run_side(out: Path, syncs: int, overrides: list[str]) -> None:
    """One side: its own services (this process's `rlfabric`), `syncs` syncs; rows to `out`."""
    import rlfabric
    from rlfabric.core.config import dump_config, load_config
    from rlfabric.trainer.pretrained import cached_model

    model = cached_model("smollm2")
    workdir = Path(tempfile.mkdtemp(prefix="rlfabric-ws-phases-"))
    config = load_config(None, [f"model.path={model}", "weight_sync.transport=gloo", "weight_sync.timeout_s=300",
                                "rollout.dtype=float32", *overrides])
    config_path = workdir / "run.yaml"
    dump_config(config, config_path)
    env = {**os.environ}
    processes = []
    try:
        actor, actor_address = serve("actor", config_path, workdir, "actor", env)
        processes.append(actor)
        rollout, rollout_address = serve("rollout", config_path, workdir, "rollout", env)
        processes.append(rollout)
        rows = asyncio.run(measure(actor_address, rollout_address, config, syncs))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)
    out.write_text(json.dumps({"source": str(Path(rlfabric.__file__).parent), "bucket_mb": config.weight_sync.bucket_mb,
                               "rows": rows}))


def side_process(side: str, old_source: str, syncs: int, workdir: Path, overrides: list[str]) -> dict:
    """Runs one side in a child process whose `rlfabric` is that side's code."""
    env = dict(os.environ)
    if side == "old":
        shim = workdir / "old-path"
        shim.mkdir(exist_ok=True)
        link = shim / "rlfabric"
        if not link.exists():
            link.symlink_to(old_source)
        env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT)])
    out = workdir / f"{side}-{time.monotonic_ns()}.json"
    subprocess.run([sys.executable, "-m", "bench.weight_sync_phases_bench", "--side", side, "--out", str(out),
                    "--syncs", str(syncs), *(f"--set={o}" for o in overrides)], check=True, env=env, cwd=ROOT)
    return json.loads(out.read_text())


# -- the comparison -----------------------------------------------------------------------------------------

def summary(rows: list[dict]) -> dict:
    ratios = [r["whole_s"] / r["wire_s"] for r in rows]
    best = min(range(len(rows)), key=lambda i: rows[i]["whole_s"])
    median = {key: round(statistics.median(r[key] for r in rows), 4)
              for key in ("whole_s", "wire_s", "prepare_s", "broadcast_s", "receive_s", "paused_s")}
    out = {"syncs": len(rows), "median": median, "whole_over_wire_median": round(statistics.median(ratios), 3),
           "whole_over_wire_best_sync": round(ratios[best], 3), "gb_s_wire": round(rows[best]["bytes"] /
                                                                                  rows[best]["wire_s"] / 1e9, 3)}
    if "phases" in rows[0]:
        out["phases_median"] = {k.rsplit("/", 1)[1]: round(statistics.median(r["phases"][k] for r in rows), 4)
                                for k in rows[0]["phases"]}
    return out


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [s for s in ("old", "new") if s in result["sides"]]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = {"gather": "#8c564b", "pack": "#1f77b4", "checksum": "#ff7f0e", "wire": "#2ca02c",
              "receive_wire": "#98df8a", "receive_checksum": "#ffbb78", "apply": "#9467bd",
              "prepare (gather + pack + checksum)": "#17becf", "receive tail (checksum + apply)": "#c5b0d5"}
    for x, side in enumerate(sides):
        stats = result["sides"][side]
        if "phases_median" in stats:
            parts = [(name, stats["phases_median"][name]) for name in
                     ("gather", "pack", "checksum", "wire", "receive_checksum", "apply")]
        else:
            median = stats["median"]
            parts = [("prepare (gather + pack + checksum)", median["prepare_s"]), ("wire", median["wire_s"]),
                     ("receive tail (checksum + apply)", max(0.0, median["receive_s"] - median["broadcast_s"]))]
        bottom = 0.0
        for name, seconds in parts:
            ax.bar(x - 0.18, seconds, 0.34, bottom=bottom, color=colors[name], label=name)
            bottom += seconds
        ax.bar(x + 0.18, stats["median"]["whole_s"], 0.34, color="#444444", label="whole sync (wall)")
        ax.hlines(TARGET * stats["median"]["wire_s"], x + 0.01, x + 0.35, colors="red", linestyles="--",
                  label=f"{TARGET} x wire (target)")
        ax.text(x + 0.18, stats["median"]["whole_s"], f"{stats['whole_over_wire_median']:.2f} x wire",
                ha="center", va="bottom", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xticks(range(len(sides)), [f"{s}\n({result['sides'][s]['bucket_mb']} MiB buckets)" for s in sides])
    ax.set_ylabel("seconds (median sync)")
    ax.set_title(f"Weight sync of SmolLM2-135M ({result['bytes'] / 1e6:.0f} MB) over gloo: phases "
                 "(busy time; pipelined phases overlap) and wall time", fontsize=9)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--old-source", default=DEFAULT_OLD_SOURCE,
                        help="services/ of a checkout before pipelining (git worktree add /tmp/old-ws 8304435)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--side", choices=["old", "new"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
    if args.side:
        return run_side(args.out, args.syncs, args.set)
    sides = ["old", "new"] if Path(args.old_source, "weight_sync").is_dir() else ["new"]
    if sides == ["new"]:
        log(f"no older checkout at {args.old_source}: measuring this one alone")
    workdir = Path(tempfile.mkdtemp(prefix="rlfabric-ws-phases-bench-"))
    rows: dict[str, list[dict]] = {side: [] for side in sides}
    buckets: dict[str, int] = {}
    try:
        for round_ in range(args.rounds):
            for side in sides:
                log(f"round {round_ + 1}/{args.rounds}: {side}")
                measured = side_process(side, args.old_source, args.syncs, workdir, args.set)
                rows[side] += measured["rows"]
                buckets[side] = measured["bucket_mb"]
                log(f"  whole / wire: {[round(r['whole_s'] / r['wire_s'], 2) for r in measured['rows']]}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    import torch

    result = {
        "model": "SmolLM2-135M (float32)", "transport": "gloo, loopback, actor -> 1 hf replica",
        "bytes": rows["new"][0]["bytes"], "target_whole_over_wire": TARGET, "overrides": args.set,
        "sides": {side: {"bucket_mb": buckets[side], **summary(rows[side]), "rows": rows[side]} for side in sides},
        "machine": platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    plot(result)
    for side in sides:
        stats = result["sides"][side]
        log(f"{side}: whole {stats['median']['whole_s']} s, wire {stats['median']['wire_s']} s, whole / wire "
            f"{stats['whole_over_wire_median']} (target <= {TARGET})")
    log(f"wrote {RESULTS} and {PLOT}")


if __name__ == "__main__":
    main()
