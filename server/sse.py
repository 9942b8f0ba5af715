"""Server-sent events, and running handlers so that a client that goes away cancels its work at once.

Cancelling is what frees the engine: the stream generators abort their requests in ``finally``, which
frees their KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("jaxserve.server")

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> bytes:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_unset=False)
    else:
        data = json.dumps(payload, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse:
    """Streams ``events`` (already encoded) as text/event-stream; stops and closes them on disconnect.

    Starlette's StreamingResponse notices a disconnect only on some ASGI versions; this one always
    listens, and always closes the generator, so its ``finally`` (the abort) runs right away.
    """

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # nginx: don't buffer the stream
        ]
        listener = asyncio.ensure_future(_wait_for_disconnect(receive))
        sender = asyncio.ensure_future(self._send_all(send, headers))
        try:
            await asyncio.wait({listener, sender}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, listener):
                if not task.done():
                    task.cancel()
            await asyncio.gather(sender, listener, return_exceptions=True)
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
        if sender.done() and not sender.cancelled() and sender.exception() is not None:
            exc = sender.exception()
            if not isinstance(exc, OSError):  # a broken pipe is just a client going away
                raise exc

    async def _send_all(self, send: Send, headers) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; if the client disconnects first, cancel it (aborting its requests) and raise CancelledError."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        logger.info("client disconnected from %s; request aborted", request.url.path)
        raise asyncio.CancelledError("client disconnected")
    return task.result()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive: yields (which, item). Closes all on exit."""
    if len(streams) == 1:  # the common case: no tasks needed
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    _end = object()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None))
            await queue.put((i, _end, None))
        except BaseException as e:  # noqa: BLE001 - hand errors to the consumer
            await queue.put((i, _end, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                if isinstance(error, asyncio.CancelledError):
                    raise asyncio.CancelledError()
                raise error
            if item is _end:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

