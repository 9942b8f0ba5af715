"""A response's output items (reasoning, a message, function calls) and, when streamed, the events that build them.

``OutputWriter`` is fed what a reply gained, in the order it arrives (reasoning, then answer text, then calls, as the
chat route's readers give them), and keeps the items: it opens an item when a new kind of output starts and closes
the one before. Every step is also an event of the Responses API's stream (``response.output_item.added``,
``response.output_text.delta``, ...), so a stream and a whole response are built by the same calls; a non-streamed
response just drops the events.
"""

from __future__ import annotations

import collections
import secrets
from typing import Any, Optional

from jaxserve.server.errors import APIError
from jaxserve.server.protocol_responses import now_s
from jaxserve.server.responses_protocol import tool_choice_json, tools_json


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class OutputWriter:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []  # not yet sent (a stream drains them after each feed)
        self._open: Optional[dict[str, Any]] = None
        self._calls: dict[int, dict[str, Any]] = {}  # call index (ToolCallStream's) -> its item

    def _event(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, **fields})

    def _start(self, item: dict[str, Any]) -> dict[str, Any]:
        self.close()
        self.items.append(item)
        self._open = item
        self._event("response.output_item.added", output_index=len(self.items) - 1, item=_snapshot(item))
        return item

    def _where(self, item) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def reasoning(self, text: str) -> None:
        if not text:
            return
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = self._start({"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress",
                                "content": []})
            item["content"].append({"type": "reasoning_text", "text": ""})
            self._event("response.content_part.added", **self._where(item), content_index=0,
                        part={"type": "reasoning_text", "text": ""})
        item["content"][0]["text"] += text
        self._event("response.reasoning_text.delta", **self._where(item), content_index=0, delta=text)

    def text(self, text: str, logprobs: list[dict[str, Any]] = ()) -> None:
        """More answer text, with the logprobs of the tokens that wrote it (when asked for)."""
        if not text:
            return
        item = self._open
        if item is None or item["type"] != "message":
            item = self._start({"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress",
                                "content": []})
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self._event("response.content_part.added", **self._where(item), content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        item["content"][0]["text"] += text
        item["content"][0]["logprobs"] += logprobs
        self._event("response.output_text.delta", **self._where(item), content_index=0, delta=text,
                    logprobs=list(logprobs))

    def more_logprobs(self, logprobs: list[dict[str, Any]]) -> None:
        """Logprobs of answer tokens whose text was held back and never sent as answer (it may have become a tool
        call): the open message keeps them, in its closing events; without an open message they are dropped."""
        if logprobs and self._open is not None and self._open["type"] == "message":
            self._open["content"][0]["logprobs"] += logprobs

    def call(self, index: int, call_id: Optional[str], name: Optional[str], arguments: str) -> None:
        """A tool call's first delta (``call_id`` set, with its name) or more of its arguments."""
        if call_id is not None:
            self._calls[index] = self._start({"type": "function_call", "id": new_id("fc"), "call_id": call_id,
                                              "name": name, "arguments": "", "status": "in_progress"})
        item = self._calls[index]
        if arguments:
            item["arguments"] += arguments
            self._event("response.function_call_arguments.delta", **self._where(item), delta=arguments)

    def close(self, status: str = "completed") -> None:
        """End the open item (its final events)."""
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        where = self._where(item)
        if item["type"] == "message":
            part = item["content"][0]
            self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                        logprobs=list(part["logprobs"]))
            self._event("response.content_part.done", **where, content_index=0, part=dict(part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            self._event("response.content_part.done", **where, content_index=0, part=dict(part))
        else:
            self._event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"])
        self._event("response.output_item.done", output_index=where["output_index"], item=_snapshot(item))

    def drain(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    """A copy of an item as it stands (events must not change when the item grows later)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [{k: list(v) if k == "logprobs" else v for k, v in p.items()} for p in out["content"]]
    return out


def response_body(
    *, response_id: str, model: str, body, items: list[dict[str, Any]], status: str, usage: Optional[dict[str, Any]],
    incomplete: Optional[str] = None, created_at: Optional[int] = None,
) -> dict[str, Any]:
    """The Response object: the request's settings echoed beside the output."""
    text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at or now_s(),
        "status": status,
        "model": model,
        "output": items,
        "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": text_format},
        "tool_choice": tool_choice_json(body.tool_choice),
        "tools": tools_json(body.tools),
        "truncation": "disabled",
        "top_logprobs": body.top_logprobs,
        "store": body.store,
        "usage": usage,
    }


def response_usage(prompt_tokens: int, output_tokens: int, reasoning_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


class ResponseStore:
    """Stored responses by id: the response as sent, and the whole conversation it ends (for the next turn)."""

    capacity = 1000  # the oldest are dropped past this many

    def __init__(self) -> None:
        self._items: collections.OrderedDict[str, tuple[dict, list]] = collections.OrderedDict()

    def put(self, response: dict, conversation: list) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> tuple[dict, list]:
        try:
            return self._items[response_id]
        except KeyError:
            raise APIError(404, f"Response with id {response_id!r} not found: it was never stored (store=false), or "
                                f"this server restarted or dropped it (it keeps the newest {self.capacity})",
                           param=param, code="response_not_found") from None

    def pop(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]
