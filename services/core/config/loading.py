"""Reading a run config: YAML files, dotted overrides, the run's rules and tokens."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlfabric.core.config.base import _DOTTED_KEY, _QUOTE, DEFAULT_CONFIG_NAME, ConfigError
from rlfabric.core.config.run import RunConfig
from rlfabric.core.config.server import ServerConfig
from rlfabric.core.config.unknown_keys import describe_unknown_key

# The built-in estimators whose baseline is the other samples of the prompt (rlfabric.algorithms.advantages).
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized",
                    "reinforce_plus_plus_baseline", "opo", "gpg", "gdpo", "optimal_token_baseline",
                    "tir_optimal_token_baseline")


def default_config_path() -> Path:
    """Path of the built-in quickstart config."""
    return Path(str(files("rlfabric.quickstart") / DEFAULT_CONFIG_NAME))


class _OverrideLoader(yaml.SafeLoader):
    """YAML of an override's value without anchors and aliases: `{a: &a [x, x], b: [*a, *a], ...}` nests
    copies of copies, a few hundred bytes that print as gigabytes ("billion laughs")."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise yaml.composer.ComposerError(None, None, "anchors and aliases (&name, *name) are not allowed in "
                                              "an override", event.start_mark)
        return super().compose_node(parent, index)


def parse_override(override: str) -> tuple[str, Any]:
    """(dotted key, value) of one `dotted.key=value` override: the key without the spaces around it, made of
    ASCII letters, digits, _ and - between dots; the value parsed as YAML without aliases. Callers decide on
    this key, never on the raw text ("trainer.run_dir =x" is trainer.run_dir)."""
    shown = _QUOTE.repr(override)
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {shown} is not of the form dotted.key=value")
    if not _DOTTED_KEY.fullmatch(key):
        raise ConfigError(f"override {shown}: {_QUOTE.repr(key)} is not a dotted key (ASCII letters, digits, _ "
                          "and - between dots)")
    try:
        return key, yaml.load(raw, Loader=_OverrideLoader) if raw.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {shown}: the value of {key} is not valid YAML: {error}") from None


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Applies one `dotted.key=value` override in place (parse_override)."""
    set_key(tree, *parse_override(override))


def set_key(tree: dict[str, Any], key: str, value: Any) -> None:
    """tree[a][b][c] = value for the dotted key a.b.c, making the sections on the way."""
    parts = key.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _describe_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":  # VeRL's name for it, or a did-you-mean
            lines.extend(describe_unknown_key(item["loc"], item.get("input")))
        elif not key:  # a rule across sections: its message names the keys; the input is the whole config
            lines.append(item["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{key}: {item['msg']} (got {_QUOTE.repr(item.get('input'))})")
    return "invalid config: " + "; ".join(lines)


def config_from_dict(tree: dict[str, Any]) -> RunConfig:
    """Validates a config tree; ConfigError names every bad key."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_describe_validation_error(error)) from None


def load_config(path: str | Path | Mapping | None = None, overrides: list[str] = ()) -> RunConfig:
    """Loads a YAML config (None = the built-in quickstart; a mapping: the tree such a file holds, which
    stays as it is), applies dotted overrides, validates."""
    if isinstance(path, Mapping):
        return _config_from_tree(copy.deepcopy(dict(path)), overrides)
    path = Path(path) if path else default_config_path()
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return _config_from_tree(tree, overrides)


def _config_from_tree(tree: dict[str, Any], overrides: list[str]) -> RunConfig:
    """The config of a loaded tree after the dotted overrides (applied to the tree in place)."""
    for override in overrides:
        apply_override(tree, override)
    return config_from_dict(tree)


def load_run_config(path: str | Path | Mapping | None = None, overrides: list[str] = ()) -> RunConfig:
    """load_config for a run (`rlfabric up`, `rlfabric train`): also checks the rules across keys
    (check_run_rules), so a config a run cannot train with fails before any service starts."""
    config = load_config(path, overrides)
    check_run_rules(config)
    return config


def check_run_rules(config: RunConfig) -> None:
    """Combinations of keys a run cannot train with, as a ConfigError naming them. Checked where a run's
    config is loaded (load_run_config) and by StartRun for its overrides; not by load_config, since one
    service may be started with a config holding only its own section (the other defaults are no run)."""
    kl_keys = [key for key, on in (("actor.use_kl_loss", config.actor.use_kl_loss),
                                   ("algorithm.use_kl_in_reward", config.algorithm.use_kl_in_reward)) if on]
    if kl_keys and not config.reference.enable:
        raise ConfigError(f"{kl_keys[0]}=true needs reference.enable=true")
    if config.reference.sync_ref_model and not config.uses_reference():
        raise ConfigError("reference.sync_ref_model=true needs a reference service: actor.use_kl_loss or "
                          "algorithm.use_kl_in_reward, and no actor.lora (its reference, the actor's base model, "
                          "never changes)")
    if config.reference.sync_ref_model and config.weight_sync.transport == "grpc":
        raise ConfigError("reference.sync_ref_model=true needs weight_sync.transport auto, gloo, nccl or cuda_ipc: "
                          "the grpc transport reaches rollout replicas only")
    for role in ("actor", "critic") if config.uses_critic() else ("actor",):
        mini = getattr(config, role).ppo_mini_batch_size
        if config.data.train_batch_size < mini:
            raise ConfigError(f"data.train_batch_size {config.data.train_batch_size} < {role}.ppo_mini_batch_size "
                              f"{mini}: a step must hold at least one mini-batch")
    _check_old_log_prob_rules(config)
    if config.trainer.colocated and config.trainer.mode == "async":
        raise ConfigError("trainer.colocated=true needs trainer.mode=sync: a colocated rollout sleeps while the "
                          "actor trains, so it cannot generate the next batch meanwhile")
    if config.trainer.colocated and config.rollout.engine == "vllm" and not config.rollout.enable_sleep_mode:
        raise ConfigError("trainer.colocated=true with rollout.engine=vllm needs rollout.enable_sleep_mode=true "
                          "(vLLM's sleep mode, CUDA only)")
    if config.algorithm.adv_estimator in GROUP_ESTIMATORS and config.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={config.algorithm.adv_estimator} compares samples of a "
                          "prompt: set rollout.n >= 2")
    multi_turn = config.rollout.multi_turn
    if multi_turn.enable and not (multi_turn.env_address or config.cluster.env or config.env.enable):
        raise ConfigError("rollout.multi_turn.enable needs an environment service: set env.enable true (the launchers "
                          "start one), or rollout.multi_turn.env_address / cluster.env to a running one")


def _check_old_log_prob_rules(config: RunConfig) -> None:
    """Where the old log-probs come from, against what reads them: rollout correction, the bypass_mode loss
    and the optimal token baselines."""
    algorithm, bypass = config.algorithm, config.actor.loss_mode == "bypass_mode"
    if bypass and algorithm.old_log_prob_source != "rollout":
        raise ConfigError("actor.loss_mode=bypass_mode takes the rollout's log-probs as the old ones (VeRL's "
                          "rollout_correction.bypass_mode): set algorithm.old_log_prob_source to rollout")
    if not bypass and algorithm.rollout_correction.loss_type != "ppo_clip":
        raise ConfigError("algorithm.rollout_correction.loss_type applies to actor.loss_mode=bypass_mode only")
    if algorithm.old_log_prob_source == "rollout" and algorithm.rollout_correction.enabled() and not bypass:
        raise ConfigError("algorithm.old_log_prob_source=rollout takes the old log-probs from the rollout, so there "
                          "is no mismatch left to correct: set algorithm.rollout_correction.rollout_is and "
                          "rollout_rs to null, old_log_prob_source to auto, or actor.loss_mode to bypass_mode "
                          "(which corrects against the policy being updated)")
    if algorithm.adv_estimator in ("optimal_token_baseline", "tir_optimal_token_baseline") and \
            algorithm.old_log_prob_source == "rollout":
        raise ConfigError(f"algorithm.adv_estimator={algorithm.adv_estimator} needs the actor's log-prob pass (its "
                          "old_log_probs and sum_pi_squared): set algorithm.old_log_prob_source to auto or actor")


def read_named_file(key: str, path: str | Path) -> bytes:
    """The bytes of a file a config key names (a token, a certificate); ConfigError naming the key when
    it cannot be read, so a service refuses to start with a clear message instead of a traceback."""
    if not str(path):
        raise ConfigError(f"{key} is empty")
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{key}: cannot read {path}: {error.strerror or error}") from None


def import_named_modules(key: str, modules: list[str]) -> None:
    """Imports each module a config key names (plugins, scorers: their imports register what they add; again:
    a no-op); ConfigError naming the key and the module when one cannot be imported."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as error:  # ImportError, a SyntaxError, the ValueError of a clashing name, ...
            raise ConfigError(f"{key}: cannot import {name!r}: {type(error).__name__}: {error}") from error


def run_dir_of(config: RunConfig) -> Path:
    """trainer.run_dir (default runs/<name>), or its experiments/<trainer.experiment_name>."""
    run_dir = Path(config.trainer.run_dir or Path("runs") / config.name).resolve()
    name = config.trainer.experiment_name
    return run_dir / "experiments" / name if name else run_dir


def read_auth_token(server: ServerConfig) -> str:
    """server.auth_token_file's token ("" when no file is configured). An empty file is an error:
    it would silently turn authentication off."""
    if not server.auth_token_file:
        return ""
    token = read_named_file("server.auth_token_file", server.auth_token_file).decode().strip()
    if not token:
        raise ConfigError(f"server.auth_token_file: {server.auth_token_file} is empty (authentication would be off)")
    return token


def read_env_token(config: RunConfig) -> str:
    """env.auth_token_file's token ("" when none is configured); an empty file is a ConfigError. The env
    service reads this one only: where it runs, the mesh's token need not exist."""
    if not config.env.auth_token_file:
        return ""
    token = read_named_file("env.auth_token_file", config.env.auth_token_file).decode().strip()
    if not token:
        raise ConfigError(f"env.auth_token_file: {config.env.auth_token_file} is empty")
    return token


def dump_config(config: RunConfig, path: str | Path) -> None:
    """Writes a config as YAML (the resolved config every service of a run reads)."""
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
