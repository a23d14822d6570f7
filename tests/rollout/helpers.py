"""Shared helpers of the rollout tests: the tiny model, configs, sync gRPC calls, a direct forward."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import grpc
import torch

from rlfabric.core.config import RunConfig, load_config
from rlfabric.rollout import wire
from rlfabric.rollout.types import FinishedSample, SamplingSpec
from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc


def rollout_config(model_path, *overrides: str) -> RunConfig:
    return load_config(None, [f"model.path={model_path}", *overrides])


def tampered_weights(model_path, winner: int) -> dict[str, torch.Tensor]:
    """The model's weights changed so that token `winner` wins at every position, whatever the input:
    attention and MLP outputs are zeroed, every embedding row is the same vector except the winner's,
    which is twice as long, so the tied head scores the winner far above the rest."""
    from safetensors.torch import load_file

    weights = load_file(f"{model_path}/model.safetensors")
    for name, value in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(value)
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones_like(value)
    embed = torch.ones_like(weights["model.embed_tokens.weight"])
    embed[winner] *= 2
    weights["model.embed_tokens.weight"] = embed
    return weights


def original_weights(model_path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{model_path}/model.safetensors")


def stub(channel) -> rollout_pb2_grpc.RolloutServiceStub:
    return rollout_pb2_grpc.RolloutServiceStub(channel)


def request(prompts, **params) -> rollout_pb2.RolloutServiceGenerateRequest:
    spec = SamplingSpec(**{"max_tokens": 8, "logprobs": True, **params})
    return rollout_pb2.RolloutServiceGenerateRequest(prompts=[wire.prompt_to_proto(p) for p in prompts],
                                                     sampling_params=wire.sampling_to_proto(spec))


def generate(channel, prompts, timeout: float = 60, **params) -> list[FinishedSample]:
    return [listed(s) for s in stub(channel).Generate(request(prompts, **params), timeout=timeout).samples]


def stream(channel, prompts, timeout: float = 60, **params) -> list[FinishedSample]:
    req = request(prompts, **params)
    stream_req = rollout_pb2.RolloutServiceGenerateStreamRequest(prompts=req.prompts,
                                                                 sampling_params=req.sampling_params)
    return [listed(r.sample) for r in stub(channel).GenerateStream(stream_req, timeout=timeout)]


def listed(sample: rollout_pb2.Sample) -> FinishedSample:
    """A sample off the wire with its per-token fields as Python lists, as the engine made them (the wire's
    decoder gives numpy arrays): the engines' tests compare and concatenate token lists."""
    decoded = wire.sample_from_proto(sample)
    return dataclasses.replace(decoded, **{name: getattr(decoded, name).tolist() for name in PER_TOKEN})


PER_TOKEN = ("token_ids", "logprobs", "prompt_ids", "loss_mask")


def invalid_argument(channel, prompts, **params) -> str:
    """Calls Generate expecting INVALID_ARGUMENT; returns the details."""
    try:
        stub(channel).Generate(request(prompts, **params), timeout=30)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        return error.details()
    raise AssertionError("expected INVALID_ARGUMENT")


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at `tokens` from one full forward of prompt + tokens (the actor's math)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (L, V)
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


# Bad requests and a phrase the INVALID_ARGUMENT details must contain (vocab 100, max length 512).
BAD_REQUESTS = {
    "no prompts": ([], {}, "no prompts"),
    "empty prompt": ([[5, 6], []], {}, "prompt 1 is empty"),
    "prompt too long": ([[5] * 510], {"max_tokens": 8}, "allows at most 504"),
    "max_tokens 0": ([[5]], {"max_tokens": 0}, "max_tokens must be >= 1"),
    "n 0": ([[5]], {"n": 0}, "n must be >= 1"),
    "negative temperature": ([[5]], {"temperature": -0.5}, "temperature must be >= 0"),
    "top_p above 1": ([[5]], {"top_p": 1.5}, "top_p must be in (0, 1]"),
    "token id outside vocab": ([[5, 100]], {}, "token id 100 outside the vocabulary"),
    "negative token id": ([[-1, 5]], {}, "token id -1 outside the vocabulary"),
    "unknown stop id": ([[5]], {"stop_token_ids": (1000,)}, "unknown stop token id 1000"),
    "unknown chat role": ([[5, 6], [{"role": "user", "content": "hi"}, {"role": "root", "content": "obey"}]], {},
                          "prompt 1: message 1 has role 'root'"),
}


def sampled_log_probs(samples, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The log-probs the rollout reported for its sampled tokens, laid out as `batch`'s responses
    (test_actor_agreement.actor_batch of the same samples): [B, T], 0 on padding."""
    width = batch["responses"].shape[1]
    return torch.tensor([s.logprobs + [0.0] * (width - len(s.logprobs)) for s in samples])


@contextlib.contextmanager
def environment_restored():
    """vLLM's CPU platform sets LD_PRELOAD (torch's libgomp, tcmalloc) in this process's environment: put the
    environment back afterwards, so that later tests' subprocesses start as they would elsewhere."""
    environment = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)
