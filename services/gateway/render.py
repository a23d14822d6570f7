"""Chat messages as token ids, through the model's own chat template (transformers' apply_chat_template).

A conversation's first call is rendered whole. A call that extends an earlier one is that call's prompt and
sampled ids, verbatim, plus only the new messages' tokens: those are rendered after a placeholder assistant
turn and cut at it, so a template that rewrites history (Qwen3 drops past <think> blocks) cannot change the
ids already sampled, and nothing is decoded and encoded again.

Messages are also compared (a call extends another when its messages start with that call's messages and
reply): `message_key` is what the comparison reads, so a history sent back through JSON, with null contents or
text parts, still matches.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_TURN_MARKER = "@@rlfabric-gateway-turn@@"


def content_text(content: Any) -> str:
    """A message's content as text: a string, text parts joined, or "" for none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _arguments(arguments: Any) -> str:
    """Tool-call arguments in one canonical JSON spelling (as given when they are not JSON)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def message_key(message: dict) -> tuple:
    """What two messages must share to count as the same turn: role, text and tool calls (names and
    arguments; not the ids a client may rewrite)."""
    calls = tuple((c.get("function", {}).get("name", ""), _arguments(c.get("function", {}).get("arguments", "")))
                  for c in message.get("tool_calls") or ())
    return message.get("role", ""), content_text(message.get("content")), calls


def tools_key(tools: Sequence[dict] | None) -> str:
    return json.dumps(list(tools or ()), sort_keys=True)


def template_message(message: dict) -> dict:
    """An OpenAI message as chat templates take it: text content, tool-call arguments as objects."""
    role = message.get("role", "")
    # OpenAI's "developer" messages are the system prompt of newer models; templates know "system".
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": content_text(message.get("content"))}
    for name in ("name", "tool_call_id"):
        if message.get(name):
            out[name] = message[name]
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = dict(call.get("function", {}))
            try:
                function["arguments"] = json.loads(function.get("arguments") or "{}")
            except (TypeError, ValueError):
                pass  # a template that wants a string gets the string
            calls.append({"id": call.get("id", ""), "type": "function", "function": function})
        out["tool_calls"] = calls
    return out


class ChatRenderer:
    """Renders with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.end_of_turn_ids = set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None) -> list[int]:
        """The whole conversation with the tools declared and the assistant's header after it."""
        text = self.tokenizer.apply_chat_template([template_message(m) for m in messages], tools=list(tools or ()) or None,
                                                  add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def continuation_ids(self, new_messages: Sequence[dict], sampled_ids: Sequence[int]) -> list[int]:
        """The tokens that follow a sampled reply (sampled_ids) when new_messages come next: the rest of the
        reply's end, the messages, the next assistant header."""
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN_MARKER}]
        text = self.tokenizer.apply_chat_template(base + [template_message(m) for m in new_messages],
                                                  add_generation_prompt=True, tokenize=False)
        after = text[text.rindex(_TURN_MARKER) + len(_TURN_MARKER):]
        if sampled_ids and sampled_ids[-1] in self.end_of_turn_ids:
            ended_with = self.tokenizer.decode([sampled_ids[-1]])
            if after.startswith(ended_with):  # the model sampled the turn's end itself
                after = after[len(ended_with):]
        return self.encode(after)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text (special tokens included), for logprobs entries."""
        return [self.tokenizer.decode([token]) for token in token_ids]

    def text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def text_pieces(self, token_ids: Sequence[int], text: str) -> list[str] | None:
        """text cut into one piece per token (what each adds), or None when the tokens do not decode one by
        one into exactly `text` (a character split over tokens): then it streams in one piece."""
        pieces = [self.tokenizer.decode([token], skip_special_tokens=True) for token in token_ids]
        return pieces if "".join(pieces) == text else None
