"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API, served as a chat request.

The request becomes a chat request (responses_protocol.py), which the chat route's pieces render, check and submit;
the reply is read as a chat reply is (ReplyReader: reasoning, answer, tool calls) and written as output items
(responses_output.py), whole or as the API's stream of events. Responses with ``store`` (the default) are kept in
this server's memory, the newest ``ResponseStore.capacity`` of them, for ``previous_response_id`` and GET.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.reasoning import ANSWERING, UNDECIDED
from jaxserve.server.deltas import DeltaTracker, stream_outputs
from jaxserve.server.errors import from_value_error
from jaxserve.server.logprobs import token_logprob_dicts
from jaxserve.server.protocol import ChatMessage
from jaxserve.server.protocol_responses import now_s
from jaxserve.server.reply_reader import ReplyReader
from jaxserve.server.responses_output import OutputWriter, new_id, response_body, response_usage
from jaxserve.server.responses_protocol import ResponsesRequest
from jaxserve.server.routes_chat import prepare_chat
from jaxserve.server.serving import ServerState, collect_finals, get_state, guard_stream, parse_body
from jaxserve.server.sse import SSEResponse
from jaxserve.server.tool_calls import ToolPlan


async def create_response(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, ResponsesRequest)
    model = state.resolve_model(body.model)
    history = state.responses.get(body.previous_response_id, "previous_response_id")[1] if body.previous_response_id else []
    try:
        chat = body.as_chat(history)
    except ValueError as e:
        raise from_value_error(e) from None
    logprobs = body.logprobs
    tools, prompt, mm, params = await prepare_chat(state, chat, "input", "max_output_tokens", logprobs)
    response_id = new_id("resp")
    streams = await state.submit(response_id, [prompt], params, model, mm=mm)
    turn = _Turn(state, body, chat, model, response_id, prompt, tools, logprobs)
    if body.stream:
        return SSEResponse(guard_stream(turn.stream(streams), what="responses", request_id=response_id,
                                        engine=state.engine, streams=streams))
    finals = await collect_finals(request, state.engine, streams)
    (d,) = DeltaTracker(1, [len(prompt)]).update(0, finals[0])
    turn.cached_tokens = finals[0].num_cached_tokens
    turn.feed(d.text, d.token_ids, final=True, logprobs=d.logprobs)
    return JSONResponse(turn.finish(d.finish_reason))


class _Turn:
    """One response being written: its reader, its items, and what it stores at the end."""

    def __init__(self, state: ServerState, body: ResponsesRequest, chat, model: str, response_id: str,
                 prompt: list[int], tools: ToolPlan, logprobs: Optional[int]) -> None:  # fmt: skip
        self.state, self.body, self.chat, self.model, self.id = state, body, chat, model, response_id
        self.prompt_len = len(prompt)
        self.reply_state = state.reasoning_state(prompt)
        self.reader = ReplyReader(state.reasoning, self.reply_state, tools)
        self.writer = OutputWriter()
        self.token_ids: list[int] = []
        self.cached_tokens = 0  # prompt tokens the prefix cache served
        self.top_logprobs = logprobs  # None: no logprobs asked for (include), else alternatives per token
        self._pending: list[dict[str, Any]] = []  # answer tokens' logprobs whose text is not sent yet
        self._reasoning_end: Optional[int] = None  # the index of </think> among the output tokens, once seen
        self.created_at = now_s()
        self.sequence = 0

    def feed(self, text: str, token_ids: list[int], final: bool, logprobs=None) -> None:
        first = len(self.token_ids)
        self.token_ids += token_ids
        end_id = self.state.reasoning_end_id
        if self._reasoning_end is None and end_id is not None and end_id in token_ids:  # the new tokens only
            self._reasoning_end = first + token_ids.index(end_id)
        if self.top_logprobs is not None and logprobs is not None:
            entries = token_logprob_dicts(token_ids, logprobs, self.top_logprobs)
            self._pending += [e for i, e in enumerate(entries) if self._is_answer(first + i)]
        thought, content, made = self.reader.feed(text, final)
        self.writer.reasoning(thought)
        if content:
            self.writer.text(content, self._pending)  # the answer tokens so far go with the text they wrote
            self._pending = []
        for index, call_id, call in made:
            self.writer.call(index, call_id, call.name, call.arguments)

    def finish(self, finish_reason: Optional[str]) -> dict[str, Any]:
        """Close the output; the Response object (stored when asked)."""
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        self.writer.more_logprobs(self._pending)
        self._pending = []
        self.writer.close("incomplete" if incomplete else "completed")
        usage = response_usage(self.prompt_len, len(self.token_ids), self._reasoning_tokens(), self.cached_tokens)
        response = response_body(
            response_id=self.id, model=self.model, body=self.body, items=self.writer.items,
            status="incomplete" if incomplete else "completed", usage=usage, incomplete=incomplete,
            created_at=self.created_at,
        )  # fmt: skip
        if self.body.store:
            turns = list(self.chat.messages)[1:] if self.body.instructions else list(self.chat.messages)
            self.state.responses.put(response, turns + [self._reply_message()])
        return response

    def _is_answer(self, i: int) -> bool:
        """Whether output token ``i`` belongs to the answer rather than to a reasoning block (its tags included)."""
        if self.reply_state is None or self.reply_state == ANSWERING:
            return True
        if self.reply_state == UNDECIDED and self.token_ids[0] != self.state.reasoning_start_id:
            return True  # a reply that could open a block and did not
        return self._reasoning_end is not None and i > self._reasoning_end

    def _reasoning_tokens(self) -> int:
        """Output tokens up to and including </think> (all of them if the reply never closed its block)."""
        if not any(item["type"] == "reasoning" for item in self.writer.items):
            return 0
        return self._reasoning_end + 1 if self._reasoning_end is not None else len(self.token_ids)

    def _reply_message(self) -> ChatMessage:
        """The reply as the assistant turn a next request's chat template sees (reasoning left out)."""
        text = "".join(i["content"][0]["text"] for i in self.writer.items if i["type"] == "message")
        calls = []
        for item in self.writer.items:
            if item["type"] == "function_call":
                try:
                    arguments = json.loads(item["arguments"] or "{}")
                except json.JSONDecodeError:
                    arguments = {}  # a call cut short (max_output_tokens): its partial arguments are not kept
                calls.append({"id": item["call_id"], "function": {"name": item["name"], "arguments": arguments}})
        return ChatMessage(role="assistant", content=text, tool_calls=calls or None)

    def _event(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()

    async def stream(self, streams) -> AsyncIterator[bytes]:
        opening = response_body(
            response_id=self.id, model=self.model, body=self.body, items=[], status="in_progress", usage=None,
            created_at=self.created_at,
        )  # fmt: skip
        yield self._event({"type": "response.created", "response": opening})
        yield self._event({"type": "response.in_progress", "response": opening})
        tracker = DeltaTracker(1, [self.prompt_len])
        finish_reason = None
        async for i, out in stream_outputs(streams):
            self.cached_tokens = out.num_cached_tokens
            for d in tracker.update(i, out):
                self.feed(d.text, d.token_ids, final=d.finish_reason is not None, logprobs=d.logprobs)
                finish_reason = d.finish_reason or finish_reason
                for event in self.writer.drain():
                    yield self._event(event)
        response = self.finish(finish_reason)
        for event in self.writer.drain():
            yield self._event(event)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield self._event({"type": kind, "response": response})


async def retrieve_response(request: Request) -> Response:
    return JSONResponse(get_state(request).responses.get(request.path_params["response_id"])[0])


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    get_state(request).responses.pop(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
