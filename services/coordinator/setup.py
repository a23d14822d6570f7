"""Builds a run from its config: tokenizer, datasets, connections and weight sync, around its PPODriver.

    async with open_run(config, hooks) as driver:   # the run's connections close when the block ends
        await driver.prepare(initial_dir)
        await driver.run()

The connections come from a `connect` function (config -> peers and weight sync): connect_services
for services over gRPC (config.cluster's addresses), rlfabric.launch.inprocess.InProcessMesh.connect for
engines in this process. Everything else is built the same way for both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

from prometheus_client import CollectorRegistry

from rlfabric.agents.llm import AgentRunner
from rlfabric.agents.runners import runner_of
from rlfabric.coordinator.agent_episodes import AgentEpisodes
from rlfabric.coordinator.driver import PPODriver, RunHooks
from rlfabric.coordinator.membership import RolloutMembership
from rlfabric.coordinator.peers import Peers
from rlfabric.coordinator.weight_sync import WeightSync, WeightSyncPlane
from rlfabric.core.config import ConfigError, RunConfig, run_dir_of
from rlfabric.core.errors import FailedPrecondition, InvalidArgument
from rlfabric.core.host import load_tokenizer
from rlfabric.core.start_phases import StartPhases
from rlfabric.data.dataset import DatasetError, RLHFDataset
from rlfabric.data.prep import write_arithmetic, write_lookup, write_synthetic
from rlfabric.data.reasoning_gym import write_reasoning_gym
from rlfabric.data.verifiers import write_verifiers
from rlfabric.trainer.models import check_policy_model, check_teacher_tokenizer

log = logging.getLogger("rlfabric.coordinator")


def load_datasets(config: RunConfig, run_dir: Path, tokenizer) -> tuple[RLHFDataset, RLHFDataset | None]:
    """data.train_files / val_files, or data.builtin_task written into RUN_DIR/data."""
    data = config.data
    train_files, val_files = list(data.train_files), list(data.val_files)
    if not train_files:
        out = run_dir / "data" / data.builtin_task
        if data.builtin_task in ("reasoning_gym", "verifiers"):
            try:
                paths = write_reasoning_gym(out, data.reasoning_gym) if data.builtin_task == "reasoning_gym" \
                    else write_verifiers(out, data.verifiers)
            except ConfigError as error:
                raise InvalidArgument(str(error)) from None
        else:
            write = {"arithmetic": write_arithmetic, "lookup": write_lookup}.get(data.builtin_task, write_synthetic)
            paths = write(out)
        train_files, val_files = [str(paths["train"])], val_files or ([str(paths["val"])] if "val" in paths else [])
    try:
        kwargs = dict(tokenizer=tokenizer, max_prompt_length=data.max_prompt_length, truncation=data.truncation,
                      filter_overlong_prompts=data.filter_overlong_prompts)
        train = RLHFDataset(train_files, **kwargs)
        val = RLHFDataset(val_files, **kwargs) if val_files else None
    except DatasetError as error:
        raise InvalidArgument(str(error)) from None
    for name, dataset in (("data.train_files", train), ("data.val_files", val)):
        if dataset is not None and dataset.num_filtered:
            log.warning("%s: %d of the prompts are longer than data.max_prompt_length %d tokens and were left out "
                        "(data.filter_overlong_prompts); %d remain", name, dataset.num_filtered,
                        data.max_prompt_length, len(dataset))
    if data.train_batch_size > len(train):
        raise InvalidArgument(f"data.train_batch_size {data.train_batch_size} > {len(train)} usable training rows")
    return train, val


async def connect_services(config: RunConfig) -> tuple[Peers, WeightSyncPlane]:
    """Clients of the services in config.cluster (all of them ready) and the weight-sync plane over them, its
    transport chosen from the devices the actor and the replicas report."""
    peers = Peers.connect(config)
    try:
        await peers.wait_until_ready(config.client.connect_timeout_s)
        plane = WeightSyncPlane(peers.actor, {address: address for address in peers.rollout.addresses}, config,
                                serving=peers.rollout)
        await plane.choose_transport()  # from the devices they hold; a forced nccl they cannot run fails here
    except BaseException:
        await peers.close()
        raise
    return peers, plane


# config -> (peers, weight sync): a WeightSyncPlane over the services, or rlfabric.launch.inprocess.LocalWeightSync.
Connect = Callable[[RunConfig], Awaitable[tuple[Peers, WeightSync]]]


class PolicyTokenizer:
    """The policy model, checked (check_policy_model), and its tokenizer, loaded once per coordinator:
    model.path is the mesh's (a StartRun cannot change it), so the coordinator's start loads them on a
    thread while the other services load their models, and every run takes them from here. A load that
    failed is tried again at the next StartRun (and fails it, FAILED_PRECONDITION naming the problem)."""

    def __init__(self, config: RunConfig):
        self.path = config.model.path
        self.trust_remote_code = config.model.trust_remote_code
        self.tensorboard = "tensorboard" in config.trainer.loggers
        self._loading: asyncio.Future | None = None

    async def preload(self) -> None:
        """Loads them on a thread; a failure is logged here and raised by the next get()."""
        if self._loading is None and self.path:
            self._loading = asyncio.get_running_loop().run_in_executor(None, self._load)
            self._loading.add_done_callback(_log_preload_failure)
        if self._loading is not None:
            await asyncio.wait([self._loading])

    async def get(self):
        """The tokenizer (FailedPrecondition when the model is unusable); loads it now unless preload() did."""
        loading = self._loading
        if loading is None or (loading.done() and (loading.cancelled() or loading.exception() is not None)):
            self._loading = asyncio.get_running_loop().run_in_executor(None, self._load)
        return await asyncio.shield(self._loading)  # a cancelled StartRun leaves the load to the next one

    def _load(self):
        phases = StartPhases("coordinator", log)
        with phases.phase("model_check"):
            try:
                check_policy_model(self.path, self.trust_remote_code)
            except ValueError as error:
                raise FailedPrecondition(str(error)) from None
        with phases.phase("tokenizer"):
            tokenizer = load_tokenizer(self.path, self.trust_remote_code)
        if self.tensorboard:  # RunTracker's first SummaryWriter: an import of a few seconds, done here
            with phases.phase("tensorboard_import"):
                import torch.utils.tensorboard  # noqa: F401
        return tokenizer


def _log_preload_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("the policy model could not be loaded at the coordinator's start; StartRun tries again: %s",
                    future.exception())


async def _started_gateway(config: RunConfig, tokenizer, peers: Peers, registry: CollectorRegistry | None):
    """The agent gateway in front of the run's rollout router, listening; InvalidArgument naming the key when
    its tool-call format does not read the calls the model's chat template writes."""
    # Imported here: FastAPI and uvicorn take ~0.8 s to import, which a run without agents need not pay.
    from rlfabric.gateway.calls import RouterGenerator
    from rlfabric.gateway.server import Gateway

    try:
        gateway = Gateway(config, tokenizer, RouterGenerator(peers.rollout), registry)
    except ConfigError as error:
        raise InvalidArgument(str(error)) from None
    await gateway.start()
    return gateway


def _check_teacher(config: RunConfig) -> None:
    """algorithm.distill's teacher shares the policy's tokenizer; InvalidArgument naming teacher.model_path if not."""
    try:
        check_teacher_tokenizer(config)
    except ValueError as error:
        raise InvalidArgument(str(error)) from None


def _agent_runner(config: RunConfig) -> AgentRunner:
    """agent.runner's runner; InvalidArgument naming the key when the agent cannot be loaded or found."""
    try:
        return runner_of(config.agent)
    except ConfigError as error:
        raise InvalidArgument(str(error)) from None


@asynccontextmanager
async def open_run(config: RunConfig, hooks: RunHooks, connect: Connect = connect_services,
                   phases: StartPhases | None = None, policy: PolicyTokenizer | None = None,
                   actor_mini_batch_rows: int | None = None,
                   registry: CollectorRegistry | None = None,
                   membership: RolloutMembership | None = None) -> AsyncIterator[PPODriver]:
    """A PPODriver for one run, connected to its services by `connect` (default: over gRPC, to
    config.cluster's addresses); the connections close when the block ends. The tokenizer (`policy`'s,
    loaded at the coordinator's start) and the data (on a thread) are made ready while the connections are
    made (waits on the services); each is a phase of `phases`. With agent.gateway.enable (or an agent to run,
    agent.entrypoint / agent.command) the agent gateway starts here too, over the run's rollout router
    (driver.gateway), and stops when the block ends; an agent's episodes are then the run's samples. `registry`
    (the coordinator's) gets the gateway's Prometheus metrics; `membership`: the rollout replicas that join and
    leave during the run (the coordinator's)."""
    phases = phases or StartPhases("run", log)
    if not config.model.path:
        raise FailedPrecondition("model.path is empty: the coordinator needs the policy's tokenizer")
    run_dir = run_dir_of(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    connecting = asyncio.ensure_future(phases.timed("connect", connect(config)))
    try:
        tokenizer = await phases.timed("tokenizer", (policy or PolicyTokenizer(config)).get())
        if config.uses_teacher():
            await phases.timed("teacher_tokenizer", asyncio.to_thread(_check_teacher, config))
        with phases.phase("data"):
            train, val = await asyncio.to_thread(load_datasets, config, run_dir, tokenizer)
    except BaseException:
        connecting.cancel()
        connected = (await asyncio.gather(connecting, return_exceptions=True))[0]
        if not isinstance(connected, BaseException):  # connected before the cancel reached it
            await connected[0].close()
        raise
    peers, weight_sync = await connecting
    gateway, agents = None, None
    try:
        if config.agent.gateway.enable or config.agent.runs_agents():  # agents' OpenAI endpoint
            gateway = await phases.timed("agent_gateway", _started_gateway(config, tokenizer, peers, registry))
        if config.agent.runs_agents():
            agents = AgentEpisodes(config, gateway, _agent_runner(config), score=partial(
                peers.score, retry_window_s=config.trainer.reward_retry_window_s))
        yield PPODriver(config, peers, tokenizer, run_dir, train, val, weight_sync, hooks, start_phases=phases,
                        actor_mini_batch_rows=actor_mini_batch_rows, gateway=gateway, agents=agents,
                        membership=membership)
    finally:
        if agents is not None:
            await agents.runner.close()
        if gateway is not None:
            await gateway.close()
        await weight_sync.close()
        await peers.close()
