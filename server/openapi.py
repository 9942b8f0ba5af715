"""GET /openapi.json: the API described from the same pydantic models that validate requests."""

from __future__ import annotations

from typing import Any, Optional

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse


from jaxserve.server import embeddings as emb
from jaxserve.server import protocol as rq
from jaxserve.server import protocol_responses as rs
from jaxserve.server import responses_protocol as rr
from jaxserve.server.protocol_responses import server_version

_JSON = "application/json"
_SSE = "text/event-stream"

# path -> (method, summary, request model, response model, streams)
_ROUTES: list[tuple[str, str, str, Optional[type], Optional[type], bool]] = [
    ("/v1/completions", "post", "Create a completion", rq.CompletionRequest, rs.CompletionResponse, True),
    ("/v1/chat/completions", "post", "Create a chat completion", rq.ChatCompletionRequest, rs.ChatCompletionResponse, True),
    ("/v1/responses", "post", "Create a response (OpenAI's Responses API; streamed as its events)",
     rr.ResponsesRequest, None, False),
    ("/v1/responses/{response_id}", "get", "A stored response", None, None, False),
    ("/v1/responses/{response_id}", "delete", "Delete a stored response", None, None, False),
    ("/v1/embeddings", "post", "Create embeddings (embedding models only)", emb.EmbeddingRequest,
     emb.EmbeddingResponse, False),
    ("/v1/models", "get", "List the served models", None, rs.ModelList, False),
    ("/tokenize", "post", "Tokenize a prompt or chat messages", rq.TokenizeRequest, rs.TokenizeResponse, False),
    ("/detokenize", "post", "Turn token ids back into text", rq.DetokenizeRequest, rs.DetokenizeResponse, False),
    ("/version", "get", "Server version", None, rs.VersionResponse, False),
    ("/health", "get", "200 while the engine serves, 503 otherwise", None, None, False),
    ("/metrics", "get", "Prometheus metrics", None, None, False),
]


def build_openapi(api_key_required: bool) -> dict[str, Any]:
    models = {m for _, _, _, req, resp, _ in _ROUTES for m in (req, resp) if m is not None}
    models |= {rs.ErrorResponse, rs.ChatCompletionChunk}
    keys, defs = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
        ref_template="#/components/schemas/{model}",
    )
    ref = {m: keys[(m, "validation")] for m in models}
    error = {"description": "OpenAI error body", "content": {_JSON: {"schema": ref[rs.ErrorResponse]}}}
    paths: dict[str, Any] = {}
    for path, method, summary, req, resp, streams in _ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {}}
        ok: dict[str, Any] = {"description": "OK"}
        if resp is not None:
            ok["content"] = {_JSON: {"schema": ref[resp]}}
            if streams:
                ok["content"][_SSE] = {"schema": {"type": "string", "description": "SSE chunks, then `data: [DONE]`"}}
        op["responses"]["200"] = ok
        if req is not None:
            op["requestBody"] = {"required": True, "content": {_JSON: {"schema": ref[req]}}}
            op["responses"]["400"] = error
            op["responses"]["404"] = error
        if path.startswith("/v1/"):
            if api_key_required:
                op["security"] = [{"bearer": []}]
                op["responses"]["401"] = error
            if streams:
                op["responses"]["503"] = error
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve OpenAI-compatible API", "version": server_version()},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


async def openapi_endpoint(request: Request) -> JSONResponse:
    cached = getattr(request.app.state, "openapi", None)
    if cached is None:
        cached = build_openapi(request.app.state.jaxserve.api_key is not None)
        request.app.state.openapi = cached
    return JSONResponse(cached)
