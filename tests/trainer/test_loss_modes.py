"""Each of VeRL's policy losses through the actor's own path: its name and its settings from a run config
(actor.loss_mode, actor.dro_beta, actor.clip_cov_ratio, ...), the actor's PolicyObjective on the tiny model.
The policy loss it reports is the registered function's on the same log-probs with the config's settings,
and another value of a setting changes that loss, so a setting that does not reach its loss fails."""

from __future__ import annotations

import pytest
import torch

from rlfabric import algorithms as algos
from rlfabric.algorithms.plugins import check_algorithm_names, policy_loss_sections
from rlfabric.trainer import models
from rlfabric.trainer.batch import validate_batch
from rlfabric.trainer.objectives import MiniBatchCounts, PolicyObjective, forward_log_probs
from tests.trainer.helpers import make_batch, make_config

TEMPERATURE = 0.7
# mode -> (its settings in the config, other values of them that must change its loss, or None)
LOSS_MODES = {
    "gpg": ({}, None),
    "cispo": ({}, None),
    "dppo_tv": ({}, None),
    "dppo_kl": ({}, None),
    "dro": ({"dro_beta": 0.5}, {"dro_beta": 2.0}),
    "sapo": ({"tau_pos": 2.0, "tau_neg": 3.0}, {"tau_pos": 1.0, "tau_neg": 1.05}),
    "geo_mean": ({}, None),
    "clip_cov": ({"clip_cov_ratio": 0.3, "clip_cov_lb": -1e9, "clip_cov_ub": 1e9},
                 {"clip_cov_ratio": 0.0002, "clip_cov_lb": -1e9, "clip_cov_ub": 1e9}),
    "kl_cov": ({"kl_cov_ratio": 0.3, "ppo_kl_coef": 2.0}, {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}),
}


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_each_loss_mode_trains_with_its_config_settings(hf_model, tiny_model, mode):
    settings, other = LOSS_MODES[mode]
    config = make_config(tiny_model, actor={"loss_mode": mode, **settings})
    check_algorithm_names(config)  # what the actor asks at start: the name is registered, its settings are keys
    cfg = config.actor
    keep_logits = models.accepts_logits_to_keep(hf_model)
    raw = make_batch(rows=4, prompt_len=6, response_len=5)
    gen = torch.Generator().manual_seed(0)
    current, *_ = forward_log_probs(hf_model, validate_batch(raw, models.vocab_size(hf_model)), TEMPERATURE,
                                  False, keep_logits)
    old = current.detach() + 0.3 * torch.randn(current.shape, generator=gen, dtype=current.dtype)  # ratios != 1
    batch = validate_batch({**raw, "advantages": torch.randn(4, 5, generator=gen), "old_log_probs": old},
                           models.vocab_size(hf_model), required_floats=("advantages", "old_log_probs"))
    counts = MiniBatchCounts(tokens=float(batch["response_mask"].sum()), sequences=4.0, response_len=5)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # clip_cov draws the tokens it cuts from torch's generator
        _, stats = PolicyObjective(cfg, TEMPERATURE, keep_logits).loss(hf_model, batch, counts)

    def direct(loss_settings: dict) -> torch.Tensor:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            loss, _ = algos.policy_loss(
                batch["old_log_probs"], current.detach(), batch["advantages"], batch["response_mask"].float(),
                clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                agg=cfg.loss_agg_mode, mode=mode, **counts.aggregation(), **loss_settings)
        return loss

    torch.testing.assert_close(stats["pg_loss"], direct(settings).to(stats["pg_loss"].dtype))
    if other is not None:
        assert abs(float(direct(other)) - float(stats["pg_loss"])) > 1e-3  # the settings matter: they arrived


def test_bypass_mode_takes_algorithm_rollout_correction(hf_model, tiny_model):
    """bypass_mode's settings are algorithm.rollout_correction's (VeRL's place), passed whole by the actor."""
    overrides = {"algorithm": {"old_log_prob_source": "rollout",
                               "rollout_correction": {"loss_type": "reinforce", "rollout_is": "token",
                                                      "rollout_is_threshold": 1.1}}}
    config = make_config(tiny_model, actor={"loss_mode": "bypass_mode"}, **overrides)
    check_algorithm_names(config)
    keep_logits = models.accepts_logits_to_keep(hf_model)
    raw = make_batch(rows=4, prompt_len=6, response_len=5)
    gen = torch.Generator().manual_seed(1)
    current, *_ = forward_log_probs(hf_model, validate_batch(raw, models.vocab_size(hf_model)), TEMPERATURE,
                                    False, keep_logits)
    rollout = current.detach() + 0.3 * torch.randn(current.shape, generator=gen, dtype=current.dtype)
    batch = validate_batch({**raw, "advantages": torch.randn(4, 5, generator=gen), "old_log_probs": rollout},
                           models.vocab_size(hf_model), required_floats=("advantages", "old_log_probs"))
    counts = MiniBatchCounts(tokens=float(batch["response_mask"].sum()), sequences=4.0, response_len=5)
    cfg = config.actor
    _, stats = PolicyObjective(cfg, TEMPERATURE, keep_logits, sections=policy_loss_sections(config)).loss(
        hf_model, batch, counts)

    def direct(settings) -> torch.Tensor:
        loss, _ = algos.policy_loss(batch["old_log_probs"], current.detach(), batch["advantages"],
                                    batch["response_mask"].float(), clip_low=cfg.clip_ratio_low,
                                    clip_high=cfg.clip_ratio_high, agg=cfg.loss_agg_mode, mode="bypass_mode",
                                    **counts.aggregation(), rollout_correction_settings=settings)
        return loss

    torch.testing.assert_close(stats["pg_loss"], direct(config.algorithm.rollout_correction).to(stats["pg_loss"].dtype))
    assert abs(float(direct(None)) - float(stats["pg_loss"])) > 1e-3  # ppo_clip without IS: another loss
