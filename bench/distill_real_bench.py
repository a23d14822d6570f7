"""On-policy distillation on the real model against GRPO from the same start (issue 48's real-model row).

    python -m bench.distill_real_bench [--steps 10] [--seed 0]      (make bench BENCH=distill_real)

1. GRPO: SmolLM2-135M-Instruct on the arithmetic task (examples/smollm2_arithmetic.yaml), `--steps` steps.
   Its final model is the teacher, and its curve is "GRPO from the same start".
2. Distillation: the same start (SmolLM2) and settings, the teacher scoring every sampled token, the per-token
   reverse KL the only signal (algorithm.distill.use_task_reward false; the task reward is still scored).

The teacher's reward is the mean of GRPO's last WINDOW steps. Each side's time to reward is when its
WINDOW-step moving average first reaches the teacher's reward - MARGIN, on its own clock (from its first
step's start; both runs start the same services, so start-up is left out of both). Both runs go one after the
other on this machine, so the load each saw is recorded next to it. Writes bench/results/distill_real.json and
a plot of both curves against steps and seconds (distill_real.png).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.peer_trl_bench import ROOT, WINDOW, log, rlfabric_train, step_reaching, time_to_reward

RESULTS = Path(__file__).parent / "results"
CONFIG = ROOT / "examples" / "smollm2_arithmetic.yaml"
MARGIN = 0.1  # the target: the student reaches the teacher's reward - 0.1
STEPS = 10
QUIET = ["trainer.progress_bar=false", "trainer.plot=false"]


def grpo_overrides() -> list[str]:
    return [*QUIET, "trainer.export_final=true"]  # final_model/: the teacher


def distill_overrides(teacher: Path) -> list[str]:
    return [*QUIET, "trainer.save_final=false", "trainer.export_final=false", f"teacher.model_path={teacher}",
            "teacher.log_prob_micro_batch_size_per_gpu=32", "algorithm.distill.enable=true",
            "algorithm.distill.use_task_reward=false"]


def run(name: str, run_dir: Path, seed: int, steps: int, overrides: list[str]) -> dict:
    log(f"{name}: training {steps} steps into {run_dir}")
    load_before = os.getloadavg()[0]
    spec = {"config": CONFIG}
    figures, _ = rlfabric_train(spec, run_dir, seed, [*overrides, f"trainer.total_steps={steps}"])
    figures["load_before"], figures["load_after"] = load_before, os.getloadavg()[0]
    log(f"{name}: rewards {[round(s['reward'], 2) for s in figures['steps']]}")
    return figures


def steps_to_reward(steps: list[dict], goal: float) -> int | None:
    """The step at which the WINDOW-step moving average of the reward first reaches `goal`."""
    reached = step_reaching(steps, goal)
    return reached["step"] if reached else None


def summarize(grpo: dict, distill: dict) -> dict:
    teacher_reward = statistics.mean(s["reward"] for s in grpo["steps"][-WINDOW:])
    goal = teacher_reward - MARGIN
    grpo_s, distill_s = (time_to_reward(side["steps"], goal) for side in (grpo, distill))
    return {"teacher_reward": teacher_reward, "goal": goal,
            "grpo_steps_to_goal": steps_to_reward(grpo["steps"], goal),
            "distill_steps_to_goal": steps_to_reward(distill["steps"], goal),
            "grpo_time_to_goal_s": grpo_s, "distill_time_to_goal_s": distill_s,
            "distill_over_grpo": distill_s / grpo_s if grpo_s and distill_s else None,
            "median_step_s": {name: statistics.median(s["seconds"] for s in side["steps"][1:])
                              for name, side in (("grpo", grpo), ("distill", distill))}}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, color in (("grpo", "tab:orange"), ("distill", "tab:blue")):
        steps = results[name]["steps"]
        label = {"grpo": "GRPO (its final model is the teacher)", "distill": "distillation from that teacher"}[name]
        for axis, x in zip(axes, ([s["step"] for s in steps], [s["t"] for s in steps]), strict=True):
            axis.plot(x, [s["reward"] for s in steps], "o-", color=color, label=label)
    for axis, xlabel in zip(axes, ("step", "seconds since the first step began"), strict=True):
        axis.axhline(results["summary"]["goal"], color="grey", lw=0.8, ls=":", label="teacher's reward - 0.1")
        axis.set_xlabel(xlabel)
        axis.set_ylabel("mean task reward")
        axis.grid(alpha=0.3)
        axis.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"SmolLM2-135M on arithmetic: distillation vs GRPO from the same start, {os.cpu_count()}-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
    work = Path(tempfile.mkdtemp(prefix="distill-real-bench-"))
    started = time.monotonic()
    grpo = run("grpo", work / "grpo", args.seed, args.steps, grpo_overrides())
    teacher = work / "grpo" / "final_model"
    distill = run("distill", work / "distill", args.seed, args.steps, distill_overrides(teacher))
    results = {"model": "SmolLM2-135M-Instruct", "config": str(CONFIG.relative_to(ROOT)), "seed": args.seed,
               "window": WINDOW, "margin": MARGIN, "cpus": os.cpu_count(),
               "wall_s": time.monotonic() - started, "grpo": grpo, "distill": distill,
               "summary": summarize(grpo, distill)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distill_real.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, RESULTS / "distill_real.png")
    log(f"summary: {json.dumps(results['summary'])}")


if __name__ == "__main__":
    main()
