"""Relay between replicas (weight_sync.relay chain) against direct pushes, over the gRPC stream on loopback: an actor
and N hf rollout replicas, each a process of its own (`rlfabric serve`), the coordinator's WeightSyncPlane driving.
Writes bench/results/weight_sync_relay.json and bench/results/weight_sync_relay.png.

    python -m bench.weight_sync_relay_bench [--rounds 3] [--replicas 1 --replicas 2 ...] [--model tiny|smollm2]

For each model (the tiny test model at N = 1, 2, 4, 8; SmolLM2-135M at N = 1, 4 with --model smollm2 or by
default), one actor and max(N) replicas are started once; for each N the plane syncs the first N replicas, relay
chain and direct alternated for --rounds rounds (full weights every time), and records per sync:
- seconds: the whole plane.sync (pack, the pushes, every replica's checks and switch);
- egress ratio: the bytes the actor itself sent (weight_sync/actor_egress_bytes) over the model's bytes;
- each replica's receive (wire) seconds, in chain order (the per-hop figure).
Targets (issue 49), SmolLM2 on 4 replicas against 1: sync time ratio <= 2.0, actor egress / model bytes <= 1.25.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.weight_sync_delta_bench import actor_and_replicas

RESULTS = Path(__file__).parent / "results" / "weight_sync_relay.json"
PLOT = RESULTS.with_suffix(".png")
REPLICAS = {"tiny": (1, 2, 4, 8), "smollm2": (1, 4)}
TARGETS = {"time_ratio_4_vs_1": 2.0, "egress_ratio": 1.25}  # SmolLM2, 4 hf replicas against 1 (issue 49)
MODES = ("chain", "none")


def log(message: str) -> None:
    print(f"[weight_sync_relay_bench] {message}", flush=True)


def model_path(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from rlfabric.quickstart.tiny_model import make_tiny_model

        return make_tiny_model(workdir / "tiny")
    from rlfabric.trainer.pretrained import cached_model

    return cached_model(name)


def plane_config(model: Path, relay: str):
    from rlfabric.core.config import load_config

    return load_config(None, [f"model.path={model}", "weight_sync.transport=grpc", f"weight_sync.relay={relay}",
                              "weight_sync.timeout_s=300", "rollout.dtype=bfloat16", "rollout.n=1"])


async def measure(actor_address: str, rollouts: list[str], model: Path, counts: tuple[int, ...],
                  rounds: int) -> dict:
    from rlfabric.actor.client import ActorClient
    from rlfabric.coordinator.weight_sync import WeightSyncPlane
    from rlfabric.core.client import ChannelOptions, wait_until_serving

    for address in (actor_address, *rollouts):
        await wait_until_serving(address, timeout_s=600)
    results: dict = {}
    version = 0
    async with ActorClient(actor_address, ChannelOptions(timeout_s=1800)) as client:
        for count in counts:
            addresses = {f"rollout-{i}": address for i, address in enumerate(rollouts[:count])}
            planes = {mode: WeightSyncPlane(client, addresses, plane_config(model, mode)) for mode in MODES}
            rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
            for mode, plane in planes.items():
                if await plane.open():
                    raise RuntimeError(f"a replica did not join ({mode}, N={count})")
                version += 1
                await plane.sync(version)  # warm-up: first touch of every buffer on both ends
            for _ in range(rounds):
                for mode, plane in planes.items():
                    version += 1
                    report = await plane.sync(version)
                    if not report.ok:
                        raise RuntimeError(f"{mode} sync {version} (N={count}) failed: {report.failed}")
                    rows[mode].append({"seconds": report.seconds, "bytes": report.num_bytes,
                                       "egress_bytes": report.egress_bytes,
                                       "egress_ratio": report.egress_bytes / report.num_bytes,
                                       "hop_wire_s": [report.hop_seconds[name] for name in addresses]})
            for plane in planes.values():
                await plane.close()
            results[str(count)] = {mode: {"median_s": statistics.median(r["seconds"] for r in mode_rows),
                                          "egress_ratio": statistics.median(r["egress_ratio"] for r in mode_rows),
                                          "rows": mode_rows} for mode, mode_rows in rows.items()}
            log(f"N={count}: " + ", ".join(f"{mode} {results[str(count)][mode]['median_s']:.3f} s, egress "
                                           f"{results[str(count)][mode]['egress_ratio']:.2f}x" for mode in MODES))
    return results


def run_model(name: str, counts: tuple[int, ...], rounds: int) -> dict:
    from rlfabric.core.config import dump_config, load_config

    workdir = Path(tempfile.mkdtemp(prefix="rlfabric-ws-relay-"))
    try:
        model = model_path(name, workdir)
        config = load_config(None, [f"model.path={model}", "weight_sync.timeout_s=300", "rollout.dtype=bfloat16",
                                    "rollout.n=1", "rollout.max_num_seqs=4"])
        config_path = workdir / "run.yaml"
        dump_config(config, config_path)
        with actor_and_replicas(config_path, workdir, max(counts)) as (actor, rollouts):
            results = asyncio.run(measure(actor, rollouts, model, counts, rounds))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    one = results[str(counts[0])]["none"]["median_s"]
    return {"replicas": results, "model_bytes": results[str(counts[0])]["none"]["rows"][0]["bytes"],
            "time_ratio_vs_1": {count: {mode: results[count][mode]["median_s"] / one for mode in MODES}
                                for count in results}}


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    figure, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    for (seconds, egress), name in zip(axes, models, strict=True):
        measured = result["models"][name]["replicas"]
        counts = [int(count) for count in measured]
        for mode, label in (("chain", "relay chain"), ("none", "direct")):
            seconds.plot(counts, [measured[str(c)][mode]["median_s"] for c in counts], marker="o", label=label)
            egress.plot(counts, [measured[str(c)][mode]["egress_ratio"] for c in counts], marker="o", label=label)
        seconds.set(xlabel="rollout replicas (N)", ylabel="sync seconds (median)", title=f"{name}: whole sync")
        egress.set(xlabel="rollout replicas (N)", ylabel="actor egress / model bytes", title=f"{name}: actor egress")
        for panel in (seconds, egress):
            panel.set_xticks(counts)
            panel.grid(alpha=0.3)
            panel.legend(fontsize=8)
    figure.suptitle("weight sync over gRPC on loopback: relay chain against direct pushes (hf replicas)", fontsize=10)
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    figure.savefig(PLOT, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", action="append", choices=sorted(REPLICAS), help="default: all")
    parser.add_argument("--replicas", type=int, action="append", help="replica counts (default per model)")
    args = parser.parse_args(argv)
    result = {"transport": "grpc, loopback, hf replicas (bfloat16), each service a process",
              "targets_smollm2": TARGETS, "rounds": args.rounds, "cpus": os.cpu_count(),
              "machine": platform.machine(), "models": {}}
    if args.model and RESULTS.exists():  # the models not measured now keep their last figures
        result["models"] = json.loads(RESULTS.read_text()).get("models", {})
    for name in args.model or list(REPLICAS):
        counts = tuple(sorted(args.replicas)) if args.replicas else REPLICAS[name]
        log(f"{name}: N = {', '.join(map(str, counts))}")
        result["models"][name] = run_model(name, counts, args.rounds)
    result["load_average"] = os.getloadavg()
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    plot(result)
    log(f"wrote {RESULTS} and {PLOT}")


if __name__ == "__main__":
    main()
