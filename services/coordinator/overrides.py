"""What a StartRun may change of the mesh's config: decided on parsed keys and on the config they make.

    config = config_for_run(mesh_config, ["trainer.total_steps=20", "data.train_files=[gsm8k/train.parquet]"])
    check_roles(config)   # what the run's config needs of this coordinator and mesh

A StartRun changes how the loop runs, never how the services were started (their model, dtype, optimizer,
sampling temperature and addresses are fixed then), where the mesh writes, or whom it calls:

- RUN_OVERRIDABLE: the keys a StartRun may change; any other is INVALID_ARGUMENT.
- MESH_ONLY: keys among those that only the mesh's own config sets (INVALID_ARGUMENT from a StartRun):
  trainer.run_dir (a run must not write into another's folder), trainer.mlflow.tracking_uri (a
  database file anywhere, or an address the coordinator would send requests to) and data.verifiers.python,
  .path and .taskset (an interpreter to run and a module it imports).
- Confined: data.train_files, data.val_files and trainer.resume_from_path must resolve under storage.root
  (PERMISSION_DENIED otherwise).
- algorithm.plugin_modules: a StartRun cannot add one (an import runs code): PERMISSION_DENIED.

Every other key that names a file, a folder or an address (model.path, reward.model_path, rollout.sglang_url,
rollout.multi_turn.env_address, tracing.endpoint, cluster.*, ...) is outside RUN_OVERRIDABLE.
The checks run on the keys rlfabric.core.config.parse_override reads ("trainer.run_dir =x" is
trainer.run_dir), a section given as one value counting as each of its keys; and once the overrides are
applied, again on every key whose value differs from the mesh's config, so that no spelling changes a key
the first check did not see.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from rlfabric.algorithms.plugins import check_algorithm_names
from rlfabric.core.config import (
    ConfigError,
    RunConfig,
    check_run_rules,
    config_from_dict,
    parse_override,
    set_key,
)
from rlfabric.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from rlfabric.core.storage import StorageRoot

# Patterns (fnmatch) of the dotted keys a StartRun may change.
RUN_OVERRIDABLE = ("trainer.*", "data.*", "algorithm.*", "rollout.n", "rollout.top_p", "rollout.top_k",
                   "rollout.response_length", "rollout.seed", "rollout.val_*", "weight_sync.timeout_s")
# Keys RUN_OVERRIDABLE matches that only the mesh's own config may set, and why.
MESH_ONLY = {
    "trainer.run_dir": "a run must not write into another's folder; set trainer.experiment_name to keep this "
                       "run in RUN_DIR/experiments/<name>",
    "trainer.mlflow.tracking_uri": "the tracking store would be a file anywhere or an address of the caller's "
                                   "choosing that the coordinator sends requests to; a run logs to the mesh's "
                                   "store (its default: RUN_DIR/mlflow.db)",
    # data.verifiers: an interpreter to run and a task set it imports are code with the service's rights.
    **{f"data.verifiers.{key}": "the data source runs this interpreter and imports this task set: code, which "
                                "only the operator's config names" for key in ("python", "path", "taskset")},
}


def config_for_run(base: RunConfig, overrides: list[str]) -> RunConfig:
    """base (the mesh's config) with a StartRun's overrides, its confined paths resolved; InvalidArgument or
    PermissionDenied naming the key a StartRun may not set."""
    tree = base.model_dump(mode="json")
    try:
        for override in overrides:
            key, value = parse_override(override)
            for leaf in _keys_set(key, value):
                check_settable(leaf)
            set_key(tree, key, value)
        config = config_from_dict(tree)
    except ConfigError as error:
        raise InvalidArgument(str(error)) from None
    for key in changed_keys(base.model_dump(mode="json"), config.model_dump(mode="json")):
        check_settable(key)
    _confine_paths(base, config)
    added = sorted(set(config.algorithm.plugin_modules) - set(base.algorithm.plugin_modules))
    if added:
        # An import runs code with the service's rights: only the operator's config may name one.
        raise PermissionDenied(f"StartRun cannot add algorithm.plugin_modules {added}: plugin modules are "
                               "imported when the mesh starts, from its own config; this mesh has "
                               f"{base.algorithm.plugin_modules}")
    return config


def check_roles(config: RunConfig) -> None:
    """What a StartRun's config needs of this coordinator and mesh, as errors naming the keys: the config's
    own rules (check_run_rules: load_run_config checked the mesh's config, this checks the overrides), an
    advantage estimator registered here, and the roles the run calls. A run that needs a role the mesh was
    started without (the launchers start only the roles of the config they were given) is
    FAILED_PRECONDITION naming the role and the key that needs it."""
    try:
        check_run_rules(config)
    except ConfigError as error:
        raise InvalidArgument(str(error)) from None
    try:
        check_algorithm_names(config)  # the names its plugin modules (the mesh's) registered count
    except ConfigError as error:
        raise FailedPrecondition(str(error)) from None
    kl_key = "actor.use_kl_loss" if config.actor.use_kl_loss else "algorithm.use_kl_in_reward"
    needed = {"critic": f"algorithm.adv_estimator={config.algorithm.adv_estimator}" if config.uses_critic() else "",
              "reference": f"{kl_key}=true" if config.uses_reference() else "",
              "teacher": "algorithm.distill.enable=true" if config.uses_teacher() else ""}
    for role, key in needed.items():
        if key and not getattr(config.cluster, role):
            raise FailedPrecondition(f"{key} needs a {role} service, and this mesh runs none (cluster.{role} is "
                                     f"empty): start the mesh with a config that sets {key}")


def check_settable(key: str) -> None:
    """InvalidArgument naming key unless a StartRun may set it."""
    if key in MESH_ONLY:
        raise InvalidArgument(f"StartRun cannot set {key}: only the mesh's own config does ({MESH_ONLY[key]})")
    if not any(fnmatchcase(key, pattern) for pattern in RUN_OVERRIDABLE):
        raise InvalidArgument(f"StartRun cannot set {key}: it is fixed when the mesh's services start; a StartRun "
                              f"may change {', '.join(RUN_OVERRIDABLE)}")


def changed_keys(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two config trees (a list is one value)."""
    keys = []
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if isinstance(old, dict) and isinstance(new, dict):
            keys.extend(changed_keys(old, new, f"{prefix}{name}."))
        elif old != new or (name in before) != (name in after):
            keys.append(f"{prefix}{name}")
    return keys


def _keys_set(key: str, value: Any) -> list[str]:
    """The keys an override sets: its own, or with a section as its value, each key inside."""
    if isinstance(value, dict) and value:
        return [leaf for name, item in value.items() for leaf in _keys_set(f"{key}.{name}", item)]
    return [key]


def _confine_paths(base: RunConfig, config: RunConfig) -> None:
    """Paths a StartRun changed must lie under the storage root (PermissionDenied naming it) and are
    replaced by their resolved form; the mesh's own config, written by its operator, may name data
    anywhere."""
    storage = StorageRoot.from_config(base)
    for what in ("train_files", "val_files"):
        paths = getattr(config.data, what)
        if paths != getattr(base.data, what):
            setattr(config.data, what, [str(storage.resolve(path, f"data.{what}")) for path in paths])
    resume = config.trainer.resume_from_path
    if resume and resume != base.trainer.resume_from_path:
        config.trainer.resume_from_path = str(storage.resolve(resume, "trainer.resume_from_path"))
