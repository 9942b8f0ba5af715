"""POST /v1/completions: text or token-id prompts (one or many), plain JSON or SSE."""

from __future__ import annotations

import functools
import logging
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.detokenizer import decode_token
from jaxserve.outputs import RequestOutput

from jaxserve.server.deltas import Delta, DeltaTracker
from jaxserve.server.errors import bad_request, from_value_error
from jaxserve.server.logprobs import completion_logprobs, prompt_logprobs_json
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.protocol_responses import (
    CompletionChoice,
    CompletionLogprobs,
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
    if body.max_tokens == 0 and not body.echo:
        raise bad_request(
            "max_tokens=0 generates nothing and, without echo, returns nothing: give max_tokens >= 1, or echo=true "
            "(with logprobs) to score the prompt alone",
            param="max_tokens",
        )
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs are not available with stream=true; leave stream off, or stream with echo=true and "
            "logprobs, whose first chunk carries the prompt's logprobs",
            param="prompt_logprobs",
        )


async def create_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, CompletionRequest)
    model = state.resolve_model(body.model)
    _check_unsupported(body)
    prompts = [state.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
    # max_tokens=0 (with echo): the engine samples one token, which the response leaves out (the prompt alone).
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    for ids in prompts:
        state.check_fits(len(ids), max_tokens, "prompt", "max_tokens")
    # echo with logprobs scores the echoed prompt too: the engine computes the prompt's logprobs.
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    try:
        params = body.sampling_params(max_tokens, body.logprobs, prompt_logprobs)
    except ValueError as e:
        raise from_value_error(e) from None
    texts = [p if isinstance(p, str) else None for p in body.prompts()]
    echo = [""] * len(prompts)
    decode = None
    if body.echo:
        tokenizer = state.need_tokenizer("echo of a token-id prompt") if None in texts else state.tokenizer
        echo = [t if t is not None else tokenizer.decode(ids) for t, ids in zip(texts, prompts)]
        if tokenizer is not None:
            decode = functools.partial(decode_token, tokenizer)
    request_id = random_id("cmpl")
    streams = await state.submit(request_id, prompts, params, model)
    shape = _Shape(body, echo, prompts, decode, prompt_details=state.enable_prompt_tokens_details)
    if body.stream:
        events = _stream(state, body, model, request_id, streams, shape)
        return SSEResponse(
            guard_stream(events, what="completion", request_id=request_id, engine=state.engine, streams=streams)
        )
    finals = await collect_finals(request, state.engine, streams)
    tracker = shape.tracker()
    choices = []
    for i, out in enumerate(finals):
        for d in tracker.update(i, out):
            choice, _ = shape.choice(i, d, out, len(echo[i]))
            choices.append(choice)
    choices.sort(key=lambda c: c.index)
    resp = CompletionResponse(
        id=request_id, created=now_s(), model=model, choices=choices,
        usage=usage(tracker),
    )
    return JSONResponse(resp.model_dump())


class _Shape:
    """How a completion's choices look: echo (the prompt before the text, and with logprobs its tokens' logprobs
    before the output's), max_tokens=0 (the prompt alone), vLLM's prompt_logprobs field."""

    def __init__(self, body: CompletionRequest, echo: list[str], prompts: list[list[int]], decode, *,
                 prompt_details: bool = False) -> None:  # fmt: skip
        self.body = body
        self.prompt_details = prompt_details
        self.echo = echo
        self.prompts = prompts
        self.decode = decode
        self.prompt_only = body.max_tokens == 0

    def tracker(self) -> DeltaTracker:
        tracker = DeltaTracker(self.body.n, [len(p) for p in self.prompts], prompt_details=self.prompt_details)
        tracker.counts_completion = not self.prompt_only  # the one token sampled is not returned
        return tracker

    def choice(self, i: int, d: Delta, out: RequestOutput, offset: int) -> tuple[CompletionChoice, int]:
        """Choice ``d`` of prompt ``i``; ``offset``: the text offset of the output's next token. Returns (the
        choice, the next token's offset)."""
        body = self.body
        prefix = self.echo[i] if d.first else ""
        lp = None
        if body.logprobs is not None:
            lp = CompletionLogprobs()
            if body.echo and d.first and out.prompt_logprobs is not None:
                completion_logprobs(self.prompts[i], out.prompt_logprobs, 0, body.logprobs, self.decode, into=lp)
            if not self.prompt_only and d.logprobs is not None:
                _, offset = completion_logprobs(d.token_ids, d.logprobs, offset, into=lp)
        plp = None
        if body.prompt_logprobs is not None and d.first:
            plp = prompt_logprobs_json(out.prompt_logprobs, body.prompt_logprobs)
        choice = CompletionChoice(
            index=d.index, text=prefix + ("" if self.prompt_only else d.text), logprobs=lp,
            finish_reason=d.finish_reason, stop_reason=d.stop_reason, prompt_logprobs=plp,
        )  # fmt: skip
        return choice, offset


async def _stream(
    state: ServerState, body: CompletionRequest, model: str, request_id: str, streams, shape: _Shape
) -> AsyncIterator[bytes]:
    created = now_s()
    tracker = shape.tracker()
    offsets: dict[int, int] = {}  # choice index -> text offset of its next token (completions logprobs)

    def chunk(choices, with_usage) -> bytes:
        resp = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=with_usage)
        return sse_event(resp)

    def choice(i: int, d: Delta, out: RequestOutput) -> CompletionChoice:
        made, offsets[d.index] = shape.choice(i, d, out, offsets.get(d.index, len(shape.echo[i])))
        return made

    async for event in stream_choices(streams, tracker, body, choice, chunk):
        yield event
