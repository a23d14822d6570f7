"""algorithm.plugin_modules: your advantage estimators and policy losses, registered without editing
rlfabric. A plugin is a plain Python module on the processes' import path whose import registers them:

    # my_algos.py (examples/plugins/topr_plugin.py is a complete one)
    from rlfabric import algorithms as algos
    algos.register_policy_loss("topr", topr_loss)

    # the run's config
    algorithm: {plugin_modules: [my_algos], adv_estimator: grpo}
    actor: {loss_mode: topr}

The coordinator imports them when it starts (advantage estimators run there) and so does every rank of
the actor (policy losses run there). Reward scorers are the reward service's: reward.scorer_modules.

Plugins run with the service's rights, so only the operator's config names them: the processes import
them at start, and a StartRun may not name a module its mesh was not started with (PERMISSION_DENIED).
"""

from __future__ import annotations

from collections.abc import Sequence

from rlfabric.core.config import ConfigError, RunConfig, import_named_modules


def load_plugin_modules(modules: Sequence[str]) -> None:
    """Imports each module (again: a no-op); ConfigError naming algorithm.plugin_modules and the module when
    one cannot be imported or its registrations fail (e.g. a name that clashes with a built-in)."""
    import_named_modules("algorithm.plugin_modules", modules)


def check_algorithm_names(config: RunConfig) -> None:
    """Imports algorithm.plugin_modules, then ConfigError naming the key unless algorithm.adv_estimator and
    actor.loss_mode are registered, their params are algorithm / actor keys, and actor.kl_loss_type and
    algorithm.kl_penalty are KL estimators. What the coordinator (StartRun), the actor (its start) and
    `rlfabric check` ask."""
    import torch

    from rlfabric.algorithms.kl import kl_penalty
    from rlfabric.algorithms.registry import (
        POLICY_LOSS_SECTIONS,
        advantage_estimator_names,
        advantage_estimator_params,
        policy_loss_names,
        policy_loss_params,
    )

    load_plugin_modules(config.algorithm.plugin_modules)
    for key, name, known in (("algorithm.adv_estimator", config.algorithm.adv_estimator, advantage_estimator_names()),
                             ("actor.loss_mode", config.actor.loss_mode, policy_loss_names())):
        if name not in known:
            raise ConfigError(f"{key} {name!r} is not registered; known: {', '.join(known)} (add yours with "
                              "algorithm.plugin_modules)")
    for key, name, params, section in (
            ("algorithm.adv_estimator", config.algorithm.adv_estimator,
             advantage_estimator_params(config.algorithm.adv_estimator), config.algorithm),
            ("actor.loss_mode", config.actor.loss_mode, policy_loss_params(config.actor.loss_mode), config.actor)):
        unknown = [param for param in params if param not in type(section).model_fields
                   and not (section is config.actor and param in POLICY_LOSS_SECTIONS)]
        if unknown:
            raise ConfigError(f"{key} {name!r} was registered with params {unknown} that are no "
                              f"{key.split('.')[0]} keys")
    for key, kind in (("actor.kl_loss_type", config.actor.kl_loss_type),
                      ("algorithm.kl_penalty", config.algorithm.kl_penalty)):
        try:
            kl_penalty(torch.zeros(1), torch.zeros(1), kind)  # ValueError naming the kinds for an unknown one
        except ValueError as error:
            raise ConfigError(f"{key}: {error}") from None


def policy_loss_sections(config: RunConfig) -> dict:
    """The config sections of POLICY_LOSS_SECTIONS by name, which a policy loss may take whole (bypass_mode's
    algorithm.rollout_correction)."""
    from rlfabric.algorithms.registry import POLICY_LOSS_SECTIONS

    sections = {}
    for name, path in POLICY_LOSS_SECTIONS.items():
        section = config
        for key in path.split("."):
            section = getattr(section, key)
        sections[name] = section
    return sections
