"""`rlfabric check` (rlfabric.launch.preflight, rlfabric.cli.check): each mistake a run's start would find is
named before anything starts, by the same function the start calls; the CLI says it in one line, fast."""

from __future__ import annotations

import resource
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfabric.coordinator.overrides import check_roles
from rlfabric.core.config import load_config, load_run_config
from rlfabric.core.errors import FailedPrecondition
from rlfabric.data.prep import write_synthetic
from rlfabric.launch.preflight import CheckReport, check_data_sources, check_run

PROMPT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The quickstart's parquet files (64 training rows), and ones that break VeRL's schema or the scorers."""
    folder = tmp_path_factory.mktemp("data")
    paths = write_synthetic(folder, train_size=64, val_size=8)
    pq.write_table(pa.table({"data_source": ["find_vowel"], "prompt": [PROMPT]}), folder / "no_reward_model.parquet")
    pq.write_table(pa.table({"data_source": ["my/task"], "prompt": [PROMPT],
                             "reward_model": [{"ground_truth": "a"}]}), folder / "unscored.parquet")
    return {"train": str(paths["train"]), "val": str(paths["val"]), "folder": folder}


def _problems(*overrides: str, stages=("files", "names")) -> list[str]:
    """The problems of the checks that need no model (the last test runs them all)."""
    return check_run(load_run_config(None, list(overrides)), stages).problems


@pytest.mark.parametrize("override, problem", [
    ("algorithm.adv_estimator=grpoo", "algorithm.adv_estimator 'grpoo' is not registered; known: "),
    ("actor.loss_mode=topr", "actor.loss_mode 'topr' is not registered; known: "),  # and what tests registered
    ("actor.kl_loss_type=k9", "actor.kl_loss_type: kl_penalty: unknown kind 'k9'"),
    ("model.path=/nowhere/model", "model.path /nowhere/model: no such directory"),
    ("model.path=Qwen/Qwen2.5-0.5B", "model.path Qwen/Qwen2.5-0.5B: it looks like a hub id"),
    ("model.path=pypi:llama", "model.path pypi:llama: unknown model 'llama'; known: pypi:smollm2"),
    ("judge.model_path=/nowhere/judge", "judge.model_path /nowhere/judge: no such directory"),
    ("reward.custom_path=/nowhere/reward.py", "reward.custom_path: custom reward file not found: '/nowhere/reward.py'"),
    ("reward.scorer_modules=[no_such_scorers]", "reward.scorer_modules: cannot import 'no_such_scorers'"),
    ("algorithm.plugin_modules=[no_such_plugin]", "algorithm.plugin_modules: cannot import 'no_such_plugin'"),
])
def test_each_mistake_is_one_problem_naming_its_key(override, problem):
    problems = _problems(override)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_data_files_are_checked_for_existence_schema_and_scorers(data, tmp_path):
    missing = tmp_path / "missing.parquet"
    assert _problems(f"data.train_files=[{missing}]") == [f"data.train_files: {missing}: file does not exist"]
    no_reward = data["folder"] / "no_reward_model.parquet"
    assert _problems(f"data.train_files=[{data['train']}]", f"data.val_files=[{no_reward}]") == [
        f"data.val_files: {no_reward}: missing column(s) ['reward_model']; it has ['data_source', 'prompt']"]
    unscored = data["folder"] / "unscored.parquet"
    problem, = _problems(f"data.train_files=[{unscored}]")
    assert problem.startswith("data.train_files / val_files: unknown data_source 'my/task'; registered: ")
    assert "or set reward.default_score_for_unknown" in problem
    config = load_run_config(None, [f"data.train_files=[{unscored}]", "reward.default_score_for_unknown=0"])
    assert check_data_sources(config, CheckReport()) == "data_source my/task: each has a scorer"


def test_a_custom_reward_file_must_define_its_function(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    assert _problems(f"reward.custom_path={reward}") == [
        f"reward.custom_path {reward} defines no 'compute_score' (reward.custom_name)"]
    assert not _problems(f"reward.custom_path={reward}", "reward.custom_name=score")


def test_a_plugin_module_adds_the_names_it_registers(tmp_path, monkeypatch):
    from rlfabric.algorithms import registry

    monkeypatch.setattr(registry, "_POLICY_LOSSES", dict(registry._POLICY_LOSSES))  # this test's registration only
    (tmp_path / "check_plugin_losses.py").write_text(
        "from rlfabric import algorithms as algos\nalgos.register_policy_loss('my_loss', lambda *a, **k: None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not _problems("algorithm.plugin_modules=[check_plugin_losses]", "actor.loss_mode=my_loss")


def test_start_run_refuses_with_the_same_words():
    """One home per check: StartRun's refusal (check_roles) is check's problem, word for word."""
    config = load_config(None, ["algorithm.adv_estimator=grpoo"])
    with pytest.raises(FailedPrecondition) as refused:
        check_roles(config)
    assert _problems("algorithm.adv_estimator=grpoo") == [str(refused.value)]


def test_a_config_a_run_can_start_passes_every_stage(tiny_model, data):
    """The tiny model and the quickstart data: every stage passes, the rows as StartRun reads them included;
    too few rows for a batch is the problem StartRun would have answered."""
    good = [f"model.path={tiny_model}", f"data.train_files=[{data['train']}]", f"data.val_files=[{data['val']}]",
            "data.max_prompt_length=256"]
    report = check_run(load_run_config(None, good))
    assert not report.problems, report.problems
    assert "data rows: 64 training prompts, 8 validation" in report.passed
    assert any(line.startswith("resources: ") for line in report.passed)
    problem, = _problems(*good, "data.train_batch_size=128", "actor.ppo_mini_batch_size=128", stages=("files", "model"))
    assert problem == "data.train_batch_size 128 > 64 usable training rows"


# -- the command line: exit code, one line on stderr, in a few seconds, nothing started -----------------------


def _rlfabric(*args: str, cwd=None) -> tuple[subprocess.CompletedProcess, float]:
    """The command's result and the CPU seconds it took: what it does, not how busy the machine is (a
    wall-clock bound fails on a machine shared with other test runs)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run([sys.executable, "-m", "rlfabric", *args], capture_output=True, text=True,
                            timeout=120, cwd=cwd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return result, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


@pytest.mark.parametrize("override, named", [
    ("data.train_files=[{tmp}/missing.parquet]", "data.train_files: {tmp}/missing.parquet: file does not exist"),
    ("model.path={tmp}/no-model", "model.path {tmp}/no-model: no such directory"),
    ("algorithm.adv_estimator=grpoo", "algorithm.adv_estimator 'grpoo' is not registered"),
])
def test_check_names_the_mistake_in_one_line_in_under_5_cpu_seconds(tmp_path, override, named):
    out = tmp_path / "resolved.yaml"
    result, seconds = _rlfabric("check", override.format(tmp=tmp_path), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlfabric check: {named.format(tmp=tmp_path)}"), lines
    assert seconds < 5, f"{seconds:.1f} CPU s"  # no model loaded: ~0.7 CPU s, ~2.5 with torch (the estimator)
    assert load_config(out).name == "quickstart"  # the resolved config, written even so
    assert not (tmp_path / "runs").exists()  # no run dir: nothing started


def test_a_verl_key_gets_its_rlfabric_name(tmp_path):
    result, _ = _rlfabric("check", "trainer.total_epochs=3", "--out", str(tmp_path / "x.yaml"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["rlfabric: invalid config: trainer.total_epochs: VeRL's key; use "
                                          "trainer.total_steps (rlfabric counts steps: epochs x training rows / "
                                          "data.train_batch_size)"]


def test_status_and_stop_on_a_folder_that_is_no_run_say_so_in_one_line(tmp_path):
    for command in ("status", "stop"):
        result, _ = _rlfabric(command, "--run-dir", str(tmp_path))
        assert result.returncode == 2
        assert result.stderr.splitlines() == [f"rlfabric {command}: {tmp_path} is not the folder of a running mesh: "
                                              "it has no endpoints.json with the coordinator's address (`rlfabric "
                                              "up` and `rlfabric train` write it once the mesh is up)"]


def test_version():
    from importlib.metadata import version

    result, _ = _rlfabric("--version")
    assert result.returncode == 0 and result.stdout == f"rlfabric {version('rlfabric')}\n"
