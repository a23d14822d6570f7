"""Generative judge throughput (reward.judge): judged items/s through the reward service, the judge unbatched
(judge.batch_size=1, max_concurrency=1) against batched, side by side in one run. Writes bench/results/judge.json.

    python -m bench.judge_bench                   # the quickstart's tiny model as the judge, 64 items (seconds)
    python -m bench.judge_bench --model smollm2   # SmolLM2-135M-Instruct (minutes on 2 CPU cores)

The path is the one a run takes: a reward service (the real RewardService on loopback) gets one Score call of
all the items, every one of a judged data source, and its JudgeScorer sends them to an hf rollout service (the
judge pool) in Generate requests. Both ends and the client run in this process, on the same cores. Each mode is
timed `--repeats` times, the modes alternated so that load from elsewhere hits both alike; the best time counts
(interference only ever adds time). Greedy verdicts: both modes judge the same items to the same scores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

from rlfabric.core.config import JudgeConfig, load_config
from rlfabric.core.server import ServerOptions
from rlfabric.reward.arithmetic import DATA_SOURCE
from rlfabric.reward.client import RewardClient
from rlfabric.reward.items import ScoreItem
from rlfabric.reward.judge import render
from rlfabric.reward.servicer import build_service as build_reward
from rlfabric.rollout.servicer import build_service as build_rollout
from tests.conftest import ServerThread

RESULTS = Path(__file__).parent / "results" / "judge.json"
TEMPLATE = (
    "Grade the answer to a math question.\nQuestion: {prompt}\nAnswer: {response}\nReference: {ground_truth}\n"
    "Reply in the form 'Score: N', with N from 0 to 10. Example reply: Score: 7"
)
# The number after "Score:", else the first one: SmolLM2-135M seldom keeps to the asked form.
REGEX = r"(?:Score:\s*)?(\d+)"
# mode -> (judge.batch_size, judge.max_concurrency)
MODES = {"unbatched": (1, 1), "batched": (16, 2)}
TARGET_SPEEDUP = 3.0
# A Score call's and a judge request's deadline: an unbatched SmolLM2 run of 32 items passed 600 s on 2 cores shared
# with a load average of 16.
SCORE_TIMEOUT_S = 3600
MODELS = {"tiny": "tiny (quickstart, random weights)", "smollm2": "SmolLM2-135M-Instruct"}


def make_items(count: int, seed: int = 0) -> list[ScoreItem]:
    """Arithmetic rows with a short answer, about half of them wrong by one."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        answer = a + b if rng.random() < 0.5 else a + b + 1
        items.append(
            ScoreItem(DATA_SOURCE, f"The answer is {answer}.", str(a + b), prompt=f"What is {a} + {b}?")
        )
    return items


def _reward_overrides(address: str, batch_size: int, concurrency: int, max_tokens: int) -> list[str]:
    return [
        f"reward.judge.addresses=[{address}]",
        f"reward.judge.data_sources=[{DATA_SOURCE}]",
        f"reward.judge.prompt_template={json.dumps(TEMPLATE)}",
        f"reward.judge.regex={json.dumps(REGEX)}",
        f"reward.judge.max_tokens={max_tokens}",
        f"reward.judge.batch_size={batch_size}",
        f"reward.judge.max_concurrency={concurrency}",
        f"reward.judge.timeout_s={SCORE_TIMEOUT_S}",
        "server.log_level=WARNING",
    ]


def measure(
    model_dir: Path, items: list[ScoreItem], modes: dict[str, tuple[int, int]], max_tokens: int, repeats: int
) -> dict:
    """Items/s of each mode (best of `repeats`), the judge's scores per mode, and the Generate requests sent."""
    seqs = max(size * concurrency for size, concurrency in modes.values())
    judge = ServerThread(
        build_rollout(
            load_config(
                None, [f"model.path={model_dir}", "rollout.dtype=float32", f"rollout.max_num_seqs={seqs}"]
            )
        ),
        ServerOptions(port=0, metrics_port=None),
    )
    caller = asyncio.new_event_loop()
    rewards, clients = {}, {}
    try:
        for mode, (size, concurrency) in modes.items():
            service = build_reward(
                load_config(None, _reward_overrides(judge.address, size, concurrency, max_tokens))
            )
            rewards[mode] = ServerThread(service, ServerOptions(port=0, metrics_port=None))
            clients[mode] = caller.run_until_complete(_connect(rewards[mode].address))
        scores, seconds = {}, {mode: [] for mode in modes}
        for mode, client in clients.items():  # warm-up: the connections, and the model's first passes
            caller.run_until_complete(
                client.score(items[: max(modes[mode][0], 2)], timeout_s=SCORE_TIMEOUT_S)
            )
        for _ in range(repeats):
            for mode, client in clients.items():
                start = time.perf_counter()
                results = caller.run_until_complete(client.score(items, timeout_s=SCORE_TIMEOUT_S))
                seconds[mode].append(time.perf_counter() - start)
                scores[mode] = [r.score if r.ok else None for r in results]
        requests = {mode: rewards[mode].server.service.engine.judge.requests for mode in modes}
    finally:
        for client in clients.values():
            caller.run_until_complete(client.close())
        caller.close()
        for server in rewards.values():
            server.stop()
        judge.stop()
    return {
        mode: {
            "judge_batch_size": modes[mode][0],
            "judge_max_concurrency": modes[mode][1],
            "items_per_s": round(len(items) / min(seconds[mode]), 2),
            "seconds": [round(s, 3) for s in seconds[mode]],
            "generate_requests": requests[mode],
            "scored": sum(score is not None for score in scores[mode]),
            "scores": scores[mode],
        }
        for mode in modes
    }


def forward_costs(model_dir: Path, items: list[ScoreItem], rows: int) -> dict:
    """Milliseconds per row of the judge model's own forward passes (transformers, float32, no service) on the
    first item's judge prompt, 1 row against `rows` rows: the prompt's prefill and one decode step after it. Where
    a pass's time grows with its rows (compute-bound, as on a few CPU cores), batching saves only the per-request
    and per-step costs around it, and what the rows have in common: the prefill of `rows` items' own prompts as
    the hf engine runs it (hf_decode.DecodeBatch.prefill), their common prefix (the chat template's system turn,
    the template's head) run once or once a row."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfabric.rollout.hf_decode import DecodeBatch, shared_prefix
    from rlfabric.rollout.types import SamplingSpec

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": render(TEMPLATE, item)}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for item in items[:rows]
    ]
    ids = torch.tensor([prompts[0]])

    def best_ms(run) -> float:
        run()  # warm-up
        times = []
        for _ in range(2):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return 1000 * min(times)

    per_row: dict[str, dict[int, float]] = {"prefill": {}, "decode_step": {}}
    with torch.no_grad():
        for count in (1, rows):
            batch = ids.repeat(count, 1)
            per_row["prefill"][count] = best_ms(lambda b=batch: model(b, use_cache=True)) / count
            out = model(batch, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            # Each step appends one position to the cache: the steps timed differ by a token of context.
            per_row["decode_step"][count] = (
                best_ms(lambda t=token, c=cache: model(t, past_key_values=c, use_cache=True)) / count
            )
        spec = SamplingSpec(temperature=0.0)
        distinct = {
            share: best_ms(
                lambda share=share: DecodeBatch.prefill(
                    model,
                    prompts,
                    list(range(len(prompts))),
                    [spec] * len(prompts),
                    [0] * len(prompts),
                    0,
                    share_prefix=share,
                )
            )
            / len(prompts)
            for share in (False, True)
        }
    return {
        "prompt_tokens": ids.shape[1],
        "rows": rows,
        **{
            f"{kind}_ms_per_row": {str(k): round(v, 2) for k, v in ms.items()} for kind, ms in per_row.items()
        },
        **{f"{kind}_batching_gain": round(ms[1] / ms[rows], 2) for kind, ms in per_row.items()},
        "distinct_prompts_shared_prefix_tokens": shared_prefix(prompts),
        "distinct_prompts_prefill_ms_per_row": {
            "prefix_per_row": round(distinct[False], 2),
            "prefix_shared": round(distinct[True], 2),
        },
        "distinct_prompts_prefill_gain_of_sharing": round(distinct[False] / distinct[True], 2),
    }


async def _connect(address: str) -> RewardClient:
    return RewardClient(address)


def summarize(runs: dict) -> dict:
    """The batched over the unbatched rate, and whether every item got the same score both ways."""
    unbatched, batched = runs["unbatched"], runs["batched"]
    return {
        "batched_vs_unbatched": round(batched["items_per_s"] / unbatched["items_per_s"], 2),
        "same_scores": batched["scores"] == unbatched["scores"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="tiny")
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument(
        "--max-tokens", type=int, default=JudgeConfig().max_tokens, help="reward.judge.max_tokens"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        if args.model == "smollm2":
            from rlfabric.trainer.pretrained import cached_model

            model_dir = cached_model("smollm2")
        else:
            from rlfabric.quickstart.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(workdir) / "tiny")
        items = make_items(args.items)
        runs = measure(model_dir, items, MODES, args.max_tokens, args.repeats)
        costs = forward_costs(model_dir, items, MODES["batched"][0])
    summary = summarize(runs)
    for mode, run in runs.items():
        print(
            f"judge {MODELS[args.model]}, {mode} (batch_size {run['judge_batch_size']}, max_concurrency "
            f"{run['judge_max_concurrency']}): {run['items_per_s']:.2f} items/s, {run['generate_requests']} "
            f"Generate requests",
            flush=True,
        )
    print(
        f"batched over unbatched: {summary['batched_vs_unbatched']:.2f}x (target {TARGET_SPEEDUP:g}x), "
        f"same scores: {summary['same_scores']}",
        flush=True,
    )
    print(
        f"the model's own passes, {costs['rows']} rows over 1, per row: prefill {costs['prefill_batching_gain']}x, "
        f"a decode step {costs['decode_step_batching_gain']}x faster; {costs['rows']} items' own prompts' prefill "
        f"{costs['distinct_prompts_prefill_gain_of_sharing']}x faster with their "
        f"{costs['distinct_prompts_shared_prefix_tokens']}-token common prefix run once",
        flush=True,
    )
    # One entry per judge model: a run of one model keeps the other's figures.
    models = json.loads(args.out.read_text())["models"] if args.out.exists() else {}
    models[args.model] = {
        "judge_model": MODELS[args.model],
        "workload": f"{len(items)} arithmetic items in one Score call, judge.max_tokens {args.max_tokens}, greedy, "
        f"float32 hf rollout service as the judge pool; best of {args.repeats} per mode, alternated",
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1m": round(os.getloadavg()[0], 1),
        **summary,
        "modes": runs,
        "forward_passes": costs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "target_batched_vs_unbatched": TARGET_SPEEDUP,
                "models": dict(sorted(models.items())),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
