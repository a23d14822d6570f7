"""A sampled reply as the assistant message an agent reads: its text, and its tool calls when the request
declared tools. Formats are looked up by name (agent.gateway.tool_call_format); a reply whose calls do not
parse is plain text (counted), never an error."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rlfabric.rollout.agent_loop import parse_tool_calls

_HERMES_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


@dataclass
class Reply:
    """The assistant message of one call."""

    content: str
    tool_calls: list[dict] = field(default_factory=list)
    """OpenAI's form: {"id", "type": "function", "function": {"name", "arguments": JSON text}}."""
    parse_error: bool = False
    """The reply looked like tool calls but did not parse (it is then plain text)."""

    def message(self) -> dict:
        message: dict = {"role": "assistant", "content": self.content if self.content or not self.tool_calls else None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def _hermes(text: str, call_id: str) -> Reply:
    if "<tool_call>" not in text:
        return Reply(text)
    calls = parse_tool_calls(text)
    if not calls or any(not call.name for call in calls):
        return Reply(text, parse_error=True)
    content = _HERMES_BLOCK.sub("", text).strip()
    return Reply(content, [{"id": f"{call_id}_{index}", "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments_json}}
                           for index, call in enumerate(calls)])


def _plain(text: str, call_id: str) -> Reply:
    return Reply(text)


REPLY_FORMATS: dict[str, Callable[[str, str], Reply]] = {"hermes": _hermes, "none": _plain}


def parse_reply(text: str, tool_call_format: str, tools_declared: bool, call_id: str) -> Reply:
    """The reply of `text`; tool calls only when the request declared tools (and did not say tool_choice none).
    Tool-call ids are `call_id`_<index>: the same reply gets the same ids."""
    if not tools_declared:
        return Reply(text)
    return REPLY_FORMATS[tool_call_format](text, call_id)
