"""The hf engine's recorded routes (actor.router_replay) are the experts a plain transformers forward of the
sample's prompt + response chooses, token by token, layer by layer, also for rows that joined a running batch
(continuous batching: left-padded next to rows that started earlier)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from rlfabric.core.router_replay import RouteRecorder
from rlfabric.rollout.hf_engine import HFEngine
from rlfabric.rollout.types import SamplingSpec

from .helpers import rollout_config

pytestmark = pytest.mark.slow

PROMPTS = [[1, 90, 88, 74], [1, 70, 88, 88, 78, 88, 89, 70, 83], [40, 41]]


def test_recorded_routes_are_a_plain_forwards_also_for_rows_that_joined_a_running_batch(tiny_moe_model):
    """A long request (2 rows of 12 tokens) and a short one (4 rows of 3) arrive together; with max_num_seqs 3
    the first batch holds both long rows and one short one, and the other short rows join it one by one as the
    short rows before them end (the last joins at step 9 and ends with the long rows). Both sides in float32: the engine's cached decode and the full forward differ
    by float32 summation order only (~1e-7 of a router logit), which flips a route only at a tie that close."""
    config = rollout_config(tiny_moe_model, "rollout.dtype=float32", "actor.router_replay=true",
                            "rollout.max_num_seqs=3")
    engine = HFEngine(config)
    finished: list[tuple[str, object]] = []

    async def collect(name: str, prompts, **params):
        spec = SamplingSpec(temperature=1.0, seed=5, **params)
        async for sample in engine.generate(prompts, spec):
            finished.append((name, sample))

    async def scenario():
        await engine.start()
        engine.limits = dataclasses.replace(engine.limits, eos_token_ids=())  # every row runs to its max_tokens
        try:
            await asyncio.gather(collect("long", PROMPTS[:1], n=2, max_tokens=12),
                                 collect("short", PROMPTS[1:], n=2, max_tokens=3))
        finally:
            await engine.stop()

    asyncio.run(scenario())
    order = [name for name, _ in finished]
    # Short row k joins at step 3k and ends at 3k + 3: rows 1 and 2 (joiners) end before the long rows' step 12.
    assert order.index("long") >= 3, order
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32).eval()
    with RouteRecorder(model) as recorder, torch.no_grad():
        for name, sample in finished:
            prompt = (PROMPTS[:1] if name == "long" else PROMPTS[1:])[sample.prompt_index]
            model(input_ids=torch.tensor([prompt + list(sample.token_ids)]))
            own = recorder.take().sort(-1).values  # [tokens, layers, top_k]
            recorded = sample.routed_experts
            assert recorded.shape == own.shape
            assert (recorded[-1] == 255).all()  # the last token: never run through the engine's model
            assert torch.equal(torch.from_numpy(np.sort(recorded[:-1], -1).astype(np.int64)), own[:-1]), name
