"""The run: PPODriver takes one run from its start to its end, a step at a time (StepRunner, loop.py).

    driver = PPODriver(config, peers, tokenizer, run_dir, train_data, val_data, weight_sync, hooks)
    start_step = await driver.prepare(initial_dir)   # the actor (and critic) where the run starts
    await driver.run()                               # steps until trainer.total_steps, or RunStopped

`run` starts the run (the weight-sync group, wake, the first sync, validation before training), then steps
until trainer.total_steps; after each step come the metrics, validation and checkpoints on schedule, and
run control's turn at the boundary (pause, stop: RunHooks.between_steps, request_stop). The end of a run
keeps the policy: a checkpoint of the last step and RUN_DIR/final_model.

The driver reports to its RunHooks (RunController): the phase it is in, each step's metrics. A checkpoint a
SaveCheckpoint asks for (request_checkpoint) is taken at the next step boundary; its answer is given in one
place, _answer_checkpoint_request, when it is written, when it fails, or when the run ends first (`ended`).
The driver does not close its connections: whoever built them does (setup.open_run).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rlfabric.coordinator.checkpoints import (
    CoordinatorState,
    final_model_dir,
    latest_checkpoint,
    read_state,
    require_complete,
    require_part_visible,
    step_dir,
    write_checkpoint,
)
from rlfabric.coordinator.hybrid import wake_sleeping
from rlfabric.coordinator.loop import StepRunner
from rlfabric.coordinator.membership import RolloutMembership
from rlfabric.coordinator.peers import Peers
from rlfabric.coordinator.rollout_stream import RolloutStream
from rlfabric.coordinator.sampler import Sampler
from rlfabric.coordinator.weight_sync import WeightSync
from rlfabric.core.config import RunConfig
from rlfabric.core.errors import FailedPrecondition
from rlfabric.core.start_phases import StartPhases
from rlfabric.data.dataset import DataCursor, RLHFDataset

if TYPE_CHECKING:
    from rlfabric.coordinator.agent_episodes import AgentEpisodes
    from rlfabric.gateway.server import Gateway

log = logging.getLogger("rlfabric.coordinator")


class RunHooks(Protocol):
    """What a run tells whoever runs it (RunController), and where run control gets its turn."""

    def on_phase(self, phase: str) -> None:
        """The run is now `phase` (starting, generating, computing, checkpointing, ...)."""

    def on_metrics(self, step: int, metrics: dict[str, float], trace_id: str) -> None:
        """Step `step`'s metrics (step 0: validation before training); trace_id: its trace, "" without."""

    async def between_steps(self) -> None:
        """Run control's turn at a step boundary: a pause waits here."""


class NoHooks:
    """The hooks of a run nobody controls (tests, benches): nothing is reported, nothing waits."""

    def on_phase(self, phase: str) -> None:
        pass

    def on_metrics(self, step: int, metrics: dict[str, float], trace_id: str) -> None:
        pass

    async def between_steps(self) -> None:
        pass


class RunStopped(Exception):
    """StopRun ended the run at a step boundary."""


class PPODriver:
    """Drives one run over the services in `peers`; phase changes and step metrics go to `hooks`."""

    def __init__(self, config: RunConfig, peers: Peers, tokenizer, run_dir: Path, train_data: RLHFDataset,
                 val_data: RLHFDataset | None, weight_sync: WeightSync, hooks: RunHooks | None = None,
                 start_phases: StartPhases | None = None, actor_mini_batch_rows: int | None = None,
                 gateway: Gateway | None = None, agents: AgentEpisodes | None = None,
                 membership: RolloutMembership | None = None):
        self.config = config
        self.gateway = gateway  # agent.gateway: the OpenAI endpoint agent episodes call (None when off)
        self.agents = agents  # agent.entrypoint: the agent's episodes are the samples (None: the rollout's)
        self.peers = peers
        self.run_dir = run_dir
        self.run_id = run_dir.name
        self.train_data = train_data
        self.val_data = val_data
        self.weight_sync = weight_sync
        self.hooks = hooks or NoHooks()
        self.sampler = Sampler(config, peers, agents=agents)  # generates and scores; holds the weight versions
        self.versions = self.sampler.versions
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.steps = StepRunner(config, peers, self.sampler, weight_sync, pad_token_id, run_dir,
                                on_phase=self.hooks.on_phase, actor_mini_batch_rows=actor_mini_batch_rows,
                                membership=membership)
        self.step = 0  # steps completed
        self.start_cursor = DataCursor()  # where this run's data starts (a resume: the checkpoint's)
        # Where a resume continues: the first batch not trained yet (RolloutStream.untrained_cursor: in async
        # mode batches generating ahead are drawn but not trained).
        self.untrained_cursor = DataCursor()
        self.last_checkpoint_step: int | None = None
        # The run's start, from StartRun to its first Generate (RunController starts it; prepare and run add to it).
        self.start_phases = start_phases or StartPhases("run", log)
        self._checkpoint_request: asyncio.Future | None = None  # a SaveCheckpoint waiting for a step boundary
        self._stop_requested = False
        self._save_at_end = False  # StopRun asked for a checkpoint: the end of the run saves one in any case
        self._group_opened = False  # prepare() built the weight-sync group
        self._first_sync: dict[str, float] = {}  # the metrics of the run's first sync
        self._initial_saves: list[tuple[object, Path]] = []  # (client, directory) prepare() left to run()
        self._saving: asyncio.Future | None = None  # that save, running beside the first step's generation

    @property
    def weight_version(self) -> int:
        """The version the rollout serves."""
        return self.versions.served

    # -- requests from run control, served at the next step boundary --------------------------------

    def request_checkpoint(self) -> asyncio.Future:
        """A checkpoint at the next step boundary: the future gets its directory (or the save's error)."""
        if self._checkpoint_request is None:
            self._checkpoint_request = asyncio.get_running_loop().create_future()
        return self._checkpoint_request

    def request_stop(self, save: bool) -> None:
        """Ends the run at the next step boundary (RunStopped): with `save`, after a checkpoint and the final
        model whatever trainer.save_final says (two stops: either asking for the save gets it). A stop during
        the last step lets it complete, with the save too."""
        self._stop_requested = True
        self._save_at_end = self._save_at_end or save

    def ended(self, why: str) -> None:
        """The run is over: a SaveCheckpoint still waiting for a step boundary gets its answer, the end's own
        checkpoint when it holds the last step (it has it all), else FailedPrecondition(why)."""
        if self.step and self.last_checkpoint_step == self.step:
            self._answer_checkpoint_request(step_dir(self.run_dir, self.step))
        else:
            self._answer_checkpoint_request(FailedPrecondition(why))

    # -- the start ----------------------------------------------------------------------------------

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
        self.hooks.on_phase("resuming" if path else "starting")
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
        if self._initial_saves and trainer.colocated:
            await phases.timed("initial_save", self._save_initial_weights())
        if path is not None:
            state = read_state(path)
            self.step = state.step
            self.start_cursor = DataCursor(state.data_epoch, state.data_position)
            self.untrained_cursor = self.start_cursor.copy()
            self.last_checkpoint_step = self.step
            self.steps.kl_ctrl.value = state.kl_coef
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

    async def _start(self) -> None:
        """The run's start after StartRun: the group (unless prepare() built it), wake, the first sync."""
        phases = self.start_phases
        if not self._group_opened:
            await phases.timed("weight_sync_group", self.weight_sync.open())
        await phases.timed("wake", wake_sleeping(self.peers.rollout))  # replicas an earlier run left asleep
        # Every replica starts from the weights this run starts from (fresh, reset or resumed).
        with phases.phase("first_sync"):
            self._first_sync = await self.steps.sync_weights(self.versions.after(self.step))
        if self.config.trainer.val_before_train and self.step == 0:
            with phases.phase("validate"):
                self.hooks.on_metrics(0, {**await self._validate(), **self._agent_metrics()}, "")

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

    # -- the run ------------------------------------------------------------------------------------

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
                metrics = await self.steps.train_step(step, stream, initial_save=self._saving)
                self._saving = None  # saved: only the first step waits for it
                if step == first_step:
                    metrics.update(self.start_phases.metrics())
                    self._write_run_start()  # again, with the initial save
                self.step = step
                stream.trained(step)  # generation may run one step further ahead
                if trainer.test_freq and (step % trainer.test_freq == 0 or step == trainer.total_steps):
                    metrics.update(await self._validate())
                metrics.update(self._agent_metrics())
                self.hooks.on_metrics(step, metrics, self.steps.last_trace_id)
                self.untrained_cursor = stream.untrained_cursor()
                if self._checkpoint_due(step):
                    await self.save_checkpoint()
        finally:
            stream.close()
            if self._saving is not None:  # the run ended before its first update: the save ends with it
                self._saving.cancel()
                await asyncio.gather(self._saving, return_exceptions=True)
        await self.keep_policy(checkpoint=trainer.save_final or self._save_at_end)

    def _agent_metrics(self) -> dict[str, float]:
        """agent/*: the gateway's calls and the agent's episodes since the last report (validation's included)."""
        metrics = self.gateway.calls.take_metrics() if self.gateway is not None else {}
        return metrics | (self.agents.take_metrics() if self.agents is not None else {})

    async def _between_steps(self) -> None:
        """Run control's turn: a pause waits in the hooks; a stop ends the run here (RunStopped), after
        keeping the policy when the stop asked for a save."""
        await self.hooks.between_steps()
        if self._stop_requested:
            if self._save_at_end:
                await self.keep_policy(checkpoint=True)
            raise RunStopped()

    async def _validate(self) -> dict[str, float]:
        """Mean score on data.val_files (Sampler.validate); {} without them."""
        if self.val_data is None:
            return {}
        self.hooks.on_phase("validating")
        return await self.sampler.validate(self.val_data.rows)

    async def keep_policy(self, checkpoint: bool) -> None:
        """The end of a run (completed, or stopped with a save): a checkpoint of the last step unless
        one was just written, and the policy as a Hugging Face directory in RUN_DIR/final_model
        (trainer.export_final)."""
        if self.step == 0:
            return
        if checkpoint and self.last_checkpoint_step != self.step:
            await self.save_checkpoint()
        if self.config.trainer.export_final:
            self.hooks.on_phase("exporting")
            await self.peers.actor.export_hf(str(final_model_dir(self.run_dir)))
            log.info("final policy exported to %s", final_model_dir(self.run_dir))

    # -- checkpoints --------------------------------------------------------------------------------

    def _checkpoint_due(self, step: int) -> bool:
        trainer = self.config.trainer
        if self._checkpoint_request is not None:
            return True
        last = step == trainer.total_steps
        return (last and trainer.save_final) or bool(trainer.save_freq) and (step % trainer.save_freq == 0 or last)

    async def save_checkpoint(self) -> Path:
        """RUN_DIR/checkpoints/global_step_<step>, written atomically (checkpoints.write_checkpoint); a resume
        from it continues with the first batch not trained yet. A SaveCheckpoint waiting for it gets its
        directory, or the save's error."""
        self.hooks.on_phase("checkpointing")
        cursor = self.untrained_cursor
        parts = {"actor": self.peers.actor} | ({"critic": self.peers.critic} if self.peers.critic is not None else {})
        state = CoordinatorState(step=self.step, data_epoch=cursor.epoch, data_position=cursor.position,
                                 kl_coef=self.steps.kl_ctrl.value, weight_version=self.versions.served,
                                 run_id=self.run_id, parts=list(parts))
        try:
            path = await write_checkpoint(self.run_dir, state, parts, keep=self.config.trainer.max_checkpoints_to_keep)
        except BaseException as error:
            self._answer_checkpoint_request(error)
            raise
        self.last_checkpoint_step = self.step
        log.info("checkpoint %s written", path)
        self._answer_checkpoint_request(path)
        return path

    def _answer_checkpoint_request(self, outcome: Path | BaseException) -> None:
        """The one place a SaveCheckpoint waiting for a step boundary gets its answer: a directory or an error."""
        request, self._checkpoint_request = self._checkpoint_request, None
        if request is None or request.done():
            return
        if isinstance(outcome, BaseException):
            request.set_exception(outcome)
        else:
            request.set_result(outcome)
