"""TRL's GRPOTrainer on a workload of bench.peer_trl_bench, run by the bench inside its own venv
(TRL is never a dependency of rlfabric). Standalone: it imports neither rlfabric nor torch's extras.

    python bench/trl_grpo.py SPEC.json OUT.json

SPEC: {"model", "train_parquet", "reward_file", "prompts_per_step", "n", "max_tokens", "lr", "steps",
       "temperature", "seed"}, optionally "top_p" (1.0), "top_k" (0: off), "entropy_coef" (0.0), "weight_decay"
(0.01), and for a GPU (bench.gpu_check) "device" ("cpu" by default, or "cuda"), "bf16" (false), "micro_batch"
(rows per forward/backward; all of a step's by default) and "gradient_checkpointing" (TRL's default, on, when
absent). The settings are those of docs/peer-bench.md's table, each the same as rlfabric's key it names. The
reward is the same function rlfabric's reward service runs (compute_score of a file in services/reward/, loaded
by path). OUT: per step the wall time between step ends, the time since training began (time.time() of the
step's end minus that of on_train_begin) and the mean reward; "started_at": time.time() when the script began
and "train_begin_at" when training did; on a GPU the peak of torch's allocated memory.

Replay (bench.first_update_bench): with "replay" (an rlfabric rollout dump with token ids, RUN_DIR/rollouts/
step_1.jsonl) and "save_model_to", TRL takes the dump's samples instead of generating (its `rollout_func` hook:
each prompt's recorded responses, token for token, with the sampler's log-probs), scores them with the reward
function, and does its one step; OUT then also has "replay": TRL's logged metrics of that step, and per sample
its reward and advantage; the updated model goes to "save_model_to".
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time


def load_score(path: str):
    spec = importlib.util.spec_from_file_location("task_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def load_replay(path: str) -> dict[str, list[dict]]:
    """A rollout dump's samples by prompt (its last message), in sample order."""
    groups: dict[str, list[dict]] = {}
    with open(path) as dump:
        for line in dump:
            sample = json.loads(line)
            groups.setdefault(sample["prompt"], []).append(sample)
    return {prompt: sorted(samples, key=lambda s: s["sample_index"]) for prompt, samples in groups.items()}


def replayed(replay: dict[str, list[dict]]):
    """TRL's rollout_func: for each prompt TRL draws (each n times), its next recorded sample."""

    def rollout(prompts, trainer):
        taken: dict[str, int] = {}
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            content = prompt[-1]["content"]
            sample = replay[content][taken.get(content, 0)]
            taken[content] = taken.get(content, 0) + 1
            out["prompt_ids"].append(sample["prompt_ids"])
            out["completion_ids"].append(sample["response_ids"])
            out["logprobs"].append(sample["rollout_log_probs"])
        return out

    return rollout


def main() -> None:
    started_at = time.time()
    spec = json.loads(open(sys.argv[1]).read())
    out_path = sys.argv[2]
    import datasets
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(spec["seed"])
    score = load_score(spec["reward_file"])
    table = datasets.load_dataset("parquet", data_files=spec["train_parquet"], split="train")
    # The conversational form TRL applies the chat template to; the ground truth rides along as a column.
    train = table.map(lambda row: {"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]},
                      remove_columns=[c for c in table.column_names if c not in ("prompt",)])

    replay = load_replay(spec["replay"]) if "replay" in spec else None
    if replay is not None:  # the dumped step's prompts, once each: TRL's one step draws all of them
        seen: set[str] = set()

        def first_of_dumped(row) -> bool:
            content = row["prompt"][-1]["content"]
            keep = content in replay and content not in seen
            seen.add(content)
            return keep

        train = train.filter(first_of_dumped)
        if len(train) != len(replay) or spec["steps"] != 1:
            raise ValueError(f"replay: {len(replay)} dumped prompts, {len(train)} found in the data; steps must be 1")
    recorded: dict[str, list] = {"rewards": [], "advantages": []}

    def reward(completions, ground_truth, **unused):
        scores = [score(c[-1]["content"] if isinstance(c, list) else c, truth)
                  for c, truth in zip(completions, ground_truth, strict=True)]
        recorded["rewards"].extend(scores)
        return scores

    rows = spec["prompts_per_step"] * spec["n"]
    micro = spec.get("micro_batch", rows)  # one optimizer step per step: the step's rows in micro-batches
    on_cpu = spec.get("device", "cpu") == "cpu"
    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=spec.get("weight_decay", 0.01), max_grad_norm=1.0,
        optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro, num_generations=spec["n"],
        max_completion_length=spec["max_tokens"], temperature=spec["temperature"], top_p=spec.get("top_p", 1.0),
        top_k=spec.get("top_k", 0), num_iterations=1, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        entropy_coef=spec.get("entropy_coef", 0.0), mask_truncated_completions=False,
        logging_steps=1, save_strategy="no", report_to=[], seed=spec["seed"], bf16=spec.get("bf16", False),
        fp16=False, use_cpu=on_cpu, dataloader_num_workers=0, disable_tqdm=True,
        **({"gradient_checkpointing": spec["gradient_checkpointing"]} if "gradient_checkpointing" in spec else {}),
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    tokenizer.padding_side = "left"

    steps: list[dict] = []

    clock: dict[str, float] = {}

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock["begin"] = clock["last"] = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.time()
            steps.append({"step": state.global_step, "seconds": now - clock["last"], "t": now - clock["begin"]})
            clock["last"] = now
            print(f"[trl] step {state.global_step}: {steps[-1]['seconds']:.2f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and steps:
                steps[-1]["reward"] = float(logs["reward"])
                recorded.setdefault("logs", {k: v for k, v in logs.items() if isinstance(v, int | float)})

    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward, args=config, train_dataset=train,
                          processing_class=tokenizer, callbacks=[StepClock()],
                          rollout_func=replayed(replay) if replay is not None else None)
    if replay is not None:
        compute_loss = trainer.compute_loss

        def recording_compute_loss(model, inputs, *args, **kwargs):  # each row's advantage, by its token ids
            for row in range(inputs["completion_ids"].shape[0]):
                recorded["advantages"].append({
                    "prompt_ids": inputs["prompt_ids"][row][inputs["prompt_mask"][row].bool()].tolist(),
                    "completion_ids": inputs["completion_ids"][row][inputs["completion_mask"][row].bool()].tolist(),
                    "advantage": float(inputs["advantages"][row])})
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = recording_compute_loss
    trainer.train()
    if replay is not None:
        trainer.save_model(spec["save_model_to"])
    import transformers
    import trl

    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and not on_cpu else None
    with open(out_path, "w") as out:
        json.dump({"steps": steps, "started_at": started_at, "train_begin_at": clock["begin"], "trl": trl.__version__, "transformers": transformers.__version__,
                   "torch": torch.__version__, "peak_device_mb": peak / 2**20 if peak else None,
                   **({"replay": recorded} if replay is not None else {})}, out, indent=2)


if __name__ == "__main__":
    main()
