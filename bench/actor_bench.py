"""Actor training throughput through the real service, and the share of each step spent outside the
model's forward/backward (codec, gRPC, validation, sharding, padding). Writes bench/results/actor.json.

    python -m bench.actor_bench

Each case starts `rlfabric serve actor` as its own process (the tiny model, then a ~25M-parameter
Qwen2 with random weights; CPU), sends UpdatePolicy requests from this process and compares the
client's wall time per request with the forward/backward and optimizer time the service reports
(actor/fwd_bwd_s, actor/optimizer_s): overhead = wall - fwd_bwd - optimizer. Figures are medians over
the timed updates; the load average is recorded because other work on the machine skews them.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from rlfabric.actor.client import ActorClient
from rlfabric.core.client import ChannelOptions, wait_until_serving
from rlfabric.quickstart.tiny_model import build_tokenizer, make_tiny_model

RESULTS = Path(__file__).parent / "results" / "actor.json"
REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_OVERHEAD = 0.05

# name, model builder kwargs (None = tiny), world_size, rows, prompt_len, response_len, timed updates
CASES = [
    ("tiny", None, 1, 32, 64, 64, 8),
    ("tiny", None, 2, 32, 64, 64, 8),
    ("qwen2-25m", dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1408), 1, 16, 64, 64, 4),
]


def log(message: str) -> None:
    print(f"[actor_bench] {message}", flush=True)


def make_model(root: Path, name: str, shape: dict | None) -> Path:
    if shape is None:
        return make_tiny_model(root / name)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_heads"], max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(root / name)
    tokenizer.save_pretrained(root / name)
    return root / name


def make_batch(rows: int, prompt_len: int, response_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts (50-100% full) and right-padded responses (25-100% full), as a rollout returns."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt_len // 2, prompt_len + 1, (rows,), generator=g)
    response_lens = torch.randint(response_len // 4, response_len + 1, (rows,), generator=g)
    columns = torch.arange(prompt_len + response_len)
    attention_mask = ((columns >= prompt_len - prompt_lens[:, None]) & (columns < prompt_len + response_lens[:, None]))
    input_ids = torch.randint(4, 100, (rows, prompt_len + response_len), generator=g) * attention_mask
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask.long(),
        "responses": input_ids[:, prompt_len:].clone(),
        "response_mask": attention_mask[:, prompt_len:].long(),
    }


def start_actor(model: Path, world_size: int, rows: int, work: Path) -> tuple[subprocess.Popen, str]:
    config = {"model": {"path": str(model)}, "rollout": {"n": 1},
              "actor": {"world_size": world_size, "lr": 1e-5, "ppo_mini_batch_size": rows,
                        "ppo_micro_batch_size_per_gpu": 8, "log_prob_micro_batch_size_per_gpu": 16}}
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    port_file = work / "ports.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "rlfabric", "serve", "actor", "--config", str(work / "run.yaml"), "--port", "0",
         "--metrics-port", "0", "--port-file", str(port_file)],
        cwd=REPO_ROOT, stdout=open(work / "actor.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"actor did not start: {(work / 'actor.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return process, f"127.0.0.1:{json.loads(port_file.read_text())['grpc']}"


async def measure(address: str, batch: dict[str, torch.Tensor], updates: int) -> dict:
    await wait_until_serving(address, timeout_s=120)
    async with ActorClient(address, ChannelOptions(timeout_s=600)) as actor:
        await actor.compute_log_probs(batch)  # warm-up
        started = time.perf_counter()
        old = (await actor.compute_log_probs(batch))["log_probs"]
        log_prob_s = time.perf_counter() - started
        update = {**batch, "old_log_probs": old, "advantages": torch.randn(old.shape)}
        await actor.update_policy(update)  # warm-up: optimizer state, allocator, first-call costs
        walls, reported = [], []
        for step in range(updates):
            started = time.perf_counter()
            metrics = await actor.update_policy(update, global_step=step)
            walls.append(time.perf_counter() - started)
            reported.append(metrics)
    # Medians over the timed updates: the figures stay meaningful when other work shares the machine.
    # engine_other: validation, sharding, padding removal, stats, waiting for the other ranks.
    shares = []
    for wall, m in zip(walls, reported, strict=True):
        fwd_bwd, optimizer, service = m["actor/fwd_bwd_s"], m["actor/optimizer_s"], m["actor/update_s"]
        shares.append({
            "fwd_bwd_share": fwd_bwd / wall,
            "optimizer_share": optimizer / wall,
            "rpc_and_codec_share": (wall - service) / wall,
            "engine_other_share": (service - fwd_bwd - optimizer) / wall,
            "outside_fwd_bwd_and_optimizer_share": (wall - fwd_bwd - optimizer) / wall,
        })
    tokens = int(batch["attention_mask"].sum())
    wall = statistics.median(walls)
    return {
        "real_tokens_per_update": tokens,
        "padded_tokens_per_update": batch["input_ids"].numel(),
        "update_s_median": round(wall, 4),
        "train_tokens_per_s": round(tokens / wall, 1),
        "log_prob_tokens_per_s": round(tokens / log_prob_s, 1),
        **{name: round(statistics.median(s[name] for s in shares), 4) for name in shares[0]},
    }


def run_case(root: Path, models: dict, case) -> dict:
    name, shape, world_size, rows, prompt_len, response_len, updates = case
    if name not in models:
        log(f"building {name}")
        models[name] = make_model(root, name, shape)
    work = Path(tempfile.mkdtemp(dir=root))
    log(f"{name}, world_size {world_size}: starting the actor service")
    process, address = start_actor(models[name], world_size, rows, work)
    try:
        log(f"{name}, world_size {world_size}: {updates} timed updates of {rows} x {prompt_len + response_len} tokens")
        figures = asyncio.run(measure(address, make_batch(rows, prompt_len, response_len), updates))
    finally:
        process.terminate()
        process.wait(60)
    parameters = sum(t.numel() for t in _weights(models[name]).values())
    result = {"model": name, "parameters": parameters, "world_size": world_size, "rows": rows,
              "seq_len": prompt_len + response_len, "timed_updates": updates, **figures}
    log(f"{name}, world_size {world_size}: {figures['train_tokens_per_s']} tokens/s, outside forward/backward/"
        f"optimizer {figures['outside_fwd_bwd_and_optimizer_share']:.1%}")
    return result


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def main() -> None:
    started = time.perf_counter()
    load_before = round(os.getloadavg()[0], 2)  # > cpus means other work competed for the cores
    with tempfile.TemporaryDirectory(prefix="actor-bench-") as tmp:
        root, models = Path(tmp), {}
        results = [run_case(root, models, case) for case in CASES]
    report = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "device": "cpu",
        "what": "UpdatePolicy through `rlfabric serve actor` over loopback gRPC; shares are of the client's wall "
                "time per update; outside = codec + RPC + validation + sharding + padding + stats",
        "target_outside_share": TARGET_OVERHEAD,
        "load_average_before_after": [load_before, round(os.getloadavg()[0], 2)],
        "results": results,
        "bench_seconds": round(time.perf_counter() - started, 1),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {RESULTS} in {report['bench_seconds']} s")


if __name__ == "__main__":
    main()
