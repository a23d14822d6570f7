"""LoRA against full weights, in two parts, both written to bench/results/lora.json (a part run alone
keeps the other's figures):

- sync: adapter-only syncs (weight_sync.lora adapter) against merged full-weight syncs (weight_sync.lora
  merged) of the same LoRA actor, in bytes and seconds, over gloo and grpc on loopback, on the tiny test
  model and the real SmolLM2-135M;
- steps: GRPO step time on SmolLM2-135M with and without LoRA, the same workload one run after the other
  (see step_times).

    python -m bench.lora_bench [--parts sync,steps] [--models tiny,smollm2] [--rank 16] [--repeats 3]

Every service is its own process (`rlfabric serve`), as in a deployment: one actor with actor.lora
(all-linear, float32) and one hf rollout replica; the coordinator's WeightSyncPlane drives the syncs.
Sync, per (model, mode, transport): the bytes one sync moves to the replica, and the best of `repeats`
syncs after a warm-up for
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.weight_sync_bench import serve

RESULTS = Path(__file__).parent / "results" / "lora.json"
MODES = ("adapter", "merged")
TRANSPORTS = ("gloo", "grpc")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2_arithmetic.yaml"
# The step-time workload: the real-model example (vLLM rollout, gloo sync, float32), made smaller.
STEP_WORKLOAD = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4",
                 "data.max_response_length=32", "trainer.total_steps=4", "rollout.seed=0",
                 "trainer.progress_bar=false", "trainer.plot=false", "trainer.export_final=false"]
STEP_PHASES = ("step", "gen", "old_log_prob", "ref", "update", "update_weights")


def model_path(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from rlfabric.quickstart.tiny_model import make_tiny_model

        return make_tiny_model(workdir / "tiny")
    from rlfabric.trainer.pretrained import cached_model

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


def step_times(rank: int, workdir: Path, omp_threads: int = 0) -> dict:
    """`rlfabric train examples/smollm2_arithmetic.yaml` with STEP_WORKLOAD, once with full weights and once
    with actor.lora (rank, alpha 2 x rank, all-linear; adapter-only sync into vLLM's LoRA support), one
    after the other. Per run: the mean of each timing_s/ phase over the steps after the first (the first
    step also pays first-call costs), weight-sync bytes, mean response length, the load average at its
    end. Ratios: LoRA over full. omp_threads > 0: every service's OMP_NUM_THREADS (torch's CPU threads;
    vLLM's worker binds its own); 0: torch's default, one per core."""
    variants = {"full": [], "lora": [f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}"]}
    environment = {**os.environ, **({"OMP_NUM_THREADS": str(omp_threads)} if omp_threads else {})}
    runs = {}
    for name, overrides in variants.items():
        run_dir = workdir / f"steps-{name}"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "rlfabric", "train", str(EXAMPLE), "--run-dir", str(run_dir),
                               *STEP_WORKLOAD, *overrides], capture_output=True, text=True, timeout=1800,
                              env=environment)
        if done.returncode != 0:
            raise RuntimeError(f"the {name} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        later = records[1:]
        runs[name] = {
            "overrides": overrides,
            "seconds_by_phase": {phase: round(sum(r.get(f"timing_s/{phase}", 0.0) for r in later) / len(later), 3)
                                 for phase in STEP_PHASES},
            "step_seconds_by_step": [round(r["timing_s/step"], 2) for r in records],
            "sync_bytes": round(records[-1]["weight_sync/gbytes"] * 1e9),
            "response_length_mean": round(sum(r["response_length/mean"] for r in later) / len(later), 1),
            "run_seconds": round(time.perf_counter() - started, 1),
            "load_average_after": os.getloadavg(),
        }
        print(f"steps {name}: {runs[name]['seconds_by_phase']} (responses {runs[name]['response_length_mean']} "
              f"tokens, sync {runs[name]['sync_bytes']:,} B)", flush=True)
    full, lora = runs["full"]["seconds_by_phase"], runs["lora"]["seconds_by_phase"]
    ratios = {phase: round(lora[phase] / full[phase], 2) for phase in STEP_PHASES if full[phase] > 0 and lora[phase] > 0}
    print(f"steps lora / full: {ratios}", flush=True)
    return {"workload": STEP_WORKLOAD, "example": EXAMPLE.name, "rank": rank, "alpha": 2 * rank,
            "rollout_engine": "vllm", "omp_threads": omp_threads or "default", "runs": runs, "lora_over_full": ratios}


def sync_results(models: list[str], rank: int, repeats: int, workdir: Path) -> list[dict]:
    results = []
    for name in models:
        model = model_path(name, workdir)
        parameters = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        rows = {mode: run_mode(name, model, mode, rank, repeats, workdir) for mode in MODES}
        for adapter, merged in zip(rows["adapter"], rows["merged"], strict=True):
            entry = {"model": name, "model_bytes": parameters, "transport": adapter["transport"],
                     "adapter": adapter, "merged": merged,
                     "bytes_ratio": round(merged["bytes"] / adapter["bytes"], 1),
                     "sync_speedup": round(merged["sync_seconds"] / adapter["sync_seconds"], 1)}
            results.append(entry)
            print(f"{name} {entry['transport']}: adapter {adapter['bytes']:,} B in {adapter['sync_seconds']} s, "
                  f"merged {merged['bytes']:,} B in {merged['sync_seconds']} s ({entry['bytes_ratio']} x the "
                  f"bytes, {entry['sync_speedup']} x the time)", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="sync,steps", help="comma-separated: sync, steps")
    parser.add_argument("--models", default="tiny,smollm2", help="sync part, comma-separated: tiny, smollm2")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (all-linear, alpha = 2 x rank)")
    parser.add_argument("--repeats", type=int, default=3, help="sync part: syncs measured per configuration")
    parser.add_argument("--omp-threads", type=int, default=0, help="steps part: OMP_NUM_THREADS of the services "
                        "(0: torch's default); results go under step_time_omp<N>")
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
    parts = args.parts.split(",")

    import torch

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    workdir = Path(tempfile.mkdtemp(prefix="rlfabric-lora-bench-"))
    machine = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__}
    try:
        if "sync" in parts:
            results.update({
                "lora": {"rank": args.rank, "alpha": 2 * args.rank, "target_modules": "all-linear"},
                "dtype": "float32", "rollout_engine": "hf", "repeats": args.repeats,
                "results": sync_results(args.models.split(","), args.rank, args.repeats, workdir),
                **machine, "load_average": os.getloadavg(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            })
        if "steps" in parts:
            key = f"step_time_omp{args.omp_threads}" if args.omp_threads else "step_time"
            results[key] = {**step_times(args.rank, workdir, args.omp_threads), **machine,
                            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
