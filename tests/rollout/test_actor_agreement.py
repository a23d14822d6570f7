"""The rollout's sampled log-probs agree with the actor service's ComputeLogProbs (the PPO ratio's
denominator and numerator): same model, temperature 0.7, top_p 1, top_k off, float32, for the hf
engine and the vLLM engine (the session's shared one; skipped where vLLM is not installed)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from rlfabric.core.server import ServerOptions
from rlfabric.rollout.servicer import build_service
from tests.conftest import ServerThread
from tests.numerics import ENGINE_LOGPROB_GAP

from .helpers import generate, rollout_config, sampled_log_probs

pytestmark = pytest.mark.slow

actor_service = pytest.importorskip("rlfabric.actor.servicer")
actor_client = pytest.importorskip("rlfabric.actor.client")

PROMPTS = [[1, 90, 88, 74], [1, 70, 88, 88, 78, 88, 89, 70, 83], [40, 41]]


def actor_batch(samples, prompts) -> dict[str, torch.Tensor]:
    """VeRL's layout: left-padded prompt + right-padded response per row."""
    prompt_len = max(len(p) for p in prompts)
    response_len = max(len(s.token_ids) for s in samples)
    ids, mask, responses, response_mask = [], [], [], []
    for s in samples:
        prompt, response = prompts[s.prompt_index], s.token_ids
        pad_left, pad_right = prompt_len - len(prompt), response_len - len(response)
        ids.append([0] * pad_left + prompt + response + [0] * pad_right)
        mask.append([0] * pad_left + [1] * (len(prompt) + len(response)) + [0] * pad_right)
        responses.append(response + [0] * pad_right)
        response_mask.append([1] * len(response) + [0] * pad_right)
    return {name: torch.tensor(value) for name, value in (("input_ids", ids), ("attention_mask", mask),
                                                           ("responses", responses), ("response_mask", response_mask))}


@pytest.fixture(scope="module")
def actor(tiny_model):
    server = ServerThread(actor_service.build_service(rollout_config(tiny_model)),
                          ServerOptions(port=0, metrics_port=None))
    yield server
    server.stop()


@pytest.fixture(params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def rollout_channel(request, tiny_model):
    """A channel to the rollout service with each engine: hf started here, vllm the session's engine."""
    if request.param == "vllm":
        _, channel, _ = request.getfixturevalue("vllm_served")
        yield channel
        return
    rollout = ServerThread(build_service(rollout_config(tiny_model)), ServerOptions(port=0, metrics_port=None))
    try:
        with grpc.insecure_channel(rollout.address) as channel:
            yield channel
    finally:
        rollout.stop()


@pytest.mark.numerics
def test_rollout_logprobs_match_the_actor_service(rollout_channel, actor):
    samples = generate(rollout_channel, PROMPTS, n=2, max_tokens=16, temperature=0.7, seed=4)
    batch = actor_batch(samples, PROMPTS)

    async def compute():
        async with actor_client.ActorClient(actor.address) as client:
            return await client.compute_log_probs(batch, temperature=0.7)

    actor_log_probs = asyncio.run(compute())["log_probs"]  # [B, T]
    rollout_log_probs = sampled_log_probs(samples, batch)
    mask = batch["response_mask"].bool()
    assert mask.sum() > 0
    diff = (actor_log_probs[mask] - rollout_log_probs[mask]).abs()
    assert diff.max() <= ENGINE_LOGPROB_GAP, diff.max()  # float32 engines of the same weights: tests/numerics.py
