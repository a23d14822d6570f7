"""The role table (rlfabric.core.roles) against what reads it: every row names a servicer module that builds
its role, has its config sections, and the trainer's RoleSpecs cover exactly its trainer rows."""

from __future__ import annotations

import importlib

import pytest

from rlfabric.core.config import RunConfig, load_config
from rlfabric.core.roles import POOL_ROLES, ROLE_TABLE, ROLES, TRAINER_ROLES, Kind, role_of
from rlfabric.serve import build_service


@pytest.mark.parametrize("name", ROLES)
def test_every_row_names_a_servicer_module_and_its_config_sections(name):
    role = ROLE_TABLE[name]
    assert role.name == name
    assert callable(importlib.import_module(role.servicer).build_service)
    config = RunConfig()
    assert isinstance(getattr(config.cluster, name), list)  # its addresses
    assert getattr(config.launcher.ray, name).num_cpus >= 0  # what the Ray launcher reserves for it
    assert hasattr(getattr(config, name, None), "pool") == (name in POOL_ROLES)


def test_the_trainer_rows_are_the_trainers_role_specs():
    from rlfabric.trainer.roles import ROLES as SPECS

    assert TRAINER_ROLES == tuple(SPECS) == ("actor", "reference", "critic", "teacher")


def test_roles_in_use_follow_the_table_with_the_coordinator_last():
    every_role = load_config(None, ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "reference.enable=true",
                                    "env.enable=true", "algorithm.distill.enable=true",
                                    "algorithm.distill.use_task_reward=true", "teacher.model_path=teacher",
                                    "judge.model_path=judge"])
    assert every_role.roles_in_use() == list(ROLES)
    assert load_config(None, []).roles_in_use() == ["actor", "rollout", "reward", "coordinator"]  # the quickstart
    assert ROLE_TABLE[ROLES[-1]].kind is Kind.COORDINATOR


def test_an_unknown_role_is_refused_naming_the_roles():
    with pytest.raises(ValueError, match="unknown role 'critc'; roles are actor, reference, critic, teacher, rollout, judge"):
        role_of("critc")
    with pytest.raises(ValueError, match="unknown role 'critc'"):
        build_service("critc", RunConfig())
