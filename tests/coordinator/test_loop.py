"""The run's driver (PPODriver) and its steps (StepRunner) in one process: the real run and train_step over
stand-in model services that return tensors of the right shapes and record what they were sent."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from rlfabric.coordinator.driver import NoHooks, PPODriver, RunStopped
from rlfabric.coordinator.overrides import check_roles
from rlfabric.coordinator.peers import Peers
from rlfabric.coordinator.rollout_batch import RolloutBatch, build_rollout_batch
from rlfabric.coordinator.sample_failures import TooManyFailedSamples, failure_of
from rlfabric.coordinator.step_metrics import StepTimer
from rlfabric.coordinator.weight_sync import SyncReport, WeightSync
from rlfabric.core.config import RunConfig, config_from_dict
from rlfabric.core.errors import FailedPrecondition, InvalidArgument
from rlfabric.data.dataset import PromptRow
from rlfabric.reward.items import ItemResult
from rlfabric.reward.items import failed as failed_result
from rlfabric.rollout.router import RouterStats
from rlfabric.rollout.types import Finish, FinishedSample

N = 2  # samples per prompt
PROMPTS = 2


class ModelService:
    """Stands in for the actor, reference or critic client: zeros of the right shape; the batches each
    update was sent; `slow_s` makes every call take that long (a slow service is what a timer measures)."""

    def __init__(self, name: str, slow_s: float = 0.0, fail_update: bool = False):
        self.address = f"{name}.test:1"
        self.options = SimpleNamespace(timeout_s=5.0)
        self.slow_s = slow_s
        self.fail_update = fail_update
        self.updates: list[dict[str, torch.Tensor]] = []

    async def _answer(self, tensors, key: str) -> dict[str, torch.Tensor]:
        await asyncio.sleep(self.slow_s)  # the service's own latency, not synchronisation
        return {key: torch.zeros(tensors["responses"].shape)}

    async def compute_log_probs(self, tensors, temperature, compute_entropy=True, compute_sum_pi_squared=False):
        return await self._answer(tensors, "log_probs")

    async def compute_values(self, tensors):
        return await self._answer(tensors, "values")

    async def update_policy(self, batch, global_step):
        return self._update(batch)

    async def update_values(self, batch, global_step):
        return self._update(batch)

    def _update(self, batch) -> dict[str, float]:
        if self.fail_update:
            raise FailedPrecondition("the update failed")
        self.updates.append(batch)
        return {}


class InstantSync(WeightSync):
    """Stands in for the weight-sync plane: every sync reaches its one receiver at once."""

    @property
    def receivers(self) -> dict[str, str]:
        return {"rollout": "rollout.test:1"}

    @property
    def stale(self) -> bool:
        return False

    async def open(self) -> dict[str, str]:
        return {}

    async def close(self) -> None:
        pass

    async def sync(self, version: int) -> SyncReport:
        return SyncReport(version)


class Prompts:
    """The training data: the same prompts every step."""

    def __init__(self, rows: list[PromptRow]):
        self.rows = rows

    def batches(self, batch_size, seed, cursor):
        while True:
            yield self.rows[:batch_size]


def config(*overrides: str) -> RunConfig:
    tree = {"data": {"train_batch_size": PROMPTS}, "rollout": {"n": N},
            "actor": {"ppo_mini_batch_size": PROMPTS}, "critic": {"ppo_mini_batch_size": PROMPTS},
            "trainer": {"dump_rollouts": False, "total_steps": 3}}
    for override in overrides:
        key, value = override.split("=")
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = value
    return config_from_dict(tree)


ROWS = [PromptRow(f"p{i}", "src", [{"role": "user", "content": "q"}], [1, 2, 3], "a", "", "{}")
        for i in range(PROMPTS)]


def rollout_batch(scores: list[float], failed: list[bool] | None = None, version: int = 0) -> RolloutBatch:
    samples = [FinishedSample(p, i, [4, 5], [], Finish.STOP, version) for p in range(PROMPTS) for i in range(N)]
    batch = build_rollout_batch(ROWS, samples, N, pad_token_id=0)
    batch.scores = torch.tensor(scores)
    batch.score_failed = torch.tensor(failed or [False] * len(scores))
    return batch


def train_step(driver: PPODriver, batch: RolloutBatch, step: int = 1) -> dict[str, float]:
    """StepRunner.train_on: phases 2 to 5 on a batch already generated and scored; its metrics."""
    return asyncio.run(driver.steps.train_on(step, batch, StepTimer()))


def driver_over(run_config: RunConfig, tmp_path, actor: ModelService, reference: ModelService | None = None,
                critic: ModelService | None = None, rollout=None, reward=None, hooks=None) -> PPODriver:
    peers = Peers(actor=actor, rollout=rollout, reward=reward, reference=reference, critic=critic)
    return PPODriver(run_config, peers, SimpleNamespace(pad_token_id=0), tmp_path, Prompts(ROWS), None,
                     InstantSync(), hooks)


class Rollout:
    """Stands in for the rollout router: step 1's prompts generate at once, every later request waits
    until cancelled (it is still generating when step 1 fails)."""

    def __init__(self):
        self.requests: list[asyncio.Task] = []
        self.stats = RouterStats()  # the loop reads its counts each step

    def healthy(self):
        return [self]

    async def status(self, timeout_s=None):
        return {}  # no replica to wake at the run's start

    async def generate_stream(self, prompts, params, chunk_prompts=None):
        self.requests.append(asyncio.current_task())
        if len(self.requests) > 1:
            await asyncio.Event().wait()
        for p in range(len(prompts)):
            for i in range(params.n):
                yield FinishedSample(p, i, [4, 5], [], Finish.STOP, 0)


class Reward:
    async def score(self, items, timeout_s=None):
        return [ItemResult(float(i % 2)) for i in range(len(items))]


def test_a_failing_step_in_async_mode_cancels_the_generation_running_ahead(tmp_path):
    driver = driver_over(config("trainer.mode=async"), tmp_path, ModelService("actor", fail_update=True),
                           rollout=Rollout(), reward=Reward())

    async def scenario():
        with pytest.raises(FailedPrecondition, match="the update failed"):
            await driver.run()
        ahead = driver.peers.rollout.requests[-1]
        assert len(driver.peers.rollout.requests) == 2  # step 2's prompts were generating while step 1 trained
        await asyncio.wait([ahead], timeout=10)
        assert ahead.done()  # (asyncio.run would cancel it at the end in any case)

    asyncio.run(scenario())


def test_reference_and_critic_have_timers_of_their_own(tmp_path):
    # Two epochs: the update is more than one optimizer step, so the old log-probs are computed.
    run_config = config("algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "actor.ppo_epochs=2")
    actor = ModelService("actor")
    driver = driver_over(run_config, tmp_path, actor, reference=ModelService("reference", slow_s=0.3),
                           critic=ModelService("critic", slow_s=0.3))
    metrics = train_step(driver, rollout_batch([1.0, 0.0, 1.0, 0.0]))
    assert metrics["timing_s/ref"] >= 0.3 and metrics["timing_s/values"] >= 0.3
    assert metrics["timing_s/old_log_prob"] < 0.3  # the actor answers at once; the others are not in it


def test_failed_scores_are_counted_and_left_out_of_the_update_by_default(tmp_path):
    actor = ModelService("actor")
    driver = driver_over(config(), tmp_path, actor)
    assert driver.config.algorithm.score_failure == "mask"
    batch = rollout_batch([1.0, 0.0, 1.0, 0.0], failed=[False, True, False, False])
    metrics = train_step(driver, batch)
    assert metrics["reward/score_failed/count"] == 1.0 and metrics["reward/score_failed/fraction"] == 0.25
    sent = actor.updates[0]
    assert sent["response_mask"].sum(-1).tolist() == [2, 0, 2, 2]  # the failed sample trains on nothing
    # Its group-mate is a group of one (GRPO: mean 0, std 1): its advantage is its own score, not a
    # comparison with a 0 the reward service never gave.
    assert sent["advantages"][0].tolist() == pytest.approx([1.0, 1.0], abs=1e-4)
    assert batch.response_mask.sum(-1).tolist() == [2, 2, 2, 2]  # the batch itself (its metrics) unchanged


def test_the_rollout_dump_says_which_samples_failed_scoring_and_why(tmp_path):
    driver = driver_over(config("trainer.dump_rollouts=true"), tmp_path, ModelService("actor"))
    batch = rollout_batch([1.0, 0.0, 1.0, 0.0], failed=[False, True, False, False])
    batch.failures = [None, failure_of(failed_result("crashed", "the scorer died")), None, None]
    train_step(driver, batch)
    lines = [json.loads(line) for line in (tmp_path / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert [line["score_failed"] for line in lines] == [False, True, False, False]
    assert lines[1]["failure"] == {"source": "reward", "status": "crashed", "message": "the scorer died"}
    assert lines[0]["failure"] is None


def test_the_rollout_dump_has_token_ids_and_sampler_log_probs_only_when_asked(tmp_path):
    samples = [FinishedSample(p, i, [4 + i, 5, 6][: 3 - i % 2], [-0.5 * i, -1.0, -2.0][: 3 - i % 2], Finish.STOP, 0)
               for p in range(PROMPTS) for i in range(N)]
    samples[1].prompt_ids = [7, 8, 9, 10]  # a sample rendered with its own prompt (multi-turn) keeps it
    for tokens, name in ((False, "plain"), (True, "tokens")):
        driver = driver_over(config("trainer.dump_rollouts=true", f"trainer.dump_rollout_tokens={tokens}"),
                               tmp_path / name, ModelService("actor"))
        batch = build_rollout_batch(ROWS, samples, N, pad_token_id=0)
        batch.scores, batch.score_failed = torch.zeros(len(samples)), torch.zeros(len(samples), dtype=torch.bool)
        train_step(driver, batch)
        lines = [json.loads(line) for line in (tmp_path / name / "rollouts" / "step_1.jsonl").read_text().splitlines()]
        if not tokens:
            assert not {"prompt_ids", "response_ids", "rollout_log_probs"} & set(lines[0])
            continue
        by_key = {(s.prompt_index, s.sample_index): s for s in samples}
        for line, row in zip(lines, batch.rows, strict=True):
            sample = by_key[(int(row.uid[1:]), line["sample_index"])]
            assert line["response_ids"] == sample.token_ids and line["rollout_log_probs"] == sample.logprobs
            assert line["prompt_ids"] == (sample.prompt_ids or [1, 2, 3])
        assert lines[1]["prompt_ids"] == [7, 8, 9, 10] and lines[0]["response_ids"] == [4, 5, 6]


class StopAfterOneStep(NoHooks):
    """Run control that, at the boundary after step 1, asks for a checkpoint and then stops without one;
    records the phases and the metrics the run reports."""

    def __init__(self):
        self.driver: PPODriver | None = None
        self.checkpoint: asyncio.Future | None = None
        self.phases: list[str] = []
        self.metrics: dict[int, tuple[dict[str, float], str]] = {}

    def on_phase(self, phase: str) -> None:
        self.phases.append(phase)

    def on_metrics(self, step: int, metrics: dict[str, float], trace_id: str) -> None:
        self.metrics[step] = (metrics, trace_id)

    async def between_steps(self) -> None:
        if self.driver.step == 1:
            self.checkpoint = self.driver.request_checkpoint()
            self.driver.request_stop(save=False)


def test_a_stop_ends_the_run_at_the_step_boundary_and_a_waiting_checkpoint_request_gets_an_answer(tmp_path):
    hooks = StopAfterOneStep()
    driver = driver_over(config(), tmp_path, ModelService("actor"), rollout=Rollout(), reward=Reward(), hooks=hooks)
    hooks.driver = driver

    async def scenario():
        with pytest.raises(RunStopped):
            await driver.run()
        assert not hooks.checkpoint.done()  # no step boundary came to take it
        driver.ended("the run ended (RUN_STATE_STOPPED) before the requested checkpoint was taken")
        with pytest.raises(FailedPrecondition, match="before the requested checkpoint was taken"):
            await hooks.checkpoint

    asyncio.run(scenario())
    assert driver.step == 1 and sorted(hooks.metrics) == [1]
    assert hooks.metrics[1][1] == ""  # the step's trace id: none with tracing off
    # Step 1's phases, then nothing: the stop asked for no save (no checkpointing, no exporting).
    assert hooks.phases == ["generating", "computing", "updating", "syncing"]


class FailingReward:
    """Stands in for the reward client: every item but the first `scored` fails with `status`, saying why
    at length (a scorer's traceback can be long)."""

    def __init__(self, scored: int, status: str = "timeout"):
        self.scored, self.status = scored, status

    async def score(self, items, timeout_s=None):
        return [ItemResult(1.0) if i < self.scored else failed_result(self.status, f"item {i} took too long " + "x" * 500)
                for i in range(len(items))]


def test_a_step_where_most_samples_failed_fails_the_run_before_training_with_the_reasons(tmp_path, caplog):
    actor = ModelService("actor")
    driver = driver_over(config("trainer.dump_rollouts=true"), tmp_path, actor, rollout=Rollout(),
                           reward=FailingReward(scored=1))
    assert driver.config.algorithm.max_failed_fraction == 0.5
    driver.keep_policy = None  # a run that failed must not get to keep (export) its policy

    with pytest.raises(TooManyFailedSamples) as failure:
        asyncio.run(driver.run())
    assert str(failure.value).startswith("step 1: 3 of 4 samples failed (reward timeout: 3); the first: item 1 took")
    assert "algorithm.max_failed_fraction=0.5" in str(failure.value)
    assert actor.updates == [] and driver.step == 0
    # The step's samples, each with its failure, for the error to be looked into.
    dumped = [json.loads(line) for line in (tmp_path / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert [row["failure"] and row["failure"]["status"] for row in dumped] == [None, "timeout", "timeout", "timeout"]
    assert all(row["failure"] is None or (row["failure"]["source"] == "reward" and
                                          len(row["failure"]["message"]) == 300) for row in dumped)
    assert "step 1: 3 of 4 samples failed (reward timeout: 3)" in caplog.text


def test_a_step_at_the_failed_fraction_trains_on_the_rest(tmp_path):
    actor = ModelService("actor")
    driver = driver_over(config("trainer.total_steps=1", "trainer.export_final=false", "trainer.save_final=false"),
                           tmp_path, actor, rollout=Rollout(), reward=FailingReward(scored=2))
    asyncio.run(driver.run())  # 2 of 4 failed: not more than half
    assert driver.step == 1 and actor.updates[0]["response_mask"].sum(-1).tolist() == [2, 2, 0, 0]


def test_failed_scores_train_as_zero_when_configured(tmp_path):
    actor = ModelService("actor")
    driver = driver_over(config("algorithm.score_failure=zero"), tmp_path, actor)
    batch = rollout_batch([1.0, 0.0, 1.0, 0.0], failed=[False, True, False, False])
    metrics = train_step(driver, batch)
    assert metrics["reward/score_failed/count"] == 1.0
    sent = actor.updates[0]
    assert sent["response_mask"].sum(-1).tolist() == [2, 2, 2, 2]
    assert sent["advantages"][1, 0] < 0 < sent["advantages"][0, 0]  # compared with its group-mate's 1


def test_no_failed_scores_reports_zero(tmp_path):
    driver = driver_over(config(), tmp_path, ModelService("actor"))
    metrics = train_step(driver, rollout_batch([1.0, 0.0, 1.0, 0.0]))
    assert metrics["reward/score_failed/count"] == 0.0 and metrics["reward/score_failed/fraction"] == 0.0


def test_start_run_overrides_are_held_to_the_config_rules_and_the_mesh_roles():
    with pytest.raises(InvalidArgument, match="set rollout.n >= 2"):
        check_roles(config("rollout.n=1"))
    with pytest.raises(FailedPrecondition, match="algorithm.adv_estimator=gae needs a critic service"):
        check_roles(config("algorithm.adv_estimator=gae"))  # cluster.critic is empty
    check_roles(config())
