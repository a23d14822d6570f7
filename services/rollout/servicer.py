"""RolloutService: a thin servicer over a RolloutEngine (proto -> domain -> await engine -> proto).

    rlfabric serve rollout --config run.yaml rollout.engine=hf

The engine is chosen once, in build_engine, from rollout.engine. Weight sync
(rlfabric.core.weight_sync): JoinWeightSyncGroup and ReceiveWeights (gloo, nccl) and PushWeights
(grpc) end in the engine swapping in the new version at once; a checksum mismatch rejects it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from prometheus_client import CollectorRegistry

from rlfabric.core.config import RunConfig
from rlfabric.core.errors import InvalidArgument, RlfabricError, Unavailable
from rlfabric.core.metrics import service_counter, service_gauge, service_histogram
from rlfabric.core.server import ServiceBinding, ServiceDefinition
from rlfabric.core.weight_sync import BucketAssembler, Manifest, SyncGroup, WeightSwap
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
    def __init__(self, engine: RolloutEngine, metrics: RolloutMetrics):
        self.engine = engine
        self.metrics = metrics
        self._push_lock = asyncio.Lock()  # one PushWeights at a time: they share the buffers below
        self._push_buffers: list = []  # the last push's bucket buffers, reused by the next one

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
        started = time.monotonic()
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("manifest"):
            raise InvalidArgument("PushWeights: the first message must carry the manifest")
        manifest = Manifest.from_proto(first.manifest)
        async with self._push_lock:
            assembler = BucketAssembler(manifest, self._push_buffers)
            self._push_buffers = assembler.buffers
            try:
                async for chunk in request_iterator:
                    assembler.add(chunk.bucket_index, chunk.offset, chunk.data)
            except BaseException:
                assembler.close()
                raise
            weights = await asyncio.to_thread(assembler.finish)  # waits for the last bucket's CRC check
            swap = await self.engine.swap_weights(weights, manifest.version)
        self.metrics.weight_swap(swap, time.monotonic() - started, manifest.num_bytes)
        return rollout_pb2.PushWeightsResponse(version=swap.version, paused_seconds=swap.paused_seconds)

    def _prompts(self, prompts: Sequence[rollout_pb2.Prompt]) -> list[list[int]]:
        ids = []
        for prompt in prompts:
            value = convert.prompt_from_proto(prompt)
            ids.append(self.engine.render_chat(value) if value and isinstance(value[0], dict) else value)
        return ids

    async def _generate(self, prompts, params: rollout_pb2.SamplingParams) -> AsyncIterator[FinishedSample]:
        """The engine's samples; a failure that is not a domain error becomes UNAVAILABLE with its cause."""
        spec: SamplingSpec = convert.sampling_from_proto(params)
        try:
            async for sample in self.engine.generate(self._prompts(prompts), spec):
                self.metrics.generated_tokens.inc(len(sample.token_ids))
                yield sample
        except RlfabricError:
            raise
        except Exception as error:
            raise Unavailable(f"{self.engine.name} engine failed: {type(error).__name__}: {error}") from error


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
    servicer = RolloutServicer(engine, RolloutMetrics(registry, engine))
    binding = ServiceBinding(servicer, rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                             "rlfabric.v1.RolloutService")
    return ServiceDefinition(role="rollout", bindings=[binding], engine=engine, registry=registry)
