"""RolloutService: a thin servicer over a RolloutEngine (proto -> domain -> await engine -> proto).

    rlfabric serve rollout --config run.yaml rollout.engine=hf

The engine is chosen once, in build_engine, from rollout.engine. Weight sync
(rlfabric.core.weight_sync): JoinWeightSyncGroup and ReceiveWeights (gloo, nccl) and PushWeights
(grpc) end in the engine swapping in the new version at once; a checksum mismatch rejects it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from prometheus_client import CollectorRegistry

from rlfabric.core.config import RunConfig
from rlfabric.core.errors import InvalidArgument, ResourceExhausted, RlfabricError, Unavailable
from rlfabric.core.metrics import service_counter, service_gauge, service_histogram
from rlfabric.core.server import ServiceBinding, ServiceDefinition
from rlfabric.core.weight_sync import Manifest, SyncGroup, WeightSwap
from rlfabric.core.weight_sync.grpc_stream import PushReceiver, add_rollout_service
from rlfabric.rollout import convert
from rlfabric.rollout.engine import RolloutEngine
from rlfabric.rollout.types import FinishedSample, SamplingSpec
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc


class RolloutMetrics:
    """The rollout's rlfabric_* metrics; the gauges read engine.status() at scrape time."""

    def __init__(self, registry: CollectorRegistry, engine: RolloutEngine):
        self.generated_tokens = service_counter(
            registry, "rlfabric_rollout_generated_tokens_total", "Tokens generated (all samples, aborted included).")
        gauges = {
            "rlfabric_rollout_queue_depth": ("Generate requests waiting or running.", "queue_depth"),
            "rlfabric_rollout_weight_version": ("Version of the weights being served.", "weight_version"),
            "rlfabric_rollout_kv_cache_usage_ratio": ("Fraction of the KV cache in use.", "kv_cache_usage"),
        }
        for name, (doc, attr) in gauges.items():
            service_gauge(registry, name, doc).set_function(lambda attr=attr: getattr(engine.status(), attr))
        self.sync_seconds = service_histogram(
            registry, "rlfabric_weight_sync_seconds", "Wall time of one weight sync on this service "
            "(rollout: receive and switch).", ("role",))
        self.paused_seconds = service_histogram(
            registry, "rlfabric_rollout_paused_seconds", "Seconds generation was held for one weight switch.")
        self.sync_bytes = service_counter(
            registry, "rlfabric_weight_sync_bytes_total", "Weight bytes moved by weight sync (rollout: received).",
            ("role",))
        self.sync_bytes.labels("rollout")

    def weight_swap(self, swap: WeightSwap, seconds: float, num_bytes: int) -> None:
        self.sync_seconds.labels("rollout").observe(seconds)
        self.paused_seconds.observe(swap.paused_seconds)
        self.sync_bytes.labels("rollout").inc(num_bytes)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, engine: RolloutEngine, metrics: RolloutMetrics, max_pending_requests: int = 0):
        self.engine = engine
        self.metrics = metrics
        self.max_pending_requests = max_pending_requests  # rollout.max_pending_requests; 0 = no limit
        self._pending_requests = 0  # Generate/GenerateStream requests admitted and not finished
        self._pushes = PushReceiver()  # PushWeights: one push at a time, over one or more streams

    async def Generate(self, request, context):
        samples = [s async for s in self._generate(request.prompts, request.sampling_params)]
        samples.sort(key=convert.sample_order)
        return rollout_pb2.GenerateResponse(samples=[convert.sample_to_proto(s) for s in samples])

    async def GenerateStream(self, request, context):
        async for sample in self._generate(request.prompts, request.sampling_params):
            yield rollout_pb2.GenerateStreamResponse(sample=convert.sample_to_proto(sample))

    async def GetStatus(self, request, context):
        return convert.status_to_proto(self.engine.status())

    async def Pause(self, request, context):
        return rollout_pb2.PauseResponse(num_aborted=await self.engine.pause(abort=request.abort))

    async def Resume(self, request, context):
        await self.engine.resume()
        return rollout_pb2.ResumeResponse()

    async def Sleep(self, request, context):
        if request.level not in (1, 2):
            raise InvalidArgument(f"sleep level must be 1 or 2 (got {request.level})")
        await self.engine.sleep(request.level)
        return rollout_pb2.SleepResponse()

    async def WakeUp(self, request, context):
        await self.engine.wake_up(list(request.tags))
        return rollout_pb2.WakeUpResponse()

    async def JoinWeightSyncGroup(self, request, context):
        await self.engine.join_weight_sync(SyncGroup.from_proto(request.group), request.rank)
        return rollout_pb2.JoinWeightSyncGroupResponse()

    async def ReceiveWeights(self, request, context):
        started = time.monotonic()
        manifest = Manifest.from_proto(request.manifest)
        swap = await self.engine.receive_weights(manifest)
        self.metrics.weight_swap(swap, time.monotonic() - started, manifest.num_bytes)
        return rollout_pb2.ReceiveWeightsResponse(version=swap.version, paused_seconds=swap.paused_seconds)

    async def PushWeights(self, request_iterator, context):
        """Raw request bytes (add_rollout_service): the manifest, checked against the engine's own
        weights before anything is allocated, then chunks, possibly over several streams per push."""
        started = time.monotonic()
        outcome = await self._pushes.receive(request_iterator, context, self.engine.weight_limits(),
                                             self.engine.swap_weights)
        swap = outcome.swap
        if outcome.applied_here:  # once per push, however many streams carried it
            self.metrics.weight_swap(swap, time.monotonic() - started, outcome.manifest.num_bytes)
        return rollout_pb2.PushWeightsResponse(version=swap.version, paused_seconds=swap.paused_seconds)

    def _prompts(self, prompts: Sequence[rollout_pb2.Prompt]) -> list[list[int]]:
        ids = []
        for prompt in prompts:
            value = convert.prompt_from_proto(prompt)
            ids.append(self.engine.render_chat(value) if value and isinstance(value[0], dict) else value)
        return ids

    async def _generate(self, prompts, params: rollout_pb2.SamplingParams) -> AsyncIterator[FinishedSample]:
        """The engine's samples; a failure that is not a domain error becomes UNAVAILABLE with its cause.

        Admission: with rollout.max_pending_requests requests already held (waiting or running), a new
        one is refused with RESOURCE_EXHAUSTED before it is queued, so the engine's queue stays bounded.
        """
        spec: SamplingSpec = convert.sampling_from_proto(params)
        limit = self.max_pending_requests
        if limit and self._pending_requests >= limit:
            raise ResourceExhausted(
                f"this rollout replica holds {self._pending_requests} generation requests, its limit "
                f"(rollout.max_pending_requests={limit}): retry with backoff, send fewer, larger requests, "
                "add replicas, or raise rollout.max_pending_requests (0 = no limit)")
        self._pending_requests += 1
        try:
            async for sample in self.engine.generate(self._prompts(prompts), spec):
                self.metrics.generated_tokens.inc(len(sample.token_ids))
                yield sample
        except RlfabricError:
            raise
        except Exception as error:
            raise Unavailable(f"{self.engine.name} engine failed: {type(error).__name__}: {error}") from error
        finally:
            self._pending_requests -= 1


def build_engine(config: RunConfig) -> RolloutEngine:
    """The engine named by rollout.engine (imported lazily: vLLM is heavy and optional)."""
    engine = config.rollout.engine
    if engine == "hf":
        from rlfabric.rollout.hf_engine import HFEngine

        return HFEngine(config)
    if engine == "vllm":
        from rlfabric.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(config)
    if engine == "sglang":
        from rlfabric.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(config)
    raise ValueError(f"unknown rollout.engine {engine!r}")


def build_service(config: RunConfig, engine: RolloutEngine | None = None) -> ServiceDefinition:
    """The rollout role: RolloutService over the configured (or given) engine."""
    engine = engine or build_engine(config)
    engine.max_rows_per_request = config.rollout.max_rows_per_request
    registry = CollectorRegistry()
    servicer = RolloutServicer(engine, RolloutMetrics(registry, engine), config.rollout.max_pending_requests)
    binding = ServiceBinding(servicer, add_rollout_service,  # PushWeights takes raw bytes
                             "rlfabric.v1.RolloutService")
    return ServiceDefinition(role="rollout", bindings=[binding], engine=engine, registry=registry)
