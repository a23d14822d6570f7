"""The launchers' start order (rlfabric.launch.start_order): the env service and the judge replicas first, the
rollout replicas and the reward service once their addresses are in the workers' config, which names a judge
pool's as the reward's reward.judge.addresses."""

from __future__ import annotations

import asyncio

import pytest

from rlfabric.core.config import ConfigError, load_config
from rlfabric.launch.inprocess import InProcessMesh
from rlfabric.launch.local import service_names
from rlfabric.launch.start_order import name_addresses, spawn_order, write_worker_config


def test_the_env_and_the_judge_pool_start_first_and_their_callers_last():
    config = load_config(
        None,
        [
            "env.enable=true",
            "judge.model_path=/models/judge",
            "judge.replicas=2",
            "rollout.replicas=2",
            "reward.judge.data_sources=[chat]",
        ],
    )
    first, early, late = spawn_order(service_names(config))
    assert first == [("judge-0", "judge"), ("judge-1", "judge"), ("env", "env")]
    assert early == [("actor", "actor")]
    assert late == [("rollout-0", "rollout"), ("rollout-1", "rollout"), ("reward", "reward")]
    # Without an env or a judge nothing waits: the reward starts with the trainers.
    assert spawn_order(service_names(load_config(None, [])))[0] == []
    assert ("reward", "reward") in spawn_order(service_names(load_config(None, [])))[1]


def test_the_workers_config_names_the_judge_pool_as_the_rewards_judge(tmp_path):
    config = load_config(None, ["judge.model_path=/models/judge", "reward.judge.data_sources=[chat]"])
    path = tmp_path / "config.yaml"
    write_worker_config(
        config, path, {"judge": ["127.0.0.1:5001", "127.0.0.1:5002"], "env": ["127.0.0.1:5003"]}
    )
    written = load_config(path)  # as the reward service reads it: the rules between the keys hold
    assert written.reward.judge.addresses == written.cluster.judge == ["127.0.0.1:5001", "127.0.0.1:5002"]
    assert written.cluster.env == ["127.0.0.1:5003"] and written.cluster.rollout == []


def test_the_in_process_mesh_refuses_a_judge_pool_naming_the_key(tmp_path):
    """The reward service reaches its judge over gRPC only: `--in-process` refuses judge.model_path before it
    starts anything, pointing at the local launcher."""
    config = load_config(None, ["judge.model_path=/models/judge"])
    mesh = InProcessMesh(config, tmp_path / "run")
    with pytest.raises(ConfigError, match="judge.model_path: the in-process mesh has no judge pool"):
        asyncio.run(mesh.__aenter__())
    assert mesh.engines == {} and not (tmp_path / "run").exists()


def test_a_judge_pool_served_elsewhere_is_named_as_the_rewards_judge():
    """`rlfabric up --external judge=HOST:PORT`: the launcher names it before any service starts."""
    config = load_config(None, ["judge.model_path=/models/judge", "reward.judge.data_sources=[chat]"])
    name_addresses(config, {"judge": ["10.0.0.7:50051"]})
    assert config.reward.judge.addresses == config.cluster.judge == ["10.0.0.7:50051"]
