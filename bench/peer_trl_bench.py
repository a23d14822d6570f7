"""rlfabric against TRL's GRPOTrainer on the same two workloads, in one run. Writes
bench/results/peer_trl.json and bench/results/peer_trl.png (reward and seconds per step, both side by side).

    python -m bench.peer_trl_bench

Workloads (the same model, prompts, group size, prompts per step, max tokens and learning rate):
    quickstart   the warm-started tiny model on "find the vowel": 64 prompts x 8 samples x 4 tokens, lr 2e-3
    real_model   SmolLM2-135M-Instruct on "What is 7 + 5?": 8 prompts x 4 samples x 48 tokens, lr 2e-5
                 (examples/smollm2_arithmetic.yaml; rlfabric generates with vLLM, TRL with transformers)
Seconds per step are wall time between step ends (the first step, with its warm-up, is left out of the
medians). TRL runs in its own venv (bench/.venv-trl, created here on first use: torch, trl, datasets);
it is never a dependency of rlfabric. rlfabric's mesh is stopped before TRL starts, so the two never
share the machine's cores. Differences that stay: TRL has no entropy bonus (the quickstart's rlfabric
config has 0.02) and reads the prompts in its own shuffled order.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import load_config
from rlfabric.launch.local import LocalMesh
from rlfabric.v1 import coordinator_pb2

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
TRL_VENV = Path(__file__).parent / ".venv-trl"
TRL_PACKAGES = ["torch==2.13.0", "trl==1.16.0", "transformers>=5.16.1,<5.20", "datasets>=3"]

WORKLOADS = {
    "quickstart": {"config": None, "overrides": [], "task": "find_vowel",
                   "reward_file": ROOT / "services" / "reward" / "synthetic.py"},
    "real_model": {"config": ROOT / "examples" / "smollm2_arithmetic.yaml", "overrides": [], "task": "arithmetic",
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


async def rlfabric_run(address: str, run_dir: Path, steps: int) -> list[dict]:
    """One run; per step: wall seconds since the previous step's end (metric timestamps) and the score."""
    async with CoordinatorClient(address, ChannelOptions(timeout_s=3600)) as client:
        started = time.time()
        await client.start_run([f"trainer.run_dir={run_dir}", "trainer.resume=disable"])
        out, previous = [], started
        async for update in client.stream_metrics(timeout_s=3600):
            out.append({"step": update.step, "seconds": update.timestamp - previous,
                        "reward": update.metrics["critic/score/mean"],
                        "timing_s/step": update.metrics["timing_s/step"]})
            previous = update.timestamp
            log(f"rlfabric step {update.step}: {out[-1]['seconds']:.2f} s, reward {out[-1]['reward']:.3f}")
        status = await client.run_status()
        if status.state != coordinator_pb2.RUN_STATE_COMPLETED:
            raise RuntimeError(f"rlfabric run ended {status.state}: {status.error}")
    return out


def run_workload(name: str, spec: dict, workdir: Path) -> dict:
    config = load_config(spec["config"], [*spec["overrides"], "trainer.progress_bar=false", "trainer.export_final=false"])
    steps = config.trainer.total_steps
    log(f"{name}: rlfabric, {steps} steps")
    with LocalMesh(config, workdir / f"{name}-mesh") as mesh:
        run_dir = workdir / f"{name}-rlfabric"
        ours = asyncio.run(rlfabric_run(mesh.endpoints["coordinator"][0]["grpc"], run_dir, steps))
        model = mesh.config.model.path  # resolved by the launcher (built tiny model, cached registry model)
    if (run_dir / "curves.png").exists():  # rlfabric's own curves of the run (reward, KL, length)
        shutil.copy(run_dir / "curves.png", RESULTS / f"peer_trl_{name}_rlfabric_curves.png")
    train_parquet = run_dir / "data" / spec["task"] / "train.parquet"
    trl_spec = {"model": model, "train_parquet": str(train_parquet), "reward_file": str(spec["reward_file"]),
                "prompts_per_step": config.data.train_batch_size, "n": config.rollout.n,
                "max_tokens": config.data.max_response_length, "lr": config.actor.lr, "steps": steps,
                "temperature": config.rollout.temperature, "seed": 0, "output_dir": str(workdir / f"{name}-trl")}
    spec_file, out_file = workdir / f"{name}-trl.json", workdir / f"{name}-trl-out.json"
    spec_file.write_text(json.dumps(trl_spec))
    log(f"{name}: TRL GRPOTrainer, {steps} steps")
    subprocess.run([str(trl_python()), str(Path(__file__).parent / "trl_grpo.py"), str(spec_file), str(out_file)],
                   check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    theirs = json.loads(out_file.read_text())
    ours_median = statistics.median(s["seconds"] for s in ours[1:])
    trl_median = statistics.median(s["seconds"] for s in theirs["steps"][1:])
    return {
        "workload": {k: v for k, v in trl_spec.items() if k in ("prompts_per_step", "n", "max_tokens", "lr", "steps")},
        "model": Path(model).name, "rollout_engine": config.rollout.engine,
        "rlfabric": {"steps": ours, "median_step_s": ours_median,
                     "first_reward": ours[0]["reward"], "last3_reward": statistics.mean(s["reward"] for s in ours[-3:])},
        "trl": {"steps": theirs["steps"], "median_step_s": trl_median, "versions": {
            k: theirs[k] for k in ("trl", "transformers", "torch")},
            "first_reward": theirs["steps"][0].get("reward"),
            "last3_reward": statistics.mean(s.get("reward", float("nan")) for s in theirs["steps"][-3:])},
        "step_time_ratio_rlfabric_over_trl": ours_median / trl_median,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(WORKLOADS), figsize=(5.5 * len(WORKLOADS), 7), squeeze=False)
    for column, name in enumerate(WORKLOADS):
        result = results["workloads"][name]
        for system, style in (("rlfabric", "o-"), ("trl", "s--")):
            steps = result[system]["steps"]
            x = [s["step"] for s in steps]
            axes[0][column].plot(x, [s.get("reward", float("nan")) for s in steps], style, label=system)
            axes[1][column].plot(x, [s["seconds"] for s in steps], style, label=system)
        axes[0][column].set_title(f"{name} ({result['model']})")
        axes[0][column].set_ylabel("mean reward")
        axes[1][column].set_ylabel("seconds per step (wall, between step ends)")
        axes[1][column].set_xlabel("step")
        for axis in (axes[0][column], axes[1][column]):
            axis.grid(alpha=0.3)
            axis.legend()
    fig.suptitle("rlfabric (sync) vs TRL GRPOTrainer, same workload, 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="peer-trl-bench-"))
    trl_python()  # before any timing: the venv install is slow
    load_before = os.getloadavg()
    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "workloads": {}}
    for name, spec in WORKLOADS.items():
        results["workloads"][name] = run_workload(name, spec, workdir)
        ratio = results["workloads"][name]["step_time_ratio_rlfabric_over_trl"]
        log(f"{name}: rlfabric / TRL median step time {ratio:.2f}x")
    results["load_average"] = {"before": load_before, "after": os.getloadavg()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "peer_trl.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "peer_trl.png")
    log(f"wrote {RESULTS / 'peer_trl.json'} and {RESULTS / 'peer_trl.png'}")


if __name__ == "__main__":
    main()
