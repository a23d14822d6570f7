"""rlfabric's tool-call formats against vLLM's parsers of the same names (vllm.tool_parsers, where vLLM is
installed): well-formed calls, and the calls each fixture template writes, are read alike. The last test pins
why the gateway does not use vLLM's parsers themselves (rlfabric.gateway.tool_formats): when it fails, vLLM
changed and the choice is worth another look."""

from __future__ import annotations

import json

import pytest

from rlfabric.gateway.format_check import PROBE_TOOL, probe_reply
from rlfabric.gateway.replies import parse_reply
from rlfabric.quickstart.tiny_model import build_tokenizer
from tests.gateway.templates import tokenizer_with
from tests.rollout.conftest import require_vllm

pytestmark = pytest.mark.slow  # importing vllm.tool_parsers: ~10-30 s here

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
    "key": {"type": "string"}, "count": {"type": "integer"}, "tags": {"type": "array"}, "ok": {"type": "boolean"},
    "note": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}]
CALLS = [
    ("hermes", 'Let me look.<tool_call>{"name": "lookup", "arguments": {"key": "a", "count": 2}}</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>'),
    ("qwen3_xml", "I will look it up.\n<tool_call>\n<function=lookup>\n<parameter=key>\n a b \n</parameter>\n"
                  "<parameter=count>\n3\n</parameter>\n<parameter=tags>\n[\"x\", 1]\n</parameter>\n"
                  "<parameter=ok>\ntrue\n</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n"
                  "</function>\n</tool_call>\n<tool_call>\n<function=clock>\n</function>\n</tool_call>"),
    ("llama3_json", '{"name": "lookup", "parameters": {"key": "a", "count": 2}}'),
    ("llama3_json", '{"name": "lookup", "parameters": {"key": "a"}}; {"name": "clock", "parameters": {}}'),
]


@pytest.fixture(scope="module")
def vllm_read():
    """(format, text, tools) -> (content, [(name, arguments)]) as vLLM's parser of that name reads it."""
    require_vllm()
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    tokenizer = tokenizer_with("llama3_json")  # Llama's specials: vLLM's llama3_json parser needs <|python_tag|>

    def read(tool_call_format: str, text: str, tools: list[dict]):
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], tools=tools)
        parser = ToolParserManager.get_tool_parser(tool_call_format)(tokenizer, request.tools)
        found = parser.extract_tool_calls(text, request)
        return ((found.content or "").strip(),
                [(call.function.name, json.loads(call.function.arguments)) for call in found.tool_calls])

    return read


def ours(tool_call_format: str, text: str, tools: list[dict]):
    reply = parse_reply(text, tool_call_format, tools, "c")
    assert not reply.parse_error
    return ((reply.content or "").strip(),
            [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in reply.tool_calls])


@pytest.mark.parametrize("tool_call_format, text", CALLS)
def test_well_formed_calls_are_read_as_vllm_reads_them(vllm_read, tool_call_format, text):
    expected = vllm_read(tool_call_format, text, TOOLS)
    assert expected[1], "vLLM finds the calls"
    assert ours(tool_call_format, text, TOOLS) == expected


@pytest.mark.parametrize("tool_call_format", ["hermes", "qwen3_xml", "llama3_json"])
def test_the_call_each_fixture_template_writes_is_read_as_vllm_reads_it(vllm_read, tool_call_format):
    written = probe_reply(tokenizer_with(tool_call_format))
    expected = vllm_read(tool_call_format, written, [PROBE_TOOL])
    assert len(expected[1]) == 1 and ours(tool_call_format, written, [PROBE_TOOL]) == expected


def test_what_vllms_parsers_do_that_the_gateway_cannot(vllm_read):
    from vllm.tool_parsers import ToolParserManager

    # A call cut off mid-parameter is a call with no arguments to vLLM; to the gateway, plain text, counted.
    cut = "<tool_call>\n<function=lookup>\n<parameter=key>\na"
    assert vllm_read("qwen3_xml", cut, TOOLS) == ("", [("lookup", {})])
    assert parse_reply(cut, "qwen3_xml", TOOLS, "c").parse_error
    # Its llama3_json parser needs Llama's <|python_tag|> in the vocabulary, which the tiny model lacks.
    with pytest.raises(RuntimeError, match="python_tag"):
        ToolParserManager.get_tool_parser("llama3_json")(build_tokenizer())
