"""The in-process mesh: every role of a run in this one process, for debugging and fast loop tests.

    async with InProcessMesh(config, run_dir) as mesh:
        started = await mesh.coordinator.start_run(["trainer.total_steps=3"])
        ...                                            # the CoordinatorInterface, as over gRPC

`rlfabric train --in-process` runs this. Each role's engine is built exactly as `rlfabric serve ROLE`
builds it (rlfabric.serve.build_service); the coordinator's RunController and PPODriver are the same
objects; only the clients differ: LocalActorClient, LocalRolloutClient, ... call the engines directly,
after the same request checks the servicers make, so a bad request gets the same domain error
(InvalidArgument, ...) as over gRPC. An unexpected exception (a bug) reaches the caller as itself, with
its traceback, where gRPC would answer INTERNAL. A breakpoint anywhere (the loop, an engine, a scorer)
stops the whole run in one debugger. What stays out is the wire: no gRPC servers, auth, TLS, message
limits, readiness probes or servicer metrics. A role with world_size > 1 still runs its other ranks as
processes of their own. A multi-turn run without env.enable calls its environment
(rollout.multi_turn.env_address) over gRPC, and waits for it to be ready before its first step.

Weight sync is a direct handoff (LocalWeightSync): the actor gathers its full weights, as it does for
every transport, casts them to the receivers' dtype, and each rollout engine swaps them in through
swap_weights, the method every transport ends in, with the same version numbers as over gRPC. When
weight_sync.lora resolves to adapter (actor.lora with an engine that loads adapters), the actor gathers
its LoRA adapters alone and each engine takes them through swap_adapter, as an adapter-only sync ends.

Tests wrap clients to inject failures: InProcessMesh(config, run_dir, wrap_peers=lambda peers:
dataclasses.replace(peers, reward=FailingReward(peers.reward))).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from rlfabric.actor.client import LocalActorClient
from rlfabric.coordinator.client import LocalCoordinatorClient
from rlfabric.coordinator.peers import Peers, RoleClients, build_peers, environment_of
from rlfabric.coordinator.run_controller import RunController
from rlfabric.coordinator.weight_sync import SyncReport, WeightSync, target_dtype
from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import ConfigError, RunConfig
from rlfabric.core.roles import ROLE_TABLE, Kind
from rlfabric.critic.client import LocalCriticClient
from rlfabric.env.client import LocalEnvClient
from rlfabric.launch.local import prepare_run_dir, service_names
from rlfabric.reference.client import LocalReferenceClient, LocalTeacherClient
from rlfabric.reward.client import LocalRewardClient
from rlfabric.rollout.agent_rollout import AgentRollouts
from rlfabric.rollout.client import LocalRolloutClient
from rlfabric.rollout.router import RolloutRouter
from rlfabric.serve import build_service

log = logging.getLogger("rlfabric.launch.inprocess")

ADDRESS_PREFIX = "in-process:"  # config.cluster names the engines "in-process:rollout-0", ...


class LocalWeightSync(WeightSync):
    """Weight sync for engines in this process: the actor's gathered weights straight into each rollout
    engine's swap_weights, or with adapter-only syncs its LoRA adapters into swap_adapter."""

    def __init__(self, actor_engine, rollout_engines: Mapping[str, object], config: RunConfig,
                 serving: RolloutRouter | None = None):
        self.actor = actor_engine
        self.serving = serving
        self.engines = dict(rollout_engines)
        self.dtype = target_dtype(config)  # None: the actor's own
        self.adapters_only = config.syncs_lora_adapters()

    @property
    def receivers(self) -> dict[str, str]:
        return {name: name for name in self.engines}

    @property
    def stale(self) -> bool:
        """Never: there is no group to rebuild, so a failed receiver is not retried at once."""
        return False

    async def open(self) -> dict[str, str]:
        return {}

    async def close(self) -> None:
        pass

    async def sync(self, version: int) -> SyncReport:
        """Every engine serves `version` afterwards, or is named in the report's `failed`; raises when the
        actor cannot gather its weights (as the plane does when it cannot prepare them)."""
        started = time.perf_counter()
        report = SyncReport(version)
        weights = await (self.actor.gather_adapter() if self.adapters_only else self.actor.gather_weights())
        if self.dtype is not None:
            weights = {name: tensor.to(self.dtype) for name, tensor in weights.items()}
        report.num_bytes = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
        names = list(self.engines)
        swaps = await asyncio.gather(*(self._swap(self.engines[name], weights, version) for name in names),
                                     return_exceptions=True)
        report.record(dict(zip(names, swaps, strict=True)))
        report.seconds = report.broadcast_seconds = time.perf_counter() - started
        self.serve_synced(report)
        return report

    async def _swap(self, engine, weights: dict, version: int):
        if self.adapters_only:
            return await engine.swap_adapter(list(weights.items()), version)
        return await engine.swap_weights(list(weights.items()), version)


class InProcessMesh:
    """The engines of every role the config uses, started in this process, and a RunController whose
    runs reach them through in-process clients. `coordinator` is its CoordinatorInterface."""

    def __init__(self, config: RunConfig, run_dir: Path,
                 wrap_peers: Callable[[Peers], Peers] | None = None):
        self.config = config
        self.run_dir = Path(run_dir)
        self.wrap_peers = wrap_peers  # tests: wrap a client to inject failures
        self.engines: dict[str, object] = {}  # address ("in-process:actor") -> engine
        self.agents: dict[str, AgentRollouts] = {}  # a rollout engine's address -> its multi-turn requests
        self.controller: RunController | None = None
        self.coordinator: LocalCoordinatorClient | None = None

    async def start(self) -> None:
        """Prepares RUN_DIR as `rlfabric up` does (the tiny model when model.path is empty, the storage
        root), then builds and starts each role's engine; config.cluster names them. A judge pool is refused: the
        reward service reaches its judge over gRPC only (rlfabric.reward.judge)."""
        if self.config.uses_judge_pool():
            raise ConfigError("judge.model_path: the in-process mesh has no judge pool (the reward service calls its "
                              "judge over gRPC); use the local launcher (`rlfabric up`), which starts it")
        await asyncio.to_thread(prepare_run_dir, self.config, self.run_dir)
        addresses: dict[str, list[str]] = {}
        for name, role in service_names(self.config):
            address = ADDRESS_PREFIX + name
            engine = build_service(role, self.config, replica=len(addresses.get(role, []))).engine
            self.engines[address] = engine  # before start(): stop() stops a half-started one too
            addresses.setdefault(role, []).append(address)
            await engine.start()
        for role, listed in addresses.items():
            setattr(self.config.cluster, role, listed)
        self.agents = self._agent_rollouts(addresses)
        self.controller = RunController(self.config, connect=self.connect)
        self.coordinator = LocalCoordinatorClient(self.controller)
        log.info("in-process mesh ready", extra={"fields": {"run_dir": str(self.run_dir),
                                                            "engines": list(self.engines)}})

    def _agent_rollouts(self, addresses: dict[str, list[str]]) -> dict[str, AgentRollouts]:
        """The multi-turn requests of each rollout engine: their agent loops call the environment engine of this
        process, or without one the environment the config names, over gRPC."""
        def of_kind(kind: Kind) -> list[str]:
            return [address for role, listed in addresses.items() if ROLE_TABLE[role].kind is kind for address in listed]

        environments = of_kind(Kind.ENVIRONMENT)
        env = LocalEnvClient(self.engines[environments[0]]) if environments else None
        return {address: AgentRollouts(self.engines[address], self.config, env) for address in of_kind(Kind.ROLLOUT)}

    async def stop(self) -> None:
        """Ends a run that is still going (the last checkpoint stays the resume point), then every engine."""
        if self.controller is not None:
            await self.controller.stop()
        for agents in self.agents.values():
            await agents.close()
        for engine in reversed(list(self.engines.values())):
            try:
                await engine.stop()
            except Exception:  # the others still stop
                log.exception("stopping an in-process engine failed")

    async def __aenter__(self) -> InProcessMesh:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def engine(self, name: str):
        """The engine of service `name` ("actor", "rollout-0", ...)."""
        return self.engines[ADDRESS_PREFIX + name]

    async def connect(self, config: RunConfig) -> tuple[Peers, LocalWeightSync]:
        """RunController's `connect` (rlfabric.coordinator.setup): in-process clients of the engines
        config.cluster names, and the direct weight handoff."""
        cluster = config.cluster
        rollouts = list(cluster.rollout)
        engines = self.engines
        peers = build_peers(config, RoleClients(
            actor=lambda address: LocalActorClient(engines[address]),
            reference=lambda address: LocalReferenceClient(engines[address]),
            critic=lambda address: LocalCriticClient(engines[address]),
            teacher=lambda address: LocalTeacherClient(engines[address]),
            rollout=lambda addresses: RolloutRouter(addresses, max_attempts=config.trainer.rollout_retries + 1,
                                                    hedge_after=config.trainer.rollout_hedge_after,
                                                    clients=[LocalRolloutClient(engines[a], self.agents[a])
                                                             for a in addresses]),
            reward=lambda addresses: LocalRewardClient(engines[addresses[0]]),
        ))
        if not any(address in self.engines for address in cluster.env):
            # No environment in this process: the replicas' agent loops call the run's over gRPC, and the
            # run waits for it to be ready as over the mesh (rlfabric.coordinator.setup.connect_services).
            peers = dataclasses.replace(peers, **environment_of(config, ChannelOptions.for_env(config)))
            try:
                await peers.wait_until_ready(config.client.connect_timeout_s)
            except BaseException:
                await peers.close()
                raise
        if self.wrap_peers is not None:
            peers = self.wrap_peers(peers)
        weight_sync = LocalWeightSync(self.engines[cluster.actor[0]], {a: self.engines[a] for a in rollouts}, config,
                                      serving=peers.rollout)
        return peers, weight_sync
