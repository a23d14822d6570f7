"""Proto <-> domain conversions of the rollout service, used by the servicer and the client."""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from rlfabric.core.errors import InvalidArgument
from rlfabric.rollout.routes import decode_routes, encode_routes
from rlfabric.rollout.types import (
    AgentPrompt,
    AgentTask,
    EngineStatus,
    Finish,
    FinishedSample,
    MultiTurnSpec,
    PromptInput,
    SamplingSpec,
    TurnInfo,
)
from rlfabric.v1 import common_pb2, rollout_pb2
from rlfabric.weight_sync.devices import DeviceReport

_FINISH_TO_PROTO = {
    Finish.STOP: rollout_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: rollout_pb2.FINISH_REASON_LENGTH,
    Finish.ABORT: rollout_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def sampling_from_proto(params: rollout_pb2.SamplingParams) -> SamplingSpec:
    """The proto's zero values mean: top_p 0 -> 1, top_k 0 -> off; n and max_tokens 0 stay (invalid)."""
    return SamplingSpec(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p or 1.0,
        top_k=params.top_k if params.top_k > 0 else -1,
        max_tokens=params.max_tokens,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        seed=params.seed if params.HasField("seed") else None,
        logprobs=params.logprobs,
        multi_turn=_multi_turn_from_proto(params.multi_turn) if params.HasField("multi_turn") else None,
    )


def _multi_turn_from_proto(params: rollout_pb2.MultiTurnParams) -> MultiTurnSpec:
    return MultiTurnSpec(env_address=params.env_address, max_turns=params.max_turns,
                         max_total_tokens=params.max_total_tokens, tool_call_format=params.tool_call_format,
                         env_timeout_s=params.env_timeout_s)


def _multi_turn_to_proto(spec: MultiTurnSpec | None) -> rollout_pb2.MultiTurnParams | None:
    if spec is None:
        return None
    return rollout_pb2.MultiTurnParams(env_address=spec.env_address, max_turns=spec.max_turns,
                                       max_total_tokens=spec.max_total_tokens,
                                       tool_call_format=spec.tool_call_format, env_timeout_s=spec.env_timeout_s)


def sampling_to_proto(spec: SamplingSpec) -> rollout_pb2.SamplingParams:
    return rollout_pb2.SamplingParams(
        n=spec.n, temperature=spec.temperature, top_p=spec.top_p, top_k=max(spec.top_k, 0),
        max_tokens=spec.max_tokens, stop=list(spec.stop), stop_token_ids=list(spec.stop_token_ids),
        seed=spec.seed, logprobs=spec.logprobs, multi_turn=_multi_turn_to_proto(spec.multi_turn),
    )


def prompt_to_proto(prompt: PromptInput) -> rollout_pb2.Prompt:
    if isinstance(prompt, AgentPrompt):
        task = prompt.task
        return rollout_pb2.Prompt(messages=_messages_to_proto(prompt.messages), task=rollout_pb2.AgentTask(
            environment=task.environment, ground_truth=task.ground_truth,
            extra_info_json=json.dumps(dict(task.extra_info)) if task.extra_info else ""))
    if len(prompt) and isinstance(prompt[0], Mapping):
        return rollout_pb2.Prompt(messages=_messages_to_proto(prompt))
    return rollout_pb2.Prompt(token_ids=[int(t) for t in prompt])


def _messages_to_proto(messages) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def prompt_from_proto(prompt: rollout_pb2.Prompt) -> PromptInput:
    """Token ids when set, else the chat messages (the engine renders them), with a task an AgentPrompt."""
    if prompt.token_ids:
        return list(prompt.token_ids)
    messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
    if prompt.HasField("task"):
        return AgentPrompt(messages, _task_from_proto(prompt.task))
    return messages


def _task_from_proto(task: rollout_pb2.AgentTask) -> AgentTask:
    try:
        extra_info = json.loads(task.extra_info_json or "{}")
    except ValueError as error:
        raise InvalidArgument(f"task.extra_info_json is not JSON: {error}") from None
    if not isinstance(extra_info, dict):
        raise InvalidArgument("task.extra_info_json must be a JSON object")
    return AgentTask(task.environment, task.ground_truth, extra_info)


def sample_to_proto(sample: FinishedSample) -> rollout_pb2.Sample:
    return rollout_pb2.Sample(
        prompt_index=sample.prompt_index, sample_index=sample.sample_index, token_ids=sample.token_ids,
        logprobs=sample.logprobs, finish_reason=_FINISH_TO_PROTO[sample.finish_reason],
        weight_version=sample.weight_version, text=sample.text,
        prompt_token_ids=sample.prompt_ids, loss_mask=sample.loss_mask,
        turns=[rollout_pb2.AgentTurn(
            model_tokens=t.model_tokens, observation_tokens=t.observation_tokens, tool_calls=t.tool_calls,
            step_status=t.step_status, reward=t.reward, weight_version=t.weight_version,
            env_seconds=t.env_seconds, finish_reason=t.finish_reason) for t in sample.turns],
        agent_status=sample.agent_status, agent_error=sample.agent_error, env_reward=sample.env_reward,
        version_spans=[rollout_pb2.VersionSpan(version=v, first_token=i) for v, i in sample.version_spans],
        routed_experts=_routes_to_proto(sample.routed_experts),
    )


def _routes_to_proto(routes) -> rollout_pb2.RoutedExperts | None:
    if routes is None:
        return None
    ids, layers, top_k, id_bytes = encode_routes(routes)
    return rollout_pb2.RoutedExperts(ids=ids, layers=layers, top_k=top_k, id_bytes=id_bytes)


def sample_from_proto(sample: rollout_pb2.Sample) -> FinishedSample:
    """The sample with its per-token fields as numpy arrays: np.array reads a packed repeated field in
    one pass, ~8x faster than list() (which makes a Python object per token) and in 1/4 to 1/6 the memory."""
    return FinishedSample(
        prompt_index=sample.prompt_index, sample_index=sample.sample_index,
        token_ids=np.array(sample.token_ids, dtype=np.int64), logprobs=np.array(sample.logprobs, dtype=np.float32),
        finish_reason=_FINISH_FROM_PROTO[sample.finish_reason], weight_version=sample.weight_version,
        text=sample.text, prompt_ids=np.array(sample.prompt_token_ids, dtype=np.int64),
        loss_mask=np.array(sample.loss_mask, dtype=np.int32),
        turns=[TurnInfo(t.model_tokens, t.observation_tokens, list(t.tool_calls), t.step_status, t.reward,
                        t.finish_reason, t.weight_version, t.env_seconds) for t in sample.turns],
        agent_status=sample.agent_status, agent_error=sample.agent_error, env_reward=sample.env_reward,
        version_spans=[(span.version, span.first_token) for span in sample.version_spans],
        routed_experts=_routes_from_proto(sample),
    )


def _routes_from_proto(sample: rollout_pb2.Sample) -> np.ndarray | None:
    if not sample.HasField("routed_experts"):
        return None
    message = sample.routed_experts
    return decode_routes(message.ids, message.layers, message.top_k, message.id_bytes)


def status_to_proto(status: EngineStatus) -> rollout_pb2.RolloutServiceGetStatusResponse:
    return rollout_pb2.RolloutServiceGetStatusResponse(
        engine=status.engine, model=status.model, weight_version=status.weight_version,
        queue_depth=status.queue_depth, kv_cache_usage=status.kv_cache_usage, paused=status.paused,
        sleeping=status.sleeping, rss_bytes=status.rss_bytes, device_memory_bytes=status.device_memory_bytes,
        device=status.device.to_proto(),
    )


def status_from_proto(status: rollout_pb2.RolloutServiceGetStatusResponse) -> EngineStatus:
    return EngineStatus(
        engine=status.engine, model=status.model, weight_version=status.weight_version,
        queue_depth=status.queue_depth, kv_cache_usage=status.kv_cache_usage, paused=status.paused,
        sleeping=status.sleeping, rss_bytes=status.rss_bytes, device_memory_bytes=status.device_memory_bytes,
        device=DeviceReport.from_proto(status.device),
    )


def sample_order(sample: FinishedSample) -> tuple[int, int]:
    return sample.prompt_index, sample.sample_index
