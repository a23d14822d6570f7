"""UpdatePolicy and UpdateValues: the direction of a PPO step, zero gradients, metrics, the critic learning."""

from __future__ import annotations

import asyncio

import torch
from grpc_health.v1 import health_pb2
from prometheus_client import generate_latest

from rlfabric.core.client import check_health, open_channel
from tests.trainer.helpers import Served, make_batch, make_config
from tests.waiting import wait_until_async

ACTOR_METRICS = {"actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy",
                 "actor/grad_norm", "actor/lr", "actor/kl_loss"}


def weights(served) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in served.service.engine.worker.model.state_dict().items()}


def test_positive_advantages_raise_the_log_probs_of_their_tokens(tiny_model):
    # One mini-batch of 8 rows, 2 micro-batches of 4: gradient accumulation on the way.
    config = make_config(tiny_model, n=2, actor={"lr": 1e-2, "ppo_mini_batch_size": 4})
    batch = make_batch(rows=8)
    with Served("actor", config) as served:
        old = served.run(served.client.compute_log_probs(batch))["log_probs"]
        metrics = served.run(served.client.update_policy(
            {**batch, "old_log_probs": old, "advantages": torch.ones(8, 5)}, global_step=1))
        new = served.run(served.client.compute_log_probs(batch))["log_probs"]
        status = served.run(served.client.get_status())
        exposition = generate_latest(served.service.registry).decode()
    mask = batch["response_mask"].bool()
    assert (new - old)[mask].mean() > 0.05
    assert ACTOR_METRICS <= set(metrics)
    # On-policy start: ratio 1, so the clipped loss is -mean(A) = -1 and nothing is clipped.
    assert abs(metrics["actor/pg_loss"] + 1.0) < 1e-5 and abs(metrics["actor/ppo_kl"]) < 1e-6
    assert metrics["actor/pg_clipfrac"] == 0 and metrics["actor/grad_norm"] > 0 and metrics["actor/lr"] == 1e-2
    assert status.optimizer_step == 1 and status.num_parameters > 80_000
    # The process's memory around the update (a step reports it as is; on a GPU also device_mb/*).
    assert metrics["memory/actor/rss_mb/before_update"] > 0 and metrics["memory/actor/rss_mb/after_update"] > 0
    for name in ("rlfabric_train_update_seconds_count", "rlfabric_train_tokens_total", "rlfabric_train_grad_norm"):
        assert f'{name}{{role="actor"}}' in exposition


def test_a_single_step_update_without_old_log_probs_is_the_same_update(tiny_model):
    """One mini-batch, one epoch: left out, the old log-probs are the policy's own, taken in the step;
    the weights end where an update given the separately computed ones puts them."""
    import pytest

    from rlfabric.core.errors import InvalidArgument

    config = make_config(tiny_model, n=2, actor={"lr": 1e-2, "ppo_mini_batch_size": 4})
    batch = make_batch(rows=8)
    advantages = torch.linspace(-1, 1, 40).reshape(8, 5)
    results = []
    for give_old in (True, False):
        with Served("actor", config) as served:
            update = {**batch, "advantages": advantages}
            if give_old:
                update["old_log_probs"] = served.run(served.client.compute_log_probs(batch))["log_probs"]
            metrics = served.run(served.client.update_policy(update))
            results.append((weights(served), metrics))
    (with_old, metrics_with), (without, metrics_without) = results
    for name in with_old:
        torch.testing.assert_close(without[name], with_old[name], rtol=1e-5, atol=1e-6)
    assert metrics_without["actor/ppo_kl"] == 0 and metrics_without["actor/pg_clipfrac"] == 0
    assert abs(metrics_without["actor/pg_loss"] - metrics_with["actor/pg_loss"]) < 1e-5

    # Two mini-batches: the second's "old" policy would be the updated one, so the actor refuses.
    two_steps = make_config(tiny_model, n=2, actor={"lr": 1e-2, "ppo_mini_batch_size": 2})
    with Served("actor", two_steps) as served:
        with pytest.raises(InvalidArgument, match="old_log_probs is missing"):  # INVALID_ARGUMENT on the wire
            served.run(served.client.update_policy({**batch, "advantages": advantages}))
        assert served.run(served.client.get_status()).optimizer_step == 0


def test_zero_advantages_give_zero_gradient(tiny_model):
    config = make_config(tiny_model, n=2, actor={"lr": 1e-2, "ppo_mini_batch_size": 2, "weight_decay": 0.0})
    batch = make_batch(rows=8)
    with Served("actor", config) as served:
        before = weights(served)
        old = served.run(served.client.compute_log_probs(batch))["log_probs"]
        metrics = served.run(served.client.update_policy(
            {**batch, "old_log_probs": old - 0.1, "advantages": torch.zeros(8, 5)}))
        after = weights(served)
    assert metrics["actor/grad_norm"] == 0.0 and metrics["actor/pg_loss"] == 0.0
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_kl_loss_entropy_bonus_and_warmup(tiny_model):
    config = make_config(tiny_model, n=2, actor={
        "lr": 1e-3, "ppo_mini_batch_size": 2, "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
        "entropy_coeff": 0.01, "lr_warmup_steps": 4, "loss_agg_mode": "seq-mean-token-mean", "ppo_epochs": 2})
    batch = make_batch(rows=8)
    with Served("actor", config) as served:
        old = served.run(served.client.compute_log_probs(batch))["log_probs"]
        ref = old + 0.3 * batch["response_mask"]
        update = {**batch, "old_log_probs": old, "advantages": torch.zeros(8, 5), "ref_log_probs": ref}
        first = served.run(served.client.update_policy(update))
        second = served.run(served.client.update_policy(update))
        status = served.run(served.client.get_status())
    # k3 of d = -0.3 at the start is exp(0.3) - 0.3 - 1 = 0.0499; the KL loss then pulls the policy to ref.
    assert 0 < second["actor/kl_loss"] < first["actor/kl_loss"] < 0.0499
    assert first["actor/grad_norm"] > 0 and first["actor/entropy"] > 4.0
    assert first["actor/lr"] == 1e-3 / 4 and second["actor/lr"] == 2e-3 / 4
    assert status.optimizer_step == 2 * 2 * 2  # 2 updates x 2 epochs x 2 mini-batches of 2 x n rows


def test_critic_learns_a_constant_return(tiny_model):
    config = make_config(tiny_model, n=2, critic={"lr": 1e-2, "ppo_mini_batch_size": 4, "cliprange_value": 0.5})
    batch = make_batch(rows=8)
    returns = torch.full((8, 5), 1.0) * batch["response_mask"]
    losses = []
    with Served("critic", config) as served:
        for step in range(12):
            values = served.run(served.client.compute_values(batch))["values"]
            metrics = served.run(served.client.update_values({**batch, "values": values, "returns": returns}, step))
            losses.append(metrics["critic/vf_loss"])
        final = served.run(served.client.compute_values(batch))["values"]
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"} <= set(metrics)
    assert losses[-1] < 0.1 * losses[0]
    assert (final[batch["response_mask"] == 1] - 1.0).abs().mean() < 0.15


def test_gradient_checkpointing_changes_memory_not_math(tiny_model):
    batch = make_batch(rows=8)
    results = []
    for checkpointing in (False, True):
        config = make_config(tiny_model, n=2, model={"gradient_checkpointing": checkpointing},
                             actor={"lr": 1e-2, "ppo_mini_batch_size": 4})
        with Served("actor", config) as served:
            old = served.run(served.client.compute_log_probs(batch))["log_probs"]
            metrics = served.run(served.client.update_policy(
                {**batch, "old_log_probs": old, "advantages": torch.ones(8, 5)}))
            results.append((metrics, served.run(served.client.compute_log_probs(batch))["log_probs"]))
            model = served.service.engine.worker.model
            # transformers >= 5.20 names it is_activation_checkpointing, earlier 5.x is_gradient_checkpointing.
            enabled = getattr(model, "is_activation_checkpointing", None)
            assert (model.is_gradient_checkpointing if enabled is None else enabled) == checkpointing
    (plain, plain_after), (checkpointed, checkpointed_after) = results
    assert abs(plain["actor/grad_norm"] - checkpointed["actor/grad_norm"]) < 1e-5
    torch.testing.assert_close(plain_after, checkpointed_after, atol=1e-5, rtol=0)


def test_health_answers_during_a_long_update(tiny_model):
    config = make_config(tiny_model, n=1, actor={"ppo_mini_batch_size": 64, "ppo_micro_batch_size_per_gpu": 64,
                                                 "ppo_epochs": 8})
    batch = make_batch(rows=64, prompt_len=32, response_len=32)
    update = {**batch, "old_log_probs": torch.zeros(64, 32), "advantages": torch.ones(64, 32)}
    with Served("actor", config) as served:

        async def probe_while_updating():
            training = asyncio.ensure_future(served.client.update_policy(update))
            await wait_until_async(lambda: served.server.concurrency_limit.active, 30, "the update to start")
            async with open_channel(served.address) as channel:
                statuses = [await check_health(channel, timeout_s=0.5) for _ in range(3)]
            assert not training.done()  # the probes really overlapped the update
            await training
            return statuses

        statuses = served.run(probe_while_updating())
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 3


def test_rollout_is_weights_scale_each_tokens_policy_loss(tiny_model):
    """Rollout correction's weights arrive with the update over the wire and multiply the policy loss;
    a negative weight is INVALID_ARGUMENT and the service keeps training."""
    import pytest

    from rlfabric.core.errors import InvalidArgument

    config = make_config(tiny_model, n=2, actor={"lr": 1e-2, "ppo_mini_batch_size": 4})
    batch = make_batch(rows=8)
    with Served("actor", config) as served:
        old = served.run(served.client.compute_log_probs(batch))["log_probs"]
        update = {**batch, "old_log_probs": old, "advantages": torch.ones(8, 5)}
        with pytest.raises(InvalidArgument, match="rollout_is_weights must be >= 0"):
            served.run(served.client.update_policy({**update, "rollout_is_weights": -torch.ones(8, 5)}))
        metrics = served.run(served.client.update_policy({**update, "rollout_is_weights": torch.full((8, 5), 2.0)}))
    # On-policy start: ratio 1, so each token's loss is -A * weight = -2.
    assert abs(metrics["actor/pg_loss"] + 2.0) < 1e-5
