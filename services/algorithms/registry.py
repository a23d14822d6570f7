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

A loss that needs settings of its own names them at registration (`params`): actor config keys that the
actor passes it as extra keyword arguments (e.g. clip_cov's actor.clip_cov_ratio), or a name of
POLICY_LOSS_SECTIONS (bypass_mode's algorithm.rollout_correction, passed whole). An estimator may name
algorithm config keys the same way, and `inputs`: per-sample data beyond the call form, from
ESTIMATOR_INPUTS, which the coordinator then gathers and passes (e.g. gdpo's reward_components; the
optimal token baselines' sum_pi_squared, for which it asks the actor's log-prob pass).

Built-ins, under VeRL's names: the estimators of BUILTIN_ADVANTAGE_ESTIMATORS (advantages.py) and the
policy losses of BUILTIN_POLICY_LOSSES (losses.py, reinforce_losses.py, surrogate_losses.py, bypass.py). Each module
registers its own at import; no registration may replace a built-in (overwrite=True replaces only your
own). A run's config imports its own registrations from algorithm.plugin_modules
(rlfabric.algorithms.plugins).
"""

from collections.abc import Callable

from ._checks import unknown_name

ADVANTAGE_ESTIMATOR_KWARGS = (
    "token_rewards", "mask", "values", "group_ids", "baselines", "gamma", "lam", "norm_by_std",
)

BUILTIN_ADVANTAGE_ESTIMATORS = (
    "gae", "grpo", "rloo", "reinforce_plus_plus", "remax", "grpo_vectorized", "rloo_vectorized", "grpo_passk",
    "reinforce_plus_plus_baseline", "opo", "gpg", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline",
)
BUILTIN_POLICY_LOSSES = (
    "vanilla", "gspo", "gpg", "cispo", "dppo_tv", "dppo_kl", "dro", "sapo", "geo_mean", "clip_cov", "kl_cov",
    "bypass_mode",
)

# What an estimator may ask for beyond the call form (register_advantage_estimator's inputs).
ESTIMATOR_INPUTS = {
    "reward_components": "[batch, K] float: the scorer outputs algorithm.gdpo_reward_keys names, a column each "
                         "(0 for a sample whose scoring failed)",
    "old_log_probs": "[batch, response_len] the actor's log-probs of the sampled tokens (its old-log-prob pass)",
    "sum_pi_squared": "[batch, response_len] sum over the vocabulary of the actor's pi(v)^2 at each response "
                      "token (asked of the same pass)",
    "rollout_is_weights": "[batch, response_len] algorithm.rollout_correction's IS weights, or None when it is off",
}

# What a policy loss may name in its params beyond actor keys: config sections the actor passes whole.
POLICY_LOSS_SECTIONS = {"rollout_correction_settings": "algorithm.rollout_correction"}

_ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
_ADVANTAGE_ESTIMATOR_EXTRAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}  # name -> (params, inputs)
_POLICY_LOSSES: dict[str, Callable] = {}
_POLICY_LOSS_PARAMS: dict[str, tuple[str, ...]] = {}
_BUILTINS = {"advantage_estimator": BUILTIN_ADVANTAGE_ESTIMATORS, "policy_loss": BUILTIN_POLICY_LOSSES}


def _register(table: dict[str, Callable], what: str, name: str, fn: Callable, overwrite: bool) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_{what}: name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise TypeError(f"register_{what}: {name!r} is not callable: {fn!r}")
    if name in table and name in _BUILTINS[what]:
        raise ValueError(f"register_{what}: {name!r} is built in and cannot be replaced; register yours under "
                         "another name")
    if name in table and not overwrite:
        raise ValueError(f"register_{what}: {name!r} is already registered; pass overwrite=True to replace it")
    table[name] = fn


def _key_names(what: str, name: str, keys: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(keys, str) or not all(isinstance(key, str) and key.isidentifier() for key in keys):
        raise ValueError(f"register_{what}: the extra arguments of {name!r} must be a tuple of names, got {keys!r}")
    return tuple(keys)


def register_advantage_estimator(name: str, fn: Callable, overwrite: bool = False, params: tuple[str, ...] = (),
                                 inputs: tuple[str, ...] = ()) -> None:
    """Make `fn` (in the advantage estimator call form above) selectable as `name`. `params`: algorithm config
    keys it takes as extra keyword arguments of the same names; `inputs`: ESTIMATOR_INPUTS it takes so."""
    params, inputs = _key_names("advantage_estimator", name, params), _key_names("advantage_estimator", name, inputs)
    unknown = [key for key in inputs if key not in ESTIMATOR_INPUTS]
    if unknown:
        raise ValueError(f"register_advantage_estimator: {name!r} asks for inputs {unknown}; known: "
                         f"{', '.join(ESTIMATOR_INPUTS)}")
    _register(_ADVANTAGE_ESTIMATORS, "advantage_estimator", name, fn, overwrite)
    _ADVANTAGE_ESTIMATOR_EXTRAS[name] = params, inputs


def get_advantage_estimator(name: str) -> Callable:
    """The advantage estimator registered as `name`; ValueError listing the known names otherwise."""
    if name not in _ADVANTAGE_ESTIMATORS:
        raise unknown_name("get_advantage_estimator", "advantage estimator", name, _ADVANTAGE_ESTIMATORS)
    return _ADVANTAGE_ESTIMATORS[name]


def advantage_estimator_params(name: str) -> tuple[str, ...]:
    """The algorithm config keys the estimator `name` takes (its registration's params); () for most."""
    get_advantage_estimator(name)  # ValueError for an unknown name
    return _ADVANTAGE_ESTIMATOR_EXTRAS.get(name, ((), ()))[0]


def advantage_estimator_inputs(name: str) -> tuple[str, ...]:
    """The ESTIMATOR_INPUTS the estimator `name` takes (its registration's inputs); () for most."""
    get_advantage_estimator(name)
    return _ADVANTAGE_ESTIMATOR_EXTRAS.get(name, ((), ()))[1]


def advantage_estimator_names() -> list[str]:
    """Registered advantage estimator names, sorted."""
    return sorted(_ADVANTAGE_ESTIMATORS)


def register_policy_loss(name: str, fn: Callable, overwrite: bool = False, params: tuple[str, ...] = ()) -> None:
    """Make `fn` (in the policy loss call form above) selectable as policy_loss(mode=name). `params`: the
    actor config keys it takes as extra keyword arguments of the same names."""
    params = _key_names("policy_loss", name, params)
    _register(_POLICY_LOSSES, "policy_loss", name, fn, overwrite)
    _POLICY_LOSS_PARAMS[name] = params


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as `name`; ValueError listing the known names otherwise."""
    if name not in _POLICY_LOSSES:
        raise unknown_name("get_policy_loss", "policy loss mode", name, _POLICY_LOSSES)
    return _POLICY_LOSSES[name]


def policy_loss_params(name: str) -> tuple[str, ...]:
    """The actor config keys the policy loss `name` takes (register_policy_loss's params); () for most."""
    get_policy_loss(name)  # ValueError for an unknown name
    return _POLICY_LOSS_PARAMS.get(name, ())


def policy_loss_names() -> list[str]:
    """Registered policy loss mode names, sorted."""
    return sorted(_POLICY_LOSSES)
