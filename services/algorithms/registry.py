"""Name -> function registries, so config picks the advantage estimator and policy loss by name.

Register your own with one plain call, then select it by name in the config:

    def my_estimator(*, token_rewards, mask, values=None, group_ids=None, baselines=None,
                     gamma=1.0, lam=1.0, norm_by_std=True):
        ...
        return advantages, returns  # both [batch, response_len]

    register_advantage_estimator("my_est", my_estimator)
    advantages, returns = get_advantage_estimator("my_est")(token_rewards=r, mask=m, values=v)

Advantage estimator call form: keyword-only arguments exactly ADVANTAGE_ESTIMATOR_KWARGS
(`token_rewards`, `mask` [batch, response_len]; `values` [batch, response_len] or None; `group_ids` int64
[batch] or None; `baselines` [batch] or None; floats `gamma`, `lam`; bool `norm_by_std`). An estimator
ignores what it does not need and raises ValueError when something it needs is None.

Policy loss call form: `fn(old_log_probs, log_probs, advantages, mask, *, clip_low, clip_high,
clip_ratio_c, agg, global_token_count, global_seq_count, scale_factor, rollout_is_weights) -> (loss,
stats)`, the same arguments as `losses.policy_loss` less `mode`; `agg` may be None (use the mode's own
default); `rollout_is_weights` is None or [batch, response_len] weights to multiply the per-token loss
by before aggregation (algorithm.rollout_correction.rollout_is). Inputs arrive already shape-checked;
stats is a dict of 0-dim tensors, reported by the actor as actor/<name>.

Built-ins: estimators gae, grpo, rloo, reinforce_plus_plus, remax (advantages.ADVANTAGE_ESTIMATORS); policy
losses vanilla, gspo (losses.POLICY_LOSSES). Their names are known here without torch (a config is checked
in a blink); their modules are imported when one is first asked for. No registration may replace a built-in
(overwrite=True replaces only your own). A run's config imports its own registrations from
algorithm.plugin_modules (rlfabric.algorithms.plugins). This module imports no torch.
"""

import importlib
from collections.abc import Callable

ADVANTAGE_ESTIMATOR_KWARGS = (
    "token_rewards", "mask", "values", "group_ids", "baselines", "gamma", "lam", "norm_by_std",
)

BUILTIN_ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "remax")
BUILTIN_POLICY_LOSSES = ("vanilla", "gspo")
# KL estimators of kl.kl_penalty; each also with a "+" (its value, k2's gradient).
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")

_ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}  # yours; the built-ins stay in their modules
_POLICY_LOSSES: dict[str, Callable] = {}
# what -> (its built-in names, the module and the table that hold their functions)
_BUILTINS = {"advantage_estimator": (BUILTIN_ADVANTAGE_ESTIMATORS, "advantages", "ADVANTAGE_ESTIMATORS"),
             "policy_loss": (BUILTIN_POLICY_LOSSES, "losses", "POLICY_LOSSES")}


def unknown_name(fn: str, what: str, name: str, known) -> ValueError:
    """The error for a name that is not one of `known` (lists the known names)."""
    return ValueError(f"{fn}: unknown {what} {name!r}; known: {', '.join(sorted(known))}")


def _register(table: dict[str, Callable], what: str, name: str, fn: Callable, overwrite: bool) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_{what}: name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise TypeError(f"register_{what}: {name!r} is not callable: {fn!r}")
    if name in _BUILTINS[what][0]:
        raise ValueError(f"register_{what}: {name!r} is built in and cannot be replaced; register yours under "
                         "another name")
    if name in table and not overwrite:
        raise ValueError(f"register_{what}: {name!r} is already registered; pass overwrite=True to replace it")
    table[name] = fn


def _get(table: dict[str, Callable], what: str, name: str, shown: str) -> Callable:
    names, module, builtins = _BUILTINS[what]
    if name in names:
        return getattr(importlib.import_module(f"rlfabric.algorithms.{module}"), builtins)[name]
    if name not in table:
        raise unknown_name(f"get_{what}", shown, name, [*names, *table])
    return table[name]


def register_advantage_estimator(name: str, fn: Callable, overwrite: bool = False) -> None:
    """Make `fn` (in the advantage estimator call form above) selectable as `name`."""
    _register(_ADVANTAGE_ESTIMATORS, "advantage_estimator", name, fn, overwrite)


def get_advantage_estimator(name: str) -> Callable:
    """The advantage estimator registered as `name`; ValueError listing the known names otherwise."""
    return _get(_ADVANTAGE_ESTIMATORS, "advantage_estimator", name, "advantage estimator")


def advantage_estimator_names() -> list[str]:
    """Registered advantage estimator names, the built-ins included, sorted."""
    return sorted({*BUILTIN_ADVANTAGE_ESTIMATORS, *_ADVANTAGE_ESTIMATORS})


def register_policy_loss(name: str, fn: Callable, overwrite: bool = False) -> None:
    """Make `fn` (in the policy loss call form above) selectable as policy_loss(mode=name)."""
    _register(_POLICY_LOSSES, "policy_loss", name, fn, overwrite)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as `name`; ValueError listing the known names otherwise."""
    return _get(_POLICY_LOSSES, "policy_loss", name, "policy loss mode")


def policy_loss_names() -> list[str]:
    """Registered policy loss mode names, the built-ins included, sorted."""
    return sorted({*BUILTIN_POLICY_LOSSES, *_POLICY_LOSSES})


def kl_kind_base(kind: str) -> str:
    """The KL estimator of a kl_penalty kind ("k3+" -> "k3"); ValueError listing the kinds when it is none."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_KINDS:
        raise unknown_name("kl_penalty", "kind", kind, KL_KINDS + tuple(k + "+" for k in KL_KINDS))
    return base
