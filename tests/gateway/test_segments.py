"""Segments, episodes and rendering without an engine: how recorded calls join, what the store answers, and
that a template which rewrites history cannot change the ids already sampled."""

from __future__ import annotations

import pytest
import torch

from rlfabric.core.config import load_config
from rlfabric.core.errors import ResourceExhausted
from rlfabric.gateway.episodes import EpisodeStore
from rlfabric.gateway.openai_api import OpenAIError
from rlfabric.gateway.render import ChatRenderer, message_key
from rlfabric.gateway.segments import RecordedCall, episode_advantages, join_calls
from rlfabric.quickstart.tiny_model import build_tokenizer
from rlfabric.rollout.types import Finish

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
