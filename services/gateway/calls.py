"""One call of an agent, from its request to its record: replay a retry, check the limits, build the prompt
ids (reusing an extended call's ids), sample with the run's settings, record.

    handler = CallHandler(config, tokenizer, RouterGenerator(router))
    call = await handler.chat(episode, request, request_hash, is_retry=False)

The rollout is reached through a TokenGenerator (token ids in, one FinishedSample out): RouterGenerator
over the coordinator's RolloutRouter, each episode's key its routing key, so every engine serves the gateway
and an episode stays on one replica (its prefix cache).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
from jinja2 import TemplateError
from prometheus_client import CollectorRegistry, Histogram

from rlfabric.core.config import RunConfig
from rlfabric.core.errors import InvalidArgument, ResourceExhausted, RlfabricError
from rlfabric.core.metrics import RPC_SECONDS_BUCKETS, service_histogram
from rlfabric.gateway.episodes import Episode, EpisodeStore
from rlfabric.gateway.openai_api import ChatRequest, CompletionRequest, OpenAIError
from rlfabric.gateway.render import ChatRenderer, message_key, tools_key
from rlfabric.gateway.replies import parse_reply
from rlfabric.gateway.segments import RecordedCall
from rlfabric.rollout.routes import join_routes, padded_routes
from rlfabric.rollout.types import Finish, FinishedSample, SamplingSpec, compact_versions, row_seed

LATENCIES_KEPT = 100_000  # call latencies kept between two take_metrics (the newest)
CALL_LATENCY = "rlfabric_agent_call_latency_seconds"
_histograms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def call_latency_histogram(registry: CollectorRegistry) -> Histogram:
    """The registry's rlfabric_agent_call_latency_seconds, made once (a coordinator runs one gateway per run)."""
    if registry not in _histograms:
        _histograms[registry] = service_histogram(
            registry, CALL_LATENCY, "Seconds from a call's request to its reply through the agent gateway (render, "
            "wait for a replica, generate, parse); calls answered from the record or refused are not counted.",
            buckets=RPC_SECONDS_BUCKETS)
    return _histograms[registry]


class TokenGenerator(Protocol):
    """What the gateway asks of the rollout side."""

    async def generate(self, prompt_ids: list[int], params: SamplingSpec, routing_key: str) -> FinishedSample:
        """One sample of one prompt."""

    def release(self, routing_key: str) -> None:
        """The key's episode ended."""


class RouterGenerator:
    """TokenGenerator over a RolloutRouter (or anything with its generate(..., routing_key=) and release)."""

    def __init__(self, router: Any):
        self.router = router

    async def generate(self, prompt_ids: list[int], params: SamplingSpec, routing_key: str) -> FinishedSample:
        (sample,) = await self.router.generate([prompt_ids], params, routing_key=routing_key)
        return sample

    def release(self, routing_key: str) -> None:
        self.router.release(routing_key)


@dataclass
class SamplingPolicy:
    """The run's sampling settings, and whether an agent's own replace them (agent.gateway.honour_agent_sampling)."""

    temperature: float
    top_p: float
    top_k: int
    honour_agent: bool

    def resolve(self, request: ChatRequest | CompletionRequest) -> tuple[float, float, int, bool]:
        """(temperature, top_p, top_k, whether the agent asked for others)."""
        asked = {"temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k}
        run = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        differs = any(value is not None and value != run[name] and not (name == "top_k" and value <= 0 and run[name] <= 0)
                      for name, value in asked.items())
        differs = differs or bool(request.stop)  # stop strings would cut sampled tokens: never applied
        if self.honour_agent:
            run = {name: (asked[name] if asked[name] is not None else run[name]) for name in run}
        return run["temperature"], run["top_p"], run["top_k"], differs


class CallHandler:
    """Runs the calls of every episode; counts what agent/* metrics report."""

    def __init__(self, config: RunConfig, tokenizer: Any, generator: TokenGenerator, episodes: EpisodeStore,
                 registry: CollectorRegistry | None = None):
        settings = config.agent.gateway
        self.settings = settings
        self.generator = generator
        self.episodes = episodes
        self.renderer = ChatRenderer(tokenizer)
        rollout = config.rollout
        self.sampling = SamplingPolicy(rollout.temperature, rollout.top_p, rollout.top_k,
                                       settings.honour_agent_sampling)
        self.max_tokens = settings.max_tokens_per_call or rollout.response_length or config.data.max_response_length
        self.inflight = 0
        self.counts: Counter[str] = Counter()  # calls, retries_replayed, sampling_overrides, tool_parse_errors, ...
        self.latencies: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self.latency_histogram = call_latency_histogram(registry) if registry is not None else None

    # -- the two kinds of call ---------------------------------------------------------------------------

    async def chat(self, episode: Episode, request: ChatRequest, request_hash: str, is_retry: bool) -> RecordedCall:
        started = time.monotonic()
        replayed = await self._replay(episode, request_hash, is_retry)
        if replayed is not None:
            return replayed
        messages, tools = request.messages, request.tools
        parent, new_messages = self._extended(episode, messages, tools)
        try:
            if parent is not None:
                prompt_ids = parent.prompt_ids + parent.token_ids + self.renderer.continuation_ids(new_messages,
                                                                                                    parent.token_ids)
            else:
                prompt_ids = self.renderer.prompt_ids(messages, tools)
        except (TemplateError, ValueError, TypeError, KeyError) as error:  # the template refused these messages
            raise OpenAIError(400, f"the model's chat template cannot render these messages: {error}",
                              "invalid_messages", param="messages") from None

        def reply_of(call: RecordedCall) -> None:
            reply = parse_reply(call.text, self.settings.tool_call_format,
                                tools if request.tool_choice != "none" else None, call.call_id)
            self.counts["tool_parse_errors"] += reply.parse_error
            self.counts["tool_calls"] += len(reply.tool_calls)
            call.message = reply.message()
            key = (tools_key(tools), *(message_key(m) for m in messages), message_key(call.message))
            episode.conversations[key] = call.number

        return await self._run(episode, request, request_hash, prompt_ids, parent, reply_of, started)

    async def completion(self, episode: Episode, request: CompletionRequest, request_hash: str,
                         is_retry: bool) -> RecordedCall:
        started = time.monotonic()
        replayed = await self._replay(episode, request_hash, is_retry)
        if replayed is not None:
            return replayed
        prompt = request.prompt
        prompt_ids = list(prompt) if isinstance(prompt, list) else list(self.renderer.tokenizer.encode(prompt))
        return await self._run(episode, request, request_hash, prompt_ids, None, lambda call: None, started)

    # -- shared steps ----------------------------------------------------------------------------------

    async def _replay(self, episode: Episode, request_hash: str, is_retry: bool) -> RecordedCall | None:
        """The recorded call of a retried request (waiting for it while it still runs), else None."""
        if not is_retry or request_hash not in episode.by_request:
            return None
        call = await asyncio.shield(episode.by_request[request_hash])
        self.counts["retries_replayed"] += 1
        return call

    def _extended(self, episode: Episode, messages: Sequence[dict], tools) -> tuple[RecordedCall | None, list[dict]]:
        """(the call whose messages and reply the request's messages start with, the messages after them),
        the longest such; (None, messages) when there is none."""
        keys = [message_key(m) for m in messages]
        tools_of = tools_key(tools)
        for end in range(len(messages) - 1, 0, -1):  # at least one new message after the reply
            if keys[end - 1][0] != "assistant":
                continue
            number = episode.conversations.get((tools_of, *keys[:end]))
            if number is not None:
                return episode.calls[number], list(messages[end:])
        return None, list(messages)

    def _limits(self, episode: Episode, request: ChatRequest | CompletionRequest) -> int:
        """The call's max_tokens, or the OpenAIError of the limit it is past."""
        settings = self.settings
        if episode.started_calls >= settings.max_calls_per_episode:
            raise OpenAIError(400, f"this episode made {episode.started_calls} calls, the most "
                                   "agent.gateway.max_calls_per_episode allows", "episode_call_limit")
        left = settings.max_tokens_per_episode - episode.sampled_tokens
        if left <= 0:
            raise OpenAIError(400, f"this episode sampled {episode.sampled_tokens} tokens, the most "
                                   "agent.gateway.max_tokens_per_episode allows", "episode_token_limit")
        if self.inflight >= settings.max_inflight_calls:
            self.counts["rate_limited"] += 1
            raise OpenAIError(429, f"{self.inflight} calls are generating, the most agent.gateway.max_inflight_calls "
                                   "allows: retry shortly", "rate_limit_exceeded", type="requests",
                              headers={"retry-after-ms": str(settings.retry_after_ms),
                                       "retry-after": str(max(1, settings.retry_after_ms // 1000))})
        return min(request.token_budget() or self.max_tokens, self.max_tokens, left)

    async def _run(self, episode: Episode, request, request_hash: str, prompt_ids: list[int],
                   parent: RecordedCall | None, finish, started: float) -> RecordedCall:
        """Samples, records and answers one call; its seconds run from `started` (the request taken) to its
        reply parsed."""
        max_tokens = self._limits(episode, request)
        temperature, top_p, top_k, overridden = self.sampling.resolve(request)
        self.counts["sampling_overrides"] += overridden
        if episode.temperature is not None and not self.sampling.honour_agent:  # validation's, say
            temperature = episode.temperature
        number = episode.started_calls
        seed = row_seed(episode.seed, number, 0) if episode.seed is not None else request.seed
        params = SamplingSpec(n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                              seed=seed, logprobs=True)
        pending: asyncio.Future = asyncio.get_running_loop().create_future()
        episode.by_request[request_hash] = pending
        episode.started_calls += 1
        self.inflight += 1
        try:
            sample = await self._generate(episode, prompt_ids, params)
        except BaseException as error:
            episode.started_calls -= 1
            del episode.by_request[request_hash]  # a retry samples again
            pending.set_exception(error)
            pending.exception()  # retrieved: a failure nobody retried is not logged as unretrieved
            raise
        finally:
            self.inflight -= 1
        token_ids = np.asarray(sample.token_ids).tolist()  # Python ints: the agent gets them as JSON
        call = RecordedCall(number, f"call_{number}", prompt_ids, token_ids, np.asarray(sample.logprobs).tolist(),
                            sample.token_versions(), sample.finish_reason,
                            parent.number if parent is not None else None,
                            text=self.renderer.text(token_ids), routes=sample.routed_experts)
        finish(call)
        call.seconds = time.monotonic() - started
        episode.calls.append(call)
        episode.sampled_tokens += len(call.token_ids)
        self.counts["calls"] += 1
        self.latencies.append(call.seconds)
        if self.latency_histogram is not None:
            self.latency_histogram.observe(call.seconds)
        pending.set_result(call)
        return call

    async def _generate(self, episode: Episode, prompt_ids: list[int], params: SamplingSpec) -> FinishedSample:
        """The engine's sample; OpenAIErrors for what the agent is told (its episode ended meanwhile: 410)."""
        episode_left = max(0.0, self.episodes.seconds_left(episode))
        deadline = min(episode_left, self.settings.call_timeout_s)
        try:
            sample = await asyncio.wait_for(self._sample(prompt_ids, params, episode.key), deadline)
        except TimeoutError:
            if deadline < episode_left:  # the call's own deadline (a sync that does not end): the agent may retry
                self.counts["call_timeouts"] += 1
                retry_after_ms = self.settings.retry_after_ms
                raise OpenAIError(503, f"the call waited agent.gateway.call_timeout_s ({self.settings.call_timeout_s:g}"
                                       " s) for the rollout (held by a weight sync, or generating) and was dropped, "
                                       "unrecorded: retry it", "call_timeout", type="server_error",
                                  headers={"retry-after-ms": str(retry_after_ms),
                                           "retry-after": str(max(1, retry_after_ms // 1000))}) from None
            self.episodes.time_out(episode)
            self.episodes.get(episode.key)  # raises its 410
            raise
        except InvalidArgument as error:  # a prompt past the context, ...: the agent's to fix
            raise OpenAIError(400, str(error), "invalid_request") from None
        except ResourceExhausted as error:
            raise OpenAIError(429, str(error), "rate_limit_exceeded", type="requests",
                              headers={"retry-after-ms": str(self.settings.retry_after_ms)}) from None
        except RlfabricError as error:
            raise OpenAIError(503, f"the rollout could not generate: {error}", "rollout_unavailable",
                              type="server_error") from None
        if not episode.is_open():
            self.episodes.get(episode.key)  # closed while it ran: 410, not recorded
        if len(sample.logprobs) and len(sample.logprobs) != len(sample.token_ids):
            raise OpenAIError(503, "the rollout returned a sample whose log-probs do not match its tokens; retry it",
                              "rollout_aborted", type="server_error")
        return sample

    async def _sample(self, prompt_ids: list[int], params: SamplingSpec, routing_key: str) -> FinishedSample:
        """The call's sample, waiting through pauses: a replica's gate holds a call while it is paused (a weight
        sync, Pause), and one that Pause(abort=True) ended early (Finish.ABORT) goes on as a new request for the
        prompt and what it sampled, with the max_tokens left, held until Resume. Each token keeps the version
        that sampled it; the caller bounds the wait (the episode's time left)."""
        pieces: list[FinishedSample] = []
        sampled: list[int] = []
        while True:
            piece = await self.generator.generate(prompt_ids + sampled, replace(
                params, max_tokens=params.max_tokens - len(sampled)), routing_key)
            pieces.append(piece)
            sampled += np.asarray(piece.token_ids).tolist()
            if piece.finish_reason != Finish.ABORT:
                break
            if len(sampled) >= params.max_tokens:  # aborted, but with every token it may sample
                pieces[-1] = replace(piece, finish_reason=Finish.LENGTH)
                break
            self.counts["calls_resumed"] += 1
        return joined_sample(pieces)

    def take_metrics(self) -> dict[str, float]:
        """agent/* since the last take: counts, and call latency (mean, max)."""
        metrics = {f"agent/{name}": float(count) for name, count in sorted(self.counts.items())}
        if self.latencies:
            metrics["agent/call_seconds/mean"] = sum(self.latencies) / len(self.latencies)
            metrics["agent/call_seconds/max"] = max(self.latencies)
        self.counts.clear()
        self.latencies.clear()
        return metrics


def joined_sample(pieces: Sequence[FinishedSample]) -> FinishedSample:
    """One call's sample from the pieces an abort split it into, in order (each continuing the ones before):
    their tokens and log-probs end to end, each token with the version that sampled it, the last one's finish,
    each token's routes from the first piece that ran it."""
    if len(pieces) == 1:
        return pieces[0]
    tokens: list[int] = []
    logprobs: list[float] = []
    spans: list[tuple[int, int]] = []
    routes = None
    for piece in pieces:
        routes = join_routes(routes, piece.routed_experts)
        own = piece.version_spans or [(piece.weight_version, 0)]
        spans += [(version, len(tokens) + first) for version, first in own]
        tokens += np.asarray(piece.token_ids).tolist()
        logprobs += np.asarray(piece.logprobs).tolist()
    weight_version, version_spans = compact_versions(spans)
    last = pieces[-1].routed_experts
    return replace(pieces[-1], token_ids=tokens, logprobs=logprobs, weight_version=weight_version,
                   version_spans=version_spans, text="",  # the last piece's routes span the prompt and every token
                   routed_experts=None if last is None else padded_routes(routes, len(last)))

