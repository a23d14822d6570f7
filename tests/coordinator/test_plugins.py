"""algorithm.plugin_modules: the example plugin (examples/plugins/topr_plugin.py) trains a short run on
the in-process mesh with its loss and estimator; a module that cannot be imported or that replaces a
built-in fails at start naming the key; a StartRun over gRPC cannot name a module of its own."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path

import pytest

from rlfabric.algorithms import registry
from rlfabric.algorithms.plugins import check_algorithm_names, load_plugin_modules
from rlfabric.coordinator.client import CoordinatorClient
from rlfabric.coordinator.run_controller import RunController
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import ConfigError, load_run_config
from rlfabric.core.errors import PermissionDenied
from rlfabric.core.server import ServerOptions
from rlfabric.serve import build_service
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import fast_config, in_process

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins"


@pytest.fixture
def example_plugin(monkeypatch):
    """The example plugin module, importable as `topr_plugin`. Its registrations go into copies of the
    registries that the test's end discards (the in-process mesh shares this process with other tests)."""
    monkeypatch.setattr(registry, "_ADVANTAGE_ESTIMATORS", dict(registry._ADVANTAGE_ESTIMATORS))
    monkeypatch.setattr(registry, "_POLICY_LOSSES", dict(registry._POLICY_LOSSES))
    monkeypatch.syspath_prepend(str(PLUGINS))
    yield importlib.import_module("topr_plugin")
    sys.modules.pop("topr_plugin", None)


def test_a_run_trains_with_the_plugins_loss_and_estimator(tiny_model, tmp_path, example_plugin):
    config = fast_config(tiny_model, "algorithm.plugin_modules=[topr_plugin]", "actor.loss_mode=topr",
                         "algorithm.adv_estimator=group_rank")
    calls_before = dict(example_plugin.CALLS)

    async def scenario():
        async with in_process(config, tmp_path / "run") as client:
            # Naming a module the mesh was started with is fine (it is imported already).
            await client.start_run(["algorithm.plugin_modules=[topr_plugin]"])
            metrics = {update.step: dict(update.metrics) async for update in client.stream_metrics(from_step=1)}
            return metrics, await client.run_status()

    metrics, status = asyncio.run(scenario())
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert example_plugin.CALLS["group_rank"] - calls_before["group_rank"] == 2  # once a step
    assert example_plugin.CALLS["topr"] > calls_before["topr"]  # in the actor, once a micro-batch
    assert 0.0 <= metrics[2]["actor/topr_truncfrac"] <= 1.0  # the plugin's own stat reached the metrics


def test_a_module_that_cannot_be_imported_fails_at_start_naming_the_key(tiny_model):
    with pytest.raises(ConfigError, match="algorithm.plugin_modules: cannot import 'no_such_plugin_module'"):
        load_plugin_modules(["no_such_plugin_module"])
    config = fast_config(tiny_model, "algorithm.plugin_modules=[no_such_plugin_module]")
    with pytest.raises(ConfigError, match="algorithm.plugin_modules"):
        RunController(config)  # the coordinator, as `rlfabric serve coordinator` builds it


def test_a_plugin_may_not_replace_a_built_in(tmp_path, monkeypatch):
    (tmp_path / "replaces_grpo.py").write_text(
        "from rlfabric import algorithms as algos\n"
        "algos.register_advantage_estimator('grpo', lambda **kw: None, overwrite=True)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="'replaces_grpo'.*'grpo' is built in and cannot be replaced"):
        load_plugin_modules(["replaces_grpo"])


def test_start_run_cannot_add_a_plugin_module(tiny_model, serve_in_thread):
    coordinator = serve_in_thread(build_service("coordinator", fast_config(tiny_model)),
                                  ServerOptions(port=0, metrics_port=None))

    async def start(overrides):
        async with CoordinatorClient(coordinator.address, ChannelOptions()) as client:
            await client.start_run(overrides)

    with pytest.raises(PermissionDenied, match=r"StartRun cannot add algorithm.plugin_modules \['os'\]"):
        asyncio.run(start(["algorithm.plugin_modules=[os]"]))
    # The service keeps answering.
    with pytest.raises(PermissionDenied):
        asyncio.run(start(["algorithm.plugin_modules=[topr_plugin]"]))


def test_the_example_estimator_ranks_within_each_group(example_plugin):
    import torch

    from rlfabric import algorithms as algos

    scores = torch.tensor([0.0, 1.0, 0.5, 2.0, 2.0, 7.0])  # groups: (0, 1, 0.5), (2, 2), (7)
    token_rewards = torch.zeros(6, 2)
    token_rewards[:, 1] = scores
    mask = torch.ones(6, 2)
    mask[0, 1] = 0
    advantages, _ = algos.get_advantage_estimator("group_rank")(
        token_rewards=token_rewards, mask=mask, group_ids=torch.tensor([0, 0, 0, 1, 1, 2]))
    assert advantages[:, 0].tolist() == [-1.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # ranks 0, 2, 1 of 3; a tie; alone
    assert advantages[0, 1] == 0  # masked


def test_a_plugins_settings_are_keys_of_its_section(tmp_path, monkeypatch):
    for table in ("_POLICY_LOSSES", "_POLICY_LOSS_PARAMS", "_ADVANTAGE_ESTIMATORS", "_ADVANTAGE_ESTIMATOR_EXTRAS"):
        monkeypatch.setattr(registry, table, dict(getattr(registry, table)))
    (tmp_path / "with_settings.py").write_text(
        "from rlfabric import algorithms as algos\n"
        "algos.register_policy_loss('my_kl_cov', lambda *a, **kw: None, params=('ppo_kl_coef',))\n"
        "algos.register_policy_loss('my_beta_loss', lambda *a, **kw: None, params=('beta',))\n"
        "algos.register_advantage_estimator('my_discounted', lambda **kw: None, params=('gamma',))\n"
        "algos.register_advantage_estimator('my_tempered', lambda **kw: None, params=('temperature',))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = "algorithm.plugin_modules=[with_settings]"
    check_algorithm_names(load_run_config(None, [plugin, "actor.loss_mode=my_kl_cov",  # keys of their sections
                                                 "algorithm.adv_estimator=my_discounted"]))
    with pytest.raises(ConfigError, match=r"actor.loss_mode 'my_beta_loss' was registered with params \['beta'\] "
                                          "that are no actor keys"):
        check_algorithm_names(load_run_config(None, [plugin, "actor.loss_mode=my_beta_loss"]))
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator 'my_tempered' was registered with params "
                                          r"\['temperature'\] that are no algorithm keys"):
        check_algorithm_names(load_run_config(None, [plugin, "algorithm.adv_estimator=my_tempered"]))
    with pytest.raises(ValueError, match=r"'my_critic' asks for inputs \['values_of_others'\]; known: "
                                         "reward_components"):
        registry.register_advantage_estimator("my_critic", lambda **kw: None, inputs=("values_of_others",))
    sys.modules.pop("with_settings", None)
