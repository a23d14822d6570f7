"""The first update of rlfabric and of TRL's GRPOTrainer on the same batch, side by side (issue 34, item 5).
Writes bench/results/first_update.json.

    python -m bench.first_update_bench [--workload real_model] [--seed 0]

1. `rlfabric train` runs one step of the workload as bench.peer_trl_bench runs it (defaults; the seeds; one
   step) and dumps the step's samples with their token ids and the sampler's log-probs
   (trainer.dump_rollout_tokens), its metrics and the updated policy (final_model).
2. TRL (bench/trl_grpo.py in its own venv, the settings of docs/peer-bench.md's table, derived by
   bench.peer_trl_bench.trl_spec) replays those samples token for token instead of generating, scores them with
   the same reward function, and does its one step; it records each sample's reward and advantage, its logged
   metrics, and saves its updated model.
3. Here, side by side: the rewards and advantages per sample; the policy loss, gradient norm (before clipping),
   clip fractions and entropy; the KL between the sampler (rlfabric's rollout engine) and the trainer (the
   initial weights in a plain transformers forward, the policy both trainers start from); and the updates
   themselves: each side's weights after the step minus the initial ones, compared tensor by tensor (cosine,
   norm ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from bench.peer_trl_bench import (
    RLFABRIC_OVERRIDES,
    WORKLOADS,
    log,
    run_rlfabric,
    run_trl,
    trl_python,
    trl_spec,
)

RESULTS = Path(__file__).parent / "results" / "first_update.json"
OVERRIDES = [o for o in RLFABRIC_OVERRIDES if not o.startswith("trainer.export_final")] + [
    "trainer.total_steps=1", "trainer.dump_rollouts=true", "trainer.dump_rollout_tokens=true"]
# rlfabric metric -> TRL's logged metric for the same quantity (TRL's loss_type dapo is rlfabric's token-mean)
SAME_METRICS = {"actor/pg_loss": "loss", "actor/grad_norm": "grad_norm", "actor/pg_clipfrac": "clip_ratio/region_mean",
                "actor/entropy": "entropy", "critic/score/mean": "reward"}


def rlfabric_step(spec: dict, run_dir: Path, seed: int) -> tuple[dict, dict, list[dict]]:
    """(step 1's metrics, the resolved config, the dumped samples) of a one-step `rlfabric train`."""
    config = run_rlfabric(spec, run_dir, seed, OVERRIDES)
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    samples = [json.loads(line) for line in (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    return metrics, config, samples


# -- the comparisons -----------------------------------------------------------------------------------------

def sample_key(prompt_ids: list[int], response_ids: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(prompt_ids), tuple(response_ids)


def grpo_advantages(samples: list[dict]) -> list[float]:
    """rlfabric's GRPO advantage of each dumped sample (the estimator the loop runs, on its scores)."""
    from rlfabric.algorithms import get_advantage_estimator
    from rlfabric.coordinator.rollout_batch import token_level_scores

    groups = {prompt: index for index, prompt in enumerate(dict.fromkeys(s["prompt"] for s in samples))}
    mask = torch.ones(len(samples), 1)
    advantages, _ = get_advantage_estimator("grpo")(
        token_rewards=token_level_scores(torch.tensor([s["score"] for s in samples]), mask), mask=mask, values=None,
        group_ids=torch.tensor([groups[s["prompt"]] for s in samples]), baselines=None, gamma=1.0, lam=1.0,
        norm_by_std=True)  # trl_spec refuses a config without algorithm.norm_adv_by_std_in_grpo
    return advantages[:, 0].tolist()


def per_sample(samples: list[dict], ours_advantages: list[float], theirs: dict) -> dict:
    """Rewards and advantages per sample, matched by token ids (TRL shuffles its rows)."""
    trl_advantages = {sample_key(r["prompt_ids"], r["completion_ids"]): r["advantage"] for r in theirs["advantages"]}
    matched = [(s, a, trl_advantages.get(sample_key(s["prompt_ids"], s["response_ids"]))) for s, a in
               zip(samples, ours_advantages, strict=True)]
    missing = sum(t is None for _, _, t in matched)
    differences = [abs(a - t) for _, a, t in matched if t is not None]
    ours_rewards, trl_rewards = sorted(s["score"] for s in samples), sorted(theirs["rewards"])
    return {"samples": len(samples), "not_found_in_trl": missing,
            "advantage_max_abs_difference": max(differences, default=None),
            "reward_sorted_max_abs_difference": max((abs(a - b) for a, b in zip(ours_rewards, trl_rewards, strict=True)),
                                                    default=None),
            "reward_mean": [statistics.mean(ours_rewards), statistics.mean(trl_rewards)]}


def sampler_trainer_kl(model_dir: Path, samples: list[dict]) -> dict:
    """The sampler's log-probs against the initial policy's (a plain transformers forward, as both trainers
    compute it), over every response token: mean log-ratio, the k3 KL estimate, the largest gap."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps, k3 = [], []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample["prompt_ids"] + sample["response_ids"]])
            logits = model(input_ids=ids).logits[0, len(sample["prompt_ids"]) - 1:-1].float()
            trainer = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample["response_ids"])[:, None])[:, 0]
            sampler = torch.tensor(sample["rollout_log_probs"])
            log_ratio = trainer - sampler  # log pi_trainer / pi_sampler, per token
            gaps.append(log_ratio)
            k3.append(torch.exp(log_ratio) - 1 - log_ratio)  # KL(sampler || trainer) estimate on sampler tokens
    gaps, k3 = torch.cat(gaps), torch.cat(k3)
    return {"tokens": gaps.numel(), "mean_log_ratio_trainer_minus_sampler": gaps.mean().item(),
            "kl_k3": k3.mean().item(), "max_abs_log_ratio": gaps.abs().max().item()}


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def update_agreement(initial: Path, ours: Path, theirs: Path) -> dict:
    """Each side's update (weights after minus before), compared: over all weights and the worst tensor."""
    before, after_ours, after_theirs = load_weights(initial), load_weights(ours), load_weights(theirs)
    shared = sorted(set(before) & set(after_ours) & set(after_theirs))
    dot = ours_sq = theirs_sq = 0.0
    per_tensor = {}
    for name in shared:
        delta_ours = (after_ours[name].float() - before[name].float()).flatten().double()
        delta_theirs = (after_theirs[name].float() - before[name].float()).flatten().double()
        dot += float(delta_ours @ delta_theirs)
        ours_sq += float(delta_ours @ delta_ours)
        theirs_sq += float(delta_theirs @ delta_theirs)
        norms = delta_ours.norm() * delta_theirs.norm()
        per_tensor[name] = {"cosine": float(delta_ours @ delta_theirs / norms) if norms > 0 else None,
                            "norm_ratio_rlfabric_over_trl": float(delta_ours.norm() / delta_theirs.norm())
                            if delta_theirs.norm() > 0 else None}
    cosines = {name: v["cosine"] for name, v in per_tensor.items() if v["cosine"] is not None}
    worst = min(cosines, key=cosines.get)
    return {"tensors": len(shared), "only_one_side": sorted(set(after_ours) ^ set(after_theirs)),
            "cosine_all_weights": dot / (ours_sq * theirs_sq) ** 0.5,
            "norm_ratio_rlfabric_over_trl": (ours_sq / theirs_sq) ** 0.5,
            "update_norm": {"rlfabric": ours_sq ** 0.5, "trl": theirs_sq ** 0.5},
            "worst_tensor": {"name": worst, **per_tensor[worst]},
            "median_tensor_cosine": statistics.median(cosines.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="real_model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
    spec = WORKLOADS[args.workload]
    trl_python()
    with tempfile.TemporaryDirectory(prefix="first-update-bench-") as tmp:
        work = Path(tmp)
        log(f"{args.workload}: rlfabric train, one step, seed {args.seed}")
        metrics, config, samples = rlfabric_step(spec, work / "rlfabric", args.seed)
        if set(Counter(s["prompt"] for s in samples).values()) != {config["rollout"]["n"]}:
            raise ValueError(f"seed {args.seed}: a prompt came twice in the step; TRL draws each once: try another")
        settings = trl_spec(config, spec, work / "rlfabric", args.seed, work / "trl-out")
        settings.update(steps=1, replay=str(work / "rlfabric" / "rollouts" / "step_1.jsonl"),
                        save_model_to=str(work / "trl-model"))
        log(f"{args.workload}: TRL replays the {len(samples)} samples")
        theirs = run_trl(settings, work, env={"TRL_EXPERIMENTAL_SILENCE": "1"})["replay"]  # rollout_func's warning
        log("comparing")
        model = Path(config["model"]["path"])
        report = {
            "workload": args.workload, "seed": args.seed, "model": model.name, "rlfabric_overrides": OVERRIDES,
            "trl_settings": {k: v for k, v in settings.items() if k not in ("replay", "save_model_to", "output_dir")},
            "per_sample": per_sample(samples, grpo_advantages(samples), theirs),
            "metrics": {ours: {"rlfabric": metrics.get(ours), "trl": theirs["logs"].get(trl), "trl_name": trl}
                        for ours, trl in SAME_METRICS.items()},
            "sampler_vs_trainer": sampler_trainer_kl(model, samples),
            "update": update_agreement(model, work / "rlfabric" / "final_model", work / "trl-model"),
            "trl_logs": theirs["logs"],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, pair in report["metrics"].items():
        log(f"{name:28s} rlfabric {pair['rlfabric']!s:24s} TRL {pair['trl']!s:24s} ({pair['trl_name']})")
    log(f"per sample: {report['per_sample']}")
    log(f"sampler vs trainer: {report['sampler_vs_trainer']}")
    update = report["update"]
    log(f"update: cosine {update['cosine_all_weights']:.4f}, norm ratio {update['norm_ratio_rlfabric_over_trl']:.4f}, "
        f"worst tensor {update['worst_tensor']}")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
