"""What a runner gives an agent (LLM: the endpoint, the episode's key, the model) and what every runner is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rlfabric.agents.outcome import AgentOutcome


@dataclass(frozen=True)
class LLM:
    """The model an episode's agent calls: an OpenAI-compatible base URL, the episode's key, the model name;
    for an inline agent also `http_client`, one connection pool for all its episodes (see InlineRunner), which
    `AsyncOpenAI(..., http_client=llm.http_client)` takes; None elsewhere, which the SDK reads as its own."""

    base_url: str
    api_key: str
    model: str
    http_client: Any = field(default=None, compare=False, repr=False)

    def env(self) -> dict[str, str]:
        """The variables a plain `AsyncOpenAI()` reads (and OPENAI_MODEL, the name to ask for)."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model}


class AgentRunner(Protocol):
    async def run(self, task: dict[str, Any], llm: LLM) -> AgentOutcome:
        """One episode of the agent on `task`."""

    async def close(self) -> None:
        """Frees what the runner holds across episodes (at the run's end)."""
