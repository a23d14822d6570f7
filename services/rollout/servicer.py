"""RolloutService: a thin servicer over a RolloutEngine and, for multi-turn requests, the AgentRollouts above
it (proto -> domain -> await engine -> proto).

    rlfabric serve rollout --config run.yaml rollout.engine=hf

The engine is chosen once, in build_engine, from rollout.engine; admission, the pause/sleep gate and
request deadlines are the engine's (rlfabric.rollout.engine), and errors reach the client through
the server's ErrorInterceptor: a domain error with its own status, anything else INTERNAL. Weight sync
(rlfabric.weight_sync): JoinWeightSyncGroup and ReceiveWeights (gloo, nccl) and PushWeights
(grpc) end in the engine swapping in the new version at once; a checksum mismatch rejects it. PushHeldWeights
pushes what this replica holds to joiners (a catch-up from a peer).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial

from prometheus_client import CollectorRegistry

from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import RunConfig
from rlfabric.core.metrics import service_counter, service_gauge, service_histogram
from rlfabric.core.server import ServiceBinding, ServiceDefinition
from rlfabric.rollout import wire
from rlfabric.rollout.agent_rollout import AgentRollouts
from rlfabric.rollout.engine import RolloutEngine
from rlfabric.rollout.registration import Registration
from rlfabric.rollout.types import FinishedSample
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
from rlfabric.weight_sync.chain import ChainForward, push_held
from rlfabric.weight_sync.grpc_stream import PushReceiver, add_rollout_service
from rlfabric.weight_sync.manifest import Manifest, SyncGroup
from rlfabric.weight_sync.receiver import WeightSwap


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
        self.sync_phases = service_histogram(
            registry, "rlfabric_weight_sync_phase_seconds", "Seconds of each phase of one weight sync on this service "
            "(rollout: wire, checksum, apply).", ("role", "phase"))
        self.agent_samples = service_counter(
            registry, "rlfabric_rollout_agent_samples_total", "Multi-turn samples, by how they ended "
            "(done, max_turns, max_tokens, env_failed).", ("status",))
        self.agent_turns = service_counter(
            registry, "rlfabric_rollout_agent_turns_total", "Model turns of multi-turn samples.")
        self.tool_calls = service_counter(
            registry, "rlfabric_rollout_tool_calls_total", "Tool calls of multi-turn samples, by the environment's "
            "step status (ok, unknown_tool, invalid_arguments, tool_error, tool_timeout; '' = no Step made).",
            ("status",))
        self.env_seconds = service_histogram(
            registry, "rlfabric_rollout_env_step_seconds", "Latency of one environment Step, seen from the rollout.")

    def agent_sample(self, sample: FinishedSample) -> None:
        """Counts a multi-turn sample: its end, turns, tool calls and environment latency."""
        self.agent_samples.labels(sample.agent_status).inc()
        self.agent_turns.inc(len(sample.turns))
        for turn in sample.turns:
            if turn.tool_calls:
                self.tool_calls.labels(turn.step_status).inc(len(turn.tool_calls))
            if turn.step_status:
                self.env_seconds.observe(turn.env_seconds)

    def weight_swap(self, swap: WeightSwap, seconds: float, num_bytes: int) -> None:
        self.sync_seconds.labels("rollout").observe(seconds)
        self.paused_seconds.observe(swap.paused_seconds)
        self.sync_bytes.labels("rollout").inc(num_bytes)
        for phase in ("wire", "checksum", "apply"):
            self.sync_phases.labels("rollout", phase).observe(getattr(swap.phases, phase))


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Generation goes to the engine, a multi-turn request to the agent rollouts over it."""

    def __init__(self, engine: RolloutEngine, agents: AgentRollouts, metrics: RolloutMetrics):
        self.engine = engine
        self.agents = agents
        self.metrics = metrics
        # PushWeights: one push at a time, over one or more streams; relayed to the next replica over these options
        self._pushes = PushReceiver(partial(ChannelOptions.from_config, engine.config), ChainForward)

    async def Generate(self, request, context):
        samples = [s async for s in self._generate(request.prompts, request.sampling_params)]
        samples.sort(key=wire.sample_order)
        return rollout_pb2.RolloutServiceGenerateResponse(samples=[wire.sample_to_proto(s) for s in samples])

    async def GenerateStream(self, request, context):
        async for sample in self._generate(request.prompts, request.sampling_params):
            yield rollout_pb2.RolloutServiceGenerateStreamResponse(sample=wire.sample_to_proto(sample))

    async def GetStatus(self, request, context):
        return wire.status_to_proto(self.engine.status())

    async def Pause(self, request, context):
        return rollout_pb2.RolloutServicePauseResponse(num_aborted=await self.engine.pause(abort=request.abort))

    async def Resume(self, request, context):
        await self.engine.resume()
        return rollout_pb2.RolloutServiceResumeResponse()

    async def Sleep(self, request, context):
        await self.engine.sleep(request.level)
        return rollout_pb2.RolloutServiceSleepResponse()

    async def WakeUp(self, request, context):
        await self.engine.wake_up(list(request.tags))
        return rollout_pb2.RolloutServiceWakeUpResponse()

    async def JoinWeightSyncGroup(self, request, context):
        group = SyncGroup.from_proto(request.group, self.engine.config.weight_sync.max_timeout_s)
        await self.engine.join_weight_sync(group, request.rank)
        return rollout_pb2.RolloutServiceJoinWeightSyncGroupResponse()

    async def ReceiveWeights(self, request, context):
        started = time.monotonic()
        manifest = Manifest.from_proto(request.manifest)
        swap = await self.engine.receive_weights(manifest)
        self.metrics.weight_swap(swap, time.monotonic() - started, manifest.num_bytes)
        return rollout_pb2.RolloutServiceReceiveWeightsResponse(version=swap.version,
                                                                paused_seconds=swap.paused_seconds,
                                                                phases=swap.phases.to_proto())

    async def PushWeights(self, request_iterator, context):
        """Raw request bytes (add_rollout_service): the manifest, checked against the engine's own
        weights before anything is allocated, then chunks, possibly over several streams per push."""
        started = time.monotonic()
        outcome = await self._pushes.receive(request_iterator, context, self.engine.weight_limits(),
                                             self.engine.apply_weights)
        swap = outcome.swap
        if outcome.applied_here:  # once per push, however many streams carried it
            self.metrics.weight_swap(swap, time.monotonic() - started, outcome.manifest.num_bytes)
        relayed = [rollout_pb2.RelayedPush(address=r.address, version=r.version, paused_seconds=r.paused_seconds,
                                           error=r.error, phases=r.phases.to_proto()) for r in outcome.relayed]
        return rollout_pb2.RolloutServicePushWeightsResponse(version=swap.version, paused_seconds=swap.paused_seconds,
                                                             phases=swap.phases.to_proto(), relayed=relayed)

    async def PushHeldWeights(self, request, context):
        """A joiner's catch-up from this replica: the weights it holds pushed along request.targets."""
        results, sent = await push_held(self._pushes, tuple(request.targets), request.version, request.hop_timeout_s,
                                        self._pushes.options, self.engine.config.weight_sync.max_timeout_s)
        pushes = [rollout_pb2.RelayedPush(address=r.address, version=r.version, paused_seconds=r.paused_seconds,
                                          error=r.error, phases=r.phases.to_proto()) for r in results]
        return rollout_pb2.RolloutServicePushHeldWeightsResponse(pushes=pushes, sent_bytes=sent)

    async def _generate(self, prompts, params: rollout_pb2.SamplingParams) -> AsyncIterator[FinishedSample]:
        """The engine's samples, counted as they pass."""
        requested, spec = [wire.prompt_from_proto(prompt) for prompt in prompts], wire.sampling_from_proto(params)
        generator = self.agents if spec.multi_turn is not None else self.engine
        async for sample in generator.generate(requested, spec):
            self.metrics.generated_tokens.inc(sample.num_model_tokens())
            if sample.agent_status:
                self.metrics.agent_sample(sample)
            yield sample


def build_engine(config: RunConfig, replica: int = 0) -> RolloutEngine:
    """The engine named by rollout.engine (imported lazily: vLLM is heavy and optional); `replica`: which of
    the run's replicas it is (the simulated engine draws its stragglers and randomness by it)."""
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
    if engine == "sim":
        from rlfabric.rollout.sim_engine import SimEngine

        return SimEngine(config, replica)
    raise ValueError(f"unknown rollout.engine {engine!r}")


def build_service(config: RunConfig, engine: RolloutEngine | None = None, replica: int = 0,
                  servicer_class: type[RolloutServicer] = RolloutServicer, role: str = "rollout") -> ServiceDefinition:
    """The rollout role: RolloutService over the configured engine (replica number `replica` of the run), or
    the given one (which keeps the rollout limits of the config it was built with); its multi-turn requests
    call the environments the config names. The judge role (rlfabric.rollout.judge) passes its own servicer. With
    rollout.register_with it registers with the coordinator once ready and deregisters when it drains
    (rlfabric.rollout.registration)."""
    engine = engine or build_engine(config, replica)
    registry = CollectorRegistry()
    engine.register_metrics(registry)
    servicer = servicer_class(engine, AgentRollouts(engine, config), RolloutMetrics(registry, engine))
    binding = ServiceBinding(servicer, add_rollout_service,  # PushWeights takes raw bytes
                             "rlfabric.v1.RolloutService")
    registration = Registration.of(config)  # rollout.register_with: joins and leaves a running mesh by itself
    return ServiceDefinition(role=role, bindings=[binding], engine=engine, registry=registry,
                             on_ready=registration.ready if registration else None,
                             on_drain=registration.drain if registration else None)
