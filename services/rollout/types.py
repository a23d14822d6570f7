"""Domain types of the rollout service and the request rules every engine shares (no torch here,
so the coordinator and the router can use them without importing it).

Log-probs, for every engine: the log-prob of each sampled token under the sampling distribution,
log_softmax(logits / T) after top-k/top-p filtering (removed tokens at -inf; vLLM's
"processed_logprobs"). With top_p = 1 and top_k off that is exactly what the actor's
ComputeLogProbs computes for the PPO ratio. With temperature 0 (greedy) T is taken as 1.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from rlfabric.core.errors import InvalidArgument
from rlfabric.weight_sync.devices import DeviceReport

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class AgentTask:
    """The data row a multi-turn sample's environment session starts on."""

    environment: str = ""
    """Registered environment name; empty = the environment service's env.name."""
    ground_truth: str = ""
    extra_info: Mapping = field(default_factory=dict)
    """The row's extra_info (tools_kwargs in it)."""


@dataclass(frozen=True)
class AgentPrompt:
    """A multi-turn prompt: chat messages (rendered with the session's tools) and the environment task."""

    messages: Sequence[Mapping[str, str]]
    task: AgentTask


# A prompt as callers write it: token ids, chat messages [{"role": ..., "content": ...}], or an AgentPrompt.
PromptInput = Sequence[int] | Sequence[Mapping[str, str]] | AgentPrompt
# The roles a prompt's chat messages may have. Chat templates render any other as given (ChatML writes the
# role after <|im_start|>), so an unknown one is refused rather than rendered into the prompt.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_chat_roles(prompts: Sequence[PromptInput]) -> None:
    """InvalidArgument naming the prompt and message whose role is not one of CHAT_ROLES."""
    for index, prompt in enumerate(prompts):
        messages = prompt.messages if isinstance(prompt, AgentPrompt) else prompt
        for number, message in enumerate(messages):
            if isinstance(message, Mapping) and message.get("role") not in CHAT_ROLES:
                raise InvalidArgument(f"prompt {index}: message {number} has role {message.get('role')!r}; a chat "
                                      f"message's role is one of {', '.join(CHAT_ROLES)}")


@dataclass(frozen=True)
class MultiTurnSpec:
    """How a multi-turn request runs its agent loops (rollout.multi_turn, resolved by the caller)."""

    env_address: str = ""
    """The environment service; empty = the replica's rollout.multi_turn.env_address or cluster.env. The replica
    refuses an address its own config does not name (rollout.agent_rollout.allowed_env_addresses)."""
    max_turns: int = 4
    max_total_tokens: int = 1024
    """Most response tokens, the model's and the environment's; SamplingSpec.max_tokens bounds each turn."""
    tool_call_format: str = "hermes"
    env_timeout_s: float = 60.0


class Finish(str, Enum):
    """Why a sample ended (the proto's FinishReason)."""

    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # Pause(abort=True), a cancelled request, or shutdown


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters of one request, vLLM's names and meanings."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    multi_turn: MultiTurnSpec | None = None
    """Set: every sample is an agent loop against an environment (prompts are AgentPrompts)."""


@dataclass
class TurnInfo:
    """One model turn of a multi-turn sample and what the environment answered."""

    model_tokens: int
    observation_tokens: int
    tool_calls: list[str]
    """Names of the turn's tool calls ("" for one that could not be parsed)."""
    step_status: str
    """The environment's StepStatus ("ok", "unknown_tool", ...); "" when no Step was made."""
    reward: float
    finish_reason: str
    weight_version: int
    env_seconds: float = 0.0
    """How long the environment's Step took."""


@dataclass
class FinishedSample:
    """One generated response.

    Per-token weight versions, run-length: a sample generated under one version has weight_version
    and no version_spans. A partial rollout (a weight switch reached it mid-generation, and it went on
    from its prefix under the new weights) has version_spans [(version, first token index), ...] in
    order, the first (weight_version, 0): weight_version is always the version of its first token,
    the oldest it holds.

    The per-token fields are lists where an engine makes the sample, and numpy arrays where it comes off
    the wire (rlfabric.rollout.wire.sample_from_proto, so the coordinator's samples): a Python int or
    float per token would cost 4-8x the memory and most of the coordinator's time per sample at scale.
    Read them with len(), indexing or np.asarray, never by truth value."""

    prompt_index: int
    sample_index: int
    token_ids: Sequence[int]  # (L,) prompt excluded
    logprobs: Sequence[float]  # (L,) empty unless SamplingSpec.logprobs
    finish_reason: Finish
    weight_version: int
    text: str = ""
    _: KW_ONLY  # the fields below by name only: they are many, and optional
    # Multi-turn samples only (empty otherwise):
    prompt_ids: Sequence[int] = field(default_factory=list)  # (P,) the prompt as rendered with the session's tools
    loss_mask: Sequence[int] = field(default_factory=list)  # (L,) 1 = the model's token, 0 = the environment's
    turns: list[TurnInfo] = field(default_factory=list)
    agent_status: str = ""  # done, max_turns, max_tokens or env_failed
    agent_error: str = ""  # what failed, with env_failed
    env_reward: float = 0.0  # the sum of the environment's step rewards
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    routed_experts: np.ndarray | None = None
    """(P + L, layers, top_k) uint8/uint16: with actor.router_replay, the experts each MoE layer chose for each
    token of the prompt and the response (rlfabric.core.router_replay's layout)."""

    def model_token_mask(self) -> Sequence[int]:
        """(L,) 1 for each token the model sampled (every token of a single-turn sample)."""
        return self.loss_mask if len(self.loss_mask) else [1] * len(self.token_ids)

    def num_model_tokens(self) -> int:
        """The tokens the model sampled (all of a single-turn sample's)."""
        return int(sum(self.loss_mask)) if len(self.loss_mask) else len(self.token_ids)

    def token_versions(self) -> list[int]:
        """(L,) the weight version that produced each token."""
        return [version for version, count in self.version_counts() for _ in range(count)]

    def version_counts(self) -> list[tuple[int, int]]:
        """[(version, tokens)] in order: how many tokens each span of versions produced (token_versions
        run-length, for counting without a Python object per token)."""
        spans = self.version_spans or [(self.weight_version, 0)]
        ends = [first for _, first in spans[1:]] + [len(self.token_ids)]
        return [(version, end - first) for (version, first), end in zip(spans, ends, strict=True)]

    @property
    def newest_version(self) -> int:
        return self.version_spans[-1][0] if self.version_spans else self.weight_version


def compact_versions(spans: list[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
    """(weight_version, version_spans) of a FinishedSample whose generation went through `spans`
    [(version, first token index)] in order: spans that hold no token are dropped, and a sample of one
    version has no spans (its weight_version says it all)."""
    kept: list[tuple[int, int]] = []
    for version, first in spans:
        if kept and kept[-1][1] == first:
            kept.pop()  # the span before ended before its first token
        if not kept or kept[-1][0] != version:
            kept.append((version, first))
    return kept[0][0], (kept if len(kept) > 1 else [])


@dataclass
class EngineStatus:
    """What GetStatus reports."""

    engine: str
    model: str
    weight_version: int = 0
    queue_depth: int = 0  # requests waiting or running
    kv_cache_usage: float = 0.0  # in [0, 1]
    paused: bool = False
    sleeping: bool = False
    rss_bytes: int = 0  # resident memory of the service process
    device_memory_bytes: int = 0  # what the engine's weights and KV cache hold on its device (0 = unknown)
    device: DeviceReport = DeviceReport()  # where the engine's weights live (weight_sync.transport auto reads it)


@dataclass
class EngineLimits:
    """What a request is validated against; known once the engine has started."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)


def row_seed(seed: int | None, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample: fixed by (request seed, prompt index, sample index), so a sample does
    not depend on what else is batched with it; random when the request has no seed."""
    if seed is None:
        return random.SystemRandom().getrandbits(63)
    mixed = (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB)
    return mixed % (1 << 63)


def validate_request(prompts: Sequence[Sequence[int]], params: SamplingSpec, limits: EngineLimits) -> None:
    """Raises InvalidArgument naming the first problem of a request."""
    if not prompts:
        raise InvalidArgument("no prompts: a request needs at least one prompt")
    if params.n <= 0:
        raise InvalidArgument(f"sampling_params.n must be >= 1 (got {params.n})")
    if params.max_tokens <= 0:
        raise InvalidArgument(f"sampling_params.max_tokens must be >= 1 (got {params.max_tokens})")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise InvalidArgument(f"sampling_params.temperature must be >= 0 (got {params.temperature})")
    if not 0 < params.top_p <= 1:
        raise InvalidArgument(f"sampling_params.top_p must be in (0, 1] (got {params.top_p})")
    for token in params.stop_token_ids:
        if not 0 <= token < limits.vocab_size:
            raise InvalidArgument(f"unknown stop token id {token}: the vocabulary has ids 0..{limits.vocab_size - 1}")
    if any(not s for s in params.stop):
        raise InvalidArgument("sampling_params.stop holds an empty string")
    longest = limits.max_model_len - params.max_tokens
    if longest < 1:
        raise InvalidArgument(f"max_tokens {params.max_tokens} leaves no room for a prompt in the engine's "
                              f"max_model_len {limits.max_model_len}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise InvalidArgument(f"prompt {i} is empty")
        if len(prompt) > longest:
            raise InvalidArgument(f"prompt {i} has {len(prompt)} tokens; with max_tokens {params.max_tokens} the "
                                  f"engine's max_model_len {limits.max_model_len} allows at most {longest}")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= limits.vocab_size:
            bad = low if low < 0 else high
            raise InvalidArgument(f"prompt {i} has token id {bad} outside the vocabulary (0..{limits.vocab_size - 1})")


def truncate_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """Cuts text before the earliest stop string; returns (text, whether one was found)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
