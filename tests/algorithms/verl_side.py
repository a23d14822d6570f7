"""VeRL's half of the parity test (test_verl_parity.py), run by the VeRL venv's Python (verl_venv.py):

    python verl_side.py DIR

reads DIR/cases.json (what to call) and DIR/inputs.npz (the tensors, float64), calls VeRL's own functions from
verl.trainer.ppo.core_algos, and writes every case's outputs to DIR/outputs.npz as "<case id>::<output name>".
No pickle: plain arrays in, plain arrays out. Imports nothing of rlfabric's.

A case: {"id", "kind": estimator | policy_loss | value_loss | kl_penalty, "name": VeRL's registered name,
"tensors": {VeRL's argument: input key}, "scalars": {argument: value}, "index": input key of the group ids
(estimators), "non_tensor_batch" and "batch": {name: input key} (gdpo), "algo": AlgoConfig fields, "actor": FSDPActorConfig fields, "policy_loss": PolicyLossConfig
fields (its "rollout_correction": RolloutCorrectionConfig fields, bypass_mode), "agg": loss_agg_mode, "seed":
torch's seed before the call, "drop_stats": prefixes of metric names left out}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import FSDPActorConfig, PolicyLossConfig


def _tensors(case: dict, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {arg: torch.from_numpy(inputs[key]) for arg, key in case.get("tensors", {}).items()}


def estimator(case: dict, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    kwargs = {**_tensors(case, inputs), **case.get("scalars", {})}
    if "index" in case:
        kwargs["index"] = inputs[case["index"]]  # a numpy array of ids, as VeRL's uid column
    if "non_tensor_batch" in case:  # gdpo: the scorer's outputs by name, and the batch's layout
        kwargs["non_tensor_batch"] = {name: inputs[key] for name, key in case["non_tensor_batch"].items()}
        kwargs["batch"] = {name: torch.from_numpy(inputs[key]) for name, key in case["batch"].items()}
    if "algo" in case:
        kwargs["config"] = AlgoConfig(**case["algo"])
    advantages, returns = core_algos.get_adv_estimator_fn(case["name"])(**kwargs)
    return {"advantages": advantages, "returns": returns}


def policy_loss(case: dict, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    tensors = _tensors(case, inputs)
    log_prob = tensors.pop("log_prob").clone().requires_grad_(True)
    loss_settings = dict(case.get("policy_loss", {}))
    if "rollout_correction" in loss_settings:  # bypass_mode's settings
        loss_settings["rollout_correction"] = RolloutCorrectionConfig(**loss_settings["rollout_correction"])
    config = FSDPActorConfig(rollout_n=1, ppo_micro_batch_size_per_gpu=1, global_batch_info={},
                             policy_loss=PolicyLossConfig(loss_mode=case["name"], **loss_settings),
                             **case.get("actor", {}))
    torch.manual_seed(case.get("seed", 0))
    loss, metrics = core_algos.get_policy_loss_fn(case["name"])(
        log_prob=log_prob, loss_agg_mode=case["agg"], config=config, **tensors)
    loss.backward()
    dropped = tuple(case.get("drop_stats", ()))
    stats = {f"stat/{name.removeprefix('actor/')}": torch.tensor(float(value)) for name, value in metrics.items()
             if not name.startswith(dropped)}
    return {"loss": loss.detach(), "grad": log_prob.grad, **stats}


def value_loss(case: dict, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    tensors = _tensors(case, inputs)
    vpreds = tensors.pop("vpreds").clone().requires_grad_(True)
    loss, clipfrac = core_algos.compute_value_loss(vpreds=vpreds, **tensors, **case.get("scalars", {}),
                                                   loss_agg_mode=case["agg"])
    loss.backward()
    return {"loss": loss.detach(), "grad": vpreds.grad, "stat/vf_clipfrac": clipfrac.detach()}


def kl_penalty(case: dict, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    tensors = _tensors(case, inputs)
    logprob = tensors.pop("logprob").clone().requires_grad_(True)
    kl = core_algos.kl_penalty(logprob, kl_penalty=case["name"], **tensors)
    kl.sum().backward()
    return {"kl": kl.detach(), "grad": logprob.grad}


KINDS = {"estimator": estimator, "policy_loss": policy_loss, "value_loss": value_loss, "kl_penalty": kl_penalty}


def main(folder: Path) -> None:
    cases = json.loads((folder / "cases.json").read_text())
    with np.load(folder / "inputs.npz", allow_pickle=False) as archive:
        inputs = {key: archive[key] for key in archive.files}
    outputs = {}
    for case in cases:
        for name, value in KINDS[case["kind"]](case, inputs).items():
            outputs[f"{case['id']}::{name}"] = value.detach().to(torch.float64).numpy()
    np.savez(folder / "outputs.npz", **outputs)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
