"""The single-controller PPO/GRPO loop. `PPOTrainer.run` steps until trainer.total_steps; each step is
`train_step`, top to bottom (phase 1 in `generated`, 2 to 5 in `train_on`):

    1. generate and score    n samples per prompt over the rollout replicas; Score requests go out
                             as samples finish (RolloutStream, rollout_stream.py: `run` takes each
                             step's groups from it); a step where more than algorithm.max_failed_fraction
                             of the samples failed fails the run here (sample_failures.py)
    2. log-probs and values  reference, old policy and critic, concurrently
    3. advantages            KL in the reward (optional), then the estimator (rlfabric.algorithms)
    4. updates               critic and actor, concurrently
    5. weight sync           actor -> every rollout replica
    then metrics, validation and checkpoints on schedule (`run`).

Modes: `sync` generates each step's batch with the weights trained so far (on-policy). `async`
keeps generating for up to trainer.max_staleness steps ahead while the trainer trains; weight syncs
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

The end of a run keeps the policy: a checkpoint of the last step and RUN_DIR/final_model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from rlfabric import algorithms as algos
from rlfabric.coordinator.checkpoints import (
    CheckpointError,
    CheckpointWriter,
    CoordinatorState,
    latest_checkpoint,
    read_state,
    require_complete,
    require_part_visible,
)
from rlfabric.coordinator.hybrid import HybridEngine, wake_sleeping
from rlfabric.coordinator.multi_turn import agent_metrics
from rlfabric.coordinator.peers import Peers
from rlfabric.coordinator.rollout_batch import (
    RolloutBatch,
    build_rollout_batch,
    token_level_scores,
    write_rollouts,
)
from rlfabric.coordinator.rollout_stream import RolloutStream, TakenGroups
from rlfabric.coordinator.sample_failures import TooManyFailedSamples, check_failed_fraction, failure_of
from rlfabric.coordinator.sample_failures import describe as describe_failures
from rlfabric.coordinator.sampler import Sampler
from rlfabric.coordinator.step_metrics import StepTimer, data_metrics
from rlfabric.coordinator.weight_sync import WeightSync
from rlfabric.core import tracing
from rlfabric.core.config import RunConfig
from rlfabric.core.errors import FailedPrecondition
from rlfabric.core.start_phases import StartPhases
from rlfabric.data.dataset import DataCursor, RLHFDataset

log = logging.getLogger("rlfabric.coordinator")



class PPOTrainer:
    """Drives one run over the services in `peers`. Phase changes and step metrics go to `report`."""

    def __init__(self, config: RunConfig, peers: Peers, tokenizer, run_dir: Path, train_data: RLHFDataset,
                 val_data: RLHFDataset | None, weight_sync: WeightSync,
                 on_phase: Callable[[str], None] = lambda phase: None,
                 on_metrics: Callable[[int, dict[str, float]], None] = lambda step, metrics: None,
                 between_steps: Callable[[], Awaitable[None]] | None = None,
                 start_phases: StartPhases | None = None, actor_mini_batch_rows: int | None = None):
        self.config = config
        self.peers = peers
        self.run_dir = run_dir
        self.train_data = train_data
        self.val_data = val_data
        self.weight_sync = weight_sync
        # trainer.colocated: the rollout sleeps while the trainers work (rlfabric.coordinator.hybrid).
        self.hybrid = HybridEngine(config, peers.rollout) if config.trainer.colocated else None
        self.on_phase = on_phase
        self.on_metrics = on_metrics
        self.between_steps = between_steps
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.step = 0  # steps completed
        self.sampler = Sampler(config, peers)  # generates and scores; holds the weight versions
        self.versions = self.sampler.versions
        self.start_cursor = DataCursor()  # where this run's data starts (a resume: the checkpoint's)
        self.kl_ctrl = self._kl_controller(config)
        self.checkpoint_requested: asyncio.Future | None = None
        # Where a resume continues: the first batch not trained yet (RolloutStream.untrained_cursor: in async
        # mode batches generating ahead are drawn but not trained).
        self.untrained_cursor = DataCursor()
        self.last_checkpoint_step: int | None = None
        self.save_at_end = False  # StopRun asked for a checkpoint: the end of the run saves one in any case
        self.last_step_trace_id = ""  # the last trained step's trace (tracing on), for the metrics' exemplars
        # Rows of one actor optimizer step, as the actor was started: a StartRun may override rollout.n but
        # not the mini-batch of an actor that is already running (RunController passes the mesh's).
        self.actor_mini_batch_rows = actor_mini_batch_rows or config.actor.ppo_mini_batch_size * config.rollout.n
        self._last_step_end: float | None = None  # perf_counter() at the end of the previous step
        self.run_id = run_dir.name
        # The run's start, from StartRun to its first Generate (RunController starts it; prepare and run add to it).
        self.start_phases = start_phases or StartPhases("run", log)
        self._group_opened = False  # prepare() built the weight-sync group
        self._first_sync: dict[str, float] = {}  # the metrics of the run's first sync
        self._initial_saves: list[tuple[object, Path]] = []  # (client, directory) prepare() left to run()
        self._saving: asyncio.Future | None = None  # that save, running beside the first step's generation

    # -- requests from the run's controller, served at the next step boundary ----------------------

    def request_checkpoint(self) -> asyncio.Future:
        """A checkpoint at the next step boundary: the future gets its directory (or the save's error)."""
        if self.checkpoint_requested is None:
            self.checkpoint_requested = asyncio.get_running_loop().create_future()
        return self.checkpoint_requested

    def request_stop(self, save: bool) -> None:
        """The run is being stopped: with `save`, its end keeps a checkpoint and the final model whatever
        trainer.save_final says (two stops: either asking for the save gets it)."""
        self.save_at_end = self.save_at_end or save

    # -- the run ---------------------------------------------------------------------------------

    async def prepare(self, initial_dir: Path) -> int:
        """Puts the actor (and critic) where this run starts and builds the weight-sync group meanwhile;
        returns the step it continues from.

        A resumed run loads its checkpoint (trainer.resume / resume_from_path). A fresh run starts
        from the initial weights: the first run on a mesh saves them into `initial_dir`, and a later
        fresh run on the same (already trained) services loads them back. The save waits: run() makes it
        while the first step generates (nothing changes the trainers' weights before its update), except
        with trainer.colocated, where the trainers keep off the devices while the rollout generates.
        """
        trainer = self.config.trainer
        path = Path(trainer.resume_from_path) if trainer.resume_from_path else (
            latest_checkpoint(self.run_dir) if trainer.resume == "auto" else None)
        self.on_phase("resuming" if path else "starting")
        if path is not None:
            require_complete(path)
        phases = self.start_phases
        # The group's rendezvous waits on the network, the save or load on the trainers' disks: side by side.
        outcomes = await asyncio.gather(
            phases.timed("resume" if path else "initial_weights", self._initial_weights(path, initial_dir)),
            phases.timed("weight_sync_group", self.weight_sync.open()),
            phases.timed("rollout_status", self.peers.rollout.status()), return_exceptions=True)
        self._group_opened = not isinstance(outcomes[1], BaseException)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        self._initial_saves = outcomes[0]
        if self._initial_saves and self.hybrid is not None:
            await phases.timed("initial_save", self._save_initial_weights())
        if path is not None:
            state = read_state(path)
            self.step = state.step
            self.start_cursor = DataCursor(state.data_epoch, state.data_position)
            self.untrained_cursor = self.start_cursor.copy()
            self.last_checkpoint_step = self.step
            self.kl_ctrl.value = state.kl_coef
            log.info("resumed from %s at step %d", path, self.step)
        # Weight versions only grow on a replica: this run's versions start above what they serve now.
        served = [s.weight_version for s in outcomes[2].values() if not isinstance(s, str)]
        self.versions.base = max(served, default=0) + 1 - self.step
        return self.step

    async def _initial_weights(self, path: Path | None, initial_dir: Path) -> list[tuple[object, Path]]:
        """The actor's (and critic's) weights where the run starts: the checkpoint `path`, or the initial ones;
        the (client, directory) of each untrained role whose initial weights are still to be saved."""
        saves = []
        for client in (self.peers.actor, self.peers.critic):
            if client is None:
                continue
            role = client.role
            if path is not None:
                await client.load_checkpoint(str(path / role))
            elif (await client.get_status()).optimizer_step == 0:
                if not (initial_dir / role / "meta.json").exists():
                    saves.append((client, initial_dir / role))
            elif (initial_dir / role / "meta.json").exists():
                await client.load_checkpoint(str(initial_dir / role))
            else:
                raise FailedPrecondition(f"the {role} was trained by an earlier run and its initial weights were "
                                         "not saved: resume that run (trainer.resume_from_path) or restart the mesh")
        return saves

    async def _save_initial_weights(self) -> None:
        """Saves the untrained roles' initial weights (prepare() found them missing), side by side."""
        saves, self._initial_saves = self._initial_saves, []

        async def save(client, directory: Path) -> None:
            await client.save_checkpoint(str(directory))
            # Storage the coordinator and this role do not share fails here, not at the first checkpoint.
            require_part_visible(client.role, directory, self.run_dir)

        await asyncio.gather(*(save(client, directory) for client, directory in saves))

    async def run(self) -> None:
        """Steps until trainer.total_steps (or StopRun), with validation and checkpoints on schedule."""
        trainer = self.config.trainer
        await self._start()
        # What generates (cancelled at the end); it draws the prompts from start_cursor on.
        stream = RolloutStream(self.sampler, self.config, self.train_data, self.start_cursor, first_step=self.step + 1)
        self._finish_start()
        first_step = self.step + 1
        # The initial weights go to disk while the first step generates; its trainers wait for them.
        self._saving = asyncio.ensure_future(self.start_phases.timed("initial_save", self._save_initial_weights())
                                             ) if self._initial_saves else None
        try:
            while self.step < trainer.total_steps:
                await self._between_steps()
                step = self.step + 1
                metrics = await self.train_step(step, stream)
                if step == first_step:
                    metrics.update(self.start_phases.metrics())
                    self._write_run_start()  # again, with the initial save
                self.step = step
                stream.trained(step)  # generation may run one step further ahead
                if trainer.test_freq and (step % trainer.test_freq == 0 or step == trainer.total_steps):
                    metrics.update(await self.validate())
                self.on_metrics(step, metrics)
                self.untrained_cursor = stream.untrained_cursor()
                if self._checkpoint_due(step):
                    await self.save_checkpoint()
        finally:
            stream.close()
            if self._saving is not None:  # the run ended before its first update: the save ends with it
                self._saving.cancel()
                await asyncio.gather(self._saving, return_exceptions=True)
        await self.keep_policy(checkpoint=trainer.save_final or self.save_at_end)

    async def _start(self) -> None:
        """The run's start after StartRun: the group (unless prepare() built it), wake, the first sync."""
        phases = self.start_phases
        if not self._group_opened:
            await phases.timed("weight_sync_group", self.weight_sync.open())
        await phases.timed("wake", wake_sleeping(self.peers.rollout))  # replicas an earlier run left asleep
        # Every replica starts from the weights this run starts from (fresh, reset or resumed).
        with phases.phase("first_sync"):
            self._first_sync = await self._sync_weights(self.versions.after(self.step))
        if self.config.trainer.val_before_train and self.step == 0:
            with phases.phase("validate"):
                self.on_metrics(0, await self.validate())

    @staticmethod
    async def _initial_save_done(saving: asyncio.Future, timer: StepTimer) -> None:
        """The first step's trainers wait for the initial save (timing_s/initial_save: how long)."""
        try:
            with timer("initial_save"):
                await saving
        except BaseException as error:
            timer.end(error)
            raise

    def _finish_start(self) -> None:
        """The first Generate goes out next: the start's total, logged and in RUN_DIR/run_start.json."""
        self.start_phases.finish()
        self._write_run_start()

    def _write_run_start(self) -> None:
        """RUN_DIR/run_start.json: the start's phases (one that began after the total ran beside the first step)."""
        sync = self._first_sync
        try:
            self.start_phases.write(self.run_dir / "run_start.json", run_id=self.run_id, start_step=self.step,
                                    weight_transfer_s=sync.get("weight_sync/seconds", 0.0),
                                    weight_gbytes=sync.get("weight_sync/gbytes", 0.0))
        except OSError as error:  # a record of timings is no reason to fail the run
            log.warning("could not write run_start.json: %s", error)

    async def keep_policy(self, checkpoint: bool) -> None:
        """The end of a run (completed, or stopped with a save): a checkpoint of the last step unless
        one was just written, and the policy as a Hugging Face directory in RUN_DIR/final_model
        (trainer.export_final)."""
        trainer = self.config.trainer
        if self.step == 0:
            return
        if checkpoint and self.last_checkpoint_step != self.step:
            await self.save_checkpoint()
        if trainer.export_final:
            self.on_phase("exporting")
            await self.peers.actor.export_hf(str(self.final_model_dir()))
            log.info("final policy exported to %s", self.final_model_dir())

    def final_model_dir(self) -> Path:
        return self.run_dir / "final_model"

    async def train_step(self, step: int, stream: RolloutStream) -> dict[str, float]:
        """One whole PPO step: its batch from the stream (phase 1), then phases 2 to 5 on it; its metrics."""
        timer = StepTimer(step)  # and the step's trace: its root span starts with generation
        batch, rollout_metrics = await self.generated(step, stream, timer)
        if self._saving is not None:  # the first step's trainers wait for the initial save
            await self._initial_save_done(self._saving, timer)
            self._saving = None
        metrics = await self.train_on(step, batch, timer)
        metrics.update(rollout_metrics)
        return metrics

    async def generated(self, step: int, stream: RolloutStream, timer: StepTimer,
                        ) -> tuple[RolloutBatch, dict[str, float]]:
        """1. Generate and score (timing_s/gen: the wait for the step's groups; timing_s/gen_overlapped:
        their generation that ran while earlier steps trained): the step's batch and the stream's metrics."""
        self.on_phase("generating")
        try:
            taken = await stream.take(step, timer)
            batch = self._scored_batch(step, taken)
            self._check_failed_fraction(step, batch)
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
        """Phases 2 to 5 of one PPO step on a generated and scored batch; its metrics (timings under `timer`)."""
        metrics: dict[str, float] = {}
        try:
            # 2. Log-probs and values (timing_s/old_log_prob, timing_s/ref, timing_s/values).
            self.on_phase("computing")
            await self._log_probs_and_values(batch, timer)
            # 3. Advantages (timing_s/adv).
            with timer("adv"):
                metrics.update(self._advantages(batch))
                metrics.update(self._rollout_correction(batch))
            # 4. Critic and actor updates (timing_s/update).
            self.on_phase("updating")
            with timer("update"):
                metrics.update(await self._updates(step, batch))
            # 5. Weight sync (timing_s/update_weights). Generation running ahead (async mode) goes on:
            #    the samples in flight switch to the new weights.
            self.on_phase("syncing")
            with timer("update_weights"):
                if self.hybrid is not None:  # VeRL's order: the weights wake, take the sync, then the KV cache
                    await self.hybrid.wake_weights()
                metrics.update(await self._sync_weights(self.versions.after(step)))
                if self.hybrid is not None:
                    await self.hybrid.wake_kv_cache()
                    metrics.update(self.hybrid.metrics())
        except BaseException as error:
            timer.end(error)
            raise
        metrics.update(data_metrics(batch, self.sampler.max_tokens()))
        metrics.update(agent_metrics(batch.samples))
        metrics.update(timer.metrics(batch, previous_step_end=self._last_step_end))
        self.last_step_trace_id = timer.trace_id
        self._last_step_end = time.perf_counter()
        if self.config.trainer.dump_rollouts:
            write_rollouts(self.run_dir, step, batch, self.config.trainer.dump_rollout_tokens)
        return metrics

    # -- the phases of a step ---------------------------------------------------------------------

    async def _log_probs_and_values(self, batch: RolloutBatch, timer: StepTimer) -> None:
        """batch.old_log_probs, ref_log_probs and values: three services at once, each timed on its own.
        When the update is one optimizer step, the "old" policy is the one being updated: the actor takes
        its own log-probs in that step, and the separate forward pass is skipped (_old_log_prob_forward);
        with algorithm.old_log_prob_source=rollout they are the rollout's."""
        peers, temperature, tensors = self.peers, self.config.rollout.temperature or 1.0, batch.tensors
        calls = {}
        if self._old_log_prob_forward():
            calls["old_log_prob"] = peers.actor.compute_log_probs(tensors, temperature, compute_entropy=False)
        if peers.reference is not None:
            calls["ref"] = peers.reference.compute_log_probs(tensors, temperature)
        if peers.critic is not None:
            calls["values"] = peers.critic.compute_values(tensors)
        answers = await asyncio.gather(*(timer.timed(phase, call) for phase, call in calls.items()))
        results = dict(zip(calls, answers, strict=True))
        batch.old_log_probs = results["old_log_prob"]["log_probs"] if "old_log_prob" in results else None
        if self.config.algorithm.old_log_prob_source == "rollout":
            if batch.rollout_log_probs is None:
                raise FailedPrecondition("algorithm.old_log_prob_source=rollout needs the rollout's log-probs, and a "
                                         "sample of this step came back without them (rollout.engine "
                                         f"{self.config.rollout.engine}): use old_log_prob_source auto")
            batch.old_log_probs = batch.rollout_log_probs
        batch.ref_log_probs = results["ref"]["log_probs"] if "ref" in results else None
        batch.values = results["values"]["values"] if "values" in results else None

    def _advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """batch.token_rewards (KL-penalised if configured), advantages, returns and train_mask. A sample
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
        estimator = algos.get_advantage_estimator(algorithm.adv_estimator)
        batch.advantages, batch.returns = estimator(
            token_rewards=token_rewards, mask=train_mask, values=batch.values, group_ids=group_ids,
            baselines=batch.baselines, gamma=algorithm.gamma, lam=algorithm.lam,
            norm_by_std=algorithm.norm_adv_by_std_in_grpo)
        batch.token_rewards, batch.train_mask = token_rewards, train_mask
        return metrics

    def _rollout_correction(self, batch: RolloutBatch) -> dict[str, float]:
        """rollout_corr/* metrics whenever the step has the rollout's log-probs and separate old ones, and
        with algorithm.rollout_correction on: batch.rollout_is_weights and rejected tokens out of
        batch.train_mask; perf/old_log_prob_forward: 1 when the old-log-prob forward pass ran."""
        forward = float(self._old_log_prob_forward())
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
        updates = [self.peers.actor.update_policy(policy_batch, global_step=step)]
        if self.peers.critic is not None:
            updates.append(self.peers.critic.update_values(
                {**tensors, "values": batch.values, "returns": batch.returns}, global_step=step))
        metrics: dict[str, float] = {}
        for update_metrics in await asyncio.gather(*updates):
            metrics.update(update_metrics)
        return metrics

    # -- generation and scoring -----------------------------------------------------------------

    def _scored_batch(self, step: int, taken: TakenGroups) -> RolloutBatch:
        """The step's groups as a RolloutBatch with their scores; failed samples logged, counted by reason."""
        batch = build_rollout_batch(taken.rows, taken.samples, self.config.rollout.n, self.pad_token_id)
        results = [taken.results[(s.prompt_index, s.sample_index)] for s in batch.samples]
        batch.scores = torch.tensor([result.score for result in results])
        batch.score_failed = torch.tensor([not result.ok for result in results])
        batch.failures = [failure_of(result) for result in results]
        failed = describe_failures(step, batch.failures)
        if failed:
            kept = "trained on with score 0" if self.config.algorithm.score_failure == "zero" else "left out of training"
            log.warning("%s (%s)", failed, kept)
        return batch

    def _check_failed_fraction(self, step: int, batch: RolloutBatch) -> None:
        """Fails the step (and the run) when more than algorithm.max_failed_fraction of its samples failed;
        with trainer.dump_rollouts its samples and their failures are written first."""
        try:
            check_failed_fraction(step, batch.failures, self.config.algorithm.max_failed_fraction)
        except TooManyFailedSamples:
            if self.config.trainer.dump_rollouts:
                write_rollouts(self.run_dir, step, batch, self.config.trainer.dump_rollout_tokens)
            raise

    # -- validation, weights, checkpoints ------------------------------------------------------------

    async def validate(self) -> dict[str, float]:
        """Mean score on data.val_files (Sampler.validate); {} without them."""
        if self.val_data is None:
            return {}
        self.on_phase("validating")
        return await self.sampler.validate(self.val_data.rows)

    async def _sync_weights(self, version: int) -> dict[str, float]:
        """Actor -> every live rollout replica. A replica that misses a sync leaves the router until a
        later sync reaches it (the weight sync does that, WeightSync.serve_synced; the plane takes
        restarted replicas back into the group), so no request is ever served by stale weights."""
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
                **report.phase_metrics()}

    def _checkpoint_due(self, step: int) -> bool:
        trainer = self.config.trainer
        if self.checkpoint_requested is not None:
            return True
        last = step == trainer.total_steps
        return (last and trainer.save_final) or bool(trainer.save_freq) and (step % trainer.save_freq == 0 or last)

    async def save_checkpoint(self) -> Path:
        """RUN_DIR/checkpoints/global_step_<step>, written atomically (see checkpoints.py); a resume from
        it continues with the first batch not trained yet."""
        self.on_phase("checkpointing")
        cursor = self.untrained_cursor
        writer = CheckpointWriter(self.run_dir, keep=self.config.trainer.max_checkpoints_to_keep)
        tmp = writer.begin(self.step)
        try:
            saves = [self.peers.actor.save_checkpoint(str(tmp / "actor"))]
            if self.peers.critic is not None:
                saves.append(self.peers.critic.save_checkpoint(str(tmp / "critic")))
            await asyncio.gather(*saves)
            state = CoordinatorState(step=self.step, data_epoch=cursor.epoch, data_position=cursor.position,
                                     kl_coef=self.kl_ctrl.value, weight_version=self.versions.served,
                                     run_id=self.run_id, parts=["actor"] + ["critic"] * (self.peers.critic is not None))
            path = await asyncio.to_thread(writer.commit, state)  # fsyncs: off the event loop
        except BaseException as error:
            writer.abort()
            failure = error
            if isinstance(error, Exception) and not isinstance(error, CheckpointError):
                # e.g. the actor's disk is full: say which checkpoint failed and what a resume will use.
                previous = latest_checkpoint(self.run_dir)
                failure = CheckpointError(
                    f"saving the checkpoint of step {self.step} failed; "
                    f"{f'{previous} stays the resume point' if previous else 'there is no earlier checkpoint'}: "
                    f"{type(error).__name__}: {error}")
            if self.checkpoint_requested is not None and not self.checkpoint_requested.done():
                self.checkpoint_requested.set_exception(failure)
                self.checkpoint_requested = None
            if failure is not error:
                raise failure from error
            raise
        self.last_checkpoint_step = self.step
        log.info("checkpoint %s written", path)
        if self.checkpoint_requested is not None and not self.checkpoint_requested.done():
            self.checkpoint_requested.set_result(path)
        self.checkpoint_requested = None
        return path

    # -- helpers -----------------------------------------------------------------------------------

    async def _between_steps(self) -> None:
        """Run control (pause, stop) gets its turn between steps."""
        if self.between_steps is not None:
            await self.between_steps()

    def _old_log_prob_forward(self) -> bool:
        """Whether the old log-probs take a separate actor forward pass (algorithm.old_log_prob_source).
        auto skips it when the actor's update is a single optimizer step (one mini-batch, one epoch) and
        nothing reads them before it: no KL in the reward, no rollout correction."""
        config, algorithm = self.config, self.config.algorithm
        if algorithm.old_log_prob_source != "auto":
            return algorithm.old_log_prob_source == "actor"
        rows = config.data.train_batch_size * config.rollout.n
        one_step = config.actor.ppo_epochs == 1 and rows <= self.actor_mini_batch_rows
        return not one_step or algorithm.use_kl_in_reward or algorithm.rollout_correction.enabled()

    @property
    def weight_version(self) -> int:
        """The version the rollout serves."""
        return self.versions.served

    @staticmethod
    def _kl_controller(config: RunConfig):
        algorithm = config.algorithm
        if algorithm.kl_ctrl_type == "adaptive":
            return algos.AdaptiveKLController(algorithm.kl_coef, algorithm.kl_target, algorithm.kl_horizon)
        return algos.FixedKLController(algorithm.kl_coef)


def leave_out(failed: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(response mask [B, T], group ids [B]) with the rows where `failed` [B] is true left out of training:
    their mask is 0, so no loss sees them, and each is a group of its own, so no group baseline counts them."""
    if not failed.any():
        return mask, group_ids
    mask = mask.masked_fill(failed.unsqueeze(-1), 0)
    group_ids = group_ids.clone()
    group_ids[failed] = int(group_ids.max()) + 1 + torch.arange(int(failed.sum()))
    return mask, group_ids
