"""One TRL GRPOTrainer training step on a fixed batch, and the memory it took: run by bench.update_memory_bench
inside TRL's own venv (TRL is never a dependency of rlfabric). Standalone: it imports no rlfabric.

    python bench/trl_update_step.py SPEC.json OUT.json

SPEC: {"model", "prompt_ids" [B, P], "completion_ids" [B, T], "advantages" [B], "lr", "gradient_checkpointing",
       "output_dir"}. The step is TRL's own (Trainer's loop: training_step, clipping, AdamW, zero_grad) with
generation replaced by the fixed batch, so only the update is measured. Memory: on a GPU the peak torch
allocation during the step (and before it); on CPU the process's resident high-water mark during the step
(VmHWM, reset when the step begins) and the resident memory before it, every weight read once before (their
pages, mapped from the safetensors file, are then resident). OUT: those figures in MiB.
"""

from __future__ import annotations

import json
import sys
import time

MB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    prompt_ids = torch.tensor(spec["prompt_ids"], device=device)
    completion_ids = torch.tensor(spec["completion_ids"], device=device)
    rows = prompt_ids.shape[0]
    completion_mask = torch.ones_like(completion_ids)
    batch = {  # what _generate_and_score_completions hands the loss
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.tensor(spec["advantages"], device=device),
        "num_items_in_batch": completion_mask.sum(),
    }
    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=1, learning_rate=spec["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=rows,
        gradient_accumulation_steps=1, num_generations=rows, max_completion_length=completion_ids.shape[1],
        num_iterations=1, beta=0.0, loss_type="dapo", gradient_checkpointing=spec["gradient_checkpointing"],
        bf16=cuda, fp16=False, use_cpu=not cuda, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    figures: dict = {}

    class StepMemory(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                figures["device_before_mb"] = torch.cuda.memory_allocated() / MB
            figures["rss_before_mb"] = rss_bytes() / MB
            reset_peak_rss()
            figures["started"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                figures["device_peak_mb"] = torch.cuda.max_memory_allocated() / MB
                figures["device_after_mb"] = torch.cuda.memory_allocated() / MB
            figures["rss_peak_mb"] = peak_rss_bytes() / MB
            figures["step_s"] = time.perf_counter() - figures.pop("started")

    prompts = datasets.Dataset.from_dict({"prompt": ["unused: generation is replaced by a fixed batch"] * rows})
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=lambda completions, **unused: [0.0] * len(completions),
                          args=config, train_dataset=prompts, callbacks=[StepMemory()])
    trainer._generate_and_score_completions = lambda generation_batch: batch  # the fixed batch, not generate()
    with torch.no_grad():  # every weight read once: resident before the step (the safetensors file is mapped)
        sum(float(parameter.sum()) for parameter in trainer.model.parameters())
    trainer.train()
    import transformers
    import trl

    parameter = next(trainer.model.parameters())
    figures.update({"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                    "param_dtype": str(parameter.dtype), "optimizer": type(trainer.optimizer.optimizer).__name__,
                    "optim": str(config.optim), "gradient_checkpointing": config.gradient_checkpointing,
                    "bf16_autocast": config.bf16, "device": str(device)})
    with open(sys.argv[2], "w") as out:
        json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
