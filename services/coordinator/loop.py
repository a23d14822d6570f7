"""One PPO/GRPO step, as phases numbered top to bottom (`StepRunner.train_step`; the run around the steps
is PPODriver's, driver.py):

    1. generate and score    the step's groups from the RolloutStream (rollout_stream.py), n samples per
                             prompt generated over the rollout replicas and scored as they finish, or
                             with agent.entrypoint n agent episodes per prompt through the gateway
                             (agent_episodes.py); the sampler makes them the step's batch (sampler.py);
                             a step where more than algorithm.max_failed_fraction of the samples
                             (episodes) failed fails the run here (sample_failures.py)
    2. log-probs and values  reference, old policy, critic and teacher, concurrently
    3. advantages            KL in the reward (optional), then the estimator (rlfabric.algorithms); with
                             algorithm.distill the teacher's per-token reverse KL, alone or added
    4. updates               critic and actor, concurrently
    5. weight sync           actor -> every rollout replica
    6. reference reset       actor -> reference, every reference.ref_model_sync_steps steps when
                             reference.sync_ref_model is on (TR-DPO; weight_sync.sync_ref_model)

Modes: `sync` generates each step's batch with the weights trained so far (on-policy). `async`
keeps generating for up to trainer.max_staleness steps ahead while the step trains; weight syncs
do not wait for it (partial rollouts: samples in flight take the new weights), and no sample whose
oldest token is more than max_staleness versions behind the policy is trained on (rollout_stream.py).
The "old" log-probs come from the actor at train time, so the PPO ratio is taken against the right
policy; when the update is one optimizer step they are the updated policy's own, taken inside that step
(algorithm.old_log_prob_source says where they come from; `rollout`: the sampler's own).

Rollout correction (algorithm.rollout_correction, rlfabric.algorithms.rollout_correction) compares the
rollout engine's log-probs with the old ones here, in the coordinator, after the advantages: its IS
weights go to the actor as one more per-token tensor of the update batch (rollout_is_weights) and its
rejections as zeros in the response mask. The coordinator holds both log-probs already, and the actor's
loss stays one generic rule (multiply by the weights when given) instead of knowing the correction's
settings; the actor processes need no config change to turn it on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from rlfabric import algorithms as algos
from rlfabric.coordinator.hybrid import HybridEngine
from rlfabric.coordinator.membership import RolloutMembership
from rlfabric.coordinator.multi_turn import agent_metrics
from rlfabric.coordinator.peers import Peers
from rlfabric.coordinator.rollout_batch import RolloutBatch, token_level_scores, write_rollouts
from rlfabric.coordinator.rollout_stream import RolloutStream, TakenGroups
from rlfabric.coordinator.sample_failures import (
    SampleFailure,
    TooManyFailedSamples,
    check_failed_fraction,
    failure_of,
)
from rlfabric.coordinator.sample_failures import describe as describe_failures
from rlfabric.coordinator.sampler import Sampler
from rlfabric.coordinator.step_metrics import StepTimer, data_metrics
from rlfabric.coordinator.weight_sync import WeightSync, sync_ref_model
from rlfabric.core import tracing
from rlfabric.core.config import RunConfig
from rlfabric.core.errors import FailedPrecondition
from rlfabric.gateway.segments import episode_advantages
from rlfabric.rollout.router import RouterStats

log = logging.getLogger("rlfabric.coordinator")


class StepRunner:
    """Trains one step at a time over the services in `peers`: phase 1 takes the step's batch from the
    stream, phases 2 to 6 train on it and sync the new weights. Phase changes go to `on_phase`."""

    def __init__(self, config: RunConfig, peers: Peers, sampler: Sampler, weight_sync: WeightSync,
                 pad_token_id: int, run_dir: Path, on_phase: Callable[[str], None] = lambda phase: None,
                 actor_mini_batch_rows: int | None = None, membership: RolloutMembership | None = None):
        self.config = config
        self.peers = peers
        self.sampler = sampler
        self.membership = membership  # rollout replicas that join and leave, taken in and let go at each sync
        self.versions = sampler.versions  # which weights the rollout serves; each sync moves them on
        self.weight_sync = weight_sync
        self.pad_token_id = pad_token_id
        self.run_dir = run_dir  # where trainer.dump_rollouts writes
        self.on_phase = on_phase
        # trainer.colocated: the rollout sleeps while the trainers work (rlfabric.coordinator.hybrid).
        self.hybrid = HybridEngine(config, peers.rollout) if config.trainer.colocated else None
        self.kl_ctrl = kl_controller(config)
        # Rows of one actor optimizer step, as the actor was started: a StartRun may override rollout.n but
        # not the mini-batch of an actor that is already running (RunController passes the mesh's).
        self.actor_mini_batch_rows = actor_mini_batch_rows or config.actor.ppo_mini_batch_size * config.rollout.n
        self.last_trace_id = ""  # the last trained step's trace (tracing on), for the metrics' exemplars
        self._last_step_end: float | None = None  # perf_counter() at the end of the previous step
        self._router_stats = RouterStats()  # the router's counts as of the previous step's metrics

    async def train_step(self, step: int, stream: RolloutStream,
                         initial_save: Awaitable[None] | None = None) -> dict[str, float]:
        """One whole PPO step: its batch from the stream (phase 1), then phases 2 to 6 on it; its metrics.
        The run's first step waits for `initial_save` (the initial weights going to disk) before it trains."""
        timer = StepTimer(step)  # and the step's trace: its root span starts with generation
        batch, rollout_metrics = await self.generated(step, stream, timer)
        if initial_save is not None:
            await _initial_save_done(initial_save, timer)
        metrics = await self.train_on(step, batch, timer)
        metrics.update(rollout_metrics)
        metrics.update(self._router_metrics())
        return metrics

    def _router_metrics(self) -> dict[str, float]:
        """rollout/router/*: the router's counts since the previous step's (none without a rollout)."""
        if self.peers.rollout is None:
            return {}
        stats = dataclasses.replace(self.peers.rollout.stats)
        since, self._router_stats = stats.since(self._router_stats), stats
        return since.as_metrics()

    async def generated(self, step: int, stream: RolloutStream, timer: StepTimer,
                        ) -> tuple[RolloutBatch, dict[str, float]]:
        """1. Generate and score (timing_s/gen: the wait for the step's groups; timing_s/gen_overlapped:
        their generation that ran while earlier steps trained; timing_s/gen_max: ReMax's greedy baselines):
        the step's batch and the stream's metrics."""
        self.on_phase("generating")
        try:
            taken = await stream.take(step, timer)
            batch = self._batch_of(step, taken)
            if self.config.algorithm.adv_estimator == "remax":
                with timer("gen_max"):
                    batch.baselines = await self.sampler.greedy_baselines(taken.rows)
            if self.hybrid is not None:  # done generating until the next sync: the devices go to the trainers
                await self.hybrid.sleep()
        except BaseException as error:
            timer.end(error)
            raise
        return batch, taken.metrics

    async def train_on(self, step: int, batch: RolloutBatch, timer: StepTimer) -> dict[str, float]:
        """Phases 2 to 6 of one PPO step on a generated and scored batch; its metrics (timings under `timer`)."""
        metrics: dict[str, float] = {}
        try:
            # 2. Log-probs and values (timing_s/old_log_prob, timing_s/ref, timing_s/values,
            #    timing_s/teacher_log_prob).
            self.on_phase("computing")
            await self._log_probs_and_values(batch, timer)
            # 3. Rollout correction and advantages (timing_s/adv).
            with timer("adv"):
                metrics.update(self._advantages(batch))
            # 4. Critic and actor updates (timing_s/update).
            self.on_phase("updating")
            with timer("update"):
                metrics.update(await self._updates(step, batch))
            # 5. Weight sync (timing_s/update_weights). Generation running ahead (async mode) goes on:
            #    the samples in flight switch to the new weights.
            self.on_phase("syncing")
            with timer("update_weights"):
                metrics.update(await self._sync_rollout(step))
            # 6. Reference reset (reference.sync_ref_model; timing_s/sync_ref_model on the steps it runs).
            metrics.update(await sync_ref_model(self.peers.actor, self.peers.reference, self.config, step,
                                                self.versions.after(step)))
        except BaseException as error:
            timer.end(error)
            raise
        metrics.update(data_metrics(batch, self.sampler.max_tokens()))
        metrics.update(agent_metrics(batch.samples))
        metrics.update(timer.metrics(batch, previous_step_end=self._last_step_end))
        self.last_trace_id = timer.trace_id
        self._last_step_end = time.perf_counter()
        if self.config.trainer.dump_rollouts:
            write_rollouts(self.run_dir, step, batch, self.config.trainer.dump_rollout_tokens)
        return metrics

    # -- the phases of a step ---------------------------------------------------------------------

    async def _log_probs_and_values(self, batch: RolloutBatch, timer: StepTimer) -> None:
        """batch.old_log_probs, ref_log_probs, values and teacher_log_probs: the services at once, each timed on
        its own.
        When the update is one optimizer step, the "old" policy is the one being updated: the actor takes
        its own log-probs in that step, and the separate forward pass is skipped (_old_log_prob_forward);
        with algorithm.old_log_prob_source=rollout they are the rollout's."""
        peers, temperature, tensors = self.peers, self.config.rollout.temperature or 1.0, batch.tensors
        calls = {}
        if self._old_log_prob_forward(batch):
            calls["old_log_prob"] = peers.actor.compute_log_probs(
                self._actor_tensors(batch, tensors), temperature, compute_entropy=False,
                compute_sum_pi_squared=self._estimator_needs("sum_pi_squared"))
        if peers.reference is not None:
            calls["ref"] = peers.reference.compute_log_probs(tensors, temperature)
        if peers.critic is not None:
            calls["values"] = peers.critic.compute_values(tensors)
        if peers.teacher is not None:
            calls["teacher_log_prob"] = peers.teacher.compute_log_probs(tensors, temperature)
        answers = await asyncio.gather(*(timer.timed(phase, call) for phase, call in calls.items()))
        results = dict(zip(calls, answers, strict=True))
        batch.old_log_probs = results["old_log_prob"]["log_probs"] if "old_log_prob" in results else None
        batch.sum_pi_squared = results["old_log_prob"].get("sum_pi_squared") if "old_log_prob" in results else None
        if self.config.algorithm.old_log_prob_source == "rollout":
            if batch.rollout_log_probs is None:
                raise FailedPrecondition("algorithm.old_log_prob_source=rollout needs the rollout's log-probs, and a "
                                         "sample of this step came back without them (rollout.engine "
                                         f"{self.config.rollout.engine}): use old_log_prob_source auto")
            batch.old_log_probs = batch.rollout_log_probs
        batch.ref_log_probs = results["ref"]["log_probs"] if "ref" in results else None
        batch.values = results["values"]["values"] if "values" in results else None
        teacher = results.get("teacher_log_prob")
        batch.teacher_log_probs = teacher["log_probs"] if teacher is not None else None

    def _advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """batch.token_rewards (KL-penalised if configured), the rollout correction (_rollout_correction),
        advantages, returns and train_mask. A sample
        whose scoring failed trains on nothing unless algorithm.score_failure=zero: mask 0 for it, and no
        group baseline counts it."""
        algorithm, metrics = self.config.algorithm, {}
        mask = batch.response_mask
        token_rewards = token_level_scores(batch.scores, mask)
        if algorithm.use_kl_in_reward:
            beta = self.kl_ctrl.value
            token_rewards, current_kl = algos.kl_in_reward(token_rewards, batch.old_log_probs, batch.ref_log_probs,
                                                           mask, self.kl_ctrl, algorithm.kl_penalty)
            metrics.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta})
        train_mask, group_ids = mask, batch.group_ids
        if algorithm.score_failure == "mask":
            train_mask, group_ids = leave_out(batch.score_failed, mask, group_ids)
        # Rollout correction before the estimator, which may weigh by its IS weights (the optimal token
        # baselines); its rejections leave the trained tokens after the advantages are taken.
        batch.train_mask = train_mask
        metrics.update(self._rollout_correction(batch))
        if batch.episode_ids is not None:  # agent episodes: one advantage per episode, shared by its segments
            batch.advantages = self._episode_advantages(batch, train_mask)
            batch.returns = batch.advantages
        else:
            name = algorithm.adv_estimator
            # What the estimator asked for at its registration beyond the call form (e.g. gdpo's components).
            extra = {key: getattr(algorithm, key) for key in algos.advantage_estimator_params(name)}
            extra.update({key: getattr(batch, key) for key in algos.advantage_estimator_inputs(name)})
            batch.advantages, batch.returns = algos.get_advantage_estimator(name)(
                token_rewards=token_rewards, mask=train_mask, values=batch.values, group_ids=group_ids,
                baselines=batch.baselines, gamma=algorithm.gamma, lam=algorithm.lam,
                norm_by_std=algorithm.norm_adv_by_std_in_grpo, **extra)
        batch.token_rewards = token_rewards
        if algorithm.distill.enable:
            metrics.update(self._distill(batch, train_mask))
        return metrics

    def _distill(self, batch: RolloutBatch, train_mask: torch.Tensor) -> dict[str, float]:
        """algorithm.distill: the teacher's per-token reverse-KL advantages, added to the estimator's
        (use_task_reward) or in their place; the distill/* metrics."""
        settings = self.config.algorithm.distill
        advantages, metrics = algos.distill_advantages(batch.old_log_probs, batch.teacher_log_probs,
                                                       train_mask, settings.weight)
        if settings.use_task_reward:
            advantages = batch.advantages + advantages
        else:
            batch.returns = advantages
        batch.advantages = advantages
        return metrics

    def _episode_advantages(self, batch: RolloutBatch, train_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] the outcome estimator over the step's episodes (a prompt's n episodes are its group), each
        segment taking its episode's on its trained tokens; failed episodes (score_failure mask) in no group."""
        algorithm, n = self.config.algorithm, self.config.rollout.n
        scores, failed = batch.episode_scores, batch.episode_failed
        groups = torch.arange(len(scores)) // n  # [E] the episode's prompt
        if algorithm.score_failure == "mask":
            _, groups = leave_out(failed, torch.zeros(len(scores), 1), groups)
        return episode_advantages(algorithm.adv_estimator, scores, groups, batch.episode_ids, train_mask,
                                  norm_by_std=algorithm.norm_adv_by_std_in_grpo)

    def _rollout_correction(self, batch: RolloutBatch) -> dict[str, float]:
        """rollout_corr/* metrics whenever the step has the rollout's log-probs and separate old ones, and
        with algorithm.rollout_correction on: batch.rollout_is_weights and rejected tokens out of
        batch.train_mask; perf/old_log_prob_forward: 1 when the old-log-prob forward pass ran."""
        forward = float(self._old_log_prob_forward(batch))
        if batch.rollout_log_probs is None or batch.old_log_probs is None or not forward:
            return {"perf/old_log_prob_forward": forward}
        settings = self.config.algorithm.rollout_correction
        correction = algos.rollout_correction(
            batch.old_log_probs, batch.rollout_log_probs, batch.train_mask,
            rollout_is=settings.rollout_is, rollout_is_threshold=settings.rollout_is_threshold,
            rollout_rs=settings.rollout_rs, rollout_rs_threshold=settings.rollout_rs_threshold,
            rollout_rs_threshold_lower=settings.rollout_rs_threshold_lower)
        batch.rollout_is_weights, batch.train_mask = correction.weights, correction.mask
        return {**correction.metrics, "perf/old_log_prob_forward": forward}

    def _actor_tensors(self, batch: RolloutBatch, tensors: dict) -> dict:
        """The actor's batch: with actor.router_replay, the rollout's routes too."""
        if self.config.actor.router_replay and batch.routed_experts is not None:
            return {**tensors, "routed_experts": batch.routed_experts}
        return tensors

    async def _updates(self, step: int, batch: RolloutBatch) -> dict[str, float]:
        """The actor's policy update and the critic's value update, at once; their metrics."""
        tensors = {**batch.tensors, "response_mask": batch.train_mask}
        policy_batch = {**tensors, "advantages": batch.advantages}
        if batch.old_log_probs is not None:
            policy_batch["old_log_probs"] = batch.old_log_probs
        if self.config.actor.use_kl_loss:
            policy_batch["ref_log_probs"] = batch.ref_log_probs
        if batch.rollout_is_weights is not None:
            policy_batch["rollout_is_weights"] = batch.rollout_is_weights
        policy_batch = self._actor_tensors(batch, policy_batch)
        # Agent episodes: as many rows as segments, padded (mask 0) to whole mini-batches for the actor.
        updates = [self.peers.actor.update_policy(padded_rows(policy_batch, self.actor_mini_batch_rows),
                                                  global_step=step)]
        if self.peers.critic is not None:
            updates.append(self.peers.critic.update_values(
                {**tensors, "values": batch.values, "returns": batch.returns}, global_step=step))
        metrics: dict[str, float] = {}
        for update_metrics in await asyncio.gather(*updates):
            metrics.update(update_metrics)
        return metrics

    async def _sync_rollout(self, step: int) -> dict[str, float]:
        """The weights after `step` to the rollout; with trainer.colocated in VeRL's order: the rollout's
        weights wake, take the sync, then its KV cache."""
        if self.hybrid is not None:
            await self.hybrid.wake_weights()
        metrics = await self.sync_weights(self.versions.after(step))
        if self.hybrid is not None:
            await self.hybrid.wake_kv_cache()
            metrics.update(self.hybrid.metrics())
        return metrics

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Actor -> every live rollout replica (phase 5, and the run's first sync). A replica that misses a
        sync leaves the router until a later sync reaches it (the weight sync does that,
        WeightSync.serve_synced; the plane takes restarted replicas back into the group), so no request is
        ever served by stale weights. Replicas that joined or left since the last sync are taken in (this sync
        brings them to `version`) or let go of first (rlfabric.coordinator.membership)."""
        changes = await self.membership.apply(self.peers.rollout, self.weight_sync) if self.membership else {}
        report = await self.weight_sync.sync(version)  # raises for the actor's failures only
        if report.failed and self.weight_sync.stale:
            # A dead member breaks the collective for every member (gloo, NCCL); the plane rebuilds the
            # group without the members that do not answer, so one more try reaches the live ones. (A
            # member already left out and still unreachable broke nothing: no second full transfer.)
            log.warning("weight sync of version %d failed for %s; retrying once", version, sorted(report.failed))
            report = await self.weight_sync.sync(version)
        synced = [name for name in self.weight_sync.receivers if name not in report.failed]
        for name, error in report.failed.items():
            log.warning("weight sync of version %d to rollout %s failed: %s", version, name, error)
        if not synced:
            actor = f"; the actor failed: {report.actor_error}" if report.actor_error else ""  # names its address
            raise FailedPrecondition(f"weight sync of version {version} reached no rollout replica: {report.failed}{actor}")
        self.versions.served = version
        tracing.annotate(weight_version=version, bytes_synced=report.num_bytes, replicas=synced)
        return {"weight_sync/seconds": report.seconds, "weight_sync/gbytes": report.num_bytes / 1e9,
                "weight_sync/paused_s": max(report.paused_seconds.values(), default=0.0),
                "weight_sync/replicas": float(len(synced)), "rollout/weight_version": float(version),
                **report.phase_metrics(), **(report.delta_metrics() if self.config.weight_sync.delta else {}),
                **({"weight_sync/actor_egress_bytes": float(report.egress_bytes)} if report.hop_seconds else {}),
                **changes}

    # -- phase 1's batch ---------------------------------------------------------------------------

    def _batch_of(self, step: int, taken: TakenGroups) -> RolloutBatch:
        """The step's groups as its scored batch (the sampler makes it); failed samples (agent episodes) logged,
        counted by reason, and more than algorithm.max_failed_fraction of them fail the step."""
        failures = [failure_of(taken.results[key]) for key in sorted(taken.results)]  # one per sample (episode)
        failed = describe_failures(step, failures)
        if failed:
            kept = "trained on with score 0" if self.config.algorithm.score_failure == "zero" else "left out of training"
            log.warning("%s (%s)", failed, kept)
        if not taken.samples:  # agent episodes that recorded no call: no batch to dump
            check_failed_fraction(step, failures, self.config.algorithm.max_failed_fraction)
        batch = self.sampler.scored_batch(taken.rows, taken.samples, taken.results, self.pad_token_id)
        self._check_failed_fraction(step, batch, failures)
        return batch

    def _check_failed_fraction(self, step: int, batch: RolloutBatch, failures: list[SampleFailure | None]) -> None:
        """Fails the step (and the run) when more than algorithm.max_failed_fraction of its samples (agent
        episodes) failed; with trainer.dump_rollouts its samples and their failures are written first."""
        try:
            check_failed_fraction(step, failures, self.config.algorithm.max_failed_fraction)
        except TooManyFailedSamples:
            if self.config.trainer.dump_rollouts:
                write_rollouts(self.run_dir, step, batch, self.config.trainer.dump_rollout_tokens)
            raise

    def _old_log_prob_forward(self, batch: RolloutBatch) -> bool:
        """Whether the old log-probs take a separate actor forward pass (algorithm.old_log_prob_source).
        auto skips it when the actor's update is a single optimizer step (one mini-batch, one epoch) and
        nothing reads them before it: no KL in the reward, no rollout correction, no distillation."""
        config, algorithm = self.config, self.config.algorithm
        if algorithm.old_log_prob_source != "auto":
            return algorithm.old_log_prob_source == "actor"
        one_step = config.actor.ppo_epochs == 1 and batch.num_rows <= self.actor_mini_batch_rows
        return (not one_step or algorithm.use_kl_in_reward or algorithm.rollout_correction.enabled()
                or algorithm.distill.enable or self._estimator_needs("old_log_probs"))

    def _estimator_needs(self, key: str) -> bool:
        """Whether algorithm.adv_estimator takes `key` of ESTIMATOR_INPUTS (the optimal token baselines:
        old_log_probs and sum_pi_squared)."""
        return key in algos.advantage_estimator_inputs(self.config.algorithm.adv_estimator)


async def _initial_save_done(saving: Awaitable[None], timer: StepTimer) -> None:
    """The first step's trainers wait for the initial save (timing_s/initial_save: how long)."""
    try:
        with timer("initial_save"):
            await saving
    except BaseException as error:
        timer.end(error)
        raise


def kl_controller(config: RunConfig):
    """algorithm.kl_ctrl_type's controller of the KL coefficient (its value is in every checkpoint)."""
    algorithm = config.algorithm
    if algorithm.kl_ctrl_type == "adaptive":
        return algos.AdaptiveKLController(algorithm.kl_coef, algorithm.kl_target, algorithm.kl_horizon)
    return algos.FixedKLController(algorithm.kl_coef)


def padded_rows(tensors: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """The batch (tensors [B, ...]) with copies of its first row added, their response mask 0 (no loss sees
    them), up to a multiple of `multiple` rows: agent batches have a row per segment, and the actor's updates
    take whole mini-batches. The batch itself when it has such a count already."""
    rows = len(tensors["response_mask"])
    extra = -rows % multiple
    if not extra:
        return tensors
    index = torch.cat([torch.arange(rows), torch.zeros(extra, dtype=torch.int64)])  # [B + extra]
    padded = {name: tensor[index] for name, tensor in tensors.items()}
    padded["response_mask"][rows:] = 0
    return padded


def leave_out(failed: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(response mask [B, T], group ids [B]) with the rows where `failed` [B] is true left out of training:
    their mask is 0, so no loss sees them, and each is a group of its own, so no group baseline counts them."""
    if not failed.any():
        return mask, group_ids
    mask = mask.masked_fill(failed.unsqueeze(-1), 0)
    group_ids = group_ids.clone()
    group_ids[failed] = int(group_ids.max()) + 1 + torch.arange(int(failed.sum()))
    return mask, group_ids
