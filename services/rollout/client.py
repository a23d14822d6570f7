"""Typed client of RolloutService: domain objects in, domain objects out.

    async with RolloutClient("127.0.0.1:50051") as rollout:
        samples = await rollout.generate([[1, 2, 3]], SamplingSpec(n=4, max_tokens=32, seed=0))
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from rlfabric.core.client import ServiceClient, rpc_error_to_domain
from rlfabric.core.weight_sync import Manifest, SyncGroup
from rlfabric.rollout import convert
from rlfabric.rollout.types import EngineStatus, FinishedSample, SamplingSpec
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc


class RolloutClient(ServiceClient):
    """One rollout replica. Errors come back as RpcError (the router looks at their codes);
    `domain_errors=True` turns them into rlfabric.core.errors exceptions instead."""

    stub_class = rollout_pb2_grpc.RolloutServiceStub

    def __init__(self, address: str, options=None, domain_errors: bool = False):
        super().__init__(address, options)
        self.domain_errors = domain_errors

    def _request(self, cls, prompts: Sequence[convert.PromptInput], params: SamplingSpec):
        return cls(prompts=[convert.prompt_to_proto(p) for p in prompts],
                   sampling_params=convert.sampling_to_proto(params))

    async def _call(self, method: str, request, timeout_s: float | None):
        try:
            return await self.call(method, request, timeout_s)
        except grpc.RpcError as error:
            if self.domain_errors:
                raise rpc_error_to_domain(error, f"{self.address} {method}") from None
            raise

    async def generate(self, prompts: Sequence[convert.PromptInput], params: SamplingSpec,
                       timeout_s: float | None = None) -> list[FinishedSample]:
        """Every sample, ordered by (prompt_index, sample_index)."""
        response = await self._call("Generate", self._request(rollout_pb2.GenerateRequest, prompts, params), timeout_s)
        return [convert.sample_from_proto(s) for s in response.samples]

    async def generate_stream(self, prompts: Sequence[convert.PromptInput], params: SamplingSpec,
                              timeout_s: float | None = None) -> AsyncIterator[FinishedSample]:
        """Each sample as soon as it finishes."""
        call = self.stream("GenerateStream", self._request(rollout_pb2.GenerateStreamRequest, prompts, params),
                           timeout_s)
        try:
            async for response in call:
                yield convert.sample_from_proto(response.sample)
        except grpc.RpcError as error:
            if self.domain_errors:
                raise rpc_error_to_domain(error, f"{self.address} GenerateStream") from None
            raise
        finally:
            call.cancel()

    async def status(self, timeout_s: float | None = None) -> EngineStatus:
        response = await self._call("GetStatus", rollout_pb2.RolloutServiceGetStatusRequest(), timeout_s)
        return convert.status_from_proto(response)

    async def pause(self, abort: bool = False, timeout_s: float | None = None) -> int:
        """Returns how many requests were aborted."""
        return (await self._call("Pause", rollout_pb2.PauseRequest(abort=abort), timeout_s)).num_aborted

    async def resume(self, timeout_s: float | None = None) -> None:
        await self._call("Resume", rollout_pb2.ResumeRequest(), timeout_s)

    async def sleep(self, level: int = 1, timeout_s: float | None = None) -> None:
        await self._call("Sleep", rollout_pb2.SleepRequest(level=level), timeout_s)

    async def wake_up(self, tags: Sequence[str] = (), timeout_s: float | None = None) -> None:
        await self._call("WakeUp", rollout_pb2.WakeUpRequest(tags=list(tags)), timeout_s)

    async def join_weight_sync_group(self, group: SyncGroup, rank: int, timeout_s: float | None = None) -> None:
        """Joins (or rejoins) the actor's weight-sync group as `rank`."""
        request = rollout_pb2.JoinWeightSyncGroupRequest(group=group.to_proto(), rank=rank)
        await self._call("JoinWeightSyncGroup", request, timeout_s)

    async def receive_weights(self, manifest: Manifest, timeout_s: float | None = None) -> tuple[int, float]:
        """Receives the manifest's buckets while the actor broadcasts: (version now served, paused seconds)."""
        response = await self._call("ReceiveWeights", rollout_pb2.ReceiveWeightsRequest(manifest=manifest.to_proto()),
                                    timeout_s)
        return response.version, response.paused_seconds
