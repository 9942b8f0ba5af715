"""POST /v1/chat/completions: messages through the model's chat template, plain JSON or SSE."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import jinja2
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.llm import render_chat
from jaxserve.media import load_image

from jaxserve.server.deltas import DeltaTracker
from jaxserve.server.errors import APIError, bad_request, from_value_error
from jaxserve.server.logprobs import chat_logprobs, prompt_logprobs_json
from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.server.protocol_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaMessage,
    now_s,
    random_id,
)
from jaxserve.server.serving import (
    ServerState, collect_finals, get_state, guard_stream, parse_body, stream_choices, usage,
)
from jaxserve.server.sse import SSEResponse, sse_event

logger = logging.getLogger("jaxserve.server")


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise bad_request("tools (function calling) are not supported", param="tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not available with stream=true; leave stream off to get them",
                          param="prompt_logprobs")


def render_messages(state: ServerState, body) -> list[int]:
    """Token ids of the conversation under the chat template; 400 when the template rejects it."""
    tokenizer = state.need_tokenizer("chat")
    conversation = [m.as_template_dict() for m in body.messages]
    try:
        return render_chat(tokenizer, conversation, body.chat_template, body.add_generation_prompt,
                           body.continue_final_message)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad_request(f"the chat template could not render these messages: {e}", param="messages") from None


async def with_images(state: ServerState, body, prompt: list[int]) -> tuple[list[int], Any]:
    """The messages' image_url parts decoded and preprocessed: (expanded prompt ids, MultiModalInputs or None).
    A bad image, or images for a text-only model, is a 400."""
    urls = [url for m in body.messages for url in m.image_urls]
    processor = state.mm_processor
    if not urls and processor is None:
        return prompt, None
    if urls and processor is None:
        raise bad_request(
            f"the model {state.model_name} is text-only and cannot take image_url parts; send text only",
            param="messages",
        )

    def decode_and_process():
        images = [load_image(url, state.allowed_local_media_path) for url in urls]
        return processor.process(prompt, images)

    try:  # decoding and resizing take milliseconds an image: off the event loop
        return await run_in_threadpool(decode_and_process)
    except ValueError as e:  # MediaError included: the message names the problem and what works
        raise APIError(400, f"messages: {e}", param="messages", code="invalid_image" if urls else None) from None


async def create_chat_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    model = state.resolve_model(body.model)
    _check_unsupported(body)
    prompt, mm = await with_images(state, body, render_messages(state, body))
    max_tokens = body.requested_max_tokens
    tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    state.check_fits(len(prompt), max_tokens, "messages", tokens_param)
    top_k = body.top_logprobs or 0
    try:
        params = body.sampling_params(max_tokens, top_k if body.logprobs else None)
    except ValueError as e:
        raise from_value_error(e) from None
    request_id = random_id("chatcmpl")
    streams = await state.submit(request_id, [prompt], params, model, mm=mm)
    if body.stream:
        events = _stream(state, body, model, request_id, streams, len(prompt), top_k)
        return SSEResponse(guard_stream(events, what="chat", request_id=request_id, engine=state.engine, streams=streams))
    finals = await collect_finals(request, state.engine, streams)
    tracker = DeltaTracker(body.n, [len(prompt)])
    choices = []
    for d in tracker.update(0, finals[0]):
        lp = chat_logprobs(d.token_ids, d.logprobs, top_k) if body.logprobs and d.logprobs is not None else None
        choices.append(
            ChatChoice(
                index=d.index, message=ChatResponseMessage(content=d.text), logprobs=lp,
                finish_reason=d.finish_reason, stop_reason=d.stop_reason,
            )
        )
    choices.sort(key=lambda c: c.index)
    resp = ChatCompletionResponse(
        id=request_id, created=now_s(), model=model, choices=choices,
        usage=usage(tracker.prompt_lens, tracker.completion_tokens),
        prompt_logprobs=prompt_logprobs_json(finals[0].prompt_logprobs, body.prompt_logprobs or 0),
    )
    return JSONResponse(resp.model_dump())


async def _stream(
    state: ServerState, body: ChatCompletionRequest, model: str, request_id: str, streams, prompt_len: int, top_k: int
) -> AsyncIterator[bytes]:
    created = now_s()
    tracker = DeltaTracker(body.n, [prompt_len])

    def chunk(choices, with_usage=None) -> bytes:
        return sse_event(
            ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=with_usage)
        )

    # OpenAI opens every choice with the role and empty content, before any token is ready.
    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(body.n)])

    def choice(_, d, __) -> ChatChunkChoice:
        lp = chat_logprobs(d.token_ids, d.logprobs, top_k) if body.logprobs and d.logprobs is not None else None
        return ChatChunkChoice(
            index=d.index, delta=DeltaMessage(content=d.text), logprobs=lp,
            finish_reason=d.finish_reason, stop_reason=d.stop_reason,
        )  # fmt: skip

    async for event in stream_choices(streams, tracker, body, choice, chunk):
        yield event
