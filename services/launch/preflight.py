"""Every check a run's start makes, made before anything starts: `rlfabric check CONFIG [key=value ...]`,
`rlfabric up --dry-run` and `rlfabric train --dry-run`.

    report = check_run(load_run_config("my.yaml"))   # its keys and the rules across them are checked by then
    for problem in report.problems:
        print(problem)                                # each names the key or the file

Each check calls the function the services and launchers call when they start (one home each, so the two
cannot disagree). They run in stages, cheapest first; a stage that finds a problem ends the check, since the
next ones build on what it checked:
1. files (no torch): the model directories, the data files and their columns, the reward's files and scorer
   modules, the trackers' packages, the mesh's token;
2. names (imports torch and algorithm.plugin_modules): the advantage estimator, loss mode and KL estimators;
   every data_source of the data against the scorers the reward service has;
3. model (imports transformers): the launcher's model check (policy, LoRA, tensor-parallel splits, MoE), then
   the tokenizer and every data row as StartRun reads them (data.train_batch_size against the rows);
4. resources: where each service runs on this machine's GPUs and cores, and the weight-sync transport.
"""

from __future__ import annotations

import ast
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from rlfabric.core.config import RunConfig, read_auth_token
from rlfabric.core.errors import RlfabricError
from rlfabric.core.host import check_model_directory
from rlfabric.core.model_cache import cache_root, is_built
from rlfabric.launch.local import REGISTRY_PREFIX


@dataclass
class CheckReport:
    """What check_run found: a line per check that passed, a line per problem (naming the key or file)."""

    passed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Checks not made, and why (e.g. the quickstart model, built at the first start)."""
    model_dir: Path | None = None
    """The policy model's directory as the launcher will use it; None until it exists."""


Check = Callable[[RunConfig, CheckReport], str]  # its line when it passes; raises with the problem


def policy_model_dir(config: RunConfig) -> Path | None:
    """model.path as the launcher resolves it (launch.local.prepare_run_dir): the quickstart model or a
    pypi: model from the machine's cache (None while not built there: the launcher builds it), else the path."""
    from rlfabric.quickstart import cached
    from rlfabric.trainer.pretrained import MODELS

    path = config.model.path
    if not path:
        return cached.cached_directory() if cached.is_cached() else None
    if path.startswith(REGISTRY_PREFIX):
        name = path.removeprefix(REGISTRY_PREFIX)
        if name not in MODELS:
            raise ValueError(f"model.path {path}: unknown model {name!r}; known: "
                             f"{', '.join(REGISTRY_PREFIX + known for known in MODELS)}")
        return cache_root() / name if is_built(cache_root() / name) else None
    return Path(path)


# -- 1. files ----------------------------------------------------------------------------------------


def check_model_paths(config: RunConfig, report: CheckReport) -> str:
    report.model_dir = policy_model_dir(config)
    if report.model_dir is None:
        report.skipped.append(f"model.path {config.model.path or '(empty)'}: the launcher builds it at the "
                              "first start, and checks it then")
    else:
        check_model_directory(str(report.model_dir))
    others = [("critic.model_path", config.critic.model_path if config.uses_critic() else ""),
              ("teacher.model_path", config.teacher.model_path if config.uses_teacher() else ""),
              # a registry model (pypi:NAME) is converted at the launch, as model.path's is
              ("judge.model_path", "" if config.judge.model_path.startswith(REGISTRY_PREFIX) else config.judge.model_path),
              ("reward.model_path", config.reward.model_path)]
    for key, path in others:
        if path:
            check_model_directory(path, key)
    return f"model.path {report.model_dir or config.model.path or '(the quickstart model)'}"


def check_data_files(config: RunConfig, report: CheckReport) -> str:
    from rlfabric.data.dataset import check_columns

    files = [("data.train_files", path) for path in config.data.train_files] + \
            [("data.val_files", path) for path in config.data.val_files]
    for key, path in files:
        try:
            check_columns(path)
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from None
    if not config.data.train_files and config.data.builtin_task == "reasoning_gym":
        from rlfabric.data.reasoning_gym import build_mix

        build_mix(config.data.reasoning_gym)  # the library is there and takes every dataset's config
        return f"data: reasoning-gym's {', '.join(config.data.reasoning_gym.datasets)}, written at the start"
    if not config.data.train_files and config.data.builtin_task == "verifiers":
        from rlfabric.data.verifiers import read_tasks

        tasks = read_tasks(config.data.verifiers)  # the venv and the task set load
        return f"data: {len(tasks)} tasks of verifiers task set {config.data.verifiers.taskset}, written at the start"
    if not config.data.train_files:
        return f"data: the built-in task {config.data.builtin_task}, written at the start"
    return f"data: {len(files)} file(s) with the columns of VeRL's schema"


def check_reward_files(config: RunConfig, report: CheckReport) -> str:
    from rlfabric.reward.custom import check_custom_file
    from rlfabric.reward.registry import load_scorer_modules

    reward = config.reward
    if reward.custom_path:
        try:
            check_custom_file(reward.custom_path)
        except FileNotFoundError as error:
            raise ValueError(f"reward.custom_path: {error}") from None
        if not _defines(Path(reward.custom_path), reward.custom_name):
            raise ValueError(f"reward.custom_path {reward.custom_path} defines no {reward.custom_name!r} "
                             "(reward.custom_name)")
    load_scorer_modules(reward.scorer_modules)
    return f"reward: {'custom function ' + reward.custom_path if reward.custom_path else 'the registered scorers'}"


def _defines(path: Path, name: str) -> bool:
    """Whether a Python file's top level plainly defines `name`, or may (a star import, a module __getattr__);
    its code is not run here: the reward service runs it in its sandbox. A SyntaxError is raised as it is."""
    tree = ast.parse(path.read_text(errors="replace"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name in (name, "__getattr__"):
            return True
        if isinstance(node, ast.Import | ast.ImportFrom) and any(
                (alias.asname or alias.name).split(".")[0] in (name, "*") for alias in node.names):
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
        if any(isinstance(n, ast.Name) and n.id == name for target in targets for n in ast.walk(target)):
            return True
    return False


def check_run_environment(config: RunConfig, report: CheckReport) -> str:
    from rlfabric.coordinator.trackers import check_tracker_packages

    check_tracker_packages(config.trainer.loggers)
    read_auth_token(config.server)  # a token file that is set must hold a token
    return f"trainer.loggers {', '.join(config.trainer.loggers) or 'none'}: installed"


# -- 2. names ----------------------------------------------------------------------------------------


def check_algorithm(config: RunConfig, report: CheckReport) -> str:
    from rlfabric.algorithms.plugins import check_algorithm_names

    check_algorithm_names(config)
    return f"algorithm.adv_estimator {config.algorithm.adv_estimator}, actor.loss_mode {config.actor.loss_mode}"


def check_data_sources(config: RunConfig, report: CheckReport) -> str:
    from rlfabric.data.dataset import data_sources
    from rlfabric.reward.engine import unscored_sources, unscored_sources_advice

    multi_turn = config.rollout.multi_turn
    if multi_turn.enable and multi_turn.reward == "env":
        return "data_source: the environment scores (rollout.multi_turn.reward env)"
    sources = set().union(*(data_sources(path) for path in [*config.data.train_files, *config.data.val_files]))
    unscored = unscored_sources(config.reward, sources)
    if unscored:
        raise ValueError(f"data.train_files / val_files: {unscored_sources_advice(config.reward, unscored)}")
    return f"data_source {', '.join(sorted(sources)) or config.data.builtin_task}: each has a scorer"


# -- 3. model and data rows --------------------------------------------------------------------------


def check_model_loads(config: RunConfig, report: CheckReport) -> str:
    from rlfabric.launch.local import check_model as launcher_check_model

    if report.model_dir is None:
        report.skipped.append("the model's checks and the data rows: no model to read yet")
        return "model: checked at the first start"
    launcher_check_model(config.model_copy(update={"model": config.model.model_copy(
        update={"path": str(report.model_dir)})}))
    return f"model {report.model_dir}: a causal LM with a chat template"


def check_data_rows(config: RunConfig, report: CheckReport) -> str:
    from rlfabric.coordinator.setup import load_datasets
    from rlfabric.core.host import load_tokenizer

    if report.model_dir is None:
        return "data rows: read at the first start"
    tokenizer = load_tokenizer(str(report.model_dir), config.model.trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="rlfabric-check-") as scratch:  # where a built-in task is written
        train, val = load_datasets(config, Path(scratch), tokenizer)
    return f"data rows: {len(train)} training prompts" + (f", {len(val)} validation" if val else "")


# -- 4. resources ------------------------------------------------------------------------------------


def check_resources(config: RunConfig, report: CheckReport) -> str:
    from rlfabric.launch.local import plan_local

    placements, transport = plan_local(config)
    return (f"resources: {len(placements)} services placed on this machine; weight sync "
            f"{transport.transport or 'as the actor chooses'} ({transport.reason})")


STAGES: tuple[tuple[str, tuple[Check, ...]], ...] = (
    ("files", (check_model_paths, check_data_files, check_reward_files, check_run_environment)),
    ("names", (check_algorithm, check_data_sources)),
    ("model", (check_model_loads, check_data_rows)),
    ("resources", (check_resources,)),
)


STAGE_NAMES = tuple(name for name, _ in STAGES)


def check_run(config: RunConfig, stages: Collection[str] = STAGE_NAMES) -> CheckReport:
    """The checks of the named STAGES on a config load_run_config read (leave out "resources" for a config a
    cluster runs, checked on a laptop)."""
    report = CheckReport()
    for stage, checks in STAGES:
        if stage not in stages:
            continue
        for check in checks:
            try:
                report.passed.append(check(config, report))
            except (ValueError, OSError, RlfabricError) as error:  # ConfigError and DatasetError are ValueErrors
                report.problems.append(str(error))
        if report.problems:
            break
    return report
