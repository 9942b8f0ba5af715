"""POST /v1/embeddings, and which routes a server offers for the runner it serves.

An embedding server (runner "pooling") answers the generate routes with a 400 saying why, and a generate
server answers /v1/embeddings the same way, so a client pointed at the wrong server learns what to fix.
"""

from __future__ import annotations

import base64
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.pooling_engine import encode_text
from jaxserve.pooling_params import PoolingParams
from jaxserve.server.errors import APIError, bad_request, from_value_error
from jaxserve.server.protocol import _Request
from jaxserve.server.protocol_responses import now_s, random_id
from jaxserve.server.serving import collect_finals, get_state, parse_body

_MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


class EmbeddingRequest(_Request):
    """OpenAI's embeddings body, plus vLLM's ``truncate_prompt_tokens`` and ``add_special_tokens``."""

    # str | list[str] | list[int] | list[list[int]]: checked by prompts(), whose 400 names the problem
    input: Any = Field(json_schema_extra={"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
    ]})  # fmt: skip
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: bool = True

    def prompts(self) -> list:
        """The inputs as a list of strings and token-id lists; 400 for anything else."""
        x = self.input
        if isinstance(x, str) or (isinstance(x, list) and x and all(_is_id(t) for t in x)):
            items = [x]
        elif isinstance(x, list) and x and all(isinstance(t, str) for t in x):
            items = list(x)
        elif isinstance(x, list) and x and all(isinstance(t, list) and t and all(_is_id(i) for i in t) for t in x):
            items = list(x)
        else:
            raise bad_request(
                "input must be a non-empty string, a list of strings, a list of token ids, or a list of non-empty "
                f"lists of token ids; got {_describe(x)}",
                param="input",
            )
        if len(items) > _MAX_INPUTS:
            raise bad_request(f"input has {len(items)} items; at most {_MAX_INPUTS} per request", param="input")
        if any(isinstance(t, str) and not t for t in items):
            raise bad_request("input must not contain empty strings", param="input")
        return items


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _describe(x) -> str:
    if isinstance(x, list):
        kinds = sorted({type(t).__name__ for t in x})
        return f"a list of {', '.join(kinds)}" if x else "an empty list"
    return type(x).__name__


def _encode(vec: list[float], fmt: str):
    if fmt == "float":
        return vec
    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")  # what OpenAI's clients decode


async def create_embedding(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, EmbeddingRequest)
    model = state.resolve_model(body.model)
    items = body.prompts()
    try:
        params = PoolingParams(truncate_prompt_tokens=body.truncate_prompt_tokens, dimensions=body.dimensions)
    except ValueError as e:
        raise from_value_error(e) from None
    keep = body.truncate_prompt_tokens
    if keep == -1:
        keep = state.max_model_len
    prompts = []
    for item in items:
        if isinstance(item, str):
            tokenizer = state.need_tokenizer("a text input")
            prompts.append(encode_text(tokenizer, item, keep, body.add_special_tokens))
        else:
            prompts.append(list(item)[-keep:] if keep else list(item))
    request_id = random_id("embd")
    streams = await state.submit(request_id, prompts, params)
    finals = await collect_finals(request, state.engine, streams)
    if any(f.outputs is None for f in finals):
        raise APIError(500, "the request was aborted before its embedding was computed (server shutting down?)")
    data = [
        EmbeddingData(index=i, embedding=_encode(f.outputs.embedding, body.encoding_format))
        for i, f in enumerate(finals)
    ]
    n = sum(len(p) for p in prompts)
    usage = EmbeddingUsage(prompt_tokens=n, total_tokens=n)
    resp = EmbeddingResponse(id=request_id, created=now_s(), model=model, data=data, usage=usage)
    return JSONResponse(resp.model_dump())


def _refusal(message: str, code: str):
    async def refuse(request: Request) -> Response:
        raise APIError(400, message.format(model=get_state(request).model_name), code=code)

    return refuse


def runner_routes(is_pooling: bool, routes: list[Route]) -> list[Route]:
    """``routes`` (the generate server's) adjusted to the runner: /v1/embeddings added, and the routes the
    runner cannot serve replaced by a 400 that says why."""
    if not is_pooling:
        refuse = _refusal(
            "model {model!r} is served as a generative model (runner='generate'), so /v1/embeddings is not available: "
            "serve an embedding model (a sentence-transformers or BERT checkpoint), or pass --runner pooling to embed "
            "with this model's last-token hidden states",
            "wrong_runner",
        )
        return [*routes, Route("/v1/embeddings", refuse, methods=["POST"])]
    refuse = _refusal(
        "model {model!r} is an embedding model (runner='pooling'): it cannot generate text. Use POST /v1/embeddings, "
        "or serve a generative model for completions and chat",
        "wrong_runner",
    )
    kept = [r for r in routes if r.path not in GENERATE_PATHS]
    return [
        *kept,
        *(Route(p, refuse, methods=["POST"]) for p in GENERATE_PATHS),
        Route("/v1/embeddings", create_embedding, methods=["POST"]),
    ]
