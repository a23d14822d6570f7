"""Sync vs async training (trainer.max_staleness k = 1, 2, 4) with the rollout and the trainer on separate
CPU pools, side by side on one mesh. Writes bench/results/async.json and bench/results/async.png.

    python -m bench.async_bench                         # every workload but real_model (~25 minutes)
    python -m bench.async_bench real_model              # SmolLM2 (after `rlfabric make-model smollm2`)

Every role is its own process, on two resource pools (rlfabric.launch.placement): the rollout, the reward
and the environment service pinned to CPU 0, the actor to CPU 1, so generation and training each have a core
of their own (the coordinator, in no pool, runs on either). Workloads (WORKLOADS: steps, rounds, modes):
- quickstart: the tiny model, hf rollout, GRPO on the synthetic task; answers are one letter, so a step is
  mostly training (generation ~0.4x of it);
- multi_turn: multi-turn tool calling on the lookup task, by a model that has to learn to call the tool,
  sized so generation and training take about as long (as one sizes disaggregated pools);
- multi_turn_slow: multi_turn at a third of the learning rate over 30 steps (learning takes longer);
- multi_turn_one_epoch: the same with the lookup example's batch and one epoch, where generation takes ~3x
  as long as training.
Async mode can hide at most the shorter of generation and the rest of the step behind the longer: the bound
(`overlap_bound_vs_sync`) is sync's step over the longer of the two. Every run starts from the same initial
weights (a fresh run on a mesh loads them back); the modes are alternated over rounds so machine noise hits
them alike.

Per mode: wall time of the run, the wall-clock time to reach the workload's reward target (the first step at
or above it: async has to learn as well, not only step faster), the median step time (timing_s/step, step 1
left out: warm-up), what the step waited for generation (timing_s/gen) and what generation hid behind
training (timing_s/gen_overlapped), the reward curve (critic/score/mean) and the final reward (mean of the
last 3 steps), staleness, the groups dropped as too stale and the share of samples that straddled a weight
sync (partial rollouts). The speed-up
of a mode is sync's median step time over its own. The load average is recorded: other work on the machine
skews every figure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import load_config
from rlfabric.launch.local import LocalMesh
from rlfabric.quickstart.cached import cached_lookup_model
from rlfabric.quickstart.lookup_warm_start import LEARNER
from rlfabric.v1 import coordinator_pb2

RESULTS = Path(__file__).parent / "results" / "async.json"
PLOT = RESULTS.with_suffix(".png")
MODES = {"sync": ("sync", 0), "async k=1": ("async", 1), "async k=2": ("async", 2), "async k=4": ("async", 4)}
LOOKUP_EXAMPLE = Path(__file__).parents[1] / "examples" / "lookup_multi_turn.yaml"
# 16 prompts x 8 samples and three PPO epochs: training takes about as long as generation
BALANCED_LOOKUP = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "actor.ppo_epochs=3",
                   "algorithm.rollout_correction.rollout_is=token"]
WORKLOADS = {
    "quickstart": {"config": None, "steps": 15, "rounds": 3, "modes": list(MODES), "reward_target": 0.9},
    # SmolLM2-135M-Instruct on arithmetic, vLLM rollout (`rlfabric make-model smollm2` first): ~0.5 min a step.
    "real_model": {"config": Path(__file__).parents[1] / "examples" / "smollm2_arithmetic.yaml", "steps": 5,
                   "rounds": 1, "modes": ["sync", "async k=1"], "reward_target": 0.4},
    # Agentic: the lookup task's tool-calling episodes (examples/lookup_multi_turn.yaml), ~100 generated tokens
    # and an environment round trip per sample. The tiny model is warm-started to write the call but to use
    # it in 10% of episodes, so reward climbs from ~0.1 as RL teaches it to call (as in
    # tests/coordinator/test_agent_learning.py). BALANCED_LOOKUP makes training take about as long as
    # generation (1.8 s and 2.2 s a step in sync mode), as pools are sized in practice: overlap can hide at
    # most the shorter of the two. Token-level truncated IS corrects for stale samples.
    "multi_turn": {"config": LOOKUP_EXAMPLE, "steps": 14, "rounds": 2, "modes": list(MODES),
                   "lookup_model": LEARNER, "reward_target": 0.75, "overrides": [*BALANCED_LOOKUP, "actor.lr=2e-4"]},
    # multi_turn learning 3x slower (actor.lr 7e-5 for 2e-4) over 30 steps: async's first k+1 batches come from
    # the starting weights, a delay of a few steps that weighs less the longer learning takes.
    "multi_turn_slow": {"config": LOOKUP_EXAMPLE, "steps": 30, "rounds": 1, "modes": ["sync", "async k=1"],
                        "lookup_model": LEARNER, "reward_target": 0.75,
                        "overrides": [*BALANCED_LOOKUP, "actor.lr=7e-5"]},
    # The example's batch (32 prompts x 8, one epoch): generation takes ~3x as long as training.
    "multi_turn_one_epoch": {"config": LOOKUP_EXAMPLE, "steps": 12, "rounds": 1, "modes": list(MODES),
                             "lookup_model": LEARNER, "reward_target": 0.75, "overrides": ["actor.lr=5e-4"]},
}
POOLS = {"generation": ([0], ("rollout", "reward", "env")), "training": ([1], ("actor", "reference", "critic"))}
REWARD = "critic/score/mean"


def log(message: str) -> None:
    print(f"[async_bench] {message}", flush=True)


async def run(address: str, options: ChannelOptions, experiment: str, mode: str, staleness: int, total_steps: int,
              ) -> tuple[float, list[dict]]:
    """One run to its end: its wall time and, per step, the metrics with the time they arrived."""
    async with CoordinatorClient(address, options) as client:
        started = time.perf_counter()
        await client.start_run([f"trainer.experiment_name={experiment}", f"trainer.total_steps={total_steps}", f"trainer.mode={mode}",
                                f"trainer.max_staleness={staleness}", "trainer.resume=disable"])
        steps = []
        async for update in client.stream_metrics():
            steps.append({"step": update.step, "at_s": time.perf_counter() - started, **dict(update.metrics)})
        status = await client.run_status()
        if status.state != coordinator_pb2.RUN_STATE_COMPLETED:
            raise RuntimeError(f"{mode} (k={staleness}) run ended {status.state}: {status.error}")
        return time.perf_counter() - started, steps


def summarize(wall: float, steps: list[dict], reward_target: float) -> dict:
    timed = steps[1:]

    def median(key: str) -> float:
        return statistics.median(s.get(key, 0.0) for s in timed)

    rewards = [s[REWARD] for s in steps]
    return {
        "wall_s": wall,
        "median_step_s": median("timing_s/step"),
        "median_wall_between_steps_s": statistics.median(b["at_s"] - a["at_s"] for a, b in zip(timed, steps[2:], strict=False)),
        "median_gen_wait_s": median("timing_s/gen"),
        "median_gen_overlapped_s": median("timing_s/gen_overlapped"),
        "median_update_s": median("timing_s/update"),
        "median_update_weights_s": median("timing_s/update_weights"),
        "final_reward": statistics.mean(rewards[-3:]),
        "reward_curve": rewards,
        "reward_at_s": [s["at_s"] for s in steps],
        # wall clock from StartRun to the first step whose reward reaches the workload's target (None: never)
        "seconds_to_target": next((s["at_s"] for s in steps if s[REWARD] >= reward_target), None),
        "staleness_max": max(s.get("rollout/staleness/max", 0.0) for s in steps),
        "staleness_mean": statistics.mean(s.get("rollout/staleness/mean", 0.0) for s in steps),
        "stale_groups": sum(s.get("rollout/stale_groups", 0.0) for s in steps),
        "partial_fraction_mean": statistics.mean(s.get("rollout/partial_fraction", 0.0) for s in steps),
    }


def pinning(mesh: LocalMesh) -> dict[str, str]:
    """The CPUs each service process may run on, as the kernel has it."""
    allowed = {}
    for proc in mesh.processes:
        status = Path(f"/proc/{proc.process.pid}/status").read_text()
        allowed[proc.name] = next(line.split(":")[1].strip() for line in status.splitlines()
                                  if line.startswith("Cpus_allowed_list"))
    return allowed


def plot(results: dict) -> None:
    """Reward per step and over wall-clock time, one row per workload measured, the last round of each mode
    (the first run on a fresh mesh, sync's of round 1, also pays the services' warm-up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [name for name in WORKLOADS if name in results]
    figure, axes = plt.subplots(len(workloads), 2, figsize=(11, 4 * len(workloads)), squeeze=False)
    for (by_step, by_time), workload in zip(axes, workloads, strict=True):
        for name, mode in results[workload]["modes"].items():
            last = mode["rounds"][-1]
            steps = range(1, len(last["reward_curve"]) + 1)
            label = f"{name} ({mode['median_step_s']:.2f} s/step)"
            by_step.plot(steps, last["reward_curve"], marker="o", markersize=3, label=label)
            by_time.plot(last["reward_at_s"], last["reward_curve"], marker="o", markersize=3, label=label)
        by_step.set(xlabel="step", ylabel="reward (critic/score/mean)", title=f"{workload}: reward per step")
        by_time.set(xlabel="wall-clock seconds since the run started", ylabel="reward",
                    title=f"{workload}: reward over time")
        for panel in (by_step, by_time):
            panel.grid(alpha=0.3)
            panel.legend(fontsize=8)
    pools = "; ".join(f"{', '.join(roles)} on CPU {cpus}" for cpus, roles in POOLS.values())
    figure.suptitle(f"sync vs async (max_staleness k): {pools}", fontsize=10)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    figure.savefig(PLOT, dpi=110)


def measure(workload: str) -> dict:
    """Every mode of WORKLOADS[workload] on one pinned mesh, alternated over its rounds."""
    spec = WORKLOADS[workload]
    root = Path(tempfile.mkdtemp(prefix="async-bench-"))
    pools = [override for name, (cpus, roles) in POOLS.items()
             for override in (f"resource_pools.{name}.cpus={cpus}", *(f"{role}.pool={name}" for role in roles))]
    model = []
    if "lookup_model" in spec:
        log(f"the lookup model {spec['lookup_model']} (warm-started once per machine, then cached)")
        model = [f"model.path={cached_lookup_model(**spec['lookup_model'])}"]
    config = load_config(spec["config"], [*pools, *model, *spec.get("overrides", []),
                                          "trainer.progress_bar=false", "trainer.plot=false",
                                          "trainer.export_final=false", "trainer.save_final=false"])
    results: dict = {"steps": spec["steps"], "rounds": spec["rounds"], "pools": pools,
                     "overrides": spec.get("overrides", []), "lookup_model": spec.get("lookup_model"),
                     "reward_target": spec["reward_target"],
                     "load_average_before": os.getloadavg(), "modes": {}}
    rounds: dict[str, list[dict]] = {name: [] for name in spec["modes"]}
    with LocalMesh(config, root / "mesh") as mesh:
        results["cpus_allowed"] = pinning(mesh)
        address = mesh.endpoints["coordinator"][0]["grpc"]
        options = dataclasses.replace(ChannelOptions.from_config(config), timeout_s=1800)  # the mesh's token
        for round_index in range(spec["rounds"]):
            for name in spec["modes"]:
                mode, staleness = MODES[name]
                experiment = f"{name.replace(' ', '-').replace('=', '')}-{round_index}"
                wall, steps = asyncio.run(run(address, options, experiment, mode, staleness, spec["steps"]))
                rounds[name].append(summarize(wall, steps, spec["reward_target"]))
                log(f"{workload} {name} round {round_index + 1}/{spec['rounds']}: {wall:.1f} s, median step "
                    f"{rounds[name][-1]['median_step_s']:.3f} s, final reward {rounds[name][-1]['final_reward']:.3f}")
    for name, runs in rounds.items():
        results["modes"][name] = {
            "median_step_s": statistics.median(r["median_step_s"] for r in runs),
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "final_reward": statistics.mean(r["final_reward"] for r in runs),
            # None when some round never reached the target
            "seconds_to_target": None if any(r["seconds_to_target"] is None for r in runs)
            else statistics.median(r["seconds_to_target"] for r in runs),
            "rounds": runs}
    sync = results["modes"]["sync"]
    # Overlap hides the shorter of generation and the rest of the step behind the longer at best.
    gen = statistics.median(r["median_gen_wait_s"] for r in sync["rounds"])
    results["overlap_bound_vs_sync"] = sync["median_step_s"] / max(gen, sync["median_step_s"] - gen)
    for mode in results["modes"].values():
        mode["speedup_vs_sync"] = sync["median_step_s"] / mode["median_step_s"]
        mode["wall_speedup_vs_sync"] = sync["wall_s"] / mode["wall_s"]
        reached = sync["seconds_to_target"] is not None and mode["seconds_to_target"] is not None
        mode["time_to_target_speedup_vs_sync"] = sync["seconds_to_target"] / mode["seconds_to_target"] if reached else None
    results["load_average_after"] = os.getloadavg()
    return results


def main() -> None:
    """python -m bench.async_bench [WORKLOAD ...] (default: all but real_model); the others' results in the file stay."""
    workloads = sys.argv[1:] or ["quickstart", "multi_turn", "multi_turn_slow", "multi_turn_one_epoch"]
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    for workload in workloads:
        results[workload] = measure(workload)
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
        for name, mode in results[workload]["modes"].items():
            to_target = mode["time_to_target_speedup_vs_sync"]
            log(f"{workload} {name}: {mode['median_step_s']:.3f} s/step ({mode['speedup_vs_sync']:.2f}x sync), "
                f"final reward {mode['final_reward']:.3f}, reward {results[workload]['reward_target']} reached "
                + (f"{to_target:.2f}x as fast as sync" if to_target else "not in every round"))
    plot(results)
    log(f"wrote {RESULTS} and {PLOT}")


if __name__ == "__main__":
    main()
