"""The gateway's test mesh: the hf engine on the tiny model, two rollout replicas over it behind a real
RolloutRouter, and gateways over the router, on one event loop in a background thread. Tests call the gateway
over loopback HTTP with the openai SDK, as agents do."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from rlfabric.core.config import load_config
from rlfabric.core.host import load_tokenizer
from rlfabric.gateway.calls import RouterGenerator
from rlfabric.gateway.server import Gateway
from rlfabric.rollout.client import LocalRolloutClient
from rlfabric.rollout.router import RolloutRouter
from rlfabric.rollout.types import FinishedSample, SamplingSpec


@dataclass
class EngineRequest:
    """What one engine request consumed and sampled, logged on the replica's side."""

    replica: str
    prompt_ids: list[int]
    params: SamplingSpec
    sample: FinishedSample


class LoggingRolloutClient(LocalRolloutClient):
    """The in-process replica client, logging each request's prompt ids and the samples the engine returned."""

    def __init__(self, engine, name: str, log: list[EngineRequest]):
        super().__init__(engine)
        self.name, self.log = name, log

    async def generate_stream(self, prompts, params, timeout_s=None):
        async for sample in super().generate_stream(prompts, params, timeout_s):
            self.log.append(EngineRequest(self.name, list(prompts[sample.prompt_index]), params, sample))
            yield sample


class GatewayMesh:
    """The engine, the router and a default gateway, on a loop of their own."""

    def __init__(self, model_path, *overrides: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.model_path = model_path
        self.base = [f"model.path={model_path}", "agent.gateway.enable=true", "data.max_response_length=8",
                     "rollout.max_num_seqs=64", "rollout.max_pending_requests=512", *overrides]
        self.config = load_config(None, self.base)
        self.tokenizer = load_tokenizer(str(model_path))
        self.log: list[EngineRequest] = []
        self.engine = self.run(self._start_engine(), timeout=120)
        clients = [LoggingRolloutClient(self.engine, name, self.log) for name in ("replica-a", "replica-b")]
        self.router = RolloutRouter(["replica-a", "replica-b"], clients=clients)
        self.gateway = self.gateway_with()
        self.extra: list[Gateway] = []

    async def _start_engine(self):
        from rlfabric.rollout.hf_engine import HFEngine

        engine = HFEngine(self.config)
        await engine.start()
        return engine

    def run(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=timeout)

    def call(self, function, *args):
        """function(*args) on the mesh's loop (the gateway's state is the loop's)."""

        async def on_loop():
            return function(*args)

        return self.run(on_loop())

    def gateway_with(self, *overrides: str, generator=None) -> Gateway:
        """Another gateway over the same router, with more config overrides."""
        config = load_config(None, [*self.base, *overrides])
        gateway = Gateway(config, self.tokenizer, generator or RouterGenerator(self.router))
        self.run(gateway.start())
        if overrides:
            self.extra.append(gateway)
        return gateway

    def requests_of(self, prompt_prefixes: Sequence[list[int]]) -> list[EngineRequest]:
        return [r for r in self.log if any(r.prompt_ids[:len(p)] == p for p in prompt_prefixes)]

    def stop(self) -> None:
        for gateway in [self.gateway, *self.extra]:
            self.run(gateway.close())
        self.run(self.engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
