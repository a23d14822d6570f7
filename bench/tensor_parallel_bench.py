"""Tensor-parallel rollout (rollout.tensor_parallel_size) on this CPU host: a vLLM replica at TP=T next to TP=1,
for the tiny model (T=2) and SmolLM2-135M (T=3: its 9 attention heads do not split in 2). Writes
bench/results/tensor_parallel.json.

    python -m bench.tensor_parallel_bench [--models tiny smollm2]

Every service is its own process (`rlfabric serve actor`, `rlfabric serve rollout`). Per (model, T):
- start_s: until the replica answers readiness (process start, vLLM's T workers, model load, KV cache);
- logprob gap: |rollout sampled log-prob - the actor's ComputeLogProbs| over every sampled token (temperature 1,
  two seeds), and |TP=T - TP=1| on the samples both replicas drew alike (same seed, same tokens);
- decode_tokens_per_s: 16 samples of 64 tokens in one Generate call;
- one gloo weight sync after a PPO update: seconds, the bytes the actor's process sent to each vLLM worker
  process (kernel TCP counters: tests/rollout/tcp_bytes.py) and what TP rank 0 forwarded to its peers, and the
  log-prob gap after it.
On two cores, T workers share them, so T>1 is no faster here: what this shows is that TP serves the actor's
log-probs and takes its weights with the actor sending one copy per replica.
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

import grpc
import torch

from bench.weight_sync_bench import serve

RESULTS = Path(__file__).parent / "results" / "tensor_parallel.json"
TP_OF = {"tiny": 2, "smollm2": 3}
SEEDS = (0, 1)


def model_path(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from rlfabric.quickstart.tiny_model import make_tiny_model

        return make_tiny_model(workdir / "tiny")
    from rlfabric.trainer.pretrained import cached_model

    return cached_model(name)


def prompts_of(model: Path) -> list[list[int]]:
    from rlfabric.core.host import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    questions = ["What is 2 + 3?", "Name a primary colour.", "What is the capital of France?", "Count to five."]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in questions]


async def gaps(rollout: str, actor, prompts, seed: int) -> tuple[torch.Tensor, list]:
    """|rollout - actor| log-prob of every sampled token, and the samples."""
    from tests.rollout.helpers import generate, sampled_log_probs
    from tests.rollout.test_actor_agreement import actor_batch

    with grpc.insecure_channel(rollout) as channel:
        samples = await asyncio.to_thread(generate, channel, prompts, timeout=900, n=2, max_tokens=24,
                                          temperature=1.0, seed=seed)
    batch = actor_batch(samples, prompts)
    actor_log_probs = (await actor.compute_log_probs(batch, temperature=1.0))["log_probs"]
    rollout_log_probs = sampled_log_probs(samples, batch)
    mask = batch["response_mask"].bool()
    return (actor_log_probs[mask] - rollout_log_probs[mask]).abs(), samples


async def decode_rate(rollout: str, prompts) -> float:
    from tests.rollout.helpers import generate

    with grpc.insecure_channel(rollout) as channel:
        started = time.perf_counter()
        samples = await asyncio.to_thread(generate, channel, prompts, timeout=900, n=4, max_tokens=64,
                                          temperature=1.0, seed=9)
        seconds = time.perf_counter() - started
    return sum(len(s.token_ids) for s in samples) / seconds


async def update(actor, rollout: str, prompts, config) -> None:
    """One PPO step on the replica's own samples, every one rewarded: the actor's weights move."""
    from tests.rollout.helpers import generate
    from tests.rollout.test_actor_agreement import actor_batch

    rows = config.actor.ppo_mini_batch_size * config.rollout.n
    with grpc.insecure_channel(rollout) as channel:
        samples = await asyncio.to_thread(generate, channel, prompts, timeout=900, n=rows // len(prompts),
                                          max_tokens=16, temperature=1.0, seed=7)
    batch = actor_batch(samples, prompts)
    old = (await actor.compute_log_probs(batch, temperature=1.0))["log_probs"]
    advantages = torch.ones_like(old) * batch["response_mask"]
    await actor.update_policy({**batch, "old_log_probs": old, "advantages": advantages})


async def sync_bytes(actor, rollout: str, config, actor_pid: int, rollout_pid: int) -> dict:
    """One gloo sync: its report and who sent the bytes to whom (see the module doc)."""
    import psutil

    from rlfabric.coordinator.weight_sync import WeightSyncPlane
    from tests.rollout.tcp_bytes import bytes_sent_since, tcp_bytes_between_processes

    plane = WeightSyncPlane(actor, {"rollout-0": rollout}, config)
    try:
        assert (await plane.sync(1)).ok  # builds the group; the next sync is measured alone
        before = tcp_bytes_between_processes()
        report = await plane.sync(2)
        after = tcp_bytes_between_processes()
        assert report.ok, report.failed
        world_size = plane.group.world_size
    finally:
        await plane.close()
    sent = bytes_sent_since(before, after)
    workers = {p.pid for p in psutil.Process(rollout_pid).children(recursive=True)}
    to_workers = {pid: n for (sender, pid), n in sent.items() if sender == actor_pid and pid in workers}
    head = max(to_workers, key=to_workers.get)
    forwarded = sum(n for (sender, pid), n in sent.items() if sender == head and pid in workers - {head})
    return {"bytes": report.num_bytes, "seconds": round(report.seconds, 3),
            "broadcast_seconds": round(report.broadcast_seconds, 3), "group_world_size": world_size,
            "actor_sent_to_workers": sorted(to_workers.values(), reverse=True),
            "tp_rank0_forwarded": forwarded}


async def measure(model: Path, tp: int, workdir: Path) -> tuple[dict, dict[int, list]]:
    from rlfabric.actor.client import ActorClient
    from rlfabric.core.client import wait_until_serving
    from rlfabric.core.config import dump_config, load_config

    config = load_config(None, [f"model.path={model}", "rollout.engine=vllm", f"rollout.tensor_parallel_size={tp}",
                                "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.lr=1e-4",
                                "rollout.max_num_seqs=16", "rollout.kv_cache_space_gb=1", "weight_sync.transport=gloo",
                                "weight_sync.timeout_s=300", f"storage.root={workdir}"])
    config_path = workdir / f"tp{tp}.yaml"
    dump_config(config, config_path)
    processes = []
    try:
        actor_process, actor_address = serve("actor", config_path, workdir, f"actor-tp{tp}")
        processes.append(actor_process)
        started = time.perf_counter()
        rollout_process, rollout = serve("rollout", config_path, workdir, f"rollout-tp{tp}")
        processes.append(rollout_process)
        await wait_until_serving(rollout, timeout_s=1800)
        start_s = time.perf_counter() - started
        await wait_until_serving(actor_address, timeout_s=600)
        prompts = prompts_of(model)
        async with ActorClient(actor_address) as actor:
            measured = [await gaps(rollout, actor, prompts, seed) for seed in SEEDS]
            before = torch.cat([gap for gap, _ in measured])
            rate = await decode_rate(rollout, prompts)
            await update(actor, rollout, prompts, config)
            sync = await sync_bytes(actor, rollout, config, actor_process.pid, rollout_process.pid)
            after, _ = await gaps(rollout, actor, prompts, seed=3)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(120)
    row = {"tensor_parallel_size": tp, "start_s": round(start_s, 1),
           "gap_vs_actor": {"max": float(before.max()), "mean": float(before.mean()), "tokens": before.numel()},
           "decode_tokens_per_s": round(rate, 1), "sync": sync,
           "gap_vs_actor_after_sync": {"max": float(after.max()), "mean": float(after.mean())}}
    return row, {seed: samples for seed, (_, samples) in zip(SEEDS, measured, strict=True)}


def tp_vs_tp1(samples: dict[int, list], reference: dict[int, list]) -> dict:
    """|TP=T - TP=1| log-prob on the samples both drew alike."""
    diffs, alike, total = [], 0, 0
    for seed, drawn in samples.items():
        by_key = {(s.prompt_index, s.sample_index): s for s in reference[seed]}
        for sample in drawn:
            other = by_key[(sample.prompt_index, sample.sample_index)]
            total += 1
            if other.token_ids == sample.token_ids:
                alike += 1
                diffs += [abs(a - b) for a, b in zip(sample.logprobs, other.logprobs, strict=True)]
    return {"samples_alike": f"{alike}/{total}", "max": max(diffs, default=None),
            "mean": sum(diffs) / len(diffs) if diffs else None}


async def measure_models(names: list[str], workdir: Path) -> dict[str, list[dict]]:
    """TP=1 and TP=T of each model, on one event loop (grpc's asyncio channels stay on the loop they began on)."""
    results = {}
    for name in names:
        model = model_path(name, workdir)
        tp1, samples1 = await measure(model, 1, workdir)
        tpn, samples = await measure(model, TP_OF[name], workdir)
        tpn["vs_tp1"] = tp_vs_tp1(samples, samples1)
        results[name] = [tp1, tpn]
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(TP_OF), choices=list(TP_OF),
                        help="measure these (the file keeps the other models' last figures)")
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
    workdir = Path(tempfile.mkdtemp(prefix="rlfabric-tp-bench-"))
    try:
        results = asyncio.run(measure_models(args.models, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    import vllm

    earlier = json.loads(RESULTS.read_text())["results"] if RESULTS.exists() else {}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "results": {**earlier, **results}, "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "torch": torch.__version__, "vllm": vllm.__version__,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
