"""The coordinator's own work on one step's samples, in process and without a mesh, up to batches a mesh on this
machine cannot carry (at 4,096 x 16 samples the update request alone is past protobuf's 2 GiB). Writes
bench/results/coordinator_samples.json.

    python -m bench.coordinator_samples_bench                 # 256, 1,024 and 4,096 prompts x 16 samples
    python -m bench.coordinator_samples_bench --prompts 256

Synthetic samples shaped as bench/scale_bench.py's (responses exponential with mean 512 tokens, at most 1,024;
prompts of 60-200 tokens) go through what the coordinator does with a step's samples, each phase in CPU seconds:
    decode          each sample's GenerateStream message parsed and decoded (rlfabric.rollout.wire)
    batch           the step's RolloutBatch and scores (Sampler.scored_batch)
    advantages      token-level scores and the GRPO estimator
    metrics         data_metrics
    update_request  the actor's UpdatePolicy request, serialized (codec.serialized_with_batch)
peak_rss_mb is the process's high-water mark; each batch size runs in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "coordinator_samples.json"
N = 16


def log(message: str) -> None:
    print(f"[coordinator_samples_bench] {message}", flush=True)


def one(prompts: int) -> dict:
    """The phases on prompts x N synthetic samples, in this process."""
    import numpy as np
    import torch

    from rlfabric import algorithms as algos
    from rlfabric.coordinator.rollout_batch import token_level_scores
    from rlfabric.coordinator.sampler import Sampler
    from rlfabric.coordinator.servicer import numpy_without_huge_pages
    from rlfabric.coordinator.step_metrics import data_metrics
    from rlfabric.core import codec
    from rlfabric.core.config import load_config
    from rlfabric.data.dataset import PromptRow
    from rlfabric.reward.items import ItemResult
    from rlfabric.rollout import wire
    from rlfabric.v1 import actor_pb2, rollout_pb2

    numpy_without_huge_pages()  # as the coordinator process runs
    rng = np.random.default_rng(0)
    rows = [PromptRow(f"bench:{i}", "bench", [{"role": "user", "content": "q"}],
                      rng.integers(0, 150_000, int(rng.integers(60, 200))).tolist(), "1", "", "{}")
            for i in range(prompts)]
    messages = []
    for prompt in range(prompts):
        for index in range(N):
            length = int(min(1024, rng.exponential(512)))
            sample = rollout_pb2.Sample(prompt_index=prompt, sample_index=index, weight_version=3,
                                        token_ids=rng.integers(0, 150_000, length).tolist(),
                                        logprobs=(-rng.exponential(1.0, length)).tolist(),
                                        finish_reason=rollout_pb2.FINISH_REASON_STOP if length < 1024
                                        else rollout_pb2.FINISH_REASON_LENGTH)
            messages.append(rollout_pb2.RolloutServiceGenerateStreamResponse(sample=sample).SerializeToString())
    config = load_config(None, [f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}",
                                f"rollout.n={N}"])
    seconds: dict[str, float] = {}

    def timed(phase, work):
        started = time.process_time()
        out = work()
        seconds[phase] = time.process_time() - started
        return out

    parse = rollout_pb2.RolloutServiceGenerateStreamResponse.FromString
    samples = timed("decode", lambda: [wire.sample_from_proto(parse(m).sample) for m in messages])
    wire_mb = sum(len(m) for m in messages) / 1e6
    messages.clear()  # the wire bytes are gone once decoded, as in the coordinator
    results = {(s.prompt_index, s.sample_index): ItemResult(float(rng.random() < 0.5)) for s in samples}
    batch = timed("batch", lambda: Sampler(config, None).scored_batch(rows, samples, results, pad_token_id=0))

    def advantages():
        batch.token_rewards = token_level_scores(batch.scores, batch.response_mask)
        batch.advantages, batch.returns = algos.get_advantage_estimator("grpo")(
            token_rewards=batch.token_rewards, mask=batch.response_mask, values=None, group_ids=batch.group_ids,
            baselines=None, gamma=1.0, lam=1.0, norm_by_std=True)

    timed("advantages", advantages)
    timed("metrics", lambda: data_metrics(batch, 1024))
    update = {**batch.tensors, "advantages": batch.advantages}
    request = timed("update_request", lambda: codec.serialized_with_batch(
        actor_pb2.ActorServiceUpdatePolicyRequest(global_step=1), ("batch",), update))
    return {"prompts": prompts, "n": N, "samples": prompts * N, "wire_mb": round(wire_mb, 1),
            "batch_shape": list(batch.tensors["input_ids"].shape), "update_request_mb": round(len(request) / 1e6, 1),
            "cpu_s": {phase: round(s, 3) for phase, s in seconds.items()},
            "cpu_s_total": round(sum(seconds.values()), 3),
            "cpu_us_per_sample": round(sum(seconds.values()) * 1e6 / (prompts * N), 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: one batch size, JSON on stdout
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    points = []
    for prompts in args.prompts:
        log(f"{prompts} x {N} samples")
        child = subprocess.run([sys.executable, "-m", "bench.coordinator_samples_bench", "--one", str(prompts)],
                               capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
        points.append(json.loads(child.stdout.strip().splitlines()[-1]))
        points[-1]["load_average"] = list(os.getloadavg())
        log(f"  {json.dumps(points[-1])}")
    RESULTS.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                                   "points": points}, indent=1))
    log(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
