"""A run config as values for the Helm chart (`rlfabric helm-values CONFIG [key=value ...] > values.yaml`).

A run config file is not chart values as it stands, for three reasons this module takes care of:
- the chart's values are a document of their own: the run config is their `config:` key;
- Helm merges the chart's default `config:` (helm/rlfabric/values.yaml) into the one you give, key by key,
  so a key your file leaves to the config model's default would take the chart's instead (its model, data,
  estimator, engine): each key the chart's default sets and the file does not is written with the model's
  default;
- Helm reads values as YAML 1.1, where the keys n, y, on, off, yes and no are booleans: rollout.n would
  arrive as `false:` and the chart's schema would refuse it. The values are written with those quoted.
A few config keys decide chart values too: the ranks of the actor and the critic (their world_size) are
the replicas of their StatefulSets, the rollout replicas the rollout's, and a reward model needs the
reward role's train image.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from rlfabric.core.config import (
    ConfigError,
    RunConfig,
    apply_override,
    default_config_path,
    load_config,
    set_key,
)

CHART = Path(__file__).resolve().parents[2] / "helm" / "rlfabric"  # in a clone of the repository


def helm_values(config_path: str | Path | None, overrides: list[str] = (), chart: Path = CHART,
                stage_model: str = "", stage_data: str = "") -> tuple[dict[str, Any], list[str]]:
    """(values, warnings): the chart values that run this config, and what the chart cannot run as given.
    stage_model and stage_data choose what the chart's stage Job writes onto the volume (values.yaml `stage`),
    and the config then reads it there; "" leaves the model or the data to you."""
    chart_values = _chart_values(chart)
    mount_path = chart_values["persistence"]["mountPath"]
    overrides = [*overrides, *_staged_paths(mount_path, stage_model, stage_data)]
    config = load_config(config_path, overrides)  # a missing file or a bad key fails here, named
    tree = _config_tree(config_path, overrides)
    defaults = RunConfig().model_dump(mode="json")
    for key in _leaf_keys(chart_values.get("config") or {}):
        if _lookup(tree, key) is _MISSING:
            set_key(tree, key, copy.deepcopy(_lookup(defaults, key)))
    values: dict[str, Any] = {"config": tree, "stage": {"model": stage_model, "data": stage_data}}
    roles = _roles_of(config)
    if roles:
        values["roles"] = roles
    return values, _off_volume(config, mount_path)


def _staged_paths(mount_path: str, stage_model: str, stage_data: str) -> list[str]:
    """Overrides that point the config at what the stage Job writes (helm/rlfabric/templates/stage-job.yaml)."""
    overrides = [f"model.path={mount_path}/models/{stage_model}"] if stage_model else []
    if stage_data:
        folder = f"{mount_path}/datasets/{stage_data}"
        overrides += [f"data.train_files=[{folder}/train.parquet]", f"data.val_files=[{folder}/val.parquet]"]
    return overrides


def dump_values(values: dict[str, Any]) -> str:
    """YAML that Helm reads back as these values (the YAML 1.1 booleans quoted)."""
    return yaml.dump(values, Dumper=_HelmDumper, sort_keys=False, allow_unicode=True)


class _HelmDumper(yaml.SafeDumper):
    """PyYAML quotes yes/no/on/off/true/false already; YAML 1.1 (Helm) also reads y/Y/n/N as booleans."""


_HelmDumper.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))

_MISSING = object()


def _config_tree(config_path: str | Path | None, overrides: list[str]) -> dict[str, Any]:
    """The file's keys with the overrides applied, not resolved: keys left to their defaults stay out."""
    tree = yaml.safe_load(Path(config_path or default_config_path()).read_text()) or {}
    for override in overrides:
        apply_override(tree, override)
    return tree


def _chart_values(chart: Path) -> dict[str, Any]:
    path = Path(chart) / "values.yaml"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: give the chart you install with --chart (helm/rlfabric in a "
                          "clone of rlfabric)")
    return yaml.safe_load(path.read_text())


def _leaf_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for name, value in tree.items():
        key = f"{prefix}{name}"
        keys.extend(_leaf_keys(value, key + ".") if isinstance(value, dict) and value else [key])
    return keys


def _lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _roles_of(config: RunConfig) -> dict[str, Any]:
    """Chart values the config decides: the pods of multi-rank and replicated roles, the reward's image."""
    roles: dict[str, Any] = {}
    for role, pods in (("actor", config.actor.world_size), ("critic", config.critic.world_size),
                       ("rollout", config.rollout.replicas)):
        if pods != 1:
            roles[role] = {"replicas": pods}
    if config.reward.model_path:
        roles["reward"] = {"image": {"variant": "train"}}  # a reward model runs on torch
    return roles


def _off_volume(config: RunConfig, mount_path: str) -> list[str]:
    """The files a run reads that no pod will find: not on the data volume, every pod's only shared disk."""
    found = [("model.path", config.model.path)]
    found += [("data.train_files", path) for path in config.data.train_files]
    found += [("data.val_files", path) for path in config.data.val_files]
    warnings = []
    for key, path in found:
        if not path:
            warnings.append(f"{key} is empty (the quickstart's tiny model): set it to a folder on the data volume "
                            f"({mount_path}/models/...) and stage the model there (docs/kubernetes.md)")
        elif not path.startswith(mount_path.rstrip("/") + "/"):
            warnings.append(f"{key} {path} is not on the data volume ({mount_path}): copy it there and give "
                            f"{key}={mount_path}/... (docs/kubernetes.md)")
    return warnings
