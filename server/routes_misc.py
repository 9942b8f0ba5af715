"""The small routes: /v1/models, /health, /version, /tokenize, /detokenize."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.async_engine import EngineDeadError

from jaxserve.server.errors import bad_request, error_response
from jaxserve.server.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.server.protocol_responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
    server_version,
)
from jaxserve.server.routes_chat import render_messages
from jaxserve.server.serving import get_state, parse_body


async def list_models(request: Request) -> Response:
    state = get_state(request)
    cards = [
        ModelCard(id=name, created=state.created, root=state.model_root, max_model_len=state.max_model_len)
        for name in state.served_model_names
    ]
    cards += [
        ModelCard(id=name, created=state.created, root=lora.lora_path, parent=state.model_name)
        for name, lora in state.lora_modules.items()
    ]
    return JSONResponse(ModelList(data=cards).model_dump())


async def health(request: Request) -> Response:
    """200 while the engine thread serves; 503 once it has crashed or stopped (load balancers drop us)."""
    try:
        get_state(request).engine.check_health()
    except EngineDeadError as e:
        return error_response(503, str(e), code="engine_dead")
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return JSONResponse(VersionResponse(version=server_version()).model_dump())


async def tokenize(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, TokenizeRequest)
    state.resolve_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        tokens = render_messages(state, body)
    else:
        tokens = state.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = state.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    resp = TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens, token_strs=strs)
    return JSONResponse(resp.model_dump())


async def detokenize(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, DetokenizeRequest)
    state.resolve_model(body.model)
    tokenizer = state.need_tokenizer("detokenize")
    vocab = len(tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=tokenizer.decode(body.tokens)).model_dump())
