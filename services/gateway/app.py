"""The gateway's HTTP routes (FastAPI): OpenAI's paths under /v1 (key from `Authorization: Bearer`) and under
/e/<key>/v1 (key in the path, for clients whose API key is fixed).

    POST /v1/chat/completions    POST /v1/completions    GET /v1/models    GET /health

Every error is OpenAI's JSON error body with its status: 400 bad or unsupported request, 401 unknown key,
410 closed or timed-out episode, 429 too many calls in flight (retry-after-ms), 503 the rollout failed.
A request with `x-stainless-retry-count` > 0 (the openai SDKs' retries) whose body was recorded before is
answered from the record.
"""

from __future__ import annotations

import hashlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlfabric.gateway import openai_api as api
from rlfabric.gateway.calls import CallHandler
from rlfabric.gateway.episodes import Episode, EpisodeStore
from rlfabric.gateway.openai_api import ChatRequest, CompletionRequest, OpenAIError
from rlfabric.gateway.responses import chat_body, chat_stream, completion_body, completion_stream

RETRY_HEADER = "x-stainless-retry-count"


def _key(request: Request) -> str:
    if "key" in request.path_params:
        return request.path_params["key"]
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _is_retry(request: Request) -> bool:
    return request.headers.get(RETRY_HEADER, "0").strip() not in ("", "0")


def build_app(episodes: EpisodeStore, calls: CallHandler, model: str) -> FastAPI:
    app = FastAPI(title="rlfabric agent gateway", openapi_url=None, docs_url=None, redoc_url=None)
    renderer = calls.renderer

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        calls.counts[f"rejected/{error.status}"] += 1
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    def episode_of(request: Request) -> Episode:
        return episodes.get(_key(request))

    async def read(request: Request, kind: type[Any]) -> tuple[Episode, Any, str]:
        episode = episode_of(request)
        body = await request.body()
        parsed = api.parse_request(kind, body)
        digest = hashlib.sha256(request.url.path.encode() + b"\0" + body).hexdigest()
        return episode, parsed, digest

    async def chat_completions(request: Request) -> Response:
        episode, chat, digest = await read(request, ChatRequest)
        call = await calls.chat(episode, chat, digest, _is_retry(request))
        if chat.stream:
            return StreamingResponse(chat_stream(call, chat, model, renderer), media_type="text/event-stream")
        return JSONResponse(chat_body(call, chat, model, renderer))

    async def completions(request: Request) -> Response:
        episode, completion, digest = await read(request, CompletionRequest)
        call = await calls.completion(episode, completion, digest, _is_retry(request))
        if completion.stream:
            return StreamingResponse(completion_stream(call, completion, model, renderer),
                                     media_type="text/event-stream")
        return JSONResponse(completion_body(call, completion, model, renderer))

    async def models(request: Request) -> JSONResponse:
        episode_of(request)
        return JSONResponse(api.models_list(model))

    for prefix in ("/v1", "/e/{key}/v1"):
        app.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/models", models, methods=["GET"])

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "open_episodes": len(episodes)}

    return app
