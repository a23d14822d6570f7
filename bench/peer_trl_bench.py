"""rlfabric against TRL's GRPOTrainer: the time to reward, over several seeds, on the same machine, alternated.
Writes bench/results/peer_trl.json and bench/results/peer_trl.png (for each workload: the mean reward with its
spread per step, and against the clock).

    python -m bench.peer_trl_bench [--seeds 0 1 2] [--workloads quickstart real_model] [--budget-min 150]

Workloads (the same model, prompts, group size, prompts per step, max tokens, learning rate and every other
setting of docs/peer-bench.md's table, which `trl_spec` checks and derives TRL's settings from):
    quickstart   the warm-started tiny model on "find the vowel": 64 prompts x 8 samples x 4 tokens, lr 2e-3,
                 entropy bonus 0.02, 15 steps (services/quickstart/quickstart.yaml)
    real_model   SmolLM2-135M-Instruct on "What is 7 + 5?": 8 prompts x 4 samples x 48 tokens, lr 2e-5, 10 steps
                 (examples/smollm2_arithmetic.yaml; rlfabric generates with vLLM, TRL with transformers)

rlfabric runs as a user runs it: `rlfabric train CONFIG --run-dir DIR` with the config's defaults (the launcher's
thread budget included) and only the overrides of RLFABRIC_OVERRIDES (the seeds; no progress bar, plot, final
checkpoint or export, which come after the last step). TRL runs bench/trl_grpo.py in its own venv (bench/.venv-trl,
created on first use; never a dependency of rlfabric) with seed S. For each seed the two sides run one after the
other, never at once, and each run's load average is recorded.

What is reported per workload and side: the reward per step of each seed; its mean and standard deviation over
the seeds per step; each step's time since the first step began (the clock: rlfabric's metrics timestamps minus
the first step's length, TRL's time.time() since on_train_begin), so that start-up (the mesh's or TRL's model load)
is counted apart, as startup_s; the time to reward (the first step whose 3-step moving average of the reward
reaches THRESHOLD, on that clock) per seed and its mean over the seeds that reach it; the median step time
(step 1, with its warm-up, left out); the mean reward of the last 3 steps. The bench stops starting runs when
its wall-time budget (--budget-min) would be passed and says which seeds it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
TRL_VENV = Path(__file__).parent / ".venv-trl"
TRL_PACKAGES = ["torch==2.13.0", "trl==1.16.0", "transformers>=5.16.1,<5.20", "datasets>=3"]
THRESHOLD = 0.6  # the reward whose 3-step moving average "time to reward" waits for
WINDOW = 3
BUDGET_MIN = 150  # the whole bench (both workloads, every seed, both sides) on a 2-core CPU
RLFABRIC_OVERRIDES = ["trainer.progress_bar=false", "trainer.plot=false", "trainer.save_final=false",
                      "trainer.export_final=false"]

WORKLOADS = {
    "quickstart": {"config": None, "task": "find_vowel",
                   "reward_file": ROOT / "services" / "reward" / "find_vowel.py"},
    "real_model": {"config": ROOT / "examples" / "smollm2_arithmetic.yaml", "task": "arithmetic",
                   "reward_file": ROOT / "services" / "reward" / "arithmetic.py"},
}


def log(message: str) -> None:
    print(f"[peer_trl_bench] {message}", flush=True)


def trl_python() -> Path:
    """The TRL venv's python, created on first use."""
    python = TRL_VENV / "bin" / "python"
    if not (TRL_VENV / ".installed").exists():
        log(f"creating {TRL_VENV} ({', '.join(TRL_PACKAGES)})")
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel first, as `make setup` does
        subprocess.run([*pip, *TRL_PACKAGES], check=True)
        (TRL_VENV / ".installed").touch()
    return python


# -- the same settings on both sides ---------------------------------------------------------------------

# rlfabric keys that must hold these values for TRL's fixed settings in trl_grpo.py to be the same algorithm
# (docs/peer-bench.md): loss_type dapo, epsilon 0.2, num_iterations 1, beta 0, scale_rewards group,
# max_grad_norm 1.0, AdamW betas (0.9, 0.999), constant lr without warmup.
SAME_ALGORITHM = {
    "algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False, "actor.use_kl_loss": False, "actor.loss_mode": "vanilla",
    "actor.loss_agg_mode": "token-mean", "actor.clip_ratio_low": 0.2, "actor.clip_ratio_high": 0.2,
    "actor.ppo_epochs": 1, "actor.grad_clip": 1.0, "actor.lr_warmup_steps": 0, "actor.lora.rank": 0,
    "algorithm.filter_groups.enable": False, "algorithm.rollout_correction.rollout_is": None,
    "algorithm.rollout_correction.rollout_rs": None,
}


def _key(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def trl_spec(config: dict, spec: dict, run_dir: Path, seed: int, out_dir: Path) -> dict:
    """TRL's settings for a resolved rlfabric config (RUN_DIR/config.yaml), after checking that every key
    TRL's fixed settings stand for holds the same value."""
    different = {key: _key(config, key) for key, value in SAME_ALGORITHM.items() if _key(config, key) != value}
    actor, data, rollout = config["actor"], config["data"], config["rollout"]
    if actor["ppo_mini_batch_size"] != data["train_batch_size"]:
        different["actor.ppo_mini_batch_size"] = actor["ppo_mini_batch_size"]  # TRL: one optimizer step a batch
    if different:
        raise ValueError(f"TRL cannot run the same algorithm as these rlfabric settings: {different}")
    return {"model": config["model"]["path"], "train_parquet": str(run_dir / "data" / spec["task"] / "train.parquet"),
            "reward_file": str(spec["reward_file"]), "prompts_per_step": data["train_batch_size"], "n": rollout["n"],
            "max_tokens": rollout["response_length"] or data["max_response_length"], "lr": actor["lr"],
            "weight_decay": actor["weight_decay"], "entropy_coef": actor["entropy_coeff"],
            "steps": config["trainer"]["total_steps"], "temperature": rollout["temperature"],
            "top_p": rollout["top_p"], "top_k": max(0, rollout["top_k"]), "seed": seed,
            # rlfabric's model.gradient_checkpointing auto is off on CPU; TRL's default (on) would recompute
            "gradient_checkpointing": False, "output_dir": str(out_dir)}


# -- one run of each side ------------------------------------------------------------------------------------

def run_rlfabric(spec: dict, run_dir: Path, seed: int, overrides: list[str] = RLFABRIC_OVERRIDES) -> dict:
    """`rlfabric train` as a user runs it, with `overrides` and the seed; the run's resolved config."""
    config = [str(spec["config"])] if spec["config"] else []
    argv = [sys.executable, "-m", "rlfabric", "train", *config, "--run-dir", str(run_dir), *overrides,
            f"rollout.seed={seed}", f"data.seed={seed}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"rlfabric train failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-3000:]}")
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def rlfabric_train(spec: dict, run_dir: Path, seed: int, overrides: list[str] = RLFABRIC_OVERRIDES,
                   ) -> tuple[dict, dict]:
    """(the run's figures, its resolved config)."""
    started = time.time()
    resolved = run_rlfabric(spec, run_dir, seed, overrides)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    begin = records[0]["timestamp"] - records[0]["timing_s/step"]  # when the first step began
    steps = [{"step": r["step"], "reward": r["critic/score/mean"], "seconds": r["timing_s/step"],
              "t": r["timestamp"] - begin} for r in records]
    return {"steps": steps, "startup_s": begin - started}, resolved


def run_trl(trl_settings: dict, work: Path, env: dict[str, str] | None = None) -> dict:
    """bench/trl_grpo.py in TRL's venv with these settings (and `env` added to the environment); what it wrote."""
    spec_file, out_file = work / "trl-spec.json", work / "trl-out.json"
    spec_file.write_text(json.dumps(trl_settings))
    done = subprocess.run([str(trl_python()), str(Path(__file__).parent / "trl_grpo.py"), str(spec_file),
                           str(out_file)], env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"TRL failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(out_file.read_text())


def trl_train(trl_settings: dict, work: Path) -> dict:
    started = time.time()
    out = run_trl(trl_settings, work)
    return {"steps": out["steps"], "startup_s": out["train_begin_at"] - started,
            "versions": {k: out[k] for k in ("trl", "transformers", "torch")}}


# -- figures -------------------------------------------------------------------------------------------------

def step_reaching(steps: list[dict], threshold: float = THRESHOLD, window: int = WINDOW) -> dict | None:
    """The step whose `window`-step moving average of the reward first reaches `threshold`; None if none does."""
    rewards = [s["reward"] for s in steps]
    for i in range(window - 1, len(steps)):
        if statistics.mean(rewards[i - window + 1: i + 1]) >= threshold:
            return steps[i]
    return None


def time_to_reward(steps: list[dict], threshold: float = THRESHOLD, window: int = WINDOW) -> float | None:
    """Seconds (on the run's clock) until the `window`-step moving average of the reward first reaches
    `threshold`; None if it never does."""
    reached = step_reaching(steps, threshold, window)
    return reached["t"] if reached else None


def summarize(runs: list[dict]) -> dict:
    """One side's figures over its seeds."""
    steps = min(len(r["steps"]) for r in runs)
    per_step = [[r["steps"][i]["reward"] for r in runs] for i in range(steps)]
    reached = [r["time_to_reward_s"] for r in runs if r["time_to_reward_s"] is not None]
    return {
        "seeds": [r["seed"] for r in runs],
        "mean_reward_per_step": [statistics.mean(v) for v in per_step],
        "std_reward_per_step": [statistics.pstdev(v) for v in per_step],
        "mean_t_per_step": [statistics.mean(r["steps"][i]["t"] for r in runs) for i in range(steps)],
        "time_to_reward_s_per_seed": [r["time_to_reward_s"] for r in runs],
        "mean_time_to_reward_s": statistics.mean(reached) if reached else None,
        "seeds_reaching_reward": len(reached),
        "median_step_s": statistics.median(s["seconds"] for r in runs for s in r["steps"][1:]),
        "mean_last3_reward": statistics.mean(statistics.mean(s["reward"] for s in r["steps"][-3:]) for r in runs),
        "mean_startup_s": statistics.mean(r["startup_s"] for r in runs),
    }


def compare(ours: dict, theirs: dict) -> dict:
    both = ours["mean_time_to_reward_s"] is not None and theirs["mean_time_to_reward_s"] is not None
    return {"time_to_reward_ratio_rlfabric_over_trl":
            ours["mean_time_to_reward_s"] / theirs["mean_time_to_reward_s"] if both else None,
            "step_time_ratio_rlfabric_over_trl": ours["median_step_s"] / theirs["median_step_s"],
            "last3_reward_rlfabric_minus_trl": ours["mean_last3_reward"] - theirs["mean_last3_reward"]}


# -- the bench -----------------------------------------------------------------------------------------------

def run_seed(name: str, spec: dict, seed: int, work: Path) -> dict[str, dict]:
    """Both sides on one seed, one after the other: rlfabric first (its run dir holds the data TRL reads)."""
    run_dir = work / f"{name}-{seed}-rlfabric"
    load = os.getloadavg()[0]
    ours, config = rlfabric_train(spec, run_dir, seed)
    ours.update(seed=seed, load_before=load, load_after=os.getloadavg()[0])
    settings = trl_spec(config, spec, run_dir, seed, work / f"{name}-{seed}-trl")
    load = os.getloadavg()[0]
    theirs = trl_train(settings, work)
    theirs.update(seed=seed, load_before=load, load_after=os.getloadavg()[0], settings=settings)
    for run in (ours, theirs):
        run["time_to_reward_s"] = time_to_reward(run["steps"])
    log(f"{name} seed {seed}: time to reward {ours['time_to_reward_s']} s (rlfabric) vs "
        f"{theirs['time_to_reward_s']} s (TRL); median step {statistics.median(s['seconds'] for s in ours['steps'][1:]):.2f}"
        f" vs {statistics.median(s['seconds'] for s in theirs['steps'][1:]):.2f} s; load {load:.1f}")
    return {"rlfabric": ours, "trl": theirs}


def write(results: dict) -> None:
    for result in results["workloads"].values():
        if result["runs"]:
            for side in ("rlfabric", "trl"):
                result[side] = summarize([run[side] for run in result["runs"]])
            result["comparison"] = compare(result["rlfabric"], result["trl"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "peer_trl.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "peer_trl.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, result in results["workloads"].items() if result["runs"]]
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 4.2 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        result = results["workloads"][name]
        for side, color in (("rlfabric", "tab:blue"), ("trl", "tab:orange")):
            summary = result[side]
            mean, std = summary["mean_reward_per_step"], summary["std_reward_per_step"]
            low, high = [m - s for m, s in zip(mean, std, strict=True)], [m + s for m, s in zip(mean, std, strict=True)]
            for column, x in enumerate((range(1, len(mean) + 1), summary["mean_t_per_step"])):
                axes[row][column].plot(x, mean, "o-", color=color,
                                       label=f"{side} (mean of {len(summary['seeds'])} seeds, band: ±1 std)")
                axes[row][column].fill_between(x, low, high, color=color, alpha=0.2)
            for run in result["runs"]:
                steps = run[side]["steps"]
                axes[row][1].plot([s["t"] for s in steps], [s["reward"] for s in steps], color=color, alpha=0.3, lw=0.8)
        axes[row][0].set_title(f"{name} ({result['model']}): reward per step")
        axes[row][1].set_title(f"{name}: reward against the clock (thin: each seed)")
        axes[row][0].set_xlabel("step")
        axes[row][1].set_xlabel("seconds since the first step began")
        for axis in axes[row]:
            axis.axhline(THRESHOLD, color="grey", lw=0.8, ls=":")
            axis.set_ylabel("mean reward")
            axis.grid(alpha=0.3)
            axis.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"rlfabric train (defaults) vs TRL GRPOTrainer, same settings, {os.cpu_count()}-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--budget-min", type=float, default=BUDGET_MIN, help="wall-time budget of the whole bench")
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
    trl_python()  # before any timing: the venv install is slow
    work = Path(tempfile.mkdtemp(prefix="peer-trl-bench-"))
    deadline = time.monotonic() + args.budget_min * 60
    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "threshold": THRESHOLD,
               "window": WINDOW, "budget_min": args.budget_min, "rlfabric_overrides": RLFABRIC_OVERRIDES,
               "workloads": {name: {"runs": [], "model": None} for name in args.workloads}}
    for name in args.workloads:
        for seed in args.seeds:
            result = results["workloads"][name]
            if result["runs"] and time.monotonic() + _seed_seconds(result["runs"]) > deadline:
                log(f"{name}: seed {seed} would pass the {args.budget_min:.0f}-minute budget; stopping here")
                result["budget_stopped_before_seed"] = seed
                break
            started = time.monotonic()
            runs = run_seed(name, WORKLOADS[name], seed, work)
            runs["wall_s"] = time.monotonic() - started
            result["runs"].append(runs)
            result["model"] = Path(runs["trl"]["settings"]["model"]).name
            write(results)  # after every seed: a run cut short keeps what it has
    log(f"wrote {RESULTS / 'peer_trl.json'} and {RESULTS / 'peer_trl.png'}")


def _seed_seconds(runs: list[dict]) -> float:
    return max(run["wall_s"] for run in runs)


if __name__ == "__main__":
    main()
