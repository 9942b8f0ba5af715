"""POST /v1/chat/completions: messages through the model's chat template, plain JSON or SSE."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional

import jinja2
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve import reasoning
from jaxserve.llm import render_chat
from jaxserve.media import load_image

from jaxserve.server.deltas import DeltaTracker
from jaxserve.server.errors import APIError, bad_request, from_value_error
from jaxserve.server.logprobs import chat_logprobs, prompt_logprobs_json
from jaxserve.server.protocol import ChatCompletionRequest, template_tools
from jaxserve.server.protocol_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    now_s,
    random_id,
)
from jaxserve.server.serving import (
    ServerState, collect_finals, get_state, guard_stream, parse_body, stream_choices, usage,
)
from jaxserve.server.sse import SSEResponse, sse_event
from jaxserve.server.reply_reader import ReplyReader
from jaxserve.server.tool_calls import ToolCallStream, ToolPlan

logger = logging.getLogger("jaxserve.server")


def _check_unsupported(body: ChatCompletionRequest) -> None:
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
                           body.continue_final_message, template_tools(body.tools),
                           {**state.default_chat_template_kwargs, **(body.chat_template_kwargs or {})})
    except ValueError as e:
        if str(e).startswith("chat_template_kwargs"):
            raise bad_request(str(e), param="chat_template_kwargs") from None
        raise bad_request(f"the chat template could not render these messages: {e}", param="messages") from None
    except jinja2.TemplateError as e:
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


async def prepare_chat(state: ServerState, body: ChatCompletionRequest, prompt_param: str, tokens_param: str,
                       logprobs: Optional[int]) -> tuple[ToolPlan, list[int], Any, Any]:  # fmt: skip
    """What a chat request submits: (its tool plan, the rendered prompt, its images or None, SamplingParams); a 400
    naming the field (``prompt_param`` / ``tokens_param`` for a prompt too long to fit) when it cannot."""
    try:
        tools = ToolPlan.for_request(body, state.tool_call_parser)
    except ValueError as e:
        raise from_value_error(e) from None
    prompt, mm = await with_images(state, body, render_messages(state, body))
    state.check_fits(len(prompt), body.requested_max_tokens, prompt_param, tokens_param)
    try:
        params = body.sampling_params(body.requested_max_tokens, logprobs)
    except ValueError as e:
        raise from_value_error(e) from None
    if tools.keep_special_tokens:
        params.skip_special_tokens = False
    return tools, prompt, mm, params


async def create_chat_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    model = state.resolve_model(body.model)
    _check_unsupported(body)
    top_k = body.top_logprobs or 0
    tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    tools, prompt, mm, params = await prepare_chat(state, body, "messages", tokens_param, top_k if body.logprobs else None)
    request_id = random_id("chatcmpl")
    streams = await state.submit(request_id, [prompt], params, model, mm=mm)
    if body.stream:
        events = _stream(state, body, model, request_id, streams, prompt, top_k, tools)
        return SSEResponse(guard_stream(events, what="chat", request_id=request_id, engine=state.engine, streams=streams))
    finals = await collect_finals(request, state.engine, streams)
    tracker = DeltaTracker(body.n, [len(prompt)], prompt_details=state.enable_prompt_tokens_details)
    reply_state = state.reasoning_state(prompt)
    choices = []
    for d in tracker.update(0, finals[0]):
        lp = chat_logprobs(d.token_ids, d.logprobs, top_k) if body.logprobs and d.logprobs is not None else None
        thought, text = None, d.text
        if reply_state is not None:  # a reasoning model: the <think> block apart from the answer
            cut = reasoning.split(state.reasoning, reply_state, d.text, final=True)
            thought, text = cut.reasoning, cut.content
        message = ChatResponseMessage(content=(text or None) if thought is not None else text)
        finish_reason = d.finish_reason
        if tools.parser is not None:
            calls = ToolCallStream(tools)
            content, made = calls.whole(text)
            message = ChatResponseMessage(content=content, tool_calls=[
                ToolCall(id=call_id, function=FunctionCall(name=c.name, arguments=c.arguments)) for call_id, c in made
            ] or None)
            finish_reason = tools.finish_reason(calls.called, d.finish_reason)
        if body.include_reasoning:
            message.reasoning = message.reasoning_content = thought
        choices.append(
            ChatChoice(
                index=d.index, message=message, logprobs=lp, finish_reason=finish_reason, stop_reason=d.stop_reason,
            )
        )
    choices.sort(key=lambda c: c.index)
    resp = ChatCompletionResponse(
        id=request_id, created=now_s(), model=model, choices=choices,
        usage=usage(tracker),
        prompt_logprobs=prompt_logprobs_json(finals[0].prompt_logprobs, body.prompt_logprobs or 0),
    )
    return JSONResponse(resp.model_dump())


async def _stream(
    state: ServerState, body: ChatCompletionRequest, model: str, request_id: str, streams, prompt: list[int],
    top_k: int, tools: ToolPlan,
) -> AsyncIterator[bytes]:
    created = now_s()
    tracker = DeltaTracker(body.n, [len(prompt)], prompt_details=state.enable_prompt_tokens_details)

    def chunk(choices, with_usage=None) -> bytes:
        return sse_event(
            ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=with_usage)
        )

    # OpenAI opens every choice with the role and empty content, before any token is ready.
    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(body.n)])

    reply_state = state.reasoning_state(prompt)
    readers: dict[int, ReplyReader] = {}  # per choice: its reasoning, answer and tool calls

    def choice(_, d, __) -> ChatChunkChoice:
        lp = chat_logprobs(d.token_ids, d.logprobs, top_k) if body.logprobs and d.logprobs is not None else None
        reader = readers.setdefault(d.index, ReplyReader(state.reasoning, reply_state, tools))
        thought, content, made = reader.feed(d.text, final=d.finish_reason is not None)
        delta = DeltaMessage(content=content if content or not (made or thought) else None, tool_calls=[
            DeltaToolCall(index=i, id=call_id, type="function" if call_id else None,
                          function=DeltaFunctionCall(name=c.name if call_id else None, arguments=c.arguments))
            for i, call_id, c in made
        ] or None)
        if thought and body.include_reasoning:
            delta.reasoning = delta.reasoning_content = thought
        return ChatChunkChoice(
            index=d.index, delta=delta, logprobs=lp, finish_reason=tools.finish_reason(reader.called, d.finish_reason),
            stop_reason=d.stop_reason,
        )  # fmt: skip

    async for event in stream_choices(streams, tracker, body, choice, chunk):
        yield event
