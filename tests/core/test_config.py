"""Run config: defaults, overrides, validation errors naming the key."""

from __future__ import annotations

import pytest

from rlfabric.core.config import (
    ConfigError,
    config_reference,
    default_config_path,
    dump_config,
    load_config,
    load_run_config,
)


def test_builtin_default_is_the_quickstart():
    config = load_config()
    assert config.name == "quickstart" and config.rollout.engine == "hf"
    assert default_config_path().exists()


def test_dotted_overrides_are_parsed_as_yaml():
    config = load_config(overrides=["trainer.total_steps=3", "rollout.temperature=0.5", "cluster.rollout=[a:1, b:2]"])
    assert config.trainer.total_steps == 3
    assert config.rollout.temperature == 0.5
    assert config.cluster.rollout == ["a:1", "b:2"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.total_stpes=3", "trainer.total_stpes: unknown key"),
        ("rollout.n=two", "rollout.n: Input should be a valid integer"),
        ("rollout.n=0", "rollout.n: Input should be greater than or equal to 1"),
        ("rollout.engine=tgi", "rollout.engine: Input should be 'hf', 'vllm', 'sglang' or 'sim'"),
        ("server=4", "server: Input should be a valid dictionary"),
        ("nokey", "is not of the form dotted.key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides=[override])


def test_bad_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(listy)


def test_dump_and_reload_round_trip(tmp_path):
    config = load_config(overrides=["trainer.total_steps=7", "cluster.actor=[x:1]"])
    dump_config(config, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == config


def test_every_field_is_documented():
    undocumented = [key for key, _, doc in config_reference() if not doc]
    assert undocumented == []


@pytest.mark.parametrize(("overrides", "aggregation"), [
    (["actor.loss_mode=gspo"], "seq-mean-token-mean"),  # GSPO's own, as documented and as in the paper
    (["actor.loss_mode=gspo", "actor.loss_agg_mode=token-mean"], "token-mean"),  # set: kept
    (["actor.loss_mode=vanilla"], "token-mean"),
    (["actor.loss_mode=sapo"], "seq-mean-token-mean"),  # SAPO's loss is a sequence mean, as VeRL's
    ([], "token-mean"),
])
def test_loss_aggregation_left_out_is_the_loss_modes_own(tmp_path, overrides, aggregation):
    config = load_config(overrides=overrides)
    assert config.actor.loss_agg_mode == aggregation
    dump_config(config, tmp_path / "c.yaml")  # what every service of the run reads
    assert load_config(tmp_path / "c.yaml").actor.loss_agg_mode == aggregation


@pytest.mark.parametrize(("overrides", "message"), [
    (["actor.use_kl_loss=true", "reference.enable=false"], "actor.use_kl_loss=true needs reference.enable=true"),
    (["algorithm.use_kl_in_reward=true", "reference.enable=false"],
     "algorithm.use_kl_in_reward=true needs reference.enable=true"),
    (["data.train_batch_size=8"], "data.train_batch_size 8 < actor.ppo_mini_batch_size 64"),
    (["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=128"],
     "data.train_batch_size 64 < critic.ppo_mini_batch_size 128"),
    (["rollout.n=1"], "algorithm.adv_estimator=grpo compares samples of a prompt: set rollout.n >= 2"),
    (["algorithm.adv_estimator=rloo", "rollout.n=1"], "algorithm.adv_estimator=rloo compares samples"),
    (["algorithm.adv_estimator=grpo_passk", "rollout.n=1"], "algorithm.adv_estimator=grpo_passk compares samples"),
    (["reference.sync_ref_model=true"], "reference.sync_ref_model=true needs a reference service"),
    (["reference.sync_ref_model=true", "actor.use_kl_loss=true", "actor.lora.rank=8"],
     "reference.sync_ref_model=true needs a reference service"),
    (["reference.sync_ref_model=true", "actor.use_kl_loss=true", "weight_sync.transport=grpc"],
     "reference.sync_ref_model=true needs weight_sync.transport auto, gloo, nccl or cuda_ipc"),
])
def test_a_config_a_run_cannot_train_with_fails_to_load(overrides, message):
    # At load, before any service starts (rlfabric up/train load it first), not at StartRun.
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_run_config(overrides=overrides)
    load_config(overrides=overrides)  # one service's config: its own section is what counts


@pytest.mark.parametrize("overrides, message", [
    (["actor.loss_mode=dro"], "actor: .*loss_mode dro needs dro_beta"),
    (["actor.loss_mode=dro", "actor.dro_beta=0"], "actor.dro_beta"),
    (["actor.clip_cov_lb=5", "actor.clip_cov_ub=1"], "clip_cov_lb 5.0 must be below clip_cov_ub 1.0"),
    (["actor.clip_cov_ratio=0"], "actor.clip_cov_ratio"),
    (["algorithm.adv_estimator=gdpo"], "adv_estimator gdpo needs gdpo_reward_keys"),
    (["algorithm.gdpo_reward_keys=[fmt,acc]", "algorithm.gdpo_reward_weights=[1.0]"],
     "gdpo_reward_weights has 1 weights for 2 gdpo_reward_keys"),
])
def test_an_algorithms_settings_are_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)
    assert load_config(overrides=["actor.loss_mode=dro", "actor.dro_beta=0.1"]).actor.dro_beta == 0.1


def test_a_critic_mini_batch_does_not_matter_without_a_critic():
    assert load_run_config(overrides=["critic.ppo_mini_batch_size=128"]).critic.ppo_mini_batch_size == 128


@pytest.mark.parametrize("overrides, message", [
    (["trainer.colocated=true", "trainer.mode=async"], "trainer.colocated=true needs trainer.mode=sync"),
    (["trainer.colocated=true", "rollout.engine=vllm"], "needs rollout.enable_sleep_mode=true"),
])
def test_a_colocated_run_needs_a_rollout_that_can_sleep_between_its_steps(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, overrides)
    load_run_config(None, ["trainer.colocated=true"])  # the hf engine sleeps on any device


def test_multi_turn_needs_an_environment_service():
    with pytest.raises(ConfigError, match="rollout.multi_turn.enable needs an environment service"):
        load_run_config(None, ["rollout.multi_turn.enable=true"])
    for where in ("env.enable=true", "rollout.multi_turn.env_address=10.0.0.5:50057", "cluster.env=[10.0.0.5:50057]"):
        assert load_run_config(None, ["rollout.multi_turn.enable=true", where]).rollout.multi_turn.enable
