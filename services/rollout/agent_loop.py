"""The agent loop: one multi-turn sample, token in and token out, against the environment service.

    loop = AgentLoop(EngineTurns(engine, params), env_client, tokenizer, AgentLoopLimits(max_turns=4))
    trajectory = await loop.run(messages, Task("lookup", ground_truth="7", extra_info=row["extra_info"]))

1. Reset a session on the row's task; render the prompt (and the tools the session declares) with the
   chat template, once.
2. The model generates a turn from the token ids so far; its sampled ids, log-probs and weight
   version are kept as they are (never decoded and re-encoded: that is what makes tokens drift).
3. Tool calls are parsed from the turn's text (Hermes / Qwen: <tool_call>{"name", "arguments"}</tool_call>);
   a turn without is the final answer. The turn goes to the environment's Step.
4. The observation's messages are rendered into the chat template's tokens for them, tokenized once,
   and appended (loss mask 0). Then 2 again, until the environment says done, or max_turns, or
   max_total_tokens.
A failing environment (down, past its deadline, answering garbage) ends this sample with status
"env_failed" and the error's status code and words; it never raises, so the other samples of a step
go on. The engine failing is raised (the request fails, as a single-turn one would).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from rlfabric.core.client import ServiceClient
from rlfabric.core.errors import DeadlineExceeded, RlfabricError
from rlfabric.env.client import EnvInterface
from rlfabric.env.items import Action, Message, StepResult, Task, ToolCall, ToolSpec
from rlfabric.rollout.routes import join_routes
from rlfabric.rollout.types import Finish, FinishedSample, SamplingSpec, TurnInfo, compact_versions, row_seed

log = logging.getLogger("rlfabric.rollout")

# How a trajectory ended.
DONE = "done"  # the environment said done
MAX_TURNS = "max_turns"
MAX_TOKENS = "max_tokens"  # max_total_tokens reached, or a turn cut at its own max_tokens
ENV_FAILED = "env_failed"  # the environment failed (error, deadline, garbage): the sample is unusable

ENV_CALL_GRACE_S = 1.0  # how long past a gRPC environment call's deadline the agent loop gives up on it itself
ENV_TOKEN_VERSION = -1  # weight_versions entry of a token the environment gave (not sampled)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_TURN_MARKER = "@@rlfabric-assistant-turn@@"


@dataclass(frozen=True)
class AgentLoopLimits:
    """When a trajectory stops, and how long the environment may take."""

    max_turns: int = 8
    """Most model turns."""
    max_tokens_per_turn: int = 256
    """Most tokens the model may generate in one turn."""
    max_total_tokens: int = 1024
    """Most response tokens in all (the model's and the environment's)."""
    env_timeout_s: float = 30.0
    """Deadline of each environment call."""


@dataclass
class Trajectory:
    """One multi-turn sample: every list is aligned with response_ids."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """1 for a token the model sampled, 0 for one the environment gave."""
    logprobs: list[float] = field(default_factory=list)
    """The sampling log-prob of each model token; 0.0 for environment tokens."""
    weight_versions: list[int] = field(default_factory=list)
    """The weight version that sampled each model token; ENV_TOKEN_VERSION for environment tokens."""
    turns: list[TurnInfo] = field(default_factory=list)
    reward: float = 0.0
    """The sum of the environment's step rewards."""
    status: str = ""
    """DONE, MAX_TURNS, MAX_TOKENS or ENV_FAILED."""
    error: str = ""
    """What failed, when status is ENV_FAILED."""
    routes: np.ndarray | None = None
    """[tokens, layers, top_k] the experts of prompt_ids + response_ids' first tokens, each from the first turn
    that ran it (rollout.routes.join_routes); None unless the engine records them (actor.router_replay)."""

    def append(self, token_ids: Sequence[int], model: bool, logprobs: Sequence[float] = (), version: int = 0,
               versions: Sequence[int] = (), routes: np.ndarray | None = None) -> None:
        """Adds a model turn (its tokens sampled under `version`, or per token under `versions` when a
        weight switch reached the turn mid-generation, and the routes its call recorded) or the environment's
        tokens (model=False)."""
        if model:
            self.routes = join_routes(self.routes, routes)
        self.response_ids += token_ids
        self.loss_mask += [1 if model else 0] * len(token_ids)
        self.logprobs += list(logprobs) if model else [0.0] * len(token_ids)
        if not model:
            self.weight_versions += [ENV_TOKEN_VERSION] * len(token_ids)
        elif versions:
            if len(versions) != len(token_ids):
                raise ValueError(f"{len(versions)} versions for {len(token_ids)} tokens")
            self.weight_versions += versions
        else:
            self.weight_versions += [version] * len(token_ids)

    def versions(self, default: int) -> tuple[int, list[tuple[int, int]]]:
        """(weight_version, version_spans) of the response as a FinishedSample has them (compact_versions):
        an environment token takes the version of the model turn before it, so the oldest token's version
        is exact; `default` for a response with no model token."""
        spans: list[tuple[int, int]] = []
        for index, version in enumerate(self.weight_versions):
            if version != ENV_TOKEN_VERSION and (not spans or spans[-1][0] != version):
                spans.append((version, index))
        return compact_versions(spans) if spans else (default, [])


class EnvFailure(Exception):
    """An environment call failed (its error, deadline or garbage): ends the sample, not the request."""


class TurnGenerator(Protocol):
    """Generates one model turn from token ids (the prompt so far)."""

    async def generate_turn(self, prompt_ids: list[int], max_tokens: int) -> FinishedSample: ...


class EngineTurns:
    """TurnGenerator over a RolloutEngine (one sample of one prompt per turn, log-probs on)."""

    def __init__(self, engine: Any, params: SamplingSpec):
        self.engine = engine
        self.params = replace(params, n=1, logprobs=True, stop=(), multi_turn=None)  # stop strings would cut tokens
        self.turns = 0

    async def generate_turn(self, prompt_ids: list[int], max_tokens: int) -> FinishedSample:
        # With a seed, each turn draws its own (the same seed every turn would repeat its choices).
        seed = None if self.params.seed is None else row_seed(self.params.seed, self.turns, 0)
        self.turns += 1
        async for sample in self.engine.generate([prompt_ids], replace(self.params, max_tokens=max_tokens, seed=seed)):
            return sample
        raise RuntimeError("the engine finished a request without its sample")


def parse_tool_calls(text: str) -> tuple[ToolCall, ...]:
    """The Hermes tool calls of a turn's text, in order: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
    A call whose body is not such an object comes out with an empty name and its raw body as arguments,
    so the environment answers it as a malformed call the model reads."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except ValueError:
            calls.append(ToolCall("", body))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            calls.append(ToolCall("", body))
            continue
        arguments = call.get("arguments", {})
        calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return tuple(calls)


def render_prompt(tokenizer: Any, messages: Sequence[Mapping[str, str]], tools: Sequence[ToolSpec]) -> list[int]:
    """Token ids of the conversation's start with the tools declared, as the chat template writes them."""
    schemas = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                 "parameters": t.parameters}} for t in tools]
    text = tokenizer.apply_chat_template([dict(m) for m in messages], tools=schemas or None,
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def observation_ids(tokenizer: Any, observation: Sequence[Message], turn_ids: Sequence[int]) -> list[int]:
    """The tokens that follow a model turn (turn_ids) in the chat template when the observation's
    messages come next: the rest of the turn's end, the messages, the next assistant header. Rendered
    after a placeholder conversation and tokenized once; the history is never re-tokenized."""
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN_MARKER}]
    following = [{"role": m.role, "content": m.content} for m in observation]
    text = tokenizer.apply_chat_template(base + following, add_generation_prompt=True, tokenize=False)
    after = text[text.rindex(_TURN_MARKER) + len(_TURN_MARKER):]
    ended_with = tokenizer.decode(list(turn_ids[-1:])) if turn_ids else ""
    if ended_with and turn_ids[-1] in _end_of_turn_ids(tokenizer) and after.startswith(ended_with):
        after = after[len(ended_with):]  # the model already sampled the turn's end
    return list(tokenizer.encode(after, add_special_tokens=False))


def _end_of_turn_ids(tokenizer: Any) -> set[int]:
    ids = tokenizer.eos_token_id
    return set(ids) if isinstance(ids, list) else {ids} if ids is not None else set()


class AgentLoop:
    """Runs multi-turn samples: one run() per sample; many run concurrently (their env calls too)."""

    def __init__(self, generator: TurnGenerator, env: EnvInterface, tokenizer: Any, limits: AgentLoopLimits):
        self.generator = generator
        self.env = env
        self.tokenizer = tokenizer
        self.limits = limits

    async def run(self, messages: Sequence[Mapping[str, str]], task: Task) -> Trajectory:
        """One trajectory; never raises for an environment's failure (status ENV_FAILED instead). The
        generator's errors (the engine failing) are raised: they are not this sample's fault."""
        try:
            session = await self._env_call("Reset", self.env.reset(task, self.limits.env_timeout_s))
        except EnvFailure as failure:  # the prompt without tools, so the sample still has one
            return Trajectory(render_prompt(self.tokenizer, messages, []), status=ENV_FAILED, error=str(failure))
        trajectory = Trajectory(render_prompt(self.tokenizer, messages, session.tools))
        if session.observation:
            trajectory.append(observation_ids(self.tokenizer, session.observation, []), model=False)
        try:
            await self._turns(trajectory, session.session_id)
        except EnvFailure as failure:
            trajectory.status, trajectory.error = ENV_FAILED, str(failure)
        finally:
            await self._close_quietly(session.session_id)
        return trajectory

    async def _turns(self, trajectory: Trajectory, session_id: str) -> None:
        limits = self.limits
        for _ in range(limits.max_turns):
            room = limits.max_total_tokens - len(trajectory.response_ids)
            if room <= 0:
                trajectory.status = MAX_TOKENS
                return
            # 1. The model's turn, from the ids so far.
            sample = await self.generator.generate_turn(trajectory.prompt_ids + trajectory.response_ids,
                                                        min(limits.max_tokens_per_turn, room))
            trajectory.append(sample.token_ids, model=True, logprobs=sample.logprobs, version=sample.weight_version,
                              versions=sample.token_versions() if sample.version_spans else (),
                              routes=sample.routed_experts)
            text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            action = Action(text, parse_tool_calls(text))
            turn = TurnInfo(len(sample.token_ids), 0, [c.name for c in action.tool_calls], "", 0.0,
                            sample.finish_reason.value, sample.weight_version)
            trajectory.turns.append(turn)
            if sample.finish_reason != Finish.STOP:  # cut off mid-turn: nothing whole to act on
                trajectory.status = MAX_TOKENS
                return
            # 2. The environment's answer.
            started = time.monotonic()
            result: StepResult = await self._env_call("Step", self.env.step(session_id, action, limits.env_timeout_s))
            turn.env_seconds = time.monotonic() - started
            turn.step_status, turn.reward = result.status, result.reward
            trajectory.reward += result.reward
            if result.done:
                trajectory.status = DONE
                return
            # 3. Its observation as tokens, once.
            observed = observation_ids(self.tokenizer, result.observation, sample.token_ids)
            if len(trajectory.response_ids) + len(observed) >= limits.max_total_tokens:
                trajectory.status = MAX_TOKENS
                return
            trajectory.append(observed, model=False)
            turn.observation_tokens = len(observed)
        trajectory.status = MAX_TURNS

    async def _env_call(self, name: str, call):
        """An environment call, also bounded here (an in-process client has no gRPC deadline); its
        failure as an EnvFailure naming the call and the status code. Over gRPC the bound here comes a
        little after the call's own deadline, so the client says what went wrong (it knows whether the
        environment was reached: UNAVAILABLE, or DEADLINE_EXCEEDED)."""
        try:
            grace = ENV_CALL_GRACE_S if isinstance(self.env, ServiceClient) else 0.0
            return await asyncio.wait_for(call, self.limits.env_timeout_s + grace)
        except TimeoutError:
            error = DeadlineExceeded(f"the environment took longer than {self.limits.env_timeout_s:g} s")
            raise EnvFailure(f"{name}: {error.code.name}: {error}") from None
        except RlfabricError as error:  # over gRPC the client's words start with the code already
            words = str(error) if str(error).startswith(error.code.name) else f"{error.code.name}: {error}"
            raise EnvFailure(f"{name}: {words}") from None

    async def _close_quietly(self, session_id: str) -> None:
        try:
            await self._env_call("Close", self.env.close_session(session_id, self.limits.env_timeout_s))
        except EnvFailure as failure:  # the session is gone or the env is down: it idles out there
            log.debug("closing environment session %s failed: %s", session_id, failure)
