"""Sequence packing (actor.use_remove_padding) against the padded path: trained tokens per second of one
UpdatePolicy on SmolLM2-135M (CPU), on a batch whose sequence lengths vary 4x. Writes
bench/results/packing.json.

    python -m bench.packing_bench [--rows 16] [--min-len 64] [--max-len 256] [--rounds 3]

The batch: `rows` sequences of min-len .. max-len real tokens (evenly spread, half prompt and half response),
prompts left-padded and responses right-padded to the longest, as the rollout hands them over. Both sides
run the actor's TrainerEngine in this process with the same settings, one micro-batch of every row, one
optimizer step; after one untimed update each (first-use allocations), the rounds alternate the two sides,
and each side's median update time gives its real tokens per second. The log-probs of the two sides are compared too (they must agree).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from rlfabric.core.config import config_from_dict
from rlfabric.trainer.engine import TrainerEngine
from rlfabric.trainer.pretrained import cached_model

RESULTS = Path(__file__).parent / "results" / "packing.json"
TARGET = 1.3  # packed tokens/s over padded, on lengths that vary 4x


def log(message: str) -> None:
    print(f"[packing_bench] {message}", flush=True)


def varied_batch(rows: int, min_len: int, max_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, max_len, rows).round().long()
    prompt_lens, response_lens = lengths // 2, lengths - lengths // 2
    prompt_width, response_width = int(prompt_lens.max()), int(response_lens.max())
    prompts = torch.zeros(rows, prompt_width, dtype=torch.long)
    responses = torch.zeros(rows, response_width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    response_mask = torch.zeros_like(responses)
    for i in range(rows):
        p, r = int(prompt_lens[i]), int(response_lens[i])
        prompts[i, prompt_width - p :] = torch.randint(100, 20000, (p,), generator=g)
        prompt_mask[i, prompt_width - p :] = 1
        responses[i, :r] = torch.randint(100, 20000, (r,), generator=g)
        response_mask[i, :r] = 1
    return {"input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "responses": responses, "response_mask": response_mask,
            "advantages": torch.randn(rows, 1, generator=g).expand(rows, response_width).contiguous()}


def engine_config(model: Path, rows: int, packing: bool):
    actor = {"use_remove_padding": packing, "ppo_mini_batch_size": rows, "ppo_micro_batch_size_per_gpu": rows,
             "log_prob_micro_batch_size_per_gpu": rows}
    return config_from_dict({"model": {"path": str(model)}, "rollout": {"n": 1}, "actor": actor})


async def measure(model: Path, batch: dict, rounds: int) -> dict:
    rows = batch["input_ids"].shape[0]
    engines = {name: TrainerEngine("actor", engine_config(model, rows, name == "packed")) for name in ("padded", "packed")}
    for engine in engines.values():
        await engine.start()
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    log_probs = {}
    try:
        for name, engine in engines.items():
            forward = {k: v for k, v in batch.items() if k != "advantages"}
            log_probs[name] = (await engine.compute(forward, 1.0, False, False))["log_probs"]
        for engine in engines.values():  # one untimed update each: first-use allocations of new shapes
            await engine.update(dict(batch), global_step=0)
        for round_index in range(rounds):
            for name in (("padded", "packed") if round_index % 2 == 0 else ("packed", "padded")):
                started = time.perf_counter()
                await engines[name].update(dict(batch), global_step=round_index + 1)
                seconds[name].append(time.perf_counter() - started)
                log(f"round {round_index + 1}/{rounds} {name}: {seconds[name][-1]:.2f} s")
    finally:
        for engine in engines.values():
            await engine.stop()
    real = batch["response_mask"].bool()
    gap = float((log_probs["packed"][real] - log_probs["padded"][real]).abs().max())
    return {"seconds": seconds, "log_prob_max_abs_diff": gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
    torch.manual_seed(0)
    model = cached_model("smollm2")
    batch = varied_batch(args.rows, args.min_len, args.max_len)
    real_tokens = int(batch["attention_mask"].sum())
    padded_tokens = batch["attention_mask"].numel()
    log(f"{args.rows} rows of {args.min_len}..{args.max_len} tokens: {real_tokens} real of {padded_tokens} padded")
    result = asyncio.run(measure(model, batch, args.rounds))
    median = {name: statistics.median(values) for name, values in result["seconds"].items()}
    tokens_per_s = {name: real_tokens / value for name, value in median.items()}
    report = {
        "model": "SmolLM2-135M-Instruct", "rows": args.rows, "lengths": [args.min_len, args.max_len],
        "real_tokens": real_tokens, "padded_tokens": padded_tokens, "rounds": args.rounds,
        "update_seconds": result["seconds"], "median_update_s": median, "trained_tokens_per_s": tokens_per_s,
        "packed_over_padded": tokens_per_s["packed"] / tokens_per_s["padded"], "target": TARGET,
        "log_prob_max_abs_diff": result["log_prob_max_abs_diff"],
        "machine": platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "torch": torch.__version__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    log(f"packed / padded trained tokens per second: {report['packed_over_padded']:.2f}x (target {TARGET}x); "
        f"log-probs agree within {report['log_prob_max_abs_diff']:.1e}; wrote {RESULTS}")


if __name__ == "__main__":
    main()
