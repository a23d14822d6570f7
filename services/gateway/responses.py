"""A recorded call as the body the agent reads: a whole response, or its server-sent-event stream. Both are
written from the record, so a stream and a plain response of one call carry the same ids and assemble into
the same message, and a replayed retry reads exactly what the first answer said."""

from __future__ import annotations

from collections.abc import Iterator

from rlfabric.gateway import openai_api as api
from rlfabric.gateway.openai_api import ChatRequest, CompletionRequest
from rlfabric.gateway.render import ChatRenderer
from rlfabric.gateway.segments import RecordedCall
from rlfabric.rollout.types import Finish


def finish_reason(call: RecordedCall) -> str:
    if call.finish_reason == Finish.LENGTH:
        return "length"
    return "tool_calls" if call.message and call.message.get("tool_calls") else "stop"


def chat_body(call: RecordedCall, request: ChatRequest, model: str, renderer: ChatRenderer) -> dict:
    logprobs = ({"content": api.logprobs_content(renderer.token_texts(call.token_ids), call.logprobs)}
                if request.logprobs else None)
    return api.chat_completion(call.call_id, model, call.message, finish_reason(call), call.prompt_ids,
                               call.token_ids, logprobs, request.return_token_ids)


def completion_body(call: RecordedCall, request: CompletionRequest, model: str, renderer: ChatRenderer) -> dict:
    logprobs = (api.completion_logprobs(renderer.token_texts(call.token_ids), call.logprobs)
                if request.logprobs is not None else None)
    return api.text_completion(call.call_id, model, call.text, finish_reason(call), call.prompt_ids, call.token_ids,
                               logprobs, request.return_token_ids)


def _pieces(call: RecordedCall, content: str, renderer: ChatRenderer) -> list[tuple[str, list[int], list[float]]]:
    """(text, token ids, log-probs) of each content chunk: one per token when the tokens decode one by one
    into the content, else one chunk with all of them."""
    pieces = renderer.text_pieces(call.token_ids, content)
    if pieces is None:
        return [(content, call.token_ids, call.logprobs)]
    return [(piece, [token], [logprob]) for piece, token, logprob in zip(pieces, call.token_ids, call.logprobs,
                                                                          strict=True)]


def chat_stream(call: RecordedCall, request: ChatRequest, model: str, renderer: ChatRenderer) -> Iterator[bytes]:
    """The chat.completion.chunk events of a call: the role, the content token by token, the tool calls, the
    finish reason, the usage (stream_options.include_usage), [DONE]."""
    ids = request.return_token_ids
    first = {"prompt_token_ids": call.prompt_ids} if ids else {}
    yield api.sse(api.chat_chunk(call.call_id, model, {"role": "assistant", "content": ""}, **first))
    message = call.message or {}
    content, tool_calls = message.get("content") or "", message.get("tool_calls") or []
    chunks = _pieces(call, content, renderer) if not tool_calls else [(content, call.token_ids, call.logprobs)]
    for text, token_ids, logprobs in chunks:
        entries = ({"content": api.logprobs_content(renderer.token_texts(token_ids), logprobs)}
                   if request.logprobs else None)
        extra = {"token_ids": token_ids} if ids else {}
        if text or entries or ids:
            yield api.sse(api.chat_chunk(call.call_id, model, {"content": text}, logprobs=entries, **extra))
    if tool_calls:
        delta = {"tool_calls": [{"index": index, **call_} for index, call_ in enumerate(tool_calls)]}
        yield api.sse(api.chat_chunk(call.call_id, model, delta, **({"token_ids": []} if ids else {})))
    yield api.sse(api.chat_chunk(call.call_id, model, {}, finish_reason(call)))
    if request.include_usage():
        yield api.sse({"id": call.call_id, "object": "chat.completion.chunk", "model": model, "choices": [],
                       "usage": api.usage(len(call.prompt_ids), len(call.token_ids))})
    yield api.sse("[DONE]")


def completion_stream(call: RecordedCall, request: CompletionRequest, model: str,
                      renderer: ChatRenderer) -> Iterator[bytes]:
    """The text_completion events of a call: the text token by token, the finish reason, usage, [DONE]."""
    chunks = _pieces(call, call.text, renderer)
    for index, (text, token_ids, logprobs) in enumerate(chunks):
        entries = (api.completion_logprobs(renderer.token_texts(token_ids), logprobs)
                   if request.logprobs is not None else None)
        body = api.text_completion(call.call_id, model, text, None, call.prompt_ids if index == 0 else [],
                                   token_ids, entries, request.return_token_ids)
        body.pop("usage")
        if index > 0:
            body.pop("prompt_token_ids", None)
        yield api.sse(body)
    end = api.text_completion(call.call_id, model, "", finish_reason(call), [], [], None, False)
    end.pop("usage")
    yield api.sse(end)
    if request.include_usage():
        yield api.sse({"id": call.call_id, "object": "text_completion", "model": model, "choices": [],
                       "usage": api.usage(len(call.prompt_ids), len(call.token_ids))})
    yield api.sse("[DONE]")
