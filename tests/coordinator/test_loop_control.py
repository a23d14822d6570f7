"""The coordinator's loop and run control on small meshes in this process (tests/coordinator/meshes.py):
async prefetch and its staleness, checkpoints asked for during a run, pause/resume/stop, and failures
injected by wrapping a client. A test that makes sense over both client kinds runs on both."""

from __future__ import annotations

import asyncio
import dataclasses
from functools import partial

import pytest

from rlfabric.coordinator.client import CoordinatorInterface
from rlfabric.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlfabric.v1 import coordinator_pb2
from tests.coordinator.meshes import MESHES, fast_config, finished, in_process, run_to_end
from tests.waiting import wait_until_async

pytestmark = pytest.mark.slow

BOTH = pytest.mark.parametrize("mesh", list(MESHES))
RUNNING = (coordinator_pb2.RUN_STATE_RUNNING, coordinator_pb2.RUN_STATE_PAUSED)



async def until_state(client: CoordinatorInterface, state: int, timeout_s: float = 60.0):
    """The run status once the run is in `state` (the controller sets it at a step boundary)."""

    async def in_state():
        status = await client.run_status()
        return status if status.state == state else None

    return await wait_until_async(in_state, timeout_s, f"run state {coordinator_pb2.RunState.Name(state)}")


async def first_step(client: CoordinatorInterface) -> int:
    async for update in client.stream_metrics(from_step=1):
        return update.step
    raise AssertionError("the run ended before its first step")


# -- runs over both client kinds ---------------------------------------------------------------------


@BOTH
def test_sync_run_trains_on_fresh_weights(tiny_model, tmp_path, mesh):
    metrics, status = run_to_end(MESHES[mesh], fast_config(tiny_model), tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert metrics[step]["rollout/staleness/max"] == 0  # sync: every sample from the current weights
        assert metrics[step]["weight_sync/replicas"] == 1
    assert metrics[2]["rollout/weight_version"] == metrics[1]["rollout/weight_version"] + 1
    assert (tmp_path / "run" / "checkpoints" / "global_step_2" / "actor").is_dir()
    assert (tmp_path / "run" / "final_model" / "config.json").exists()


@BOTH
def test_async_prefetch_trains_one_version_behind(tiny_model, tmp_path, mesh):
    config = fast_config(tiny_model, "trainer.mode=async", "trainer.max_staleness=1", "trainer.total_steps=3")
    metrics, status = run_to_end(MESHES[mesh], config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    # Step 1's batch comes from the starting weights; each later one was generated while the step
    # before it trained, so from weights one version old.
    assert metrics[1]["rollout/staleness/max"] == 0
    assert metrics[2]["rollout/staleness/max"] == metrics[3]["rollout/staleness/max"] == 1


@BOTH
def test_lora_run_takes_its_reference_from_the_actors_base_model(tiny_model, tmp_path, mesh):
    config = fast_config(tiny_model, "actor.lora.rank=4", "actor.use_kl_loss=true")
    metrics, status = run_to_end(MESHES[mesh], config, tmp_path / "run")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert not config.cluster.reference  # no reference service: the actor answers for it
    assert metrics[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == base model
    assert metrics[2]["actor/kl_loss"] > 0  # after one update the adapters move the policy off its base


@BOTH
def test_save_checkpoint_during_a_run(tiny_model, tmp_path, mesh):
    async def scenario():
        async with MESHES[mesh](fast_config(tiny_model, "trainer.total_steps=4"), tmp_path / "run") as client:
            await client.start_run()
            saved = await client.save_checkpoint()  # taken at the next step boundary
            status_then = await client.run_status()
            metrics = await finished(client)
            return saved, status_then, metrics, await client.run_status()

    saved, status_then, metrics, status = asyncio.run(scenario())
    assert 1 <= saved.step < 4 and status_then.state in RUNNING  # the run went on after the save
    assert saved.path.endswith(f"global_step_{saved.step}")
    assert (tmp_path / "run" / "checkpoints" / f"global_step_{saved.step}" / "actor" / "meta.json").exists()
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED and sorted(metrics) == [1, 2, 3, 4]


@BOTH
def test_pause_resume_then_stop_with_a_checkpoint(tiny_model, tmp_path, mesh):
    async def scenario():
        async with MESHES[mesh](fast_config(tiny_model, "trainer.total_steps=200"), tmp_path / "run") as client:
            await client.start_run()
            await first_step(client)
            await client.pause_run()
            paused = await until_state(client, coordinator_pb2.RUN_STATE_PAUSED)
            again = await client.run_status()  # nothing moves while paused
            await client.resume_run()
            async for update in client.stream_metrics(from_step=paused.step + 1):
                resumed_step = update.step
                break
            await client.stop_run()  # returns once the run has ended, checkpoint written
            return paused, again, resumed_step, await client.run_status()

    paused, again, resumed_step, stopped = asyncio.run(scenario())
    assert paused.phase == "paused" and (again.state, again.step) == (paused.state, paused.step)
    assert resumed_step == paused.step + 1
    assert stopped.state == coordinator_pb2.RUN_STATE_STOPPED and resumed_step <= stopped.step < 200
    assert (tmp_path / "run" / "checkpoints" / f"global_step_{stopped.step}" / "actor").is_dir()


@BOTH
def test_run_control_without_a_run_is_refused(tiny_model, tmp_path, mesh):
    async def scenario():
        async with MESHES[mesh](fast_config(tiny_model), tmp_path / "run") as client:
            for call in (client.pause_run(), client.resume_run(), client.stop_run(), client.save_checkpoint()):
                with pytest.raises(FailedPrecondition):
                    await call

    asyncio.run(scenario())


# -- failures injected by wrapping a client (in process) -------------------------------------------


class FlakyReward:
    """A reward client whose first `failures` calls raise Unavailable, as a restarting service does."""

    def __init__(self, inner, failures: int):
        self.inner, self.failures, self.calls = inner, failures, 0
        self.role = inner.role

    async def score(self, items, timeout_s=None):
        self.calls += 1
        if self.calls <= self.failures:
            raise Unavailable(f"injected failure {self.calls}")
        return await self.inner.score(items, timeout_s)

    async def status(self, timeout_s=None):
        return await self.inner.status(timeout_s)

    async def close(self):
        await self.inner.close()


class FailingUpdate:
    """An actor client whose update_policy raises at `step` (the other calls reach the actor)."""

    def __init__(self, inner, step: int):
        self.inner, self.step = inner, step

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def update_policy(self, batch, global_step=0, timeout_s=None):
        if global_step == self.step:
            raise InvalidArgument(f"injected update failure at step {global_step}")
        return await self.inner.update_policy(batch, global_step, timeout_s)


class OldWeights:
    """A rollout client that reports every sample as generated `behind` versions ago."""

    def __init__(self, inner, behind: int):
        self.inner, self.behind = inner, behind

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate_stream(self, prompts, params, timeout_s=None):
        async for sample in self.inner.generate_stream(prompts, params, timeout_s):
            yield dataclasses.replace(sample, weight_version=sample.weight_version - self.behind)


class BrokenRollout:
    """A rollout replica whose first `failures` generations fail as a crashed engine's do (Unavailable)."""

    def __init__(self, inner, failures: int):
        self.inner, self.failures, self.calls = inner, failures, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate_stream(self, prompts, params, timeout_s=None):
        self.calls += 1
        if self.calls <= self.failures:
            raise Unavailable("injected: the engine died")
        async for sample in self.inner.generate_stream(prompts, params, timeout_s):
            yield sample


def run_wrapped(model_path, run_dir, wrap, *overrides: str):
    """One run on the in-process mesh with wrap(peers) applied; its metrics and final status."""
    return run_to_end(partial(in_process, wrap_peers=wrap), fast_config(model_path, *overrides), run_dir)


def test_reward_that_fails_twice_is_retried(tiny_model, tmp_path):
    rewards = []

    def wrap(peers):
        rewards.append(FlakyReward(peers.reward, failures=2))
        return dataclasses.replace(peers, reward=rewards[-1])

    metrics, status = run_wrapped(tiny_model, tmp_path / "run", wrap, "trainer.total_steps=1")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert rewards[0].calls > 2 and sorted(metrics) == [1]


def test_reward_down_past_the_retry_window_fails_the_run(tiny_model, tmp_path):
    def wrap(peers):
        return dataclasses.replace(peers, reward=FlakyReward(peers.reward, failures=10**6))

    metrics, status = run_wrapped(tiny_model, tmp_path / "run", wrap, "trainer.reward_retry_window_s=0")
    assert status.state == coordinator_pb2.RUN_STATE_FAILED and metrics == {}
    assert "injected failure" in status.error and "scoring gave up" in status.error


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_actor_update_failure_fails_the_run_at_that_step(tiny_model, tmp_path, mode):
    def wrap(peers):
        return dataclasses.replace(peers, actor=FailingUpdate(peers.actor, step=2))

    metrics, status = run_wrapped(tiny_model, tmp_path / "run", wrap, f"trainer.mode={mode}", "trainer.total_steps=3")
    assert status.state == coordinator_pb2.RUN_STATE_FAILED and sorted(metrics) == [1]
    assert "injected update failure at step 2" in status.error and "after step 1" in status.error
    # The last good state stays the resume point: no checkpoint of the failed step.
    assert not (tmp_path / "run" / "checkpoints" / "global_step_2").exists()


def test_a_failing_rollout_replica_is_routed_around(tiny_model, tmp_path):
    broken = []

    def wrap(peers):
        replica = peers.rollout.replicas[0]
        replica.client = BrokenRollout(replica.client, failures=1)
        broken.append(replica.client)
        return peers

    metrics, status = run_wrapped(tiny_model, tmp_path / "run", wrap, "rollout.replicas=2")
    assert status.state == coordinator_pb2.RUN_STATE_COMPLETED, status.error
    assert broken[0].calls >= 1 and sorted(metrics) == [1, 2]
    assert metrics[2]["weight_sync/replicas"] == 2  # the replica that failed a generation still gets the weights


def test_a_replica_serving_weights_older_than_the_last_sync_fails_the_step(tiny_model, tmp_path):
    """Samples too old to train on are dropped and generated again, but samples from weights older than the
    rollout served when their generation started would come back as old every time: that fails the run."""
    def wrap(peers):
        for replica in peers.rollout.replicas:
            replica.client = OldWeights(replica.client, behind=2)
        return peers

    metrics, status = run_wrapped(tiny_model, tmp_path / "run", wrap, "trainer.mode=async", "trainer.max_staleness=1")
    assert status.state == coordinator_pb2.RUN_STATE_FAILED and metrics == {}
    assert "serves stale weights" in status.error and "trainer.max_staleness 1" in status.error
