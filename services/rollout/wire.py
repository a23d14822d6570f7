"""Proto <-> domain conversions of the rollout service, used by the servicer and the client."""

from __future__ import annotations

from collections.abc import Mapping

from rlfabric.rollout.types import EngineStatus, Finish, FinishedSample, PromptInput, SamplingSpec
from rlfabric.v1 import rollout_pb2

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
    )


def sampling_to_proto(spec: SamplingSpec) -> rollout_pb2.SamplingParams:
    return rollout_pb2.SamplingParams(
        n=spec.n, temperature=spec.temperature, top_p=spec.top_p, top_k=max(spec.top_k, 0),
        max_tokens=spec.max_tokens, stop=list(spec.stop), stop_token_ids=list(spec.stop_token_ids),
        seed=spec.seed, logprobs=spec.logprobs,
    )


def prompt_to_proto(prompt: PromptInput) -> rollout_pb2.Prompt:
    if len(prompt) and isinstance(prompt[0], Mapping):
        return rollout_pb2.Prompt(messages=[rollout_pb2.ChatMessage(role=m["role"], content=m["content"])
                                            for m in prompt])
    return rollout_pb2.Prompt(token_ids=[int(t) for t in prompt])


def prompt_from_proto(prompt: rollout_pb2.Prompt) -> list[int] | list[dict[str, str]]:
    """Token ids when set, else the chat messages (the engine renders them)."""
    if prompt.token_ids:
        return list(prompt.token_ids)
    return [{"role": m.role, "content": m.content} for m in prompt.messages]


def sample_to_proto(sample: FinishedSample) -> rollout_pb2.Sample:
    return rollout_pb2.Sample(
        prompt_index=sample.prompt_index, sample_index=sample.sample_index, token_ids=sample.token_ids,
        logprobs=sample.logprobs, finish_reason=_FINISH_TO_PROTO[sample.finish_reason],
        weight_version=sample.weight_version, text=sample.text,
        version_spans=[rollout_pb2.VersionSpan(version=v, first_token=i) for v, i in sample.version_spans],
    )


def sample_from_proto(sample: rollout_pb2.Sample) -> FinishedSample:
    return FinishedSample(
        prompt_index=sample.prompt_index, sample_index=sample.sample_index, token_ids=list(sample.token_ids),
        logprobs=list(sample.logprobs), finish_reason=_FINISH_FROM_PROTO[sample.finish_reason],
        weight_version=sample.weight_version, text=sample.text,
        version_spans=[(span.version, span.first_token) for span in sample.version_spans],
    )


def status_to_proto(status: EngineStatus) -> rollout_pb2.RolloutServiceGetStatusResponse:
    return rollout_pb2.RolloutServiceGetStatusResponse(
        engine=status.engine, model=status.model, weight_version=status.weight_version,
        queue_depth=status.queue_depth, kv_cache_usage=status.kv_cache_usage, paused=status.paused,
        sleeping=status.sleeping, rss_bytes=status.rss_bytes, device_memory_bytes=status.device_memory_bytes,
    )


def status_from_proto(status: rollout_pb2.RolloutServiceGetStatusResponse) -> EngineStatus:
    return EngineStatus(
        engine=status.engine, model=status.model, weight_version=status.weight_version,
        queue_depth=status.queue_depth, kv_cache_usage=status.kv_cache_usage, paused=status.paused,
        sleeping=status.sleeping, rss_bytes=status.rss_bytes, device_memory_bytes=status.device_memory_bytes,
    )


def sample_order(sample: FinishedSample) -> tuple[int, int]:
    return sample.prompt_index, sample.sample_index
