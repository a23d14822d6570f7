"""OpenAI's wire format as the gateway speaks it: the requests it takes, the errors it answers, the response
and stream-chunk bodies it writes. Plain dicts out (JSON), pydantic models in (validated, unknown fields kept:
vLLM's extras and fields this gateway ignores)."""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class OpenAIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, code: str, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# The roles a message may have; chat templates write any role as given, so others are refused.
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


def unsupported(param: str, why: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {why}", "unsupported_parameter", param=param)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = ""
    stream: bool = False
    stream_options: dict | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extra
    seed: int | None = None
    stop: str | list[str] | None = None
    return_token_ids: bool = False  # vLLM's extra: prompt_token_ids and each choice's token_ids

    def check_common(self) -> None:
        """400 for what the gateway cannot do as asked."""
        if self.n not in (None, 1):
            raise unsupported("n", "the gateway samples one choice per call (n = 1); call again for more")
        for name in ("max_tokens",):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise OpenAIError(400, f"{name} must be >= 1 (got {value})", "invalid_value", param=name)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatRequest(_Request):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict | None = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise OpenAIError(400, "messages: at least one message is needed", "invalid_value", param="messages")
        for index, message in enumerate(self.messages):
            if message.get("role") not in MESSAGE_ROLES:
                raise OpenAIError(400, f"messages.{index}.role: {str(message.get('role'))[:40]!r} is not one of "
                                       f"{', '.join(MESSAGE_ROLES)}", "invalid_value", param=f"messages.{index}.role")
            content = message.get("content")
            if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise unsupported(f"messages.{index}.content", "only text parts are supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise unsupported("response_format", "structured outputs are not supported: the run trains on what "
                                                 "the model samples freely")
        if self.top_logprobs:
            raise unsupported("top_logprobs", "only the sampled tokens' log-probs are recorded (logprobs: true)")
        if self.tool_choice not in (None, "auto", "none"):
            raise unsupported("tool_choice", "only 'auto' and 'none' are supported: the model is not constrained")

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # legacy: how many alternatives; only the sampled token's is given
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise unsupported("echo", "the prompt is not echoed")
        if self.suffix:
            raise unsupported("suffix", "insertion is not supported")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "one sample per call")
        if self.logprobs not in (None, 0, 1):
            raise unsupported("logprobs", "only the sampled token's log-prob is recorded (logprobs: 0 or 1)")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise unsupported("prompt", "one prompt per call")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise OpenAIError(400, "prompt is empty", "invalid_value", param="prompt")

    def token_budget(self) -> int | None:
        return self.max_tokens


def parse_request(model: type[ChatRequest] | type[CompletionRequest], body: bytes) -> Any:
    """The request of a JSON body, checked; 400 in OpenAI's format naming the field otherwise."""
    try:
        data = json.loads(body)
    except ValueError as error:
        raise OpenAIError(400, f"the body is not JSON: {error}", "invalid_json") from None
    try:
        request = model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"])
        raise OpenAIError(400, f"{param}: {first['msg']}", "invalid_value", param=param) from None
    request.check()
    return request


# -- responses -------------------------------------------------------------------------------------------


def logprobs_content(tokens: list[str], logprobs: list[float]) -> list[dict]:
    """Chat logprobs.content: one entry per sampled token, no alternatives."""
    return [{"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
            for token, logprob in zip(tokens, logprobs, strict=True)]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(call_id: str, model: str, message: dict, finish_reason: str, prompt_ids: list[int],
                    token_ids: list[int], logprobs: dict | None, return_token_ids: bool) -> dict:
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    body: dict[str, Any] = {"id": call_id, "object": "chat.completion", "created": int(time.time()),
                            "model": model, "choices": [choice], "usage": usage(len(prompt_ids), len(token_ids))}
    if return_token_ids:
        body["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = token_ids
    return body


def chat_chunk(call_id: str, model: str, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None, **extra: Any) -> dict:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if "token_ids" in extra:
        choice["token_ids"] = extra.pop("token_ids")
    return {"id": call_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [choice], **extra}


def text_completion(call_id: str, model: str, text: str, finish_reason: str, prompt_ids: list[int],
                    token_ids: list[int], logprobs: dict | None, return_token_ids: bool) -> dict:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    body: dict[str, Any] = {"id": call_id, "object": "text_completion", "created": int(time.time()), "model": model,
                            "choices": [choice], "usage": usage(len(prompt_ids), len(token_ids))}
    if return_token_ids:
        body["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = token_ids
    return body


def completion_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    """Legacy completions logprobs: tokens, token_logprobs, text offsets."""
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": [{} for _ in tokens],
            "text_offset": offsets}


def models_list(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "rlfabric"}]}


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
