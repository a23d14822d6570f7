"""RolloutService: a thin servicer over a RolloutEngine (proto -> domain -> await engine -> proto).

    rlfabric serve rollout --config run.yaml rollout.engine=hf

The engine is chosen once, in build_engine, from rollout.engine. JoinWeightSyncGroup,
ReceiveWeights and PushWeights belong to the weight-sync transports and still answer
UNIMPLEMENTED from the generated base class; they will feed `engine.load_weights`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from prometheus_client import CollectorRegistry

from rlfabric.core.config import RunConfig
from rlfabric.core.errors import InvalidArgument, RlfabricError, Unavailable
from rlfabric.core.metrics import service_counter, service_gauge
from rlfabric.core.server import ServiceBinding, ServiceDefinition
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


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, engine: RolloutEngine, metrics: RolloutMetrics):
        self.engine = engine
        self.metrics = metrics

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
    registry = CollectorRegistry()
    servicer = RolloutServicer(engine, RolloutMetrics(registry, engine))
    binding = ServiceBinding(servicer, rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                             "rlfabric.v1.RolloutService")
    return ServiceDefinition(role="rollout", bindings=[binding], engine=engine, registry=registry)
