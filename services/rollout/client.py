"""Client of RolloutService: domain objects in, domain objects out.

    async with RolloutClient("127.0.0.1:50051") as rollout:
        samples = await rollout.generate([[1, 2, 3]], SamplingSpec(n=4, max_tokens=32, seed=0))

RolloutInterface is what one replica answers (the router and the weight-sync plane call it);
RolloutClient implements it over gRPC, LocalRolloutClient over a RolloutEngine in this process (the
in-process mesh, rlfabric.launch.inprocess). Failed calls raise the domain error of their status code
(Unavailable, InvalidArgument, ...), over gRPC naming the role, the replica's address and the call; the
router looks at the error's `code` to decide on failover. Admission, validation and deadlines are the
engine's, so both implementations refuse the same requests with the same errors.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from rlfabric.core.client import RoleInterface, ServiceClient
from rlfabric.core.errors import FailedPrecondition
from rlfabric.rollout import wire
from rlfabric.rollout.agent_rollout import AgentRollouts
from rlfabric.rollout.types import EngineStatus, FinishedSample, SamplingSpec
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
from rlfabric.weight_sync.grpc_stream import PushResult
from rlfabric.weight_sync.manifest import Manifest, SyncGroup
from rlfabric.weight_sync.phases import SyncPhases
from rlfabric.weight_sync.receiver import WeightSwap

if TYPE_CHECKING:
    from rlfabric.rollout.engine import RolloutEngine


class RolloutInterface(RoleInterface):
    """One rollout replica: generation, pause/sleep control, and the receiving side of weight sync."""

    role = "rollout"

    @abstractmethod
    async def generate(self, prompts: Sequence[wire.PromptInput], params: SamplingSpec,
                       timeout_s: float | None = None) -> list[FinishedSample]:
        """Every sample, ordered by (prompt_index, sample_index)."""

    @abstractmethod
    def generate_stream(self, prompts: Sequence[wire.PromptInput], params: SamplingSpec,
                        timeout_s: float | None = None) -> AsyncIterator[FinishedSample]:
        """Each sample as soon as it finishes."""

    @abstractmethod
    async def status(self, timeout_s: float | None = None) -> EngineStatus:
        """Engine, weight version, queue depth, paused/sleeping."""

    @abstractmethod
    async def pause(self, abort: bool = False, timeout_s: float | None = None) -> int:
        """Stops admitting generation (aborting what runs if `abort`); returns how many requests were aborted."""

    @abstractmethod
    async def resume(self, timeout_s: float | None = None) -> None:
        """Admits generation again."""

    @abstractmethod
    async def sleep(self, level: int = 1, timeout_s: float | None = None) -> None:
        """Releases the engine's GPU memory (weights, KV cache) until wake_up."""

    @abstractmethod
    async def wake_up(self, tags: Sequence[str] = (), timeout_s: float | None = None) -> None:
        """Takes back the memory sleep released (only `tags`, e.g. "weights", when given)."""

    @abstractmethod
    async def join_weight_sync_group(self, group: SyncGroup, rank: int, timeout_s: float | None = None) -> None:
        """Joins (or rejoins) the actor's weight-sync group as `rank`."""

    @abstractmethod
    async def receive_weights(self, manifest: Manifest, timeout_s: float | None = None) -> WeightSwap:
        """Receives the manifest's buckets while the actor broadcasts: the version now served, how long
        generation was paused, and the replica's phases of the sync."""

    @abstractmethod
    async def push_held_weights(self, targets: Sequence[str], version: int, hop_timeout_s: float,
                                timeout_s: float | None = None) -> tuple[tuple[PushResult, ...], int]:
        """Pushes the weights this replica holds as `version` (its delta base) to `targets`, relayed along them:
        (each target's PushResult in order, the bytes this replica sent)."""


class RolloutClient(ServiceClient, RolloutInterface):
    """RolloutInterface over gRPC, to one replica."""

    stub_class = rollout_pb2_grpc.RolloutServiceStub

    def _request(self, cls, prompts: Sequence[wire.PromptInput], params: SamplingSpec):
        return cls(prompts=[wire.prompt_to_proto(p) for p in prompts],
                   sampling_params=wire.sampling_to_proto(params))

    async def generate(self, prompts: Sequence[wire.PromptInput], params: SamplingSpec,
                       timeout_s: float | None = None) -> list[FinishedSample]:
        request = self._request(rollout_pb2.RolloutServiceGenerateRequest, prompts, params)
        response = await self.call("Generate", request, timeout_s)
        return [wire.sample_from_proto(s) for s in response.samples]

    async def generate_stream(self, prompts: Sequence[wire.PromptInput], params: SamplingSpec,
                              timeout_s: float | None = None) -> AsyncIterator[FinishedSample]:
        request = self._request(rollout_pb2.RolloutServiceGenerateStreamRequest, prompts, params)
        async for response in self.stream("GenerateStream", request, timeout_s):
            yield wire.sample_from_proto(response.sample)

    async def status(self, timeout_s: float | None = None) -> EngineStatus:
        response = await self.call("GetStatus", rollout_pb2.RolloutServiceGetStatusRequest(), timeout_s)
        return wire.status_from_proto(response)

    async def pause(self, abort: bool = False, timeout_s: float | None = None) -> int:
        return (await self.call("Pause", rollout_pb2.RolloutServicePauseRequest(abort=abort), timeout_s)).num_aborted

    async def resume(self, timeout_s: float | None = None) -> None:
        await self.call("Resume", rollout_pb2.RolloutServiceResumeRequest(), timeout_s)

    async def sleep(self, level: int = 1, timeout_s: float | None = None) -> None:
        await self.call("Sleep", rollout_pb2.RolloutServiceSleepRequest(level=level), timeout_s)

    async def wake_up(self, tags: Sequence[str] = (), timeout_s: float | None = None) -> None:
        await self.call("WakeUp", rollout_pb2.RolloutServiceWakeUpRequest(tags=list(tags)), timeout_s)

    async def join_weight_sync_group(self, group: SyncGroup, rank: int, timeout_s: float | None = None) -> None:
        request = rollout_pb2.RolloutServiceJoinWeightSyncGroupRequest(group=group.to_proto(), rank=rank)
        await self.call("JoinWeightSyncGroup", request, timeout_s)

    async def receive_weights(self, manifest: Manifest, timeout_s: float | None = None) -> WeightSwap:
        request = rollout_pb2.RolloutServiceReceiveWeightsRequest(manifest=manifest.to_proto())
        response = await self.call("ReceiveWeights", request, timeout_s)
        return WeightSwap(response.version, response.paused_seconds, SyncPhases.from_proto(response.phases))

    async def push_held_weights(self, targets: Sequence[str], version: int, hop_timeout_s: float,
                                timeout_s: float | None = None) -> tuple[tuple[PushResult, ...], int]:
        request = rollout_pb2.RolloutServicePushHeldWeightsRequest(targets=list(targets), version=version,
                                                                   hop_timeout_s=hop_timeout_s)
        response = await self.call("PushHeldWeights", request, timeout_s)
        return tuple(PushResult(p.address, p.version, p.paused_seconds, p.error, SyncPhases.from_proto(p.phases))
                     for p in response.pushes), response.sent_bytes


class LocalRolloutClient(RolloutInterface):
    """RolloutInterface over a RolloutEngine in this process (started and stopped by its owner), its
    multi-turn requests through `agents` (by default AgentRollouts calling the environments the engine's
    config names, as the servicer's do).

    Prompts and sampling parameters go through their proto conversion and back, so the engine sees
    exactly what the servicer would hand it (top_p 0 means 1, top_k 0 means off, ...); so do its samples,
    so callers get what RolloutClient gives (per-token numpy arrays)."""

    def __init__(self, engine: RolloutEngine, agents: AgentRollouts | None = None):
        self.engine = engine
        self.agents = agents or AgentRollouts(engine, engine.config)
        self._owns_agents = agents is None

    async def generate(self, prompts: Sequence[wire.PromptInput], params: SamplingSpec,
                       timeout_s: float | None = None) -> list[FinishedSample]:
        samples = [sample async for sample in self.generate_stream(prompts, params, timeout_s)]
        return sorted(samples, key=wire.sample_order)

    async def generate_stream(self, prompts: Sequence[wire.PromptInput], params: SamplingSpec,
                              timeout_s: float | None = None) -> AsyncIterator[FinishedSample]:
        as_served = [wire.prompt_from_proto(wire.prompt_to_proto(p)) for p in prompts]
        spec = wire.sampling_from_proto(wire.sampling_to_proto(params))
        generator = self.agents if spec.multi_turn is not None else self.engine
        async for sample in generator.generate(as_served, spec):
            yield wire.sample_from_proto(wire.sample_to_proto(sample))

    async def status(self, timeout_s: float | None = None) -> EngineStatus:
        return self.engine.status()

    async def pause(self, abort: bool = False, timeout_s: float | None = None) -> int:
        return await self.engine.pause(abort=abort)

    async def resume(self, timeout_s: float | None = None) -> None:
        await self.engine.resume()

    async def sleep(self, level: int = 1, timeout_s: float | None = None) -> None:
        await self.engine.sleep(level)

    async def wake_up(self, tags: Sequence[str] = (), timeout_s: float | None = None) -> None:
        await self.engine.wake_up(list(tags))

    async def join_weight_sync_group(self, group: SyncGroup, rank: int, timeout_s: float | None = None) -> None:
        await self.engine.join_weight_sync(group, rank)

    async def receive_weights(self, manifest: Manifest, timeout_s: float | None = None) -> WeightSwap:
        return await self.engine.receive_weights(manifest)

    async def push_held_weights(self, targets: Sequence[str], version: int, hop_timeout_s: float,
                                timeout_s: float | None = None) -> tuple[tuple[PushResult, ...], int]:
        raise FailedPrecondition("an engine in this process holds no pushed weights to lend (PushHeldWeights "
                                 "runs on a RolloutService)")

    async def close(self) -> None:
        """The environment connections of the agent rollouts it made; the engine belongs to whoever started it."""
        if self._owns_agents:
            await self.agents.close()
