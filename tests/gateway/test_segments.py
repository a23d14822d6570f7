"""Segments, episodes and rendering without an engine: how recorded calls join, what the store answers, and
that a template which rewrites history cannot change the ids already sampled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.core.config import load_config
from rlfabric.core.errors import ResourceExhausted
from rlfabric.gateway.calls import joined_sample
from rlfabric.gateway.episodes import EpisodeStore
from rlfabric.gateway.openai_api import OpenAIError
from rlfabric.gateway.render import ChatRenderer, message_key
from rlfabric.gateway.segments import RecordedCall, episode_advantages, join_calls
from rlfabric.quickstart.tiny_model import build_tokenizer
from rlfabric.rollout.types import Finish, FinishedSample

TOKENIZER = build_tokenizer()


def call(number: int, prompt: list[int], sampled: list[int], version: int = 0) -> RecordedCall:
    return RecordedCall(number, f"call_{number}", prompt, sampled, [-0.5] * len(sampled), [version] * len(sampled),
                        Finish.STOP)


def test_calls_that_extend_each_other_join_and_a_branch_starts_its_own_segment():
    calls = [call(0, [1, 2], [3, 4]), call(1, [1, 2, 3, 4, 9], [5], version=1),
             call(2, [1, 2, 3, 4, 8], [6])]  # branches from call 0 after call 1 extended it
    first, branch = join_calls(calls)
    assert first.calls == [0, 1] and first.token_ids == [3, 4, 9, 5] and first.loss_mask == [1, 1, 0, 1]
    assert first.token_versions == [0, 0, 0, 1] and first.logprobs == [-0.5, -0.5, 0.0, -0.5]
    # The branch's prompt holds call 0's sampled tokens: they train once, in the first segment.
    assert branch.prompt_ids == [1, 2, 3, 4, 8] and branch.loss_mask == [1]
    sample = first.to_sample(0, 0, lambda ids: "")
    assert sample.weight_version == 0 and sample.version_spans == [(0, 0), (1, 3)]
    assert sample.token_versions() == first.token_versions


def routes_of(number: int, prompt: list[int], sampled: list[int]) -> np.ndarray:
    """What an engine call records (actor.router_replay): [P + L, layers 2, top_k 1], every token it ran routed
    to expert `number`, its last sampled token to none (255)."""
    routes = np.full((len(prompt) + len(sampled), 2, 1), number, dtype=np.uint8)
    routes[-1] = 255
    return routes


def test_each_segment_token_keeps_the_routes_of_the_first_call_that_ran_it():
    # A segment of calls 0 and 1 (the prompt, call 0's tokens, the tokens between, call 1's) and a branch (call 2).
    shapes = [([1, 2], [3, 4]), ([1, 2, 3, 4, 9], [5, 6]), ([1, 2, 3, 4, 8], [7])]
    calls = [call(number, prompt, sampled) for number, (prompt, sampled) in enumerate(shapes)]
    for number, (prompt, sampled) in enumerate(shapes):
        calls[number].routes = routes_of(number, prompt, sampled)
    first, branch = join_calls(calls)
    routes = first.to_sample(0, 0, lambda ids: "").routed_experts  # [2 + 5 tokens, 2, 1]
    # prompt and call 0's first token: call 0; its last token and the one between: call 1's prompt pass;
    # call 1's first token: call 1; its last: none (no call ran it).
    assert routes[:, 0, 0].tolist() == [0, 0, 0, 1, 1, 1, 255] and (routes[:, 1] == routes[:, 0]).all()
    assert branch.to_sample(0, 1, lambda ids: "").routed_experts[:, 0, 0].tolist() == [2] * 5 + [255]
    # Without routes (an engine that records none), none.
    assert join_calls([call(0, [1], [2])])[0].to_sample(0, 0, lambda ids: "").routed_experts is None


def test_an_aborted_calls_pieces_join_their_routes_as_its_tokens():
    # Piece 0 sampled [3, 4] and was aborted; piece 1 went on from prompt + [3, 4] and sampled [5].
    pieces = [FinishedSample(0, 0, [3, 4], [-0.5, -0.5], Finish.ABORT, 1, routed_experts=routes_of(0, [1, 2], [3, 4])),
              FinishedSample(0, 0, [5], [-0.5], Finish.STOP, 2, routed_experts=routes_of(1, [1, 2, 3, 4], [5]))]
    joined = joined_sample(pieces)
    assert joined.token_ids == [3, 4, 5] and joined.routed_experts[:, 0, 0].tolist() == [0, 0, 0, 1, 255]


def test_episode_advantages_count_each_episode_once():
    # Episode 0 (score 1) has three segments, episode 1 (score 0) one: GRPO over the two episodes gives +a, -a.
    mask = torch.ones(4, 2)
    advantages = episode_advantages("grpo", torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                    torch.tensor([0, 0, 0, 1]), mask)
    assert torch.allclose(advantages[:3], advantages[0, 0].expand(3, 2))
    assert torch.isclose(advantages[3, 0], -advantages[0, 0]) and advantages[0, 0] > 0


def test_the_store_bounds_open_episodes_and_remembers_closed_keys():
    settings = load_config(None, ["agent.gateway.max_concurrent_episodes=2",
                                  "agent.gateway.closed_episodes_remembered=1"]).agent.gateway
    released = []
    store = EpisodeStore(settings, on_close=released.append)
    first, second = store.open(), store.open()
    with pytest.raises(ResourceExhausted):
        store.open()
    store.close(first.key)
    assert released == [first.key]
    with pytest.raises(OpenAIError) as closed:
        store.get(first.key)
    assert closed.value.status == 410
    store.close(second.key)  # remembers one closed key: the first one is now unknown
    with pytest.raises(OpenAIError) as forgotten:
        store.get(first.key)
    assert forgotten.value.status == 401 and len(store) == 0


def test_the_tokens_after_a_turn_do_not_depend_on_how_the_template_renders_history():
    class DropsPastThinking:
        """The tiny tokenizer with a template that, as Qwen3's, drops <think> blocks of past assistant turns."""

        def __getattr__(self, name):
            return getattr(TOKENIZER, name)

        def apply_chat_template(self, messages, **kwargs):
            cleaned = [{**m, "content": m["content"].split("</think>")[-1]} if m["role"] == "assistant" else m
                       for m in messages]
            return TOKENIZER.apply_chat_template(cleaned, **kwargs)

    renderer = ChatRenderer(DropsPastThinking())
    sampled = TOKENIZER.encode("<think>hm</think>42<|im_end|>", add_special_tokens=False)
    following = renderer.continuation_ids([{"role": "user", "content": "and?"}], sampled)
    assert TOKENIZER.decode(following) == "\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n"
    # A reply cut before its end keeps the template's end of turn.
    cut = renderer.continuation_ids([{"role": "user", "content": "and?"}], sampled[:-1])
    assert TOKENIZER.decode(cut).startswith("<|im_end|>\n<|im_start|>user")


def test_messages_match_through_json_nulls_and_text_parts():
    sent = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]}
    echoed = {"role": "assistant", "content": "",
              "tool_calls": [{"id": "z", "function": {"name": "f", "arguments": '{"a": 2, "b": 1}'}}]}
    assert message_key(sent) == message_key(echoed)
    assert message_key({"role": "user", "content": [{"type": "text", "text": "hi"}]}) == \
        message_key({"role": "user", "content": "hi"})


def test_messages_the_template_refuses_are_400_before_anything_generates():
    import asyncio

    from rlfabric.gateway.calls import CallHandler
    from rlfabric.gateway.openai_api import ChatRequest

    class NoGenerator:
        async def generate(self, prompt_ids, params, routing_key):
            raise AssertionError("nothing may generate for a refused request")

        def release(self, routing_key):
            pass

    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    config = load_config(None, [])
    store = EpisodeStore(config.agent.gateway)
    handler = CallHandler(config, tokenizer, NoGenerator(), store)
    request = ChatRequest(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(handler.chat(store.open(), request, "hash", is_retry=False))
    assert refused.value.status == 400 and "no system role" in refused.value.message
