"""Tool-call formats (hermes, qwen3_xml, llama3_json): calls read into OpenAI's tool calls, badly written ones
left as plain text and flagged (over HTTP: a 200 with the text, counted in agent/tool_parse_errors), and each
format checked at start against the model's chat template (a call rendered and parsed back; a mismatch is a
config error naming agent.gateway.tool_call_format)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from openai import AsyncOpenAI

from rlfabric.core.config import ConfigError, load_config
from rlfabric.gateway.calls import RouterGenerator
from rlfabric.gateway.format_check import (
    KEY,
    PROBE_ARGUMENTS,
    PROBE_NAME,
    check_tool_call_format,
    probe_reply,
)
from rlfabric.gateway.replies import parse_reply
from rlfabric.gateway.server import Gateway
from rlfabric.quickstart.tiny_model import build_tokenizer
from rlfabric.rollout.types import Finish, FinishedSample
from tests.gateway.templates import tokenizer_with

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
    "key": {"type": "string"}, "count": {"type": "integer"}, "tags": {"type": "array"}, "note": {}}}}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}]
FORMATS = ("hermes", "qwen3_xml", "llama3_json")


def calls_of(text: str, tool_call_format: str) -> tuple[str | None, list[tuple[str, dict]], bool]:
    reply = parse_reply(text, tool_call_format, TOOLS, "call_7")
    assert [call["id"] for call in reply.tool_calls] == [f"call_7_{i}" for i in range(len(reply.tool_calls))]
    message = reply.message()
    return (message["content"], [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                 for c in reply.tool_calls], reply.parse_error)


QWEN_TWO_CALLS = ("I will look it up.\n<tool_call>\n<function=lookup>\n<parameter=key>\n a b \n</parameter>\n"
                  "<parameter=count>\n3\n</parameter>\n<parameter=tags>\n[\"x\", 1]\n</parameter>\n"
                  "<parameter=note>\n{\"kept\": \"as text\"}\n</parameter>\n</function>\n</tool_call>\n"
                  "<tool_call>\n<function=clock>\n</function>\n</tool_call>")


@pytest.mark.parametrize("tool_call_format, text, expected", [
    ("hermes", 'Let me look.<tool_call>{"name": "lookup", "arguments": {"key": "a", "count": 2}}</tool_call>',
     ("Let me look.", [("lookup", {"key": "a", "count": 2})])),
    # A string parameter keeps its spaces; integer and array values are JSON; an untyped one stays a string.
    ("qwen3_xml", QWEN_TWO_CALLS, ("I will look it up.", [
        ("lookup", {"key": " a b ", "count": 3, "tags": ["x", 1], "note": '{"kept": "as text"}'}), ("clock", {})])),
    ("qwen3_xml", "<tool_call>\n<function=lookup>\n<parameter=count>\nthree\n</parameter>\n</function>\n</tool_call>",
     (None, [("lookup", {"count": "three"})])),  # not JSON where JSON was declared: the tool gets the text
    ("llama3_json", '{"name": "lookup", "parameters": {"key": "a"}}', (None, [("lookup", {"key": "a"})])),
    ("llama3_json", ' {"name": "lookup", "parameters": {"key": "a"}}; {"name": "clock", "arguments": {}}\n',
     (None, [("lookup", {"key": "a"}), ("clock", {})])),
    ("llama3_json", '<|python_tag|>{"name": "clock", "parameters": {}}', (None, [("clock", {})])),
])
def test_each_format_reads_its_calls_into_openai_tool_calls(tool_call_format, text, expected):
    content, calls, parse_error = calls_of(text, tool_call_format)
    assert (content, calls) == expected and not parse_error


@pytest.mark.parametrize("tool_call_format, text", [
    ("hermes", "<tool_call>{not json</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("qwen3_xml", "<tool_call>\n<function=lookup>\n<parameter=key>\na"),  # cut off mid-parameter
    ("qwen3_xml", "<tool_call>\n<function=lookup>\n<parameter=key>\na\n</parameter>\n</tool_call>"),  # no </function>
    ("qwen3_xml", "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {}}\n</tool_call>"),  # hermes' body
    ("qwen3_xml", "<tool_call>\n<function=lookup>\nkey=a\n</function>\n</tool_call>"),  # not parameter blocks
    ("qwen3_xml", "<tool_call><function=lookup><parameter=key>a</parameter><parameter=key>b</parameter>"
                  "</function></tool_call>"),  # a parameter twice
    ("qwen3_xml", "<function=lookup>\n</function>"),  # outside <tool_call>
    ("qwen3_xml", "<tool_call>\n<function= >\n</function>\n</tool_call>"),  # no name
    ("llama3_json", '{"name": "lookup", "parameters": {"key": "a"'),  # cut off
    ("llama3_json", '{"name": "lookup", "parameters": {"key": "a"}} and then some words'),
    ("llama3_json", '{"name": "lookup", "parameters": "key=a"}'),
    ("llama3_json", '{"parameters": {"key": "a"}}'),
    ("llama3_json", "{the answer is 4}"),
])
def test_a_badly_written_call_comes_back_as_the_whole_text_and_is_flagged(tool_call_format, text):
    assert calls_of(text, tool_call_format) == (text, [], True)


@pytest.mark.parametrize("tool_call_format", FORMATS)
def test_a_reply_without_a_call_is_plain_text_and_no_error(tool_call_format):
    text = "The answer is 4 (see the table: key -> value)."
    assert calls_of(text, tool_call_format) == (text, [], False)
    call = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    assert parse_reply(call, tool_call_format, None, "c").tool_calls == []  # no tools declared: never a call
    assert parse_reply(call, "none", TOOLS, "c").content == call


@pytest.mark.parametrize("template", FORMATS)
def test_each_templates_calls_are_read_by_its_format_and_refused_by_the_others(template):
    tokenizer = tokenizer_with(template)
    check = check_tool_call_format(tokenizer, template)
    assert check.checked and check.readers == [template] and PROBE_NAME in check.written
    for other in FORMATS:
        if other != template:
            with pytest.raises(ConfigError) as refused:
                check_tool_call_format(tokenizer, other)
            assert str(refused.value).startswith(f"{KEY}={other} does not read back") and \
                f"set {KEY}={template}" in str(refused.value)


def test_the_probe_is_the_template_rendering_of_one_call():
    assert probe_reply(tokenizer_with("llama3_json")) == \
        f'{{"name": "{PROBE_NAME}", "parameters": {json.dumps(PROBE_ARGUMENTS)}}}'


def test_a_gateway_with_hermes_on_a_llama3_template_is_refused_naming_the_key():
    config = load_config(None, ["model.path=/nonexistent", "agent.gateway.enable=true"])
    assert config.agent.gateway.tool_call_format == "hermes"
    with pytest.raises(ConfigError, match=f"{KEY}=hermes does not read back .*set {KEY}=llama3_json"):
        Gateway(config, tokenizer_with("llama3_json"), RouterGenerator(router=None))
    config.agent.gateway.tool_call_format = "llama3_json"
    assert Gateway(config, tokenizer_with("llama3_json"), RouterGenerator(router=None)).tool_format.checked


def test_the_tiny_models_template_writes_no_calls_so_no_format_is_checked_against_it(caplog):
    tokenizer = build_tokenizer()
    assert PROBE_NAME not in probe_reply(tokenizer)
    for tool_call_format in FORMATS:
        with caplog.at_level(logging.WARNING, logger="rlfabric.gateway"):
            check = check_tool_call_format(tokenizer, tool_call_format)
        assert not check.checked and check.why_unchecked == "the chat template writes no trace of a tool call"
        assert f"{KEY}={tool_call_format} is not checked" in caplog.text
    assert check_tool_call_format(tokenizer, "none").why_unchecked == "replies are plain text"


def test_a_template_that_cannot_render_a_call_is_not_checked():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m.tool_calls %}{{ raise_exception('no tools here') }}"
                               "{% endif %}{{ m.content }}{% endfor %}")
    check = check_tool_call_format(tokenizer, "hermes")
    assert not check.checked and "no tools here" in check.why_unchecked



class WrittenReplies:
    """A TokenGenerator whose replica writes the given texts, in turn (no model here writes qwen3_xml or
    llama3_json calls, well-formed or not): each text's tokens, then the end of turn."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts = tokenizer, list(texts)

    async def generate(self, prompt_ids, params, routing_key):
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return FinishedSample(0, 0, ids, [-0.5] * len(ids), Finish.STOP, 0)

    def release(self, routing_key):
        pass


WELL_AND_BADLY_WRITTEN = {
    "qwen3_xml": ("<tool_call>\n<function=lookup>\n<parameter=key>\na\n</parameter>\n</function>\n</tool_call>",
                  "<tool_call>\n<function=lookup>\n<parameter=key>\na"),
    "llama3_json": ('{"name": "lookup", "parameters": {"key": "a"}}', '{"name": "lookup", "parameters": {"key": "a"'),
}


@pytest.mark.parametrize("tool_call_format", sorted(WELL_AND_BADLY_WRITTEN))
def test_over_http_a_badly_written_call_is_a_plain_reply_and_counted(tool_call_format):
    tokenizer = tokenizer_with(tool_call_format)
    good, bad = WELL_AND_BADLY_WRITTEN[tool_call_format]
    config = load_config(None, ["model.path=/nonexistent", "agent.gateway.enable=true", "data.max_response_length=64",
                                f"agent.gateway.tool_call_format={tool_call_format}"])

    async def scenario():
        gateway = Gateway(config, tokenizer, WrittenReplies(tokenizer, [good, bad, bad]))
        await gateway.start()
        try:
            episode = gateway.episodes.open()
            client = AsyncOpenAI(base_url=gateway.base_url, api_key=episode.key, max_retries=0)
            ask = {"model": "m", "messages": [{"role": "user", "content": "look up a"}], "tools": TOOLS}
            called = await client.chat.completions.create(**ask)
            plain = await client.chat.completions.create(**ask)
            chunks = [chunk async for chunk in await client.chat.completions.create(**ask, stream=True)]
            return called, plain, chunks, gateway.calls.take_metrics()
        finally:
            await gateway.close()

    called, plain, chunks, metrics = asyncio.run(scenario())
    (call,) = called.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"key": "a"})
    assert called.choices[0].finish_reason == "tool_calls"
    assert plain.choices[0].message.content == bad and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == bad
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert (metrics["agent/calls"], metrics["agent/tool_calls"], metrics["agent/tool_parse_errors"]) == (3, 1, 2)
