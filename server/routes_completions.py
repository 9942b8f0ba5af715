"""POST /v1/completions: text or token-id prompts (one or many), plain JSON or SSE."""

from __future__ import annotations

import logging
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.server.deltas import Delta, DeltaTracker
from jaxserve.server.errors import bad_request, from_value_error
from jaxserve.server.logprobs import completion_logprobs
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.protocol_responses import (
    CompletionChoice,
    CompletionResponse,
    now_s,
    random_id,
)
from jaxserve.server.serving import (
    ServerState, collect_finals, get_state, guard_stream, parse_body, stream_choices, usage,
)
from jaxserve.server.sse import SSEResponse, sse_event

logger = logging.getLogger("jaxserve.server")


def _check_unsupported(body: CompletionRequest) -> None:
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of={body.best_of} is not supported; only best_of == n ({body.n})", param="best_of")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", param="echo")


async def create_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, CompletionRequest)
    model = state.resolve_model(body.model)
    _check_unsupported(body)
    prompts = [state.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
    for ids in prompts:
        state.check_fits(len(ids), body.max_tokens, "prompt", "max_tokens")
    try:
        params = body.sampling_params(body.max_tokens, body.logprobs)
    except ValueError as e:
        raise from_value_error(e) from None
    texts = [p if isinstance(p, str) else None for p in body.prompts()]
    echo = [""] * len(prompts)
    if body.echo:
        tokenizer = state.need_tokenizer("echo of a token-id prompt") if None in texts else None
        echo = [t if t is not None else tokenizer.decode(ids) for t, ids in zip(texts, prompts)]
    request_id = random_id("cmpl")
    streams = await state.submit(request_id, prompts, params, model)
    if body.stream:
        events = _stream(state, body, model, request_id, streams, prompts, echo)
        return SSEResponse(
            guard_stream(events, what="completion", request_id=request_id, engine=state.engine, streams=streams)
        )
    finals = await collect_finals(request, state.engine, streams)
    tracker = DeltaTracker(body.n, [len(p) for p in prompts])
    choices = []
    for i, out in enumerate(finals):
        for d in tracker.update(i, out):
            choices.append(_choice(d, echo[i], body.logprobs, 0))
    choices.sort(key=lambda c: c.index)
    resp = CompletionResponse(
        id=request_id, created=now_s(), model=model, choices=choices,
        usage=usage(tracker.prompt_lens, tracker.completion_tokens),
    )
    return JSONResponse(resp.model_dump())


def _choice(d: Delta, echo: str, logprobs: Optional[int], offset: int) -> CompletionChoice:
    lp = None
    if logprobs is not None and d.logprobs is not None:
        lp, _ = completion_logprobs(d.token_ids, d.logprobs, offset + len(echo))
    return CompletionChoice(
        index=d.index, text=echo + d.text, logprobs=lp, finish_reason=d.finish_reason, stop_reason=d.stop_reason
    )


async def _stream(
    state: ServerState,
    body: CompletionRequest,
    model: str,
    request_id: str,
    streams,
    prompts: list[list[int]],
    echo: list[str],
) -> AsyncIterator[bytes]:
    created = now_s()
    tracker = DeltaTracker(body.n, [len(p) for p in prompts])
    offsets: dict[int, int] = {}  # choice index -> text offset of its next token (completions logprobs)

    def chunk(choices, with_usage) -> bytes:
        resp = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=with_usage)
        return sse_event(resp)

    def choice(i: int, d: Delta) -> CompletionChoice:
        prefix = echo[i] if d.first else ""
        lp = None
        if body.logprobs is not None and d.logprobs is not None:
            lp, offsets[d.index] = completion_logprobs(d.token_ids, d.logprobs, offsets.get(d.index, len(echo[i])))
        return CompletionChoice(
            index=d.index, text=prefix + d.text, logprobs=lp, finish_reason=d.finish_reason, stop_reason=d.stop_reason
        )

    async for event in stream_choices(streams, tracker, body, choice, chunk):
        yield event
