"""Multi-turn requests of the rollout service: every (prompt, sample) of the request is one AgentLoop
against the environment service, each model turn an ordinary generate request on the engine.

    rollouts = AgentRollouts(engine, config)          # or AgentRollouts(engine, config, env=an EnvInterface)
    async for sample in rollouts.generate([AgentPrompt(messages, AgentTask("lookup", "7", extra))],
                                          SamplingSpec(n=4, max_tokens=64, multi_turn=MultiTurnSpec(max_turns=3))):
        sample.loss_mask  # 1 = the model's token, 0 = the environment's

This sits above the engine, which knows nothing of agents: the servicer and the in-process client hand a
request whose SamplingSpec.multi_turn is set here, and all this asks of the engine is a TurnEngine
(single-turn generate, its tokenizer, the version it serves); an agent gateway would ask the same.
Samples are yielded as they finish; rows run concurrently (their environment calls too), at most
rollout.max_num_seqs (and rollout.max_pending_requests) at once over all requests, so their turns stay
within the engine's batch and its admission limit. A failing environment ends its sample with agent_status
"env_failed" (left out of training by the coordinator); the engine failing fails the request, as it would a
single-turn one. A request may name its environment service (multi_turn.env_address), but only one this
replica's own config names (allowed_env_addresses): any other is PERMISSION_DENIED, before a connection is made.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from rlfabric.core.client import ChannelOptions
from rlfabric.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from rlfabric.env.client import EnvClient, EnvInterface
from rlfabric.env.items import Task
from rlfabric.rollout.agent_loop import MAX_TOKENS, AgentLoop, AgentLoopLimits, EngineTurns, Trajectory
from rlfabric.rollout.routes import padded_routes
from rlfabric.rollout.types import (
    AgentPrompt,
    Finish,
    FinishedSample,
    MultiTurnSpec,
    PromptInput,
    SamplingSpec,
    check_chat_roles,
    row_seed,
)

if TYPE_CHECKING:
    from rlfabric.core.config import RunConfig

TOOL_CALL_FORMATS = ("hermes",)


class TurnEngine(Protocol):
    """What multi-turn requests ask of a rollout engine (a RolloutEngine is one): single-turn requests, the
    tokenizer whose chat template renders the conversation, and the weight version it serves."""

    tokenizer: Any
    weight_version: int

    def check_started(self) -> None:
        """FailedPrecondition until the engine can generate."""

    def generate(self, prompts: Sequence[PromptInput], params: SamplingSpec) -> AsyncIterator[FinishedSample]:
        """Each sample of a single-turn request as it finishes."""

    def decode(self, token_ids: Sequence[int]) -> str: ...


class AgentRollouts:
    """The multi-turn requests of one engine, and the environment clients they call: `env` when given (every
    request calls it), else one per allowed address of the replica's config, made on first use."""

    def __init__(self, engine: TurnEngine, config: RunConfig, env: EnvInterface | None = None):
        self.engine = engine
        self.config = config
        self._env_clients: dict[str, EnvInterface] = {}
        self._given_env = env
        # Rows running at once, over all requests: each runs one turn request at a time, so this keeps
        # them within the engine's batch and its admission limit.
        rollout = config.rollout
        self._rows = asyncio.Semaphore(min(rollout.max_num_seqs, rollout.max_pending_requests or rollout.max_num_seqs))

    async def generate(self, prompts: Sequence[PromptInput], params: SamplingSpec) -> AsyncIterator[FinishedSample]:
        """Each (prompt, sample) as one trajectory, yielded as it finishes."""
        check_chat_roles(prompts)
        spec = params.multi_turn
        agent_prompts = self._check(prompts, params)
        env = self._env(spec.env_address)
        limits = AgentLoopLimits(max_turns=spec.max_turns, max_tokens_per_turn=params.max_tokens,
                                 max_total_tokens=spec.max_total_tokens, env_timeout_s=spec.env_timeout_s)

        async def row(prompt_index: int, sample_index: int) -> FinishedSample:
            async with self._rows:
                seed = None if params.seed is None else row_seed(params.seed, prompt_index, sample_index)
                turns = EngineTurns(self.engine, replace(params, seed=seed))
                loop = AgentLoop(turns, env, self.engine.tokenizer, limits)
                prompt = agent_prompts[prompt_index]
                trajectory = await loop.run(prompt.messages, _env_task(prompt))
            return self._sample(prompt_index, sample_index, trajectory)

        tasks = [asyncio.create_task(row(p, s)) for p in range(len(agent_prompts)) for s in range(params.n)]
        try:
            for finished in asyncio.as_completed(tasks):
                yield await finished
        finally:  # done, failed, or the caller went away: no row outlives the request
            for task in tasks:
                task.cancel()

    def _check(self, prompts: Sequence[PromptInput], params: SamplingSpec) -> list[AgentPrompt]:
        """The prompts as AgentPrompts, or InvalidArgument / FailedPrecondition naming the problem."""
        spec: MultiTurnSpec = params.multi_turn
        self.engine.check_started()
        if self.engine.tokenizer is None:
            raise FailedPrecondition(f"model {self.config.model.path} has no tokenizer: multi-turn needs its chat template")
        if not prompts:
            raise InvalidArgument("no prompts: a request needs at least one prompt")
        for index, prompt in enumerate(prompts):
            if not isinstance(prompt, AgentPrompt) or not prompt.messages:
                raise InvalidArgument(f"prompt {index}: a multi-turn prompt needs chat messages and a task")
        if params.n <= 0 or params.max_tokens <= 0:
            raise InvalidArgument(f"sampling_params.n and max_tokens must be >= 1 (got {params.n}, {params.max_tokens})")
        if spec.max_turns <= 0 or spec.max_total_tokens <= 0:
            raise InvalidArgument(f"multi_turn.max_turns and max_total_tokens must be >= 1 "
                                  f"(got {spec.max_turns}, {spec.max_total_tokens})")
        if spec.tool_call_format not in TOOL_CALL_FORMATS:
            raise InvalidArgument(f"multi_turn.tool_call_format {spec.tool_call_format!r} is not known "
                                  f"(known: {', '.join(TOOL_CALL_FORMATS)})")
        if not spec.env_timeout_s > 0:
            raise InvalidArgument(f"multi_turn.env_timeout_s must be > 0 (got {spec.env_timeout_s})")
        rows, most = len(prompts) * params.n, self.config.rollout.max_rows_per_request
        if rows > most:
            raise ResourceExhausted(f"{rows} multi-turn samples in one request; this replica takes at most {most} "
                                    "(rollout.max_rows_per_request): split the request")
        return list(prompts)

    def _env(self, address: str) -> EnvInterface:
        """The environment client of the request's address, else rollout.multi_turn.env_address, else cluster.env;
        PermissionDenied for an address this replica's config does not name (allowed_env_addresses), so there
        is one client per allowed address at most."""
        if self._given_env is not None:
            return self._given_env
        config = self.config
        address = address or config.rollout.multi_turn.env_address or next(iter(config.cluster.env), "")
        if not address:
            raise FailedPrecondition("a multi-turn request names no environment service, and this rollout replica "
                                     "knows none: set rollout.multi_turn.env_address or cluster.env")
        allowed = allowed_env_addresses(config)
        if address not in allowed:
            # A caller must not make the replica connect, with the environment's token, wherever it likes.
            raise PermissionDenied(
                f"multi_turn.env_address {address[:200]!r} is not an environment service this rollout replica may "
                f"call (it calls {', '.join(allowed) or 'none'}): its operator adds the address to the replica's "
                "rollout.multi_turn.allowed_env_addresses (or rollout.multi_turn.env_address, cluster.env)")
        if address not in self._env_clients:
            self._env_clients[address] = EnvClient(address, ChannelOptions.for_env(config))  # not the mesh's token
        return self._env_clients[address]

    def _sample(self, prompt_index: int, sample_index: int, trajectory: Trajectory) -> FinishedSample:
        turns = trajectory.turns
        if turns and turns[-1].finish_reason == Finish.ABORT.value:
            finish = Finish.ABORT
        else:
            finish = Finish.LENGTH if trajectory.status == MAX_TOKENS else Finish.STOP
        # Per-token versions over the turns (a model turn under the version that sampled it, or its own spans
        # when it was a partial rollout): the oldest token's version is weight_version, as for one turn.
        weight_version, version_spans = trajectory.versions(default=self.engine.weight_version)
        return FinishedSample(
            prompt_index, sample_index, trajectory.response_ids, trajectory.logprobs, finish, weight_version,
            text=self.engine.decode(trajectory.response_ids), prompt_ids=trajectory.prompt_ids,
            loss_mask=trajectory.loss_mask, turns=turns, agent_status=trajectory.status,
            agent_error=trajectory.error, env_reward=trajectory.reward, version_spans=version_spans,
            routed_experts=padded_routes(trajectory.routes, len(trajectory.prompt_ids) + len(trajectory.response_ids)))

    async def close(self) -> None:
        for client in self._env_clients.values():
            await client.close()
        self._env_clients.clear()


def allowed_env_addresses(config: RunConfig) -> list[str]:
    """The environment services a rollout replica of this config calls, all from its operator's config:
    rollout.multi_turn.env_address, cluster.env and rollout.multi_turn.allowed_env_addresses."""
    multi_turn = config.rollout.multi_turn
    named = (multi_turn.env_address, *config.cluster.env, *multi_turn.allowed_env_addresses)
    return list(dict.fromkeys(address for address in named if address))


def _env_task(prompt: AgentPrompt) -> Task:
    """The environment's Task of a prompt: its last user message is the prompt text."""
    users = [m["content"] for m in prompt.messages if m["role"] == "user"]
    task = prompt.task
    return Task(task.environment, users[-1] if users else "", task.ground_truth, dict(task.extra_info))
