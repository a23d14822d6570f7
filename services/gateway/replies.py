"""A sampled reply as the assistant message an agent reads: its text, and its tool calls when the request
declared tools. Formats are looked up by name (agent.gateway.tool_call_format); a reply whose calls do not
parse is plain text (counted), never an error."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rlfabric.gateway.tool_formats import TOOL_CALL_FORMATS, MalformedToolCall


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


def parse_reply(text: str, tool_call_format: str, tools: Sequence[dict] | None, call_id: str) -> Reply:
    """The reply of `text`; tool calls only when the request declared tools (None: it did not, or said
    tool_choice none). Tool-call ids are `call_id`_<index>: the same reply gets the same ids."""
    if not tools:
        return Reply(text)
    try:
        content, calls = TOOL_CALL_FORMATS[tool_call_format](text, tools)
    except MalformedToolCall:
        return Reply(text, parse_error=True)
    return Reply(content, [{"id": f"{call_id}_{index}", "type": "function",
                            "function": {"name": name, "arguments": arguments}}
                           for index, (name, arguments) in enumerate(calls)])
