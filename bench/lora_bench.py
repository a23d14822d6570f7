"""LoRA weight sync: adapter-only syncs (weight_sync.lora adapter) against merged full-weight syncs
(weight_sync.lora merged) of the same LoRA actor, in bytes and seconds, over gloo and grpc on loopback,
on the tiny test model and the real SmolLM2-135M. Writes bench/results/lora.json.

    python -m bench.lora_bench [--models tiny,smollm2] [--rank 16] [--repeats 3]

Every service is its own process (`rlfabric serve`), as in a deployment: one actor with actor.lora
(all-linear, float32) and one hf rollout replica; the coordinator's WeightSyncPlane drives the syncs.
Per (model, mode, transport): the bytes one sync moves to the replica, and the best of `repeats` syncs
after a warm-up for
- sync seconds: the whole plane.sync (the actor's gather: adapters alone, or every weight and the merge;
  pack + CRC; transfer; the replica's checks and switch);
- broadcast seconds: the actor's BroadcastWeights (gloo: the bytes on the wire; grpc: until the replica
  answered, its switch included);
- paused seconds: how long the replica held generation for the switch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.weight_sync_bench import serve

RESULTS = Path(__file__).parent / "results" / "lora.json"
MODES = ("adapter", "merged")
TRANSPORTS = ("gloo", "grpc")


def model_path(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from rlfabric.quickstart.tiny_model import make_tiny_model

        return make_tiny_model(workdir / "tiny")
    from rlfabric.actor.pretrained import cached_model

    return Path(cached_model(name))


async def measure(actor_address: str, rollout_address: str, config, repeats: int) -> list[dict]:
    from rlfabric.actor.client import ActorClient
    from rlfabric.coordinator.weight_sync import WeightSyncPlane
    from rlfabric.core.client import wait_until_serving

    for address in (actor_address, rollout_address):
        await wait_until_serving(address, timeout_s=600)
    rows, version = [], 0
    async with ActorClient(actor_address) as actor:
        for transport in TRANSPORTS:
            run_config = config.model_copy(update={"weight_sync": config.weight_sync.model_copy(
                update={"transport": transport})})
            plane = WeightSyncPlane(actor, {"rollout-0": rollout_address}, run_config)
            assert await plane.open() == {}
            reports = []
            for _ in range(repeats + 1):  # the first is a warm-up (first touch of every buffer)
                version += 1
                report = await plane.sync(version)
                if not report.ok:
                    raise RuntimeError(f"sync failed: {report.failed} {report.actor_error}")
                reports.append(report)
            await plane.close()
            reports = reports[1:]
            best = min(reports, key=lambda r: r.seconds)
            rows.append({
                "transport": transport, "bytes": best.num_bytes,
                "sync_seconds": round(best.seconds, 4), "broadcast_seconds": round(best.broadcast_seconds, 4),
                "paused_seconds": round(max(best.paused_seconds.values()), 4),
                "all_sync_seconds": [round(r.seconds, 4) for r in reports],
            })
    return rows


def run_mode(name: str, model: Path, mode: str, rank: int, repeats: int, workdir: Path) -> list[dict]:
    from rlfabric.core.config import dump_config, load_config

    config = load_config(None, [f"model.path={model}", f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}",
                                f"weight_sync.lora={mode}", "weight_sync.timeout_s=300", "model.dtype=float32"])
    assert config.syncs_lora_adapters() == (mode == "adapter")
    config_path = workdir / f"{name}-{mode}.yaml"
    dump_config(config, config_path)
    processes = []
    try:
        actor, actor_address = serve("actor", config_path, workdir, f"actor-{name}-{mode}")
        processes.append(actor)
        rollout, rollout_address = serve("rollout", config_path, workdir, f"rollout-{name}-{mode}")
        processes.append(rollout)
        return asyncio.run(measure(actor_address, rollout_address, config, repeats))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (all-linear, alpha = 2 x rank)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])

    import torch

    workdir = Path(tempfile.mkdtemp(prefix="rlfabric-lora-bench-"))
    results = []
    try:
        for name in args.models.split(","):
            model = model_path(name, workdir)
            parameters = sum(f.stat().st_size for f in model.glob("*.safetensors"))
            rows = {mode: run_mode(name, model, mode, args.rank, args.repeats, workdir) for mode in MODES}
            for adapter, merged in zip(rows["adapter"], rows["merged"], strict=True):
                entry = {"model": name, "model_bytes": parameters, "transport": adapter["transport"],
                         "adapter": adapter, "merged": merged,
                         "bytes_ratio": round(merged["bytes"] / adapter["bytes"], 1),
                         "sync_speedup": round(merged["sync_seconds"] / adapter["sync_seconds"], 1)}
                results.append(entry)
                print(f"{name} {entry['transport']}: adapter {adapter['bytes']:,} B in {adapter['sync_seconds']} s, "
                      f"merged {merged['bytes']:,} B in {merged['sync_seconds']} s ({entry['bytes_ratio']} x the "
                      f"bytes, {entry['sync_speedup']} x the time)", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "lora": {"rank": args.rank, "alpha": 2 * args.rank, "target_modules": "all-linear"},
        "dtype": "float32", "rollout_engine": "hf", "repeats": args.repeats, "results": results,
        "machine": platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
