"""rlfabric's advantage estimators, policy losses, value loss and KL penalties against VeRL's own functions
(verl.trainer.ppo.core_algos of VeRL 0.9.1, run in a venv of its own: verl_venv.py, verl_side.py), on the same
float64 inputs: every output, gradient and stat VeRL gives must match to 1e-6.

One VeRL subprocess computes every case (inputs and outputs travel as .npz, no pickle). A VeRL venv that cannot
be built fails the module. The inputs are built to avoid what would only measure VeRL's float32 shortcuts:
scores on a grid float32 holds exactly (as rule-based rewards are), so that grpo_vectorized's float32 group
statistics cost no more than float32 rounding.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from rlfabric import algorithms as algos
from tests.algorithms.verl_venv import verl_python

TOLERANCE = 1e-6
F64 = torch.float64


# ---- inputs (float64, seeded) ----


def _outcome(gen: torch.Generator, sizes: list[int], length: int = 8) -> dict[str, torch.Tensor]:
    """An outcome batch: groups of `sizes`, right-padded responses of 1..length tokens, each score on its last
    token; scores on a grid of quarters, one group all alike (std 0) and one with a tie at the top."""
    index = torch.repeat_interleave(torch.arange(len(sizes)) * 7 + 3, torch.tensor(sizes))  # arbitrary ids
    lengths = torch.randint(1, length + 1, (len(index),), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(F64)  # [B, T]
    scores = torch.randint(0, 5, (len(index),), generator=gen).to(F64) / 4  # [B]
    scores[: sizes[0]] = 0.5  # group 0: no spread
    scores[sizes[0]: sizes[0] + 2] = 1.0  # group 1: two share the top
    scores[sizes[0] + 2: sizes[0] + sizes[1]] = torch.tensor([0.25, 0.0, 0.75, 0.5][: sizes[1] - 2], dtype=F64)
    rewards = torch.zeros(len(index), length, dtype=F64)
    rewards[torch.arange(len(index)), lengths - 1] = scores
    return {"rewards": rewards, "mask": mask, "index": index}


def _outcome_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    inputs = {}
    for name, sizes in (("outcome", [4, 4, 3, 5, 1, 2, 5]), ("pairs", [4, 4, 3, 5, 2, 6])):
        inputs.update({f"{name}/{key}": value for key, value in _outcome(gen, sizes).items()})
    # GDPO's reward components (two scorer outputs on the grid) and the prompt/attention layout VeRL reads them by.
    components = torch.randint(0, 5, (24, 2), generator=gen).to(F64) / 4
    components[:4, 1] = 1.0  # one component with no spread in group 0
    inputs.update({"outcome/format_reward": components[:, 0], "outcome/accuracy_reward": components[:, 1],
                   "outcome/prompts": torch.zeros(24, 3, dtype=torch.int64),
                   "outcome/attention_mask": torch.cat([torch.ones(24, 3), inputs["outcome/mask"]], 1).long()})
    return inputs


def _dense_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Dense rewards with values, masks with holes (tool output inside a multi-turn response) and padding."""
    mask = (torch.rand(6, 9, generator=gen) > 0.25).to(F64)
    mask[:, 0], mask[2, 6:] = 1, 0
    return {"dense/rewards": torch.randn(6, 9, generator=gen, dtype=F64), "dense/mask": mask,
            "dense/values": torch.randn(6, 9, generator=gen, dtype=F64),
            "dense/baselines": torch.randn(6, generator=gen, dtype=F64)}


def _loss_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Probabilities in (0.02, 0.98), the new policy near the old one, and one far from it (ratios past the
    dual clip, sequence ratios past GSPO's clip)."""
    old = torch.log(0.02 + 0.96 * torch.rand(8, 16, generator=gen, dtype=F64))
    lengths = torch.tensor([16, 3, 9, 12, 1, 16, 7, 10])
    mask = (torch.arange(16)[None, :] < lengths[:, None]).to(F64)
    empty = mask.clone()
    empty[3] = 0  # a row with no valid token (e.g. a sample whose scoring failed)
    values = torch.randn(8, 16, generator=gen, dtype=F64)

    def near(scale: float) -> torch.Tensor:
        return torch.clamp(old + scale * torch.randn(8, 16, generator=gen, dtype=F64), max=-1e-3)

    return {
        "loss/old": old, "loss/new": near(0.25), "loss/far": near(1.0), "loss/mask": mask, "loss/mask_empty": empty,
        "loss/adv": 1.5 * torch.randn(8, 16, generator=gen, dtype=F64),
        "loss/adv_seq": (1.5 * torch.randn(8, 1, generator=gen, dtype=F64)).expand(8, 16).contiguous(),
        "loss/is_weights": 0.5 + 1.5 * torch.rand(8, 16, generator=gen, dtype=F64),
        "loss/values": values, "loss/vpreds": values + 0.8 * torch.randn(8, 16, generator=gen, dtype=F64),
        "loss/returns": torch.randn(8, 16, generator=gen, dtype=F64),
    }


def _token_baseline_inputs(gen: torch.Generator, outcome: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The optimal token baselines' per-token inputs on the outcome batch: the sampled token's log-prob, a
    consistent sum over the vocabulary of pi^2 (pi_t^2 plus part of the (1 - pi_t)^2 the rest can give), IS
    weights, and a mask with holes (tool output inside multi-turn responses; one response left with none)."""
    mask = outcome["outcome/mask"]
    probs = 0.02 + 0.96 * torch.rand(mask.shape, generator=gen, dtype=F64)
    holes = mask * (torch.rand(mask.shape, generator=gen, dtype=F64) > 0.3)
    holes[:, 0] = mask[:, 0]  # the first token of each response is the model's
    holes[5] = 0  # a response of group 1 with no trained token
    return {"otb/old_log_probs": probs.log(),
            "otb/sum_pi_squared": probs**2 + (1 - probs) ** 2 * torch.rand(mask.shape, generator=gen, dtype=F64),
            "otb/is_weights": (0.5 + 1.5 * torch.rand(mask.shape, generator=gen, dtype=F64)) * mask,
            "otb/mask_holes": holes}


def _inputs() -> dict[str, torch.Tensor]:
    """Each family from a generator of its own, so that adding inputs to one leaves the others as they were."""
    outcome = _outcome_inputs(torch.Generator().manual_seed(48))
    return {**outcome, **_dense_inputs(torch.Generator().manual_seed(49)),
            **_loss_inputs(torch.Generator().manual_seed(50)),
            **_token_baseline_inputs(torch.Generator().manual_seed(51), outcome)}


INPUTS = _inputs()


# ---- cases: what VeRL calls (verl_side.py's case form) and what rlfabric computes ----


@dataclass
class Case:
    id: str
    verl: dict
    ours: Callable[[], dict[str, torch.Tensor]]


def _estimator_case(verl_name: str, ours_name: str, batch: str, suffix: str = "", norm_by_std: bool = True,
                    gamma: float = 1.0, lam: float = 1.0) -> Case:
    tensors = {"token_level_rewards": f"{batch}/rewards", "response_mask": f"{batch}/mask"}
    verl = {"kind": "estimator", "name": verl_name, "tensors": tensors, "algo": {"gamma": gamma,
            "norm_adv_by_std_in_grpo": norm_by_std}}
    if batch != "dense":
        verl["index"] = f"{batch}/index"
    if verl_name in ("grpo", "grpo_vectorized"):  # VeRL's trainer hands these the flag itself
        verl["scalars"] = {"norm_adv_by_std_in_grpo": norm_by_std}
    if verl_name == "gae":
        tensors["values"] = "dense/values"
        verl = {**verl, "scalars": {"gamma": gamma, "lam": lam}}
        del verl["algo"]
    if verl_name == "remax":
        tensors["reward_baselines"] = "dense/baselines"

    def ours() -> dict[str, torch.Tensor]:
        advantages, returns = algos.get_advantage_estimator(ours_name)(
            token_rewards=INPUTS[f"{batch}/rewards"], mask=INPUTS[f"{batch}/mask"], values=INPUTS["dense/values"],
            group_ids=INPUTS.get(f"{batch}/index"), baselines=INPUTS["dense/baselines"], gamma=gamma, lam=lam,
            norm_by_std=norm_by_std)
        return {"advantages": advantages, "returns": returns}

    return Case(f"estimator/{verl_name}{suffix}", verl, ours)


def _gdpo_case(suffix: str, weights: list[float] | None, norm_by_std: bool = True) -> Case:
    keys = ["format_reward", "accuracy_reward"]
    verl = {"kind": "estimator", "name": "gdpo", "index": "outcome/index",
            "tensors": {"token_level_rewards": "outcome/rewards", "response_mask": "outcome/mask"},
            "scalars": {"norm_adv_by_std_in_grpo": norm_by_std},
            "algo": {"gdpo_reward_keys": keys, "gdpo_reward_weights": weights},
            "non_tensor_batch": {key: f"outcome/{key}" for key in keys},
            "batch": {"prompts": "outcome/prompts", "attention_mask": "outcome/attention_mask"}}

    def ours() -> dict[str, torch.Tensor]:
        advantages, returns = algos.get_advantage_estimator("gdpo")(
            token_rewards=INPUTS["outcome/rewards"], mask=INPUTS["outcome/mask"], group_ids=INPUTS["outcome/index"],
            norm_by_std=norm_by_std, gdpo_reward_weights=weights,
            reward_components=torch.stack([INPUTS[f"outcome/{key}"] for key in keys], dim=-1))
        return {"advantages": advantages, "returns": returns}

    return Case(f"estimator/gdpo{suffix}", verl, ours)


def _token_baseline_case(name: str, suffix: str = "", mask: str = "outcome/mask", is_weights: bool = False) -> Case:
    """An optimal token baseline on the outcome batch, with the actor's log-probs and sum of pi^2."""
    tensors = {"token_level_rewards": "outcome/rewards", "response_mask": mask,
               "old_log_probs": "otb/old_log_probs", "sum_pi_squared": "otb/sum_pi_squared"}
    if is_weights:
        tensors["rollout_is_weights"] = "otb/is_weights"
    verl = {"kind": "estimator", "name": name, "tensors": tensors, "index": "outcome/index", "algo": {}}

    def ours() -> dict[str, torch.Tensor]:
        advantages, returns = algos.get_advantage_estimator(name)(
            token_rewards=INPUTS["outcome/rewards"], mask=INPUTS[mask], group_ids=INPUTS["outcome/index"],
            old_log_probs=INPUTS["otb/old_log_probs"], sum_pi_squared=INPUTS["otb/sum_pi_squared"],
            rollout_is_weights=INPUTS["otb/is_weights"] if is_weights else None)
        return {"advantages": advantages, "returns": returns}

    return Case(f"estimator/{name}{suffix}", verl, ours)


@dataclass
class BypassSettings:
    """algorithm.rollout_correction's keys that bypass_mode reads."""

    loss_type: str = "ppo_clip"
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float | None = None


# rlfabric's rejection levels as VeRL names them: the token's, or the sequence's summed, log-ratio within
# [log lower, log upper] (the same set of kept tokens for bounds symmetric in log space, as 1/C and C are).
VERL_RS = {"token": "token_k1", "sequence": "seq_sum_k1"}


def _bypass_case(suffix: str, settings: BypassSettings, agg: str = "token-mean", new: str = "loss/new") -> Case:
    """bypass_mode: old_log_prob is the rollout's; VeRL's rollout_corr/* diagnostics are left out (rlfabric's
    loss reports none: the coordinator's rollout_corr/* metrics are its)."""
    verl_settings = {"loss_type": settings.loss_type, "rollout_is": settings.rollout_is,
                     "rollout_is_threshold": settings.rollout_is_threshold, "bypass_mode": True,
                     "rollout_rs": VERL_RS.get(settings.rollout_rs),
                     "rollout_rs_threshold": settings.rollout_rs_threshold if settings.rollout_rs else None}
    case = _loss_case("bypass_mode", suffix, agg=agg, new=new, params={"rollout_correction": verl_settings})
    case.verl["drop_stats"] = ["rollout_corr/"]

    def ours() -> dict[str, torch.Tensor]:
        log_probs = INPUTS[new].clone().requires_grad_(True)
        loss, stats = algos.policy_loss(INPUTS["loss/old"], log_probs, INPUTS["loss/adv"], INPUTS["loss/mask"],
                                        clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, agg=agg, mode="bypass_mode",
                                        rollout_correction_settings=settings)
        loss.backward()
        return {"loss": loss.detach(), "grad": log_probs.grad, **{f"stat/{k}": v for k, v in stats.items()}}

    return Case(case.id, case.verl, ours)


def _loss_case(mode: str, suffix: str = "", agg: str = "token-mean", mask: str = "loss/mask", adv: str = "loss/adv",
               new: str = "loss/new", is_weights: bool = False, clip_low: float = 0.2, clip_high: float = 0.28,
               clip_ratio_c: float = 3.0, params: dict | None = None, seed: int = 0) -> Case:
    """A policy loss case: rlfabric's policy_loss(mode) against VeRL's registered loss of the same name, with
    VeRL's config keys (clip_ratio_*, tau_*, policy_loss.*) set from the same values."""
    params = params or {}
    tensors = {"old_log_prob": "loss/old", "log_prob": new, "advantages": adv, "response_mask": mask}
    if is_weights:
        tensors["rollout_is_weights"] = "loss/is_weights"
    actor_keys = {key: params[key] for key in ("tau_pos", "tau_neg") if key in params}
    verl = {"kind": "policy_loss", "name": mode, "tensors": tensors, "agg": agg, "seed": seed,
            "actor": {"clip_ratio": clip_low, "clip_ratio_low": clip_low, "clip_ratio_high": clip_high,
                      "clip_ratio_c": clip_ratio_c, **actor_keys},
            "policy_loss": {key: value for key, value in params.items() if key not in actor_keys}}

    def ours() -> dict[str, torch.Tensor]:
        log_probs = INPUTS[new].clone().requires_grad_(True)
        with torch.random.fork_rng():
            torch.manual_seed(seed)  # clip_cov draws its tokens from torch's global generator, as VeRL's does
            loss, stats = algos.policy_loss(
                INPUTS["loss/old"], log_probs, INPUTS[adv], INPUTS[mask], clip_low=clip_low, clip_high=clip_high,
                clip_ratio_c=clip_ratio_c, agg=agg, mode=mode,
                rollout_is_weights=INPUTS["loss/is_weights"] if is_weights else None, **params)
        loss.backward()
        return {"loss": loss.detach(), "grad": log_probs.grad, **{f"stat/{k}": v for k, v in stats.items()}}

    return Case(f"policy_loss/{mode}{suffix}", verl, ours)


def _value_case(agg: str) -> Case:
    verl = {"kind": "value_loss", "agg": agg, "scalars": {"cliprange_value": 0.5},
            "tensors": {"vpreds": "loss/vpreds", "returns": "loss/returns", "values": "loss/values",
                        "response_mask": "loss/mask_empty"}}

    def ours() -> dict[str, torch.Tensor]:
        vpreds = INPUTS["loss/vpreds"].clone().requires_grad_(True)
        loss, stats = algos.value_loss(vpreds, INPUTS["loss/returns"], INPUTS["loss/values"], INPUTS["loss/mask_empty"],
                                       clip_range=0.5, agg=agg)
        loss.backward()
        return {"loss": loss.detach(), "grad": vpreds.grad, "stat/vf_clipfrac": stats["vf_clipfrac"]}

    return Case(f"value_loss/{agg}", verl, ours)


def _kl_case(kind: str) -> Case:
    verl = {"kind": "kl_penalty", "name": kind, "tensors": {"logprob": "loss/new", "ref_logprob": "loss/old"}}

    def ours() -> dict[str, torch.Tensor]:
        new = INPUTS["loss/new"].clone().requires_grad_(True)
        kl = algos.kl_penalty(new, INPUTS["loss/old"], kind)
        kl.sum().backward()
        return {"kl": kl.detach(), "grad": new.grad}

    return Case(f"kl_penalty/{kind}", verl, ours)


CASES = [
    # Advantage estimators rlfabric had, then VeRL's others (same names).
    _estimator_case("gae", "gae", "dense", gamma=0.95, lam=0.9),
    _estimator_case("grpo", "grpo", "outcome"),
    _estimator_case("grpo", "grpo", "outcome", "/dr_grpo", norm_by_std=False),
    _estimator_case("rloo", "rloo", "outcome"),
    _estimator_case("reinforce_plus_plus", "reinforce_plus_plus", "dense", gamma=0.9),
    _estimator_case("remax", "remax", "dense"),
    _estimator_case("grpo_vectorized", "grpo_vectorized", "outcome"),
    _estimator_case("grpo_vectorized", "grpo_vectorized", "outcome", "/dr_grpo", norm_by_std=False),
    _estimator_case("rloo_vectorized", "rloo_vectorized", "outcome"),
    _estimator_case("grpo_passk", "grpo_passk", "pairs"),
    _estimator_case("grpo_passk", "grpo_passk", "pairs", "/no_std", norm_by_std=False),
    _estimator_case("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline", "outcome"),
    _estimator_case("opo", "opo", "outcome"),
    _estimator_case("gpg", "gpg", "outcome"),
    _gdpo_case("", None),
    _gdpo_case("/weights", [0.25, 1.5]),
    _gdpo_case("/no_std", [0.25, 1.5], norm_by_std=False),
    _token_baseline_case("optimal_token_baseline"),
    _token_baseline_case("optimal_token_baseline", "/is_weights", is_weights=True),
    _token_baseline_case("optimal_token_baseline", "/holes", mask="otb/mask_holes"),
    _token_baseline_case("tir_optimal_token_baseline"),
    _token_baseline_case("tir_optimal_token_baseline", "/holes", mask="otb/mask_holes"),
    _token_baseline_case("tir_optimal_token_baseline", "/holes_is_weights", mask="otb/mask_holes", is_weights=True),
    # Policy losses: PPO's under every aggregation, then VeRL's others.
    *[_loss_case("vanilla", f"/{agg}", agg=agg, mask="loss/mask_empty") for agg in algos.AGG_MODES],
    _loss_case("vanilla", "/is_weights", is_weights=True),
    _loss_case("vanilla", "/far", new="loss/far"),
    _loss_case("gspo", agg="seq-mean-token-mean", adv="loss/adv_seq"),
    _loss_case("gspo", "/far", agg="seq-mean-token-mean", new="loss/far", is_weights=True),
    _loss_case("gpg"),
    _loss_case("cispo"),
    _loss_case("cispo", "/seq-mean-token-mean", agg="seq-mean-token-mean", mask="loss/mask_empty", is_weights=True),
    _loss_case("dppo_tv", clip_ratio_c=1.2),
    _loss_case("dppo_tv", "/far", new="loss/far", clip_ratio_c=20.0),
    _loss_case("dppo_kl", clip_ratio_c=1.2, clip_low=0.05, clip_high=0.08),
    _loss_case("dro", params={"dro_beta": 0.3}),
    _loss_case("sapo", params={"tau_pos": 1.0, "tau_neg": 1.05}),
    _loss_case("sapo", "/taus", params={"tau_pos": 2.0, "tau_neg": 4.0}, is_weights=True),
    _loss_case("geo_mean", adv="loss/adv_seq", clip_low=0.1, clip_high=0.15),
    _loss_case("geo_mean", "/is_weights", adv="loss/adv_seq", is_weights=True),
    _loss_case("clip_cov", params={"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}),
    _loss_case("clip_cov", "/many", params={"clip_cov_ratio": 0.2, "clip_cov_lb": 0.2, "clip_cov_ub": 5.0}, seed=7),
    _loss_case("kl_cov", params={"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}),
    _loss_case("kl_cov", "/many", params={"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0}, mask="loss/mask_empty"),
    _bypass_case("", BypassSettings()),
    _bypass_case("/far_token_rs", BypassSettings(rollout_rs="token", rollout_rs_threshold=2.0), new="loss/far"),
    _bypass_case("/reinforce", BypassSettings(loss_type="reinforce")),
    _bypass_case("/reinforce_token_is", BypassSettings(loss_type="reinforce", rollout_is="token",
                                                        rollout_is_threshold=1.5), agg="seq-mean-token-mean"),
    _bypass_case("/reinforce_seq_is_rs", BypassSettings(loss_type="reinforce", rollout_is="sequence",
                                                         rollout_rs="sequence", rollout_rs_threshold=3.0),
                 new="loss/far"),
    # The value loss and the KL penalties.
    *[_value_case(agg) for agg in algos.AGG_MODES],
    *[_kl_case(kind) for kind in ("kl", "abs", "mse", "low_var_kl", "k3+", "low_var_kl+")],
]


@pytest.fixture(scope="module")
def verl_outputs(tmp_path_factory) -> dict[str, np.ndarray]:
    """Every case computed by VeRL in one subprocess of the VeRL venv (built on first use)."""
    try:
        python = verl_python()
    except RuntimeError as error:
        pytest.fail(f"the VeRL venv could not be built: {error}", pytrace=False)
    folder = tmp_path_factory.mktemp("verl")
    np.savez(folder / "inputs.npz", **{key: value.numpy() for key, value in INPUTS.items()})
    (folder / "cases.json").write_text(json.dumps([{"id": case.id, **case.verl} for case in CASES]))
    done = subprocess.run([str(python), str(Path(__file__).with_name("verl_side.py")), str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"VeRL's side failed:\n{done.stderr[-4000:]}"
    with np.load(folder / "outputs.npz", allow_pickle=False) as archive:
        return {key: archive[key] for key in archive.files}


def max_abs_diff(case: Case, verl: dict[str, np.ndarray]) -> dict[str, float]:
    """Each of VeRL's outputs of `case` -> max |rlfabric - VeRL| (inf when rlfabric lacks it or shapes differ)."""
    ours = {name: torch.as_tensor(value).detach().to(F64).numpy() for name, value in case.ours().items()}
    diffs = {}
    for key, expected in verl.items():
        case_id, _, name = key.partition("::")
        if case_id != case.id:
            continue
        actual = ours.get(name)
        same_shape = actual is not None and np.shape(actual) == np.shape(expected)
        diffs[name] = float(np.max(np.abs(actual - expected), initial=0.0)) if same_shape else math.inf
    return diffs


# Stats that must be non-zero in VeRL's outputs, so that the cases reach the branches they are there for.
REACHED = ("vanilla/far::stat/pg_clipfrac_lower", "gspo/far::stat/pg_clipfrac", "cispo::stat/pg_clipfrac",
           "dppo_tv::stat/pg_clipfrac", "dppo_tv::stat/pg_clipfrac_lower", "dppo_kl::stat/pg_clipfrac",
           "dppo_kl::stat/pg_clipfrac_lower", "geo_mean::stat/pg_clipfrac", "geo_mean::stat/pg_clipfrac_lower",
           "clip_cov::stat/pg_clipfrac", "clip_cov/many::stat/pg_clipfrac")


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_matches_verl(case, verl_outputs):
    diffs = max_abs_diff(case, verl_outputs)
    assert diffs, f"VeRL gave no outputs for {case.id}"
    assert {"loss", "advantages", "kl"} & set(diffs), diffs  # the main output was compared
    assert max(diffs.values()) <= TOLERANCE, diffs


def test_the_cases_reach_the_branches_they_test(verl_outputs):
    assert all(float(verl_outputs[f"policy_loss/{key}"]) > 0 for key in REACHED), \
        {key: float(verl_outputs[f"policy_loss/{key}"]) for key in REACHED}
    passk = verl_outputs["estimator/grpo_passk::advantages"][:, 0]
    assert np.count_nonzero(passk) >= 3  # a best response learns in most groups (not in the tied one)
    out = {key.removeprefix("estimator/"): value for key, value in verl_outputs.items()}
    otb = "optimal_token_baseline"
    assert np.abs(out[f"{otb}/is_weights::advantages"] - out[f"{otb}::advantages"]).max() > 0.01  # weights count
    assert np.abs(out[f"tir_{otb}/holes::advantages"] - out[f"{otb}/holes::advantages"]).max() > 0.01  # realigned
    lengths, index = INPUTS["outcome/mask"].sum(-1), INPUTS["outcome/index"]
    unique_longest = [int((lengths[index == g] == lengths[index == g].max()).sum()) == 1
                      for g in index.unique() if (index == g).sum() > 1]
    assert sum(unique_longest) >= 2  # handle_zero_tail acts in some groups

    def bypass(settings: BypassSettings, new: str, agg: str) -> float:  # matches VeRL's, by the cases above
        return float(algos.policy_loss(INPUTS["loss/old"], INPUTS[new], INPUTS["loss/adv"], INPUTS["loss/mask"],
                                       agg=agg, mode="bypass_mode", rollout_correction_settings=settings)[0])

    for settings, new, agg in ((BypassSettings("reinforce", "token", 1.5), "loss/new", "seq-mean-token-mean"),
                               (BypassSettings(rollout_rs="token"), "loss/far", "token-mean")):
        off = dataclasses.replace(settings, rollout_is=None, rollout_rs=None)
        assert abs(bypass(settings, new, agg) - bypass(off, new, agg)) > 1e-3  # the IS weights, the rejection act
