"""AsyncLLMEngine: the LLMEngine loop in a background thread, driven from asyncio.

Why a thread: ``LLMEngine.step()`` blocks for a whole model step, and JAX releases the GIL while the
device works, so a plain thread keeps the event loop free to accept and stream requests.

The contract between the two sides:
- The event loop never touches the engine. It puts commands (add, abort, stop) on a thread-safe
  queue; the engine thread drains that queue between steps, so the engine stays single-caller.
- The engine thread never touches asyncio objects directly. After each step it hands a batch of
  outputs to the loop with one ``loop.call_soon_threadsafe`` call; each request has a RequestStream.
- Outputs are cumulative (whole text so far), so a slow reader skips to the newest one.
- An exception in the engine thread kills the engine: every stream and every pending add fails with
  EngineDeadError, and later adds fail at once (the server answers 500 and /health fails).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Optional

from jaxserve.config import EngineArgs
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve.async_engine")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (crashed or shut down); no request can be served."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class EngineObserver:
    """Hooks the engine thread calls as tokens come out (metrics). Methods must be cheap and thread-safe."""

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        pass

    def on_new_tokens(self, num_tokens: int, inter_token_s: Optional[float]) -> None:
        """``num_tokens`` new tokens for one sample; ``inter_token_s`` per token, None for a first token."""

    def on_finished(self, e2e_s: float, output: RequestOutput) -> None:
        pass


@dataclasses.dataclass
class _Timing:
    """Engine-thread bookkeeping of one request, for the observer."""

    arrival: float
    num_tokens: list[int]  # tokens seen so far, per sample
    last_time: list[float]  # when the last token of each sample came out
    first_token_seen: bool = False


class RequestStream:
    """The outputs of one request, as the event loop sees them. Iterate with ``async for``."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Loop thread only."""
        self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The newest output; waits for one. Earlier outputs are dropped: each one contains them."""
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        latest = None
        while self._items:
            item = self._items.popleft()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            latest = item
        if latest.finished:
            self.finished = True
        return latest

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        return await self.get()


class AsyncLLMEngine:
    """Serves an LLMEngine to asyncio code; any number of requests stream independently.

    ``max_waiting_requests`` bounds the requests queued but not yet running; beyond it add_request
    raises QueueFullError at once instead of queueing without bound.
    """

    def __init__(self, engine, max_waiting_requests: Optional[int] = None, observer: Optional[EngineObserver] = None):
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} is invalid: must be >= 1 (or None for no limit)")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer or EngineObserver()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._timings: dict[str, _Timing] = {}  # engine thread only
        self._num_pending_adds = 0  # loop thread only: adds queued but not yet taken by the engine thread
        self._stats = engine.get_stats()  # replaced (never mutated) by the engine thread
        self._dead: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, progress: bool = True, **kwargs) -> "AsyncLLMEngine":
        from jaxserve.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(args, progress=progress), **kwargs)

    # ------------------------------------------------------------------ lifecycle (loop side)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: Optional[float] = 30.0) -> None:
        """Abort what is left, stop the engine thread and wait for it."""
        if self._thread is None:
            return
        self._commands.put(("stop",))
        self._thread.join(timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_error(self) -> Optional[BaseException]:
        return self._dead

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine thread is not serving."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead!r}")
        if not self.is_running:
            raise EngineDeadError("engine thread is not running")

    def get_stats(self):
        """The EngineStats of the last step (refreshed between steps)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        return self._stats.num_waiting + self._num_pending_adds

    # ------------------------------------------------------------------ requests (loop side)

    async def add_request(
        self,
        request_id: str,
        prompt,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        lora_request=None,  # jaxserve.lora.LoRARequest
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        Raises ValueError for bad input (from the engine's validation), QueueFullError when the waiting
        queue is full, EngineDeadError when the engine is not serving. None of these affect other requests.
        """
        self.check_health()
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(
                f"{self.num_waiting} requests are waiting, the limit (--max-waiting-requests) is "
                f"{self.max_waiting_requests}; retry later"
            )
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop)
        accepted = loop.create_future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._num_pending_adds += 1
        try:
            self._commands.put(("add", request_id, prompt, params, arrival, stream, accepted, lora_request))
            if self._dead is not None:  # died after our health check: nobody will answer the future
                raise EngineDeadError(f"engine is dead: {self._dead!r}")
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller went away while we waited; don't leave it running
            raise
        finally:
            self._num_pending_adds -= 1
        return stream

    async def generate(
        self, prompt, params: Optional[SamplingParams], request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; aborts it if the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def call_engine(self, fn):
        """Run ``fn(engine)`` on the engine thread between steps (e.g. loading a LoRA adapter) and return its
        result; its exception is raised here."""
        self.check_health()
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, done))
        return await done

    def abort(self, request_ids: str | list[str]) -> None:
        """Stop requests and free their KV blocks at the next step boundary. Safe from any thread."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        if request_ids:
            self._commands.put(("abort", list(request_ids)))

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain(block=idle):
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._stats = self.engine.get_stats()
                    self._dispatch(outputs)
        except BaseException as e:  # noqa: BLE001 - any failure must reach the waiting requests
            logger.exception("engine loop crashed; failing all requests")
            self._die(e)
            return
        self._shutdown_streams()

    def _drain(self, block: bool) -> bool:
        """Run queued commands; blocks for the first one when idle. Returns False on stop."""
        first = True
        while True:
            try:
                cmd = self._commands.get(block=block and first)
            except queue.Empty:
                break
            first = False
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._do_add(*cmd[1:])
            elif kind == "abort":
                self._dispatch(self.engine.abort_request(cmd[1]))
            elif kind == "call":
                self._do_call(*cmd[1:])
        self._stats = self.engine.get_stats()
        return True

    def _do_call(self, fn, done: asyncio.Future) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as e:  # noqa: BLE001 - the caller gets it; the engine carries on
            result, error = None, e
        _call_soon(done.get_loop(), _settle, done, result, error)

    def _do_add(
        self, request_id, prompt, params, arrival, stream: RequestStream, accepted: asyncio.Future, lora_request=None
    ) -> None:
        if request_id in self._streams:
            error: Optional[BaseException] = ValueError(f"request_id {request_id!r} is already in use")
        else:
            try:
                lora_kw = {"lora_request": lora_request} if lora_request is not None else {}
                self.engine.add_request(request_id, prompt, params, arrival_time=arrival, **lora_kw)
                error = None
            except ValueError as e:
                error = e
        if error is None:
            n = params.n if params is not None else 1
            self._streams[request_id] = stream
            self._timings[request_id] = _Timing(arrival, [0] * n, [arrival] * n)
        _call_soon(stream.loop, _resolve, accepted, error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Observe and hand outputs to their streams: one loop callback per loop per step."""
        if not outputs:
            return
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            self._observe(out, now)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in batches.items():
            _call_soon(loop, _deliver, batch)

    def _observe(self, out: RequestOutput, now: float) -> None:
        timing = self._timings.get(out.request_id)
        if timing is None:
            return
        if getattr(out, "is_pooling", False):  # an embedding: no tokens to count, finished in one step
            self._timings.pop(out.request_id, None)
            return
        try:
            for i, comp in enumerate(out.outputs[: len(timing.num_tokens)]):
                new = len(comp.token_ids) - timing.num_tokens[i]
                if new <= 0:
                    continue
                if not timing.first_token_seen:
                    timing.first_token_seen = True
                    self.observer.on_first_token(now - timing.arrival, len(out.prompt_token_ids))
                first_of_sample = timing.num_tokens[i] == 0
                gap = None if first_of_sample else (now - timing.last_time[i]) / new
                self.observer.on_new_tokens(new, gap)
                timing.num_tokens[i] += new
                timing.last_time[i] = now
            if out.finished:
                self._timings.pop(out.request_id, None)
                self.observer.on_finished(now - timing.arrival, out)
        except Exception:  # noqa: BLE001 - metrics must never take the engine down
            logger.exception("engine observer failed")

    def _die(self, error: BaseException) -> None:
        self._dead = error
        dead = EngineDeadError(f"engine crashed: {error!r}")
        for stream in self._streams.values():
            _call_soon(stream.loop, stream._put, dead)
        self._streams.clear()
        self._fail_queued_adds(dead)

    def _shutdown_streams(self) -> None:
        """On stop: abort what is still running, so that its streams end (finish_reason "abort")."""
        self._dead = EngineDeadError("engine was shut down")
        if self._streams:
            try:
                self._dispatch(self.engine.abort_request(list(self._streams)))
            except Exception:  # noqa: BLE001
                logger.exception("abort on shutdown failed")
        for stream in self._streams.values():  # anything the abort did not end
            _call_soon(stream.loop, stream._put, self._dead)
        self._streams.clear()
        self._fail_queued_adds(self._dead)

    def _fail_queued_adds(self, error: BaseException) -> None:
        """Fail adds queued before ``_dead`` was set; later ones see ``_dead`` themselves (add_request)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                stream, accepted = cmd[5], cmd[6]
                _call_soon(stream.loop, _resolve, accepted, error)


def _resolve(future: asyncio.Future, error: Optional[BaseException]) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in batch:
        stream._put(out)


def _settle(future: asyncio.Future, result, error: Optional[BaseException]) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass
