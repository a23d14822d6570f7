"""The tool-call format checked against the model's chat template at the gateway's start: one assistant message
with a tool call is rendered through the template, its tokens read back as the gateway reads a sampled reply
(special tokens left out), and the configured format must parse back that very call. A template that writes
calls another way is a config error naming agent.gateway.tool_call_format (and the formats that do read it).

A template that writes no trace of the call (the tiny model's ChatML, SmolLM2's) cannot be checked: the
model writes what it was trained to write. That is logged, not refused.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from rlfabric.core.config import ConfigError
from rlfabric.gateway.render import template_message
from rlfabric.gateway.tool_formats import TOOL_CALL_FORMATS, MalformedToolCall

log = logging.getLogger("rlfabric.gateway")

KEY = "agent.gateway.tool_call_format"
PROBE_NAME = "rlfabric_format_probe"
PROBE_ARGUMENTS = {"query": "format check", "limit": 3}
PROBE_TOOL = {"type": "function", "function": {
    "name": PROBE_NAME, "description": "The gateway's start-up check of the tool-call format.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["query", "limit"]}}}


@dataclass
class FormatCheck:
    """What the check found."""

    tool_call_format: str
    checked: bool
    """The template writes tool calls, and the format read the probe's back."""
    written: str = ""
    """The probe call's reply as the template writes it (special tokens left out)."""
    readers: list[str] = field(default_factory=list)
    """The formats that read it back."""
    why_unchecked: str = ""


def probe_reply(tokenizer: Any) -> str:
    """The text of an assistant turn that calls PROBE_NAME with PROBE_ARGUMENTS, as the template writes it."""
    messages = [{"role": "user", "content": "Check the format."}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_probe", "type": "function",
         "function": {"name": PROBE_NAME, "arguments": json.dumps(PROBE_ARGUMENTS)}}]}
    prompt = tokenizer.apply_chat_template(messages, tools=[PROBE_TOOL], add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(messages + [template_message(call)], tools=[PROBE_TOOL],
                                          add_generation_prompt=False, tokenize=False)
    turn = whole[len(os.path.commonprefix([prompt, whole])):]
    return tokenizer.decode(tokenizer.encode(turn, add_special_tokens=False), skip_special_tokens=True)


def reads_back(tool_call_format: str, text: str) -> bool:
    """Whether the format parses `text` into exactly the probe's call."""
    try:
        _, calls = TOOL_CALL_FORMATS[tool_call_format](text, [PROBE_TOOL])
    except MalformedToolCall:
        return False
    return len(calls) == 1 and calls[0][0] == PROBE_NAME and json.loads(calls[0][1]) == PROBE_ARGUMENTS


def check_tool_call_format(tokenizer: Any, tool_call_format: str) -> FormatCheck:
    """The check of `tool_call_format` against the tokenizer's chat template; ConfigError naming the key when
    the template writes calls the format does not read back."""
    if tool_call_format == "none":
        return FormatCheck(tool_call_format, False, why_unchecked="replies are plain text")
    try:
        written = probe_reply(tokenizer)
    except Exception as error:  # a template's own raise_exception, a missing template, ...
        result = FormatCheck(tool_call_format, False, why_unchecked=f"the chat template cannot render a tool call "
                                                                    f"({type(error).__name__}: {error})")
    else:
        readers = [name for name in TOOL_CALL_FORMATS if name != "none" and reads_back(name, written)]
        if PROBE_NAME not in written:
            result = FormatCheck(tool_call_format, False, written, readers,
                                 "the chat template writes no trace of a tool call")
        elif tool_call_format in readers:
            log.info("tool-call format checked against the chat template",
                     extra={"fields": {"tool_call_format": tool_call_format, "written": written}})
            return FormatCheck(tool_call_format, True, written, readers)
        else:
            fix = (f"{', '.join(readers)} {'does' if len(readers) == 1 else 'do'}: set {KEY}={readers[0]}" if readers
                   else f"no format rlfabric knows does: set {KEY}=none to answer replies as plain text")
            raise ConfigError(f"{KEY}={tool_call_format} does not read back the tool call the model's chat template "
                              f"writes ({written.strip()[:300]!r}); {fix}")
    log.warning("%s=%s is not checked against the chat template: %s; the model must write calls as %s reads them",
                KEY, tool_call_format, result.why_unchecked, tool_call_format)
    return result
