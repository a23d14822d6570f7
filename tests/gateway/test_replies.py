"""Replies as agents read them: hermes tool calls parsed (or left as text when they do not parse), and a
streamed reply, in each tool-call format, that assembles chunk by chunk into the message a plain response
carries (the formats themselves: test_tool_formats.py)."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from rlfabric.gateway.openai_api import ChatRequest
from rlfabric.gateway.render import ChatRenderer
from rlfabric.gateway.replies import parse_reply
from rlfabric.gateway.responses import chat_body, chat_stream
from rlfabric.gateway.segments import RecordedCall
from rlfabric.quickstart.tiny_model import build_tokenizer
from rlfabric.rollout.types import Finish

TOKENIZER = build_tokenizer()
RENDERER = ChatRenderer(TOKENIZER)
CALL_TEXT = 'Let me look.<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "lookup"}}]
CALLS = {"hermes": CALL_TEXT,
         "qwen3_xml": "Let me look.\n<tool_call>\n<function=lookup>\n<parameter=key>\na\n</parameter>\n</function>\n"
                      "</tool_call>",
         "llama3_json": '{"name": "lookup", "parameters": {"key": "a"}}'}


def test_hermes_calls_become_tool_calls_and_a_bad_one_leaves_plain_text():
    reply = parse_reply(CALL_TEXT, "hermes", TOOLS, call_id="call_3")
    assert reply.content == "Let me look." and not reply.parse_error
    assert reply.tool_calls == [{"id": "call_3_0", "type": "function",
                                 "function": {"name": "lookup", "arguments": '{"key": "a"}'}}]
    bad = parse_reply("<tool_call>{not json</tool_call>", "hermes", TOOLS, call_id="c")
    assert bad.parse_error and bad.tool_calls == [] and bad.content == "<tool_call>{not json</tool_call>"
    assert parse_reply(CALL_TEXT, "hermes", None, call_id="c").tool_calls == []
    assert parse_reply(CALL_TEXT, "none", TOOLS, call_id="c").content == CALL_TEXT


def _assembled(events: list[bytes]) -> tuple[dict, list[int]]:
    """The message a client builds from the chunks, and the token ids they carried."""
    message, ids = {"content": "", "tool_calls": {}}, []
    datas = [e.decode().removeprefix("data: ").strip() for e in events]
    assert datas[-1] == "[DONE]"
    for data in datas[:-1]:
        chunk = ChatCompletionChunk.model_validate(json.loads(data))
        for choice in chunk.choices:
            message["content"] += choice.delta.content or ""
            ids += (choice.model_extra or {}).get("token_ids") or []
            for call in choice.delta.tool_calls or ():
                slot = message["tool_calls"].setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
    return message, ids


@pytest.mark.parametrize("tool_call_format", sorted(CALLS))
def test_a_streamed_reply_assembles_into_the_plain_responses_message(tool_call_format):
    for text, tools in [("plain words", None), (CALLS[tool_call_format], TOOLS)]:
        token_ids = TOKENIZER.encode(text, add_special_tokens=False) + [TOKENIZER.eos_token_id]
        call = RecordedCall(0, "call_0", [5, 6], token_ids, [-1.0] * len(token_ids), [0] * len(token_ids),
                            Finish.STOP, text=text)
        call.message = parse_reply(text, tool_call_format, tools, call.call_id).message()
        request = ChatRequest(messages=[{"role": "user", "content": "q"}], tools=tools, logprobs=True,
                              return_token_ids=True, stream=True)
        plain = ChatCompletion.model_validate(chat_body(call, request, "m", RENDERER))
        message, ids = _assembled(list(chat_stream(call, request, "m", RENDERER)))
        assert ids == token_ids == plain.choices[0].model_extra["token_ids"]
        assert message["content"] == (plain.choices[0].message.content or "")
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in plain.choices[0].message.tool_calls or ()]
        assert list(message["tool_calls"].values()) == calls
        assert [json.loads(c["arguments"]) for c in calls] == ([{"key": "a"}] if tools else [])
        assert plain.choices[0].finish_reason == ("tool_calls" if tools else "stop")
