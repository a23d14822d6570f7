"""RunController: the coordinator's engine. It owns the run (one at a time, a PPODriver, driver.py) and the
task that drives it, and answers run control (start, status, metrics, pause/resume, stop, checkpoints); the
CoordinatorService servicer (servicer.py) is its thin gRPC face. It keeps the run's state (phase, metrics,
outcome) itself: the driver reports to it through the RunHooks it implements."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from pathlib import Path

from prometheus_client import CollectorRegistry

from rlfabric.algorithms.plugins import load_plugin_modules
from rlfabric.coordinator.checkpoints import final_model_dir
from rlfabric.coordinator.driver import PPODriver, RunStopped
from rlfabric.coordinator.membership import RolloutMembership
from rlfabric.coordinator.overrides import check_roles, config_for_run
from rlfabric.coordinator.setup import Connect, PolicyTokenizer, connect_services, open_run
from rlfabric.coordinator.trackers import check_tracker_packages
from rlfabric.coordinator.tracking import RunTracker
from rlfabric.core.config import ConfigError, RunConfig, run_dir_of
from rlfabric.core.errors import FailedPrecondition
from rlfabric.core.start_phases import StartPhases
from rlfabric.v1 import coordinator_pb2

log = logging.getLogger("rlfabric.coordinator")

ACTIVE = (coordinator_pb2.RUN_STATE_RUNNING, coordinator_pb2.RUN_STATE_PAUSED)


class RunController:
    """One run at a time: drives it in a task, reports its state, relays run control; the run's RunHooks.
    Each run's connections come from `connect` (default: the services of config.cluster over gRPC)."""

    def __init__(self, config: RunConfig, registry: CollectorRegistry | None = None,
                 connect: Connect = connect_services):
        load_plugin_modules(config.algorithm.plugin_modules)  # the operator's config, at start: see overrides.py
        self.base_config = config
        self.connect = connect
        self.policy = PolicyTokenizer(config)  # model.path is the mesh's: one check and tokenizer for every run
        self.membership = RolloutMembership(config)  # replicas that join and leave: the mesh's, across runs
        self.registry = registry or CollectorRegistry()
        self.run_id = ""
        self.state = coordinator_pb2.RUN_STATE_UNSPECIFIED
        self.phase = "idle"
        self.error = ""
        self.total_steps = 0
        self.driver: PPODriver | None = None
        self.run_dir: Path | None = None
        self.history: list[tuple[int, dict[str, float], float]] = []
        self._changed = asyncio.Condition()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._task: asyncio.Task | None = None
        self._tracker = None
        self._starting = False  # a StartRun is building its run (the awaits before state RUNNING)

    # -- engine protocol (the server calls these) -------------------------------------------------

    async def start(self) -> None:
        """Checks the policy model and loads its tokenizer (on a thread, as the other services load their
        models before they are ready), so that a StartRun finds them ready. A model that cannot be used
        does not stop the coordinator: StartRun tries again and answers why. rollout.discovery starts here."""
        await self.membership.start()
        await self.policy.preload()

    async def stop(self) -> None:
        """Server shutdown: stop the loop where it is (the last checkpoint stays the resume point)."""
        await self.membership.close()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # -- run control --------------------------------------------------------------------------------

    async def start_run(self, overrides: list[str]) -> tuple[str, int]:
        """Builds the run (config, data, connections), resumes if a checkpoint says so, starts the loop."""
        # Checked and claimed with no await in between: a second StartRun sees the first one at once.
        if self._starting:
            raise FailedPrecondition("another StartRun is starting a run on this mesh; one run at a time")
        if self.state in ACTIVE:
            raise FailedPrecondition(f"run {self.run_id} is {coordinator_pb2.RunState.Name(self.state)}; one run "
                                     "at a time: StopRun it first")
        self._starting = True
        try:
            return await self._start_run(overrides)
        finally:
            self._starting = False

    async def _start_run(self, overrides: list[str]) -> tuple[str, int]:
        # Every phase from here to the first Generate logs its seconds (the driver's run() ends the start).
        phases = StartPhases("run", log)
        with phases.phase("config"):
            config = config_for_run(self.base_config, overrides)  # what a StartRun may change: overrides.py
            check_roles(config)
            try:
                check_tracker_packages(config.trainer.loggers)
            except ConfigError as error:  # the coordinator's environment lacks it, not the request
                raise FailedPrecondition(str(error)) from None
        # The actor was started with the mesh's config: its mini-batch (in rows) does not follow a StartRun
        # override of rollout.n.
        base, run_dir = self.base_config, run_dir_of(config)
        async with contextlib.AsyncExitStack() as stack:
            driver = await stack.enter_async_context(open_run(
                config, self, self.connect, phases, self.policy,
                actor_mini_batch_rows=base.actor.ppo_mini_batch_size * base.rollout.n, registry=self.registry,
                membership=self.membership))
            start_step = await driver.prepare(run_dir_of(base) / "initial_weights")
            with phases.phase("trackers"):
                tracker = RunTracker(run_dir, config, self.registry, total_steps=config.trainer.total_steps,
                                     start_step=start_step)
            connections = stack.pop_all()  # the run is built: its task closes them when it ends (_run)
        self.driver, self.run_dir, self._tracker = driver, run_dir, tracker
        self.run_id = run_dir.name or uuid.uuid4().hex[:12]
        self.total_steps = config.trainer.total_steps
        self.history = []
        self.error = ""
        self._resumed.set()
        self.state = coordinator_pb2.RUN_STATE_RUNNING
        self._task = asyncio.create_task(self._run(driver, connections), name=f"run-{self.run_id}")
        log.info("run %s started at step %d of %d", self.run_id, start_step, self.total_steps)
        return self.run_id, start_step

    def status(self) -> coordinator_pb2.CoordinatorServiceGetRunStatusResponse:
        driver = self.driver
        return coordinator_pb2.CoordinatorServiceGetRunStatusResponse(
            run_id=self.run_id, state=self.state, step=driver.step if driver else 0,
            total_steps=self.total_steps, phase=self.phase,
            last_metrics=self.history[-1][1] if self.history else {},
            weight_version=driver.weight_version if driver else 0, error=self.error)

    async def metrics_since(self, from_step: int):
        """Every recorded step >= from_step, then each new one, until the run ends."""
        sent = 0
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda seen=sent: len(self.history) > seen or self.state not in ACTIVE)
                fresh = self.history[sent:]
                sent = len(self.history)
                finished = self.state not in ACTIVE
            for step, metrics, timestamp in fresh:
                if step >= from_step:
                    yield step, metrics, timestamp
            if finished and sent == len(self.history):
                return

    def pause(self) -> None:
        self._require_active()
        self._resumed.clear()

    def resume(self) -> None:
        self._require_active()
        self._resumed.set()

    async def stop_run(self, save_checkpoint: bool) -> None:
        """Ends the run at the next step boundary, after a checkpoint and the final-model export unless
        save_checkpoint is false; returns once it has ended, with an error if the save failed."""
        self._require_active()
        # Two StopRuns: either asking for the checkpoint gets it (nothing trained is dropped silently).
        self.driver.request_stop(save_checkpoint)  # a stop during the last step ends it with the save too
        self._resumed.set()  # a paused run goes on to its step boundary, where it stops
        # wait(), not gather(): a StopRun that is cancelled (deadline, client gone) must not cancel the run
        # (and its checkpoint) with it.
        await asyncio.wait({self._task})
        if self.state == coordinator_pb2.RUN_STATE_FAILED:
            raise FailedPrecondition(f"the run failed while stopping: {self.error}")

    def register_rollout_replica(self, address: str) -> None:
        """A rollout replica joins: the run (this one, or the next) takes it in at its next weight sync."""
        self.membership.register(address)

    def deregister_rollout_replica(self, address: str) -> None:
        """A rollout replica leaves: the run lets go of it at its next weight sync."""
        self.membership.deregister(address)

    async def save_checkpoint(self) -> tuple[Path, int]:
        """A checkpoint now (idle run) or at the next step boundary (running run)."""
        driver = self.driver
        if driver is None:
            raise FailedPrecondition("no run has been started")
        if self.state in ACTIVE:
            path = await asyncio.shield(driver.request_checkpoint())
        else:
            path = await driver.save_checkpoint()
        return path, driver.step

    # -- inside the run -------------------------------------------------------------------------------

    async def _run(self, driver: PPODriver, connections: contextlib.AsyncExitStack) -> None:
        try:
            async with connections:  # the run's (setup.open_run): closed once it has ended
                await self._drive(driver)
        finally:
            async with self._changed:
                self._changed.notify_all()

    async def _drive(self, driver: PPODriver) -> None:
        try:
            await driver.run()
            self.state, self.phase = coordinator_pb2.RUN_STATE_COMPLETED, "finished"
        except RunStopped:
            self.state, self.phase = coordinator_pb2.RUN_STATE_STOPPED, "stopped"
        except asyncio.CancelledError:
            self.state, self.phase = coordinator_pb2.RUN_STATE_STOPPED, "stopped"
            raise
        except Exception as error:  # the run fails; the service keeps answering
            log.exception("run %s failed", self.run_id)
            where = f"while {self.phase} after step {driver.step}"  # e.g. "while computing after step 2"
            self.state, self.phase = coordinator_pb2.RUN_STATE_FAILED, "failed"
            self.error = f"{type(error).__name__} {where}: {error}"
        finally:
            ended = coordinator_pb2.RunState.Name(self.state)
            driver.ended(f"the run ended ({ended}) before the requested checkpoint was taken"
                         f"{': ' + self.error if self.error else ''}")
            if self._tracker is not None:
                outcome = {coordinator_pb2.RUN_STATE_COMPLETED: "completed",
                           coordinator_pb2.RUN_STATE_FAILED: "failed"}.get(self.state, "stopped")
                self._tracker.close(final_model=final_model_dir(self.run_dir), outcome=outcome)

    # -- the run's hooks (RunHooks: the driver calls these) ------------------------------------------

    def on_phase(self, phase: str) -> None:
        self.phase = phase

    def on_metrics(self, step: int, metrics: dict[str, float], trace_id: str) -> None:
        self.history.append((step, dict(metrics), time.time()))
        if self._tracker is not None:
            self._tracker.log(step, metrics, trace_id)
        asyncio.get_running_loop().create_task(self._notify())

    async def between_steps(self) -> None:
        """Run control at a step boundary: a pause waits here (a stop ends the run in the driver)."""
        if not self._resumed.is_set():
            self.on_phase("paused")
            self.state = coordinator_pb2.RUN_STATE_PAUSED
            await self._resumed.wait()
            self.state = coordinator_pb2.RUN_STATE_RUNNING

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _require_active(self) -> None:
        if self.state not in ACTIVE:
            raise FailedPrecondition(f"no run is in progress (state {coordinator_pb2.RunState.Name(self.state)})")

